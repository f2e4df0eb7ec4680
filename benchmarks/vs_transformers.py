"""specsim's decode loop side by side with Hugging Face transformers' generation: one process, same models.

    python benchmarks/vs_transformers.py --workload code [--model zoo --num-prompts 8 --reps 3]

Paths (greedy throughout; p = target, q = draft): HF ``generate``; HF assisted generation (Leviathan et al.
2023, ``assistant_model=`` q, constant γ); HF prompt lookup (Saxena 2023, ``prompt_lookup_num_tokens=``);
specsim's autoregressive, vanilla chain, prompt lookup, and its best method/tree among a few candidates
(chosen on a selection pass, then timed with the others). Runs are interleaved prompt by prompt so that
machine noise hits every path alike; every output must equal HF greedy token for token. The last line printed
is one JSON object. benchmarks/README.md explains the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # an entry point like run.py: the packages live at the repository root
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from methods.core.engine import ModelEngine  # noqa: E402
from methods.core.loop import DecodeOptions, decode  # noqa: E402
from methods.core.metrics import AcceptStats  # noqa: E402
from methods.core.sampling import SamplingParams  # noqa: E402
from methods.data.workloads import load_prompts  # noqa: E402
from methods.drafters.registry import build_drafter  # noqa: E402
from methods.models import Models, load_models  # noqa: E402
from specsim.config import MethodConfig, RunConfig, Verifier  # noqa: E402
from specsim.tree import Tree  # noqa: E402

HF_GREEDY, HF_ASSISTED, HF_PLD = "hf greedy", "hf assisted", "hf prompt_lookup"
AR, VANILLA, PLD = "specsim autoregressive", "specsim vanilla", "specsim prompt_lookup"
# issue 5's performance goals (ratios of tokens/s, same run)
TARGETS = {"ar_vs_hf_greedy": 1.3, "vanilla_vs_hf_assisted": 1.5, "pld_vs_hf_pld": 1.5,
           "best_vs_hf_greedy": 2.5}


@dataclass(frozen=True)
class Output:
    tokens: list[int]
    steps: int  # target forwards that verified drafts (HF: every target forward; its first also prefills)


@dataclass
class Pass:
    """One path's totals over all prompts in one pass."""

    outputs: list[list[int]]  # generated tokens per prompt
    time: float = 0.0
    steps: int = 0

    @property
    def tokens(self) -> int:
        return sum(map(len, self.outputs))


@dataclass
class BenchPath:
    name: str
    run: Callable[[torch.Tensor], Output]
    candidate: bool = False  # in the race for "best"
    counter: list[int] | None = None  # HF paths: the target-forward counter during the selection pass
    selection: Pass | None = None
    reps: list[Pass] = field(default_factory=list)
    equal: int = 0  # runs (prompt x pass) whose output equals HF greedy's in the selection pass
    equal_ar: int = 0  # ... equals specsim autoregressive's (same numerics as specsim's other paths)
    runs: int = 0


# ---- configs and models ---------------------------------------------------------------------------------
def compose(*overrides: str) -> RunConfig:
    """The validated RunConfig of ``python run.py <overrides>`` (the real presets; hydra stays in run.py)."""
    import run

    return run.compose_run_config(*overrides)


# ---- the paths --------------------------------------------------------------------------------------------
def hf_path(name: str, models: Models, max_new: int, **extra) -> BenchPath:
    """HF ``generate``: greedy, the tokenizer's EOS, no minimum length — it stops only where specsim does."""
    tok = models.tokenizer
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    kwargs = dict(max_new_tokens=max_new, min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=eos,
                  pad_token_id=pad, temperature=None, top_p=None, top_k=None, **extra)

    @torch.inference_mode()
    def run(ids: torch.Tensor) -> Output:
        ids = ids.to(models.device)[None]  # (1, T)
        out = models.target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return Output(out[0, ids.shape[1]:].tolist(), 0)

    return BenchPath(name, run)


