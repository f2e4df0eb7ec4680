"""Where a batch-1 decode step's time goes, per method (p = target, q = draft): thread CPU time of each phase
of methods.core.loop.decode, per target forward (step), over real prompts. Phases:

  target forward   ModelEngine.forward_tree of the target (of which: model math = the lean forward + LM head)
  draft propose    Drafter.propose (of which: the draft model's engine calls, extend / prefill)
  verify           loop.verify_step (argmax / acceptance on the host)
  target commit    ModelEngine.commit of the accepted path's KV
  draft feedback   Drafter.feedback (the draft cache's commit / rollback)
  prefill          the prompt's prefill (target) and the drafter's reset (a draft model's own prefill)
  rest             the loop's own bookkeeping (contexts, token buffer, statistics), the remainder

    python benchmarks/step_split.py --workload code --dtype bfloat16 --threads 1
    python benchmarks/step_split.py --methods staged --staged-depth 8 --num-prompts 16

Figures are thread CPU time (time.thread_time), so a loaded machine inflates them less than wall time; the
wrappers that time the phases cost ~1 µs per call. The staged row is the race's candidate (benchmarks/
candidates.py: depth D, top-2 branches, the second stage guessing up to D tokens on up to --staged-order
context tokens); vanilla is a γ chain; autoregressive is the same loop proposing the root alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import methods.core.loop as loop  # noqa: E402
from methods.core.engine import ModelEngine  # noqa: E402
from methods.core.loop import DecodeOptions, decode  # noqa: E402
from methods.core.sampling import SamplingParams  # noqa: E402
from methods.data.workloads import load_prompts  # noqa: E402
from methods.drafters.registry import build_drafter  # noqa: E402
from methods.models import load_models  # noqa: E402
from specsim.config import Verifier  # noqa: E402
from specsim.tree import Tree  # noqa: E402

PHASES = ("target forward", "  model math", "draft propose", "  draft model", "verify", "target commit",
          "draft feedback", "prefill")


class Clock:
    """Thread CPU time per phase, accumulated by wrappers set on instances (and on loop.verify_step); a
    sub-phase (``within``) counts only calls made inside its phase (the target's model math inside its
    verify forward, not inside its prefill)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.active: set[str] = set()
        self._undo: list = []

    def wrap(self, obj, name: str, phase: str, within: str | None = None) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            if within is not None and within not in self.active:
                return inner(*args, **kwargs)
            t, outer = time.thread_time(), phase not in self.active
            self.active.add(phase)
            try:
                return inner(*args, **kwargs)
            finally:
                if outer:
                    self.active.discard(phase)
                    self.seconds[phase] += time.thread_time() - t
                    self.calls[phase] += 1

        had = name in vars(obj)
        setattr(obj, name, timed)
        self._undo.append((obj, name, inner if had else None))

    def unwrap(self) -> None:
        for obj, name, old in reversed(self._undo):
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._undo.clear()


def instrument(clock: Clock, target: ModelEngine, drafter) -> None:
    clock.wrap(target, "forward_tree", "target forward")
    clock.wrap(target, "commit", "target commit")
    clock.wrap(target, "prefill", "prefill")
    if target.fast is not None:
        clock.wrap(target.fast, "forward", "  model math", within="target forward")
        clock.wrap(target.fast, "logits", "  model math", within="target forward")
    clock.wrap(drafter, "propose", "draft propose")
    clock.wrap(drafter, "feedback", "draft feedback")
    clock.wrap(drafter, "reset", "prefill")
    own = getattr(drafter, "engine", None)
    if isinstance(own, ModelEngine) and own is not target:  # a draft model's own engine
        clock.wrap(own, "extend", "  draft model", within="draft propose")
    clock.wrap(loop, "verify_step", "verify")


