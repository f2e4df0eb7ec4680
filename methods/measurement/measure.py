"""task=measure: real speculative decoding of a workload, beside the autoregressive baseline and simulator.

Loads target p / draft q and the workload's prompts, builds the run's tree (the simulator's own construction,
so the prediction is for exactly the tree decoded with), warms up, then for every prompt decodes with the
autoregressive baseline and with the method through the same loop and timers (interleaved, so slow drifts of
a shared machine hit both). Metrics follow the run-output contract (docs/architecture.md); tau counts the
bonus token.

Every drafter's run also reads (or calibrates once, cached) its measured profile on this device
(methods.measurement.profiles): ``predicted_*`` are then the simulator's figures for the decoded tree under
the measured acceptance (Medusa: one vector per head) — with this device's t(n) and draft time for
``hardware=cpu``, the preset's roofline otherwise; both are kept (``*_this_device``, ``*_hardware``).
``decode_speedup`` leaves out the prompt's prefill (of the target, and of a draft model), which the per-step
cost model does not price.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from tqdm import tqdm

from methods.core.batch_drafter import batched
from methods.core.batch_engine import BatchEngine
from methods.core.batch_loop import BatchResult, decode_batch
from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, DecodeResult, decode
from methods.core.metrics import AcceptStats
from methods.core.sampling import SamplingParams
from methods.data.workloads import load_prompts
from methods.drafters.autoregressive import Autoregressive
from methods.drafters.registry import backbone_of, build_drafter
from methods.measurement.batch_cost import load_batch_fit, load_head_fit
from methods.measurement.calibrate import ensure_profile
from methods.measurement.dynamic_shapes import ensure_shapes, nodes_per_depth
from methods.measurement.merged_trees import ensure_merged, with_merged
from methods.measurement.profiles import (
    apply_profile,
    draft_terms,
    dynamic_draft_s,
    dynamic_tree_for,
    prediction_metrics,
    profile_config,
    profile_path,
    sequoia_config,
    sequoia_tree_for,
    to_measured_cost,
    tree_predictions,
)
from methods.measurement.staleness import judge_profile
from methods.models import load_models
from specsim.acceptance import from_config
from specsim.batch import predict_at_batch
from specsim.config import RunConfig, TreeKind, Verifier
from specsim.predict import simulate
from specsim.tau_error import precise_enough, steady_lengths, tau_relative_standard_error
from specsim.tree import Tree
from specsim.trees import recorded_law


@dataclass(frozen=True)
class RunResult:
    metrics: dict[str, Any]
    samples: list[dict[str, Any]]


@dataclass
class _Totals:
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    steps: list[float] = field(default_factory=list)  # seconds per decode step of each prompt (no prefill)
    offline_s: float = 0.0
    forward_s: float = 0.0  # batches: the target forward alone

    def add(self, r: DecodeResult) -> None:
        self._add(r, len(r.token_ids), r.n_target_forwards)
        self.offline_s += r.time_offline_s

    def add_batch(self, r: BatchResult) -> None:
        """A batch's totals: tokens over its wall time (the rows' decodes overlap)."""
        self._add(r, r.tokens, r.n_steps)
        self.forward_s += r.time_forward_s

    def _add(self, r: DecodeResult | BatchResult, tokens: int, forwards: int) -> None:
        """The timers one decode and one batch both have."""
        self.steps.append((r.time_total_s - r.time_prefill_s) / max(forwards, 1))
        self.tokens += tokens
        self.seconds += r.time_total_s
        self.forwards += forwards
        self.draft_s += r.time_draft_s
        self.verify_s += r.time_verify_s
        self.prefill_s += r.time_prefill_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Without the prompt's prefill: the per-step regime the simulator's S = k̄·t_AR / t_step models."""
        decode_s = self.seconds - self.prefill_s
        return self.tokens / decode_s if decode_s > 0 else 0.0


