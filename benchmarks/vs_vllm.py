"""specsim's decode loop side by side with vLLM (the engine people serve with): one process, same checkpoints,
same prompts, interleaved prompt by prompt (batch 1) and batch by batch (batch 16).

    make vllm && .venv-vllm/bin/python benchmarks/vs_vllm.py --workload code

Paths (greedy; p = target, q = draft; every path decodes exactly --max-new tokens, EOS ignored, so the work is
equal): vLLM plain, draft-model speculation (γ tokens), n-gram speculation, EAGLE-1 and EAGLE-3 (the zoo's
heads exported in vLLM's layout, when trained: methods.heads.eagle.vllm_export); specsim autoregressive,
vanilla chain (γ), prompt lookup, and specsim's best method: every candidate of benchmarks/candidates.py
(staged, Medusa, EAGLE-1/2/3, Sequoia trees, ...; those that train on first use only with --drafters) raced
on calibration-split prompts, the fastest then timed with the others on the measured prompts. vLLM's engine
processes get Intel OpenMP preloaded (LD_PRELOAD of the venv's libiomp5.so, as vLLM asks for speculative
decoding on CPU; --iomp off to compare). Batch 16 runs vLLM's paths and, where this checkout has issue 16's
batched loop (methods.core.batch_loop), specsim's batched autoregressive and vanilla chains (static
batches). Token equality is checked between the two engines' plain decoding (exact in float32: --dtype
float32) and within each engine between speculative and plain output. The last line printed is one JSON
object. Without vLLM installed it says how to install it and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.candidates import Context, add_race_arguments, candidates, method_config  # noqa: E402
from methods.measurement.vllm_engine import INSTALL_HINT, available  # noqa: E402

GOAL_B1 = 1.5  # issue 18: specsim's best at batch 1 ≥ 1.5 × vLLM's best speculative configuration
BATCH_LOOP_MISSING = "specsim batch-16: needs issue 16's batched loop (not in this checkout)"


@dataclass
class Path_:
    name: str
    engine: str  # "vllm" | "specsim"
    batch: int
    seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    decode_steps: int = 0  # vLLM: sequences' decode steps (one that drafted nothing counted: Counters)
    accepted: int = 0
    steps: int = 0  # specsim: target forwards

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / sum(self.seconds) if self.seconds else float("nan")

    @property
    def tau(self) -> float:
        if self.engine == "vllm":
            return 1.0 + self.accepted / self.decode_steps if self.decode_steps else 1.0
        return self.tokens / self.steps if self.steps else float("nan")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="code")
    ap.add_argument("--model", default="zoo")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4, help="vLLM's num_speculative_tokens; specsim's vanilla γ")
    ap.add_argument("--pld-tokens", type=int, default=4, help="specsim's fixed prompt-lookup path's tokens")
    ap.add_argument("--ngram", type=int, default=3, help="max n-gram of both engines' lookups")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile (faster start)")
    ap.add_argument("--iomp", choices=["on", "off"], default="on",
                    help="preload Intel OpenMP (the venv's libiomp5.so) into vLLM's engine processes")
    ap.add_argument("--vllm-eagle3-layers", type=int, nargs=3, default=None,
                    help="the EAGLE-3 head vLLM runs fuses these (0-based) target layers (default: the "
                    "method=eagle3 preset's, whatever head it resolves to). vLLM taps layers before the "
                    "final norm, so a head on the top layer cannot be exported exactly (the run warns); "
                    "e.g. 0 2 4 with --eagle train trains an exact one")
    ap.add_argument("--float32-cache", action="store_true",
                    help="batch > 1: also specsim's batched autoregressive over a float32 KV cache (the "
                    "engine before methods.core.mixed_attention's bf16 cache), interleaved with the others")
    add_race_arguments(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not available():
        print(INSTALL_HINT)
        print(json.dumps({"vllm": "not installed"}))
        return 0
    import torch

    from methods.measurement.vllm_engine import preload_intel_openmp
    from methods.measurement.vllm_measure import checkpoints

    preloaded = preload_intel_openmp() if args.iomp == "on" else None
    cfg = compose(*base_overrides(args), f"workload.num_prompts={args.num_prompts}",
                  f"workload.max_new_tokens={args.max_new}")
    ck = checkpoints(cfg)
    started = time.perf_counter()
    vllm, failed = vllm_engines(args, ck)
    print(f"vLLM engines {list(vllm)} started in {time.perf_counter() - started:.0f} s "
          f"(LD_PRELOAD {preloaded or 'not set: vLLM preloads its libgomp'})", flush=True)
    torch.set_num_threads(1)  # vLLM's worker holds the other core (its default CPU binding)
    os.environ.pop("LD_PRELOAD", None)
    specsim, race, ctx = specsim_paths(cfg, args)
    prompts = [p.token_ids for p in load(cfg, ck)]
    results: list[Path_] = []
    for b in args.batch_sizes:
        results += run_batch(b, prompts, vllm, specsim if b == 1 else batch_paths(ctx, args, b), args.max_new)
    report(results, race, args, preloaded, failed)
    return 0


def base_overrides(args) -> tuple[str, ...]:
    return (f"model={args.model}", f"workload={args.workload}", f"model.dtype={args.dtype}")


def compose(*overrides: str):
    import run

    return run.compose_run_config(*overrides)


def load(cfg, ck):
    from transformers import AutoTokenizer

    from methods.data.workloads import load_prompts

    tok = AutoTokenizer.from_pretrained(ck.tokenizer_dir, local_files_only=True)
    return load_prompts(cfg.workload, tok, cfg.seed)


# ---- vLLM's side ------------------------------------------------------------------------------------------
def vllm_engines(args, ck) -> tuple[dict, dict[str, str]]:
    """vLLM's paths: plain, draft model, n-gram, and EAGLE-1 / EAGLE-3 where trained heads exist (exported in
    vLLM's layout; --eagle train trains them). Returns the started engines and, per path that did not
    start, why."""
    from methods.measurement.vllm_engine import VllmEngine, VllmSettings, plan_for

    # a quarter GiB of KV cache holds a batch of 16 on the zoo target many times over; five engines at once
    settings = VllmSettings(dtype=args.dtype, enforce_eager=args.enforce_eager, kv_cache_gib=0.25)
    plans = {"vllm plain": plan_for("autoregressive", 0, None),
             "vllm ngram": plan_for("prompt_lookup", args.gamma, None, {"max_ngram": args.ngram})}
    if ck.draft_dir:
        plans["vllm draft_model"] = plan_for("draft_model", args.gamma, ck.draft_dir)
    for name, head_dir in eagle_heads(args).items():
        plans[f"vllm {name}"] = plan_for(name, args.gamma, str(head_dir))
    engines, failed = {}, {}
    for name, plan in plans.items():
        try:
            engines[name] = VllmEngine(ck.target_dir, plan, settings)
        except Exception as e:  # one path that vLLM cannot start must not cost the others their row
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            failed[name] = reason
            print(f"{name}: FAILED to start ({reason}; vLLM's own log above says why)", flush=True)
    return engines, failed


def eagle_heads(args) -> dict:
    """eagle / eagle3 → the head's export for vLLM, for the heads that are trained (or --eagle train)."""
    from methods.measurement.vllm_measure import eagle_for_vllm

    if args.eagle == "off":
        return {}
    base = base_overrides(args)
    eagle3 = ("method=eagle3",)
    if args.vllm_eagle3_layers:
        eagle3 += ("method.params.feature_layers=[" + ",".join(map(str, args.vllm_eagle3_layers)) + "]",)
    configs = {"eagle": compose(*base, "method=eagle"), "eagle3": compose(*base, *eagle3)}
    out = {}
    for name, cfg in configs.items():
        got = eagle_for_vllm(cfg, train=args.eagle == "train")
        if got is None:
            print(f"vllm {name}: no trained head for this target (--eagle train trains one)", flush=True)
        else:
            out[name] = got[0]
    return out


