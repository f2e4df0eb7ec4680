"""Draft & Verify's skip-set search (Zhang et al. 2023), by greedy forward selection instead of the paper's
Bayesian optimisation: a 6-layer target has 12 sub-layers (attention and MLP of each layer), 2^12 sets.

Proxy objective, on the calibration split (p = target, q = p with the set S skipped):
- α(S): greedy agreement P(argmax q = argmax p), position by position over calibration prompts (teacher
  forced on real text; q reads p's own prefix KV as the drafter does, so this is its depth-1 acceptance);
- c(S): draft step cost over t(1), from single-token forwards timed once on this device: the fixed part
  (embedding, norm, LM head: everything skipped) plus each kept attention / MLP sub-layer's share;
- predicted speedup max over γ ≤ ``max_gamma`` of Leviathan's (1 - α^{γ+1}) / ((1 - α)(γ c + t(γ+1)/t(1))).
Greedy: start from nothing skipped; each round adds the sub-layer whose skipping predicts the best speedup;
the best set seen on that path of 12 rounds (78 evaluations) is chosen and cached (keyed by the target's
weights and this config). ``python -m methods.drafters.skip_search`` prints the path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from methods.core.engine import ModelEngine
from methods.core.fast_llama import SubLayers
from methods.core.timing import median_seconds
from methods.zoo.identity import doc_key

VERSION = 1


@dataclass(frozen=True)
class SearchConfig:
    prompts: int = 8  # calibration-split prompts
    prompt_tokens: int = 256
    max_gamma: int = 8
    reps: int = 15  # timing repetitions per single-token forward


@dataclass(frozen=True)
class SkipSet:
    skip_attn: tuple[int, ...]
    skip_mlp: tuple[int, ...]
    alpha: float
    cost: float  # draft step / t(1)
    speedup: float  # predicted
    gamma: int  # the chain length that predicts it

    @property
    def sub(self) -> SubLayers:
        return SubLayers(skip_attn=frozenset(self.skip_attn), skip_mlp=frozenset(self.skip_mlp))


def predicted_speedup(alpha: float, cost: float, verify: list[float]) -> tuple[float, int]:
    """max over γ of (1 - α^{γ+1}) / ((1 - α)(γ c + verify[γ])), verify[γ] = t(γ+1)/t(1); (S, γ)."""
    best = (1.0, 0)
    for gamma in range(1, len(verify)):
        tau = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
        s = tau / (gamma * cost + verify[gamma])
        best = max(best, (s, gamma))
    return best


def unit_costs(engine: ModelEngine, context: torch.Tensor, cfg: SearchConfig) -> tuple[float, float, float,
                                                                                          list[float]]:
    """(fixed, per attention, per MLP) shares of t(1), and t(n)/t(1) for n = 1..max_gamma+1."""
    n_layers = engine.n_layers
    everything = frozenset(range(n_layers))
    engine.reset()
    engine.prefill(context[:-1])

    def step(sub: SubLayers | None, n: int = 1):
        def run():
            engine.extend(context[-n:], list(range(-1, n - 1)), last_only=n == 1, sub=sub)
            engine.drop_pending()
        return run

    full = median_seconds(step(None), cfg.reps, warmup=1)
    no_attn = median_seconds(step(SubLayers(skip_attn=everything)), cfg.reps, warmup=1)
    no_mlp = median_seconds(step(SubLayers(skip_mlp=everything)), cfg.reps, warmup=1)
    fixed = median_seconds(step(SubLayers(skip_attn=everything, skip_mlp=everything)), cfg.reps, warmup=1)
    verify = [1.0] + [median_seconds(step(None, n + 1), cfg.reps, warmup=1) / full
                      for n in range(1, cfg.max_gamma + 1)]
    engine.reset()
    attn, mlp = max(0.0, full - no_attn) / n_layers, max(0.0, full - no_mlp) / n_layers
    return fixed / full, attn / full, mlp / full, verify


@torch.inference_mode()
def search(target, tokenizer, cfg: SearchConfig) -> dict:
    """The greedy path (see the module docstring) and the chosen set."""
    from methods.data.workloads import load_prompts
    from specsim.config import WorkloadConfig

    w = WorkloadConfig(name="code", kind="code", split="calibration", num_prompts=cfg.prompts,
                       prompt_tokens=cfg.prompt_tokens)
    seqs = [torch.tensor(p.token_ids, dtype=torch.long) for p in load_prompts(w, tokenizer, 0)]
    engine = ModelEngine(target)
    start = time.perf_counter()
    fixed, attn, mlp, verify = unit_costs(engine, seqs[0], cfg)
    ref = [_argmax(engine, s, None) for s in seqs]
    n_layers = engine.n_layers

    def evaluate(skip: frozenset[tuple[str, int]]) -> SkipSet:
        sub = SubLayers(skip_attn=frozenset(i for k, i in skip if k == "attn"),
                        skip_mlp=frozenset(i for k, i in skip if k == "mlp"))
        agree = sum(int((_argmax(engine, s, sub) == r).sum()) for s, r in zip(seqs, ref))
        alpha = agree / sum(r.numel() for r in ref)
        cost = fixed + attn * (n_layers - len(sub.skip_attn)) + mlp * (n_layers - len(sub.skip_mlp))
        s, gamma = predicted_speedup(alpha, cost, verify)
        return SkipSet(tuple(sorted(sub.skip_attn)), tuple(sorted(sub.skip_mlp)), alpha, cost, s, gamma)

    units = [(k, i) for i in range(n_layers) for k in ("attn", "mlp")]
    chosen: frozenset[tuple[str, int]] = frozenset()
    path, evaluations = [], 0
    while len(chosen) < len(units) - 1:  # skipping everything leaves no draft
        trials = [(evaluate(chosen | {u}), u) for u in units if u not in chosen]
        evaluations += len(trials)
        best, unit = max(trials, key=lambda t: t[0].speedup)
        chosen = chosen | {unit}
        path.append(dataclasses.asdict(best))
    top = max(path, key=lambda r: r["speedup"])
    return {"chosen": top, "path": path, "evaluations": evaluations, "unit_costs": {
        "fixed": fixed, "attention": attn, "mlp": mlp, "verify_over_t1": verify},
        "seconds": time.perf_counter() - start, "loadavg_1min": os.getloadavg()[0],
        "positions": sum(r.numel() for r in ref), "config": dataclasses.asdict(cfg)}


def _argmax(engine: ModelEngine, seq: torch.Tensor, sub: SubLayers | None) -> torch.Tensor:
    engine.reset()
    out = engine.extend(seq, list(range(-1, seq.numel() - 1)), sub=sub)
    engine.drop_pending()
    return out.logits.argmax(-1)  # (T,)


def search_path(target, cfg: SearchConfig) -> Path:
    from methods.zoo.build import cache_root
    from methods.zoo.layerskip import fingerprint

    doc = {"v": VERSION, "target": fingerprint(target), "cfg": dataclasses.asdict(cfg),
           "dtype": str(target.dtype), "threads": torch.get_num_threads()}
    key = doc_key(doc, 16)
    return cache_root() / "draft_verify" / f"{key}.json"


def ensure_skip_set(target, tokenizer, cfg: SearchConfig = SearchConfig()) -> SkipSet:
    """The cached search's chosen set (searching first when missing)."""
    path = search_path(target, cfg)
    if not path.exists():
        print(f"draft_verify: searching the skip set (cached in {path})", file=sys.stderr, flush=True)
        result = search(target, tokenizer, cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(tmp, path)
    c = json.loads(path.read_text())["chosen"]
    return SkipSet(tuple(c["skip_attn"]), tuple(c["skip_mlp"]), c["alpha"], c["cost"], c["speedup"],
                   c["gamma"])


def main() -> int:
    """Search (or read the cache) for the default zoo target in bf16 and print the greedy path."""
    from methods.models import load_models
    from specsim.config import ModelConfig

    torch.set_num_threads(1)
    models = load_models(ModelConfig(), "cpu", "auto")
    ensure_skip_set(models.target, models.tokenizer)
    result = json.loads(search_path(models.target, SearchConfig()).read_text())
    print(f"greedy skip-set search: {result['evaluations']} sets evaluated in {result['seconds']:.0f} s; "
          f"unit costs (x t(1)): {result['unit_costs']['fixed']:.3f} fixed, "
          f"{result['unit_costs']['attention']:.3f}/attention, {result['unit_costs']['mlp']:.3f}/MLP")
    for r in result["path"]:
        mark = " <- chosen" if r == result["chosen"] else ""
        print(f"  skip attn {r['skip_attn']} mlp {r['skip_mlp']}: alpha {r['alpha']:.3f} cost {r['cost']:.3f}"
              f" predicted speedup {r['speedup']:.2f} (gamma {r['gamma']}){mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