def run_tree(cfg: RunConfig) -> Tree:
    """The tree of this run: the simulator's construction of ``cfg.tree`` (Sequoia's DP included). Dynamic
    trees (EAGLE-2) are re-shaped per step by their drafter; this static one is their budget/approximation."""
    p = simulate(cfg)
    return Tree.from_parents(p.tree_parents, p.tree_ranks)


def measure(cfg: RunConfig, show_progress: bool = True) -> RunResult:
    models = load_models(cfg.model, cfg.device, cfg.model.dtype)
    w = cfg.workload
    sampling = SamplingParams(w.temperature, w.top_k, w.top_p)
    # one more prompt than measured, for the warm-up: the drafter never decodes a measured prompt twice (a
    # drafter that learns between requests, Online SD, would otherwise have seen the first one)
    *prompts, warm = load_prompts(replace(w, num_prompts=w.num_prompts + 1), models.tokenizer, cfg.seed)
    tree, predictions, profile, sequoia_tree = None, {}, None, None
    if cfg.method.drafter != "autoregressive":  # the drafter's measured profile on this device (cached)
        pcfg = profile_config(cfg)
        profile = ensure_profile(pcfg, models, show_progress=show_progress)
        predictions["profile_path"] = str(profile_path(pcfg))
    if TreeKind(cfg.tree.kind) == TreeKind.sequoia:  # the DP-optimal tree for this drafter's measured vector
        tree, here, preset = sequoia_tree_for(cfg, profile)
        sequoia_tree = tree
        predictions.update(prediction_metrics(cfg, here, preset))
        cfg = sequoia_config(cfg, profile)  # measured vector; Sequoia's verifier (w/o replacement) at T > 0
        predictions["verifier_used"] = cfg.method.verifier.value
    if tree is None:
        tree = run_tree(cfg)
    drafter = build_drafter(cfg.method, tree if tree.size > 1 else None, models, sampling, tree_cfg=cfg.tree)
    built_on = tree  # the tree the drafter was built with (SpecInfer's merged trees are counted on it)
    baseline = Autoregressive()
    backbone, backbone_name = backbone_of(drafter, models, cfg.model.name)  # one target for both sides
    target = ModelEngine(backbone) if w.batch_size == 1 else None  # batches: a BatchEngine of their own
    generator = torch.Generator(device=models.device).manual_seed(cfg.seed)
    eos = models.tokenizer.eos_token_id
    opts = DecodeOptions.for_method(cfg.method, sampling, w.max_new_tokens, eos)
    # the baseline proposes the root alone: no verifier runs, the next token is the target's own
    base_opts = DecodeOptions(Verifier.greedy, sampling, w.max_new_tokens, eos)
    ids = [torch.tensor(p.token_ids, dtype=torch.long) for p in prompts]
    warm_ids = torch.tensor(warm.token_ids, dtype=torch.long)
    stats, method_t, base_t = AcceptStats(), _Totals(), _Totals()
    samples = []
    tree_depth = (getattr(drafter, "tree", None) or tree).depth  # the steps it cuts: τ's steady steps
    if w.batch_size > 1:
        def remake():  # one more instance of the drafter (batched per row)
            return build_drafter(cfg.method, tree if tree.size > 1 else None, models, sampling,
                                 tree_cfg=cfg.tree)

        pairs = _decode_batches(cfg, backbone, (baseline, drafter, remake), ids, warm_ids, (base_opts, opts),
                                generator, (base_t, method_t), show_progress)
    else:
        for _ in range(cfg.warmup):  # first calls allocate buffers and warm kernels: out of the timings
            decode(target, baseline, warm_ids, base_opts, generator)
            decode(target, drafter, warm_ids, opts, generator)
        _forget_warmup(drafter)
        pairs = []
        for x in tqdm(ids, desc=f"measure {cfg.method.name}", disable=not show_progress):
            ref = decode(target, baseline, x, base_opts, generator)  # interleaved: same machine state
            res = decode(target, drafter, x, opts, generator)
            base_t.add(ref)
            method_t.add(res)
            pairs.append((res, ref))
            if w.tau_se_target > 0 and _tau_precise(pairs, prompts, w, tree_depth):  # the sequential rule
                break
    for prompt, (res, ref) in zip(prompts, pairs):
        stats.merge(res.stats)
        samples.append(_sample(prompt.prompt_id, res, ref, models.tokenizer))
    metrics = _metrics(stats, method_t, base_t, samples)
    metrics["tau_se_rel"] = _finite(tau_relative_standard_error(*_steady(pairs, prompts, w, tree_depth)))
    if w.batch_size > 1:
        metrics.update(_batch_metrics(cfg, method_t, base_t))
    if hasattr(drafter, "run_stats"):  # a drafter's own figures (Staged SD: draft forwards per step)
        metrics.update(drafter.run_stats())
    metrics.update(_per_request(samples))
    updates = getattr(drafter, "updates", None)  # a drafter that learns while serving: its updates' record
    if updates is not None:
        # counted in measured requests (the drafter also counted the warm-up's)
        metrics["drafter_updates"] = [dict(u, after_measured_request=u["after_request"] - cfg.warmup)
                                      for u in updates]
    tree = getattr(drafter, "tree", None) or tree  # a drafter may re-shape it (Medusa: budget, head count)
    shapes = in_run = None  # a dynamic tree: the kept trees recorded on the calibration split, priced as such
    if TreeKind(cfg.tree.kind) == TreeKind.dynamic and profile is not None:  # the step: its static DP tree
        tree = dynamic_tree_for(cfg, profile)
        metrics["dynamic_mean_tree_size"] = getattr(drafter, "mean_tree_size", None)
        in_run = dict(getattr(drafter, "shapes", None) or {}) or None  # this run's own: a diagnostic only
        metrics["dynamic_trees_recorded"] = sum(in_run.values()) if in_run else 0  # warm-up's left out
        if hasattr(drafter, "shapes"):  # a drafter recording its trees (EAGLE): price those it keeps on the
            depth = int(profile.extra.get("loop_tree_depth") or 0)  # its draft timed against the loop's chain
            shapes, path = ensure_shapes(cfg, pcfg, models, show_progress=show_progress,  # calibration split
                                         chain_depth=depth)
            shapes = shapes or None
            metrics["dynamic_shapes_path"] = str(path)
            scale = getattr(shapes, "draft_scale", None)  # (its draft / the chain's, the chain's depth)
            metrics["dynamic_draft_scale"] = None if scale is None else list(scale)
        for key, kept in (("dynamic_nodes_per_depth_calibration", shapes),
                          ("dynamic_nodes_per_depth", in_run)):  # mean kept nodes per depth
            if kept:
                metrics[key] = nodes_per_depth(kept)
        metrics["dynamic_tree_pricing"] = "calibration_trees" if shapes else "static_upper_bound"
    if profile is None:  # autoregressive: nothing calibrated, the config's own model
        pred = simulate(cfg, tree=tree)
        predictions = {"predicted_tau": pred.predicted_tau, "predicted_speedup": pred.predicted_speedup,
                       "predicted_decode_speedup": pred.predicted_decode_speedup,
                       "predicted_tokens_per_forward": pred.tokens_per_forward}
    else:  # the profile's t(1) against this run's own baseline step: if stale, predict with the run's t(1)
        # the profile's t(1) is a one-sequence step: a batch's step is not comparable (never judged stale)
        steps = base_t.steps if w.batch_size == 1 else []
        profile, judged = judge_profile(profile, profile_path(pcfg), steps)
        predictions.update(judged)
        merged = ensure_merged(cfg, pcfg, models, built_on, show_progress=show_progress)
        if merged is not None:  # SpecInfer: its merged trees' size counted on the calibration split
            profile = with_merged(profile, merged)
            predictions["merged_nodes_calibration"] = merged["size"]
        if "predicted_tau" not in predictions or judged["profile_stale"]:  # the tree decoded with
            predicted = sequoia_tree or tree  # (Sequoia: as selected on the measured vector)
            predictions.update(prediction_metrics(cfg, *tree_predictions(cfg, profile, predicted, shapes)))
            if shapes:  # the static DP tree's τ, for comparison (the former pricing, an upper bound)
                static = tree_predictions(cfg, profile, tree)[0]
                predictions["predicted_tau_static_tree"] = static["predicted_tau"]
                # the kept trees under the static calibration's (depth, rank) vectors, not their own nodes'
                # acceptance (the pricing before the kept nodes were counted: low, q keeps likely nodes)
                plain = tree_predictions(cfg, profile, tree, dict(shapes))[0]
                predictions["predicted_tau_kept_static_vectors"] = plain["predicted_tau"]
            if shapes and in_run:  # diagnostic: the τ of the trees this run kept (its own prompts' shapes,
                # so not a held-out prediction: the former pricing)
                own = tree_predictions(cfg, profile, tree, in_run)[0]
                predictions["predicted_tau_in_run_trees"] = own["predicted_tau"]
        predictions.update(calibrated_costs(cfg, profile))
        by_depth = [list(v) for v in profile.acceptance_vectors_by_depth]
        predictions.update(profile_acceptance_vector=list(profile.acceptance_vector),
                           profile_acceptance_vectors_by_depth=by_depth)
    if w.batch_size > 1:
        predictions.update(batch_prediction(cfg, profile, sequoia_tree or tree, predictions, shapes))
    metrics.update(predictions)
    if "predicted_tau" in metrics and metrics["n_target_forwards"] and metrics["baseline_n_target_forwards"]:
        metrics["predicted_speedup_at_run_costs"] = at_run_costs(metrics)
    if getattr(drafter, "decoded_model", None):  # a drafter that replaced the target (LayerSkip's variant)
        metrics["decoded_model"] = drafter.decoded_model
    metrics.update({
        "tree_size": tree.size,
        "tree_depth": tree.depth,
        # the tree priced (Sequoia: as selected on the measured vector): its draft can be re-priced afterwards
        "tree_parents": list((sequoia_tree or tree).parents),
        "lossless": cfg.method.lossless,
        "backbone": backbone_name,  # the target the method and the baseline both decoded
        "dtype": str(models.dtype).removeprefix("torch."),
        "device": str(models.device),
    })
    return RunResult(metrics, samples)


