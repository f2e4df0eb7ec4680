"""Rows of a batch differ in acceptance (issue 16): the forwards a static batch of B rows needs for
max_new_tokens each (it steps until its slowest row is done), measured by specsim's batched loop and
predicted with one shared acceptance law (specsim.expected.batch_forwards) and with the per-prompt spread
(specsim.batch.prompt_laws + mixture_batch_forwards) read from calibration-split prompts decoded alone.

The forwards count and τ do not depend on the machine's load: this runs on a busy machine as well. The
speedup columns price the forwards with the method's cached profile and this device's t(B, n) fit (as
``task=measure`` does at batch B); the measured decode speedups are a sweep's (``--sweep DIR``, optional).

    python benchmarks/batch_rows.py                      # vanilla (draft model, chain of 4), code, bf16
    python benchmarks/batch_rows.py --sweep /tmp/lead/sweep2
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from methods.core.batch_drafter import batched  # noqa: E402
from methods.core.batch_engine import BatchEngine  # noqa: E402
from methods.core.batch_loop import decode_batch  # noqa: E402
from methods.core.engine import ModelEngine  # noqa: E402
from methods.core.loop import DecodeOptions, decode  # noqa: E402
from methods.core.sampling import SamplingParams  # noqa: E402
from methods.data.workloads import load_prompts  # noqa: E402
from methods.drafters.registry import build_drafter  # noqa: E402
from methods.measurement.batch_cost import load_batch_fit  # noqa: E402
from methods.measurement.profiles import apply_profile, load_profile, profile_config, to_measured_cost  # noqa: E402
from methods.models import load_models  # noqa: E402
from specsim.batch import BATCHES, predict_at_batch  # noqa: E402
from specsim.expected import batch_forwards, forwards_law  # noqa: E402
from specsim.tree import Tree  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


def prompt_hists(models, cfg, tree: Tree, n_prompts: int, new_tokens: int) -> list[list[int]]:
    """Each calibration-split prompt decoded alone with the method: its histogram of accepted drafts."""
    w = replace(cfg.workload, split="calibration", num_prompts=n_prompts)
    drafter = build_drafter(cfg.method, tree, models, GREEDY)
    engine, opts = ModelEngine(models.target), DecodeOptions(max_new_tokens=new_tokens)
    return [list(decode(engine, drafter, torch.tensor(p.token_ids), opts, torch.Generator()).stats.hist)
            for p in load_prompts(w, models.tokenizer, cfg.seed)]


def measured_forwards(models, cfg, tree: Tree, batches, new_tokens: int) -> dict[int, float]:
    """Target forwards per static batch of B test-split prompts (mean over the workload's batches)."""
    prompts = [torch.tensor(p.token_ids) for p in load_prompts(cfg.workload, models.tokenizer, cfg.seed)]
    drafter = build_drafter(cfg.method, tree, models, GREEDY)
    opts = DecodeOptions(max_new_tokens=new_tokens)  # no EOS: every row decodes new_tokens tokens
    out = {}
    for b in batches:
        engine, side = BatchEngine(models.target, b), batched(drafter, b)
        steps = [decode_batch(engine, side, prompts[i : i + b], opts, torch.Generator()).n_steps
                 for i in range(0, len(prompts) - b + 1, b)]
        out[b] = float(np.mean(steps))
    return out


def sweep_speedups(root: Path, method: str) -> dict[int, float]:
    """The measured decode speedup per B of a run.py -m sweep's runs of ``method``."""
    out = {}
    for path in root.rglob("metrics.json"):
        m = json.loads(path.read_text())
        if m.get("method") == method and "decode_speedup" in m:
            out[int(m.get("batch_size", 1))] = m["decode_speedup"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="vanilla")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=32, help="test-split prompts (the sweep's num_prompts)")
    ap.add_argument("--calibration-prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default=",".join(map(str, BATCHES)))
    ap.add_argument("--sweep", type=Path, help="a run.py -m sweep dir: its measured decode speedups")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import run

    cfg = run.compose_run_config(f"method={args.method}", f"workload.num_prompts={args.prompts}",
                                 f"workload.max_new_tokens={args.new_tokens}", f"model.dtype={args.dtype}")
    models = load_models(cfg.model, "cpu", args.dtype)
    tree = Tree.chain(int(cfg.tree.gamma))
    batches = [int(x) for x in args.batch_sizes.split(",")]
    hists = prompt_hists(models, cfg, tree, args.calibration_prompts, args.new_tokens)
    taus = [sum((k + 1) * c for k, c in enumerate(h)) / max(sum(h), 1) for h in hists]
    print(f"calibration prompts: tau per prompt {np.min(taus):.2f}..{np.max(taus):.2f} "
          f"(mean {np.mean(taus):.2f}, sd {np.std(taus):.2f})", flush=True)
    loop_law, spread = row_spread(hists, args.new_tokens)
    print(f"forwards per prompt alone ({args.new_tokens} tokens): variance {spread['variance_alone']:.2f} "
          f"against {spread['variance_iid']:.2f} for i.i.d. steps of the pooled loop law (ratio "
          f"{spread['ratio']:.2f}: above 1 = prompts differ beyond sampling noise)", flush=True)
    measured = measured_forwards(models, cfg, tree, batches, args.new_tokens)
    profile = load_profile(profile_config(cfg))
    pcfg, cost = (cfg, None) if profile is None else (apply_profile(cfg, profile), to_measured_cost(profile))
    fit, sweep = load_batch_fit(cfg), sweep_speedups(args.sweep, args.method) if args.sweep else {}
    draft_fit = load_batch_fit(cfg, role="draft") if cfg.method.drafter == "draft_model" else None
    rows = []
    for b in batches:
        c = replace(pcfg, workload=replace(pcfg.workload, batch_size=b))
        one = predict_at_batch(c, cost, fit, tree=tree, with_break_even=False, draft_fit=draft_fit)
        mix = predict_at_batch(c, cost, fit, tree=tree, with_break_even=False, prompt_hists=hists,
                               draft_fit=draft_fit)
        rows.append({"B": b, "measured_forwards": measured[b], "one_law_forwards": one.batch_forwards,
                     "mixture_forwards": mix.batch_forwards,
                     "loop_law_forwards": batch_forwards(loop_law, args.new_tokens, b),
                     "one_law_decode": one.predicted_decode_speedup,
                     "mixture_decode": mix.predicted_decode_speedup, "measured_decode": sweep.get(b)})
    print("forwards per static batch: measured; predicted with the profile's law (one law, the per-prompt "
          "mixture), and with calibration's pooled loop law")
    print(f"{'B':>3} {'measured':>8} {'one law':>15} {'mixture':>15} {'loop law':>15} | decode speedup: "
          f"{'one law':>7} {'mixture':>7} {'measured':>8}")
    for r in rows:
        m = r["measured_forwards"]
        dec = f"{r['measured_decode']:.3f}" if r["measured_decode"] else "–"
        cols = "".join(f" {r[k]:>6.2f} ({r[k] / m - 1:+6.1%})"
                       for k in ("one_law_forwards", "mixture_forwards", "loop_law_forwards"))
        print(f"{r['B']:>3} {m:>8.2f}{cols} | {'':>15}{r['one_law_decode']:>7.3f} "
              f"{r['mixture_decode']:>7.3f} {dec:>8}")
    print(json.dumps({"profile": profile is not None, "fit": fit is not None, "tau_by_prompt": taus,
                      "spread": spread, "rows": rows}))


def row_spread(hists: list[list[int]], new_tokens: int) -> tuple[np.ndarray, dict[str, float]]:
    """The pooled loop law of the prompts' histograms, and the variance of the forwards each prompt needed
    alone against the variance i.i.d. steps of that law give (specsim.expected.forwards_law)."""
    size = max(len(h) for h in hists) + 1
    pooled = np.zeros(size)
    for h in hists:
        pooled[1 : 1 + len(h)] += h
    pooled /= pooled.sum()
    pmf = forwards_law(pooled, new_tokens)
    s = np.arange(pmf.size)
    iid = float(pmf @ (s - pmf @ s) ** 2)
    alone = float(np.var([sum(h) for h in hists], ddof=1))
    return pooled, {"variance_alone": alone, "variance_iid": iid, "ratio": alone / iid}


if __name__ == "__main__":
    main()
