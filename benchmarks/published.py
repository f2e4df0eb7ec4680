"""Published tables from published inputs (issue 17, part 2): every row of conf/published/<paper>.yaml
composed as `experiment=<the paper's preset>` plus the row's overrides, priced by specsim.published with the
framework costs of conf/published/runtimes.yaml, and set beside the paper's figure with the relative error.

    python benchmarks/published.py                         # the Markdown table (docs/published.md has it)
    python benchmarks/published.py --json out.json         # the rows as JSON as well
    python benchmarks/published.py --count-kernels         # the microbenchmark behind runtimes.yaml (CPU)
    python benchmarks/published.py --count-kernels --transformers-path DIR --attention eager
                               # the same on a paper's transformers (pip install --target DIR ...==4.34.1)
    python benchmarks/published.py --magicdec              # MagicDec: speedup vs batch (conf/published/batch)

Pure simulation (a second per row); --count-kernels builds tiny random Llamas (seconds, torch + transformers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specsim.published import forecast, markdown, misses, setting_from, table_row  # noqa: E402

PUBLISHED = REPO / "conf" / "published"


def paper_files(names: list[str] | None = None) -> list[Path]:
    files = sorted(p for p in PUBLISHED.glob("*.yaml") if p.stem != "runtimes")
    return [p for p in files if not names or p.stem in names]


def load_yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def row_overrides(paper: dict[str, Any], row: dict[str, Any]) -> list[str]:
    """What `python run.py` would be given for this row (task=simulate: nothing is decoded)."""
    experiment = row.get("experiment", paper["experiment_default"])
    return [f"experiment={experiment}", "task=simulate", *row.get("overrides", [])]


def rows(names: list[str] | None = None) -> list[dict[str, Any]]:
    from run import compose_run_config

    runtimes = load_yaml(PUBLISHED / "runtimes.yaml")
    out = []
    for path in paper_files(names):
        paper = load_yaml(path)
        for row in paper["rows"]:
            cfg = compose_run_config(*row_overrides(paper, row))
            f = forecast(cfg, setting_from(paper, runtimes, row))
            extra = {"alpha": f.alpha, "command": row_overrides(paper, row)}
            out.append(table_row(paper["paper"], row, f) | extra)
    return out


def _magicdec_cost(d: dict[str, Any], model: str | None = None) -> Any:
    """MagicDec's batch cost model: the target (``model``, else the yaml's sweep model) on its hardware,
    tensor parallel over ``tp`` GPUs (specsim.batch)."""
    from dataclasses import replace

    from run import compose_run_config
    from specsim.batch import BatchRoofline
    from specsim.cost import ModelShape

    cfg = compose_run_config(f"model={model or d['model']}", f"hardware={d['hardware']}", "task=simulate")
    hw = cfg.hardware
    return replace(BatchRoofline.from_config(hw, ModelShape.target(cfg.model), 0), tp=int(d["tp"]),
                   link=d["nvlink_gbs"] * 1e9, memory_bytes=hw.memory_gb * 1e9)


def _magicdec_latency(d: dict[str, Any], cost: Any, latency: bool = True) -> float:
    """The per-forward all-reduce latency of the yaml's ``all_reduce`` block (0 with ``latency`` off)."""
    from specsim.magicdec import collective_latency_s

    ar = d.get("all_reduce")
    if not latency or not ar:
        return 0.0
    return collective_latency_s(cost.model.n_layers, float(ar["latency_us"]), int(ar["per_layer"]),
                                int(ar["fixed"]))


def alpha_reaching(speedup_of: Any, target: float, steps: int = 40) -> float:
    """The α in (0, 0.999) at which ``speedup_of(α)`` (rising in α) reaches ``target`` (bisection); NaN when
    even α = 0.999 falls short."""
    lo, hi = 0.0, 0.999
    if speedup_of(hi) < target:
        return math.nan
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if speedup_of(mid) < target else (lo, mid)
    return round(0.5 * (lo + hi), 3)


