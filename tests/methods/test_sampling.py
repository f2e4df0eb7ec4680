"""methods.core.sampling: processed distributions (temperature, top-k, top-p) and the randomness primitive."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from methods.core.sampling import (
    Randomness,
    SamplingParams,
    TorchRandomness,
    as_randomness,
    draw,
    draw_without_replacement,
    inverse_cdf,
    probs,
    sample,
)

LOGIT = st.one_of(
    st.floats(-50, 50),
    st.sampled_from([float("-inf"), float("inf"), 1e38, -1e38, 3e38, 0.0]),
)
PARAMS = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(1e-30, 100)),
    top_k=st.integers(0, 6),
    top_p=st.floats(1e-6, 1.0),
)


@settings(max_examples=200, deadline=None)
@given(logits=st.lists(LOGIT, min_size=1, max_size=8), params=PARAMS, f64=st.booleans())
def test_probs_are_a_distribution_for_any_logits(logits, params, f64):
    x = torch.tensor(logits, dtype=torch.float64 if f64 else torch.float32)
    out = probs(x, params)
    assert out.dtype == (torch.float64 if f64 else torch.float32)
    assert torch.isfinite(out).all() and (out >= 0).all()
    assert abs(out.sum().item() - 1) < (1e-12 if f64 else 1e-5)
    assert out[x.argmax()] > 0, "the top token is always kept"


@settings(max_examples=100, deadline=None)
@given(
    logits=st.lists(st.floats(-5, 5), min_size=2, max_size=8),
    top_p=st.floats(0.01, 0.99),
    temperature=st.floats(0.2, 3),
)
def test_top_p_keeps_the_smallest_tie_closed_set_reaching_top_p(logits, top_p, temperature):
    x = torch.tensor(logits, dtype=torch.float64)
    full = probs(x, SamplingParams(temperature))
    out = probs(x, SamplingParams(temperature, top_p=top_p))
    kept = out > 0
    assert full[kept].sum() >= top_p - 1e-12
    # minimal up to ties: without the least likely kept value (all its ties) the mass is below top_p
    assert full[full > full[kept].min()].sum() < top_p + 1e-12
    # kept tokens are the most likely ones, and the kept probabilities are renormalised
    if (~kept).any():
        assert full[kept].min() >= full[~kept].max()
    assert torch.allclose(out[kept], full[kept] / full[kept].sum())


def test_top_p_on_a_large_vocabulary_matches_a_full_sort():
    """The CPU path grows a top-k until the nucleus fits: flat rows need the full vocabulary."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 3000, generator=g) * torch.tensor([[0.05], [1.0], [8.0]])  # flat, medium, peaked
    for top_p in (0.3, 0.9, 0.999):
        out = probs(x, SamplingParams(1.0, top_p=top_p))
        full = torch.softmax(x, -1)
        s = full.sort(-1, descending=True).values
        floor = torch.where(s.cumsum(-1) - s < top_p, s, torch.inf).amin(-1, keepdim=True)
        assert torch.equal(out > 0, full >= floor)
        assert torch.allclose(out.sum(-1), torch.ones(3))


def test_top_k_keeps_k_and_ties():
    x = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.3])
    out = probs(x, SamplingParams(1.0, top_k=2))
    assert (out > 0).tolist() == [False, True, False, True, False]
    assert torch.allclose(out[[1, 3]], torch.softmax(x[[1, 3]], 0))
    tied = probs(torch.tensor([1.0, 2.0, 2.0, 0.0]), SamplingParams(1.0, top_k=1))
    assert (tied > 0).tolist() == [False, True, True, False], "ties with the k-th are kept (as transformers)"


def test_temperature_matches_softmax_and_zero_is_argmax_lowest_tie():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, generator=g, dtype=torch.float64)
    for t in (0.3, 1.0, 4.0):
        assert torch.allclose(probs(x, SamplingParams(t)), torch.softmax(x / t, -1), atol=1e-12)
    greedy = probs(torch.tensor([[1.0, 3.0, 3.0], [5.0, 5.0, 5.0]]), SamplingParams(0.0))
    assert greedy.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_extreme_logits():
    x = torch.tensor([[float("inf"), 0.0, float("inf")], [float("-inf")] * 3, [3e38, -3e38, 3e38]])
    out = probs(x, SamplingParams(0.01, top_p=0.9))
    assert torch.isfinite(out).all()
    assert out[0].tolist() == [0.5, 0.0, 0.5] and out[2].tolist() == [0.5, 0.0, 0.5]
    assert torch.allclose(out[1], torch.full((3,), 1 / 3)), "an all -inf row becomes uniform, not NaN"


def test_dtypes_and_batch_shape():
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        assert probs(torch.zeros(2, 3, 5, dtype=dt), SamplingParams()).dtype == torch.float32
    assert probs(torch.zeros(2, 3, 5, dtype=torch.float64), SamplingParams(0.0)).shape == (2, 3, 5)


