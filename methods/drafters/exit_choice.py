"""LayerSkip's exit layer E chosen by calibration on this device (Elhoushi et al. 2024 set E per model by
hand; ``method.params.exit_layer: auto`` asks for it here). p = the decoded model, q = its early exit after
layer E.

For each E = 1..L-1, on the calibration split (code, teacher forced on real text, as Draft & Verify's skip
search):
- α_E: greedy agreement P(argmax q_E = argmax p), position by position;
- ρ_E: the early-exit draft step over t(1), and v = t(γ+1)/t(1) for the verify, timed on this device in
  interleaved rounds (methods.zoo.layerskip.exit_timings), with thread CPU time when torch runs one thread
  (a loaded machine's preemptions then drop out of the ratios);
- predicted speedup at the configured draft length γ (methods.zoo.layerskip.choose_exit):
  τ_E / (γ ρ_E + (1 - E/L) v + E/L), τ_E = (1 - α_E^{γ+1}) / (1 - α_E).
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
from methods.zoo.identity import doc_key

VERSION = 1


@dataclass(frozen=True)
class ExitChoiceConfig:
    prompts: int = 8  # calibration-split prompts
    prompt_tokens: int = 256
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
    seqs = [torch.tensor(p.token_ids, dtype=torch.long) for p in load_prompts(w, tokenizer, 0)]
    engine = ModelEngine(model)
    n_layers = engine.n_layers
    ref = [_argmax(engine, s, None) for s in seqs]
    positions = sum(r.numel() for r in ref)
    agreement = [sum(int((_argmax(engine, s, SubLayers(stop=e)) == r).sum()) for s, r in zip(seqs, ref))
                 / positions for e in range(1, n_layers)] + [1.0]
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    rho, verify = exit_timings(model, seqs[0], cfg.reps, gamma + 1, clock)
    ranked = choose_exit(agreement, {1: 1.0, gamma + 1: verify}, draft_cost=rho, gamma=gamma)
    return {"chosen": ranked[0]["exit_layer"], "ranked": ranked, "gamma": gamma,
            "verify_over_t1": verify, "clock": clock.__name__, "positions": positions,
            "seconds": time.perf_counter() - start, "loadavg_1min": os.getloadavg()[0],
            "config": dataclasses.asdict(cfg)}


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
