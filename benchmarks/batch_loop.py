"""Throughput of specsim's batched decode loop (issue 16): tokens/s of batched autoregressive decoding and of
batched vanilla speculative decoding (the draft model chain of the method=vanilla preset) for each batch size,
the share of a decode step spent outside the target forward (drafting, verification, bookkeeping), and the
batched-vs-alone identity rate (greedy rows against each prompt decoded alone by the one-sequence loop).

Each batch decodes B workload prompts (code, test split) for --new-tokens tokens each, static batch (no
continuous joining, so every row runs the whole time unless it hits EOS). Figures are medians over --reps
interleaved repetitions; tok/s counts generated tokens over the decode time (prefill left out: the anchor,
vLLM's CPU build at batch 16 on the zoo target, ~1,600-2,000 tok/s bf16 one thread, is a steady-state figure),
over the whole time, and over the process's CPU time of the decode (one thread: what a loaded machine
distorts least; the prefill's CPU time, timed by a one-token run, is taken off).
"outside" = the decode time outside the target forward (drafting included); "overhead" = outside minus
drafting: the loop's own work (verification, commit, bookkeeping). The same split is printed in CPU time
(BatchResult.cpu_*: the process's CPU time of the steps, the drafter's propose + feedback, the target
forward), which a loaded machine distorts less than the wall times.

    python benchmarks/batch_loop.py                                   # zoo target, bfloat16, one thread
    python benchmarks/batch_loop.py --dtype float32 --batch-sizes 1,4,16 --identity
    python benchmarks/batch_loop.py --batch-sizes 16 --prefill-tokens 100000,512  # prefill: 1 forward/groups
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from methods.core.batch_drafter import batched  # noqa: E402
from methods.core.batch_engine import BatchEngine  # noqa: E402
from methods.core.batch_loop import BatchResult, decode_batch  # noqa: E402
from methods.core.engine import ModelEngine  # noqa: E402
from methods.core.loop import DecodeOptions, decode  # noqa: E402
from methods.core.sampling import SamplingParams  # noqa: E402
from methods.data.workloads import load_prompts  # noqa: E402
from methods.drafters.autoregressive import Autoregressive  # noqa: E402
from methods.drafters.registry import build_drafter  # noqa: E402
from methods.models import load_models  # noqa: E402
from specsim.tree import Tree  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
FLOAT32_CACHE = "float32-cache"  # --kv-dtypes: the default attention over a float32 cache (no mixed kernel)


def _rates(r: BatchResult, cpu_s: float) -> dict[str, float]:
    """tok/s over the decode time and the whole time; over the process's CPU time of the decode (``cpu_s``:
    one thread, the time it actually ran, a figure a loaded machine distorts less; the prefill's CPU time,
    timed by a one-token run, taken off); the share of the decode time outside the
    target forward, and of it what is neither the forward nor drafting (the loop's own overhead); the same
    shares of the steps' CPU time (``cpu_outside``, ``cpu_draft``: propose + feedback alone, ``cpu_loop``:
    the rest)."""
    decode_s = r.time_total_s - r.time_prefill_s
    return {"decode_tok_s": r.tokens / decode_s, "total_tok_s": r.tokens / r.time_total_s,
            "cpu_tok_s": (r.tokens - len(r.results)) / cpu_s, "outside": 1 - r.time_forward_s / decode_s,
            "overhead": 1 - (r.time_forward_s + r.time_draft_s) / decode_s, "tau": r.stats.tau,
            "cpu_outside": 1 - r.cpu_forward_s / r.cpu_steps_s, "cpu_draft": r.cpu_draft_s / r.cpu_steps_s,
            "cpu_loop": 1 - (r.cpu_forward_s + r.cpu_draft_s) / r.cpu_steps_s}


def bench(models, cfg, prompts: list[torch.Tensor], sizes: list[int], new_tokens: int, reps: int,
          kv_dtypes: tuple[str, ...] = ("model",)) -> dict:
    """{B: {side: rates}} medians over reps (each rep: every side, every B, interleaved). Sides: "ar" and
    "vanilla" per KV dtype of the batched engines (target's and draft's): "model" (the engine's default) is
    named plainly, another (e.g. "bfloat16": the engine before it chose float32 on CPUs without AMX;
    ``FLOAT32_CACHE``: the default attention over a float32 cache, the engine before the mixed-precision
    kernel) as "ar@bfloat16"."""
    opts = DecodeOptions(max_new_tokens=new_tokens)  # no EOS: every row decodes new_tokens tokens
    room = max(x.numel() for x in prompts) + new_tokens + 16
    tree = Tree.chain(int(cfg.tree.gamma))
    draft = build_drafter(cfg.method, tree, models, GREEDY)
    engines: dict[tuple[int, str], BatchEngine] = {}
    sides: dict[int, dict[str, tuple]] = {b: {} for b in sizes}
    for kv in kv_dtypes:
        BatchEngine.default_attn_dtype = None if kv in ("model", FLOAT32_CACHE) else getattr(torch, kv)
        BatchEngine.mixed_cache = kv != FLOAT32_CACHE
        tag = "" if kv == "model" else f"@{kv}"
        for b in sizes:
            engines[b, kv] = BatchEngine(models.target, b, capacity=room)
            sides[b] |= {f"ar{tag}": (engines[b, kv], batched(Autoregressive(), b)),
                         f"vanilla{tag}": (engines[b, kv], batched(draft, b))}
    BatchEngine.default_attn_dtype, BatchEngine.mixed_cache = None, True
    runs: dict[int, dict[str, list[dict]]] = {b: {name: [] for name in sides[b]} for b in sizes}
    one = DecodeOptions(max_new_tokens=1)  # the prefill and one step: its CPU time is taken off the decode's
    for rep in range(reps + 1):  # the first is the warm-up
        for b in sizes:
            for name, (engine, side) in sides[b].items():
                cpu = time.process_time()
                decode_batch(engine, side, prompts[:b], one, torch.Generator())
                cpu_prefill = time.process_time() - cpu
                r = decode_batch(engine, side, prompts[:b], opts, torch.Generator())
                if rep:
                    runs[b][name].append(_rates(r, time.process_time() - cpu - 2 * cpu_prefill))
    return {b: {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in per.items()}
            for b, per in runs.items()}


def prefill_times(models, prompts: list[torch.Tensor], sizes: list[int], budgets: list[int], reps: int
                  ) -> dict[int, dict[int, float]]:
    """{B: {budget: median seconds}} of one batched prefill of B prompts (all but their last token, as
    decode_batch does) on the target's engine with ``prefill_tokens`` = budget, interleaved budget by budget
    in each repetition (after a warm-up one)."""
    out: dict[int, dict[int, list[float]]] = {b: {k: [] for k in budgets} for b in sizes}
    for b in sizes:
        engine = BatchEngine(models.target, b, capacity=max(x.numel() for x in prompts[:b]))
        for rep in range(reps + 1):
            for k in budgets:
                engine.prefill_tokens = k
                engine.reset()
                engine.add(b)
                t0 = time.perf_counter()
                engine.prefill([x[:-1] for x in prompts[:b]])
                if rep:
                    out[b][k].append(time.perf_counter() - t0)
    return {b: {k: statistics.median(v) for k, v in per.items()} for b, per in out.items()}


def identity(models, cfg, prompts: list[torch.Tensor], b: int, new_tokens: int) -> dict[str, float]:
    """Share of rows whose batched greedy output equals the prompt decoded alone (AR, one-sequence loop)."""
    opts = DecodeOptions(max_new_tokens=new_tokens, eos_token_id=models.tokenizer.eos_token_id)
    alone = [decode(ModelEngine(models.target), Autoregressive(), x, opts, torch.Generator()).token_ids
             for x in prompts]
    draft = build_drafter(cfg.method, Tree.chain(int(cfg.tree.gamma)), models, GREEDY)
    out = {}
    for name, side in (("ar", batched(Autoregressive(), b)), ("vanilla", batched(draft, b))):
        target = BatchEngine(models.target, b)
        r = decode_batch(target, side, prompts, opts, torch.Generator(), continuous=True)
        out[name] = sum(x.token_ids == y for x, y in zip(r.results, alone)) / len(prompts)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="zoo", help="a conf/model preset")
    ap.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-dtypes", default="model",
                    help="comma list: the batched engines' KV/attention dtype per compared variant: model "
                    "(the engine's default: float32 attention on a CPU without AMX, over a bf16 cache with "
                    "the mixed-precision kernel, else the model's), e.g. bfloat16 (the engine before that "
                    f"rule) and {FLOAT32_CACHE} (float32 attention over a float32 cache: the engine before "
                    "the kernel), interleaved in one process")
    ap.add_argument("--prefill-tokens", default="",
                    help="comma list of BatchEngine.prefill_tokens budgets: also time one batched prefill "
                    "of B prompts with each (interleaved; e.g. 512,100000 = grouped rows vs one forward)")
    ap.add_argument("--identity", type=int, default=0, metavar="N",
                    help="also the batched-vs-alone identity rate over N prompts (batch 16)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import run  # the repository's entry point: composes conf/ presets (Hydra stays there)

    cfg = run.compose_run_config(f"model={args.model}", "method=vanilla")
    models = load_models(cfg.model, "cpu", args.dtype)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    n = max(max(sizes), args.identity)
    w = replace(cfg.workload, num_prompts=n, prompt_tokens=args.prompt_tokens)
    prompts = [torch.tensor(p.token_ids) for p in load_prompts(w, models.tokenizer, cfg.seed)]
    kv_dtypes = tuple(args.kv_dtypes.split(","))
    res = bench(models, cfg, prompts, sizes, args.new_tokens, args.reps, kv_dtypes)
    print(f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()} new_tokens="
          f"{args.new_tokens} prompt_tokens~{args.prompt_tokens} gamma={cfg.tree.gamma} "
          f"(medians of {args.reps})")
    print(f"{'B':>4} {'AR tok/s':>9} {'total':>6} {'cpu':>6} {'outside':>8} | {'vanilla tok/s':>13} "
          f"{'total':>6} {'cpu':>6} {'tau':>5} {'outside':>8} {'overhead':>8} {'speedup':>8}")
    for b in sizes:
        ar, va = res[b]["ar"], res[b]["vanilla"]
        print(f"{b:>4} {ar['decode_tok_s']:>9.0f} {ar['total_tok_s']:>6.0f} {ar['cpu_tok_s']:>6.0f} "
              f"{ar['outside']:>8.1%} | {va['decode_tok_s']:>13.0f} {va['total_tok_s']:>6.0f} "
              f"{va['cpu_tok_s']:>6.0f} {va['tau']:>5.2f} {va['outside']:>8.1%} {va['overhead']:>8.1%} "
              f"{va['decode_tok_s'] / ar['decode_tok_s']:>7.2f}x")
    print("shares of the decode steps' CPU time (load distorts these less than the wall shares above):")
    for b in sizes:
        ar, va = res[b]["ar"], res[b]["vanilla"]
        print(f"{b:>4} ar: outside the forward {ar['cpu_outside']:.1%} | vanilla: outside the forward "
              f"{va['cpu_outside']:.1%} = draft {va['cpu_draft']:.1%} + loop {va['cpu_loop']:.1%}")
    for kv in kv_dtypes:
        if kv == "model":
            continue
        print(f"KV/attention in the engine's default vs in {kv} (decode tok/s ratio, same process, "
              "interleaved):")
        for b in sizes:
            line = f"{b:>4}"
            for side in ("ar", "vanilla"):
                new, old = res[b][side], res[b][f"{side}@{kv}"]
                line += (f" | {side} {old['decode_tok_s']:>6.0f} -> {new['decode_tok_s']:>6.0f} tok/s "
                         f"({new['decode_tok_s'] / old['decode_tok_s']:.2f}x, "
                         f"with prefill {new['total_tok_s'] / old['total_tok_s']:.2f}x, "
                         f"cpu {new['cpu_tok_s'] / old['cpu_tok_s']:.2f}x)")
            print(line)
    summary = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
               "new_tokens": args.new_tokens, "results": {str(b): r for b, r in res.items()}}
    if 16 in res:
        summary["outside_forward_fraction_b16"] = {k: res[16][k]["outside"] for k in ("ar", "vanilla")}
        summary["loop_overhead_fraction_b16"] = {k: res[16][k]["overhead"] for k in ("ar", "vanilla")}
        summary["cpu_shares_b16"] = {k: {x: res[16][k][f"cpu_{x}"] for x in ("outside", "draft", "loop")}
                                     for k in ("ar", "vanilla")}
    if args.prefill_tokens:
        budgets = [int(x) for x in args.prefill_tokens.split(",")]
        pre = prefill_times(models, prompts, sizes, budgets, args.reps)
        summary["prefill_s"] = {str(b): {str(k): v for k, v in per.items()} for b, per in pre.items()}
        print("one batched prefill (median s) per BatchEngine.prefill_tokens budget, interleaved:")
        for b, per in pre.items():
            first = per[budgets[0]]
            print(f"{b:>4} " + " | ".join(f"{k}: {v * 1e3:7.1f} ms ({first / v:.2f}x of {budgets[0]})"
                                          for k, v in per.items()))
    if args.identity:
        summary["identity_rate"] = identity(models, cfg, prompts[: args.identity], 16, args.new_tokens)
        print(f"batched-vs-alone identity over {args.identity} prompts (batch 16): "
              f"{summary['identity_rate']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
