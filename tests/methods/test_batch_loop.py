"""The batched decode loop (issue 16): every row's greedy output is token-identical to decoding its prompt
alone (fp32), with ragged prompts, rows finishing at different times (EOS) and continuous batching; the
sampling verifiers stay lossless per row (chi-square on the rows of batches); drafters without a batched
form are batched per row."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from methods.core.batch_drafter import PerRow, batched
from methods.core.batch_engine import BatchEngine
from methods.core.batch_loop import decode_batch, row_generator
from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.drafters.registry import BATCHABLE, build_drafter, names
from specsim.config import MethodConfig, TreeConfig, TreeKind, Verifier
from specsim.tree import Tree
from tests.methods.test_statistical import N_TOKENS, PROMPT, T1, chi2_pvalue, exact_marginals

GREEDY = SamplingParams(temperature=0.0)
MAX_NEW = 18
CASES = {  # (drafter, tree, params)
    "autoregressive": ("autoregressive", None, {}),
    "vanilla_chain": ("draft_model", Tree.chain(3), {}),
    "vanilla_tree": ("draft_model", Tree.from_parents([-1, 0, 0, 0, 1, 1, 2, 4, 4, 7]), {}),
    "prompt_lookup": ("prompt_lookup", Tree.chain(3), {}),
    "medusa": ("medusa", Tree.kary(2, 2), {"heads": "random", "num_heads": 4}),
    # random modules: a wide first level gets drafts accepted (the identity is not trivial); a window of 8
    # puts short prompts' rows in groups of their own for the first steps (ragged windows)
    "mtp": ("mtp", Tree.from_parents([-1] + [0] * 48 + [1, 1, 2, 49]), {"modules": "random", "window": 8}),
    "eagle": ("eagle", Tree.from_parents([-1] + [0] * 40 + [1, 1, 2, 42, 42, 45]), {"head": "random"}),
    "eagle_dynamic": ("eagle", None, {"head": "random"}),  # EAGLE-2: batched, frontiers per row (TREE_CFG)
    # EAGLE-3: features of layers 0 and 1 (the last: after the final norm) from the batched target forward
    "eagle3": ("eagle3", Tree.from_parents([-1] + [0] * 40 + [1, 1, 2, 42, 42, 45]),
               {"head": "random", "feature_layers": [0, 1]}),
    "eagle3_dynamic": ("eagle3", None, {"head": "random", "feature_layers": [0, 1]}),
    "lookahead_per_row": ("lookahead", Tree.chain(3), {"level": 4, "window": 3, "guess_set": 3}),
    "specinfer_per_row": ("specinfer", Tree.kary(2, 2), {"source": "copies", "drafts": 3}),
    "staged_per_row": ("staged", Tree.chain(3), {"stage2": "ngram", "stage2_gamma": 3, "order": 1}),
}
# EAGLE-2's dynamic trees: narrow and deep for the EAGLE-1 head (each row's frontier hangs under parents of
# its own: row-mixing fails test_rows_draft_as_alone), wide for the EAGLE-3 head (its random drafts get
# accepted)
TREE_CFG = {
    "eagle_dynamic": TreeConfig(name="dynamic", kind=TreeKind.dynamic, total_tokens=12, depth=5, top_k=2),
    "eagle3_dynamic": TreeConfig(name="dynamic", kind=TreeKind.dynamic, total_tokens=40, depth=3, top_k=20),
}
FIELDS = {"lookahead": {"verify_extra_tokens": 2 + 2 * 3 + 2 * 3}}  # as test_greedy_equivalence


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(0, 256, (5,), generator=g)
    ragged = [torch.randint(0, 300, (n,), generator=g) for n in (6, 1, 17, 3, 9)]
    return ragged + [torch.cat([motif, motif, motif[:3]])]


def _method(name: str, verifier: Verifier = Verifier.greedy) -> tuple[MethodConfig, Tree | None]:
    drafter, tree, params = CASES[name]
    fields = FIELDS.get(drafter, {})
    return MethodConfig(name=name, drafter=drafter, verifier=verifier, params=dict(params), **fields), tree


@pytest.fixture(scope="module")
def alone(tiny_models) -> dict[str, list[list[int]]]:
    """Greedy AR of each prompt alone, and an EOS that ends some rows early (at different steps)."""
    drafter = build_drafter(MethodConfig(name="ar", drafter="autoregressive"), None, tiny_models, GREEDY)
    opts = DecodeOptions(Verifier.greedy, GREEDY, MAX_NEW)
    refs = [decode(ModelEngine(tiny_models.target), drafter, p, opts, torch.Generator()).token_ids
            for p in _prompts()]
    counts = np.bincount(np.concatenate(refs), minlength=320)
    eos = int(np.argmax(counts))  # the most frequent token: several rows stop at it, at different positions
    return {"eos": eos, "refs": [_cut(r, eos) for r in refs]}


def _cut(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("continuous", [False, True], ids=["static", "continuous"])
@pytest.mark.parametrize("case", list(CASES))
def test_rows_equal_prompts_decoded_alone(tiny_models, alone, case, continuous):
    method, tree = _method(case)
    cfg = TREE_CFG.get(case)
    drafter = build_drafter(method, tree, tiny_models, GREEDY, cfg)
    rows = batched(drafter, 3, lambda: build_drafter(method, tree, tiny_models, GREEDY, cfg))
    assert isinstance(rows, PerRow) == case.endswith("per_row")
    opts = DecodeOptions(Verifier.greedy, GREEDY, MAX_NEW, eos_token_id=alone["eos"])
    out = decode_batch(BatchEngine(tiny_models.target, 3), rows, _prompts(), opts, torch.Generator(),
                       continuous=continuous)
    got = [r.token_ids for r in out.results]
    assert got == alone["refs"]
    lengths = {len(r) for r in got}
    assert len(lengths) > 1, "rows must finish at different times"
    assert [r.stop for r in out.results] == ["eos" if len(r) < MAX_NEW else "length" for r in got]
    if case not in ("autoregressive", "lookahead_per_row"):
        assert out.stats.tau > 1.0, "drafts must be accepted in a batch (else identity is trivial)"
    assert out.row_steps == sum(r.n_target_forwards for r in out.results)
    # CPU times: the drafter's and the target forward's are disjoint parts of the steps'
    assert out.cpu_forward_s > 0 and out.cpu_draft_s > 0
    assert out.cpu_forward_s + out.cpu_draft_s <= out.cpu_steps_s + 1e-9


class _Checked:
    """A batched drafter checked against one-sequence drafters on the same contexts: each row's proposal
    (tree and tokens) must be theirs, every step (``compared``: rows compared whose draft is ≥ 2 deep). Each
    reference drafter draws from a generator of its own, seeded as the loop seeds a joining row's from
    ``seeds`` (a copy of the run's generator, in the same state): that is decoding its prompt alone, whatever
    rows decode beside it and however much they draw (Lookahead's initial window)."""

    def __init__(self, form, reference: PerRow, seeds: torch.Generator) -> None:
        self.form, self.ref, self.seeds = form, reference, seeds
        self.needs_hidden_states = form.needs_hidden_states
        self.feature_layers = getattr(form, "feature_layers", ())
        self.compared = 0
        self.generators: list[torch.Generator] = []  # the reference rows' own, slot order

    def join(self, prompts):
        self.form.join(prompts)
        self.ref.join(prompts)
        self.generators += [row_generator(self.seeds) for _ in prompts]

    def leave(self, slot):
        self.form.leave(slot)
        self.ref.leave(slot)
        last = self.generators.pop()
        if slot < len(self.generators):
            self.generators[slot] = last

    def propose_batch(self, ctx):
        alone = [replace(c, generator=g) for c, g in zip(ctx.rows, self.generators)]
        got, want = self.form.propose_batch(ctx), self.ref.propose_batch(replace(ctx, rows=alone))
        for b in range(len(ctx.rows)):
            g, w = got.row(b), want.row(b)
            assert g.tree.parents == w.tree.parents and g.tokens.tolist() == w.tokens.tolist(), b
            self.compared += w.tree.depth >= 2
        return got

    def feedback_batch(self, fb):
        self.form.feedback_batch(fb)
        self.ref.feedback_batch(fb)


@pytest.mark.parametrize("case", [c for c in CASES if c != "autoregressive"])
def test_rows_draft_as_alone(tiny_models, alone, case):
    """A batched drafter proposes, for every row and step, the one-sequence drafter's draft of that row's
    context (the outputs above are the target's whatever the drafts: this checks the drafter itself, its
    caches, positions and masks per row, at every depth; per-row drafters that draw, Lookahead's initial
    window: the row's own generator)."""
    method, tree = _method(case)
    cfg = TREE_CFG.get(case)
    opts = DecodeOptions(Verifier.greedy, GREEDY, MAX_NEW, eos_token_id=alone["eos"])
    make = lambda: build_drafter(method, tree, tiny_models, GREEDY, cfg)  # noqa: E731
    run = torch.Generator().manual_seed(7)
    checked = _Checked(batched(make(), 3, make), PerRow(make(), make),
                       torch.Generator().set_state(run.get_state()))
    out = decode_batch(BatchEngine(tiny_models.target, 3), checked, _prompts(), opts, run, continuous=True)
    assert [r.token_ids for r in out.results] == alone["refs"]
    assert checked.compared >= 10


def test_hf_forward_and_verifier_deterministic(tiny_models, alone):
    """The HF fallback engine (no lean forward) on both sides, a tree verified per row (deterministic)."""
    method, tree = _method("vanilla_tree", Verifier.deterministic)
    drafter = build_drafter(method, tree, tiny_models, GREEDY)
    opts = DecodeOptions(Verifier.deterministic, GREEDY, MAX_NEW, eos_token_id=alone["eos"])
    target = BatchEngine(tiny_models.target, 4, fast=False)
    out = decode_batch(target, batched(drafter, 4), _prompts(), opts, torch.Generator(), continuous=True)
    assert [r.token_ids for r in out.results] == alone["refs"]


SAMPLED = {
    "ar": ("autoregressive", Verifier.greedy, None),
    "chain": ("draft_model", Verifier.chain, Tree.chain(2)),
    "specinfer_tree": ("draft_model", Verifier.specinfer, Tree.kary(2, 2)),
    "sequoia_tree": ("draft_model", Verifier.sequoia, Tree.from_parents([-1, 0, 0, 0, 1, 1, 2])),
    "mtp_chain": ("mtp", Verifier.chain, Tree.chain(3)),
    "eagle_specinfer_per_row": ("eagle", Verifier.specinfer, Tree.kary(2, 2)),  # sampled EAGLE: per row
    "eagle3_deterministic": ("eagle3", Verifier.deterministic, Tree.kary(2, 2)),  # top-k EAGLE-3: batched
}
SAMPLED_PARAMS = {"mtp": {"modules": "random", "window": 4}, "eagle": {"head": "random"},
                  "eagle3": {"head": "random", "feature_layers": [0]}}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SAMPLED))
