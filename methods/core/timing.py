"""t(n): wall time of the decode loop's verify forward (``ModelEngine.forward_tree``) over n draft tokens, and
the interleaved rounds that a cost table is timed in.

One timer for everything that reports t(n) — ``task=calibrate`` (the profiles the simulator prices this device
with) and the zoo report — so both measure the forward the decode loop runs. The clock is a parameter
(``time.perf_counter`` by default) so that tests can script it: no test asserts a wall time.

A shared machine's load comes and goes: costs timed one after the other (all autoregressive steps, then all
forwards) can see different machines. :func:`interleaved` runs every timed path once per round, the order
rotated per round, as the benchmarks do; per-round ratios and their medians then cancel a slow phase, and
:func:`relative_iqr` says how much the rounds scattered.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from methods.core.engine import ModelEngine
from specsim.tree import Tree

Clock = Callable[[], float]  # seconds, monotonic
TimedPath = Callable[[], Mapping[Hashable, float]]  # one path of a round: its named measurements (seconds)


def star_inputs(engine: ModelEngine, sizes: Sequence[int], seed: int = 0
                ) -> tuple[dict[int, Tree], dict[int, torch.Tensor]]:
    """Star-shaped trees of n nodes and random tokens for them: the cost depends on n, not on the shape."""
    gen = torch.Generator().manual_seed(seed)
    vocab = int(engine.model.config.get_text_config().vocab_size)
    trees = {n: Tree.from_parents([-1] + [0] * (n - 1)) for n in sizes}
    return trees, {n: torch.randint(vocab, (n,), generator=gen) for n in sizes}


def forward_round(engine: ModelEngine, trees: Mapping[int, Tree], tokens: Mapping[int, torch.Tensor],
                  clock: Clock = time.perf_counter, repeat: int = 1) -> dict[int, float]:
    """Per size, the median of ``repeat`` timed tree forwards after the engine's committed prefix, right
    after an untimed one of the same size, warm as the loop's back-to-back steps are (timed right after the
    largest size, t(1..8) of the zoo target read up to 50% slow: caches full of the other size's
    activations). ``repeat`` > 1: one preempted forward does not make the round's figure."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    out: dict[int, float] = {}
    for n, tree in trees.items():
        engine.forward_tree(tokens[n], tree)  # untimed: the same size just before, as in the loop
        engine.drop_pending()
        times = []
        for _ in range(repeat):
            sync()
            t0 = clock()
            engine.forward_tree(tokens[n], tree)
            sync()
            times.append(clock() - t0)
            engine.drop_pending()
        out[n] = statistics.median(times)
    return out


def forward_times(engine: ModelEngine, context: torch.Tensor, sizes: Sequence[int], reps: int, warmup: int,
                  seed: int = 0, clock: Clock = time.perf_counter) -> dict[int, list[float]]:
    """Seconds of ``reps`` tree forwards (methods.core.engine.forward_tree, the loop's verify) over n tokens
    after ``context`` (T,) committed tokens, for n in ``sizes``, after ``warmup`` untimed rounds. Each round
    times every size once (:func:`forward_round`): a slow drift of a shared machine hits all sizes alike."""
    engine.reset()
    engine.prefill(context)
    trees, tokens = star_inputs(engine, sizes, seed)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(warmup + reps):
        one = forward_round(engine, trees, tokens, clock)
        if r >= warmup:
            for n, dt in one.items():
                times[n].append(dt)
    return times


def verify_times(engine: ModelEngine, context: torch.Tensor, sizes: Sequence[int], reps: int, warmup: int,
                 seed: int = 0, clock: Clock = time.perf_counter) -> dict[int, float]:
    """t(n): the median of :func:`forward_times` for each n."""
    times = forward_times(engine, context, sizes, reps, warmup, seed, clock)
    return {n: statistics.median(v) for n, v in times.items()}


# ---- interleaved rounds ------------------------------------------------------------------------------------
Rounds = list[dict[Hashable, float]]


def interleaved(paths: Sequence[TimedPath], rounds: int, warmup: int = 0, max_rounds: int = 0,
                more: Callable[[Rounds], bool] | None = None) -> Rounds:
    """``warmup`` untimed rounds, then ``rounds`` rounds that each run every path once, the order rotated by
    one per round (so no path always runs first or last in its round), then further rounds up to
    ``max_rounds`` while ``more(timed rounds so far)`` says the figures are not yet precise enough. A rotation
    keeps the cyclic order: a path follows the same one in all rounds but the one it opens (calibration's
    autoregressive decode follows the wide or shape decodes, or the tree forwards); timed by thread CPU time,
    the zoo target's t(1) read the same after the tree forwards as after a speculative decode (ratio 0.998, 80
    pairs, load ~4). Returns one dict per timed round: the paths' measurements merged (their names must
    differ)."""
    out: Rounds = []
    r = 0
    while r < warmup + rounds or (len(out) < max_rounds and more is not None and more(out)):
        merged: dict[Hashable, float] = {}
        for i in range(len(paths)):
            merged.update(paths[(r + i) % len(paths)]())
        if r >= warmup:
            out.append(merged)
        r += 1
    return out


def series(rounds: Sequence[Mapping[Hashable, float]], name: Hashable) -> list[float]:
    return [float(r[name]) for r in rounds]


def ratios(rounds: Sequence[Mapping[Hashable, float]], name: Hashable, base: Hashable) -> list[float]:
    """Per round, ``name`` over ``base`` measured in the same round: that round's machine state cancels."""
    return [float(r[name]) / float(r[base]) for r in rounds]


def median_standard_error(values: Sequence[float]) -> float:
    """Relative standard error of the median of ``values`` (inf for fewer than two): the large-sample
    sqrt(pi / 2) · sigma / sqrt(n), sigma read from the interquartile range (IQR / 1.349), so that a few
    preempted rounds do not inflate it as they would a standard deviation."""
    if len(values) < 2:
        return float("inf")
    return math.sqrt(math.pi / 2) / 1.349 * relative_iqr(values) / math.sqrt(len(values))


def relative_iqr(values: Sequence[float]) -> float:
    """Spread of repeated timings: (third quartile − first quartile) / median; 0 for fewer than two values.
    A machine busy for part of the rounds splits them into two groups, and the quartiles fall in both."""
    if len(values) < 2:
        return 0.0
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / med if med > 0 else float("inf")


def ratio_clock() -> Callable[[], float]:
    """The clock for a ratio of two CPU-bound pieces timed back to back: this thread's CPU time when torch
    runs one thread (a shared machine's preemptions fall out of it), wall seconds when torch's own worker
    threads do part of the work (thread CPU time would miss theirs)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 0,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls, after ``warmup`` untimed calls: wall seconds by
    default, the thread's CPU seconds with ``clock=time.thread_time`` (a ratio of two CPU-bound pieces
    measured on a busy machine)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return statistics.median(out)
