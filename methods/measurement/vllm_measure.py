"""task=measure with engine=vllm: the method and vLLM's own plain decoding on the same model, prompts and
batch, interleaved batch by batch, with the simulator's prediction beside the measurement (p = target, q =
draft).

The prediction uses what is engine-independent from specsim's calibrated profile of the same drafter on the
same models — the acceptance model, and the ratios t(n)/t(1) of a verify forward — and prices them with
vLLM's own steps, measured on calibration-split prompts before the measured ones (the profile measured for
this engine, cached under <cache>/profiles/vllm/): t(1) from its plain decoding, and the drafting cost
*inside* speculation, solved from the speculative engine's own step, T_spec = t(1)·r(γ+1) + γ·c (c per
draft token; a single-pass drafter — n-gram lookup — as one c per step), r(n) = the verify ratio
t(n)/t(1). Pricing the draft by a plain vLLM run of the draft model instead charged vLLM's whole per-step
scheduling overhead to every draft token (predicted 1.05x against 2.40x measured). The measured run then
re-anchors the ratios on its own plain t(1).
EAGLE heads are exported once in the layout vLLM loads (methods.heads.eagle.vllm_export); vLLM drafts a
chain of the tree's depth.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from tqdm import tqdm

from methods.data.workloads import load_prompts
from methods.measurement.calibrate import ensure_profile
from methods.measurement.measure import RunResult, run_tree
from methods.measurement.profiles import (
    Profile,
    cache_root,
    profile_config,
    save_profile,
    to_measured_cost,
    tree_predictions,
)
from methods.measurement.vllm_engine import (
    CHAIN_OF_DEPTH,
    Counters,
    Generation,
    VllmEngine,
    VllmSettings,
    plan_for,
)
from specsim.config import RunConfig, TreeKind
from specsim.tree import Tree


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    target_dir: str
    draft_dir: str | None
    tokenizer_dir: str


def checkpoints(cfg: RunConfig) -> Checkpoints:
    """Directories vLLM loads: the zoo's (built on first use) or the configured local/hub paths; for EAGLE
    methods the draft is the head exported in vLLM's layout."""
    m = cfg.model
    if m.source == "zoo":
        from methods.zoo import ensure_zoo

        paths = ensure_zoo(m.zoo)
        out = Checkpoints(str(paths.target_dir), str(paths.draft_dir), str(paths.tokenizer_dir))
    elif m.source in ("hub", "local"):
        out = Checkpoints(m.path, m.draft_path or None, m.path)
    else:
        raise ValueError(f"engine=vllm loads checkpoints from disk: model.source={m.source!r} has none")
    if cfg.method.drafter in CHAIN_OF_DEPTH:
        out = dataclasses.replace(out, draft_dir=str(eagle_for_vllm(cfg)[0]))
    return out


def eagle_for_vllm(cfg: RunConfig, train: bool = True) -> tuple[Path, bool] | None:
    """The method's EAGLE head (trained on first use and cached, or ``method.params.head``'s directory)
    exported once in vLLM's layout; returns (directory, whether vLLM computes exactly what our head does),
    or None when ``train`` is False and the head is not trained yet."""
    import hashlib
    import json

    from methods.drafters.eagle import EagleParams
    from methods.heads.eagle.checkpoint import load_eagle
    from methods.heads.eagle.store import ensure_eagle
    from methods.heads.eagle.vllm_export import export_once
    from methods.models import load_models

    ep = EagleParams.from_method(cfg.method)
    variant = "eagle3" if cfg.method.drafter == "eagle3" else "eagle1"
    models = load_models(cfg.model, "cpu", "float32")
    if ep.head == "train":
        if not train and not eagle_cached(models, ep, variant):
            return None
        source = ensure_eagle(models.target, models.tokenizer, ep.train_config(variant)).head_dir
        out = source.parent / "vllm"
    elif ep.head != "random":
        source = Path(ep.head)
        digest = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:20]
        out = cache_root() / "eagle" / f"vllm-{digest}"
    else:
        raise ValueError("engine=vllm runs trained EAGLE heads: method.params.head=train or a directory")
    head, meta = load_eagle(source, models.target)
    layers = models.target.config.get_text_config().num_hidden_layers
    export_once(head, out, layers, meta)
    exact = bool(json.loads((out / "config.json").read_text())["specsim"]["vllm_exact"])
    if not exact:
        print(f"warning: {out}: vLLM cannot compute this head exactly (its top feature layer is taken after "
              f"the final norm; vLLM taps before it): train one on lower layers", flush=True)
    return out, exact


