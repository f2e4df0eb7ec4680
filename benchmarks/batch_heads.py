"""Batched MTP and EAGLE-1/2/3 against the same drafters run per row (issue 16), and against batched
autoregressive decoding, interleaved in one process (A B C A B C ...): decode tok/s, τ and the drafter's CPU
time per row and step, for each method's batched form (methods.drafters.mtp.BatchMTP,
methods.drafters.eagle.BatchEagle: static trees, EAGLE-2's dynamic trees, EAGLE-3's fused features) and
methods.core.batch_drafter.PerRow (one drafter per row, what these drafters had before). Also checks that
both forms give every row the same tokens.

    python benchmarks/batch_heads.py --batch-sizes 4,16 --reps 2      # zoo, bf16, the presets' heads
    python benchmarks/batch_heads.py --methods eagle2,eagle3          # the dynamic trees (the presets')
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from methods.core.batch_drafter import PerRow, batched  # noqa: E402
from methods.core.batch_engine import BatchEngine  # noqa: E402
from methods.core.batch_loop import decode_batch  # noqa: E402
from methods.core.loop import DecodeOptions  # noqa: E402
from methods.core.sampling import SamplingParams  # noqa: E402
from methods.data.workloads import load_prompts  # noqa: E402
from methods.drafters.autoregressive import Autoregressive  # noqa: E402
from methods.drafters.registry import build_drafter  # noqa: E402
from methods.measurement.measure import run_tree  # noqa: E402
from methods.models import load_models  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="mtp,eagle")
    ap.add_argument("--batch-sizes", default="4,16")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import run  # composes conf/ presets

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    base = run.compose_run_config("model=zoo", "method=vanilla")
    models = load_models(base.model, "cpu", "auto")
    w = replace(base.workload, num_prompts=max(sizes))
    prompts = [torch.tensor(p.token_ids) for p in load_prompts(w, models.tokenizer, base.seed)]
    opts = DecodeOptions(max_new_tokens=args.new_tokens)
    sides: dict[str, Callable] = {"ar": lambda b: batched(Autoregressive(), b)}
    for name in args.methods.split(","):
        cfg = run.compose_run_config("model=zoo", f"method={name}")
        tree = run_tree(cfg)
        tree = tree if tree.size > 1 else None

        def make(c=cfg, t=tree):
            return build_drafter(c.method, t, models, GREEDY, c.tree)

        sides[f"{name} batched"] = lambda b, m=make: batched(m(), b)
        sides[f"{name} per-row"] = lambda b, m=make: PerRow(m(), m)
    runs = {(b, s): [] for b in sizes for s in sides}
    tokens = {}
    forms = {(b, s): make_side(b) for b in sizes for s, make_side in sides.items()}
    for rep in range(args.reps + 1):  # the first: warm-up
        for b in sizes:
            engine = BatchEngine(models.target, b)
            for s in sides:
                cpu = time.process_time()
                r = decode_batch(engine, forms[b, s], prompts[:b], opts, torch.Generator())
                cpu = time.process_time() - cpu
                tokens[b, s] = [x.token_ids for x in r.results]
                if rep:
                    runs[b, s].append({"tok_s": r.tokens / (r.time_total_s - r.time_prefill_s),
                                       "tau": r.stats.tau, "cpu_tok_s": r.tokens / cpu,
                                       "draft_ms_row_step": 1e3 * r.cpu_draft_s / r.row_steps})
    print(f"zoo bf16, threads={args.threads}, {args.new_tokens} new tokens, medians of {args.reps} (load)")
    for b in sizes:
        ar = statistics.median(x["tok_s"] for x in runs[b, "ar"])
        for s in sides:
            med = {k: statistics.median(x[k] for x in runs[b, s]) for k in runs[b, s][0]}
            same = tokens[b, s] == tokens[b, "ar"]
            print(f"B={b:>3} {s:<16} {med['tok_s']:>7.1f} tok/s ({med['tok_s'] / ar:.2f}x AR)  cpu "
                  f"{med['cpu_tok_s']:>7.1f} tok/s  tau {med['tau']:.3f}  draft "
                  f"{med['draft_ms_row_step']:.3f} ms CPU per row-step  same tokens as AR: {same}")


if __name__ == "__main__":
    main()