def _steady(pairs: list[tuple[DecodeResult, DecodeResult]], prompts, w, depth: int
            ) -> tuple[list[list[int]], list[str]]:
    """Each decoded prompt's accepted lengths on its steady steps (the generation's cut last steps left out,
    as the validation report measures τ), and its source module (τ's error clusters by module:
    specsim.tau_error.by_cluster); prompts without a steady step left out."""
    kept = [(steady_lengths(res.accepted_lengths, w.max_new_tokens, depth), prompt.module or prompt.prompt_id)
            for prompt, (res, _) in zip(prompts, pairs)]
    kept = [(lengths, module) for lengths, module in kept if lengths]
    return [lengths for lengths, _ in kept], [module for _, module in kept]


def _tau_precise(pairs: list[tuple[DecodeResult, DecodeResult]], prompts, w, depth: int) -> bool:
    """The sequential rule (workload.tau_se_target): τ's relative standard error over the prompts decoded so
    far, on their steady steps, with their modules as clusters."""
    lengths, modules = _steady(pairs, prompts, w, depth)
    return precise_enough(lengths, w.tau_se_target, clusters=modules)


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _decode_batches(cfg: RunConfig, backbone, drafters: tuple, ids: list[torch.Tensor], warm: torch.Tensor,
                    opts: tuple[DecodeOptions, DecodeOptions], generator: torch.Generator,
                    totals: tuple[_Totals, _Totals], show_progress: bool
                    ) -> list[tuple[DecodeResult, DecodeResult]]:
    """Batched autoregressive and batched speculative decoding of the prompts (methods.core.batch_loop), at
    the same batch size: static batches of B prompts, interleaved batch by batch (same machine state), or
    with ``workload.continuous`` the whole workload per side with requests joining as rows finish.
    Returns (method, baseline) results per prompt."""
    w, (baseline, drafter, remake) = cfg.workload, drafters
    b = w.batch_size
    room = max(x.numel() for x in [*ids, warm]) + w.max_new_tokens + 64  # + the largest tree, grown if needed
    target = BatchEngine(backbone, b, capacity=room)
    sides = (batched(baseline, b), batched(drafter, b, remake))
    for _ in range(cfg.warmup):
        for side, o in zip(sides, opts):
            decode_batch(target, side, [warm] * b, o, generator, w.continuous)
    _forget_warmup(drafter)
    chunks = [ids] if w.continuous else [ids[i : i + b] for i in range(0, len(ids), b)]
    out: list[tuple[DecodeResult, DecodeResult]] = []
    desc = f"measure {cfg.method.name} (batch {b}{', continuous' if w.continuous else ''})"
    for chunk in tqdm(chunks, desc=desc, disable=not show_progress):
        ref, res = (decode_batch(target, side, chunk, o, generator, w.continuous)
                    for side, o in zip(sides, opts))
        totals[0].add_batch(ref)
        totals[1].add_batch(res)
        out += list(zip(res.results, ref.results))
    return out


