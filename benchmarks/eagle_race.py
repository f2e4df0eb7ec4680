"""Which EAGLE configuration is fastest on this device, against the project's fastest other methods, in ONE
interleaved run (benchmarks/harness.py: every prompt runs every path, the order rotated; paired ratios over
the same run's autoregressive baseline, median over repetitions) (Li et al. 2024a/b, 2025; p = target).

Paths: autoregressive; vanilla chain γ (conf/tree/chain.yaml's), prompt lookup (g = 10, n ≤ 3), staged D = 6 k
= 2 order 4 (vs_transformers' fastest by median); EAGLE-1 chains of ``--chains`` tokens, 2-ary trees of depth
2, 3 and EAGLE-1's 25-node tree; EAGLE-2 dynamic trees ``--dynamic`` (total/depth/top_k); EAGLE-3's chains and
dynamic trees; EAGLE-1's chain γ = 4 with a float32 head K/V cache (the A/B of the bf16 cache,
methods.heads.eagle.state.kv_cache_dtype); ``--vocab``: the chains with an inference-time draft vocabulary. A
smaller driver than benchmarks/vs_transformers.py (no HF paths).

    python benchmarks/eagle_race.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import measure, median_speed, ratio  # noqa: E402
from benchmarks.vs_transformers import compose, specsim_path  # noqa: E402
from methods.core.engine import ModelEngine  # noqa: E402
from methods.core.loop import DecodeOptions  # noqa: E402
from methods.core.sampling import SamplingParams  # noqa: E402
from methods.data.workloads import load_prompts  # noqa: E402
from methods.drafters.registry import build_drafter  # noqa: E402
from methods.heads.eagle.state import HeadCache  # noqa: E402
from methods.models import load_models  # noqa: E402
from specsim.config import Verifier  # noqa: E402
from specsim.tree import Tree  # noqa: E402

AR = "autoregressive"


def specs(args, base: tuple[str, ...]) -> list[tuple[str, tuple[str, ...], Tree | None, dict, bool]]:
    """(name, overrides, tree (None: the drafter's own), method.params, float32 head K/V) per path."""
    gamma = compose(*base, "tree=chain").tree.gamma
    eagle_tree = Tree.from_paths(compose(*base, "method=eagle").tree.paths)
    out = [(AR, ("method=autoregressive",), Tree.chain(0), {}, False),
           (f"vanilla chain g={gamma}", ("method=vanilla", "tree=chain"), Tree.chain(gamma), {}, False),
           ("prompt_lookup g=10 n<=3", ("method=prompt_lookup",), Tree.chain(10),
            {"num_pred_tokens": 10, "max_ngram_size": 3}, False),
           ("staged D=6 k=2 order=4", ("method=staged",), None,
            {"depth": 6, "top_k": 2, "stage2_gamma": 6, "order": 4}, False)]
    for g in args.chains:
        out.append((f"eagle chain g={g}", ("method=eagle",), Tree.chain(g), {}, False))
    out.append(("eagle chain g=4, float32 K/V", ("method=eagle",), Tree.chain(4), {}, True))
    if args.no_trees:
        args.kary_depths, args.dynamic = [], []
    for d in args.kary_depths:
        out.append((f"eagle 2-ary depth {d}", ("method=eagle",), Tree.kary(2, d), {}, False))
    if not args.no_trees:
        out.append(("eagle static tree (25)", ("method=eagle",), eagle_tree, {}, False))
    for spec in args.dynamic:
        t, d, k = spec.split("/")
        dyn = ("tree=dynamic", f"tree.total_tokens={t}", f"tree.depth={d}", f"tree.top_k={k}")
        out.append((f"eagle2 dynamic {spec}", ("method=eagle2", *dyn), None, {}, False))
        if not args.no_eagle3:
            out.append((f"eagle3 dynamic {spec}", ("method=eagle3", *dyn), None, {}, False))
    if not args.no_eagle3:
        for g in args.eagle3_chains:
            out.append((f"eagle3 chain g={g}", ("method=eagle3", "tree=chain"), Tree.chain(g), {}, False))
    for v in args.vocab:  # an inference-time draft vocabulary (EagleParams.draft_vocab) on the chains
        for g in args.chains:
            out.append((f"eagle chain g={g} vocab {v}", ("method=eagle",), Tree.chain(g), {"draft_vocab": v},
                        False))
        if not args.no_eagle3:
            for g in args.eagle3_chains:
                out.append((f"eagle3 chain g={g} vocab {v}", ("method=eagle3", "tree=chain"), Tree.chain(g),
                            {"draft_vocab": v}, False))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="code")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chains", type=int, nargs="*", default=[2, 3, 4, 5])
    ap.add_argument("--kary-depths", type=int, nargs="*", default=[2, 3])
    ap.add_argument("--dynamic", nargs="*", default=["8/4/2", "6/3/2", "6/4/2", "10/5/2"],
                    help="EAGLE-2/3 dynamic trees total_tokens/depth/top_k")
    ap.add_argument("--eagle3-chains", type=int, nargs="*", default=[3, 4])
    ap.add_argument("--no-eagle3", action="store_true")
    ap.add_argument("--vocab", type=int, nargs="*", default=[],
                    help="method.params.draft_vocab sizes tried on the EAGLE chains")
    ap.add_argument("--no-trees", action="store_true", help="chains only (no k-ary, static or dynamic trees)")
    ap.add_argument("overrides", nargs="*", help="more run.py overrides")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = ("model=zoo", f"workload={args.workload}", "task=measure", *args.overrides)
    cfg = compose(*base)
    models = load_models(cfg.model, "cpu", cfg.model.dtype)
    prompts = [torch.tensor(p.token_ids) for p in load_prompts(cfg.workload, models.tokenizer, cfg.seed)]
    greedy = SamplingParams(temperature=0.0)
    opts = DecodeOptions(Verifier.greedy, greedy, cfg.workload.max_new_tokens, models.tokenizer.eos_token_id)
    engine = ModelEngine(models.target)
    paths = []
    for name, overrides, tree, params, f32 in specs(args, base):
        run_cfg = compose(*base, *overrides)
        method = run_cfg.method
        method.params = {**method.params, **params}

        def make(method=method, tree=tree, tree_cfg=run_cfg.tree, f32=f32):
            d = build_drafter(method, tree, models, greedy, tree_cfg=tree_cfg)
            if f32:
                d.cache = HeadCache(d.head, mixed_ok=False)
            return d

        paths.append(specsim_path(name, engine, make, opts, True))
    t0 = time.perf_counter()
    measure(paths, prompts, args.reps, models.target, (AR, AR))
    by = {p.name: p for p in paths}
    print(f"\n{'path':34s} {'tok/s':>8s} {'tau':>6s} {'x AR':>6s} {'min':>6s} {'max':>6s} {'=AR':>5s}  "
          f"(paired medians over {args.reps} reps, load {os.getloadavg()[0]:.1f})")
    result = {}
    for p in paths:
        tau = p.selection.tokens / max(p.selection.steps, 1)
        r = ratio(p, by[AR])
        print(f"{p.name:34s} {median_speed(p):8.1f} {tau:6.2f} {r[0]:6.3f} {r[1]:6.3f} {r[2]:6.3f} "
              f"{p.equal_ar / p.runs:5.2f}")
        result[p.name] = {"tok_s": round(median_speed(p), 1), "tau": round(tau, 3), "x_ar": round(r[0], 3),
                          "x_ar_min_max": [round(r[1], 3), round(r[2], 3)], "equal_ar": p.equal_ar / p.runs}
    if args.vocab:  # the share of the target's greedy tokens (the autoregressive outputs) a vocabulary covers
        from methods.heads.eagle.store import frequent_ids

        greedy = torch.tensor([t for out in by[AR].selection.outputs for t in out])
        vocab = models.target.config.vocab_size
        cover = {v: torch.isin(greedy, frequent_ids(models.tokenizer, v, vocab)).float().mean().item()
                 for v in args.vocab}
        cover = {v: round(c, 4) for v, c in cover.items()}
        print(f"greedy tokens inside the draft vocabulary: {cover}")
        result["coverage"] = cover
    eagle = [n for n in by if n.startswith("eagle")]
    others = [n for n in by if n not in eagle and n != AR]
    best_e, best_o = max(eagle, key=lambda n: result[n]["x_ar"]), max(others, key=lambda n: result[n]["x_ar"])
    summary = {"best_eagle": best_e, "best_other": best_o,
               "best_eagle_vs_best_other": round(ratio(by[best_e], by[best_o])[0], 3),
               "seconds": round(time.perf_counter() - t0, 1), "loadavg_1min": round(os.getloadavg()[0], 2)}
    print(json.dumps({"paths": result, **summary}))
    return result


if __name__ == "__main__":
    main()
