"""task=calibrate: a drafter against the target on this device, measured Sequoia's way (Chen et al. 2024).

p = target, q = draft. Along the target's own generation on the calibration split (greedy, or sampled at the
workload's temperature) every position gets a one-level star tree of W children — q's top-W at temperature 0,
W draws without replacement from q otherwise — verified by the matching verifier against p; the histogram of
the accepted rank is the positional vector [0, p_1, …, p_W, p_none]. Also α_d of the drafter's chain/tree in
the real loop, the target's t(n) (tree forwards of methods.core.engine), the draft step time and t_AR: a
methods.measurement.profiles Profile, cached for tree=sequoia and the simulator's hardware=cpu validation.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from itertools import takewhile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from methods.core.drafter import Draft, DraftContext
from methods.core.engine import ForwardOut, ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.metrics import AcceptStats
from methods.core.sampling import SamplingParams, probs
from methods.core.timing import forward_times, verify_times
from methods.core.verify import verify
from methods.data.workloads import load_prompts
from methods.drafters.autoregressive import Autoregressive
from methods.drafters.registry import build_drafter
from methods.measurement.profiles import (
    Profile,
    StarRule,
    device_name,
    load_profile,
    missing_budgets,
    profile_key,
    profile_lock,
    profile_path,
    save_profile,
    sequoia_tree_for,
    star_rule,
)
from methods.models import Models, context_length, load_models
from specsim.acceptance import from_config
from specsim.config import RunConfig, TreeKind, Verifier
from specsim.cost import CostModel
from specsim.io import atomic_write_json
from specsim.tree import Tree
from specsim.trees import build_tree

__all__ = ["CalibrationResult", "Star", "StarRule", "calibrate", "ensure_profile", "measure_profile",
           "rank_vector", "sequoia_tree_for", "star_children", "star_ranks", "star_rule", "forward_times",
           "verify_times"]


# ---- the star tree ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Star:
    children: torch.Tensor  # (k,) tokens in rank order (k <= W)
    q: torch.Tensor | None  # (V,) the law they were drawn from; None = deterministic children


def star_children(q_logits: torch.Tensor, width: int, rule: StarRule, sampling: SamplingParams,
                  generator: torch.Generator) -> list[Star]:
    """One star per row of the draft logits (T, V): the top-W, or W draws without replacement from the
    processed q by the exponential race (descending q/E, E ~ Exp(1), is a sequential draw ∝ q); a row with
    fewer than W tokens of mass gets fewer children."""
    if not rule.sample:
        cands = q_logits.topk(width, dim=-1).indices  # (T, W)
        return [Star(c, None) for c in cands]
    q = probs(q_logits, sampling)  # (T, V)
    keys, cands = (q / torch.empty_like(q).exponential_(generator=generator)).topk(width, dim=-1)  # (T, W)
    return [Star(c[k > 0], qt) for c, k, qt in zip(cands, keys, q)]


def star_ranks(p: torch.Tensor, roots: torch.Tensor, stars: Sequence[Star], rule: StarRule,
               generator: torch.Generator) -> list[int | None]:
    """Verify one star tree per position with the configured verifier (methods.core.verify): p (T, V)
    processed target law after each root, roots (T,) root tokens. The accepted child's rank (0-based), None
    if none."""
    out: list[int | None] = []
    for t, star in enumerate(stars):
        k = int(star.children.numel())
        if k == 0:
            out.append(None)
            continue
        one_hot = star.q is None and rule.verifier == Verifier.sequoia  # a proposal that came without q
        verifier = Verifier.deterministic if one_hot else rule.verifier
        tree = Tree.from_parents([-1] + [0] * k)  # ranks 0..k-1 in order
        tokens = torch.cat([roots[t : t + 1], star.children]).to(p.device)
        q = None if star.q is None else star.q.expand(k + 1, -1)  # only row 0 (the root's) is read
        # the children's rows of p only feed the bonus token after an accepted leaf: not needed here
        res = verify(verifier, Draft(tree, tokens, q), p[t].expand(k + 1, -1), generator)
        out.append(tree.ranks[res.accepted[1]] if len(res.accepted) > 1 else None)
    return out


def rank_vector(ranks: Sequence[int | None], width: int) -> list[float]:
    """Sequoia's [0, p_1, …, p_W, p_none] from accepted ranks (0-based; None = none accepted)."""
    counts = np.zeros(width + 1)
    for r in ranks:
        counts[width if r is None else r] += 1
    assert counts.sum() > 0, "no position was verified"
    return [0.0, *(counts / counts.sum()).tolist()]