def fixed_reaching(speedup_of: Any, target: float, hi: float = 0.2, steps: int = 50) -> float:
    """The extra seconds per forward x in [0, ``hi``] at which ``speedup_of(x)`` (falling in x) comes down to
    ``target`` (bisection): a diagnostic of how much per-forward time a miss leaves unexplained, never an
    input. 0 where the prediction is already at or below the target, NaN past ``hi``."""
    if speedup_of(0.0) <= target:
        return 0.0
    if speedup_of(hi) > target:
        return math.nan
    lo = 0.0
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if speedup_of(mid) > target else (lo, mid)
    return 0.5 * (lo + hi)


MAGICDEC = PUBLISHED / "batch" / "magicdec.yaml"


def magicdec(path: Path = MAGICDEC, latency: bool = True) -> list[dict[str, Any]]:
    """MagicDec's speedup vs batch size per (context, α) for the sweep model on its 8-GPU tensor-parallel
    setting (specsim.magicdec), NaN where the batch's KV cache does not fit; and per context the α at which
    the best batch reaches the published maximum. A sweep: this model's acceptance is not published (the
    yaml)."""
    from specsim.magicdec import self_spec_speedup

    d = load_yaml(path)
    cost = _magicdec_cost(d)
    f = _magicdec_latency(d, cost, latency)

    def speedup(b: int, context: int, alpha: float) -> float:
        return self_spec_speedup(cost, b, context, d["budget"], d["gamma"], alpha, f)

    def best(context: int, alpha: float) -> float:
        return max(speedup(b, context, alpha) for b in d["batches"] if cost.fits(b, context))

    out = []
    for context in d["contexts"]:
        needed = alpha_reaching(lambda a, c=context: best(c, a), d["published_max_speedup"])
        for alpha in d["alphas"]:
            row = {"context": context, "alpha": alpha, "alpha_for_published": needed}
            for b in d["batches"]:
                row[f"B={b}"] = speedup(b, context, alpha) if cost.fits(b, context) else math.nan
            out.append(row)
    return out


def magicdec_rows(path: Path = MAGICDEC, latency: bool = True) -> list[dict[str, Any]]:
    """The published per-batch speedups (the yaml's ``rows``) beside the prediction at the row's α (its
    target's own published one, or a stand-in: the yaml's ``targets``), with the error, the prediction
    without the all-reduce latency, and the α the published speedup needs on this cost model."""
    from specsim.magicdec import self_spec_speedup, verify_ratio_for

    d = load_yaml(path)
    out = []
    for r in d["rows"]:
        model = r.get("model", d["model"])
        cost = _magicdec_cost(d, model)
        f = _magicdec_latency(d, cost, latency)
        ctx, b, g = int(r["context"]), int(r["batch"]), int(r["gamma"])
        assert cost.fits(b, ctx), f"MagicDec row {r} does not fit the modelled memory"
        target = d["targets"][model]
        alpha = float(target["alpha"][ctx])

        def speedup_at(a: float, b: int = b, ctx: int = ctx, g: int = g, f: float = f,
                       cost: Any = cost) -> float:
            return self_spec_speedup(cost, b, ctx, d["budget"], g, a, f)

        published, pred = float(r["speedup"]), speedup_at(alpha)
        out.append({"model": model, "context": ctx, "batch": b, "gamma": g, "published": published,
                    "alpha": alpha, "alpha_source": target["alpha_source"], "predicted": pred,
                    "error": (pred - published) / published,
                    "no_latency": speedup_at(alpha, f=0.0),
                    "alpha_for_published": alpha_reaching(speedup_at, published),
                    "extra_ms_for_published": 1e3 * fixed_reaching(
                        lambda x, a=alpha, f0=f: speedup_at(a, f=f0 + x), published),
                    "verify_ar_model": verify_ratio_for(cost, b, ctx, d["budget"], g, alpha, pred, f),
                    "verify_ar_for_published": verify_ratio_for(cost, b, ctx, d["budget"], g, alpha,
                                                                published, f)})
    return out