def _forget_warmup(drafter) -> None:
    """A drafter recording the trees it proposes (EAGLE-2/3's dynamic trees: ``shapes``,
    ``mean_tree_size``) forgets the warm-up's, so that its records are the measured prompts' alone."""
    clear = getattr(drafter, "clear_records", None)
    if clear is not None:
        clear()


def _batch_metrics(cfg: RunConfig, method: _Totals, base: _Totals) -> dict[str, Any]:
    """A batched run's own keys, and its step split into the terms the prediction prices (seconds per
    batched step, decode only): ``*step_s`` the step, ``*forward_step_s`` the target forward,
    ``draft_step_s`` the drafter's propose + feedback (with the loop's per-row bookkeeping between verify
    and feedback), ``*outside_step_s`` the rest (verification, commit); ``*forwards_per_batch``: steps of
    a static batch (all its rows' steps, the slowest row's); ``*decode_tokens_per_s``: without prefill."""
    return {**_step_terms(method, ""), **_step_terms(base, "baseline_"),
        "batch_size": cfg.workload.batch_size,
        "continuous": cfg.workload.continuous,
        "time_forward_s": method.forward_s,
        "baseline_time_forward_s": base.forward_s,
        # the step's time outside the target forward (drafting, verification, bookkeeping), decode only
        "outside_forward_fraction": 1 - method.forward_s / max(method.seconds - method.prefill_s, 1e-12),
        "baseline_outside_forward_fraction": 1 - base.forward_s / max(base.seconds - base.prefill_s, 1e-12),
    }