# ---- one calibration ------------------------------------------------------------------------------------
@dataclass
class _Run:
    cfg: RunConfig
    models: Models
    target: ModelEngine
    draft: ModelEngine | None  # the draft model's, when there is one
    drafter: Any  # methods.core.drafter.Drafter, built for the depth tree
    tree: Tree  # the drafter's chain/tree for acceptance_by_depth
    prompts: list[torch.Tensor]
    sampling: SamplingParams
    generator: torch.Generator
    bar: tqdm

    @property
    def eos(self) -> int | None:
        return self.models.tokenizer.eos_token_id if self.models.tokenizer is not None else None


def depth_tree(cfg: RunConfig) -> Tree:
    """The tree whose real decoding gives acceptance_by_depth: the configured one, or a chain of tree.gamma
    when the configured tree is itself chosen from the calibration (sequoia) or per context (dynamic)."""
    if TreeKind(cfg.tree.kind) in (TreeKind.sequoia, TreeKind.dynamic, TreeKind.none):
        return Tree.chain(cfg.tree.gamma)
    return build_tree(cfg.tree, from_config(cfg.method.acceptance), CostModel.from_config(cfg))


def _forward_all(engine: ModelEngine, seq: torch.Tensor, hidden: bool = False) -> ForwardOut:
    """Logits (and hidden states) at every position of seq (T,), causally, leaving the engine empty."""
    engine.reset()
    out = engine.extend(seq.to(engine.device), list(range(-1, seq.numel() - 1)), hidden=hidden)
    engine.drop_pending()
    return out


def _draft_model_law(run: _Run, seq: torch.Tensor, target: ForwardOut, roots: torch.Tensor, depth: int = 1
                     ) -> torch.Tensor:
    """q after each root: the draft model's logits over the same sequence (depth 1 only: at depth d the draft
    model reads the true prefix, so its star there is a depth-1 star at a later position)."""
    assert depth == 1, "the draft model's law is positional"
    return _forward_all(run.draft, seq).logits[roots]  # (T, V)


def _medusa_law(run: _Run, seq: torch.Tensor, target: ForwardOut, roots: torch.Tensor, depth: int = 1
                ) -> torch.Tensor:
    """q of the depth-``depth`` children: Medusa head ``depth`` on the hidden state that predicted the root
    (as its drafter proposes them: every head reads that one state)."""
    heads = run.drafter.heads
    h = target.hidden[roots - 1]  # (T, H)
    with torch.inference_mode():
        return heads.head_logits(h.to(heads.heads[0][-1].weight.dtype), depth).float()  # (T, V)


def _self_draft_law(run: _Run, seq: torch.Tensor, target: ForwardOut, roots: torch.Tensor, depth: int = 1
                    ) -> torch.Tensor:
    """q after each root from the drafter's own sub-layers of the target (``drafter.sub``: LayerSkip's early
    exit, Draft & Verify's skipped sub-layers) over the true sequence. Positional: the draft reads the
    target's KV of the committed prefix, exactly for LayerSkip at every depth (layers [0, E) of draft nodes
    are the target's own); for Draft & Verify deeper drafts also read the earlier drafts' skipped-layer KV,
    which this law does not (an approximation at depth > 1)."""
    assert depth == 1, "the self-draft law is positional"
    engine = run.target
    engine.reset()
    out = engine.extend(seq.to(engine.device), list(range(-1, seq.numel() - 1)), sub=run.drafter.sub)
    engine.drop_pending()
    return out.logits[roots]  # (T, V)


def _mtp_law(run: _Run, seq: torch.Tensor, target: ForwardOut, roots: torch.Tensor, depth: int = 1
             ) -> torch.Tensor:
    """q of the depth-``depth`` children: MTP module ``depth`` along the trajectory (modules 1..depth over
    the target's hidden states with the true tokens, which are the accepted prefix), at the position whose
    hidden state predicted the root; its attention window as in drafting."""
    heads = run.drafter.heads
    h = target.hidden[None].to(heads.lm_head.dtype)  # (1, T-1, H): position i predicted seq[i + 1]
    n = h.shape[1]
    with torch.inference_mode():
        for k in range(1, depth + 1):
            toks = seq[k : k + n].to(h.device)
            h = heads.step(k, h[:, : toks.numel()], toks[None])
        return heads.logits(depth, h[0, roots - 1]).float()  # (R, V)