def count_kernels(layers: tuple[int, int] = (2, 8), reps: int = 40, attention: str | None = None
                  ) -> dict[str, Any]:
    """Top-level aten ops and host time of one eager HF Llama forward (one token over a 128-token cache) at
    two depths: ops per decoder layer, fixed ops, host µs per layer and per op (thread CPU time, the median
    and the fastest of ``reps`` forwards); tiny widths. Runs on
    whichever transformers is importable (``--transformers-path`` puts an older one first): a legacy tuple
    cache (transformers 4.x) is not mutated by a forward, a Cache object is cropped back after each.
    ``attention`` sets the attention implementation where the version has the choice ("eager": the papers'
    own Llama copies compute the scores with matmul + softmax)."""
    import time

    import torch
    import transformers
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.gpu_forward import top_level_ops

    torch.set_num_threads(1)
    ops, secs, fastest, attn_class = {}, {}, {}, ""
    for n in layers:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=n,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
        if attention is not None:
            cfg._attn_implementation = attention
        model = LlamaForCausalLM(cfg).eval()
        attn_class = type(model.model.layers[0].self_attn).__name__ + ":" + str(
            getattr(model.config, "_attn_implementation", "eager"))
        with torch.no_grad():
            cache = model(torch.randint(0, 256, (1, 128)), use_cache=True).past_key_values
            token = torch.randint(0, 256, (1, 1))
            legacy = isinstance(cache, tuple)

            times = []
            for _ in range(reps):
                t = time.thread_time()  # this thread's CPU time: robust to a loaded machine's other jobs
                model(token, past_key_values=cache, use_cache=True)
                times.append(time.thread_time() - t)
                if not legacy:
                    cache.crop(-1)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model(token, past_key_values=cache, use_cache=True)
        ops[n], secs[n], fastest[n] = len(top_level_ops(prof)), sorted(times)[len(times) // 2], min(times)
    lo, hi = layers
    per_layer = (ops[hi] - ops[lo]) / (hi - lo)
    host_per_layer = (secs[hi] - secs[lo]) / (hi - lo)
    host_min = (fastest[hi] - fastest[lo]) / (hi - lo)  # the fastest rep: least disturbed by other jobs
    return {"transformers": transformers.__version__, "torch": torch.__version__, "attention": attn_class,
            "ops_per_layer": per_layer, "fixed_ops": ops[lo] - lo * per_layer,
            "host_us_per_layer": host_per_layer * 1e6, "host_us_per_op": host_per_layer * 1e6 / per_layer,
            "host_us_per_layer_min": host_min * 1e6, "host_us_per_op_min": host_min * 1e6 / per_layer}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--papers", nargs="*", help="paper files to run (stems of conf/published/*.yaml)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--count-kernels", action="store_true", help="run the kernel-count microbenchmark only")
    ap.add_argument("--transformers-path", type=Path,
                    help="with --count-kernels: a folder holding another transformers "
                         "(pip install --target), imported before the installed one")
    ap.add_argument("--attention", help="with --count-kernels: the attention implementation (e.g. eager)")
    ap.add_argument("--reps", type=int, default=40, help="with --count-kernels: timed forwards per depth")
    ap.add_argument("--magicdec", action="store_true", help="MagicDec's speedup vs batch size only")
    args = ap.parse_args(argv)
    if args.count_kernels:
        if args.transformers_path is not None:
            assert "transformers" not in sys.modules, "transformers imported before --transformers-path"
            sys.path.insert(0, str(args.transformers_path))
        print(json.dumps(count_kernels(reps=args.reps, attention=args.attention), indent=1))
        return 0
    if args.magicdec:
        def cell(v: Any) -> str:
            if isinstance(v, float):
                return "–" if math.isnan(v) else f"{v:.2f}"
            return str(v)

        for table in (magicdec(), magicdec_rows()):
            keys = list(table[0])
            print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
            for r in table:
                print("| " + " | ".join(f"{100 * v:+.0f}%" if k == "error" else cell(v) for k, v in r.items())
                      + " |")
            print()
        return 0
    table = rows(args.papers)
    print(markdown(table))
    for r in misses(table):
        errors = [f"{name} {r[key]:+.0%}" for name, key in
                  (("speedup", "speedup_error"), ("t_AR", "ar_error"), ("t_step", "step_error"))
                  if not math.isnan(r[key])]
        print(f"miss > 15%: {r['paper']} {r['row']}: " + ", ".join(errors))
    if args.json:
        args.json.write_text(json.dumps(table, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
