"""The measuring side of benchmarks/vs_transformers.py: paths (one way of generating), interleaved passes
over the prompts, paired ratios. Nothing here knows HF from specsim: a path is a function from a prompt's
token ids to the generated tokens (and, for specsim, the target forwards it took)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Output:
    tokens: list[int]
    steps: int  # target forwards that verified drafts (HF: every target forward; its first also prefills)


@dataclass
class Pass:
    """One path's totals over all prompts in one pass."""

    outputs: list[list[int]]  # generated tokens per prompt
    time: float = 0.0
    steps: int = 0

    @property
    def tokens(self) -> int:
        return sum(map(len, self.outputs))


@dataclass
class BenchPath:
    name: str
    run: Callable[[torch.Tensor], Output]
    candidate: bool = False  # in the race for specsim's "best"
    hf: bool = False  # a transformers configuration: forwards counted with a hook; races for HF's fastest
    counter: list[int] | None = None  # HF paths: the target-forward counter during the selection pass
    # called (untimed) before every pass: a specsim path starts each pass with a new drafter, so that what a
    # drafter keeps across prompts (staged's n-gram table of q's outputs) has not seen these prompts in the
    # warm-up or an earlier pass; within a pass it carries over from prompt to prompt, as in serving
    fresh: Callable[[], None] | None = None
    selection: Pass | None = None
    reps: list[Pass] = field(default_factory=list)
    equal: int = 0  # runs (prompt x pass) whose output equals HF greedy's in the selection pass
    equal_ar: int = 0  # ... equals specsim autoregressive's (same numerics as specsim's other paths)
    runs: int = 0


def count_forwards(model: torch.nn.Module) -> tuple[list[int], Callable[[], None]]:
    """A counter of the target's forward calls (HF paths) and the function that removes the hook."""
    count = [0]
    handle = model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count, handle.remove


def run_pass(paths: list[BenchPath], prompts, offset: int) -> dict[str, Pass]:
    """Every prompt runs every path, the order rotated per prompt (from ``offset``) so that a slow phase of
    the machine hits all paths alike. Steps: the drafter loop's, or the target forwards a hook counted."""
    out = {p.name: Pass([]) for p in paths}
    for p in paths:
        if p.fresh is not None:
            p.fresh()
    for i, ids in enumerate(prompts):
        k = (offset + i) % len(paths)
        for p in paths[k:] + paths[:k]:
            calls = p.counter[0] if p.counter else 0
            t0 = time.perf_counter()
            res = p.run(ids)
            one = out[p.name]
            one.time += time.perf_counter() - t0
            one.outputs.append(res.tokens)
            one.steps += res.steps or (p.counter[0] - calls if p.counter else 0)
    return out


def measure(paths: list[BenchPath], prompts, reps: int, target: torch.nn.Module, references: tuple[str, str]
            ) -> None:
    """Warm-up calls per path (untimed: the longest prompt, so that shape-specialised HF configurations —
    static caches, compiled graphs — are sized for every prompt, and the shortest); the selection pass
    (target forwards of HF paths counted; the best candidate is picked on it); ``reps`` timed repetitions.
    ``references``: the names of the paths whose selection-pass outputs the others are compared with
    (HF greedy, specsim autoregressive)."""
    by_len = sorted(prompts, key=len)
    for p in paths:
        p.run(by_len[-1])
        p.run(by_len[0])
    counter, remove = count_forwards(target)
    for p in paths:
        p.counter = counter if p.hf else None
    try:
        selection = run_pass(paths, prompts, 0)
    finally:
        remove()
    passes = [selection] + [run_pass(paths, prompts, (r + 1) * len(prompts)) for r in range(reps)]
    hf_ref, ar_ref = references
    for p in paths:
        p.selection, p.reps = selection[p.name], [one[p.name] for one in passes[1:]]
        p.runs = len(passes) * len(prompts)
        p.equal = matches([one[p.name] for one in passes], selection[hf_ref].outputs)
        p.equal_ar = matches([one[p.name] for one in passes], selection[ar_ref].outputs)


def matches(passes: list[Pass], reference: list[list[int]]) -> int:
    """Runs (prompt x pass) whose tokens equal the reference's for that prompt."""
    return sum(out == ref for one in passes for out, ref in zip(one.outputs, reference))


def speeds(p: BenchPath) -> list[float]:
    """tokens/s of each repetition."""
    return [one.tokens / one.time for one in p.reps]


def median_speed(p: BenchPath) -> float:
    return statistics.median(speeds(p))


def ratio(p: BenchPath, q: BenchPath) -> tuple[float, float, float]:
    """Median, min and max over repetitions of p's tokens/s over q's in the same repetition (paired: both ran
    interleaved, so slow phases of the machine cancel)."""
    r = [a / b for a, b in zip(speeds(p), speeds(q))]
    return statistics.median(r), min(r), max(r)