# ---- specsim's side ---------------------------------------------------------------------------------------
def specsim_paths(cfg, args) -> tuple[dict, list[tuple[str, float, float]], Context]:
    """name → callable(prompt ids) -> (tokens, target forwards): specsim's autoregressive, vanilla and prompt
    lookup paths and the race's winner; and the race (candidate, tokens/s, τ on calibration prompts)."""
    import dataclasses

    import torch

    from methods.core.engine import ModelEngine
    from methods.core.loop import DecodeOptions
    from methods.core.sampling import SamplingParams
    from methods.data.workloads import load_prompts
    from methods.models import load_models
    from specsim.config import Verifier
    from specsim.tree import Tree

    models = load_models(cfg.model, "cpu", args.dtype)
    engine = ModelEngine(models.target)
    greedy = SamplingParams(0.0)
    opts = DecodeOptions(Verifier.greedy, greedy, args.max_new, None)  # no EOS: vLLM ignores it too
    calib_w = dataclasses.replace(cfg.workload, split="calibration", num_prompts=args.calibration_prompts)
    calib = [torch.tensor(p.token_ids) for p in load_prompts(calib_w, models.tokenizer, cfg.seed)]
    ctx = Context(args, models, base_overrides(args), engine, opts, calib, compose)
    fixed = [("specsim autoregressive", ("method=autoregressive",), Tree.chain(0), {})]
    if models.draft is not None:
        fixed.append(("specsim vanilla", ("method=vanilla", "tree=chain"), Tree.chain(args.gamma), {}))
    fixed.append(("specsim prompt_lookup", ("method=prompt_lookup",), Tree.chain(args.pld_tokens),
                  {"num_pred_tokens": args.pld_tokens, "max_ngram_size": args.ngram}))
    paths = {name: runner(ctx, o, t, p) for name, o, t, p in fixed}
    race = [(f"specsim best: {c.name}", runner(ctx, c.overrides, c.tree, c.params)) for c in candidates(ctx)]
    scores = select(race, calib)
    if scores:
        best = max(scores, key=lambda s: s[1])[0]
        paths[best] = dict(race)[best]
    return paths, scores, ctx


