"""Prompt lookup's n-gram search: the incremental index answers exactly what a scan of the context does."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from methods.drafters.prompt_lookup import LookupParams, NgramIndex


def find_continuation(tokens: torch.Tensor, params: LookupParams) -> torch.Tensor:
    """The reference, a scan of the whole context: (k,) continuation of the most recent earlier occurrence of
    the longest matching suffix n-gram of ``tokens`` ((t,) long, host), k ≤ num_pred_tokens; empty when
    nothing matches."""
    t = tokens.numel()
    for n in range(min(params.max_ngram_size, t - 1), params.min_ngram_size - 1, -1):
        windows = tokens[: t - 1].unfold(0, n, 1)  # (t-n, n): every n-gram that has a successor
        hits = (windows == tokens[t - n :]).all(-1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start : start + params.num_pred_tokens]
    return tokens[:0]


def test_most_recent_longest_match():
    p = LookupParams(max_ngram_size=2, num_pred_tokens=3)
    ctx = torch.tensor([5, 1, 2, 7, 8, 9, 1, 2, 3, 4, 0, 2])
    # the 2-gram (0, 2) never occurred; the 1-gram (2,) last did at index 7, followed by 3, 4, 0
    assert find_continuation(ctx, p).tolist() == [3, 4, 0] == NgramIndex(p).continuation(ctx)
    ctx = torch.tensor([5, 1, 2, 7, 8, 9, 1, 2, 3, 4, 1, 2])
    assert find_continuation(ctx, p).tolist() == [3, 4, 1] == NgramIndex(p).continuation(ctx)
    assert NgramIndex(p).continuation(torch.tensor([4, 5, 6])) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 3), st.integers(1, 3),
       st.integers(1, 6), st.lists(st.integers(1, 5), min_size=1, max_size=12))
def test_incremental_index_equals_the_scan(tokens, lo, span, k, steps):
    """Growing the context by random amounts (as accepted drafts do), every answer equals the scan's."""
    p = LookupParams(max_ngram_size=lo + span - 1, num_pred_tokens=k, min_ngram_size=lo)
    ctx, index, t = torch.tensor(tokens), NgramIndex(p), 1
    for step in steps:
        t = min(len(tokens), t + step)
        assert index.continuation(ctx[:t]) == find_continuation(ctx[:t], p).tolist()
    other = torch.tensor([9, *tokens])  # a different context: the index starts over
    assert index.continuation(other) == find_continuation(other, p).tolist()
