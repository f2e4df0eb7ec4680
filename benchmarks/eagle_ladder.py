"""The EAGLE ladder at ONE verification budget: EAGLE-1 and Medusa-1 on the full k-ary tree of depth D
(N = k + k² + … + k^D draft tokens), EAGLE-2 and EAGLE-3 on the dynamic tree keeping the same N tokens at the
same depth D (tree=dynamic tree.total_tokens=N tree.depth=D tree.top_k=K), so that τ compares the drafters
alone (issue 13: τ EAGLE-3 ≥ EAGLE-2 ≥ EAGLE-1 > Medusa-1 at equal budget).

The dynamic tree (methods.drafters.eagle) drafts K nodes at depth 1 and, at each deeper level, the K children
of each of the K frontier nodes: a pool of K + (D − 1)·K² nodes from which it keeps the best N. With fewer
than N in the pool it verifies fewer nodes than the static trees (the default K = 2 at D = 3: 10 < 14), so
K is the smallest ≥ 2 whose pool holds N (``dynamic_top_k``; ``--top-k`` overrides it). Every run reports
the mean verified nodes per step (``verified_nodes_per_step``, root included; the static trees verify fewer
only when the length limit cuts them): the table prints it for every rung, flags (``!``) a rung more than
5% below the largest, and the script exits 1 then.

Runs ``run.py`` once per method (task=measure: τ, speedup over the same-run autoregressive baseline,
predicted τ and speedup) and prints one table, then per rung the acceptance by depth and by sibling rank
and the dynamic trees' mean kept nodes per depth; ``--dry-run`` prints the commands only.

    python benchmarks/eagle_ladder.py --k 2 --depth 3 --workload code
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def budget(k: int, depth: int) -> int:
    """Draft tokens of the full k-ary tree of ``depth`` levels below the root."""
    return sum(k**d for d in range(1, depth + 1))


def dynamic_pool(top_k: int, depth: int) -> int:
    """Nodes the dynamic tree drafts before its rerank: top_k at depth 1, then top_k children of each of
    the top_k frontier nodes at each of the depth − 1 deeper levels (EagleDrafter._dynamic)."""
    return top_k + (depth - 1) * top_k**2


def dynamic_top_k(n: int, depth: int, least: int = 2) -> int:
    """The smallest top_k ≥ ``least`` whose pool holds ``n`` nodes at ``depth`` (≥ 2: top_k 1 is the chain,
    no choice left to the rerank)."""
    if n < 1 or depth < 1:
        raise ValueError(f"budget {n} and depth {depth} must be >= 1")
    if n > dynamic_pool(n, depth):  # depth 1: the pool is top_k itself
        raise ValueError(f"no top_k drafts {n} nodes at depth {depth}")
    k = max(least, 1)
    while dynamic_pool(k, depth) < n:
        k += 1
    return k


def ladder(k: int, depth: int, top_k: int | None = None) -> dict[str, list[str]]:
    """run.py overrides per rung, all verifying ``budget(k, depth)`` draft tokens at depth ``depth``; the
    dynamic rungs expand ``top_k`` nodes per level (default ``dynamic_top_k``)."""
    n = budget(k, depth)
    top_k = dynamic_top_k(n, depth) if top_k is None else top_k
    if dynamic_pool(top_k, depth) < n:
        raise ValueError(f"top_k {top_k} at depth {depth} drafts {dynamic_pool(top_k, depth)} < {n} nodes")
    static = ["tree=kary", f"tree.k={k}", f"tree.depth={depth}"]
    dynamic = ["tree=dynamic", f"tree.total_tokens={n}", f"tree.depth={depth}", f"tree.top_k={top_k}"]
    return {"medusa": ["method=medusa", *static], "eagle": ["method=eagle", *static],
            "eagle2": ["method=eagle2", *dynamic], "eagle3": ["method=eagle3", *dynamic]}


def rung_dir(name: str, workload: str, n: int, depth: int, top_k: int) -> str:
    """The run directory of one rung under ``--out``."""
    return f"{name}-{workload}-n{n}-d{depth}-t{top_k}"


def run_rung(rung: list[str], workload: str, threads: int, run_dir: Path, extra: list[str] = (),
             dry_run: bool = False) -> dict | None:
    """``run.py RUNG ... EXTRA`` (task=measure) into ``run_dir``; its metrics.json (None with ``dry_run``)."""
    cmd = [sys.executable, str(ROOT / "run.py"), *rung, f"workload={workload}", f"threads={threads}",
           f"hydra.run.dir={run_dir}", *extra]
    print(" ".join(cmd[1:]), flush=True)
    if dry_run:
        return None
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((ROOT / run_dir / "metrics.json").read_text())


def unequal(nodes: dict[str, float], tolerance: float = 0.05) -> list[str]:
    """The rungs whose mean verified nodes per step fall more than ``tolerance`` below the largest."""
    top = max(nodes.values(), default=0.0)
    return [name for name, v in nodes.items() if v < (1 - tolerance) * top]


def verified_nodes(m: dict) -> float:
    """A run's mean verified nodes per step, root included (runs before the metric: the dynamic trees' mean
    size, else the static tree's size)."""
    v = m.get("verified_nodes_per_step") or m.get("dynamic_mean_tree_size") or m.get("tree_size")
    return float(v)