Law = Callable[..., torch.Tensor]  # (run, seq, target ForwardOut, roots (T,), depth) → q logits (T, V)
LAWS: dict[str, Law] = {"draft_model": _draft_model_law, "medusa": _medusa_law,  # drafter name → its law q
                        "layerskip": _self_draft_law, "draft_verify": _self_draft_law, "mtp": _mtp_law}


def star_depths(run: _Run) -> int:
    """Depths that get their own star vector: Medusa's heads (head d drafts depth d); for a proposal drafter
    (no law here) the depth tree's depth; 1 for a positional law (the draft model)."""
    if run.cfg.method.drafter not in LAWS:
        return max(1, run.tree.depth)
    heads = getattr(run.drafter, "heads", None)
    per_depth = run.cfg.method.drafter in ("medusa", "mtp")  # one law per depth (head / module d)
    return int(heads.num_heads) if per_depth and heads is not None else 1


def _law_stars(
    run: _Run, law: Law, rule: StarRule, seq: torch.Tensor, target: ForwardOut, roots: torch.Tensor,
    depths: int,
) -> Iterator[tuple[torch.Tensor, list[Star]]]:
    """Per depth d = 1, 2, …: (parent positions, stars) drawn from the law of depth d at each root whose
    depth-d node is still inside the trajectory; the parent token sits d-1 positions after the root."""
    for d in range(1, depths + 1):
        at = roots[: roots.numel() - (d - 1)]
        yield at + d - 1, star_children(law(run, seq, target, at, d), run.cfg.calibration.width,
                                        rule, run.sampling, run.generator)


def _by_depth(proposed: list[tuple[int, int, Star]], depths: int
              ) -> Iterator[tuple[torch.Tensor, list[Star]]]:
    """_proposed's (depth, parent position, star) grouped per depth d = 1, 2, …, as _law_stars yields them."""
    for d in range(1, depths + 1):
        at = [(pos, star) for depth, pos, star in proposed if depth == d]
        yield torch.tensor([pos for pos, _ in at], dtype=torch.long), [star for _, star in at]


def _proposed(run: _Run, seq: torch.Tensor, n_prompt: int, hidden: torch.Tensor | None, max_depth: int
              ) -> list[tuple[int, int, Star]]:
    """Drafters without a law here (stateless ones such as prompt lookup; verification feedback is not
    given): their own proposal at each position, followed along the trajectory. Returns (depth, parent
    position, star): the root's children at depth 1, and at depth d the children of the depth-(d-1) node
    that equals the trajectory's token — the prefix a verification accepted — down to ``max_depth``. A node
    without children there is an empty star (the step ends: counted as none accepted)."""
    run.drafter.reset(seq[:n_prompt])
    width, last, out = run.cfg.calibration.width, seq.numel() - 1, []
    for t in range(n_prompt - 1, last):
        h = hidden[t - 1 : t] if hidden is not None and t >= 1 else None
        draft = run.drafter.propose(DraftContext(seq[: t + 1], h, run.generator, last - t))
        tree, node, depth = draft.tree, 0, 1
        while depth <= max_depth and t + depth - 1 < last:
            kids = sorted(tree.children[node], key=lambda c: tree.ranks[c])[:width]
            q = None if draft.q is None else draft.q[node]
            out.append((depth, t + depth - 1, Star(draft.tokens[list(kids)], q)))
            match = [c for c in kids if int(draft.tokens[c]) == int(seq[t + depth])]
            if not match:
                break
            node, depth = match[0], depth + 1
    return out