def configure_assistant(draft: torch.nn.Module, gamma: int) -> None:
    """Exactly γ draft tokens per step, as our chain: transformers' defaults may adapt γ (the "heuristic"
    schedule persists it across calls) and stop drafting below a draft confidence of 0.4."""
    gc = draft.generation_config
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = gamma, "constant"
    gc.assistant_confidence_threshold = 0.0


def specsim_path(name: str, engine: ModelEngine, drafter, opts: DecodeOptions, candidate: bool) -> BenchPath:
    def run(ids: torch.Tensor) -> Output:
        res = decode(engine, drafter, ids, opts, torch.Generator().manual_seed(0))
        return Output(res.token_ids, res.n_target_forwards)

    return BenchPath(name, run, candidate)


@dataclass(frozen=True)
class Candidate:
    name: str
    overrides: tuple[str, ...]  # method/tree presets (compose)
    tree: Tree | None  # None: the drafter's own (medusa)
    params: dict = field(default_factory=dict)  # method.params overrides


def _method(overrides: tuple[str, ...], base: tuple[str, ...], params: dict) -> MethodConfig:
    method = compose(*base, *overrides).method
    method.params = {**method.params, **params}
    return method


def measured_rank_vector(models: Models, base: tuple[str, ...], engine, opts, prompts, *, width: int) -> list:
    """Sequoia's positional vector [0, p_1..p_W, p_none] of this draft, measured on calibration prompts with a
    star tree (the root's top-W draft children, greedy verification)."""
    method = _method(("method=vanilla",), base, {})
    drafter = build_drafter(method, Tree.kary(width, 1), models, opts.sampling)
    stats = AcceptStats()
    for ids in prompts:
        stats.merge(decode(engine, drafter, ids, opts, torch.Generator().manual_seed(0)).stats)
    vec = stats.by_rank()
    return vec + [0.0] * (width + 2 - len(vec)) if vec else [0.0] * (width + 1) + [1.0]


def candidates(args, models: Models, base, engine, opts, calib) -> list[Candidate]:
    """specsim's contenders for "best": vanilla chains, a k-ary tree, Sequoia trees for the measured vector,
    prompt lookup settings, Medusa and EAGLE-1/2/3 when their trained heads are cached."""
    from specsim import sequoia

    out = []
    if models.draft is not None:
        vanilla = ("method=vanilla", "tree=chain")
        out += [Candidate(f"vanilla chain g={g}", vanilla, Tree.chain(g)) for g in args.chain_gammas
                if g != args.gamma]  # the fixed vanilla path already runs args.gamma
        out.append(Candidate("vanilla kary 2x3", ("method=vanilla", "tree=kary"), Tree.kary(2, 3)))
        if args.sequoia_budgets:
            vec = measured_rank_vector(models, base, engine, opts, calib, width=8)
            print(f"measured positional vector (calibration split): {[round(v, 3) for v in vec]}",
                  file=sys.stderr)
            for b in args.sequoia_budgets:
                t = sequoia.optimal_tree(vec, b, args.sequoia_depth).tree
                out.append(Candidate(f"vanilla sequoia n={t.size} d={t.depth}", vanilla, t))
    lookup = ("method=prompt_lookup", "tree=chain")
    out += [Candidate(f"prompt_lookup g={g} n<={args.ngram}", lookup, Tree.chain(g),
                      {"num_pred_tokens": g, "max_ngram_size": args.ngram})
            for g in args.pld_gammas if g != args.pld_tokens]
    if medusa_cached(args, models, base):
        paths = compose(*base, "method=medusa").tree.paths  # Medusa's 63-node tree (conf/tree/medusa.yaml)
        out.append(Candidate("medusa 63-node tree", ("method=medusa",), Tree.from_paths(paths)))
        out += [Candidate(f"medusa greedy tree n={n}", ("method=medusa",), None, {"tree_budget": n})
                for n in args.medusa_budgets]
    if heads_cached(args.eagle, "eagle", models, base):
        paths = compose(*base, "method=eagle").tree.paths  # EAGLE-1's static tree (conf/tree/eagle.yaml)
        out.append(Candidate("eagle static tree", ("method=eagle",), Tree.from_paths(paths)))
        out.append(Candidate("eagle2 dynamic tree", ("method=eagle2",), None))  # tree=dynamic preset
    if heads_cached(args.eagle, "eagle3", models, base):
        out.append(Candidate("eagle3 dynamic tree", ("method=eagle3",), None))
    return out


