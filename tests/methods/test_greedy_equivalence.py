"""Greedy equivalence (issue 3): every registered drafter, with every verifier that applies, emits exactly
the target's greedy autoregressive tokens at temperature 0 (fp32) — over prompts, lengths, max_new_tokens
boundaries inside an accepted block, and EOS inside an accepted block. Parametrized over
methods.drafters.registry, so a new method is covered by adding its registry line (and, if it needs any, its
test params below)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.drafters.autoregressive import Autoregressive
from methods.drafters.registry import build_drafter, names
from methods.models import Models
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree

REPO = Path(__file__).resolve().parents[2]

GREEDY = SamplingParams(temperature=0.0)
TREES = {
    "chain3": Tree.chain(3),
    "kary2x2": Tree.kary(2, 2),
    "irregular": Tree.from_parents([-1, 0, 0, 0, 1, 1, 2, 4, 4, 7]),
}
# drafters that fill arbitrary trees; of those, the ones returning q rows at temperature 0 too (the sampling
# verifiers apply); every drafter gets the verifiers for deterministic drafts
TREE_DRAFTERS = {"draft_model", "medusa", "specinfer", "online", "eagle", "eagle3", "mtp"}
_SAMPLED = [Verifier.chain, Verifier.specinfer, Verifier.sequoia]
Q_DRAFTERS = {"draft_model": _SAMPLED, "online": _SAMPLED, "specinfer": [Verifier.specinfer]}
TEST_PARAMS = {
    "medusa": {"heads": "random", "num_heads": 4},
    "lookahead": {"level": 4, "window": 3, "guess_set": 3},  # small: every warm-up/full-window path runs
    "staged": {"stage2": "ngram", "stage2_gamma": 3, "order": 1},
    "specinfer": {"source": "copies", "drafts": 3},  # the draft and two perturbed copies, merged
    "online": {"update_every": 2, "steps": 1},  # learns between the test's decodes: must stay lossless
    "layerskip": {"exit_layer": 1},
    "mtp": {"modules": "random", "num_heads": 3},
    "draft_verify": {"skip": "config", "skip_attn": [1], "skip_mlp": [0], "exit_threshold": 0.2},
    "eagle": {"head": "random"},  # untrained heads: fast; drafts mostly rejected (test_eagle.py accepts)
    "eagle3": {"head": "random", "feature_layers": [0, 1]},
}
METHOD_FIELDS = {"lookahead": {"verify_extra_tokens": 2 + 2 * 3 + 2 * 3}}  # (W-1) + (N-2)W + (G-1)(N-1)
MULTI_TOKEN = {"draft_model", "prompt_lookup", "lookahead"}  # must produce multi-token blocks in the EOS test
DRAFT_MODEL = {"draft_model", "staged"}  # use the self-draft (the target as q) in the EOS test
LENGTHS = (1, 6, 24)  # every boundary inside a block: test_max_new_tokens_cuts_a_fully_accepted_block


def cases() -> list[tuple[str, str, Verifier]]:
    out = []
    for name in names():
        trees = TREES if name in TREE_DRAFTERS else {"chain3": TREES["chain3"]}
        verifiers = [Verifier.greedy, Verifier.deterministic]
        verifiers += Q_DRAFTERS.get(name, [])
        for tree_name, tree in trees.items():
            for v in verifiers:
                if v != Verifier.chain or tree.width <= 1:
                    out.append((name, tree_name, v))
    return out


def method(name: str, verifier: Verifier) -> MethodConfig:
    return MethodConfig(name=name, drafter=name, verifier=verifier, params=dict(TEST_PARAMS.get(name, {})),
                        **METHOD_FIELDS.get(name, {}))


def prompts() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    motif = torch.randint(0, 256, (6,), generator=g)
    return {
        "one_token": torch.tensor([65]),
        "random": torch.randint(0, 256, (21,), generator=g),
        "repetitive": torch.cat([motif, motif, motif[:4], motif]),
    }


@pytest.fixture(scope="module")
def reference(tiny_models) -> dict[str, list[int]]:
    """Greedy autoregressive continuation of every prompt (max(LENGTHS) tokens)."""
    engine = ModelEngine(tiny_models.target)
    opts = DecodeOptions(Verifier.greedy, GREEDY, max(LENGTHS))
    g = torch.Generator().manual_seed(0)
    return {k: decode(engine, Autoregressive(), p, opts, g).token_ids for k, p in prompts().items()}


@pytest.fixture(scope="module")
def self_draft(tiny_models) -> Models:
    """The target as its own draft: every draft is accepted, blocks are as long as the tree is deep."""
    m = tiny_models
    return Models(m.target, m.target, m.tokenizer, m.device, m.dtype)


@pytest.mark.parametrize("name,tree_name,verifier", cases())
def test_greedy_equals_autoregressive(tiny_models, reference, name, tree_name, verifier):
    drafter = build_drafter(method(name, verifier), TREES[tree_name], tiny_models, GREEDY)
    engine = ModelEngine(tiny_models.target)
    g = torch.Generator().manual_seed(1)
    for key, prompt in prompts().items():
        for n in LENGTHS:
            res = decode(engine, drafter, prompt, DecodeOptions(verifier, GREEDY, n), g)
            assert res.token_ids == reference[key][:n], (key, n, res.accepted_lengths)
            assert res.n_target_forwards == len(res.accepted_lengths) <= n
            assert res.stop == "length"


def inside_first_occurrences(tokens: list[int], accepted_lengths: list[int]) -> list[int]:
    """Positions j that are not the last of their step's block and whose token first occurs at j."""
    inside, start = [], 0
    for length in accepted_lengths:
        inside += [j for j in range(start, start + length - 1) if tokens[j] not in tokens[:j]]
        start += length
    return inside


