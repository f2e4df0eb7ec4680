"""The simulator against real decoding, row by row (issue 17): τ and speedup errors, summary statistics,
and which term of the model a miss comes from.

A row is one task=measure run (analysis.validation_rows enumerates and runs them). p = target, q = draft;
τ = tokens per target forward (bonus included); S = τ·t(1) / t_step with t_step = t_draft + t_verify,
t_verify = t(n) + the loop's verification overhead (methods.measurement.profiles.to_measured_cost).
    python -m analysis.validation run --full          # the zoo sweep, resumable, into multirun/validation/zoo
    python -m analysis.validation report DIR [DIR ...]   # the table and summary as Markdown (layered)
    python -m analysis.validation insample DIR        # its rows again on the calibration split (in-sample)
    python -m analysis.validation compare BEFORE DIR [DIR ...]   # rows side by side (a power study)
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from pathlib import Path

from analysis import validation_rows as vr

DEFAULT_OUT = Path("multirun/validation")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    if args.command == "insample":
        return _insample(args)
    if args.command == "compare":
        from analysis.validation_report import compare, layered_errors

        print(compare(layered_errors([args.before]), layered_errors(args.after)))
        return 0
    from analysis.validation_report import report

    print(report(args.dirs, insample=args.insample))
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m analysis.validation", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the sweep's rows not yet done (resumable)")
    size = run.add_mutually_exclusive_group(required=True)
    size.add_argument("--full", action="store_true", help="every row on the zoo (experiment=validation)")
    size.add_argument("--small", action="store_true", help="model=micro, tiny settings, untrained methods")
    run.add_argument("--out", type=Path, help="sweep dir (default multirun/validation/{zoo,micro})")
    run.add_argument("--methods", nargs="*", help="only these method presets")
    run.add_argument("--workloads", nargs="*", default=list(vr.WORKLOADS))
    run.add_argument("--temperatures", nargs="*", type=float, default=list(vr.TEMPERATURES))
    run.add_argument("--rows", nargs="*", help="only rows whose id matches one of these shell patterns "
                     "(e.g. 'specinfer__*' 'medusa__natural__prose__T0')")
    run.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", dest="settings",
                     help="Hydra overrides appended to every row, e.g. larger splits for a power study: "
                          "workload.num_prompts=128 workload.tau_se_target=0.006 calibration.prompts=192 "
                          "(profiles calibrated on smaller splits are calibrated again)")
    run.add_argument("--minutes", type=float, help="start no new row after this many minutes")
    run.add_argument("--dry-run", action="store_true", help="list the rows and the excluded combinations")
    rep = sub.add_parser("report", help="print the validation table and summary of a sweep")
    rep.add_argument("dirs", nargs="+", type=Path, metavar="DIR",
                     help="the sweep; several: layered, a later sweep's row replacing an earlier one's")
    rep.add_argument("--insample", type=Path, help="its in-sample rows (default: DIR_insample, if any)")
    cmp = sub.add_parser("compare", help="the rows of one or more sweeps (a later one's row replacing an "
                         "earlier one's) beside the same rows of BEFORE")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path, nargs="+")
    ins = sub.add_parser("insample", help="re-run a finished sweep's rows on the calibration split, with the "
                         "profiles they were predicted with (resumable; never calibrates)")
    ins.add_argument("dir", type=Path, help="the finished sweep")
    ins.add_argument("--rows", nargs="*", help="only rows whose id matches one of these shell patterns")
    ins.add_argument("--tau-misses", action="store_true", help="the rows missing the τ goal (with --rows: "
                     "those too)")
    ins.add_argument("--out", type=Path, help="default: DIR_insample beside the sweep")
    ins.add_argument("--minutes", type=float, help="start no new row after this many minutes")
    ins.add_argument("--dry-run", action="store_true", help="list each row's command line")
    return ap


def _run(args: argparse.Namespace) -> int:
    methods = args.methods or (list(vr.SMALL_METHODS) if args.small else None)
    bad = [kv for kv in args.settings if "=" not in kv]
    if bad:
        raise SystemExit(f"--set takes KEY=VALUE overrides, not {bad}")
    extra = (*(vr.SMALL if args.small else ()), *args.settings)
    selected = vr.rows(methods, args.workloads, args.temperatures, extra)
    if args.rows:
        selected = [r for r in selected if any(fnmatch.fnmatchcase(r.row_id, pat) for pat in args.rows)]
    out = args.out or DEFAULT_OUT / ("micro" if args.small else "zoo")
    if args.dry_run:
        for row in selected:
            print(row.row_id, " ".join(row.overrides))
        for (method, tree), why in vr.EXCLUDED.items():
            print(f"excluded: {method} × {tree}: {why}")
        return 0
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    outcomes = vr.run_rows(selected, out, deadline=deadline)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("done", "skipped", "failed")}
    print(f"{len(selected)} rows: {counts} -> {out}")
    for o in outcomes:
        if o.status == "failed":
            print(f"  failed {o.row.row_id}: {o.error}", file=sys.stderr)
    return 0


def _insample(args: argparse.Namespace) -> int:
    from analysis import validation_insample as vi

    selected = vi.select(args.dir, args.rows, args.tau_misses)
    out = args.out or vi.default_out(args.dir)
    if args.dry_run:
        print("\n".join(vi.dry_run_lines(selected, vi.cache_root())))
        return 0
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    outcomes = vi.run_insample(selected, out, deadline=deadline)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("done", "skipped", "failed", "refused")}
    print(f"{len(selected)} rows: {counts} -> {out}")
    for o in outcomes:
        if o.status in ("failed", "refused"):
            print(f"  {o.status} {o.row.row_id}: {o.error}", file=sys.stderr)
    return int(any(o.status in ("failed", "refused") for o in outcomes))


if __name__ == "__main__":
    sys.exit(main())