def batch_paths(ctx: Context, args, batch: int) -> dict:
    """specsim's batched loop (issue 16: methods.core.batch_loop) at this batch size, where this checkout
    has it: batched autoregressive and vanilla chains, one call per chunk of prompts; else none."""
    import importlib.util

    if importlib.util.find_spec("methods.core.batch_loop") is None:
        return {}
    import torch

    from methods.core.batch_drafter import batched
    from methods.core.batch_engine import BatchEngine
    from methods.core.batch_loop import decode_batch
    from methods.drafters.autoregressive import Autoregressive
    from methods.drafters.registry import build_drafter
    from specsim.tree import Tree

    engine = BatchEngine(ctx.models.target, batch)
    sides = {"specsim batched autoregressive": (engine, batched(Autoregressive(), batch))}
    if ctx.models.draft is not None:
        method = method_config(ctx, ("method=vanilla", "tree=chain"), {})
        vanilla = build_drafter(method, Tree.chain(args.gamma), ctx.models, ctx.opts.sampling)
        sides["specsim batched vanilla"] = (engine, batched(vanilla, batch))
    if args.float32_cache:
        BatchEngine.mixed_cache = False
        sides["specsim batched autoregressive float32-cache"] = (BatchEngine(ctx.models.target, batch),
                                                                 batched(Autoregressive(), batch))
        BatchEngine.mixed_cache = True

    def runner(engine, side):
        def run(chunk: list[list[int]]) -> tuple[list[list[int]], int]:
            r = decode_batch(engine, side, [torch.tensor(ids) for ids in chunk], ctx.opts, torch.Generator())
            return [res.token_ids for res in r.results], r.row_steps
        return run
    return {name: runner(*side) for name, side in sides.items()}