@pytest.mark.parametrize("name", names())
def test_eos_inside_an_accepted_block(tiny_models, self_draft, name):
    """EOS = a token first emitted inside a multi-token block: decoding stops right after it. Prompts are the
    "random" prompt extended by k tokens of its own greedy continuation (same continuation, shifted), so
    that repeats in it give n-gram drafts something to copy."""
    models = self_draft if name in DRAFT_MODEL else tiny_models
    drafter = build_drafter(method(name, Verifier.greedy), TREES["chain3"], models, GREEDY)
    engine = ModelEngine(tiny_models.target)
    g = torch.Generator().manual_seed(2)
    n = 16
    base = prompts()["random"]
    cont = decode(engine, Autoregressive(), base, DecodeOptions(max_new_tokens=64), g).token_ids
    for k in range(0, 48, 2) if name in MULTI_TOKEN else range(0, 8, 2):
        prompt = torch.cat([base, torch.tensor(cont[:k], dtype=torch.long)])
        free = decode(engine, drafter, prompt, DecodeOptions(Verifier.greedy, GREEDY, n), g)
        assert free.token_ids == cont[k : k + n]
        inside = inside_first_occurrences(free.token_ids, free.accepted_lengths)
        if inside:
            break
    if name in MULTI_TOKEN:
        assert inside
    ref = free.token_ids
    firsts = [j for j in range(n) if ref[j] not in ref[:j]]
    for j in (inside or firsts)[:3]:
        opts = DecodeOptions(Verifier.greedy, GREEDY, n, eos_token_id=ref[j])
        res = decode(engine, drafter, prompt, opts, g)
        assert res.token_ids == ref[: j + 1] and res.stop == "eos", (j, res.token_ids)


@pytest.mark.parametrize("tree_name", list(TREES))
def test_max_new_tokens_cuts_a_fully_accepted_block(self_draft, reference, tree_name):
    """Every draft accepted (the target drafts for itself): lengths that end mid-block are cut exactly."""
    tree = TREES[tree_name]
    drafter = build_drafter(method("draft_model", Verifier.greedy), tree, self_draft, GREEDY)
    engine = ModelEngine(self_draft.target)
    g = torch.Generator().manual_seed(3)
    for n in range(1, 2 * (tree.depth + 1) + 2):
        res = decode(engine, drafter, prompts()["random"], DecodeOptions(Verifier.greedy, GREEDY, n), g)
        assert res.token_ids == reference["random"][:n]
        full = [tree.depth + 1] * (len(res.accepted_lengths) - 1)
        assert res.accepted_lengths[:-1] == full  # everything accepted before the last step


