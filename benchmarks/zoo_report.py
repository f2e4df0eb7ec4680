"""Print the embedded zoo's quality report (held-out perplexity, p/q agreement, loop rates, t(n)), building
the zoo first if needed; ``--step-time`` instead times a few training steps of each model to project the
build time of a preset on this machine (the quiet-machine argument for the 10-minute budget).

    python benchmarks/zoo_report.py [--zoo default] [--json] [--step-time]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_times(name: str, steps: int = 4) -> dict:
    """Seconds per training step (median of ``steps`` after one warm-up) of each model and window shape,
    on random tokens, as training runs them (its optimizer and attention; for the draft, the distillation
    forward of a bf16 teacher; the token-level unlikelihood term when the preset has one, on every
    position: an upper bound, training applies it on prose windows only); the extra seconds of a
    sequence-level unlikelihood step (greedy rollouts + their forward and backward); and the training time
    they project for the preset's step counts."""
    import statistics

    import torch

    from methods.zoo.build import preset
    from methods.zoo.train import (
        Packed,
        Rollouts,
        _step,
        distill_teacher,
        eager_attention,
        new_model,
        optimizer,
        sample_batch,
    )

    cfg = preset(name)
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(0, cfg.vocab_size, (200_000,), generator=gen)
    packed = Packed(stream, torch.arange(len(stream)) % 2000 < 1000)  # prose and code windows for rollouts
    out: dict = {"loadavg_1min_start": os.getloadavg()[0], "torch_threads": torch.get_num_threads()}
    models = {}
    projected = 0.0

    def median_step(model, opt, x, bf16, teacher, ul=None, rollouts=None) -> float:
        """Median seconds of ``_step``; with ``rollouts`` (Rollouts, weight), sampling them is timed too."""
        times = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            rollout = None if rollouts is None else (*rollouts[0].sample(model, gen, bf16), rollouts[1])
            _step(model, opt, x, bf16, teacher, ul, rollout)
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    for role, spec in (("target", cfg.target), ("draft", cfg.draft)):
        models[role] = model = new_model(spec, cfg.vocab_size, 0, cfg.max_positions, seed=0)
        opt, bf16 = optimizer(model, spec), spec.train_dtype == "bfloat16"
        teacher = (distill_teacher(models["target"], spec), spec.distill) if spec.distill else (None, 0.0)
        shape_of = [cfg.windows.at(s, spec.steps, spec.batch_size) for s in range(spec.steps)]
        with eager_attention(model, teacher[0]):
            for b, t in sorted(set(shape_of)):
                x = sample_batch(stream, b, t, gen)
                ul = ((torch.ones(b, t - 1, dtype=torch.bool), spec.unlikelihood, spec.unlikelihood_window)
                      if spec.unlikelihood else None)
                out[f"{role}_{b}x{t}_s_per_step"] = sec = median_step(model, opt, x, bf16, teacher, ul)
                projected += shape_of.count((b, t)) * sec
            seq = spec.sequence_unlikelihood
            if seq.weight and seq.steps:  # its steps' data batch is counted above; add the rollouts' share
                x = sample_batch(stream, *shape_of[-1], gen)
                rollouts = (Rollouts(packed, seq), seq.weight)
                extra = (median_step(model, opt, x, bf16, teacher, rollouts=rollouts)
                         - median_step(model, opt, x, bf16, teacher))
                out[f"{role}_sequence_unlikelihood_extra_s_per_step"] = extra
                projected += seq.steps * extra
    out["projected_training_s"] = projected
    out["loadavg_1min_end"] = os.getloadavg()[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", default="default")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--step-time", action="store_true", help="time training steps, not the report")
    args = ap.parse_args()
    if args.step_time:
        print(json.dumps(step_times(args.zoo), indent=2))
        return 0
    from methods.zoo.__main__ import main as zoo_main

    return zoo_main(["report", args.zoo] + (["--json"] if args.json else []))


if __name__ == "__main__":
    sys.exit(main())
