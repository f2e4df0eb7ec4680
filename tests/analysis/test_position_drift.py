"""analysis.position_drift: acceptance binned by the generation's position, the end's cut steps left out."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis.position_drift import bin_means, drift_table, summary


def _decaying(n_tokens: int, depth: int, early: int, late: int, switch: int) -> list[int]:
    """A generation accepting ``early`` tokens per step until ``switch`` tokens are done, ``late`` after."""
    out, done = [], 0
    while done < n_tokens:
        step = early if done < switch else late
        out.append(step)
        done += step
    return out


def test_bins_follow_the_steps_start_and_leave_the_cut_last_steps_out():
    # 12 tokens, depth 3: steps start at 0, 4, 8 (length 4), then 12 > 12-3: the loop is done
    one = [4, 4, 4]
    assert bin_means([one], 12, 3, 4) == [4.0, 4.0, 4.0]
    # the last step starts at 10 with 2 tokens left (< depth 3): cut, not counted in bin 2 (8..11)
    two = [4, 4, 2, 2]
    assert bin_means([two], 12, 3, 4) == [4.0, 4.0, 2.0]
    assert bin_means([[4, 4, 1, 1, 1]], 12, 3, 4) == [4.0, 4.0, 1.0]  # starts 8 (kept), 9, 10 (cut: <3 left)


def test_prompts_weigh_alike_in_a_bin():
    # prompt A: two steps of 1 in bin 0 (mean 1); prompt B: one step of 3 (mean 3) -> bin 0 = 2, not 5/3
    assert bin_means([[1, 1, 3, 3], [3, 3]], 8, 2, 2)[0] == pytest.approx(2.0)


def test_a_decay_along_the_generation_reads_as_negative_drift_and_a_flat_row_as_none():
    n, depth = 48, 4
    decaying = [_decaying(n, depth, 5, 2, 24) for _ in range(4)]
    flat = [[3] * 16 for _ in range(4)]
    df = pd.DataFrame({"row_id": ["decay", "flat", "ar"], "method": ["x", "x", "autoregressive"],
                       "temperature": [1.0, 0.0, 0.0], "workload.max_new_tokens": [n, n, n],
                       "tree_depth": [depth, depth, 0],
                       "prompt_accepted_lengths": [decaying, flat, [[1] * 48]]})
    t = drift_table(df, 16).set_index("row_id")
    assert "ar" not in t.index  # one token per step: nothing to bin
    assert t.loc["decay", "bin0"] == 5.0 and t.loc["decay", "bin2"] == 2.0
    assert t.loc["decay", "drift"] == pytest.approx(2 / 5 - 1)
    assert t.loc["flat", "drift"] == 0.0
    s = summary(t.reset_index())
    assert s.loc[1.0, "rows"] == 1 and s.loc[1.0, "mean_drift"] == pytest.approx(-0.6)


def test_rows_without_per_step_lengths_are_left_out():
    df = pd.DataFrame({"row_id": ["r"], "method": ["x"], "temperature": [1.0],
                       "workload.max_new_tokens": [48], "tree_depth": [4],
                       "prompt_accepted_lengths": [np.nan]})
    assert drift_table(df).empty
    assert math.isnan(bin_means([[5]], 48, 4, 16)[1])  # a bin no step started in