def test_unknown_drafter_lists_the_registered_ones(tiny_models):
    with pytest.raises(KeyError, match="registered: .*draft_model"):
        build_drafter(MethodConfig(drafter="no_such_drafter"), None, tiny_models, GREEDY)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", names())
def test_greedy_equals_autoregressive_on_cuda(tiny_models, name):
    """The same loop on a CUDA device (fp32): drafts, caches, masks and generators all live there."""
    import copy

    m = tiny_models
    target, draft = copy.deepcopy(m.target).cuda(), copy.deepcopy(m.draft).cuda()
    models = Models(target, draft, m.tokenizer, torch.device("cuda"), m.dtype)
    tree = TREES["kary2x2" if name in TREE_DRAFTERS else "chain3"]
    drafter = build_drafter(method(name, Verifier.greedy), tree, models, GREEDY)
    engine = ModelEngine(target)
    g = torch.Generator(device="cuda").manual_seed(0)
    opts = DecodeOptions(Verifier.greedy, GREEDY, max(LENGTHS))
    for prompt in prompts().values():
        ref = decode(engine, Autoregressive(), prompt, opts, g)
        assert decode(engine, drafter, prompt, opts, g).token_ids == ref.token_ids


# drafters that always fill their tree as deep as the room lets (the others may stop short: no n-gram match,
# an adaptive exit, Lookahead's pool)
FULL_DEPTH = {"draft_model", "medusa", "specinfer", "online", "layerskip", "mtp", "eagle", "eagle3", "staged"}


def preset_spares(drafter: str) -> set[int]:
    """method.room_spare of every conf/method preset whose drafter is ``drafter`` (or whose parent's is)."""
    presets = {p.stem: OmegaConf.load(p) for p in (REPO / "conf" / "method").glob("*.yaml")}

    def field(name: str, key: str):
        own = presets[name].get(key)
        parents = [d for d in presets[name].get("defaults", []) if isinstance(d, str) and d in presets]
        return own if own is not None or not parents else field(parents[0], key)

    return {int(field(n, "room_spare") or 0) for n in presets if field(n, "drafter") == drafter}


@pytest.mark.parametrize("name", names())
def test_each_drafter_drafts_the_room_its_cut_steps_are_priced_at(tiny_models, self_draft, name):
    """The prediction prices a generation's last steps as drafting min(D, room − spare) levels
    (specsim.run_steps; spare = the presets' method.room_spare: 1 where the room's last token is left to the
    bonus token, EAGLE / Medusa / MTP): every drafter drafts no deeper, and those that fill their tree draft
    exactly that deep. Every preset of the drafter declares the same spare."""
    spares = preset_spares(name)
    assert len(spares) == 1, f"the presets of drafter {name} declare method.room_spare {spares}"
    spare = spares.pop()
    models = self_draft if name in DRAFT_MODEL else tiny_models
    drafter = build_drafter(method(name, Verifier.greedy), TREES["chain3"], models, GREEDY)
    seen: list[tuple[int, int]] = []
    propose = drafter.propose

    def recording(ctx):
        draft = propose(ctx)
        seen.append((ctx.max_new, draft.tree.depth))
        return draft

    drafter.propose = recording
    engine, g = ModelEngine(tiny_models.target), torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 5):
        decode(engine, drafter, prompts()["repetitive"], DecodeOptions(Verifier.greedy, GREEDY, n), g)
    assert seen and all(depth <= max(0, room - spare) for room, depth in seen), seen
    if name in FULL_DEPTH:
        later = [(room, depth) for room, depth in seen if room < 3]
        assert later and all(depth == max(0, room - spare) for room, depth in later), seen
