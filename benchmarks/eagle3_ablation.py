"""Why EAGLE-3 sits below EAGLE-2 at equal verification budgets on the zoo (issue 13): its training budget
and its fused layers, measured on the equal-budget ladder of ``eagle_ladder.py``.

Each row is one EAGLE-3 head: the preset's (``conf/method/eagle3.yaml``) with ``method.params.steps`` and
the fused ``method.params.feature_layers`` changed, ``train_windows`` scaled with the steps as the preset
scales them (its windows / its steps). Rows: the training-budget curve (``--steps``, at the preset's layers)
and the layer choice (``--layers``, at ``--layer-steps``). Each head is trained on first use through the
normal cache (methods.heads.eagle.store, keyed by its config: a row whose head exists costs no training),
then runs the EAGLE-3 rung of each ladder budget (``--rungs`` k:depth; the dynamic tree keeps
k + … + k^depth nodes) beside the EAGLE-2 preset's rung at the same budget (``--no-eagle2`` skips it).
Printed: per head, the steps / windows / layers, training seconds (as cached: its build's load), held-out
top-1 by depth (the cache entry's report) and τ per rung with its difference to EAGLE-2's.

    python benchmarks/eagle3_ablation.py --workload code
    python benchmarks/eagle3_ablation.py --steps 1000 2200 4400 --layers 0,2,4 0,1,2 2,3,4 --layer-steps 1000

A rung whose run directory (``--out``/<head>/<rung>) already holds metrics.json for the same method, tree,
workload and threads is read back instead of run again (``--rerun`` runs it anyway); ``--dry-run`` prints
the commands only. Training uses ``--threads`` too (1 by default: the thread count moves a head's weights
only by float reduction order).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.eagle_ladder import budget, dynamic_top_k, ladder, run_rung, rung_dir  # noqa: E402


@dataclass(frozen=True)
class Head:
    """One EAGLE-3 head of the ablation: the preset's with these steps, windows and fused layers."""

    steps: int
    windows: int
    layers: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"s{self.steps}-L{''.join(map(str, self.layers))}"

    def overrides(self) -> list[str]:
        return [f"method.params.steps={self.steps}", f"method.params.train.train_windows={self.windows}",
                f"method.params.feature_layers=[{','.join(map(str, self.layers))}]"]


def preset() -> tuple[int, int, tuple[int, ...]]:
    """The eagle3 preset's steps, train_windows and feature_layers (as run.py composes them)."""
    from run import compose_run_config

    p = compose_run_config("method=eagle3").method.params
    return int(p["steps"]), int(p["train"]["train_windows"]), tuple(p["feature_layers"])


def parse_layers(text: str) -> tuple[int, ...]:
    """``"0,2,4"`` → (0, 2, 4): distinct decoder-layer indices (the issue: three distinct layers)."""
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layers must be comma-separated integers, got {text!r}") from None
    if len(set(layers)) != len(layers) or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"layers must be distinct and >= 0, got {text!r}")
    return layers


def parse_rung(text: str) -> tuple[int, int]:
    """``"2:3"`` → (k, depth) = (2, 3): the budget k + … + k^depth at depth ``depth``."""
    try:
        k, depth = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a rung is k:depth, got {text!r}") from None
    if k < 1 or depth < 1:
        raise argparse.ArgumentTypeError(f"k and depth must be >= 1, got {text!r}")
    return k, depth


def heads(steps: list[int], layers: list[tuple[int, ...]], layer_steps: int,
          base: tuple[int, int, tuple[int, ...]]) -> list[Head]:
    """The budget curve (each of ``steps`` at the preset's layers) then the layer choice (each of ``layers``
    at ``layer_steps``); windows = steps × the preset's windows / its steps; duplicates once."""
    b_steps, b_windows, b_layers = base

    def head(s: int, ls: tuple[int, ...]) -> Head:
        return Head(s, max(1, round(s * b_windows / b_steps)), ls)

    out = [head(s, b_layers) for s in steps] + [head(layer_steps, ls) for ls in layers]
    return list(dict.fromkeys(out))