def methods_to_run(args) -> dict[str, tuple[tuple[str, ...], Tree | None, dict]]:
    d = args.staged_depth
    return {
        "autoregressive": (("method=autoregressive",), Tree.chain(0), {}),
        "vanilla": (("method=vanilla", "tree=chain"), Tree.chain(args.gamma), {}),
        "staged": (("method=staged",), None,
                   {"depth": d, "top_k": 2, "stage2_gamma": d, "order": args.staged_order}),
    }


def split(args, models, prompts: tuple[list, list], opts, compose, name: str) -> None:
    """``prompts``: (warm-up, measured); the warm-up prompts come from the calibration split, so that the
    staged second stage's table, which persists across prompts, has not seen the measured ones."""
    overrides, tree, params = methods_to_run(args)[name]
    method = compose(*overrides).method
    method.params = {**method.params, **params}
    drafter = build_drafter(method, tree, models, opts.sampling)
    target = ModelEngine(models.target)

    def run_all(which: list) -> tuple[int, int]:
        out = [decode(target, drafter, p, opts, torch.Generator().manual_seed(0)) for p in which]
        return sum(len(r.token_ids) for r in out), sum(r.n_target_forwards for r in out)

    run_all(prompts[0])  # warm-up (the staged second stage learns on it, as in the benchmarks' race)
    forwards0 = getattr(drafter, "draft_forwards", 0), getattr(drafter, "steps", 0)
    clock = Clock()
    instrument(clock, target, drafter)
    t = time.thread_time()
    tokens, steps = run_all(prompts[1])
    total = time.thread_time() - t
    clock.unwrap()
    extra = ""
    if hasattr(drafter, "steps") and drafter.steps > forwards0[1]:
        per_step = (drafter.draft_forwards - forwards0[0]) / (drafter.steps - forwards0[1])
        extra = f", {per_step:.2f} draft forwards/step"
    print(f"== {name}: {tokens} tokens, {steps} steps, tau {tokens / steps:.2f}, {tokens / total:.1f} "
          f"tok/s (thread CPU), {1e3 * total / steps:.3f} ms/step{extra}")
    top = 0.0
    for phase in PHASES:
        s = clock.seconds.get(phase, 0.0)
        if not phase.startswith(" "):
            top += s
        if s:
            print(f"  {phase:16s} {1e3 * s / steps:7.3f} ms/step {100 * s / total:5.1f}%  "
                  f"({clock.calls[phase] / steps:.2f} calls/step)")
    print(f"  {'rest':16s} {1e3 * (total - top) / steps:7.3f} ms/step {100 * (total - top) / total:5.1f}%")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="zoo")
    ap.add_argument("--workload", default="code")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--warmup-prompts", type=int, default=2, help="from the calibration split")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gamma", type=int, default=4, help="vanilla's chain")
    ap.add_argument("--staged-depth", type=int, default=6)
    ap.add_argument("--staged-order", type=int, default=4)
    ap.add_argument("--methods", nargs="+", default=["staged", "vanilla", "autoregressive"],
                    choices=["staged", "vanilla", "autoregressive"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import run  # the repository's entry point: composes conf/ presets (Hydra stays there)

    base = (f"model={args.model}", f"workload={args.workload}", f"model.dtype={args.dtype}",
            f"workload.num_prompts={args.num_prompts}", f"workload.max_new_tokens={args.max_new}")
    cfg = run.compose_run_config(*base)
    models = load_models(cfg.model, "cpu", args.dtype)
    calib = dataclasses.replace(cfg.workload, split="calibration", num_prompts=args.warmup_prompts)
    prompts = tuple([torch.tensor(p.token_ids) for p in load_prompts(w, models.tokenizer, cfg.seed)]
                    for w in (calib, cfg.workload))
    opts = DecodeOptions(Verifier.greedy, SamplingParams(0.0), args.max_new, None)
    print(f"model={args.model} dtype={args.dtype} workload={args.workload} prompts={len(prompts[1])} "
          f"max_new={args.max_new} threads={torch.get_num_threads()}")
    for name in args.methods:
        split(args, models, prompts, opts, lambda *o: run.compose_run_config(*base, *o), name)


if __name__ == "__main__":
    main()
