"""The timer and the cost table under scripted clocks and timings (methods.core.timing,
methods.measurement.cost_table): interleaved rounds cancel a slow phase of the machine, ratios are medians of
per-round ratios, dispersion flags a scattered series. No test reads a wall time."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch

from methods.core.engine import ModelEngine
from methods.core.timing import (
    forward_round,
    forward_times,
    interleaved,
    median_seconds,
    median_standard_error,
    ratio_clock,
    relative_iqr,
    star_inputs,
    verify_times,
)
from methods.measurement.cost_table import (
    DRAFT,
    MAX_TIMING_DISPERSION,
    T_AR,
    VERIFY,
    VSIZES,
    cost_table,
    ratio_standard_error,
    round_series,
    scatter_reason,
)


class ScriptedClock:
    """A clock whose k-th timed interval lasts ``durations[k]`` (calls come in start/stop pairs)."""

    def __init__(self, durations):
        self.durations, self.now, self.calls = list(durations), 0.0, 0

    def __call__(self) -> float:
        if self.calls % 2 == 1:  # a stop: the interval's scripted duration has passed
            self.now += self.durations[self.calls // 2]
        self.calls += 1
        return self.now


@pytest.fixture
def engine(tiny_target) -> ModelEngine:
    return ModelEngine(tiny_target)


def test_forward_round_reads_the_injected_clock(engine):
    sizes = [1, 4, 8]
    trees, tokens = star_inputs(engine, sizes)
    engine.prefill(torch.arange(10))
    clock = ScriptedClock([5.0, 1.0, 2.0, 7.0, 7.0, 3.0, 0.5, 9.0, 4.0])  # 3 timed forwards per size
    assert forward_round(engine, trees, tokens, clock, repeat=3) == {1: 2.0, 4: 7.0, 8: 4.0}  # medians
    assert clock.calls == 2 * 9


def test_verify_times_are_medians_of_a_slow_first_half(engine):
    """Rounds 0-1 run on a machine 10x slower: the median of 5 rounds is a quiet one's."""
    sizes, reps = [1, 2], 5
    quiet = {1: 1.0, 2: 1.5}
    durations = [quiet[n] * (10.0 if r < 2 else 1.0) for r in range(reps) for n in sizes]
    clock = ScriptedClock([0.0] * len(sizes) + durations)  # the warm-up round is timed too, then dropped
    times = forward_times(engine, torch.arange(12), sizes, reps, warmup=1, clock=clock)
    assert times == {n: [quiet[n] * (10.0 if r < 2 else 1.0) for r in range(reps)] for n in sizes}
    clock = ScriptedClock([0.0] * len(sizes) + durations)
    assert verify_times(engine, torch.arange(12), sizes, reps, warmup=1, clock=clock) == quiet


class BusyMachine:
    """Scripted costs: each path's call costs its base seconds times the machine's slowdown, which is
    ``slow`` for the first ``slow_calls`` calls of any path and 1 afterwards."""

    def __init__(self, slow: float, slow_calls: int):
        self.slow, self.slow_calls, self.calls, self.order = slow, slow_calls, 0, []

    def path(self, name: str, costs: dict):
        def run() -> dict:
            factor = self.slow if self.calls < self.slow_calls else 1.0
            self.calls += 1
            self.order.append(name)
            return {k: v * factor for k, v in costs.items()}

        return run


