"""What one EAGLE draft level costs next to a target step t(1), and how much of it is arithmetic (Li et al.
2024a: the head is one decoder layer + the target's LM head; p = target, q = head).

In ONE process, interleaved, this thread's CPU time (``time.thread_time``, robust to a loaded machine's other
jobs; ``--threads 1``): the target's one-row step (the lean engine, the run's dtype) and its verify forward
over the k-ary tree, and the head's pieces on the same context: the LM head on one row, the catch-up on
the accepted rows (once per step, outside ``propose``), one decoder-layer level over n rows
(``HeadCache.feed``), and the drafter's whole ``propose`` for a static and a dynamic tree (per level:
divided by the levels). Beside them, the weight ratio of one level to a target forward (a CPU
draft level of a few rows is weight-bandwidth bound, like a target step).

    python benchmarks/eagle_draft_cost.py method=eagle
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from methods.core.drafter import DraftContext  # noqa: E402
from methods.core.engine import ModelEngine  # noqa: E402
from methods.core.sampling import SamplingParams  # noqa: E402
from methods.core.timing import median_seconds  # noqa: E402
from methods.data.workloads import load_prompts  # noqa: E402
from methods.drafters.eagle import Dynamic, EagleDrafter  # noqa: E402
from methods.drafters.registry import build_drafter  # noqa: E402
from methods.models import load_models  # noqa: E402
from specsim.tree import Tree  # noqa: E402


def weights(target, draft_vocab: int | None = None) -> dict[str, int]:
    """Matmul weights (parameters read per row) of a target forward and of one EAGLE-1 / EAGLE-3 level
    (EAGLE-3's LM head: ``draft_vocab`` rows, default the target's vocabulary)."""
    c = target.config
    H, I, V, d = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    Vd = draft_vocab or V
    n, kv = c.num_attention_heads, c.num_key_value_heads
    attn, mlp = H * (n + 2 * kv) * d + n * d * H, 3 * H * I
    return {"target": c.num_hidden_layers * (attn + mlp) + H * V, "lm_head": H * V, "layer": attn + mlp,
            "eagle1_level": 2 * H * H + attn + mlp + H * V,  # fc(e ++ g) + the layer + the LM head
            "eagle3_level": 2 * attn + mlp - (n * d * H) + H * Vd}  # 2H-wide q/k/v; fc only on committed rows


def clock(fn, reps: int) -> float:
    """Median thread CPU seconds of fn() over reps calls (one warm-up)."""
    return median_seconds(fn, reps, warmup=1, clock=time.thread_time)


@torch.inference_mode()  # as the decode loop runs (the head's cache holds inference tensors)
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median of their medians)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="run.py overrides (method=eagle|eagle3, model.dtype=...)")
    args = ap.parse_args(argv)
    import run

    torch.set_num_threads(args.threads)
    cfg = run.compose_run_config("method=eagle", *args.overrides)
    models = load_models(cfg.model, "cpu", cfg.model.dtype)
    greedy = SamplingParams(temperature=0.0)
    drafter = build_drafter(cfg.method, None, models, greedy, tree_cfg=None)
    head = drafter.head
    ids = torch.tensor(load_prompts(cfg.workload, models.tokenizer, cfg.seed)[0].token_ids)
    engine = ModelEngine(models.target)
    layers = tuple(drafter.feature_layers)
    out = engine.prefill(ids, hidden=True, layers=layers)
    src = out.features if layers else out.hidden
    static = EagleDrafter(head, Tree.kary(2, 3), greedy)
    dynamic = EagleDrafter(head, Dynamic(14, 3, 4), greedy)
    gen = torch.Generator().manual_seed(0)
    for d in (drafter, static, dynamic):
        d.propose(DraftContext(ids, src[:-1], gen, max_new=64, features=src[:-1]))
    ctx = DraftContext(ids, None, gen, max_new=64)
    root = ids[-1:]
    kary = Tree.kary(2, 3)
    kary_tokens = ids[-1:].repeat(kary.size)
    cache = static.cache
    H = head.cfg.hidden_size
    p = head.fc.weight

    def target(tree, toks):
        def go():
            engine.forward_tree(toks, tree)
            engine.drop_pending()
        return go

    def feed(n):
        h, toks, par = torch.zeros(n, H, dtype=p.dtype), ids[-n:], torch.full((n,), -1)

        def go():
            cache.feed(h, toks, 1, par)
            cache.drop_pending()
        return go

    def catch_up(n):
        f, toks = src[-n:].to(p.dtype), ids[-n:]

        def go():  # the accepted rows' append (EAGLE-3: fused first), undone: the cache keeps its length
            length, last = cache.length, cache.last
            cache.append(head.fuse(f), toks)
            cache.length, cache.last = length, last
        return go

    tasks = {
        "t(1) target step": target(Tree.chain(0), root),
        "t(15) target verify, 2-ary depth 3": target(kary, kary_tokens),
        "head LM head, 1 row": lambda: head.logits(cache.last[None]),
        "head LM head, 4 rows": lambda: head.logits(cache.last.expand(4, -1)),
        "head catch-up, 3 accepted rows": catch_up(3),
        "head layer level, 1 row": feed(1),
        "head layer level, 4 rows": feed(4),
        "propose static 2-ary depth 3": lambda: static.propose(ctx),
        "propose dynamic 14/3/4": lambda: dynamic.propose(ctx),
    }
    res = {k: [] for k in tasks}
    for _ in range(args.rounds):
        for k, fn in tasks.items():
            res[k].append(clock(fn, args.reps))
    t1 = statistics.median(res["t(1) target step"])
    print(f"{cfg.method.name} ({head.cfg.variant}), target {cfg.model.dtype}, head {p.dtype}, "
          f"{args.threads} thread(s), context {ids.numel()}, draft vocabulary {head.cfg.draft_vocab_size}: "
          f"thread CPU time, median of {args.rounds} rounds")
    for k, v in res.items():
        m = statistics.median(v)
        per = m / 3 if k.startswith("propose") else m
        tail = f"  = {per / t1:.3f} t(1) per level" if k.startswith("propose") else ""
        print(f"  {k:38} {m * 1e3:7.3f} ms  {m / t1:6.3f} t(1){tail}")
    w = weights(models.target, head.cfg.draft_vocab_size)
    print("weights read per row: " + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in w.items()))
    print(f"  arithmetic ratio of a level: EAGLE-1 {w['eagle1_level'] / w['target']:.3f}, "
          f"EAGLE-3 {w['eagle3_level'] / w['target']:.3f} (LM head alone {w['lm_head'] / w['target']:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