def _fmt(xs) -> str:
    return " ".join(f"{x:.2f}" for x in xs or []) or "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=2, help="the static trees' branching (budget = k + … + k^depth)")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--workload", default="code")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="outputs/eagle_ladder", help="one run directory per rung under it")
    ap.add_argument("--top-k", type=int, default=None,
                    help="the dynamic rungs' top_k (default: the smallest >= 2 whose pool holds the budget)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--only", nargs="+", choices=("medusa", "eagle", "eagle2", "eagle3"),
                    help="run these rungs only (default: all four)")
    ap.add_argument("overrides", nargs="*", help="more run.py overrides for every rung")
    args = ap.parse_args(argv)
    n = budget(args.k, args.depth)
    top_k = dynamic_top_k(n, args.depth) if args.top_k is None else args.top_k
    rungs = ladder(args.k, args.depth, top_k)
    print(f"verification budget: {n} draft tokens (+ root) per step, depth {args.depth}, "
          f"workload {args.workload}; dynamic top_k {top_k} (pool {dynamic_pool(top_k, args.depth)})")
    rows = []
    for name, over in rungs.items():
        if args.only and name not in args.only:
            continue
        run_dir = Path(args.out) / rung_dir(name, args.workload, n, args.depth, top_k)
        m = run_rung(over, args.workload, args.threads, run_dir, args.overrides, args.dry_run)
        if m is not None:
            rows.append((name, m))
    if not rows:
        return 0
    nodes = {name: verified_nodes(m) for name, m in rows}
    flagged = unequal(nodes)
    print(f"{'method':8} {'tau':>6} {'speedup':>8} {'pred tau':>9} {'pred spd':>9} {'nodes':>7}")
    for name, m in rows:
        ptau, pspd = m.get("predicted_tau") or float("nan"), m.get("predicted_speedup") or float("nan")
        print(f"{name:8} {m['tau']:6.3f} {m['speedup']:8.3f} {ptau:9.3f} {pspd:9.3f} {nodes[name]:6.2f}"
              f"{'!' if name in flagged else ''}")
    print("(speedup: over the same run's autoregressive baseline; nodes: mean verified per step, root incl.)")
    for name, m in rows:
        kept = _fmt(m.get("dynamic_nodes_per_depth"))
        print(f"{name:8} accepted by depth {_fmt(m.get('acceptance_by_depth'))} | by rank "
              f"{_fmt(m.get('acceptance_by_rank'))} | kept per depth {kept}")
    if flagged:
        print(f"UNEQUAL BUDGET: {', '.join(flagged)} verified more than 5% fewer nodes per step than "
              f"{max(nodes, key=nodes.get)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
