"""LayerSkip's exit layer E chosen by calibration on this device (Elhoushi et al. 2024 set E per model by
hand; ``method.params.exit_layer: auto`` asks for it here). p = the decoded model, q = its early exit after
layer E.

For each E = 1..L-1, on calibration-split prompts (code) continued greedily by p itself (the text greedy
decoding verifies), teacher forced:
- α_E: greedy agreement P(argmax q_E = argmax p), position by position over the continuations;
- τ_E at the draft length γ: 1 + E[min(γ, run of agreements from a position)] — a greedy chain drafted at
  that position is accepted up to its first disagreement (iid positions, (1 - α^{γ+1}) / (1 - α), read
  τ 1.76 at E = 2 of the LayerSkip variant where the loop measured 2.10: agreement comes in runs);
- ρ_E: the early-exit draft step over t(1), and v = t(γ+1)/t(1) for the verify, timed on this device in
  interleaved rounds (methods.zoo.layerskip.exit_timings), with thread CPU time when torch runs one thread
  (a loaded machine's preemptions then drop out of the ratios);
- predicted speedup at the configured draft length γ (methods.zoo.layerskip.choose_exit):
  τ_E / (γ ρ_E + (1 - E/L) v + E/L).
The best E is chosen; the table is cached under ``<cache>/profiles/layerskip-exit-<key>.json`` (keyed by the
model's weights, γ, this config, dtype, torch threads and the CPU), and the run's metrics.json carries it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from methods.core.engine import ModelEngine
from methods.core.fast_llama import SubLayers
from methods.core.timing import ratio_clock
from methods.zoo.greedy import greedy_extend
from methods.zoo.identity import doc_key

VERSION = 2  # 2: τ_E from runs of agreement on greedy continuations


@dataclass(frozen=True)
class ExitChoiceConfig:
    prompts: int = 8  # calibration-split prompts
    prompt_tokens: int = 128
    new_tokens: int = 96  # greedy continuation of each prompt by the model: the positions scored
    reps: int = 15  # interleaved timing rounds


DEFAULT = ExitChoiceConfig()  # what exit_layer=auto runs (tests swap in a smaller one)


@torch.inference_mode()
def exit_table(model, tokenizer, gamma: int, cfg: ExitChoiceConfig = ExitChoiceConfig()) -> dict:
    """Every exit's α, ρ and predicted speedup at draft length ``gamma``, best first, and the chosen E."""
    from methods.data.workloads import load_prompts
    from methods.zoo.layerskip import choose_exit, exit_timings
    from specsim.config import WorkloadConfig

    start = time.perf_counter()
    w = WorkloadConfig(name="code", kind="code", split="calibration", num_prompts=cfg.prompts,
                       prompt_tokens=cfg.prompt_tokens)
    prompts = [torch.tensor(p.token_ids, dtype=torch.long) for p in load_prompts(w, tokenizer, 0)]
    seqs = [greedy_extend(model, p[None].to(model.device), cfg.new_tokens)[0].cpu() for p in prompts]
    engine = ModelEngine(model)
    n_layers = engine.n_layers
    ref = [_argmax(engine, s, None)[p.numel() - 1 : -1] for s, p in zip(seqs, prompts)]
    agree = {e: [_argmax(engine, s, SubLayers(stop=e))[p.numel() - 1 : -1] == r
                 for s, p, r in zip(seqs, prompts, ref)] for e in range(1, n_layers)}
    positions = sum(r.numel() for r in ref)
    agreement = [sum(int(a.sum()) for a in agree[e]) / positions for e in range(1, n_layers)] + [1.0]
    tau = {e: chain_tau(agree[e], gamma) for e in agree}
    clock = ratio_clock()
    rho, verify = exit_timings(model, seqs[0], cfg.reps, gamma + 1, clock)
    ranked = choose_exit(agreement, {1: 1.0, gamma + 1: verify}, draft_cost=rho, gamma=gamma, tau=tau)
    return {"chosen": ranked[0]["exit_layer"], "ranked": ranked, "gamma": gamma,
            "verify_over_t1": verify, "clock": clock.__name__, "positions": positions,
            "seconds": time.perf_counter() - start, "loadavg_1min": os.getloadavg()[0],
            "config": dataclasses.asdict(cfg)}


def chain_tau(agree: list[torch.Tensor], gamma: int) -> float:
    """Mean tokens per step of a greedy chain of ``gamma`` drafted at each position whose γ next positions
    are scored: 1 + the run of agreements from there, capped at γ. ``agree``: per sequence, (n,) bool."""
    total, count = 0.0, 0
    for a in agree:
        run = torch.zeros(a.numel() + 1, dtype=torch.long)
        for i in range(a.numel() - 1, -1, -1):  # run[i] = consecutive agreements from position i
            run[i] = run[i + 1] + 1 if a[i] else 0
        starts = run[: max(0, a.numel() - gamma + 1)]
        total += float((1 + starts.clamp(max=gamma)).sum())
        count += starts.numel()
    return total / max(count, 1)


def _argmax(engine: ModelEngine, seq: torch.Tensor, sub: SubLayers | None) -> torch.Tensor:
    engine.reset()
    out = engine.extend(seq, list(range(-1, seq.numel() - 1)), sub=sub)
    engine.drop_pending()
    return out.logits.argmax(-1)  # (T,)


def choice_path(model, gamma: int, cfg: ExitChoiceConfig) -> Path:
    from methods.zoo.build import cache_root
    from methods.zoo.layerskip import fingerprint

    doc = {"v": VERSION, "model": fingerprint(model), "gamma": gamma, "cfg": dataclasses.asdict(cfg),
           "dtype": str(model.dtype), "threads": torch.get_num_threads(), "device": str(model.device),
           "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    return cache_root() / "profiles" / f"layerskip-exit-{doc_key(doc, 16)}.json"


def ensure_exit_choice(model, tokenizer, gamma: int, cfg: ExitChoiceConfig | None = None) -> dict:
    """The cached exit table for this model on this device (calibrated first when missing)."""
    cfg = cfg or DEFAULT
    path = choice_path(model, gamma, cfg)
    if not path.exists():
        print(f"layerskip: choosing the exit layer on this device (cached in {path})", file=sys.stderr,
              flush=True)
        table = exit_table(model, tokenizer, gamma, cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=2) + "\n")
        os.replace(tmp, path)
    return json.loads(path.read_text())
