"""Lookahead decoding (methods.drafters.lookahead): the tree is the paper's 2D-window mask, the Jacobi branch
alone fills the pool with n-grams that get accepted, the pool is bounded, and the method is lossless at
T > 0 with the deterministic rule (chi-square on the real engine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_statistical import N_SAMPLES, N_TOKENS, PROMPT, chi2_pvalue, exact_marginals

from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.drafters.autoregressive import Autoregressive
from methods.drafters.lookahead import Lookahead, LookaheadParams, NgramPool
from methods.drafters.registry import build_drafter
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree

GREEDY = SamplingParams(temperature=0.0)


def method(verifier: Verifier = Verifier.greedy, **params) -> MethodConfig:
    lp = LookaheadParams(**params)
    return MethodConfig(name="lookahead", drafter="lookahead", verifier=verifier, params=params,
                        verify_extra_tokens=lp.extra_verify_tokens)


def papers_mask(window: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference implementation's lookahead mask and positions, written from its description: inputs
    [root, level 0 (W-1 tokens), level 1 (W), …]; block 0 (root + level 0) is causal; level l >= 1, index i
    sees block-0 columns 0..i and index i of levels 1..l; positions: block-0 column j at j, level l index i
    at i + l."""
    size = window * levels
    mask = np.zeros((size, size), dtype=bool)
    pos = np.zeros(size, dtype=np.int64)
    for j in range(window):
        mask[j, : j + 1] = True
        pos[j] = j
    for lv in range(1, levels):
        for i in range(window):
            row = lv * window + i
            mask[row, : i + 1] = True
            mask[row, [r * window + i for r in range(1, lv + 1)]] = True
            pos[row] = lv + i
    return mask, pos


@pytest.mark.parametrize("level,window", [(3, 2), (5, 7), (4, 15)])
def test_lookahead_branch_is_the_papers_mask(level, window):
    drafter = Lookahead(LookaheadParams(level=level, window=window, guess_set=1))
    drafter.levels = [list(range(100, 100 + window - 1))] + [
        list(range(200 * lv, 200 * lv + window)) for lv in range(1, level - 1)]
    parents, tokens = [-1], [7]
    drafter._lookahead_branch(parents, tokens, 7)
    tree = Tree.from_parents(parents)
    mask, pos = papers_mask(window, level - 1)
    assert tree.size == 1 + LookaheadParams(level, window, 1).branch_tokens
    assert (tree.ancestor_mask == mask).all()
    assert (tree.depths == pos).all()
    assert drafter._step.out_nodes == list(range(tree.size - window, tree.size))  # the last level's nodes


def test_the_pool_is_bounded_and_least_recently_used_goes_first():
    pool = NgramPool(2)
    for gram in [(1, 2), (3, 4), (1, 2), (5, 6)]:
        pool.add(9, gram)
    assert pool.candidates(9) == [(5, 6), (1, 2)]  # (3, 4) was the least recently used
    assert pool.candidates(8) == []


def test_jacobi_branch_alone_finds_accepted_ngrams(tiny_models):
    """Without the prompt's n-grams the pool holds only Jacobi n-grams; they are accepted, the output is the
    target's greedy one, and every forward carries the lookahead branch."""
    engine = ModelEngine(tiny_models.target)
    opts = DecodeOptions(Verifier.greedy, GREEDY, 48)
    prompt = torch.tensor([5, 17, 99, 4, 61, 33, 2])
    ref = decode(engine, Autoregressive(), prompt, opts, torch.Generator().manual_seed(0))
    drafter = build_drafter(method(level=4, window=5, guess_set=3, pool_from_prompt=False), None,
                            tiny_models, GREEDY)
    res = decode(engine, drafter, prompt, opts, torch.Generator().manual_seed(0))
    assert res.token_ids == ref.token_ids
    assert max(res.accepted_lengths) > 1
    assert drafter.forward_tokens >= drafter.steps * (1 + LookaheadParams(4, 5, 3).branch_tokens) - 5 * 3


def test_verify_extra_tokens_must_match_the_window(tiny_models):
    params = {"level": 5, "window": 7, "guess_set": 7}
    bad = MethodConfig(name="lookahead", drafter="lookahead", params=params, verify_extra_tokens=3)
    with pytest.raises(ValueError, match="verify_extra_tokens=51"):
        build_drafter(bad, None, tiny_models, GREEDY)
    with pytest.raises(ValueError, match="unknown lookahead keys"):
        build_drafter(MethodConfig(drafter="lookahead", params={"windw": 3}), None, tiny_models, GREEDY)


@pytest.mark.slow
def test_lossless_at_temperature_one_with_the_deterministic_rule(small_vocab_models):
    sampling = SamplingParams(temperature=1.0)
    drafter = build_drafter(method(Verifier.deterministic, level=3, window=3, guess_set=3), None,
                            small_vocab_models, sampling)
    engine = ModelEngine(small_vocab_models.target)
    g = torch.Generator().manual_seed(4321)
    opts = DecodeOptions(Verifier.deterministic, sampling, N_TOKENS)
    rows = [decode(engine, drafter, PROMPT, opts, g) for _ in range(N_SAMPLES)]
    assert max(max(r.accepted_lengths) for r in rows) > 1  # drafts were accepted: the test tests something
    tokens = np.asarray([r.token_ids for r in rows])
    for i, law in enumerate(exact_marginals(small_vocab_models.target, sampling)):
        assert chi2_pvalue(tokens[:, i], law) > 1e-4, f"token {i + 1} does not follow the target"