def _trajectories(run: _Run) -> tuple[list[torch.Tensor], float]:
    """The target's own continuations (prompt + generated) and the loop's autoregressive step time: the whole
    step (forward, verification, the loop's per-step bookkeeping), what a measured baseline pays per token."""
    cal, s = run.cfg.calibration, run.sampling
    opts = DecodeOptions(Verifier.greedy if s.greedy else Verifier.chain, s, cal.new_tokens, run.eos)
    if cal.warmup:
        decode(run.target, Autoregressive(), run.prompts[0], replace(opts, max_new_tokens=4), run.generator)
    seqs, step_s, forwards = [], 0.0, 0
    for ids in run.prompts:
        r = decode(run.target, Autoregressive(), ids, opts, run.generator)
        seqs.append(torch.cat([ids, torch.tensor(r.token_ids, dtype=torch.long)]))
        step_s, forwards = step_s + r.time_total_s - r.time_prefill_s, forwards + r.n_target_forwards
        run.bar.update()
    return seqs, step_s / max(forwards, 1)


def _star_ranks(run: _Run, seqs: list[torch.Tensor]) -> list[list[int | None]]:
    """Accepted ranks of the star trees, per depth: [0] at every position (the positional vector); [d-1] for
    d >= 2 for drafters whose depth-d children come from their own law (Medusa's head d), verified against
    the target's law d-1 tokens further along the trajectory (the prefix the tree reached), and for
    proposal drafters (prompt lookup: a copied span's tokens are right or wrong together), see _proposed."""
    rule, law = star_rule(run.cfg), LAWS.get(run.cfg.method.drafter)
    want_hidden = bool(getattr(run.drafter, "needs_hidden_states", False))
    depths = star_depths(run)
    ranks: list[list[int | None]] = [[] for _ in range(depths)]
    for ids, seq in zip(run.prompts, seqs):
        n_prompt = ids.numel()
        roots = torch.arange(n_prompt - 1, seq.numel() - 1)  # (T,) positions the target generated after
        out = _forward_all(run.target, seq, hidden=want_hidden)
        stars = (_law_stars(run, law, rule, seq, out, roots, depths) if law is not None
                 else _by_depth(_proposed(run, seq, n_prompt, out.hidden, depths), depths))
        for d, (parent, group) in enumerate(stars, 1):  # verified against p after the parent token
            if group:
                ranks[d - 1] += star_ranks(probs(out.logits[parent], run.sampling), seq[parent], group, rule,
                                           run.generator)
        run.bar.update()
    return ranks


def _depth_run(run: _Run) -> tuple[AcceptStats, float, float, float]:
    """The drafter's chain/tree through the real loop: acceptance stats, seconds per draft step (one
    draft forward per level, or one pass for a single-pass drafter), per speculation step, and the loop's
    verification seconds per step (the target's forward, verification, commit)."""
    cal, m = run.cfg.calibration, run.cfg.method
    opts = DecodeOptions(Verifier(m.verifier), run.sampling, cal.new_tokens, run.eos)
    if cal.warmup:
        decode(run.target, run.drafter, run.prompts[0], replace(opts, max_new_tokens=8), run.generator)
    stats, draft_s, verify_s, steps = AcceptStats(), 0.0, 0.0, 0
    for ids in run.prompts[: cal.depth_prompts]:
        r = decode(run.target, run.drafter, ids, opts, run.generator)
        stats.merge(r.stats)
        draft_s, verify_s = draft_s + r.time_draft_s, verify_s + r.time_verify_s
        steps += r.n_target_forwards
        run.bar.update()
    per_step = draft_s / max(steps, 1) if run.tree.depth > 0 else 0.0
    levels = run.tree.depth if m.draft_steps == "depth" else 1
    return stats, per_step / max(levels, 1), per_step, verify_s / max(steps, 1)


@torch.inference_mode()
def _setup(cfg: RunConfig, models: Models, bar: tqdm) -> _Run:
    cal, w = cfg.calibration, cfg.workload
    sampling = SamplingParams(w.temperature, w.top_k, w.top_p)
    calib = replace(w, split="calibration", num_prompts=cal.prompts, max_new_tokens=cal.new_tokens)
    prompts = load_prompts(calib, models.tokenizer, cfg.seed)
    ids = [torch.tensor(p.token_ids, dtype=torch.long) for p in prompts]
    tree = depth_tree(cfg)
    drafter = build_drafter(cfg.method, tree if tree.size > 1 else None, models, sampling)
    tree = getattr(drafter, "tree", tree)  # a drafter may have cut the tree (Medusa: depth <= its heads)
    generator = torch.Generator(device=models.device).manual_seed(cfg.seed)
    draft = ModelEngine(models.draft) if models.draft is not None else None
    target = ModelEngine(models.target)
    return _Run(cfg, models, target, draft, drafter, tree, ids, sampling, generator, bar)


