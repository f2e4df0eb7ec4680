"""The EAGLE ladder at ONE verification budget: EAGLE-1 and Medusa-1 on the full k-ary tree of depth D
(N = k + k² + … + k^D draft tokens), EAGLE-2 and EAGLE-3 on the dynamic tree keeping the same N tokens at the
same depth D (tree=dynamic tree.total_tokens=N tree.depth=D). Every method verifies N + 1 tree nodes per step,
so τ compares the drafters alone (issue 13: τ EAGLE-3 ≥ EAGLE-2 ≥ EAGLE-1 > Medusa-1 at equal budget).

Runs ``run.py`` once per method (task=measure: τ, speedup over the same-run autoregressive baseline,
predicted τ and speedup) and prints one table; ``--dry-run`` prints the commands only.

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


def ladder(k: int, depth: int) -> dict[str, list[str]]:
    """run.py overrides per rung, all verifying ``budget(k, depth)`` draft tokens at depth ``depth``."""
    static = ["tree=kary", f"tree.k={k}", f"tree.depth={depth}"]
    dynamic = ["tree=dynamic", f"tree.total_tokens={budget(k, depth)}", f"tree.depth={depth}"]
    return {"medusa": ["method=medusa", *static], "eagle": ["method=eagle", *static],
            "eagle2": ["method=eagle2", *dynamic], "eagle3": ["method=eagle3", *dynamic]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=2, help="the static trees' branching (budget = k + … + k^depth)")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--workload", default="code")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="outputs/eagle_ladder", help="one run directory per rung under it")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--only", nargs="+", choices=("medusa", "eagle", "eagle2", "eagle3"),
                    help="run these rungs only (default: all four)")
    ap.add_argument("overrides", nargs="*", help="more run.py overrides for every rung")
    args = ap.parse_args(argv)
    n = budget(args.k, args.depth)
    print(f"verification budget: {n} draft tokens (+ root) per step, depth {args.depth}, "
          f"workload {args.workload}")
    rows = []
    for name, over in ladder(args.k, args.depth).items():
        if args.only and name not in args.only:
            continue
        run_dir = Path(args.out) / f"{name}-{args.workload}-n{n}-d{args.depth}"
        cmd = [sys.executable, str(ROOT / "run.py"), *over, f"workload={args.workload}",
               f"threads={args.threads}", f"hydra.run.dir={run_dir}", *args.overrides]
        print(" ".join(cmd[1:]), flush=True)
        if args.dry_run:
            continue
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        m = json.loads((ROOT / run_dir / "metrics.json").read_text())
        rows.append((name, m["tau"], m["speedup"], m.get("predicted_tau"), m.get("predicted_speedup"),
                     m.get("dynamic_mean_tree_size") or m.get("tree_size")))
    if rows:
        print(f"{'method':8} {'tau':>6} {'speedup':>8} {'pred tau':>9} {'pred spd':>9} {'nodes':>6}")
        for name, tau, spd, ptau, pspd, size in rows:
            print(f"{name:8} {tau:6.2f} {spd:8.2f} {ptau or float('nan'):9.2f} {pspd or float('nan'):9.2f} "
                  f"{size:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