def heads_cached(mode: str, method: str, models: Models, base) -> bool:
    """--eagle auto: only when the method's trained head for this target is in the cache."""
    if mode != "auto":
        return mode == "train"
    from methods.drafters.eagle import EagleParams
    from methods.heads.eagle.store import EagleEval, _cache_root, cache_key

    ep = EagleParams.from_method(_method((f"method={method}",), base, {}))
    if ep.head != "train":
        return True
    variant = "eagle3" if method == "eagle3" else "eagle1"
    key = cache_key(models.target, models.tokenizer, ep.train_config(variant), EagleEval())
    return (_cache_root() / "eagle" / key / "report.json").exists()


def medusa_cached(args, models: Models, base) -> bool:
    """--medusa auto: only when heads for this target are already in the cache (training takes minutes)."""
    if args.medusa == "off":
        return False
    if args.medusa == "train":
        return True
    from methods.drafters.medusa import MedusaParams
    from methods.heads.medusa.store import EvalConfig, _cache_root, cache_key

    mp = MedusaParams.from_method(_method(("method=medusa",), base, {}))
    if mp.heads != "train":
        return True
    key = cache_key(models.target, models.tokenizer, mp.train_config(), EvalConfig())
    return (_cache_root() / "medusa" / key / "report.json").exists()


def build_paths(args, cfg: RunConfig, models: Models, calib) -> tuple[list[BenchPath], dict[str, str]]:
    """Every path, in a fixed order; and the names of the like-for-like pairs."""
    base = (f"model={args.model}", f"workload={args.workload}", *args.overrides)
    max_new, greedy = cfg.workload.max_new_tokens, SamplingParams(temperature=0.0)
    opts = DecodeOptions(Verifier.greedy, greedy, max_new, models.tokenizer.eos_token_id)
    engine = ModelEngine(models.target)
    chain, lookup = f"chain g={args.gamma}", f"g={args.pld_tokens} n<={args.ngram}"
    pairs = {AR: HF_GREEDY, f"{PLD} {lookup}": f"{HF_PLD} {lookup}"}
    paths = [hf_path(HF_GREEDY, models, max_new)]
    if models.draft is not None:
        configure_assistant(models.draft, args.gamma)
        pairs[f"{VANILLA} {chain}"] = f"{HF_ASSISTED} {chain}"
        paths.append(hf_path(f"{HF_ASSISTED} {chain}", models, max_new, assistant_model=models.draft))
    paths.append(hf_path(f"{HF_PLD} {lookup}", models, max_new,
                         prompt_lookup_num_tokens=args.pld_tokens, max_matching_ngram_size=args.ngram))

    def ours(name, overrides, tree, params, candidate):
        tree_cfg = compose(*base, *overrides).tree  # dynamic trees (EAGLE-2/3) are shaped by their drafter
        drafter = build_drafter(_method(overrides, base, params), tree, models, greedy, tree_cfg=tree_cfg)
        return specsim_path(name, engine, drafter, opts, candidate)

    paths.append(ours(AR, ("method=autoregressive",), Tree.chain(0), {}, False))
    if models.draft is not None:
        paths.append(ours(f"{VANILLA} {chain}", ("method=vanilla", "tree=chain", f"tree.gamma={args.gamma}"),
                          Tree.chain(args.gamma), {}, False))
    paths.append(ours(f"{PLD} {lookup}", ("method=prompt_lookup",), Tree.chain(args.pld_tokens),
                      {"num_pred_tokens": args.pld_tokens, "max_ngram_size": args.ngram}, False))
    for c in candidates(args, models, base, engine, opts, calib):
        paths.append(ours(f"best? {c.name}", c.overrides, c.tree, c.params, True))
    return paths, pairs


