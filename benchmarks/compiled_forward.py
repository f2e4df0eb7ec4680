"""The compiled forward (methods.core.compiled_llama) against the eager lean forward, in one process,
interleaved: t(n) of a tree forward of n nodes + commit at a fixed cache length, for the target and the
draft, in ms of the thread's CPU time (medians of --reps per round, median of the rounds) and of wall time;
the compile time once (a first run; later processes reuse inductor's on-disk cache).

    python benchmarks/compiled_forward.py                       # zoo bf16, one thread, context 160
    python benchmarks/compiled_forward.py --sizes 1,2,4,8,13,16 --rounds 5 --reps 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from methods.core.engine import ModelEngine  # noqa: E402
from methods.core.timing import median_seconds  # noqa: E402
from methods.models import load_models  # noqa: E402
from specsim.tree import Tree  # noqa: E402


def _tree(n: int) -> Tree:
    """A binary-ish tree of n nodes (breadth-first), as Sequoia/SpecInfer trees are; n = 1: the root."""
    return Tree.from_parents([-1] + [(i - 1) // 2 for i in range(1, n)])


def bench(model, name: str, context: int, sizes: list[int], rounds: int, reps: int) -> None:
    prompt = torch.randint(0, min(model.config.vocab_size, 256), (context + max(sizes),),
                           generator=torch.Generator().manual_seed(0))
    engines = {"eager": ModelEngine(model, compile=False), "compiled": ModelEngine(model, compile=True)}
    for e in engines.values():
        e.prefill(prompt[:context])

    def step(e: ModelEngine, n: int) -> None:
        out = e.forward_tree(prompt[context: context + n], _tree(n))
        int(out.logits[0].argmax())
        e.commit((0,))
        e.truncate(context)

    for n in sizes:  # compile every shape family first (n = 1 and n > 1, with a mask)
        t0 = time.perf_counter()
        step(engines["compiled"], n)
        if time.perf_counter() - t0 > 1:
            print(f"{name}: compiled n={n} in {time.perf_counter() - t0:.1f} s", flush=True)
    n = sizes[-1]
    got, want = (e.forward_tree(prompt[context: context + n], _tree(n)).logits for e in engines.values())
    for e in engines.values():
        e.drop_pending()
    same = bool((got.argmax(-1) == want.argmax(-1)).all())
    print(f"{name}: n={n}: max |logit difference| compiled vs eager {(got - want).abs().max().item():.4g}, "
          f"argmax equal on every row: {same}")
    for clock, label in ((time.thread_time, "cpu"), (time.perf_counter, "wall")):
        for n in sizes:
            res: dict[str, list[float]] = {k: [] for k in engines}
            for _ in range(rounds):
                for k, e in engines.items():
                    res[k].append(median_seconds(lambda e=e, n=n: step(e, n), reps, warmup=2, clock=clock))
            a, b = (statistics.median(res[k]) * 1e3 for k in engines)
            print(f"{name} t({n:2d}) {label:4s} eager {a:7.3f} ms  compiled {b:7.3f} ms  "
                  f"eager/compiled {a / b:5.3f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="zoo", help="a conf/model preset")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the preset's)")
    ap.add_argument("--context", type=int, default=160, help="tokens in the KV cache")
    ap.add_argument("--sizes", default="1,2,4,8,13,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--which", default="target,draft")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import run

    cfg = run.compose_run_config(f"model={args.model}")
    models = load_models(cfg.model, "cpu", args.dtype or cfg.model.dtype)
    sizes = [int(x) for x in args.sizes.split(",")]
    for name in args.which.split(","):
        model = getattr(models, name)
        if model is not None:
            bench(model, name, args.context, sizes, args.rounds, args.reps)


if __name__ == "__main__":
    main()
