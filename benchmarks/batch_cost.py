"""Calibrate and validate the batch cost model t(B, n) (specsim.batch) on this machine.

Times the target's forward over B rows × n tokens after a KV cache of each ``--contexts`` length
(methods.measurement.batch_cost.time_grid), fits specsim.batch.BatchFit to all of it, stores the fit next
to the device profiles (the measure path and the simulator read it from there), and prints predicted vs
measured t(B, n) with the relative error (median, max) of: the fit (in sample), the fit at a context it
did not see (leave one context out, when two or more were timed), and the hardware preset's uncalibrated
roofline.

    python benchmarks/batch_cost.py                                  # zoo target, bf16, 1 thread
    python benchmarks/batch_cost.py --contexts 128 192 --reps 5 --json out.json
    python benchmarks/batch_cost.py --from-json out.json             # re-fit and print, no timing
    python benchmarks/batch_cost.py --draft                          # the draft model's own t(B, n)
    python benchmarks/batch_cost.py --ar-check 5                     # grid vs loop 1-token forward only
    python benchmarks/batch_cost.py --draft-check 10                 # draft forwards after the target's
    python benchmarks/batch_cost.py --tree-check 5                   # grid vs loop speculative forward
    python benchmarks/batch_cost.py --head eagle                     # a head drafter's step in the loop

Timings: the batched engine's verify forward (methods.core.batch_engine), chains of n nodes per row; for
the target also the batched decode loop's autoregressive step at each B (its own timers,
methods.measurement.batch_cost.time_ar_loop): its time outside the forward, which the simulator adds to
every batched step, and its 1-token forward, which prices the autoregressive step (printed beside the grid's
fit at the same B and context); for the draft model (``--draft``) the loop run speculatively with its
chain against the autoregressive loop (time_draft_loop): what the speculative step costs outside its target
forward beyond the autoregressive step's and the draft's forwards at the grid's price prices the draft
step at B (the split printed). ``--draft-check N``: only the draft's forwards after a target forward vs
after its own. ``--ar-check N``: only the grid's 1-token forward against the loop's, N rounds of its cells
(its procedure: an untimed forward, then the timed one) and the loop, interleaved round by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import astuple
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specsim.batch import BatchFit, BatchRoofline, fit_batch_cost  # noqa: E402
from specsim.cost import ModelShape  # noqa: E402

Grid = dict[tuple[int, int, int], float]  # (B, n, context) → seconds


def measure(args: argparse.Namespace) -> tuple[Grid, dict]:
    import torch

    from methods.measurement.batch_cost import (
        loop_steps,
        loop_terms,
        time_ar_loop,
        time_draft_loop,
        time_grid,
    )
    from methods.models import load_models
    from run import compose_run_config

    torch.set_num_threads(args.threads)
    cfg = compose_run_config(f"model={args.model}", f"model.dtype={args.dtype}", f"threads={args.threads}")
    models = load_models(cfg.model, "cpu", args.dtype)
    stat = {"median": statistics.median, "min": min}[args.stat]
    model = models.draft if args.draft else models.target
    assert model is not None, f"model={args.model} has no draft model"
    grid = time_grid(model, args.batches, args.sizes, args.contexts, args.reps, stat=stat)
    ctx = min(args.contexts)
    if args.draft:  # the draft step's work outside its forwards (top-k, catch-up, commit), vanilla's chain
        from methods.core.sampling import SamplingParams
        from methods.drafters.registry import build_drafter
        from specsim.batch import fit_batch_cost
        from specsim.tree import Tree

        drafter = build_drafter(cfg.method, Tree.chain(int(cfg.tree.gamma)), models, SamplingParams(0.0))
        fit = fit_batch_cost(grid, ctx)
        steps = loop_steps([ctx, *args.contexts])
        draft = time_draft_loop(models.target, drafter, fit, args.batches, ctx, steps, reps=args.reps)
        loop, ar = loop_terms(draft), {}
    else:
        ar = time_ar_loop(model, args.batches, ctx, loop_steps([ctx, *args.contexts]), reps=args.reps)
        loop, draft = {b: s.outside_s for b, s in ar.items()}, {}
    return grid, {"model": args.model, "dtype": args.dtype, "threads": args.threads, "stat": args.stat,
                  "role": "draft" if args.draft else "target", "loop": [[b, t] for b, t in loop.items()],
                  "loop_forward": [[b, s.forward_s, s.context] for b, s in ar.items()],
                  "draft_loop": [[b, *astuple(s)] for b, s in draft.items()]}


def ar_check(args: argparse.Namespace) -> None:
    """The grid's 1-token forward (time_grid's procedure, at the loop's mean context) and the batched
    loop's autoregressive forward (time_ar_loop, prompts of the first context), interleaved round by round
    in one process: per B the medians over rounds and of the per-round ratio."""
    import torch

    from methods.measurement.batch_cost import time_ar_loop, time_consecutive, time_grid
    from methods.models import load_models
    from run import compose_run_config

    torch.set_num_threads(args.threads)
    cfg = compose_run_config(f"model={args.model}", f"model.dtype={args.dtype}", f"threads={args.threads}")
    model = load_models(cfg.model, "cpu", args.dtype).target
    ctx, steps = min(args.contexts), 16
    at = round(ctx + (steps - 1) / 2)  # the loop's mean cached tokens per row
    grid: dict[int, list[float]] = {b: [] for b in args.batches}
    loop: dict[int, list[float]] = {b: [] for b in args.batches}
    for r in range(args.ar_check):
        g = time_grid(model, args.batches, [1], [at], reps=3, warmup=1, seed=r)
        for b, s in time_ar_loop(model, args.batches, ctx, steps=steps, reps=1, seed=r).items():
            grid[b].append(g[(b, 1, at)])
            loop[b].append(s.forward_s)
    print(f"1-token forward, grid (context {at}) vs the loop's (context {ctx}..{ctx + steps - 1}), "
          f"{args.ar_check} rounds, ms (median):")
    print(f"{'B':>3} {'grid':>8} {'loop':>8} {'grid/loop':>10}  per round")
    for b in args.batches:
        ratios = [x / y for x, y in zip(grid[b], loop[b])]
        print(f"{b:3d} {statistics.median(grid[b]) * 1e3:8.3f} {statistics.median(loop[b]) * 1e3:8.3f} "
              f"{statistics.median(ratios):10.3f}  " + " ".join(f"{x:.2f}" for x in ratios))
    b = 16 if 16 in args.batches else max(args.batches)
    seq = time_consecutive(model, b, at, rounds=max(args.ar_check, 3))
    print(f"B {b}: the 1st..{len(seq)}th 1-token forward in a row after another engine's forward (the grid "
          "times the 2nd), ms: " + " ".join(f"{t * 1e3:.2f}" for t in seq))


def draft_check(args: argparse.Namespace) -> None:
    """The draft model's 1st..4th 1-token forward in a row over B rows after a (γ + 1)-token forward of the
    target (the batched loop's order: verify, then draft) and after one of the draft model itself (the
    grid's order), the two interleaved round by round; medians over rounds and the per-round ratio."""
    import torch

    from methods.measurement.batch_cost import time_consecutive
    from methods.models import load_models
    from run import compose_run_config

    torch.set_num_threads(args.threads)
    cfg = compose_run_config(f"model={args.model}", f"model.dtype={args.dtype}", f"threads={args.threads}")
    models = load_models(cfg.model, "cpu", args.dtype)
    ctx, n, k = min(args.contexts), int(cfg.tree.gamma) + 1, 4
    print(f"draft model's 1-token forwards in a row (context {ctx}), after a {n}-token forward of the target "
          f"vs of the draft itself, {args.draft_check} interleaved rounds, ms (median):")
    print(f"{'B':>3} {'after':>7} " + " ".join(f"{i + 1:>7}" for i in range(k)) + "  1st target/draft")
    for b in args.batches:
        runs: dict[str, list[list[float]]] = {"target": [], "draft": []}
        for r in range(args.draft_check):
            for name, before in (("target", models.target), ("draft", None)):
                runs[name].append(time_consecutive(models.draft, b, ctx, k=k, rounds=1, seed=r, before=before,
                                                   before_n=n))
        med = {name: np.median(np.array(v), axis=0) for name, v in runs.items()}
        ratio = statistics.median(x[0] / y[0] for x, y in zip(runs["target"], runs["draft"]))
        for name in ("target", "draft"):
            tail = f"  {ratio:.2f}" if name == "target" else ""
            print(f"{b:3d} {name:>7} " + " ".join(f"{t * 1e3:7.3f}" for t in med[name]) + tail)


def tree_check(args: argparse.Namespace) -> None:
    """The grid's forward of a (γ + 1)-node chain per row (time_grid's procedure, at the loop's mean
    context) and the batched loop's speculative step's target forward (time_draft_loop, prompts of the
    first context, the draft model's chain), interleaved round by round: per B the medians over rounds and
    of the per-round ratio; the autoregressive step's 1-token forward beside it (the grid's cell against
    the loop's, which prices it), so that the two can be read as a ratio under the same load."""
    import torch

    from methods.core.sampling import SamplingParams
    from methods.drafters.registry import build_drafter
    from methods.measurement.batch_cost import time_ar_loop, time_draft_loop, time_grid
    from methods.models import load_models
    from run import compose_run_config
    from specsim.batch import BatchFit
    from specsim.tree import Tree

    torch.set_num_threads(args.threads)
    cfg = compose_run_config(f"model={args.model}", f"model.dtype={args.dtype}", f"threads={args.threads}")
    models = load_models(cfg.model, "cpu", args.dtype)
    n = int(cfg.tree.gamma) + 1
    drafter = build_drafter(cfg.method, Tree.chain(n - 1), models, SamplingParams(0.0))
    ctx, steps = min(args.contexts), 64
    at = ctx + steps // 2  # about the loop's mean cached tokens per row (both loops: 64 new tokens)
    price = BatchFit(0.0, 0.0, 0.0, 0.0, 0.0, ctx)  # the draft's grid price is not read here
    cells: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(args.tree_check):
        g = time_grid(models.target, args.batches, [1, n], [at], reps=3, warmup=1, seed=r)
        spec = time_draft_loop(models.target, drafter, price, args.batches, ctx, steps, reps=1, seed=r)
        ar = time_ar_loop(models.target, args.batches, ctx, steps, reps=1, seed=r)
        grid_n = np.array([g[(b, n, at)] for b in args.batches])
        for b in args.batches:
            rows = spec[b].rows  # the speculative rows finish apart: its steps run fewer rows than B
            at_rows = float(np.interp(rows, args.batches, grid_n))
            cells.setdefault(("tree", b), []).append((g[(b, n, at)], spec[b].verify_forward_s, at_rows, rows))
            cells.setdefault(("1-token", b), []).append((g[(b, 1, at)], ar[b].forward_s, g[(b, 1, at)], b))
    print(f"target forward, grid (context {at}) vs the loop's (context {ctx}..{ctx + steps}), "
          f"{args.tree_check} rounds, ms (median); rows: the loop's active rows per step, and the grid's "
          "cell read there (linear between the timed B) against the loop's forward:")
    print(f"{'B':>3} {'forward':>8} {'grid':>8} {'loop':>8} {'grid/loop':>10} {'rows':>6} "
          f"{'@rows/loop':>10}  per round")
    for b in args.batches:
        for kind in (f"{n}-node", "1-token"):
            v = cells[("tree" if kind != "1-token" else kind, b)]
            ratios = [x / y for x, y, _, _ in v]
            matched = [z / y for _, y, z, _ in v]
            print(f"{b:3d} {kind:>8} {statistics.median(x for x, *_ in v) * 1e3:8.3f} "
                  f"{statistics.median(y for _, y, *_ in v) * 1e3:8.3f} {statistics.median(ratios):10.3f} "
                  f"{statistics.median(r for *_, r in v):6.1f} {statistics.median(matched):10.3f}  "
                  + " ".join(f"{x:.2f}/{y:.2f}" for x, y in zip(ratios, matched)))


def head(args: argparse.Namespace) -> None:
    """A head drafter's (``--head METHOD``: mtp, eagle) step in the batched loop against the AR step at the
    same rows (methods.measurement.batch_cost.calibrate_head), on the workload's prompts, its fitted line
    stored (unless --no-store) for the simulator's batch prediction of that method."""
    import tempfile
    from dataclasses import replace

    import torch

    from methods.core.sampling import SamplingParams
    from methods.data.workloads import load_prompts
    from methods.drafters.registry import build_drafter
    from methods.measurement.batch_cost import calibrate_head, head_levels
    from methods.measurement.measure import run_tree
    from methods.models import load_models
    from run import compose_run_config

    torch.set_num_threads(args.threads)
    cfg = compose_run_config(f"model={args.model}", f"model.dtype={args.dtype}", f"threads={args.threads}",
                             f"method={args.head}", "device=cpu")
    models = load_models(cfg.model, "cpu", args.dtype)
    tree = run_tree(cfg)
    drafter = build_drafter(cfg.method, tree, models, SamplingParams(0.0), cfg.tree)
    tree = getattr(drafter, "tree", None) or tree  # a drafter may cut it (MTP: to its modules' depth)
    levels = head_levels(cfg, tree)  # a dynamic tree: its expansion's levels
    w = replace(cfg.workload, num_prompts=max(args.batches))
    texts = [torch.tensor(p.token_ids) for p in load_prompts(w, models.tokenizer, cfg.seed)]
    cache = Path(tempfile.mkdtemp()) if args.no_store else None
    fit, runs, path = calibrate_head(cfg, models.target, drafter, levels, texts, args.batches,
                                     steps=int(cfg.workload.max_new_tokens), reps=args.reps, cache=cache)
    print(f"{args.head} (tree of {tree.size} nodes, {levels} levels) in the batched loop, "
          f"{cfg.workload.name} prompts, {cfg.workload.max_new_tokens} tokens, ms per step: the speculative "
          "step outside its target forward, the AR step's at the same rows, the head step (their difference)")
    print(f"{'B':>3} {'rows':>5} {'spec out':>9} {'AR@rows':>8} {'head':>7} {'fitted':>7} "
          f"{'draft timer':>11} {'spec fwd':>9}")
    for b, st in sorted(runs.items()):
        print(f"{b:3d} {st.rows:5.1f} {st.outside_s * 1e3:9.3f} {st.ar_rows_s * 1e3:8.3f} "
              f"{st.beyond_s * 1e3:7.3f} {float(fit.time(st.rows)) * 1e3:7.3f} {st.draft_s * 1e3:11.3f} "
              f"{st.verify_forward_s * 1e3:9.3f}")
    print(f"head step: {fit.step0 * 1e3:.3f} ms + {fit.step_row * 1e6:.1f} us per row ({fit.levels} levels)")
    print(f"{'not stored' if args.no_store else 'stored'}: {path}")


def errors(pred: np.ndarray, meas: np.ndarray) -> tuple[float, float]:
    e = np.abs(pred / meas - 1)
    return float(np.median(e)), float(e.max())


def report(grid: Grid, args: argparse.Namespace, loop: dict[int, float], ar: dict | None = None,
           draft: dict | None = None) -> BatchFit:
    from methods.measurement.batch_cost import with_ar, with_loop
    from run import compose_run_config

    keys = sorted(grid)
    b, n, c = (np.array([k[i] for k in keys], float) for i in range(3))
    t = np.array([grid[k] for k in keys])
    ref_ctx = min(args.contexts)
    fit = fit_batch_cost(grid, ref_ctx)
    pred = fit.time(b, n, c)
    print(f"\nfit ({fit.form}): t0 {fit.t0 * 1e3:.3f} ms, w {fit.w * 1e3:.3f} ms, "
          f"kv {fit.kv * 1e9:.3f} ns/(row·tok) (n >= 2: {(fit.kv_tree or fit.kv) * 1e9:.3f}), "
          f"tok {fit.tok * 1e6:.2f} us/tok, "
          f"att {fit.att * 1e9:.4f} ns/(tok·pos)")
    print(f"{'B':>3} {'n':>3} {'ctx':>4} {'measured ms':>12} {'fit ms':>9} {'err':>7}")
    for k, tm, tp in zip(keys, t, pred):
        print(f"{k[0]:3d} {k[1]:3d} {k[2]:4d} {tm * 1e3:12.2f} {tp * 1e3:9.2f} {tp / tm - 1:+7.1%}")
    rows = [("fit, in sample", *errors(pred, t))]
    contexts = sorted(set(int(x) for x in c))
    for held in contexts if len(contexts) > 1 else []:
        train = {k: v for k, v in grid.items() if k[2] != held}
        f = fit_batch_cost(train, min(k[2] for k in train))
        m = c == held
        rows.append((f"fit without context {held}, at {held}", *errors(f.time(b[m], n[m], c[m]), t[m])))
    cfg = compose_run_config(f"model={args.model}", "hardware=cpu")
    for ctx in contexts:
        shape = (ModelShape.draft if getattr(args, "draft", False) else ModelShape.target)(cfg.model)
        roof = BatchRoofline.from_config(cfg.hardware, shape, ctx)
        m = c == ctx
        rows.append((f"cpu roofline (datasheet), context {ctx}", *errors(roof.time(b[m], n[m]), t[m])))
    print(f"\n{'t(B, n) prediction':45s} {'median err':>10} {'max err':>8}   ({len(t)} points)")
    for name, med, mx in rows:
        print(f"{name:45s} {med:10.1%} {mx:8.1%}")
    if loop:
        fit = with_loop(fit, loop)
        what = ("draft step outside its forwards (chain, in the loop)" if args.draft
                else "batched loop outside the forward (autoregressive)")
        print(f"\n{what}, context {ref_ctx}: {fit.loop0 * 1e3:.3f} ms + {fit.loop_row * 1e6:.1f} us per row")
        for bb, tt in sorted(loop.items()):
            t_fwd = float(fit.time(bb, 1, ref_ctx))
            print(f"  rows {bb:5.1f}: {tt * 1e3:6.3f} ms measured, {float(fit.loop_time(bb)) * 1e3:6.3f} "
                  f"fitted ({tt / t_fwd:.0%} of a 1-token forward)")
    if draft:
        print("\nthe speculative step (draft chain) outside its target forward, less the autoregressive "
              "step's, ms per step: = the draft's forwards at the grid's price + beyond (the fit's loop "
              "terms) = draft host + the draft's forwards as the loop times them + verification and leaving "
              "rows")
        print("(the AR step's outside read at the speculative step's active rows: its rows finish apart)")
        print(f"{'B':>3} {'rows':>5} {'spec-AR':>8} {'grid fwd':>9} {'beyond':>7} | {'host':>6} "
              f"{'loop fwd':>9} {'loop/grid':>9} {'verify':>7}")
        for bb, s in sorted(draft.items()):
            print(f"{bb:3d} {s.rows:5.1f} {(s.outside_s - s.ar_rows_s) * 1e3:8.3f} {s.grid_s * 1e3:9.3f} "
                  f"{s.beyond_s * 1e3:7.3f} | {s.host_s * 1e3:6.3f} {s.forwards_s * 1e3:9.3f} "
                  f"{s.forwards_s / s.grid_s:9.2f} {s.verify_s * 1e3:7.3f}")
    if ar:
        grid_fit = fit
        fit = with_ar(fit, ar)
        print(f"\nthe loop's 1-token forward (autoregressive, mean context {fit.ar_context:.1f}): "
              f"{fit.ar0 * 1e3:.3f} ms + {fit.ar_row * 1e6:.1f} us per row; against the grid's fit there")
        for bb, s in sorted(ar.items()):
            g = float(grid_fit.time(bb, 1, s.context))
            line = float(fit.time(bb, 1, s.context))
            print(f"  B {bb:3d}: loop {s.forward_s * 1e3:6.3f} ms, line {line * 1e3:6.3f}, grid fit "
                  f"{g * 1e3:6.3f} (grid / loop {g / s.forward_s:.3f})")
    return fit


def store(fit: BatchFit, grid: Grid, args: argparse.Namespace, loop: dict[int, float], ar: dict | None = None,
          draft: dict | None = None) -> None:
    import torch

    from methods.measurement.batch_cost import batch_profile_path, save_batch_fit
    from run import compose_run_config

    torch.set_num_threads(args.threads)
    cfg = compose_run_config(f"model={args.model}", f"model.dtype={args.dtype}", f"threads={args.threads}",
                             "device=cpu")
    path = save_batch_fit(fit, batch_profile_path(cfg, role="draft" if args.draft else "target"), grid, loop,
                          ar, draft)
    print(f"\nstored: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="zoo")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    # the KV lengths the loop runs at: the code workload's prompt (128) to prompt + max_new (192); the KV
    # term is not linear far beyond them (caches), so a grid at 512 biases the fit at 160 by ~10%
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="of each cell's timed forwards (min: what a quiet machine would read)")
    ap.add_argument("--json", help="write the timed grid here")
    ap.add_argument("--from-json", help="read a timed grid instead of timing")
    ap.add_argument("--no-store", action="store_true", help="do not store the fit in the profile cache")
    ap.add_argument("--draft", action="store_true",
                    help="time the draft model's forward (its own t(B, n) fit, the vanilla draft step at B)")
    ap.add_argument("--ar-check", type=int, default=0, metavar="N",
                    help="only compare the grid's 1-token forward with the loop's, N interleaved rounds")
    ap.add_argument("--draft-check", type=int, default=0, metavar="N",
                    help="only time the draft model's forwards after the target's vs after its own, N rounds")
    ap.add_argument("--tree-check", type=int, default=0, metavar="N",
                    help="only compare the grid's (gamma + 1)-node forward with the loop's speculative one, "
                    "and the 1-token forwards beside, N interleaved rounds")
    ap.add_argument("--head", metavar="METHOD",
                    help="only time this head drafter's (mtp, eagle) step in the loop, store its line")
    args = ap.parse_args()
    if args.head:
        return head(args)
    if args.ar_check:
        return ar_check(args)
    if args.tree_check:
        return tree_check(args)
    if args.draft_check:
        return draft_check(args)
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        grid = {(int(b), int(n), int(c)): float(t) for b, n, c, t in doc["grid"]}
        args.contexts = sorted({k[2] for k in grid})
        args.model, args.dtype, args.threads = doc["model"], doc["dtype"], doc["threads"]
        args.draft = doc.get("role") == "draft"
    else:
        grid, doc = measure(args)
        if args.json:
            rows = [[*k, v] for k, v in sorted(grid.items())]
            Path(args.json).write_text(json.dumps({**doc, "grid": rows}))
    from methods.measurement.batch_cost import DraftLoopStep, LoopStep

    loop = {float(b): float(t) for b, t in doc.get("loop", [])}
    ar = {int(b): LoopStep(loop.get(float(b), 0.0), float(t), float(c))
          for b, t, c in doc.get("loop_forward", [])}
    draft = {int(b): DraftLoopStep(*map(float, rest)) for b, *rest in doc.get("draft_loop", [])}
    fit = report(grid, args, loop, ar, draft)
    if not args.no_store:
        store(fit, grid, args, loop, ar, draft)


if __name__ == "__main__":
    main()