def runner(ctx: Context, overrides, tree, params):
    import torch

    from methods.core.loop import decode
    from methods.drafters.registry import build_drafter

    tree_cfg = ctx.compose(*ctx.base, *overrides).tree  # dynamic trees (EAGLE-2/3) are shaped by the drafter
    drafter = build_drafter(method_config(ctx, overrides, params), tree, ctx.models, ctx.opts.sampling,
                            tree_cfg=tree_cfg)

    def run(ids: list[int]) -> tuple[list[int], int]:
        res = decode(ctx.engine, drafter, torch.tensor(ids), ctx.opts, torch.Generator().manual_seed(0))
        return res.token_ids, res.n_target_forwards
    return run


def select(race: list, calib) -> list[tuple[str, float, float]]:
    """Each candidate on the calibration prompts (after one warm-up call): (name, tokens/s, τ)."""
    out = []
    for name, run in race:
        run(calib[0][:16].tolist())
        tokens = steps = 0
        t0 = time.perf_counter()
        for ids in calib:
            toks, n = run(ids.tolist())
            tokens, steps = tokens + len(toks), steps + n
        out.append((name, tokens / (time.perf_counter() - t0), tokens / max(steps, 1)))
        print(f"race: {name:48s} {out[-1][1]:8.1f} tok/s  tau {out[-1][2]:.2f}", flush=True)
    return out


# ---- the measured runs ------------------------------------------------------------------------------------
def run_batch(batch: int, prompts: list[list[int]], vllm: dict, specsim: dict, max_new: int) -> list[Path_]:
    paths = {n: Path_(n, "vllm", batch) for n in vllm} | {n: Path_(n, "specsim", batch) for n in specsim}
    for engine in vllm.values():  # warm-up at this batch size
        engine.generate(prompts[:batch], 8)
    for run in specsim.values():
        run([prompts[0][:16]] * batch if batch > 1 else prompts[0][:16])
    for i in range(0, len(prompts) - batch + 1, batch):
        chunk = prompts[i : i + batch]
        for name, engine in vllm.items():
            gen = engine.generate(chunk, max_new)
            p = paths[name]
            p.seconds.append(gen.seconds)
            p.tokens += gen.new_tokens
            p.outputs += gen.token_ids
            p.decode_steps += gen.counters.decode_steps
            p.accepted += gen.counters.accepted
        for name, run in specsim.items():
            p = paths[name]
            for ids in ([chunk] if batch > 1 else chunk):  # batched loop: the chunk at once
                t0 = time.perf_counter()
                toks, steps = run(ids)
                p.seconds.append(time.perf_counter() - t0)
                rows = toks if batch > 1 else [toks]
                p.tokens, p.steps = p.tokens + sum(map(len, rows)), p.steps + steps
                p.outputs += rows
    return list(paths.values())


def equal_rate(a: Path_, b: Path_) -> float:
    pairs = list(zip(a.outputs, b.outputs))
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else float("nan")


