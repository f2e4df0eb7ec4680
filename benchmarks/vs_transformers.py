"""specsim's decode loop side by side with Hugging Face transformers' generation: one process, same models.

    python benchmarks/vs_transformers.py --workload code [--model zoo --num-prompts 8 --reps 3]

Paths (greedy throughout; p = target, q = draft): HF ``generate`` as it comes and as a user makes it
fast (static KV cache, torch.compile), HF assisted generation (Leviathan et al. 2023, ``assistant_model=`` q,
its default dynamic schedule and a constant γ), HF prompt lookup (Saxena 2023) — benchmarks/hf_configs.py;
specsim's autoregressive, vanilla chain, prompt lookup, and its best method/tree among every registered
drafter's candidates (benchmarks/candidates.py; chosen on a selection pass, then timed with the others).
Runs are interleaved prompt by prompt so that machine noise hits every path alike; every output must equal HF
greedy token for token (in float32). A line sets t(1) beside the time to stream the target's weights once at
the bandwidth measured here (benchmarks/physical_limit.py). The last line printed is one JSON object.
benchmarks/README.md explains the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # an entry point like run.py: the packages live at the repository root
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.candidates import Context, add_race_arguments, candidates, method_config  # noqa: E402
from benchmarks.harness import BenchPath, Output, measure, median_speed, ratio  # noqa: E402
from benchmarks.hf_configs import HF_ASSISTED, HF_GREEDY, HF_PLD, configurations, working_paths  # noqa: E402
from benchmarks.physical_limit import describe, physical_limit  # noqa: E402
from methods.core.engine import ModelEngine, set_compile  # noqa: E402
from methods.core.loop import DecodeOptions, decode  # noqa: E402
from methods.core.sampling import SamplingParams  # noqa: E402
from methods.data.workloads import load_prompts  # noqa: E402
from methods.drafters.registry import build_drafter  # noqa: E402
from methods.models import Models, load_models  # noqa: E402
from specsim.config import RunConfig, Verifier  # noqa: E402
from specsim.tree import Tree  # noqa: E402

AR, VANILLA, PLD = "specsim autoregressive", "specsim vanilla", "specsim prompt_lookup"
# goals, ratios of tokens/s in the same run: issue 5's like-for-like ones, issue 17's for the best method
TARGETS = {"ar_vs_hf_greedy": 1.3, "vanilla_vs_hf_assisted": 1.5, "pld_vs_hf_pld": 1.5,
           "best_vs_hf_greedy": 3.5, "best_vs_hf_fastest": 2.5}


# ---- configs and models ---------------------------------------------------------------------------------
def compose(*overrides: str) -> RunConfig:
    """The validated RunConfig of ``python run.py <overrides>`` (the real presets; hydra stays in run.py)."""
    import run

    return run.compose_run_config(*overrides)


# ---- the paths --------------------------------------------------------------------------------------------
def specsim_path(name: str, engine: ModelEngine, make_drafter: Callable[[], object], opts: DecodeOptions,
                 candidate: bool) -> BenchPath:
    """A specsim path; ``make_drafter`` builds its drafter anew before every pass (BenchPath.fresh)."""
    drafter = [make_drafter()]

    def run(ids: torch.Tensor) -> Output:
        res = decode(engine, drafter[0], ids, opts, torch.Generator().manual_seed(0))
        return Output(res.token_ids, res.n_target_forwards)

    return BenchPath(name, run, candidate, fresh=lambda: drafter.__setitem__(0, make_drafter()))


def build_paths(args, cfg: RunConfig, models: Models, prompts, calib
                ) -> tuple[list[BenchPath], dict[str, str], dict[str, str]]:
    """Every path, in a fixed order (HF's configurations, then specsim's); the like-for-like pairs; the HF
    configurations that failed, with their errors."""
    base = (f"model={args.model}", f"workload={args.workload}", *args.overrides)
    max_new, greedy = cfg.workload.max_new_tokens, SamplingParams(temperature=0.0)
    opts = DecodeOptions(Verifier.greedy, greedy, max_new, models.tokenizer.eos_token_id)
    engine = ModelEngine(models.target)
    chain, lookup = f"chain g={args.gamma}", f"g={args.pld_tokens} n<={args.ngram}"
    paths, failed = working_paths(configurations(args, models.draft is not None), models, max_new, prompts[0])
    pairs = {AR: HF_GREEDY, f"{PLD} {lookup}": f"{HF_PLD} {lookup}"}
    if models.draft is not None:
        pairs[f"{VANILLA} {chain}"] = f"{HF_ASSISTED} {chain}"
    ctx = Context(args, models, base, engine, opts, calib, compose)

    def ours(name, overrides, tree, params, candidate):
        tree_cfg = ctx.compose(*base, *overrides).tree  # dynamic trees (EAGLE-2/3): shaped by their drafter
        method = method_config(ctx, overrides, params)
        def make():
            return build_drafter(method, tree, models, greedy, tree_cfg=tree_cfg)

        return specsim_path(name, engine, make, opts, candidate)

    paths.append(ours(AR, ("method=autoregressive",), Tree.chain(0), {}, False))
    if models.draft is not None:
        paths.append(ours(f"{VANILLA} {chain}", ("method=vanilla", "tree=chain", f"tree.gamma={args.gamma}"),
                          Tree.chain(args.gamma), {}, False))
    paths.append(ours(f"{PLD} {lookup}", ("method=prompt_lookup",), Tree.chain(args.pld_tokens),
                      {"num_pred_tokens": args.pld_tokens, "max_ngram_size": args.ngram}, False))
    for c in candidates(ctx):
        paths.append(ours(f"best? {c.name}", c.overrides, c.tree, c.params, True))
    names = {p.name for p in paths}
    pairs = {ours_: theirs for ours_, theirs in pairs.items() if theirs in names}  # a failed HF path: no pair
    return paths, pairs, failed


# ---- report -----------------------------------------------------------------------------------------------
def report(paths: list[BenchPath], pairs: dict[str, str], meta: dict) -> dict:
    """Print the table; return the JSON object (ratios = paired medians, see ``ratio``)."""
    by = {p.name: p for p in paths}
    tau = {p.name: p.selection.tokens / max(p.selection.steps, 1) for p in paths}
    equal = {p.name: p.equal / p.runs for p in paths}
    equal_ar = {p.name: p.equal_ar / p.runs for p in paths}
    pool = [p for p in paths if p.candidate or p.name in pairs and p.name != AR]
    best = max(pool, key=lambda p: p.selection.tokens / p.selection.time)  # chosen on the selection pass
    # HF's fastest working configuration: by its median over the repetitions (the generous choice for HF)
    hf_fastest = max((p for p in paths if p.hf), key=median_speed)
    greedy = by[HF_GREEDY]
    print(f"\n{'path':44s} {'tok/s':>8s} {'tau':>6s} {'xHFgreedy':>10s} {'xHFmatch':>9s} {'equal':>6s} "
          f"{'=AR':>5s}")
    for p in paths:
        match = f"{ratio(p, by[pairs[p.name]])[0]:.2f}" if p.name in pairs else ""
        mark = "  <- best (selection pass)" if p is best else "  <- HF fastest" if p is hf_fastest else ""
        print(f"{p.name:44s} {median_speed(p):8.1f} {tau[p.name]:6.2f} "
              f"{ratio(p, greedy)[0]:10.2f} {match:>9s} {equal[p.name]:6.2f} {equal_ar[p.name]:5.2f}{mark}")
    for name, error in meta["hf_failed"].items():
        print(f"{name:44s} FAILED: {error}")
    ratios = {**like_for_like(by, pairs), "best_vs_hf_greedy": ratio(best, greedy),
              "best_vs_hf_fastest": ratio(best, hf_fastest)}
    result = {k: None if r is None else round(r[0], 3) for k, r in ratios.items()}
    result.update(best_method=best.name.removeprefix("best? "), hf_fastest=hf_fastest.name,
                  all_outputs_equal=all(p.equal == p.runs for p in paths))
    result["targets_met"] = {k: result[k] is not None and result[k] >= goal for k, goal in TARGETS.items()}
    result["ratio_min_max"] = {k: [round(r[1], 3), round(r[2], 3)] for k, r in ratios.items() if r}
    result["hf_vs_hf_greedy"] = {p.name: round(ratio(p, greedy)[0], 3) for p in paths if p.hf}
    heuristic = by.get(f"{HF_ASSISTED} default (heuristic)")
    constant = next((p for n, p in by.items() if n.startswith(f"{HF_ASSISTED} chain")), None)
    result["hf_assisted_default_vs_constant"] = (round(ratio(heuristic, constant)[0], 3)
                                                 if heuristic and constant else None)
    fastest = max(pool, key=median_speed)
    result["fastest_by_median"] = fastest.name.removeprefix("best? ")
    result.update(meta, tokens_per_s={p.name: round(median_speed(p), 2) for p in paths},
                  tau=_rounded(tau), equal_rate=_rounded(equal), equal_rate_vs_specsim_ar=_rounded(equal_ar))
    return result


def like_for_like(by: dict[str, BenchPath], pairs: dict[str, str]) -> dict:
    """Issue 5's ratios: specsim's autoregressive, vanilla and prompt lookup over HF's same configuration."""
    def pair(prefix: str):
        name = next((n for n in pairs if n.startswith(prefix)), None)
        return ratio(by[name], by[pairs[name]]) if name else None

    return {"ar_vs_hf_greedy": pair(AR), "vanilla_vs_hf_assisted": pair(VANILLA), "pld_vs_hf_pld": pair(PLD)}