# ---- measuring --------------------------------------------------------------------------------------------
def count_forwards(model: torch.nn.Module) -> tuple[list[int], Callable[[], None]]:
    """A counter of the target's forward calls (HF paths) and the function that removes the hook."""
    count = [0]
    handle = model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count, handle.remove


def run_pass(paths: list[BenchPath], prompts, offset: int) -> dict[str, Pass]:
    """Every prompt runs every path, the order rotated per prompt (from ``offset``) so that a slow phase of
    the machine hits all paths alike. Steps: the drafter loop's, or the target forwards a hook counted."""
    out = {p.name: Pass([]) for p in paths}
    for i, ids in enumerate(prompts):
        k = (offset + i) % len(paths)
        for p in paths[k:] + paths[:k]:
            calls = p.counter[0] if p.counter else 0
            t0 = time.perf_counter()
            res = p.run(ids)
            one = out[p.name]
            one.time += time.perf_counter() - t0
            one.outputs.append(res.tokens)
            one.steps += res.steps or (p.counter[0] - calls if p.counter else 0)
    return out


def measure(paths: list[BenchPath], prompts, reps: int, target: torch.nn.Module) -> None:
    """Cold call per path (untimed); the selection pass (target forwards of HF paths counted, HF greedy's
    outputs become the reference, the best candidate is picked on it); ``reps`` timed repetitions."""
    for p in paths:
        p.run(prompts[0])
    counter, remove = count_forwards(target)
    for p in paths:
        p.counter = counter if p.name.startswith("hf") else None
    try:
        selection = run_pass(paths, prompts, 0)
    finally:
        remove()
    passes = [selection] + [run_pass(paths, prompts, (r + 1) * len(prompts)) for r in range(reps)]
    for p in paths:
        p.selection, p.reps = selection[p.name], [one[p.name] for one in passes[1:]]
        p.runs = len(passes) * len(prompts)
        p.equal = _matches([one[p.name] for one in passes], selection[HF_GREEDY].outputs)
        p.equal_ar = _matches([one[p.name] for one in passes], selection[AR].outputs)


def _matches(passes: list[Pass], reference: list[list[int]]) -> int:
    """Runs (prompt x pass) whose tokens equal the reference's for that prompt."""
    return sum(out == ref for one in passes for out, ref in zip(one.outputs, reference))


def speeds(p: BenchPath) -> list[float]:
    """tokens/s of each repetition."""
    return [one.tokens / one.time for one in p.reps]


def ratio(p: BenchPath, q: BenchPath) -> tuple[float, float, float]:
    """Median, min and max over repetitions of p's tokens/s over q's in the same repetition (paired: both ran
    interleaved, so slow phases of the machine cancel)."""
    r = [a / b for a, b in zip(speeds(p), speeds(q))]
    return statistics.median(r), min(r), max(r)


