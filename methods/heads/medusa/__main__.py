"""``python -m methods.heads.medusa [--zoo default] [--steps N] [--joint]``: train (or find cached) Medusa
heads on a zoo target and print the report: training time, per-head top-1/top-5 accuracy on the test split
(teacher-forced and on greedy continuations), and the expected accepted tokens k̄ of Medusa trees built from
the measured accuracies (Cai et al., 2024; p = target, q = heads)."""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m methods.heads.medusa", description=__doc__)
    ap.add_argument("--zoo", default="default")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="Medusa-1 steps (default: TrainConfig's)")
    ap.add_argument("--teacher", default="self", choices=("self", "data"))
    ap.add_argument("--joint", action="store_true", help="Medusa-2: joint training after the heads stage")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    ap.add_argument("--frozen-projection", action="store_true", help="train the ResBlocks only")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from methods.heads.medusa.store import ensure_medusa
    from methods.heads.medusa.train import TrainConfig
    from methods.heads.medusa.tree import expected_tokens, greedy_tree
    from methods.models import resolve_dtype
    from methods.zoo import ensure_zoo
    from specsim.tree import Tree

    paths = ensure_zoo(args.zoo)
    dtype = resolve_dtype(args.dtype)
    target = AutoModelForCausalLM.from_pretrained(paths.target_dir, local_files_only=True, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(paths.tokenizer_dir)
    extra = {"steps": args.steps} if args.steps is not None else {}
    cfg = TrainConfig(
        num_heads=args.heads,
        teacher=args.teacher,
        joint=args.joint,
        train_projection=not args.frozen_projection,
        **extra,
    )
    built = ensure_medusa(target, tok, cfg)
    r = built.report
    print(f"medusa-{r['medusa']} heads: {built.root}")
    print(
        f"train {r['train_seconds']:.0f} s (eval {r['eval_seconds']:.0f} s), loss {r['loss_first']:.3f} "
        f"-> {r['loss_last']:.3f}, teacher={cfg.teacher}"
    )
    for key in ("forced", "generated"):
        for k, (a1, a5) in enumerate(zip(r[f"top1_{key}"], r[f"top5_{key}"]), start=1):
            print(f"  head {k} ({key:9s}): top-1 {a1:.3f}  top-5 {a5:.3f}")
    if "target_drift" in r:
        print(f"medusa-2 target drift: {r['target_drift']}")
    acc = built.accuracy
    chain = Tree.chain(acc.shape[0])
    print(f"k̄ chain of {acc.shape[0]}: {expected_tokens(chain, acc):.3f}")
    for budget in (8, 16, 32, 64):
        t = greedy_tree(acc, budget)
        print(f"k̄ greedy tree, {budget} nodes (depth {t.tree.depth}): {t.expected_tokens:.3f}")
    print(json.dumps({k: r[k] for k in ("top1_generated", "top5_generated")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