def _step_terms(t: _Totals, prefix: str) -> dict[str, float]:
    steps = max(t.forwards, 1)
    step = (t.seconds - t.prefill_s) / steps
    draft = t.draft_s / steps if prefix == "" else 0.0  # the baseline's draft is not timed apart
    out = {"step_s": step, "forward_step_s": t.forward_s / steps,
           "outside_step_s": step - t.forward_s / steps - draft,
           "forwards_per_batch": t.forwards / max(len(t.steps), 1),
           "decode_tokens_per_s": t.decode_tokens_per_s, "prefill_share": t.prefill_s / max(t.seconds, 1e-12)}
    if prefix == "":
        out["draft_step_s"] = draft
    return {f"{prefix}{k}": v for k, v in out.items()}


def batch_prediction(cfg: RunConfig, profile, tree: Tree, one_sequence: dict[str, Any], shapes=None
                     ) -> dict[str, Any]:
    """The simulator at the run's batch size B (specsim.batch.predict_at_batch): the profile's measured t(n)
    grown with B by this device's stored t(B, n) fit (methods.measurement.batch_cost; `python
    benchmarks/batch_cost.py` calibrates it), else by the hardware roofline's growth (``batch_cost_source``
    says which). ``predicted_tau`` / ``predicted_speedup`` become S(B), the batched speculative step over the
    batched autoregressive step; ``predicted_decode_speedup`` prices the run's generation length, a static
    batch stepping until its slowest row is done; the one-sequence prediction's keys stay under
    ``*_batch1``. ``shapes``: a dynamic drafter's kept trees (methods.measurement.dynamic_shapes), priced
    as the one-sequence prediction prices them — τ, the forwards and B* from their law, the draft from
    its timed draft (grown with B, or the head fit's) — not as ``tree``, the static DP tree that sizes the
    step (an upper bound: the zoo's EAGLE-2 at B = 4 read τ 3.81 against 3.33 measured)."""
    fit = load_batch_fit(cfg)
    draft_fit = load_batch_fit(cfg, role="draft") if cfg.method.drafter == "draft_model" else None
    head_fit = load_head_fit(cfg) if draft_fit is None and profile is not None else None
    pcfg, cost = (cfg, None) if profile is None else (apply_profile(cfg, profile), to_measured_cost(profile))
    hists = _prompt_hists(profile, tree)
    law = draft_s = None
    if shapes and profile is not None:
        law = recorded_law(shapes, from_config(pcfg.method.acceptance))
        draft_s = dynamic_draft_s(profile, shapes)
    pred = predict_at_batch(pcfg, cost, fit, tree=tree, draft_fit=draft_fit, prompt_hists=hists,
                            head_fit=head_fit, law=law, draft_s=draft_s)
    out = {f"{k}_batch1": v for k, v in one_sequence.items()
           if k in ("predicted_tau", "predicted_speedup", "predicted_decode_speedup",
                    "predicted_tokens_per_forward")}
    out.update(predicted_tau=pred.predicted_tau, predicted_speedup=pred.predicted_speedup,
               predicted_decode_speedup=pred.predicted_decode_speedup,  # static batches: the slowest row
               predicted_batch_forwards=pred.batch_forwards,
               predicted_tokens_per_forward=cfg.workload.max_new_tokens / pred.batch_forwards,
               prediction_batch_size=pred.batch_size, break_even_batch=pred.break_even_batch,
               # the run's mean step (its later steps run the rows not done yet), as the timers measure it;
               # the step at B rows (S(B)'s) beside it
               predicted_t_step_s=pred.t_run_step_s, predicted_t_ar_s=pred.t_ar_s,
               predicted_t_verify_s=pred.t_run_verify_s, predicted_t_draft_s=pred.t_run_draft_s,
               predicted_t_step_full_s=pred.t_step_s, predicted_mean_rows=pred.mean_rows,
               **_forward_terms(pred, fit if profile is not None else None),
               ar_tokens_per_s=pred.ar_tokens_per_s, predicted_spec_tokens_per_s=pred.spec_tokens_per_s,
               batch_cost_source="fit" if fit is not None else "roofline growth",
               batch_draft_cost_source=_draft_source(draft_fit, head_fit if fit is not None else None),
               batch_rows_acceptance=f"{len(hists)} calibration prompts" if hists else "one law",
               batch_tree_pricing="calibration_trees" if law is not None else "tree",
               batch_dynamic_draft="timed" if draft_s is not None else None,
               # the former pricings beside it: every step at B rows; a head drafter's draft as the target
               # grows (without its loop-timed step)
               predicted_decode_speedup_b_rows=_decode_at(pred, cfg.workload.max_new_tokens, pred.t_step_s))
    if law is not None:  # the former pricing beside it: the static DP tree (an upper bound)
        static = predict_at_batch(pcfg, cost, fit, tree=tree, draft_fit=draft_fit, prompt_hists=hists,
                                  head_fit=head_fit, with_break_even=False)
        out.update(predicted_tau_static_tree_batch=static.predicted_tau,
                   predicted_decode_speedup_static_tree_batch=static.predicted_decode_speedup)
    if head_fit is not None and fit is not None:
        grown = predict_at_batch(pcfg, cost, fit, tree=tree, prompt_hists=hists, with_break_even=False,
                                 law=law, draft_s=draft_s)
        out["predicted_decode_speedup_head_grown"] = grown.predicted_decode_speedup
    return out


