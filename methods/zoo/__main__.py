"""``python -m methods.zoo build|report|retime|path [name]``: build (or find) a zoo and print its report;
``retime`` re-measures the t(n) curves of a built zoo (e.g. on a quiet machine) and updates report.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from methods.zoo.build import PRESETS, ZooPaths, cache_root, ensure_zoo, preset, zoo_dir


def _train_line(role: str, t: dict) -> str:
    return (f"  {role:6s} {t['params'] / 1e6:6.2f}M params  {t['steps']} steps  "
            f"{t['tokens'] / 1e6:.2f}M tokens  {t['seconds']:.0f} s ({t['tokens_per_s']:.0f} tok/s)  "
            f"train loss {t['final_train_loss']:.3f}")


def _heldout_line(kind: str, h: dict) -> str:
    late = ""
    if h.get("target_ppl_late") is not None:
        late = f"  (positions >= {h['split_at']}: {h['target_ppl_late']:.2f} / {h['draft_ppl_late']:.2f})"
    return (f"  held-out {kind:5s}: ppl target {h['target_ppl']:.2f} draft {h['draft_ppl']:.2f}{late}\n"
            f"                  greedy alpha {h['greedy_alpha']:.3f}  E[sum min(p,q)] {h['sum_min_pq']:.3f}"
            f"  ({h['tokens']} tokens)")


def format_report(report: dict) -> str:
    """The report's figures as a few readable lines."""
    lines = [f"zoo {report['zoo']} ({report['key']})"]
    lines += [_train_line(role, t) for role, t in report["train"].items()]
    lines.append("  build s: " + "  ".join(f"{k}={v:.0f}" for k, v in report["build_seconds"].items()))
    m = report["machine"]
    lines.append(f"  load avg (1 min) at build start/end: {m['loadavg_1min_start']:.2f} / "
                 f"{m['loadavg_1min_end']:.2f} on {m['cpu_count']} cpus (shared machine: timings are noisy)")
    lines += [_heldout_line(kind, h) for kind, h in report["heldout"].items()]
    for kind, r in report["loop_rate"].items():
        lines.append(f"  loop rate {kind:8s}: {r['rate']:.3f} ({r['looping']}/{r['prompts']} prompts of "
                     f"{r['prompt_tokens']} tokens, {r['new_tokens']} greedy new tokens)")
    tn = report["t_n"]
    t1 = tn["target_ms"]["1"]
    lines.append(f"  t(n) {tn['dtype']}, {tn['context']}-token cache, ms (ratio to target t(1))"
                 + (f", load avg {tn['loadavg_1min']:.2f}" if "loadavg_1min" in tn else "") + ":")
    for role in ("target_ms", "draft_ms"):
        cells = "  ".join(f"{n}:{v:.2f}({v / t1:.2f})" for n, v in tn[role].items())
        lines.append(f"    {role[:-3]:6s} {cells}")
    return "\n".join(lines)


def heads_report(paths: ZooPaths) -> str:
    """Draft heads trained on this zoo's target (notes the head stores leave in ``<zoo>/heads/``): training
    time, held-out top-1 accuracy per draft depth and (EAGLE) the head's held-out chain τ; and each
    drafter's measured τ on this device (its calibration profile's chain in the real loop, ``loop_tau``)."""
    notes = sorted(paths.target_dir.parent.glob("heads/*.json"))
    if not notes:
        return "  heads: none trained on this target yet"
    lines = ["  heads (held-out top-1 accuracy by draft depth, greedy continuations of test prompts):"]
    for f in notes:
        n = json.loads(f.read_text())
        acc = " ".join(f"{a:.3f}" for a in n["top1_by_depth"])
        tau = n.get("held_out_tau")  # EAGLE heads: τ of a greedy chain along the same continuations
        tau = f"  tau {tau['tau']:.3f} (chain of {tau['chain']})" if tau else ""
        lines.append(f"    {n['variant']:7s} trained {n['train_seconds']:.0f} s "
                     f"(load {n['loadavg_1min']:.1f}): {acc}{tau}  [{f.stem}]")
    profiles = cache_root() / "profiles"
    for f in sorted(profiles.glob("zoo-eagle*.json")):
        d = json.loads(f.read_text())
        tau = d.get("extra", {}).get("loop_tau")
        if tau is not None:
            lines.append(f"    measured tau {d['drafter']:7s} {d['workload']:8s} {tau:.3f} (chain of "
                         f"{d['extra'].get('loop_tree_depth')}, {f.stem})")
    return "\n".join(lines)


