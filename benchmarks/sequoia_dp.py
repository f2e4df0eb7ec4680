"""Time specsim's vectorised Sequoia DP (Chen et al. 2024) against the same recursion as plain loops.

    python benchmarks/sequoia_dp.py [--budget 1024 --depth 32 --width 32 --repeat 3]

The headline case is budget 1024, 32 levels, 32 ranks (the reference's torch loops need hours there). The
loop version is timed on a small case, where both also must give bit-identical tables; its O(B² L W)
count of inner steps extrapolates it to the headline case.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from specsim import sequoia


def _vector(width: int, seed: int) -> np.ndarray:
    """A Sequoia-shaped vector: a dominant first rank, a decaying tail, some p_none."""
    rng = np.random.default_rng(seed)
    tail = np.sort(rng.dirichlet(np.ones(width)))[::-1] * 0.35
    p = np.concatenate([[0.55], tail[: width - 1]])
    return np.concatenate([[0.0], p, [1.0 - p.sum()]])


def _best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _steps(budget: int, depth: int, width: int) -> float:
    """Inner (y) steps of the recursion: Σ_m (m − 1) · (L − 1) · W."""
    return budget * (budget - 1) / 2 * (depth - 1) * width


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--small", type=int, nargs=3, default=(48, 6, 8), metavar=("B", "L", "W"))
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, numpy {np.__version__}, float32")

    v = _vector(args.width, seed=0)
    big = _best_of(lambda: sequoia.solve(v, args.budget, args.depth), args.repeat)
    table = sequoia.solve(v, args.budget, args.depth)
    t0 = time.perf_counter()
    tree = table.tree(args.budget, args.depth)
    rebuild = time.perf_counter() - t0
    print(f"vectorised DP  budget={args.budget} depth={args.depth} width={args.width}: {big:.3f} s "
          f"(best of {args.repeat}); tree rebuild {rebuild * 1e3:.1f} ms; "
          f"k̄={table.best[args.budget, args.depth]:.4f}, {tree}")

    b, l, w = args.small
    vs = _vector(w, seed=1)
    fast = _best_of(lambda: sequoia.solve(vs, b, l), args.repeat)
    loops = _best_of(lambda: sequoia.solve_naive(vs, b, l), 1)
    same = np.array_equal(sequoia.solve(vs, b, l).values, sequoia.solve_naive(vs, b, l))
    print(f"small case     budget={b} depth={l} width={w}: vectorised {fast * 1e3:.2f} ms, "
          f"loops {loops:.2f} s, ratio {loops / fast:.0f}x, identical tables: {same}")
    per_step = loops / _steps(b, l, w)
    est = per_step * _steps(args.budget, args.depth, args.width)
    print(f"loops extrapolated to the headline case: ~{est / 3600:.1f} h "
          f"({per_step * 1e9:.0f} ns per inner step), i.e. ~{est / big:.0f}x slower")


if __name__ == "__main__":
    main()