def eagle_cached(models, ep, variant: str) -> bool:
    from methods.heads.eagle.store import EagleEval, _cache_root, cache_key

    key = cache_key(models.target, models.tokenizer, ep.train_config(variant), EagleEval())
    return (_cache_root() / "eagle" / key / "report.json").exists()


def draft_cost_inside(profile: Profile, t1: float, t_spec: float, gamma: int, per_token: bool) -> float:
    """vLLM's drafting cost inside speculation (seconds per draft token, or per step for a single-pass
    drafter): what the speculative engine's step ``t_spec`` costs beyond verifying γ+1 tokens,
    t(1)·r(γ+1), r from specsim's profile — vLLM's own extra work per speculative step (rejection sampler,
    proposer bookkeeping) is in it."""
    cost = to_measured_cost(dataclasses.replace(profile, verify_overhead_ratio=0.0))
    verify = t1 * float(cost.time(gamma + 1)) / float(cost.time(1))
    return max(0.0, t_spec - verify) / (gamma if per_token else 1)


def engine_profile(profile: Profile, calib: dict[str, float], gamma: int, per_token: bool) -> Profile:
    """The profile measured for vLLM: specsim's acceptance and verify ratios, vLLM's t(1) and its drafting
    cost inside speculation (``calib``: t1_s and spec_step_s on calibration prompts), no loop overhead of
    specsim's (vLLM's is in the draft cost)."""
    t1 = calib["t1_s"]
    draft = draft_cost_inside(profile, t1, calib["spec_step_s"], gamma, per_token)
    return dataclasses.replace(profile.with_t1(t1), draft_ratio=draft / t1, verify_overhead_ratio=0.0,
                               extra={**profile.extra, "engine": "vllm", "vllm_calibration": calib,
                                      "vllm_gamma": gamma}, stale="")


def spec_step_s(gen: Generation, batch: int) -> float:
    """Seconds per engine step of a speculative batch: the steps counted from vLLM's per-step stats, or
    where none were (stats of an older vLLM), one step per sequence's decode step plus the prefill step.
    Counting drafts instead missed every step whose n-gram lookup found no match (vLLM counts no draft
    there): the n-gram step came out too long, its drafting cost too high, the predicted speedup too low."""
    c = gen.counters
    return gen.seconds / (c.engine_steps if c.engine_steps else c.decode_steps / batch + 1)


def _step_s(gen: Generation, max_new: int) -> float:
    """Seconds per decode step of the batch (every row emits one token per plain step)."""
    return gen.seconds / max_new


def measure_vllm(cfg: RunConfig, show_progress: bool = True) -> RunResult:
    from transformers import AutoTokenizer

    ck = checkpoints(cfg)
    w = cfg.workload
    tokenizer = AutoTokenizer.from_pretrained(ck.tokenizer_dir, local_files_only=True)
    prompts = load_prompts(w, tokenizer, cfg.seed)
    tree = vllm_tree(cfg)
    plan = plan_for(cfg.method.drafter, tree.depth, ck.draft_dir, dict(cfg.method.params))
    # specsim's profile (acceptance, t(n) ratios) first: calibrated, where not cached, before vLLM's
    # processes start (they would share the cores with the timing, and vLLM resets torch's thread count)
    profile = None
    if cfg.method.drafter != "autoregressive":
        profile = ensure_profile(profile_config(cfg), None, show_progress=show_progress)
    e = cfg.engine
    settings = VllmSettings(dtype=cfg.model.dtype, kv_cache_gib=e.kv_cache_gib,
                            memory_fraction=e.memory_fraction, enforce_eager=e.enforce_eager, seed=cfg.seed)
    bar = tqdm(total=2, desc="vllm engines", disable=not show_progress)
    plain = VllmEngine(ck.target_dir, plan_for("autoregressive", 0, None), settings)
    bar.update()
    method = VllmEngine(ck.target_dir, plan, settings) if plan.method else plain
    bar.update()
    bar.close()
    ids = [p.token_ids for p in prompts]
    plain.generate(ids[:1], 8)  # warm-up: first calls allocate and compile
    method.generate(ids[:1], 8)
    calib = calibrate(cfg, tokenizer, (plain, method)) if plan.method else {}
    return _interleaved(cfg, prompts, (plain, method), tree, calib, profile, show_progress)