def _decode_at(pred, n_tokens: int, step: float) -> float:
    """The run's decode speedup were every step priced at ``step``."""
    return n_tokens * pred.t_ar_s / (pred.batch_forwards * step) if pred.t_step_s > 0 else float("nan")


def _draft_source(draft_fit, head_fit) -> str:
    """How the batch prediction priced the draft step at B (batch_draft_cost_source)."""
    if draft_fit is not None:
        return "draft fit"
    return "as the target grows" if head_fit is None else "head loop"


def _forward_terms(pred, fit) -> dict[str, float | None]:
    """The predicted step's target forwards alone and the batched loop's time outside them (None without a
    fit or a profile: the roofline, or the profile grown by it, prices whole steps): the autoregressive
    step's at B rows, the speculative run's mean step's at its mean rows (the loop's time is linear in
    the rows)."""
    if fit is None:
        return {"predicted_t_loop_s": None, "predicted_t_forward_s": None, "predicted_t_ar_forward_s": None}
    loop = float(fit.loop_time(pred.batch_size))
    return {"predicted_t_loop_s": loop, "predicted_t_forward_s": pred.t_run_verify_s - fit.loop_time(
        pred.mean_rows), "predicted_t_ar_forward_s": pred.t_ar_s - loop}


def _prompt_hists(profile, tree: Tree) -> list | None:
    """Calibration's per-prompt histograms of accepted drafts per step, where its loop ran the run's tree
    (rows differ in acceptance: the slowest row of a static batch); None for older profiles, another tree."""
    extra = getattr(profile, "extra", None) or {}
    same = extra.get("loop_tree_size") == tree.size and extra.get("loop_tree_depth") == tree.depth
    return (extra.get("loop_accept_hist_by_prompt") or None) if same else None