@dataclass(frozen=True)
class _Measured:
    ranks: list[list[int | None]]  # accepted rank of each star tree (None: none accepted), per depth
    stats: AcceptStats  # the drafter's chain/tree in the loop
    t_ar: float
    draft_step: float
    spec_step: float
    verify_step: float  # the loop's verification per speculation step (forward included)
    times: dict[int, list[float]]  # n → forward seconds
    context: int
    setup_s: float


def _measure(cfg: RunConfig, models: Models, bar: tqdm) -> tuple[_Run, _Measured]:
    start, cal = time.perf_counter(), cfg.calibration
    run = _setup(cfg, models, bar)
    setup_s = time.perf_counter() - start  # loading (and, Medusa, training heads on first use)
    seqs, t_ar = _trajectories(run)
    ranks = _star_ranks(run, seqs)
    stats, draft_step, spec_step, verify_step = _depth_run(run)
    ctx = min(cal.context_tokens or cfg.workload.context_tokens, context_length(models.target) - 2)
    context = torch.cat(seqs).repeat(ctx // sum(s.numel() for s in seqs) + 1)[:ctx]  # real tokens
    sizes = sorted({1, run.tree.size, *(int(b) for b in cfg.tree.budgets)})  # the loop's tree: its overhead
    times = forward_times(run.target, context, sizes, cal.reps, cal.warmup, cfg.seed)
    bar.update()
    return run, _Measured(ranks, stats, t_ar, draft_step, spec_step, verify_step, times, ctx, setup_s)


def _extra(cfg: RunConfig, run: _Run, m: _Measured, loads: list[float]) -> dict[str, Any]:
    """The calibration's own figures, kept in the profile for inspection."""
    width = cfg.calibration.width
    counts = np.bincount([width if r is None else r for r in m.ranks[0]], minlength=width + 1)  # none last
    # (first, third) quartile of each t(n), keyed by str(n) as JSON will have it
    quartiles = {str(n): statistics.quantiles(v, n=4)[::2] if len(v) > 1 else v * 2
                 for n, v in m.times.items()}
    return {
        "rank_counts": counts.tolist(), "star_rule": star_rule(cfg).name,
        "temperature": cfg.workload.temperature,
        "loop_tau": m.stats.tau, "loop_accept_hist": m.stats.hist,
        "loop_acceptance_by_rank": m.stats.by_rank(),
        "loop_tree_size": run.tree.size, "loop_tree_depth": run.tree.depth, "loop_steps": m.stats.steps,
        "draft_steps": cfg.method.draft_steps, "draft_per_speculation_step_s": m.spec_step,
        "verify_per_speculation_step_s": m.verify_step,
        "context_tokens": m.context, "reps": cfg.calibration.reps, "t_n_quartiles_s": quartiles,
        "torch_threads": torch.get_num_threads(), "setup_seconds": m.setup_s,
        "loadavg_1min": loads,  # a busy machine slows t(n): see how busy it was
    }


def measure_profile(cfg: RunConfig, models: Models | None = None, show_progress: bool = True) -> Profile:
    """Calibrate ``cfg``'s drafter against its target on this device (see the module docstring)."""
    start, cal, load = time.perf_counter(), cfg.calibration, os.getloadavg()[0]
    models = models or load_models(cfg.model, cfg.device, cfg.model.dtype)
    bar = tqdm(total=2 * cal.prompts + cal.depth_prompts + 1, desc=f"calibrate {cfg.method.drafter}",
               disable=not show_progress)
    with bar:
        run, m = _measure(cfg, models, bar)
    extra = {**_extra(cfg, run, m, [load, os.getloadavg()[0]]), "seconds": time.perf_counter() - start}
    if max(extra["loadavg_1min"]) > (os.cpu_count() or 1):
        print(f"calibrate: the machine was busy (1-min load up to {max(extra['loadavg_1min']):.1f} on "
              f"{os.cpu_count()} CPUs): t(n) and the draft time are likely inflated", file=sys.stderr)
    heads = getattr(run.drafter, "heads", None)  # Medusa: the tree cannot be deeper than its heads
    t_n = {n: statistics.median(v) for n, v in m.times.items()}
    overhead = max(0.0, m.verify_step - t_n[run.tree.size]) if run.tree.size > 1 else 0.0
    return Profile(
        acceptance_vector=tuple(rank_vector(m.ranks[0], cal.width)),
        acceptance_vectors_by_depth=tuple(tuple(rank_vector(r, cal.width)) for r in takewhile(bool, m.ranks))
        if len(m.ranks) > 1 else (),
        acceptance_by_depth=tuple(m.stats.by_depth()),
        t_n=t_n, draft_time_s=m.draft_step, t_ar_s=m.t_ar, verify_overhead_s=overhead,
        model=cfg.model.name, drafter=cfg.method.drafter, workload=cfg.workload.name,
        device=device_name(cfg.device), dtype=str(models.dtype).removeprefix("torch."), width=cal.width,
        n_positions=len(m.ranks[0]), created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        key=profile_key(cfg), max_draft_depth=int(heads.num_heads) if heads is not None else 0, extra=extra,
    )


# ---- task=calibrate ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationResult:
    metrics: dict[str, Any]  # run.py writes these into metrics.json
    profile: Profile
    path: Path  # the cached profile


def calibrate(cfg: RunConfig, out_dir: Path | str, show_progress: bool = True) -> CalibrationResult:
    """Measure afresh, cache the profile (replacing an older one) and copy it into the run dir."""
    path = profile_path(cfg)
    with profile_lock(path):
        profile = measure_profile(cfg, show_progress=show_progress)
        save_profile(profile, path)
    atomic_write_json(Path(out_dir) / "profile.json", profile.to_json())
    return CalibrationResult(profile_metrics(cfg, profile, path), profile, path)


def profile_metrics(cfg: RunConfig, profile: Profile, path: Path) -> dict[str, Any]:
    """metrics.json of a calibrate run: the profile's figures, and the Sequoia tree they select on this
    device (and on cfg.hardware) with the simulator's predictions for it."""
    tree, here, preset = sequoia_tree_for(cfg, profile)
    n = sorted(profile.t_n)
    return {
        "acceptance_vector": list(profile.acceptance_vector),
        "acceptance_by_depth": list(profile.acceptance_by_depth),
        "acceptance_vectors_by_depth": [list(v) for v in profile.acceptance_vectors_by_depth],
        "t_n_tokens": n, "t_n_s": [profile.t_n[k] for k in n],
        "draft_time_s": profile.draft_time_s, "t_ar_s": profile.t_ar_s,
        "verify_overhead_s": profile.verify_overhead_s,
        "width": profile.width, "n_positions": profile.n_positions,
        "loop_tau": profile.extra["loop_tau"], "calibration_seconds": profile.extra["seconds"],
        "device": profile.device, "dtype": profile.dtype,
        "profile_path": str(path), "profile_key": profile.key,
        "sequoia_tree_size": tree.size, "sequoia_tree_depth": tree.depth,
        "sequoia_predicted_tau": here["predicted_tau"],
        "sequoia_predicted_speedup_this_device": here["predicted_speedup"],
        "sequoia_predicted_speedup_hardware": preset["predicted_speedup"],
    }


def ensure_profile(
    cfg: RunConfig, models=None, cache: Path | None = None, show_progress: bool = True
) -> Profile:
    """The cached profile, or calibrate now (printing a notice) and cache it. ``models``
    (methods.models.Models) avoids loading them twice when the caller has them. A profile without t(n) for
    one of cfg.tree.budgets is measured again."""
    path = profile_path(cfg, cache)
    with profile_lock(path):
        profile = load_profile(cfg, cache)
        if profile is not None and not missing_budgets(profile, cfg):
            return profile
        why = "no profile yet" if profile is None else f"no t(n) for budgets {missing_budgets(profile, cfg)}"
        print(f"calibrating {cfg.method.drafter} on {cfg.model.name}/{cfg.workload.name} ({why}; "
              f"cached for later runs in {path})", file=sys.stderr, flush=True)
        profile = measure_profile(cfg, models, show_progress=show_progress)
        save_profile(profile, path)
    return profile
