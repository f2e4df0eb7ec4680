"""task=measure with engine=vllm: the method and vLLM's own plain decoding on the same model, prompts and
batch, interleaved batch by batch, with the simulator's prediction beside the measurement (p = target, q =
draft).

The prediction uses what is engine-independent from specsim's calibrated profile of the same drafter on the
same models — the acceptance model, and the ratios t(n)/t(1) of a verify forward — and prices them with
vLLM's own measured steps: t(1) from its plain decoding in this run, and the draft model's step from a
plain vLLM run of the draft (draft_model), the n-gram lookup as free (prompt_lookup).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from tqdm import tqdm

from methods.data.workloads import load_prompts
from methods.measurement.calibrate import ensure_profile
from methods.measurement.measure import RunResult, run_tree
from methods.measurement.profiles import Profile, profile_config, tree_predictions
from methods.measurement.vllm_engine import (
    Counters,
    Generation,
    VllmEngine,
    VllmSettings,
    plan_for,
)
from specsim.config import RunConfig
from specsim.tree import Tree


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    target_dir: str
    draft_dir: str | None
    tokenizer_dir: str


def checkpoints(cfg: RunConfig) -> Checkpoints:
    """Directories vLLM loads: the zoo's (built on first use) or the configured local/hub paths."""
    m = cfg.model
    if m.source == "zoo":
        from methods.zoo import ensure_zoo

        paths = ensure_zoo(m.zoo)
        return Checkpoints(str(paths.target_dir), str(paths.draft_dir), str(paths.tokenizer_dir))
    if m.source in ("hub", "local"):
        return Checkpoints(m.path, m.draft_path or None, m.path)
    raise ValueError(f"engine=vllm loads checkpoints from disk: model.source={m.source!r} has none")


def vllm_profile(profile: Profile, t1: float, draft_step: float) -> Profile:
    """The specsim profile's ratios (t(n)/t(1), verification overhead/t(1)) anchored on vLLM's plain step
    ``t1``, with vLLM's own draft step."""
    return dataclasses.replace(profile.with_t1(t1), draft_ratio=draft_step / t1)


def _step_s(gen: Generation, max_new: int) -> float:
    """Seconds per decode step of the batch (every row emits one token per plain step)."""
    return gen.seconds / max_new


def measure_vllm(cfg: RunConfig, show_progress: bool = True) -> RunResult:
    from transformers import AutoTokenizer

    ck = checkpoints(cfg)
    w = cfg.workload
    tokenizer = AutoTokenizer.from_pretrained(ck.tokenizer_dir, local_files_only=True)
    prompts = load_prompts(w, tokenizer, cfg.seed)
    tree = run_tree(cfg)
    plan = plan_for(cfg.method.drafter, tree.depth, ck.draft_dir, dict(cfg.method.params))
    e = cfg.engine
    settings = VllmSettings(dtype=cfg.model.dtype, kv_cache_gib=e.kv_cache_gib,
                            memory_fraction=e.memory_fraction, enforce_eager=e.enforce_eager, seed=cfg.seed)
    bar = tqdm(total=3, desc="vllm engines", disable=not show_progress)
    plain = VllmEngine(ck.target_dir, plan_for("autoregressive", 0, None), settings)
    bar.update()
    method = VllmEngine(ck.target_dir, plan, settings) if plan.method else plain
    bar.update()
    draft_step = 0.0
    if plan.method == "draft_model":  # vLLM's own step of the draft model, decoding plainly
        draft = VllmEngine(ck.draft_dir, plan_for("autoregressive", 0, None), settings)
        draft_step = _step_s(draft.generate([prompts[0].token_ids], w.max_new_tokens), w.max_new_tokens)
        draft_step = min(draft_step, _step_s(draft.generate([prompts[0].token_ids], w.max_new_tokens),
                                             w.max_new_tokens))
        del draft
    bar.update()
    bar.close()
    return _interleaved(cfg, prompts, (plain, method), tree, draft_step, show_progress)


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _interleaved(cfg: RunConfig, prompts, engines, tree: Tree, draft_step: float, show_progress: bool
                 ) -> RunResult:
    plain, method = engines
    w = cfg.workload
    ids = [p.token_ids for p in prompts]
    plain.generate(ids[:1], 8)  # warm-up: first calls allocate and compile
    method.generate(ids[:1], 8)
    base, spec, samples = [], [], []
    for batch, chunk in zip(_batches(ids, w.batch_size), _batches(prompts, w.batch_size)):
        ref = plain.generate(batch, w.max_new_tokens, w.temperature, cfg.seed)
        same = method is plain  # autoregressive: the plain run is the method's run
        res = ref if same else method.generate(batch, w.max_new_tokens, w.temperature, cfg.seed)
        base.append(ref)
        spec.append(res)
        for p, got, want in zip(chunk, res.token_ids, ref.token_ids):
            samples.append({"prompt_id": p.prompt_id, "token_ids": got, "equal_to_baseline": got == want})
        if show_progress:
            print(f"vllm batch: plain {ref.tokens_per_s:.0f} tok/s, {cfg.method.name} {res.tokens_per_s:.0f}",
                  flush=True)
    return RunResult(_metrics(cfg, base, spec, samples, tree, draft_step), samples)


def _metrics(cfg: RunConfig, base: list[Generation], spec: list[Generation], samples: list[dict],
             tree: Tree, draft_step: float) -> dict[str, Any]:
    w = cfg.workload
    total = Counters()
    for g in spec:
        total = total.plus(g.counters)
    tps = sum(g.new_tokens for g in spec) / sum(g.seconds for g in spec)
    base_tps = sum(g.new_tokens for g in base) / sum(g.seconds for g in base)
    t1 = statistics.median(_step_s(g, w.max_new_tokens) for g in base)
    out: dict[str, Any] = {
        "engine": "vllm",
        "tau": total.tau,
        "tokens_per_s": tps,
        "baseline_tokens_per_s": base_tps,
        "speedup": tps / base_tps,
        "acceptance_by_position": total.by_position,
        "n_drafts": total.drafts,
        "greedy_equal_rate": sum(s["equal_to_baseline"] for s in samples) / len(samples),
        "batch_size": w.batch_size,
        "t_step_plain_s": t1,
        "draft_step_s": draft_step,
        "tree_size": tree.size,
        "tree_depth": tree.depth,
        "lossless": cfg.method.lossless,
        "dtype": cfg.model.dtype,
    }
    if cfg.method.drafter != "autoregressive":
        pcfg = profile_config(cfg)
        profile = ensure_profile(pcfg, None, show_progress=False)  # acceptance + t(n) ratios from specsim
        here, _ = tree_predictions(cfg, vllm_profile(profile, t1, draft_step), tree)
        out.update(predicted_tau=here["predicted_tau"], predicted_speedup=here["predicted_speedup"])
    else:
        out.update(predicted_tau=1.0, predicted_speedup=1.0)
    return out