def at_run_costs(m: dict[str, Any]) -> float:
    """A diagnostic beside the prediction: its τ (and, for an adaptive draft length, its draft forwards per
    step) priced with this run's own timed costs — t_AR from the baseline's decode steps, the draft forward
    and the verify per step from the method's — instead of the profile's. On a machine whose load changed
    between the calibration and the run, it tells the acceptance model's error from the timing's."""
    t_ar = (m["baseline_time_s"] - m["baseline_time_prefill_s"]) / m["baseline_n_target_forwards"]
    draft, verify = m["time_draft_s"] / m["n_target_forwards"], m["time_verify_s"] / m["n_target_forwards"]
    if m.get("draft_forwards_per_step") and "predicted_draft_forwards_per_step" in m:
        draft *= m["predicted_draft_forwards_per_step"] / m["draft_forwards_per_step"]
    return m["predicted_tau"] * t_ar / (draft + verify)


def calibrated_costs(cfg: RunConfig, profile) -> dict[str, Any]:
    """The costs the prediction used, as measured on this device, beside the config's arithmetic (self-
    drafting: ρ = E / L or the kept sub-layers' share; the shared-cache verify's ρ_v)."""
    out = {"draft_cost_ratio_calibrated": profile.draft_ratio,
           "draft_cost_ratio_config": cfg.method.draft_cost_ratio}
    shared = profile.extra.get("shared_verify")
    if shared:
        out.update(verify_saving_ratio_calibrated=shared["saving_ratio"],
                   shared_verify_over_full=shared["ratio"] / shared["full_ratio"],
                   verify_reuse_ratio_config=cfg.method.verify_reuse_ratio)
    # the timings behind the draft's price (a profile timed on a busy machine is not cached: kept here)
    for key in ("loop_draft_forwards_per_step", "loop_mean_draft_length", "draft_level_ratios",
                "draft_shape_ratios", "draft_first_excess_ratios"):
        if key in profile.extra:
            out[f"calibration_{key}"] = profile.extra[key]
    terms = draft_terms(profile)
    if terms is not None:
        out["calibration_draft_terms"] = list(terms)  # (F, a, b, e, c) in t(1): profiles.draft_terms
    return out