def vllm_tree(cfg: RunConfig) -> Tree:
    """What vLLM speculates with: the run's chain, or a chain of the tree's depth (EAGLE's trees)."""
    if cfg.method.drafter in CHAIN_OF_DEPTH and TreeKind(cfg.tree.kind) != TreeKind.chain:
        depth = cfg.tree.depth if TreeKind(cfg.tree.kind) == TreeKind.dynamic else run_tree(cfg).depth
        return Tree.chain(int(depth))
    return run_tree(cfg)


def calibrate(cfg: RunConfig, tokenizer, engines, rounds: int = 4) -> dict[str, float]:
    """vLLM's plain step t(1) and its speculative engine's step on calibration-split prompts (never the
    measured ones), at the run's batch size, in ``rounds`` interleaved rounds: the speculative step is kept
    as the median of its per-round ratio to that round's t(1) (a busy phase of a shared machine moves both),
    times the median t(1)."""
    plain, method = engines
    w = cfg.workload
    n = min(w.batch_size, 8)
    calib = load_prompts(dataclasses.replace(w, split="calibration", num_prompts=n), tokenizer, cfg.seed)
    batch = [calib[i % n].token_ids for i in range(w.batch_size)]
    t1, ratio, taus = [], [], []
    for _ in range(rounds):
        ref = plain.generate(batch, w.max_new_tokens, w.temperature, cfg.seed)
        res = method.generate(batch, w.max_new_tokens, w.temperature, cfg.seed)
        t1.append(_step_s(ref, w.max_new_tokens))
        ratio.append(spec_step_s(res, w.batch_size) / t1[-1])
        taus.append(res.counters.tau)
    t1_s = statistics.median(t1)
    r = statistics.median(ratio)
    return {"t1_s": t1_s, "spec_step_s": r * t1_s, "spec_step_ratio": r, "tau": statistics.median(taus),
            "prompts": n, "rounds": rounds}


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _interleaved(cfg: RunConfig, prompts, engines, tree: Tree, calib: dict, profile: Profile | None,
                 show_progress: bool) -> RunResult:
    plain, method = engines
    w = cfg.workload
    ids = [p.token_ids for p in prompts]
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
    metrics = _metrics(cfg, base, spec, samples, tree, calib, profile)
    return RunResult({**metrics, "vllm_device": plain.device}, samples)


def _metrics(cfg: RunConfig, base: list[Generation], spec: list[Generation], samples: list[dict],
             tree: Tree, calib: dict, profile: Profile | None) -> dict[str, Any]:
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
        "t_step_spec_s": statistics.median(spec_step_s(g, len(g.token_ids)) for g in spec),
        "tree_size": tree.size,
        "tree_depth": tree.depth,
        "lossless": cfg.method.lossless,
        "dtype": cfg.model.dtype,
    }
    if profile is not None:  # specsim's acceptance and t(n) ratios, priced with vLLM's steps
        per_token = cfg.method.draft_steps == "depth"
        mine = engine_profile(profile, calib, tree.depth, per_token)
        name = f"{profile.key or cfg.method.name}-g{tree.depth}-b{w.batch_size}-{cfg.model.dtype}.json"
        path = cache_root() / "profiles" / "vllm" / name
        save_profile(mine, path)
        here, _ = tree_predictions(cfg, mine.with_t1(t1), tree)  # re-anchored on this run's own t(1)
        out.update(predicted_tau=here["predicted_tau"], predicted_speedup=here["predicted_speedup"],
                   predicted_t_step_s=here["t_step_s"], vllm_profile_path=str(path),
                   draft_s_inside_spec=mine.draft_time_s, calibration=calib)
    else:
        out.update(predicted_tau=1.0, predicted_speedup=1.0)
    return out