def train_config(overrides: list[str]) -> dict:
    """The EagleTrainConfig (as a JSON-like dict) that ``run.py method=eagle3 OVERRIDES`` trains."""
    from methods.drafters.eagle import EagleParams
    from run import compose_run_config

    cfg = compose_run_config("method=eagle3", *overrides)
    return json.loads(json.dumps(EagleParams.from_method(cfg.method).train_config("eagle3").to_dict()))


def cached_report(config: dict, cache_root: Path | None = None) -> dict | None:
    """The report.json of the cached EAGLE head trained with ``config`` (None if none is cached yet)."""
    if cache_root is None:
        from methods.zoo import cache_root as zoo_root

        cache_root = Path(zoo_root())
    found = []
    for path in (Path(cache_root) / "eagle").glob("*/report.json"):
        report = json.loads(path.read_text())
        if report.get("config") == config:
            found.append((path.stat().st_mtime, report, path.parent.name))
    if not found:
        return None
    _, report, entry = max(found, key=lambda f: f[0])
    return {**report, "entry": entry}


def build_head(overrides: list[str], threads: int) -> dict:
    """The cached head of ``run.py method=eagle3 OVERRIDES`` (trained now if missing, as run.py would):
    its report.json with its cache ``entry``; no decoding, no calibration."""
    import torch

    from methods.drafters.eagle import EagleParams
    from methods.heads.eagle.store import ensure_eagle
    from methods.models import load_models
    from run import compose_run_config

    cfg = compose_run_config("method=eagle3", *overrides)
    if threads:
        torch.set_num_threads(threads)
    models = load_models(cfg.model, cfg.device, cfg.model.dtype)
    train_cfg = EagleParams.from_method(cfg.method).train_config("eagle3")
    built = ensure_eagle(models.target, models.tokenizer, train_cfg)
    return {**built.report, "entry": built.root.name}


def same_run(run_dir: Path, overrides: list[str]) -> bool:
    """Whether ``run_dir`` holds metrics.json of a run.py run with the method, tree, workload and threads
    that ``overrides`` compose to (its recorded overrides composed again)."""
    from run import compose_run_config

    metrics, recorded = run_dir / "metrics.json", run_dir / ".hydra" / "overrides.yaml"
    if not (metrics.exists() and recorded.exists()):
        return False
    import yaml

    old = [o for o in yaml.safe_load(recorded.read_text()) if not o.startswith("hydra.")]
    new = [o for o in overrides if not o.startswith("hydra.")]
    a, b = compose_run_config(*old), compose_run_config(*new)
    return (a.method, a.tree, a.workload, a.threads) == (b.method, b.tree, b.workload, b.threads)


def row_cells(taus: list[float | None], eagle2: list[float | None]) -> list[str]:
    """τ per rung with its relative difference to EAGLE-2's at the same rung ("-" where missing)."""
    cells = []
    for t, ref in zip(taus, eagle2):
        if t is None:
            cells.append("-")
        elif ref:
            cells.append(f"{t:.3f} ({100 * (t / ref - 1):+.1f}%)")
        else:
            cells.append(f"{t:.3f}")
    return cells