# ---- report -----------------------------------------------------------------------------------------------
def report(results: list[Path_], race: list, args, preloaded: str | None,
           failed: dict[str, str] | None = None) -> None:
    by = {(p.name, p.batch): p for p in results}
    omp = "iomp5" if preloaded else "gomp"
    print(f"\nworkload={args.workload} dtype={args.dtype} γ={args.gamma} max_new={args.max_new} "
          f"prompts={args.num_prompts} vLLM OpenMP: {preloaded or 'libgomp (vLLM default)'} "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'path':48s} {'batch':>5s} {'tok/s':>9s} {'tau':>6s} {'= plain':>8s} {'omp':>6s}")
    out: dict = {"workload": args.workload, "dtype": args.dtype, "gamma": args.gamma,
                 "vllm_iomp_preloaded": bool(preloaded), "loadavg_1min": round(os.getloadavg()[0], 2)}
    for p in results:
        ar = "specsim autoregressive" if p.batch == 1 else "specsim batched autoregressive"
        plain = by.get(("vllm plain" if p.engine == "vllm" else ar, p.batch))
        eq = equal_rate(p, plain) if plain else float("nan")
        print(f"{p.name:48s} {p.batch:5d} {p.tokens_per_s:9.1f} {p.tau:6.2f} {eq:8.2f} "
              f"{omp if p.engine == 'vllm' else 'gomp':>6s}")
        out[f"{p.name} b{p.batch}"] = {"tokens_per_s": round(p.tokens_per_s, 1), "tau": round(p.tau, 3),
                                       "equal_to_plain": eq}
    batched_specsim = any(p.engine == "specsim" and p.batch > 1 for p in results)
    if any(b > 1 for b in args.batch_sizes) and not batched_specsim:
        print(BATCH_LOOP_MISSING)
        out["specsim_batch16"] = BATCH_LOOP_MISSING
    out["race_calibration"] = {n: {"tokens_per_s": round(t, 1), "tau": round(tau, 3)} for n, t, tau in race}
    for name, reason in (failed or {}).items():
        print(f"{name:48s} FAILED to start: {reason}")
    if failed:
        out["vllm_failed"] = dict(failed)
    out.update(ratios(by, results))
    print(json.dumps(out))


def ratios(by: dict, results: list[Path_]) -> dict:
    """Per batch size B: best specsim over best vLLM speculative path (and over vLLM's best path, plain
    included: at B = 16 plain decoding can be vLLM's fastest), specsim's plain loop over vLLM's plain; at
    B = 1 the goal and the engines' plain-output equality. Keys end in _b<B>."""
    out: dict = {}
    print()
    for b in sorted({p.batch for p in results}):
        out.update(batch_ratios(by, [p for p in results if p.batch == b], b))
    return out


def batch_ratios(by: dict, rows: list[Path_], b: int) -> dict:
    def fastest(paths):
        return max(paths, key=lambda p: p.tokens_per_s, default=None)

    best_specsim = fastest(p for p in rows if p.engine == "specsim")
    best_vllm = fastest(p for p in rows if p.engine == "vllm")
    best_spec = fastest(p for p in rows if p.engine == "vllm" and p.name != "vllm plain")
    if not (best_specsim and best_spec):
        return {}
    ratio = best_specsim.tokens_per_s / best_spec.tokens_per_s
    out = {f"best_specsim_b{b}": best_specsim.name, f"best_vllm_spec_b{b}": best_spec.name,
           f"best_specsim_vs_best_vllm_spec_b{b}": round(ratio, 3),
           f"best_specsim_vs_best_vllm_b{b}": round(best_specsim.tokens_per_s / best_vllm.tokens_per_s, 3)}
    ar = by.get(("specsim autoregressive" if b == 1 else "specsim batched autoregressive", b))
    plain = by.get(("vllm plain", b))
    if ar and plain:
        out[f"specsim_plain_vs_vllm_plain_b{b}"] = round(ar.tokens_per_s / plain.tokens_per_s, 3)
    line = (f"batch {b}: best specsim ({best_specsim.name}) / best vLLM speculative ({best_spec.name}) = "
            f"{ratio:.2f}x")
    if b == 1:
        engines_equal = equal_rate(ar, plain) if ar and plain else float("nan")
        out.update(goal_met=ratio >= GOAL_B1, engines_plain_equal_rate=engines_equal)
        line += f" (goal ≥ {GOAL_B1}); specsim AR = vLLM plain on {engines_equal:.0%} of prompts"
    print(line)
    return out


if __name__ == "__main__":
    sys.exit(main())