def self_spec_report(top: int = 5) -> str:
    """Self-drafting's cached searches and variants (of whichever zoo target they were built on): Draft &
    Verify's skip-set searches (greedy forward selection; the best sets of the path by predicted speedup,
    with their acceptance and draft cost) and the LayerSkip variants (recipe, training time, held-out
    perplexity of the last layer and of each early exit, beside the plain target's)."""
    lines = []
    for f in sorted((cache_root() / "draft_verify").glob("*.json")):
        r = json.loads(f.read_text())
        u = r["unit_costs"]
        lines.append(f"  draft_verify skip-set search [{f.stem}]: greedy forward selection, "
                     f"{r['evaluations']} sets in {r['seconds']:.0f} s (load {r['loadavg_1min']:.1f}); unit "
                     f"costs x t(1): fixed {u['fixed']:.3f}, attention {u['attention']:.3f}, MLP "
                     f"{u['mlp']:.3f}; best of the path:")
        for c in sorted(r["path"], key=lambda c: -c["speedup"])[:top]:
            mark = "  <- chosen" if c == r["chosen"] else ""
            lines.append(f"    skip attn {c['skip_attn']} mlp {c['skip_mlp']}: acceptance {c['alpha']:.3f}, "
                         f"cost {c['cost']:.3f}, predicted speedup {c['speedup']:.2f} "
                         f"(gamma {c['gamma']}){mark}")
    for f in sorted((cache_root() / "layerskip").glob("*/report.json")):
        r = json.loads(f.read_text())
        per = f", {r['seconds_per_step']:.2f} s/step" if "seconds_per_step" in r else ""
        lines.append(f"  layerskip variant [{f.parent.name}]: {r['recipe']['steps']} steps x "
                     f"{r['recipe']['batch_size']}x{r['recipe']['seq_len']} tokens, "
                     f"{r['train_seconds']:.0f} s{per} (load {r['loadavg_1min']:.1f})")
        for kind, both in r["heldout"].items():
            cells = "  ".join(f"{name} " + "/".join(f"{x:.0f}" for x in m["ppl_by_exit"])
                              for name, m in both.items())
            lines.append(f"    {kind:5s} held-out ppl by exit (layers 1..L): {cells}")
    return "\n".join(lines) or "  self-drafting: no skip-set search or LayerSkip variant cached yet"


def retime(paths: ZooPaths, name: str) -> dict:
    """Re-measure t(n) of the built target and draft; write it into report.json atomically."""
    import torch
    from transformers import AutoModelForCausalLM

    from methods.core.bf16 import speed_dtype
    from methods.zoo.quality import forward_times

    cfg = preset(name)
    report = json.loads(paths.report_path.read_text())
    with torch.inference_mode():
        t_n = {"dtype": speed_dtype("bfloat16"), "context": cfg.tn_context,
               "loadavg_1min": os.getloadavg()[0]}
        for role, d in (("target_ms", paths.target_dir), ("draft_ms", paths.draft_dir)):
            model = AutoModelForCausalLM.from_pretrained(d)
            times = forward_times(model, list(cfg.tn_sizes), cfg.tn_context)
            t_n[role] = {str(n): v for n, v in times.items()}
    report["t_n"] = t_n
    tmp = Path(f"{paths.report_path}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, paths.report_path)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m methods.zoo", description=__doc__)
    ap.add_argument("command", choices=["build", "report", "retime", "path"])
    ap.add_argument("name", nargs="?", default="default", choices=sorted(PRESETS))
    ap.add_argument("--json", action="store_true", help="print the raw report.json")
    args = ap.parse_args(argv)
    if args.command == "path":
        print(zoo_dir(preset(args.name)))
        return 0
    paths = ensure_zoo(args.name)  # 'report' builds too if needed: the report is made while building
    if args.command == "retime":
        report = retime(paths, args.name)
    else:
        report = json.loads(paths.report_path.read_text())
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if not args.json:
        print(heads_report(paths))
        print(self_spec_report())
    print(f"  dirs: target={paths.target_dir}\n        draft={paths.draft_dir}\n"
          f"        tokenizer={paths.tokenizer_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