def _rounded(d: dict) -> dict:
    return {k: round(v, 3) for k, v in d.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides of the model/workload, e.g. "
                    "model.path=/ckpt/target model.draft_path=/ckpt/draft with --model local")
    ap.add_argument("--workload", default="code", help="conf/workload preset (code, grounded, prose, mixed)")
    ap.add_argument("--model", default="zoo", help="conf/model preset (zoo, micro, random_tiny, ...)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: the workload preset's")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the workload preset's")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (medians are reported)")
    ap.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto (the model preset's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default); 1 "
                    "by default: on a shared 2-core machine OpenMP spin-waits make 2 threads 10-20x slower")
    ap.add_argument("--seed", type=int, default=0, help="prompt selection seed")
    ap.add_argument("--gamma", type=int, default=None, help="vanilla chain = HF num_assistant_tokens "
                                                           "(default: conf/tree/chain.yaml's gamma)")
    ap.add_argument("--pld-tokens", type=int, default=10, help="lookup tokens, ours and HF's (Saxena: 10)")
    ap.add_argument("--ngram", type=int, default=3, help="max n-gram of both prompt lookups (our preset: 3)")
    add_race_arguments(ap)
    ap.add_argument("--hf-compile", choices=["all", "hf", "forward", "off"], default="all",
                    help="HF torch.compile paths: transformers' compiled decode step with the static cache "
                    "(hf), model.forward = torch.compile(model.forward) with the dynamic and static caches "
                    "(forward), both (all), none (off); each compiles for a while on first use")
    ap.add_argument("--dram-mib", type=int, default=1024, help="buffer of the main-memory bandwidth test "
                    "(past the last-level cache); 0 skips the physical-limit line")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate's per-call notices would drown the table
    overrides = [f"model={args.model}", f"workload={args.workload}", "task=measure", *args.overrides]
    overrides += [f"workload.num_prompts={args.num_prompts}"] if args.num_prompts else []
    overrides += [f"workload.max_new_tokens={args.max_new_tokens}"] if args.max_new_tokens else []
    cfg = compose(*overrides)
    set_compile(cfg.compile)  # override compile=true: specsim's engines run their compiled forward
    args.gamma = args.gamma or compose(*overrides, "tree=chain").tree.gamma
    dtype = cfg.model.dtype if args.dtype == "auto" else args.dtype
    models = load_models(cfg.model, args.device, dtype)  # a zoo is built on first use (minutes)
    prompts = [torch.tensor(p.token_ids) for p in load_prompts(cfg.workload, models.tokenizer, args.seed)]
    calib_cfg = dataclasses.replace(cfg.workload, split="calibration", num_prompts=args.calibration_prompts)
    calib = [torch.tensor(p.token_ids) for p in load_prompts(calib_cfg, models.tokenizer, args.seed)]
    paths, pairs, failed = build_paths(args, cfg, models, prompts, calib)
    t0 = time.perf_counter()
    measure(paths, prompts, args.reps, models.target, (HF_GREEDY, AR))
    limit = physical_limit(models.target, prompts[0], dram_mib=args.dram_mib) if args.dram_mib > 0 else None
    meta = {"model": args.model, "workload": args.workload, "dtype": dtype, "device": str(models.device),
            "num_prompts": len(prompts), "max_new_tokens": cfg.workload.max_new_tokens, "reps": args.reps,
            "gamma": args.gamma, "pld_tokens": args.pld_tokens, "ngram": args.ngram,
            "torch_threads": torch.get_num_threads(), "loadavg_1min": round(os.getloadavg()[0], 2),
            "seconds": round(time.perf_counter() - t0, 1), "hf_failed": failed}
    result = report(paths, pairs, meta)
    if limit is not None:
        print(describe(limit))
        result["physical_limit"] = limit
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
