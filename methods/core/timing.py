"""t(n): wall time of the decode loop's verify forward (``ModelEngine.forward_tree``) over n draft tokens.

One timer for everything that reports t(n) — ``task=calibrate`` (the profiles the simulator prices this device
with) and the zoo report — so both measure the forward the decode loop runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from methods.core.engine import ModelEngine
from specsim.tree import Tree


def forward_times(engine: ModelEngine, context: torch.Tensor, sizes: Sequence[int], reps: int, warmup: int,
                  seed: int = 0) -> dict[int, list[float]]:
    """Seconds of ``reps`` tree forwards (methods.core.engine.forward_tree, the loop's verify) over n tokens
    after ``context`` (T,) committed tokens, for n in ``sizes``, after ``warmup`` untimed rounds. Star-shaped
    trees: the cost depends on n, not on the shape. Each round times every size once, so a slow drift of a
    shared machine hits all sizes alike; each timed forward follows an untimed one of the same size, warm as
    the loop's back-to-back steps are (timed right after the largest size, t(1..8) of the zoo target read up
    to 50% slow: caches full of the other size's activations)."""
    engine.reset()
    engine.prefill(context)
    gen = torch.Generator().manual_seed(seed)
    vocab = int(engine.model.config.get_text_config().vocab_size)
    trees = {n: Tree.from_parents([-1] + [0] * (n - 1)) for n in sizes}
    tokens = {n: torch.randint(vocab, (n,), generator=gen) for n in sizes}
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(warmup + reps):
        for n in sizes:
            engine.forward_tree(tokens[n], trees[n])  # untimed: the same size just before, as in the loop
            engine.drop_pending()
            sync()
            t0 = time.perf_counter()
            engine.forward_tree(tokens[n], trees[n])
            sync()
            dt = time.perf_counter() - t0
            engine.drop_pending()
            if r >= warmup:
                times[n].append(dt)
    return times


def verify_times(engine: ModelEngine, context: torch.Tensor, sizes: Sequence[int], reps: int, warmup: int,
                 seed: int = 0) -> dict[int, float]:
    """t(n): the median of :func:`forward_times` for each n."""
    times = forward_times(engine, context, sizes, reps, warmup, seed)
    return {n: statistics.median(v) for n, v in times.items()}
