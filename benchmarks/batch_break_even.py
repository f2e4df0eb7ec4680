"""The simulator's speedup at batch B and break-even batch B* (specsim.batch), on the GPU presets at 7B
scale and on this CPU, and — given a batch sweep — measured against predicted.

GPU presets (roofline from datasheet numbers, model=llama2_7b: Llama-2-7B with the 68M draft of its
preset): S(B) for B in 1..32 and B* per method × hardware × context length. Published cross-overs to
compare with are in docs/architecture.md ("Batch cost model"); the presets are not fitted to them.

This CPU (hardware=cpu, model=zoo): the device profile of the method (t(n), draft time and acceptance
measured by task=calibrate) grown with B by the measured t(B, n) fit (benchmarks/batch_cost.py).

    python benchmarks/batch_break_even.py                            # GPU table + CPU prediction
    python benchmarks/batch_break_even.py --sweep multirun/<stamp> --plot out/speedup_vs_batch
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specsim import batch  # noqa: E402
from specsim.cost import ModelShape  # noqa: E402

GPU_METHODS = [  # (label, overrides)
    ("vanilla (draft ρ=0.1)", ["method=vanilla"]),
    ("vanilla (68M draft roofline)", ["method=vanilla", "method.draft_cost=roofline"]),
    ("medusa", ["method=medusa"]),
    ("eagle", ["method=eagle"]),
    ("eagle2 (dynamic)", ["method=eagle2"]),
    ("sequoia (re-sized per B)", ["method=sequoia", "tree=sequoia"]),
]


BUDGET_METHODS = [  # (label, overrides): trees the cost model sizes, re-chosen at each B
    ("sequoia", ["method=sequoia", "tree=sequoia"]),
    ("eagle2", ["method=eagle2", "tree.total_tokens=60", "tree.depth=6", "tree.top_k=10",
                "tree.budgets=[1,2,4,8,16,32,64]"]),
]
BUDGET_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _fmt_b(b: float | None) -> str:
    return ">4096" if b is None else f"{b:.1f}"


def gpu_table(contexts: list[int]) -> None:
    from run import compose_run_config

    print(f"{'method':30s} {'hw':5s} {'ctx':>5s}  " + " ".join(f"S({b})".rjust(6) for b in batch.BATCHES)
          + f"  {'B*':>7s}  nodes")
    for hw in ("a100", "h100"):
        for ctx in contexts:
            for label, overrides in GPU_METHODS:
                cfg = compose_run_config("task=simulate", "model=llama2_7b", f"hardware={hw}",
                                         f"model.context_length={max(4096, ctx)}",  # Llama-2-7B-32K beyond
                                         f"workload.context_tokens={ctx}", *overrides)
                curve = batch.speedup_curve(cfg, batch.BATCHES)
                b_star = batch.break_even_batch(cfg)
                print(f"{label:30s} {hw:5s} {ctx:5d}  " + " ".join(f"{s:6.2f}" for _, _, s, _ in curve)
                      + f"  {_fmt_b(b_star):>7s}  {curve[0][3].size}")
    print("\nThe optimal budget per sequence (nodes incl. root) at each B (batch.best_budget_by_batch), the "
          "workload's context: Sequoia's selection over tree.budgets, and EAGLE-2's dynamic tree over the "
          "same budgets (the paper's A100 values: total_tokens 60, depth 6, top_k 10):")
    for label, overrides in BUDGET_METHODS:
        for hw in ("a100", "h100"):
            cfg = compose_run_config("task=simulate", "model=llama2_7b", f"hardware={hw}", *overrides)
            rows = batch.best_budget_by_batch(cfg, BUDGET_BATCHES)
            print(f"  {label:8s} {hw}: " + ", ".join(f"B={r['batch_size']}: {r['budget']}" for r in rows))


def cpu_prediction(method: str, threads: int) -> pd.DataFrame:
    """S(B), τ and B / t(B, 1) on this CPU from the method's device profile and the t(B, n) fit."""
    import torch

    from methods.measurement.batch_cost import load_batch_fit, load_head_fit
    from methods.measurement.measure import run_tree
    from methods.measurement.profiles import apply_profile, load_profile, profile_config, to_measured_cost
    from run import compose_run_config

    torch.set_num_threads(threads)
    cfg = compose_run_config(f"method={method}", f"threads={threads}", "device=cpu", "hardware=cpu")
    profile = load_profile(profile_config(cfg))
    fit = load_batch_fit(cfg)
    draft_fit = load_batch_fit(cfg, role="draft") if cfg.method.drafter == "draft_model" else None
    head_fit = load_head_fit(cfg) if draft_fit is None else None
    if profile is None or fit is None:
        raise SystemExit(f"no {'device profile' if profile is None else 't(B, n) fit'} for {method} on this "
                         "CPU: run `run.py task=calibrate method=...` / benchmarks/batch_cost.py first")
    mcfg, cost, tree = apply_profile(cfg, profile), to_measured_cost(profile), run_tree(cfg)
    roof = batch.BatchRoofline.from_config(cfg.hardware, ModelShape.target(cfg.model),
                                           cfg.workload.context_tokens)
    rows = []
    for b in batch.BATCHES:
        p = batch.predict_at_batch(mcfg, cost, fit, tree=tree, batch_size=b, with_break_even=(b == 1),
                                   draft_fit=draft_fit, head_fit=head_fit)
        rows.append({"method": method, "batch_size": b, "predicted_speedup": p.predicted_speedup,
                     "predicted_tau": p.predicted_tau, "ar_tokens_per_s": p.ar_tokens_per_s,
                     "roofline_ar_tokens_per_s": b / float(roof.time(b, 1)),
                     "break_even_batch": p.break_even_batch if b == 1 else None})
    out = pd.DataFrame(rows)
    out["break_even_batch"] = out["break_even_batch"].iloc[0]
    print(f"\nthis CPU, method={method} (profile t(1) {profile.t_ar_s * 1e3:.2f} ms, draft/t(1) "
          f"{profile.draft_ratio:.3f}; t(B, n) fit {fit.form}, median error {fit.rel_error_median:.1%}):")
    print(out.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    return out


def compare(sweep: str, prediction: pd.DataFrame, plot: str | None) -> None:
    from analysis import load
    from analysis.batch import batch_table, measured_break_even, speedup_vs_batch
    from analysis.plots import save

    df = load(sweep)
    table = batch_table(df)
    pred = prediction.set_index("batch_size")
    for method in sorted(set(table["method"]) - {"autoregressive"}):
        sub = table[table["method"] == method].set_index("workload.batch_size")
        print(f"\n{method}: B, measured speedup (± sd), predicted S(B); measured decode speedup, the run's "
              "predicted decode speedup (its length, static batch); batched AR tok/s measured (with the "
              "prompts' prefill, decode only), predicted (decode)")
        for b, row in sub.iterrows():
            p = pred.loc[int(b)] if int(b) in pred.index else None
            print(f"  {int(b):3d}  {row['speedup']:.3f} ± {row.get('speedup_std', float('nan')):.3f}   "
                  f"{p['predicted_speedup'] if p is not None else float('nan'):.3f}   "
                  f"{row.get('decode_speedup', float('nan')):.3f}  "
                  f"{row.get('predicted_decode_at_batch', float('nan')):.3f}   "
                  f"{row['baseline_tokens_per_s']:8.1f} "
                  f"{row.get('baseline_decode_tokens_per_s', float('nan')):8.1f}  "
                  f"{p['ar_tokens_per_s'] if p is not None else float('nan'):8.1f}")
        measured = measured_break_even(table, method)
        top = int(sub.index.max())
        reached = f"{measured:.1f}" if measured is not None else f"not reached up to B = {top}"
        steady = _fmt_b(prediction["break_even_batch"].iloc[0])
        print(f"  B* measured {reached}, predicted {steady} (steady state: every step at B rows)")
        dec, pdec = (measured_break_even(table, method, column=c)
                     for c in ("decode_speedup", "predicted_decode_at_batch"))
        dec, pdec = ("not reached" if b is None else f"{b:.1f}" for b in (dec, pdec))
        print(f"  B* of the decode speedup: measured {dec}, the runs' predicted (their length, static "
              f"batch) {pdec}")
    terms(df)
    if plot:
        paths = save(speedup_vs_batch(df, prediction=prediction), plot)
        print("figure:", ", ".join(map(str, paths)))


def terms(df: pd.DataFrame) -> None:
    """The step's terms at each B, measured (the runs' timers) and predicted (the runs' own prediction):
    which term the speedup's miss comes from."""
    from analysis.batch import TERMS, terms_table

    table = terms_table(df)
    if not len(table):
        print("\n(no per-term keys in this sweep's metrics: runs older than the terms)")
        return
    for method, sub in table.groupby("method"):
        print(f"\n{method}: per batched step, ms (forwards: per static batch), measured / predicted (error); "
              "outside = the step less its target forward")
        print(f"{'B':>3} " + " ".join(f"{label:>22s}" for label, _, _ in TERMS))
        for _, r in sub.iterrows():
            cells = []
            for label, _, _ in TERMS:
                k = 1.0 if label.startswith("forwards") else 1e3
                cells.append(f"{r[label + ' measured'] * k:6.2f}/{r[label + ' predicted'] * k:6.2f} "
                             f"({r[label + ' error']:+4.0%})")
            print(f"{int(r['workload.batch_size']):3d} " + " ".join(f"{c:>22s}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[160, 512, 8000])
    ap.add_argument("--method", default="vanilla", help="the CPU prediction's method")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--sweep", help="a batch sweep to compare with (run.py -m ... workload.batch_size=...)")
    ap.add_argument("--plot", help="write the speedup-vs-batch figure here (png + pdf)")
    args = ap.parse_args()
    if not args.no_gpu:
        gpu_table(args.contexts)
    prediction = cpu_prediction(args.method, args.threads)
    if args.sweep:
        compare(args.sweep, prediction, args.plot)


if __name__ == "__main__":
    main()