def print_heads(rows: list[Head], threads: int, dry_run: bool = False) -> int:
    """``--heads-only``: each head built through the cache (in this order, one training at a time), then its
    training seconds, held-out top-1 by depth and held-out chain-4 τ (methods.heads.eagle.store)."""
    reports = []
    for h in rows:
        print(f"{h.label}: method=eagle3 {' '.join(h.overrides())} threads={threads}", flush=True)
        if not dry_run:
            reports.append((h, build_head(h.overrides(), threads)))
    print(f"\n{'head':14} {'steps':>5} {'windows':>7} {'layers':>7} {'train s':>8} {'load':>5} {'chain τ':>7}"
          "  held-out top-1 by depth 1..6  entry")
    for h, r in reports:
        tau = (r.get("held_out_tau") or {}).get("tau", float("nan"))
        top1 = " ".join(f"{a:.3f}" for a in r["top1_by_depth"])
        print(f"{h.label:14} {h.steps:5d} {h.windows:7d} {','.join(map(str, h.layers)):>7} "
              f"{r['train_seconds']:8.1f} {r.get('loadavg_1min', float('nan')):5.1f} {tau:7.3f}  {top1}  "
              f"{r['entry']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, nargs="*", default=[1000, 2200, 4400],
                    help="training steps of the budget curve, at the preset's layers")
    ap.add_argument("--layers", type=parse_layers, nargs="*", default=[(0, 2, 4), (0, 1, 2), (2, 3, 4)],
                    help="fused layer triples (comma-separated) of the layer comparison, at --layer-steps")
    ap.add_argument("--layer-steps", type=int, default=1000)
    ap.add_argument("--rungs", type=parse_rung, nargs="+", default=[(2, 3), (2, 4), (1, 4)],
                    help="ladder budgets k:depth (default 2:3 2:4 1:4 = 14, 30 and the chain of 4 nodes)")
    ap.add_argument("--workload", default="code")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="outputs/eagle3_ablation")
    ap.add_argument("--no-eagle2", action="store_true", help="skip the EAGLE-2 reference rungs")
    ap.add_argument("--rerun", action="store_true", help="run every rung even where its metrics exist")
    ap.add_argument("--heads-only", action="store_true",
                    help="train/load the heads and print their held-out top-1 and chain-4 τ; no ladder runs")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if any(s < 1 for s in args.steps) or args.layer_steps < 1:
        ap.error("steps must be >= 1")
    rows = heads(args.steps, args.layers, args.layer_steps, preset())
    out = Path(args.out)
    if args.heads_only:
        return print_heads(rows, args.threads, args.dry_run)

    def rung(name: str, k: int, depth: int, extra: list[str], sub: str) -> float | None:
        n = budget(k, depth)
        top_k = dynamic_top_k(n, depth)
        over = ladder(k, depth, top_k)[name]
        run_dir = out / sub / rung_dir(name, args.workload, n, depth, top_k)
        full = [*over, f"workload={args.workload}", f"threads={args.threads}", *extra]
        if not args.rerun and not args.dry_run and same_run(ROOT / run_dir, full):
            print(f"(read back) {run_dir}", flush=True)
            m = json.loads((ROOT / run_dir / "metrics.json").read_text())
        else:
            m = run_rung(over, args.workload, args.threads, run_dir, extra, args.dry_run)
        return None if m is None else float(m["tau"])

    eagle2 = [None if args.no_eagle2 else rung("eagle2", k, d, [], "eagle2") for k, d in args.rungs]
    table = []
    for h in rows:
        taus = [rung("eagle3", k, d, h.overrides(), h.label) for k, d in args.rungs]
        table.append((h, taus, None if args.dry_run else cached_report(train_config(h.overrides()))))
    if args.dry_run:
        return 0
    names = [f"{budget(k, d)}/{d}/{dynamic_top_k(budget(k, d), d)}" for k, d in args.rungs]
    print(f"\nτ on {args.workload} at equal verified nodes (N/depth/top_k), threads={args.threads}; "
          f"(±%) against EAGLE-2 at the same rung")
    print(f"{'head':14} {'steps':>5} {'windows':>7} {'layers':>7} {'train s':>8}  "
          + "  ".join(f"{n:>16}" for n in names) + "  held-out top-1 by depth")
    if not args.no_eagle2:
        print(f"{'eagle2 preset':14} {'':>5} {'':>7} {'':>7} {'':>8}  "
              + "  ".join(f"{c:>16}" for c in row_cells(eagle2, [None] * len(eagle2))))
    for h, taus, rep in table:
        top1 = " ".join(f"{a:.3f}" for a in rep["top1_by_depth"]) if rep else "-"
        secs = f"{rep['train_seconds']:.1f}" if rep else "-"
        layers = ",".join(map(str, h.layers))
        print(f"{h.label:14} {h.steps:5d} {h.windows:7d} {layers:>7} {secs:>8}  "
              + "  ".join(f"{c:>16}" for c in row_cells(taus, eagle2)) + f"  {top1}")
    print("(train s: the cached build's own time, taken at that build's load and threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
