"""Staged speculative decoding (methods.drafters.staged): the second stage changes how many draft forwards
the spine takes, never the draft itself; lossless at T > 0 with the deterministic rule (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_statistical import N_SAMPLES, N_TOKENS, PROMPT, chi2_pvalue, exact_marginals

from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.drafters.registry import build_drafter
from methods.drafters.staged import OwnNgrams, spine_tree
from specsim.config import MethodConfig, Verifier

GREEDY = SamplingParams(temperature=0.0)


def method(verifier: Verifier = Verifier.greedy, **params) -> MethodConfig:
    return MethodConfig(name="staged", drafter="staged", verifier=verifier, params=params)


def test_spine_tree_layout():
    tree = spine_tree(3, 2)
    assert tree.parents == (-1, 0, 1, 2, 0, 1, 2) and tree.ranks == (0, 0, 0, 0, 1, 1, 1)
    assert tree.children[0] == (1, 4) and tree.depths.tolist() == [0, 1, 2, 3, 1, 2, 3]
    assert spine_tree(2, 3).parents == (-1, 0, 1, 0, 0, 1, 1)  # k = 3: two leaves per depth
    assert spine_tree(2, 1).parents == (-1, 0, 1)  # k = 1: a chain


def test_own_ngrams_back_off_to_the_longest_context_seen():
    own = OwnNgrams(2)
    own.learn([1, 2, 3], 9)  # keys (2, 3) and (3,)
    own.learn([5, 3], 8)  # (5, 3), and (3,) again: the latest wins
    assert own.guess([2, 3], 1) == [9]  # the 2-token key beats the newer 1-token one
    assert own.guess([7, 3], 1) == [8]  # an unseen 2-token key backs off to (3,)
    own.learn([3, 9], 4)
    assert own.guess([1, 2, 3], 5) == [9, 4]  # chained: (2, 3) -> 9, (3, 9) -> 4, then nothing for (9, 4)
    assert own.guess([6], 2) == [] and own.guess([], 2) == []


class Recorder:
    """Wraps a drafter, keeping every proposed draft's tokens."""

    def __init__(self, inner):
        self.inner, self.drafts = inner, []
        self.needs_hidden_states = False

    def reset(self, prompt):
        self.inner.reset(prompt)

    def propose(self, ctx):
        draft = self.inner.propose(ctx)
        self.drafts.append(draft.tokens.tolist())
        return draft

    def feedback(self, fb):
        self.inner.feedback(fb)


@pytest.mark.parametrize("stage2", ["ngram", "prompt_lookup"])
def test_second_stage_saves_draft_forwards_and_keeps_the_draft(tiny_models, stage2):
    """Same drafts, same steps as without the second stage (q's greedy spine is q's whatever proposed
    it); the plain spine costs exactly D forwards per step, the staged one fewer."""
    depth, engine = 5, ModelEngine(tiny_models.target)
    opts = DecodeOptions(Verifier.greedy, GREEDY, 40)
    motif = torch.tensor([5, 17, 99, 4, 61, 33])
    prompt = torch.cat([motif, motif, motif])  # something for prompt lookup to copy
    runs = {}
    for name in ("none", stage2):
        drafter = build_drafter(method(depth=depth, stage2=name, order=2), None, tiny_models, GREEDY)
        rec = Recorder(drafter)
        for _ in range(2):  # the second pass finds q's own n-grams learnt
            res = decode(engine, rec, prompt, opts, torch.Generator().manual_seed(0))
        runs[name] = (drafter, rec, res)
    (plain, rec0, res0), (staged, rec1, res1) = runs["none"], runs[stage2]
    assert res0.token_ids == res1.token_ids and res0.accepted_lengths == res1.accepted_lengths
    assert rec0.drafts == rec1.drafts
    assert max(len(d) for d in rec0.drafts) == 1 + 2 * depth  # near the end the spine is cut shorter
    assert plain.forwards_per_step <= depth and plain.forwards_per_step > depth - 1
    assert staged.forwards_per_step < plain.forwards_per_step


def test_draft_lm_head_runs_on_the_rows_it_reads(tiny_models):
    """The catch-up forward over a whole prompt (q's cache starts empty) asks q's LM head for the spine
    node's row and the guesses' only, not one row per prompt token; the draft is the same."""
    depth, gamma = 3, 2
    drafter = build_drafter(method(depth=depth, stage2="ngram", stage2_gamma=gamma, order=2), None,
                            tiny_models, GREEDY)
    fast = drafter.engine.fast
    rows, logits = [], fast.logits
    fast.logits = lambda h: rows.append(h.shape[0]) or logits(h)
    prompt = torch.arange(3, 43)
    res = decode(ModelEngine(tiny_models.target), drafter, prompt, DecodeOptions(Verifier.greedy, GREEDY, 12),
                 torch.Generator().manual_seed(0))
    assert rows and max(rows) <= 1 + gamma  # the first catch-up fed 40 tokens
    fast.logits = logits
    again = build_drafter(method(depth=depth, stage2="ngram", stage2_gamma=gamma, order=2), None,
                          tiny_models, GREEDY)
    assert decode(ModelEngine(tiny_models.target), again, prompt, DecodeOptions(Verifier.greedy, GREEDY, 12),
                  torch.Generator().manual_seed(0)).token_ids == res.token_ids


def test_config_errors(tiny_models):
    with pytest.raises(ValueError, match="stage2"):
        build_drafter(method(stage2="katz"), None, tiny_models, GREEDY)
    with pytest.raises(ValueError, match="deterministic"):
        build_drafter(method(Verifier.specinfer), None, tiny_models, GREEDY)


@pytest.mark.slow
def test_lossless_at_temperature_one_with_the_deterministic_rule(small_vocab_models):
    sampling = SamplingParams(temperature=1.0)
    cfg = method(Verifier.deterministic, depth=3, order=1)
    drafter = build_drafter(cfg, None, small_vocab_models, sampling)
    engine = ModelEngine(small_vocab_models.target)
    g = torch.Generator().manual_seed(4321)
    opts = DecodeOptions(Verifier.deterministic, sampling, N_TOKENS)
    rows = [decode(engine, drafter, PROMPT, opts, g) for _ in range(N_SAMPLES)]
    assert max(max(r.accepted_lengths) for r in rows) > 1
    tokens = np.asarray([r.token_ids for r in rows])
    for i, law in enumerate(exact_marginals(small_vocab_models.target, sampling)):
        assert chi2_pvalue(tokens[:, i], law) > 1e-4, f"token {i + 1} does not follow the target"
