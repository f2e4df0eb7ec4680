"""Side by side: the methods that draft from the target itself (Medusa-1, Medusa-2, MTP, LayerSkip with and
without its continued training, Draft & Verify) on the zoo target, code and prose: τ, draft cost ratio
(measured draft time per speculation step over t_AR), measured speedup, the simulator's prediction for this
device, extra parameters trained and training time. Every row is a task=measure run (its calibrated profile
and trained modules are cached, so re-running is cheaper).

    python benchmarks/self_speculative.py [--workloads code prose] [--methods ...] [--num-prompts 8]
        [--threads 1] [--calibration-prompts N] [--json out.json]
    python benchmarks/self_speculative.py --merge a.json b.json   # one table of rows run apart
    python benchmarks/self_speculative.py --metrics mtp:code:outputs/.../metrics.json ... --json rows.json

LayerSkip's variant is a different model from the zoo target: its τ and speedup are against its own
autoregressive decoding (``baseline_model`` in the JSON); so is Medusa-2's jointly tuned target. LayerSkip's
exit layer is the device's calibrated choice (``exit_layer: auto``; the table shows E).

One command gives the whole table (12 rows); with every module and profile cached it takes about 25 min on a
quiet 2-core CPU (each row calibrates its profile when missing or stale: ~2-4 min a row then). Training on
first use, quiet, one thread: Medusa-1 heads 200 steps x 0.21 s CPU + features and evaluation; Medusa-2 the
same plus 30 joint steps x 1.6 s CPU; MTP 150 steps x 0.18 s; the LayerSkip variant 400 steps x 0.64 s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = {  # row name → run.py overrides
    "medusa1": ["method=medusa"],
    "medusa2": ["method=medusa", "+method.params.joint=true"],
    "mtp": ["method=mtp"],
    "layerskip": ["method=layerskip"],
    "layerskip_plain": ["method=layerskip", "method.params.variant=none"],
    "draft_verify": ["method=draft_verify"],
}


def training_cost(name: str, cfg, models) -> tuple[int, float | None, str]:
    """(extra parameters trained, training seconds, note) from the caches the run just used."""
    p = cfg.method.params
    if name.startswith("medusa"):
        from methods.drafters.medusa import MedusaParams
        from methods.heads.medusa.checkpoint import load_heads
        from methods.heads.medusa.store import ensure_medusa

        train_cfg = MedusaParams.from_method(cfg.method).train_config()
        built = ensure_medusa(models.target, models.tokenizer, train_cfg)
        n = sum(w.numel() for w in load_heads(built.heads_dir).heads.parameters())
        if p.get("joint"):  # Medusa-2 fine-tunes the target with its heads
            return n + sum(w.numel() for w in models.target.parameters()), built.report["train_seconds"], \
                "heads + target (joint)"
        return n, built.report["train_seconds"], "heads"
    if name == "mtp":
        from methods.drafters.mtp import MTPParams
        from methods.heads.mtp.train import MTPTrainConfig, ensure_mtp

        mp = MTPParams.from_method(cfg.method)
        _, report = ensure_mtp(models.target, models.tokenizer, MTPTrainConfig(
            depths=mp.num_heads, window=mp.window, steps=mp.steps, seed=mp.seed, **mp.train))
        return report["params_trained"], report["train_seconds"], "modules"
    if name == "layerskip":
        from methods.zoo.layerskip import LayerSkipRecipe, variant_dir

        report = json.loads((variant_dir(models.target, LayerSkipRecipe(**dict(p.get("train", {}))))
                             / "report.json").read_text())
        return report["params_trained"], report["train_seconds"], "the whole target (continued training)"
    if name == "draft_verify":
        from methods.drafters.skip_search import SearchConfig, search_path

        found = json.loads(search_path(models.target, SearchConfig()).read_text())
        return 0, 0.0, f"no training; skip-set search {found['seconds']:.0f} s"
    return 0, 0.0, "no training"


def row_config(name: str, workload: str, args):
    from run import compose_run_config

    extra = [f"calibration.prompts={args.calibration_prompts}"] if args.calibration_prompts else []
    return compose_run_config(*METHODS[name], f"workload={workload}", f"threads={args.threads}",
                              f"workload.num_prompts={args.num_prompts}", *extra)


def run_row(name: str, workload: str, args) -> dict:
    from methods.measurement.measure import measure
    from run import seed_everything

    cfg = row_config(name, workload, args)
    seed_everything(cfg.seed, True, cfg.threads)
    start = time.perf_counter()
    m = measure(cfg, show_progress=False).metrics
    return make_row(name, workload, cfg, m, time.perf_counter() - start)


def make_row(name: str, workload: str, cfg, m: dict, run_seconds: float) -> dict:
    """A table row from a measure run's metrics (this script's, or a ``python run.py`` metrics.json)."""
    from methods.models import load_models

    plain = load_models(cfg.model, cfg.device, cfg.model.dtype)  # the zoo target as loaded (caches' keys)
    params, seconds, what = training_cost(name, cfg, plain)
    return {"method": name, "workload": workload, "tau": m["tau"], "predicted_tau": m["predicted_tau"],
            "draft_cost_ratio": m["draft_cost_ratio_calibrated"],  # the profile's timed draft step / t(1)
            "draft_steps": cfg.method.draft_steps, "speedup": m["speedup"],
            "decode_speedup": m["decode_speedup"],
            "predicted_speedup": m["predicted_speedup"], "greedy_equal_rate": m["greedy_equal_rate"],
            "extra_params_trained": params, "training_seconds": seconds, "trained": what,
            "baseline_model": "layerskip variant (own AR)" if name == "layerskip" else
            "medusa-2 tuned target (own AR)" if name == "medusa2" else "zoo target",
            "exit_layer": m.get("exit_layer"), "exit_layer_source": m.get("exit_layer_source"),
            "calibrated": {k: m[k] for k in CALIBRATED if k in m},
            "run_seconds": run_seconds, "loadavg_1min": os.getloadavg()[0]}


CALIBRATED = ("draft_cost_ratio_calibrated", "draft_cost_ratio_config", "verify_saving_ratio_calibrated",
              "shared_verify_over_full", "verify_reuse_ratio_config", "predicted_draft_forwards_per_step",
              "predicted_mean_draft_length", "draft_forwards_per_step", "mean_draft_length",
              "predicted_exit_threshold_final", "exit_threshold_final")


def table(rows: list[dict]) -> str:
    head = ("| method | workload | τ | pred. τ | draft cost ratio | speedup | decode speedup "
            "| pred. speedup | extra params trained | training s |")
    lines = [head, "|" + "---|" * 10]
    rows = sorted(rows, key=lambda r: (r["workload"], list(METHODS).index(r["method"])))
    for r in rows:
        secs = "-" if r["training_seconds"] is None else f"{r['training_seconds']:.0f}"
        name = r["method"] + (f" (E={r['exit_layer']})" if r.get("exit_layer") else "")
        lines.append(f"| {name} | {r['workload']} | {r['tau']:.2f} | {r['predicted_tau']:.2f} | "
                     f"{r['draft_cost_ratio']:.3f} ({r['draft_steps']}) | {r['speedup']:.2f} | "
                     f"{r['decode_speedup']:.2f} | "
                     f"{r['predicted_speedup']:.2f} | {r['extra_params_trained'] / 1e6:.2f}M "
                     f"({r['trained']}) | {secs} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["code", "prose"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calibration-prompts", type=int, default=0,
                    help="calibration.prompts of the profiles calibrated on first use (0: the config's)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--metrics", nargs="+", default=None, metavar="NAME:WORKLOAD:PATH",
                    help="rows from metrics.json files of `python run.py` runs of the same configs")
    ap.add_argument("--merge", nargs="+", type=Path, default=None,
                    help="print the table of rows written by earlier runs (--json files) and exit")
    args = ap.parse_args(argv)
    if args.metrics:  # rows from run.py's metrics.json: --metrics NAME:WORKLOAD:PATH ...
        rows = []
        for spec in args.metrics:
            from run import seed_everything

            name, workload, path = spec.split(":", 2)
            cfg = row_config(name, workload, args)
            seed_everything(cfg.seed, True, cfg.threads)  # threads enter the skip-set search's cache key
            rows.append(make_row(name, workload, cfg, json.loads(Path(path).read_text()), float("nan")))
            print(json.dumps(rows[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(table(rows))
        return 0
    if args.merge:
        print(table([r for f in args.merge for r in json.loads(f.read_text())]))
        return 0
    rows, start = [], time.perf_counter()
    for workload in args.workloads:
        for name in args.methods:
            rows.append(run_row(name, workload, args))
            print(json.dumps(rows[-1]), flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    print(f"{len(rows)} rows in {time.perf_counter() - start:.0f} s (1-min load {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