# ---- report -----------------------------------------------------------------------------------------------
def report(paths: list[BenchPath], pairs: dict[str, str], meta: dict) -> dict:
    """Print the table; return the JSON object (ratios = paired medians, see ``ratio``)."""
    by = {p.name: p for p in paths}
    tau = {p.name: p.selection.tokens / max(p.selection.steps, 1) for p in paths}
    equal = {p.name: p.equal / p.runs for p in paths}
    equal_ar = {p.name: p.equal_ar / p.runs for p in paths}
    pool = [p for p in paths if p.candidate or p.name in pairs and p.name != AR]
    best = max(pool, key=lambda p: p.selection.tokens / p.selection.time)  # chosen on the selection pass
    greedy = by[HF_GREEDY]
    print(f"\n{'path':40s} {'tok/s':>8s} {'tau':>6s} {'xHFgreedy':>10s} {'xHFmatch':>9s} {'equal':>6s} "
          f"{'=AR':>5s}")
    for p in paths:
        match = f"{ratio(p, by[pairs[p.name]])[0]:.2f}" if p.name in pairs else ""
        mark = "  <- best (selection pass)" if p is best else ""
        print(f"{p.name:40s} {statistics.median(speeds(p)):8.1f} {tau[p.name]:6.2f} "
              f"{ratio(p, greedy)[0]:10.2f} {match:>9s} {equal[p.name]:6.2f} {equal_ar[p.name]:5.2f}{mark}")
    van = next((n for n in pairs if n.startswith(VANILLA)), None)
    pld = next(n for n in pairs if n.startswith(PLD))
    ratios = {
        "ar_vs_hf_greedy": ratio(by[AR], greedy),
        "vanilla_vs_hf_assisted": ratio(by[van], by[pairs[van]]) if van else None,
        "pld_vs_hf_pld": ratio(by[pld], by[pairs[pld]]),
        "best_vs_hf_greedy": ratio(best, greedy),
    }
    result = {k: None if r is None else round(r[0], 3) for k, r in ratios.items()}
    result.update(best_method=best.name.removeprefix("best? "),
                  all_outputs_equal=all(p.equal == p.runs for p in paths))
    result["targets_met"] = {k: result[k] is not None and result[k] >= goal for k, goal in TARGETS.items()}
    result["ratio_min_max"] = {k: [round(r[1], 3), round(r[2], 3)] for k, r in ratios.items() if r}
    fastest = max(pool, key=lambda p: statistics.median(speeds(p)))
    result["fastest_by_median"] = fastest.name.removeprefix("best? ")
    result.update(meta, tokens_per_s={p.name: round(statistics.median(speeds(p)), 2) for p in paths},
                  tau=_rounded(tau), equal_rate=_rounded(equal), equal_rate_vs_specsim_ar=_rounded(equal_ar))
    return result


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
    ap.add_argument("--chain-gammas", type=int, nargs="*", default=[2, 3, 4, 6])
    ap.add_argument("--pld-gammas", type=int, nargs="*", default=[4, 10, 16])
    ap.add_argument("--sequoia-budgets", type=int, nargs="*", default=[8, 16])
    ap.add_argument("--sequoia-depth", type=int, default=8, help="levels including the root")
    ap.add_argument("--calibration-prompts", type=int, default=4)
    ap.add_argument("--medusa", choices=["auto", "train", "off"], default="auto",
                    help="auto: include Medusa only if heads for this target are cached")
    ap.add_argument("--medusa-budgets", type=int, nargs="*", default=[16],
                    help="Medusa's greedy trees (from the heads' measured accuracies) of these sizes")
    ap.add_argument("--eagle", choices=["auto", "train", "off"], default="auto",
                    help="auto: include EAGLE-1/2 (EAGLE-3) only if their heads for this target are cached")
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
    args.gamma = args.gamma or compose(*overrides, "tree=chain").tree.gamma
    dtype = cfg.model.dtype if args.dtype == "auto" else args.dtype
    models = load_models(cfg.model, args.device, dtype)  # a zoo is built on first use (minutes)
    prompts = [torch.tensor(p.token_ids) for p in load_prompts(cfg.workload, models.tokenizer, args.seed)]
    calib_cfg = dataclasses.replace(cfg.workload, split="calibration", num_prompts=args.calibration_prompts)
    calib = [torch.tensor(p.token_ids) for p in load_prompts(calib_cfg, models.tokenizer, args.seed)]
    paths, pairs = build_paths(args, cfg, models, calib)
    t0 = time.perf_counter()
    measure(paths, prompts, args.reps, models.target)
    meta = {"model": args.model, "workload": args.workload, "dtype": dtype, "device": str(models.device),
            "num_prompts": len(prompts), "max_new_tokens": cfg.workload.max_new_tokens, "reps": args.reps,
            "gamma": args.gamma, "pld_tokens": args.pld_tokens, "ngram": args.ngram,
            "torch_threads": torch.get_num_threads(), "loadavg_1min": round(os.getloadavg()[0], 2),
            "seconds": round(time.perf_counter() - t0, 1)}
    result = report(paths, pairs, meta)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