def test_sampling_params_validation():
    for bad in ({"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(0.0).greedy and not SamplingParams(0.7).greedy


# ---- randomness -------------------------------------------------------------------------------------
def test_inverse_cdf_maps_a_uniform_grid_onto_the_row():
    row = torch.tensor([0.25, 0.0, 0.5, 0.0, 0.25])
    n = 4000
    counts = torch.zeros(5)
    for i in range(n):
        counts[inverse_cdf(row, torch.tensor((i + 0.5) / n, dtype=torch.float64))] += 1
    assert torch.allclose(counts / n, row, atol=1 / n)
    # unnormalised rows, and a uniform that rounds to 1 in float32, still land on a token with mass
    assert inverse_cdf(row * 7, torch.tensor(0.0, dtype=torch.float64)) == 0
    assert inverse_cdf(row, torch.tensor(1 - 1e-12, dtype=torch.float64)) == 4
    assert inverse_cdf(torch.tensor([0.0, 1.0, 0.0]), torch.tensor(1 - 1e-12, dtype=torch.float64)) == 1


def test_first_success_outcomes_and_reproducibility():
    rng = TorchRandomness(torch.Generator().manual_seed(1))
    then = torch.eye(3)  # row i is one-hot at i: the drawn token tells which row was used
    assert rng.first_success(torch.tensor([0.0, 0.0]), then, (True,) * 3) == (2, 2)
    assert rng.first_success(torch.tensor([1.0, 1.0]), then, (True,) * 3) == (0, 0)
    assert rng.first_success(torch.tensor([0.0, 1.0]), then, (True, False, True)) == (1, -1)
    half = torch.tensor([0.5, 0.5])
    twice = [TorchRandomness(torch.Generator().manual_seed(5)).first_success(half, then, (True,) * 3)
             for _ in range(2)]
    assert twice[0] == twice[1]
    assert isinstance(rng, Randomness) and as_randomness(rng) is rng
    assert isinstance(as_randomness(torch.Generator()), TorchRandomness)


def test_first_success_frequencies():
    g = torch.Generator().manual_seed(2)
    rng = TorchRandomness(g)
    success, then, n = torch.tensor([0.3, 0.5]), torch.eye(3), 6000
    counts = [0, 0, 0]
    for _ in range(n):
        counts[rng.first_success(success, then, (True,) * 3)[0]] += 1
    for c, pr in zip(counts, (0.3, 0.35, 0.35)):
        assert abs(c / n - pr) < 5 * math.sqrt(pr * (1 - pr) / n)


def test_sample_frequencies():
    g = torch.Generator().manual_seed(3)
    row, n = torch.tensor([0.1, 0.0, 0.6, 0.3]), 6000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sample(row, g)] += 1
    assert counts[1] == 0
    sigma = torch.sqrt(row * (1 - row) / n)
    assert ((counts / n - row).abs() <= 5 * sigma + 1e-12).all()
    assert draw(g, torch.tensor([0.0, 0.0, 2.0])) == 2


@pytest.mark.parametrize(("success", "then"), [
    ([0.5], [[0.25, 0.75], [0.5, 0.5]]),
    ([0.25, 0.5], [[0.75, 0.25, 0.0], [0.0, 0.5, 0.5], [0.25, 0.25, 0.5]]),
])
def test_first_success_joint_law_is_exact_on_a_stratified_grid(monkeypatch, success, then):
    """The exact law of (i, token): P(i) · then[i] / Σ then[i], the token independent of the coins. The
    uniforms are fed from the midpoints of an N^(k+1) grid: with every probability a multiple of 1/N, the
    grid reproduces the law exactly — so drawing the token with a coin that decided i (correlated with the
    outcome) shows as a difference, not as noise."""
    N = 8
    success_t, then_t = torch.tensor(success), torch.tensor(then)
    k = len(success)
    grid = [(j + 0.5) / N for j in range(N)]
    feed = iter(itertools.product(grid, repeat=k + 1))
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.tensor(next(feed), dtype=torch.float64))
    rng = TorchRandomness(torch.Generator())
    law: dict[tuple[int, int], float] = {}
    for _ in range(N ** (k + 1)):
        out = rng.first_success(success_t, then_t, (True,) * (k + 1))
        law[out] = law.get(out, 0.0) + 1 / N ** (k + 1)
    exact, none_yet = {}, 1.0
    for i, row in enumerate(then):
        pr = none_yet * (success[i] if i < k else 1.0)
        none_yet *= 1 - success[i] if i < k else 0.0
        for tok, w in enumerate(row):
            if pr * w > 0:
                exact[(i, tok)] = pr * w / sum(row)
    assert law.keys() == exact.keys()
    assert all(law[o] == pytest.approx(exact[o], abs=1e-12) for o in exact), (law, exact)


def test_draw_without_replacement_has_the_sequential_law():
    """The ordered pair drawn from q without replacement: P(a, b) = q_a · q_b / (1 − q_a) (hand-computed for
    q = [0.5, 0.3, 0.2, 0]); three draws cover the support, the fourth is flagged as outside it."""
    q = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    n = 40000
    ids, ok = draw_without_replacement(q.expand(n, -1), 4, torch.Generator().manual_seed(7))  # (n, 4)
    assert ok[:, :3].all() and not ok[:, 3].any()
    assert (ids[:, :3] != 3).all() and (ids[:, :3].sort(-1).values == torch.tensor([0, 1, 2])).all()
    for (a, b), pr in {(0, 1): 0.3, (0, 2): 0.2, (1, 0): 0.3 * 0.5 / 0.7, (1, 2): 0.3 * 0.2 / 0.7,
                       (2, 0): 0.2 * 0.5 / 0.8, (2, 1): 0.2 * 0.3 / 0.8}.items():
        freq = float(((ids[:, 0] == a) & (ids[:, 1] == b)).double().mean())
        assert abs(freq - pr) < 5 * math.sqrt(pr * (1 - pr) / n), (a, b, freq, pr)