def test_interleaved_rounds_cancel_a_slow_first_half():
    """The machine is 4x slower for the first half of the calls. Timed in interleaved rounds, every ratio is
    the quiet machine's; timed path after path (all autoregressive steps first) it would read 4x off."""
    rounds = 8
    machine = BusyMachine(slow=4.0, slow_calls=3 * rounds // 2)
    paths = [machine.path("ar", {T_AR: 2e-3}), machine.path("spec", {DRAFT: 4e-4, VERIFY: 3e-3}),
             machine.path("fwd", {1: 1.8e-3, 8: 2.4e-3})]
    table = cost_table(interleaved(paths, rounds, warmup=1))
    assert table.rounds == rounds
    assert table.t_n_ratios == {1: pytest.approx(0.9), 8: pytest.approx(1.2)}
    assert table.draft_ratio == pytest.approx(0.2) and table.verify_ratio == pytest.approx(1.5)
    assert table.verify_overhead_ratio(8) == pytest.approx(0.3) and table.verify_overhead_ratio(1) == 0.0
    assert all(table.dispersion[k] == pytest.approx(0.0) for k in table.dispersion if k != "t1")
    assert table.dispersion["t1"] > 1.0  # t(1) itself split into a slow and a quiet group: flagged
    assert "t1" in scatter_reason(table.dispersion)
    # the order rotates: round r starts with path r (mod 3), so no path always follows the same one
    firsts = [machine.order[3 * r] for r in range(rounds + 1)]
    assert firsts == list(itertools.islice(itertools.cycle(["ar", "spec", "fwd"]), rounds + 1))



def test_cost_table_counts_the_timed_loops_forward_sizes():
    """The loop's verify forwards counted by size in each round (VSIZES) are summed over the rounds, not
    medians of ratios, and enter neither the dispersion nor the ratios; the overhead beside their mean t(k)
    is not clamped where t of the rounded mean draft sits above the loop's verification (prompt lookup's
    grounded T = 0 loop: 1.14 t(1) of verification beside t(4) = 1.22, its forwards averaging 1.08)."""
    rounds = [{T_AR: 1e-3, VERIFY: 1.14e-3, 1: 0.93e-3, 4: 1.22e-3, 5: 1.2e-3,
               (VSIZES, 1): 3, (VSIZES, 5): 4},
              {T_AR: 2e-3, VERIFY: 2.28e-3, 1: 1.86e-3, 4: 2.44e-3, 5: 2.4e-3,
               (VSIZES, 1): 3, (VSIZES, 5): 3, (VSIZES, 3): 1}]
    table = cost_table(rounds)
    assert table.verify_sizes == {1: 6.0, 3: 1.0, 5: 7.0}
    assert not any("vsizes" in k for k in table.dispersion) and not table.verify_step_ratios
    assert table.verify_overhead_ratio(4) == 0.0  # beside t(4): below it, clamped
    assert table.verify_overhead_ratio(4, 1.08) == pytest.approx(1.14 - 1.08)  # beside the forwards' mean

def test_cost_table_takes_medians_of_per_round_ratios():
    """A noisy series: one round's forward is preempted (10x), another round's t(1) is: the medians of the
    per-round ratios ignore both, and the dispersion of each series is its relative IQR."""
    t1 = [1.0, 1.1, 0.9, 10.0, 1.0]
    fwd = [1.2, 1.32, 1.08, 12.0, 12.0]  # round 4: the forward alone preempted
    rounds = [{T_AR: a, 4: f} for a, f in zip(t1, fwd)]
    table = cost_table(rounds)
    assert table.t1_s == statistics.median(t1) == 1.0
    assert table.t_n_ratios == {4: pytest.approx(1.2)}
    assert table.dispersion["t1"] == pytest.approx(relative_iqr(t1))
    assert table.dispersion["t(4)/t1"] == pytest.approx(relative_iqr([1.2, 1.2, 1.2, 1.2, 12.0]))
    assert table.draft_ratio == 0.0 and table.verify_ratio == 0.0  # no drafter path: nothing drafted


def test_relative_iqr_and_the_scatter_bound():
    assert relative_iqr([2.0] * 7) == 0.0 and relative_iqr([3.0]) == 0.0
    assert relative_iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4.0 - 2.0) / 3.0)
    assert relative_iqr([1.0, 1.0, 1.0, 4.0, 4.0, 4.0]) > 1.0  # a slow half
    quiet = {"t1": 0.05, "draft/t1": MAX_TIMING_DISPERSION}
    assert scatter_reason(quiet) == ""
    why = scatter_reason({**quiet, "t(8)/t1": MAX_TIMING_DISPERSION + 0.01})
    assert "t(8)/t1 26%" in why and "draft" not in why
    assert scatter_reason(quiet, bound=0.01) != ""