def _sample(prompt_id: str, res: DecodeResult, ref: DecodeResult, tokenizer) -> dict[str, Any]:
    return {
        "prompt_id": prompt_id,
        "token_ids": res.token_ids,
        "text": tokenizer.decode(res.token_ids, skip_special_tokens=True),
        "accepted_lengths": res.accepted_lengths,
        "equal_to_baseline": res.token_ids == ref.token_ids,
        "stop": res.stop,
        "tau": res.stats.tau,
        "acceptance": acceptance_rate(res.stats),
        "time_offline_s": res.time_offline_s,
        "speedup": ref.time_total_s / res.time_total_s if res.time_total_s else 0.0,
    }


def acceptance_rate(stats: AcceptStats) -> float:
    """Token acceptance rate: P(a child is accepted | an accepted node had children), over all depths."""
    tried = sum(stats.depth_tried)
    return sum(stats.depth_accepted) / tried if tried else 0.0


def _per_request(samples: list[dict]) -> dict[str, Any]:
    """The series over requests in serving order (a drafter that learns between requests: its curve)."""
    return {f"per_request_{k}": [s[k] for s in samples] for k in ("tau", "acceptance", "time_offline_s")}


def _metrics(stats: AcceptStats, method: _Totals, base: _Totals, samples: list[dict]) -> dict[str, Any]:
    """The run-output contract's measured quantities (docs/architecture.md). greedy_equal_rate: share of
    prompts whose output equals the baseline's (1.0 expected for lossless methods at temperature 0 in
    float32)."""
    return {
        "tau": stats.tau,
        "tokens_per_s": method.tokens_per_s,
        "baseline_tokens_per_s": base.tokens_per_s,
        "speedup": method.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0,
        # the same without either side's prefill (a draft model prefills the prompt too): what the
        # simulator's prediction is for
        "decode_speedup": (method.decode_tokens_per_s / base.decode_tokens_per_s
                           if base.decode_tokens_per_s else 0.0),
        "accept_hist": stats.hist,
        "acceptance_by_depth": stats.by_depth(),
        "acceptance_by_rank": stats.by_rank(),
        "verified_nodes_per_step": stats.verified_nodes,  # root included; a dynamic tree's kept size
        "n_target_forwards": method.forwards,
        "baseline_n_target_forwards": base.forwards,
        "n_tokens": method.tokens,
        "baseline_n_tokens": base.tokens,
        "time_draft_s": method.draft_s,
        "time_verify_s": method.verify_s,
        "time_total_s": method.seconds,
        "time_prefill_s": method.prefill_s,
        "time_offline_s": method.offline_s,  # the drafter's work between requests (online training)
        "baseline_time_prefill_s": base.prefill_s,
        "baseline_time_s": base.seconds,
        "greedy_equal_rate": sum(s["equal_to_baseline"] for s in samples) / len(samples),
        "num_prompts": len(samples),
    }