def test_sampling_stays_lossless_per_row(small_vocab_models, case):
    """1500 rows (batches of 12, continuous) of the same prompt at temperature 1: the marginals of tokens
    1..3 match the target's exact law (chi-square), as for the one-sequence loop."""
    drafter_name, verifier, tree = SAMPLED[case]
    method = MethodConfig(name=case, drafter=drafter_name, verifier=verifier,
                          params=dict(SAMPLED_PARAMS.get(drafter_name, {})))
    drafter = build_drafter(method, tree, small_vocab_models, T1)
    opts = DecodeOptions(verifier, T1, N_TOKENS)
    g = torch.Generator().manual_seed(99)
    rows = batched(drafter, 12, lambda: build_drafter(method, tree, small_vocab_models, T1))
    assert isinstance(rows, PerRow) == case.endswith("per_row")
    out = decode_batch(BatchEngine(small_vocab_models.target, 12), rows, [PROMPT] * 1500,
                       opts, g, continuous=True)
    samples = np.asarray([r.token_ids for r in out.results])
    law = exact_marginals(small_vocab_models.target, T1)
    for i in range(N_TOKENS):
        assert chi2_pvalue(samples[:, i], law[i]) > 1e-4, f"token {i + 1} of {case} is off the target's law"


def test_batchable_declaration_covers_the_registry():
    """Every drafter is declared: batched natively, per row, or rejected with a reason; every drafter that
    batches is in CASES (the identity and draft-as-alone tests above), in the form it declares."""
    assert set(BATCHABLE) == set(names())
    for name, how in BATCHABLE.items():
        assert how in ("batched", "per_row") or how.startswith("no: "), (name, how)
        forms = {case.endswith("per_row") for case, (drafter, _, _) in CASES.items() if drafter == name}
        assert how.startswith("no: ") or (how == "per_row") in forms, f"{name} ({how}) has no case"


@pytest.mark.parametrize("method", ["autoregressive", "vanilla", "prompt_lookup", "medusa", "lookahead",
                                    "mtp", "eagle", "eagle2", "eagle3"])
def test_batchable_methods_pass_the_config_checks(run_module, run_config, method):
    """workload.batch_size > 1 on specsim's engine is accepted for every method whose drafter batches."""
    run_module.check_runnable(run_config(f"method={method}", "workload.batch_size=8", "model=random_tiny"))