def test_median_seconds_reads_the_clock_it_is_given_after_the_warmup():
    ticks = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0])  # three timed calls: 5, 1, 3 s
    calls = []
    got = median_seconds(lambda: calls.append(1), reps=3, warmup=2, clock=lambda: next(ticks))
    assert got == 3.0 and len(calls) == 5


def test_ratio_clock_is_thread_cpu_time_only_when_torch_runs_one_thread():
    import time

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert ratio_clock() is time.thread_time
        torch.set_num_threads(2)
        assert ratio_clock() is time.perf_counter
    finally:
        torch.set_num_threads(before)


def test_interleaved_times_further_rounds_while_asked_up_to_the_most():
    """After ``rounds`` timed rounds, one more round at a time while ``more`` asks, never past
    ``max_rounds``; the order keeps rotating; without ``more`` (or with max_rounds <= rounds), ``rounds``."""
    def paths(machine):
        return [machine.path("ar", {T_AR: 1.0}), machine.path("spec", {DRAFT: 0.5})]

    asked = []

    def until_five(done):
        asked.append(len(done))
        return len(done) < 5

    machine = BusyMachine(slow=1.0, slow_calls=0)
    assert len(interleaved(paths(machine), 3, warmup=1, max_rounds=10, more=until_five)) == 5
    assert asked == [3, 4, 5]  # asked after the required rounds only
    firsts = [machine.order[2 * r] for r in range(6)]  # the warm-up round, then 5 timed ones
    assert firsts == ["ar", "spec"] * 3
    assert len(interleaved(paths(BusyMachine(1.0, 0)), 3, warmup=1, max_rounds=4, more=until_five)) == 4
    assert len(interleaved(paths(BusyMachine(1.0, 0)), 3, warmup=1, max_rounds=10)) == 3
    assert len(interleaved(paths(BusyMachine(1.0, 0)), 3, warmup=1, max_rounds=0, more=until_five)) == 3


def test_median_standard_error_reads_the_interquartile_range():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]  # quartiles 2 and 4 around the median 3
    sigma = (4.0 - 2.0) / 1.349  # a normal law's IQR is 1.349 sigma
    assert median_standard_error(values) == pytest.approx(math.sqrt(math.pi / 2) * sigma / 3.0 / math.sqrt(5))
    assert median_standard_error(values * 4) < median_standard_error(values)  # more rounds, a surer median
    assert median_standard_error([1.0]) == math.inf


def test_ratio_standard_error_ignores_t1_and_takes_the_worst_ratio():
    """t(1) in seconds swings with the load while the ratios stay put: nothing to time again. A scattered
    draft ratio is what the rule reads, and the table keeps each round's figures."""
    loaded = [{T_AR: t, DRAFT: 0.2 * t, VERIFY: 1.5 * t, 8: 1.2 * t} for t in (1.0, 3.0, 1.0, 5.0, 2.0)]
    assert ratio_standard_error(loaded) == pytest.approx(0.0)
    draft = [0.18, 0.2, 0.22, 0.2, 0.3]
    scattered = [{**r, DRAFT: d * r[T_AR]} for r, d in zip(loaded, draft)]
    assert ratio_standard_error(scattered) == pytest.approx(median_standard_error(draft))
    table = cost_table(scattered)
    assert table.series == round_series(scattered)
    assert table.series["draft/t1"] == pytest.approx(draft)
    assert table.series["t1"] == [1.0, 3.0, 1.0, 5.0, 2.0]
    assert set(table.series) == set(table.dispersion)
