"""Speculative decoding at batch size B: the verify forward's cost t(B, n), the speedup at B and the
break-even batch B* past which speculation loses.

A batched step runs B rows (sequences) through one target p forward of n tokens each (the tree, padded to
the batch's largest). Its roofline (Sequoia, Chen et al. 2024, extended to rows as in MagicDec, Chen et al.
2024b, and SmartSpec, Liu et al. 2024):

    t(B, n) = overhead + max(memory, compute, PCIe)
    memory  = (weight bytes + B · KV bytes per token · context) / bandwidth   weights read once per forward,
                                                                             every row reads its own KV
    compute = B · (2 · params · n + 4 · layers · hidden · n · (context + n)) / FLOP/s

At B = 1 this is specsim.cost.Roofline's t(n) exactly. Small B·n is memory-bound (t flat in n: drafts are
nearly free); past the ridge B·n ≈ bandwidth-to-FLOP ratio the forward is compute-bound and every drafted
token costs what an autoregressive token does, so speculation's gain τ shrinks to τ / n-ish and turns into
a loss. The measured variant (:class:`BatchFit`) fits the same five physical terms to a timed grid:

    t(B, n) = t0 + max(w + kv · B · context, tok · B · n + att · B · n · (context + n))   (form "max")
    or the sum of the two parts (form "sum": a CPU overlaps memory and compute little); kv is kv_tree for
    forwards of n ≥ 2 tokens: attention kernels read the cache differently for one query than for several
    (on this CPU, bf16 SDPA with a mask: 2.3x the per-row·token time of the 1-query path, timed).

Speedup per row at batch B: S(B) = τ · t(B, 1) / (t_draft(B) + t(B, n)) (the batched autoregressive step
over the batched speculative step; τ = k̄ per row, bonus included). B* = the smallest B with S(B) < 1.
Draft cost at B: the draft model's own batched roofline (``method.draft_cost=roofline``), a measured draft
fit, or — for costs given as ratios of t(1) — growing as the target's t(B, 1) does.

On a measured device (a profile and a fit, :class:`BatchedLoop`) a step at B ≥ 2 is priced as the batched
loop runs it — another engine than the one-sequence loop the profile timed: the batched engine's forward
fit(B, n) at the workload's context, plus the batched loop's own work outside the forward (timed by running
it: loop0 + loop_row · B), plus, for a draft model with a fit of its own, one draft forward of B rows per
tree level and the draft fit's loop terms: what the loop's speculative step, timed with that draft model,
costs beyond the autoregressive step and beyond its draft forwards at the grid's price (the draft's host
work, its first forwards after the target's finding its weights and KV evicted, the verification of B
trees and the rows leaving at different steps). B = 1 stays the profile's one-sequence step
(task=measure decodes a batch of one alone).
The autoregressive step's 1-token forward, where the fit has it (``ar_context`` > 0), is the loop's own
timed forward (ar0 + ar_row · B at ar_context cached tokens, kv · B per token beyond), not the grid's.
A head drafter (MTP, EAGLE) with a :class:`HeadFit` is priced by its own step timed in the batched loop,
else as the target's t(B, 1) grows. A static batch's run is priced step by step at the rows still decoding
(:func:`active_rows`, :func:`static_batch_steps`): its rows finish steps apart, and the grid's t(B, n) read
at the rows each step runs is what the loop pays (the zoo, vanilla, B = 8 and 32: the loop's 5-node forward
over the grid's cell at the same rows 0.96-1.05 in CPU time, against 1.23-1.40 at B rows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import numpy as np

from specsim.config import HardwareConfig, RunConfig
from specsim.cost import CostModel, DraftCost, ModelShape, Roofline, TargetCost

BATCH_FIT_FORMAT = 5  # bump when BatchFit's fields or their meaning change (2: the loop's own time; 3: the
# 1-token forward as the loop runs it; 4: a draft fit's loop terms = its speculative step beyond the AR step
# and its forwards at the grid's price; 5: ... beyond the AR step at the speculative step's active rows, a
# law over rows; HeadFit)
BATCHES = (1, 2, 4, 8, 16, 32)  # the batch sizes reported by default
MAX_SEARCH_BATCH = 4096  # B* beyond this is reported as None (speculation pays at every batch searched)


class BatchCost(Protocol):
    source: str

    def time(self, batch: int | np.ndarray, n: int | np.ndarray) -> float | np.ndarray:
        """Seconds of one forward over ``batch`` rows × ``n`` new tokens each."""
        ...


@dataclass(frozen=True)
class BatchRoofline:
    """t(B, n) from datasheet numbers (see the module docstring); the same fields as Roofline, and tensor
    parallelism over ``tp`` GPUs (MagicDec's setting, specsim.magicdec): weights, KV heads and FLOPs split
    over the GPUs, plus two ring all-reduces per layer of the B·n·hidden activations over ``link`` bytes/s
    per GPU (0 = not priced), 2·layers · 2(tp − 1)/tp · B·n·hidden·bytes / link. ``memory_bytes`` per GPU
    (0 = unchecked) is what :meth:`fits` checks."""

    model: ModelShape
    bandwidth: float  # bytes/s per GPU
    flops: float  # FLOP/s per GPU
    overhead_s: float
    context_tokens: int = 0
    pcie: float = 0.0
    source: str = "roofline"
    tp: int = 1
    link: float = 0.0
    memory_bytes: float = 0.0

    @classmethod
    def from_roofline(cls, r: Roofline) -> BatchRoofline:
        return cls(r.model, r.bandwidth, r.flops, r.overhead_s, r.context_tokens, r.pcie, r.source)

    @classmethod
    def from_config(cls, hw: HardwareConfig, model: ModelShape, context_tokens: int) -> BatchRoofline:
        return cls.from_roofline(Roofline.from_config(hw, model, context_tokens))

    def at_context(self, context_tokens: int) -> BatchRoofline:
        """The same device with ``context_tokens`` cached tokens per row (a sparse-KV draft's budget)."""
        return replace(self, context_tokens=int(context_tokens))

    def fits(self, batch: int, context_tokens: int | None = None) -> bool:
        """Weights and B rows of KV fit in the GPUs' memory (activations and workspace left out)."""
        ctx = self.context_tokens if context_tokens is None else context_tokens
        need = self.model.weight_bytes + batch * ctx * self.model.kv_bytes_per_token
        return self.memory_bytes <= 0 or need <= self.tp * self.memory_bytes

    def parts(self, batch: Any, n: Any) -> tuple[np.ndarray, np.ndarray, float]:
        """(memory, compute, PCIe) seconds, broadcast over batch and n."""
        b, n = np.asarray(batch, float), np.asarray(n, float)
        m, ctx = self.model, self.context_tokens
        memory = (m.weight_bytes + b * m.kv_bytes_per_token * ctx) / (self.tp * self.bandwidth)
        compute = b * (2.0 * m.params * n + 4.0 * m.n_layers * m.hidden_size * n * (ctx + n)) / (
            self.tp * self.flops)
        pcie = m.weight_bytes / self.pcie if self.pcie > 0 else 0.0
        return memory, compute, pcie

    def all_reduce(self, batch: Any, n: Any) -> float | np.ndarray:
        """Seconds of the tensor-parallel all-reduces of one forward (0 at tp = 1 or without a link)."""
        if self.tp <= 1 or self.link <= 0:
            return 0.0
        m, ring = self.model, 2.0 * (self.tp - 1) / self.tp  # a ring moves 2(tp − 1)/tp of the message
        volume = 2.0 * m.n_layers * ring * np.asarray(batch, float) * np.asarray(n, float) * m.hidden_size
        return volume * m.bytes_per_param / self.link

    def time(self, batch: Any, n: Any) -> float | np.ndarray:
        memory, compute, pcie = self.parts(batch, n)
        t = self.overhead_s + np.maximum(np.maximum(memory, compute), pcie) + self.all_reduce(batch, n)
        return float(t) if np.ndim(t) == 0 else t

    def ridge_tokens(self) -> float:
        """B·n where compute overtakes the weight reads (KV and attention aside): the batch-1 chain length
        or the batch of 1-token rows past which the forward is compute-bound."""
        return self.model.weight_bytes / self.bandwidth * self.flops / (2.0 * self.model.params)


FIT_TERMS = ("t0", "w", "kv", "tok", "att", "kv_tree")


@dataclass(frozen=True)
class BatchFit:
    """t(B, n) fitted to a measured grid (seconds; see the module docstring for the forms)."""

    t0: float  # fixed per forward (framework, launches)
    w: float  # weight reads: once per forward
    kv: float  # per row and cached token (KV reads)
    tok: float  # per token of the forward (GEMMs: 2 · params FLOPs each)
    att: float  # per token and attended position (attention FLOPs)
    context_tokens: int
    form: str = "max"  # max | sum
    source: str = "measured"
    rel_error_median: float = 0.0  # of the fit over the grid it was fitted to
    rel_error_max: float = 0.0
    # the batched decode loop's work per step outside the forward (verification, commit, per-row host
    # bookkeeping), timed by running the loop autoregressively: loop0 + loop_row · B seconds; in a draft
    # model's fit, what the loop's speculative step costs beyond the autoregressive step's and the draft's
    # forwards at this fit's price (methods.measurement.batch_cost.DraftLoopStep.beyond_s)
    loop0: float = 0.0
    loop_row: float = 0.0
    kv_tree: float | None = None  # per row and cached token in a forward of n >= 2 tokens (None: kv)
    # the 1-token (autoregressive) forward as the batched loop runs it, timed in that loop at each B with
    # ar_context cached tokens per row on average: ar0 + ar_row · B, plus kv · B per cached token beyond
    # ar_context; ar_context 0: the grid's terms price n = 1 too
    ar0: float = 0.0
    ar_row: float = 0.0
    ar_context: float = 0.0

    def loop_time(self, batch: Any) -> float | np.ndarray:
        t = self.loop0 + self.loop_row * np.asarray(batch, float)
        return float(t) if np.ndim(t) == 0 else t

    def time(self, batch: Any, n: Any, context: int | None = None) -> float | np.ndarray:
        b, n = np.asarray(batch, float), np.asarray(n, float)
        ctx = np.asarray(self.context_tokens if context is None else context, float)
        kv = self.kv if self.kv_tree is None else np.where(n > 1, self.kv_tree, self.kv)
        memory = self.w + kv * b * ctx
        compute = self.tok * b * n + self.att * b * n * (ctx + n)
        t = self.t0 + (np.maximum(memory, compute) if self.form == "max" else memory + compute)
        if self.ar_context > 0:  # n = 1: the loop's own timed forward
            t = np.where(n == 1, self.ar_time(b, ctx), t)
        return float(t) if np.ndim(t) == 0 else t

    def ar_time(self, batch: Any, context: Any) -> np.ndarray:
        """The loop-timed 1-token forward, ``batch`` rows of ``context`` cached tokens (ar_context > 0)."""
        b = np.asarray(batch, float)
        return self.ar0 + self.ar_row * b + self.kv * b * (np.asarray(context, float) - self.ar_context)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> BatchFit:
        return cls(**dict(doc))


def _predict(params: np.ndarray, b: np.ndarray, n: np.ndarray, ctx: Any, form: str) -> np.ndarray:
    *five, kv_tree = params
    return BatchFit(*five, context_tokens=0, form=form, kv_tree=kv_tree).time(b, n, ctx)


def fit_batch_cost(grid: Mapping[tuple[int, ...], float], context: int,
                   forms: Sequence[str] = ("max", "sum")) -> BatchFit:
    """Least squares on log t (relative errors) over ``grid`` ((B, n) → seconds at ``context`` cached
    tokens, or (B, n, context) → seconds for grids over several contexts), every term >= 0; the form with
    the smaller median relative error is kept. The fit's ``context_tokens`` is ``context``. The w and kv
    terms are told apart by B, tok and att by n and the context, kv and kv_tree by n = 1 against n ≥ 2."""
    from scipy.optimize import least_squares  # a dependency of specsim; imported where it is used

    keys = sorted(grid)
    assert len(keys) >= len(FIT_TERMS) + 1, f"need at least {len(FIT_TERMS) + 1} grid points"
    b = np.array([k[0] for k in keys], float)
    n = np.array([k[1] for k in keys], float)
    ctx = np.array([k[2] if len(k) > 2 else context for k in keys], float)
    t = np.array([grid[k] for k in keys], float)
    assert (t > 0).all(), "measured times must be > 0"
    t11 = float(t[np.argmin(b * n)])
    best: BatchFit | None = None
    for form in forms:
        x0 = np.array([0.3 * t11, 0.5 * t11, 1e-9, t11 / 50, 1e-9, 1e-9])
        res = least_squares(lambda p, f=form: np.log(_predict(p, b, n, ctx, f)) - np.log(t),
                            x0, bounds=(0.0, np.inf), x_scale=np.maximum(x0, 1e-9))
        err = np.abs(_predict(res.x, b, n, ctx, form) / t - 1)
        *five, kv_tree = (float(v) for v in res.x)
        fit = BatchFit(*five, context_tokens=int(context), form=form, kv_tree=kv_tree,
                       rel_error_median=float(np.median(err)), rel_error_max=float(err.max()))
        if best is None or fit.rel_error_median < best.rel_error_median:
            best = fit
    assert best is not None
    return best


@dataclass(frozen=True)
class HeadFit:
    """A head drafter's (MTP's modules, EAGLE's head) draft step in the batched decode loop, timed there
    (methods.measurement.batch_cost.calibrate_head): what the loop's speculative step with the drafter
    costs outside its target forward beyond the autoregressive step at the same rows — the heads' forwards
    over every row's fed nodes, their top-k, the catch-up, the verification of B trees and the rows leaving
    — as step0 + step_row · rows seconds per step, on a tree of ``levels`` levels (a tree of D levels pays
    D / levels of it: one head forward per level). Priced so, not as the target's t(B, 1) grows: the
    heads' work grows with the rows' nodes while the target's 1-token forward reads its weights once."""

    step0: float
    step_row: float
    levels: int
    source: str = "head loop"

    def time(self, rows: Any, levels: Any = None) -> float | np.ndarray:
        t = (self.step0 + self.step_row * np.asarray(rows, float)) * (
            1.0 if levels is None else np.asarray(levels, float) / self.levels)
        return float(t) if np.ndim(t) == 0 else t

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> HeadFit:
        return cls(**dict(doc))


# ---- a single-row cost model at batch B ----------------------------------------------------------------
@dataclass(frozen=True)
class AtBatch:
    """t(n) of B rows: the TargetCost view of a BatchCost at a fixed B (specsim.cost prices trees with it)."""

    cost: Any  # BatchCost
    batch: int
    source: str = ""

    def time(self, n: Any) -> float | np.ndarray:
        return self.cost.time(self.batch, n)


@dataclass(frozen=True)
class Anchored:
    """A measured single-row t(n) (the device profile: the loop's own step, verification included) grown
    with B as a measured fit grows: t(B, n) = t_profile(n) · fit(B, n) / fit(1, n). At B = 1 it is the
    profile. A ratio, like the profile's own costs (ratios of t(1) from interleaved rounds): a fit timed
    on a busier machine than the profile moves every cell alike, which a ratio cancels and a difference
    would not."""

    base: TargetCost
    fit: BatchFit
    source: str = "measured"

    def time(self, batch: Any, n: Any) -> float | np.ndarray:
        grow = np.asarray(self.fit.time(batch, n)) / np.asarray(self.fit.time(1, n))
        t = np.asarray(self.base.time(np.asarray(n))) * grow
        return float(t) if np.ndim(t) == 0 else t


@dataclass(frozen=True)
class BatchedLoop:
    """t(B, n) of a step of the batched decode loop on this device, in seconds: the batched engine's verify
    forward as the fit prices it at its ``context_tokens`` plus the loop's measured time outside the forward
    (``fit.loop_time``); B = 1 is the one-sequence loop's measured step (``base``, the device profile):
    task=measure decodes a batch of one with it, and the two engines cost differently (the batched one
    builds a per-row mask and writes KV by index). Absolute times, not ratios of the profile: the profile
    times another engine, whose t(1) grown by fit(B, n) / fit(1, n) under-read the batched loop's steps.
    The fit and the run must be timed under the same load (a quiet machine)."""

    base: TargetCost
    fit: BatchFit
    source: str = "measured"
    one_sequence: bool = True  # B = 1 is the one-sequence loop (False: the batched loop's last row)

    def time(self, batch: Any, n: Any) -> float | np.ndarray:
        b, n = np.broadcast_arrays(np.asarray(batch, float), np.asarray(n, float))
        batched = np.asarray(self.fit.time(b, n)) + np.asarray(self.fit.loop_time(b))
        t = np.where(b <= 1, np.asarray(self.base.time(n)), batched) if self.one_sequence else batched
        return float(t) if np.ndim(t) == 0 else t


@dataclass(frozen=True)
class BatchCostModel:
    """A CostModel (the single-row one) and the batched target t(B, n); ``draft`` prices the draft model's
    step at B (a BatchCost over B rows × w nodes of a level), None = as the target's t(B, 1) grows."""

    single: CostModel
    target: Any  # BatchCost
    draft: Any = None  # BatchCost | None
    head: HeadFit | None = None  # a head drafter's step in the batched loop (on a measured device)

    @classmethod
    def from_config(cls, cfg: RunConfig, profile: TargetCost | None = None, fit: BatchFit | None = None,
                    draft_fit: BatchFit | None = None, head_fit: HeadFit | None = None) -> BatchCostModel:
        """The roofline of hardware × model at B rows, or — with a measured ``profile`` t(n) and this
        device's ``fit`` — the batched loop's measured step at B ≥ 2 (:class:`BatchedLoop`, the fit at the
        workload's context). A measured profile without a fit falls back to the roofline's growth
        (t_profile(n) · roofline(B, n) / roofline(1, n), :class:`Anchored`). ``draft_fit``: the draft
        model's own batched forward, priced at the workload's context too; ``head_fit``: a head drafter's
        draft step timed in the batched loop (:class:`HeadFit`, read with a fit only)."""
        single = CostModel.from_config(cfg, profile)
        context = cfg.workload.context_tokens
        roof = BatchRoofline.from_config(cfg.hardware, ModelShape.target(cfg.model), context)
        if profile is None:
            target: Any = roof
        elif fit is None:
            target = Anchored(profile, _as_fit(roof))
        else:
            target = BatchedLoop(profile, replace(fit, context_tokens=int(context)))
        draft: Any = None if draft_fit is None else replace(draft_fit, context_tokens=int(context))
        if draft is None and single.draft.model is not None:  # draft_cost=roofline: its own rows too
            draft = BatchRoofline.from_roofline(single.draft.model)
        return cls(single, target, draft, head_fit if isinstance(target, BatchedLoop) else None)

    def at(self, batch: int) -> CostModel:
        """The single-row CostModel whose t(n) is t(B, n) and whose draft step is priced at B rows."""
        target = AtBatch(self.target, int(batch), getattr(self.target, "source", "batch"))
        d = self.single.draft
        t11 = float(self.single.target.time(1))  # the profile's t(1): what its draft ratios are ratios of
        if d.model is not None and isinstance(self.draft, BatchRoofline):
            draft = replace(d, model=AtBatch(self.draft, int(batch), "roofline"))
        elif self.draft_forwards(batch):  # the draft model's batched forward, one per tree level
            # plus what the loop's speculative step costs beyond them and the AR step (the draft fit's loop
            # terms, methods.measurement.batch_cost.time_draft_loop), per step
            tb1 = float(self.target.time(batch, 1))
            fixed = (d.fixed_ratio * t11 + self.draft.loop_time(batch)) / tb1
            draft = replace(d, model=AtBatch(self.draft, int(batch), "draft fit"), ratio=0.0,
                            fixed_ratio=fixed, fed_width=False)
        elif self.head is not None and (batch > 1 or not getattr(self.target, "one_sequence", True)):
            # the head's step as the batched loop times it (HeadFit), in t(B, 1)
            step = float(self.head.time(batch)) / float(self.target.time(batch, 1))
            ratio, fixed = (0.0, step) if d.one_pass else (step / self.head.levels, 0.0)
            draft = replace(d, ratio=ratio, fixed_ratio=fixed, model=None, fed_width=False,
                            tokens_per_forward=1.0)
        else:  # ratios of t(1): rescale so that ratio · t(B, 1) = the draft step at B
            tb1 = float(self.target.time(batch, 1))
            grow = tb1 / t11 if self.draft is None else (
                float(self.draft.time(batch, 1)) / float(self.draft.time(1, 1)))
            scale = grow * t11 / tb1
            draft = replace(d, ratio=d.ratio * scale, fixed_ratio=d.fixed_ratio * scale)
        return replace(self.single, target=target, draft=draft)

    def with_draft_step(self, seconds: float) -> BatchCostModel:
        """The one-sequence draft priced at ``seconds`` per speculation step (a dynamic drafter's draft as
        timed against the loop's chain, methods.measurement.profiles.dynamic_draft_s) instead of by its
        levels: at B ≥ 2 it grows as the target's t(B, 1) (:meth:`at`'s ratio branch), or a head fit
        replaces it. A drafter with a draft model's own batched forward keeps that pricing."""
        assert seconds >= 0, seconds
        d, t11 = self.single.draft, float(self.single.target.time(1))
        if d.model is not None or self.draft is not None:
            return self
        step = DraftCost(0.0, seconds / t11, d.one_pass)
        return replace(self, single=replace(self.single, draft=step))

    def draft_forwards(self, batch: int) -> bool:
        """The draft step at ``batch`` is the measured draft fit's forwards (a draft model drafting level
        by level, on a measured device at B ≥ 2 or in the batched loop's last rows) rather than a ratio of
        t(1)."""
        d = self.single.draft
        return (isinstance(self.draft, BatchFit) and isinstance(self.target, BatchedLoop)
                and (batch > 1 or not self.target.one_sequence) and d.model is None and not d.one_pass)

    def rows(self, batch: int) -> CostModel:
        """:meth:`at` ``batch`` as a batch that started larger pays for its last ``batch`` rows: one row
        too is a step of the batched loop (on a measured device), not the one-sequence loop's."""
        target = self.target
        if isinstance(target, BatchedLoop):
            target = replace(target, one_sequence=False)
        return replace(self, target=target).at(batch)


def _as_fit(r: BatchRoofline) -> BatchFit:
    """The roofline written as a BatchFit (form max), for growing a profile where no fit was measured."""
    m, ctx = r.model, r.context_tokens
    w = m.weight_bytes / r.bandwidth
    kv = m.kv_bytes_per_token / r.bandwidth
    tok = 2.0 * m.params / r.flops
    att = 4.0 * m.n_layers * m.hidden_size / r.flops
    return BatchFit(r.overhead_s, w, kv, tok, att, ctx, "max", "roofline")


def batch_speedup(cost: BatchCostModel, tree: Any, tau: float, batch: int) -> float:
    """S(B) = τ · t(B, 1) / (t_draft(B) + t(B, n)) for a fixed tree (the root alone: 1)."""
    at = cost.at(batch)
    return tau * at.ar_time / at.step_time(tree) if tree.depth > 0 else 1.0


def first_loss(speedups: Sequence[float], batches: Sequence[int]) -> float | None:
    """B* from S sampled at increasing ``batches``: where S crosses 1 going down, interpolated linearly in
    log B between the last B with S >= 1 and the first with S < 1; None if S >= 1 everywhere. S < 1 at
    the first B already: that B (speculation never pays)."""
    for i, s in enumerate(speedups):
        if s < 1.0:
            if i == 0:
                return float(batches[0])
            lo, hi, s_lo, s_hi = batches[i - 1], batches[i], speedups[i - 1], s
            frac = (s_lo - 1.0) / (s_lo - s_hi)
            return float(math.exp(math.log(lo) + frac * (math.log(hi) - math.log(lo))))
    return None


# ---- predictions at batch B ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchPrediction:
    """The simulator at batch B for one config: per-row τ and speedup of the batched speculative step over
    the batched autoregressive step, the tree chosen at B (Sequoia / dynamic trees shrink with B), and B*."""

    batch_size: int
    predicted_tau: float  # per row, bonus included
    predicted_speedup: float  # S(B) = τ · t(B, 1) / (t_draft(B) + t(B, n))
    tree_size: int  # nodes per row at this B (root included)
    t_step_s: float  # the batched speculative step
    t_ar_s: float  # t(B, 1): the batched autoregressive step
    ar_tokens_per_s: float  # B / t(B, 1)
    spec_tokens_per_s: float  # B · τ / t_step
    break_even_batch: float | None  # B*: None = speculation pays at every B searched
    cost_source: str
    # a generation of workload.max_new_tokens per row: n · t(B, 1) / (E[forwards] · t_run_step), E[forwards]
    # of a static batch = E[max over its B rows] (it steps until its slowest row is done, its steps running
    # the rows not done yet; continuous batching refills rows: one row's mean at B rows); the measured
    # counterpart is decode_speedup
    predicted_decode_speedup: float = float("nan")
    batch_forwards: float = float("nan")  # E[forwards] of the batch (the autoregressive side: n)
    t_verify_s: float = float("nan")  # the step's terms: the verify (target forward and loop work at B)
    t_draft_s: float = float("nan")  # and the drafting at B (t_step_s = their sum)
    # the run's mean step (its expected time over batch_forwards): a static batch's rows leave as they
    # finish, so its later steps run fewer rows (static_batch_steps); the measured per-step terms are these
    t_run_step_s: float = float("nan")
    t_run_verify_s: float = float("nan")
    t_run_draft_s: float = float("nan")
    mean_rows: float = float("nan")  # active rows per step of the run (B while every row decodes)

    def to_metrics(self, prefix: str = "") -> dict[str, Any]:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}


def _tree_at(cfg: RunConfig, acceptance: Any, cost: CostModel, tree: Any = None) -> Any:
    """The tree a run uses at this cost model: ``tree`` when given, the root alone without a drafter,
    else the preset's (Sequoia and dynamic trees are sized for this cost)."""
    from specsim.predict import NO_DRAFTER
    from specsim.tree import Tree
    from specsim.trees import build_tree

    if tree is not None:
        return tree
    if cfg.method.drafter == NO_DRAFTER:
        return Tree.chain(0)
    return build_tree(cfg.tree, acceptance, cost)


def speedup_curve(cfg: RunConfig, batches: Sequence[int], cost: BatchCostModel | None = None,
                  tree: Any = None, law: np.ndarray | None = None) -> list[tuple[int, float, float, Any]]:
    """(B, τ, S(B), tree) per B. Trees sized by the cost model (Sequoia, dynamic) are re-chosen at each B;
    a fixed ``tree`` is priced as is. ``law``: the accepted-length law of a fixed ``tree``'s steps (a
    dynamic drafter's recorded trees, specsim.trees.recorded_law): τ is its mean, ``tree`` sizes the step."""
    from specsim.acceptance import from_config
    from specsim.expected import expected_tokens

    assert law is None or tree is not None, "a law prices a fixed tree's steps"
    model = from_config(cfg.method.acceptance)
    cost = cost or BatchCostModel.from_config(cfg)
    out = []
    for b in batches:
        at = cost.at(b)
        t = _tree_at(cfg, model, at, tree)
        tau = expected_tokens(t, model) if law is None else _mean(law)
        s = tau * at.ar_time / at.step_time(t) if t.depth > 0 else 1.0
        out.append((int(b), float(tau), float(s), t))
    return out


def _mean(law: np.ndarray) -> float:
    """τ of an accepted-length law (pmf over tokens per step, bonus included)."""
    law = np.asarray(law, float)
    return float(np.arange(law.size) @ law)


def break_even_batch(cfg: RunConfig, cost: BatchCostModel | None = None, tree: Any = None,
                     max_batch: int = MAX_SEARCH_BATCH, law: np.ndarray | None = None) -> float | None:
    """B*: the smallest batch at which the method's speculative step loses to autoregressive decoding
    (S(B) < 1), interpolated in log B between the integers around it; None if S >= 1 up to ``max_batch``
    or the method drafts nothing. A tree the cost model sizes (Sequoia) shrinks to the root alone instead
    of losing: its B* is where it stops speculating. S(B) is taken as decreasing in B: powers of two
    bracket the crossing, bisection on integers narrows it. ``law``: as :func:`speedup_curve`'s."""
    from specsim.predict import NO_DRAFTER

    if cfg.method.drafter == NO_DRAFTER:
        return None
    cost = cost or BatchCostModel.from_config(cfg)

    def s(b: int) -> float:
        (_, _, sp, t), = speedup_curve(cfg, [b], cost, tree, law)
        return sp if t.depth > 0 else 1.0 - 1e-12  # the root alone: speculation does not pay here

    memo: dict[int, float] = {}
    at = lambda b: memo[b] if b in memo else memo.setdefault(b, s(b))  # noqa: E731
    powers = [2**i for i in range(int(math.log2(max_batch)) + 1)]
    hi = next((b for b in powers if at(b) < 1.0), None)
    if hi is None:
        return None
    if hi == 1:
        return 1.0
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at(mid) >= 1.0 else (lo, mid)
    return first_loss([at(lo), at(hi)], [lo, hi])


# ---- the run's length: a static batch steps until its slowest row is done -------------------------------
def prompt_laws(hists: Sequence[Sequence[int]], center: np.ndarray) -> list[np.ndarray]:
    """One accepted-length law per prompt (pmf over tokens per step, bonus included, as
    specsim.expected.accepted_length_law) from each prompt's histogram of accepted drafts per step
    (``hists[j][k]``: steps of prompt j that accepted k drafts; calibration's loop), re-centred on the
    model's law ``center``: law_j = center + λ_j (e_j − ē), e_j the prompt's empirical law, ē the pooled one.
    λ_j shrinks a prompt's few steps towards the pool (empirical Bayes on τ: λ_j = v / (v + σ² / N_j), σ²
    the pooled variance of the tokens per step, v the spread of τ between prompts beyond what N_j steps of
    sampling noise explain, Var_j(τ̂_j) − mean(σ² / N_j), at least 0): without it every prompt's sampling
    noise would read as heterogeneity. Laws are clipped at 0 and renormalised."""
    center = np.asarray(center, float)
    size = center.size
    counts = np.zeros((len(hists), size))
    for j, h in enumerate(hists):
        h = np.asarray(h, float)[: size - 1]
        counts[j, 1 : 1 + h.size] = h
    steps = counts.sum(1)
    counts, steps = counts[steps > 0], steps[steps > 0]
    if len(steps) < 2:
        return [center]
    k = np.arange(size)
    emp = counts / steps[:, None]
    pooled = counts.sum(0) / steps.sum()
    var = float(pooled @ (k - pooled @ k) ** 2)
    tau = emp @ k
    between = max(0.0, float(np.var(tau, ddof=1) - np.mean(var / steps)))
    shrink = between / (between + var / steps) if between > 0 else np.zeros_like(steps)
    laws = np.clip(center + shrink[:, None] * (emp - pooled), 0.0, None)
    return list(laws / laws.sum(1, keepdims=True))


def mixture_batch_forwards(laws: Sequence[np.ndarray], n_tokens: int, batch: int) -> float:
    """E[max over ``batch`` rows of the forwards to emit ``n_tokens`` each] when every row is a prompt drawn
    at random from ``laws`` (equal weights; each prompt's steps i.i.d. under its own law): a row's forwards
    have the mixture's CDF F(s) = mean_j F_j(s), the rows are independent, so P(max ≤ s) = F(s)^B. One law:
    specsim.expected.batch_forwards."""
    from specsim.expected import forwards_law

    cdf = np.mean([np.cumsum(forwards_law(law, n_tokens)) for law in laws], axis=0)
    return float(np.sum(1.0 - np.clip(cdf[:-1], 0.0, 1.0) ** int(batch)))


def active_rows(laws: Sequence[np.ndarray], n_tokens: int, batch: int) -> np.ndarray:
    """(n_tokens, batch + 1): P(B_s = k), the rows of a static batch still decoding at its step s = 1 …
    n_tokens, every row a prompt drawn at random from ``laws`` (as :func:`mixture_batch_forwards`): a row
    decodes at step s while its forwards F ≥ s, so B_s ~ Binomial(B, P(F ≥ s)). Summed over k ≥ 1 and s:
    E[max over the rows of F] (:func:`mixture_batch_forwards`)."""
    from scipy.stats import binom

    from specsim.expected import forwards_law

    cdf = np.mean([np.cumsum(forwards_law(law, n_tokens)) for law in laws], axis=0)
    alive = 1.0 - np.clip(cdf[:-1], 0.0, 1.0)  # P(F ≥ s) = 1 − P(F ≤ s − 1), s = 1 … n_tokens
    return binom.pmf(np.arange(int(batch) + 1)[None], int(batch), alive[:, None])


def static_batch_steps(cost: BatchCostModel, tree: Any, occupancy: np.ndarray) -> tuple[float, float, float]:
    """(expected steps, their draft seconds, their verify seconds) of a static batch whose step s runs k rows
    with probability ``occupancy[s, k]`` (:func:`active_rows`): each step priced at the rows it runs, as the
    batched loop pays it (:meth:`BatchCostModel.rows`: its last row too). The step at B rows priced for every
    step read the loop's speculative forward +9…+16% dear at B ≥ 8 on the zoo (vanilla, 64 tokens): the
    rows of a batch of 32 finish ~10 steps apart, and its steps ran 25 rows on average."""
    steps_with = occupancy[:, 1:].sum(0)  # (B,) expected steps run with k = 1 … B rows
    draft = verify = 0.0
    for k, w in enumerate(steps_with, start=1):
        if w > 0:
            at = cost.rows(k)
            draft += w * at.draft_time(tree)
            verify += w * at.tree_verify_time(tree)
    return float(steps_with.sum()), float(draft), float(verify)


def predict_at_batch(cfg: RunConfig, profile: TargetCost | None = None, fit: BatchFit | None = None,
                     tree: Any = None, batch_size: int | None = None, draft_fit: BatchFit | None = None,
                     with_break_even: bool = True, prompt_hists: Sequence[Sequence[int]] | None = None,
                     head_fit: HeadFit | None = None, law: np.ndarray | None = None,
                     draft_s: float | None = None) -> BatchPrediction:
    """The simulator's prediction at ``batch_size`` (default ``cfg.workload.batch_size``) for the measure
    path: τ from ``cfg.method.acceptance`` (pass ``apply_profile(cfg, profile)``'s config for the measured
    one), t(B, n) from the hardware roofline or — with a measured single-row ``profile`` t(n) — that
    profile grown with B by this device's ``fit`` (methods.measurement.batch_cost.load_batch_fit; the
    roofline's growth where None). ``tree``: the exact tree the run used (else the preset's, re-sized at
    B). S(B) compares the batched speculative step with the batched autoregressive step of the same B.
    ``prompt_hists``: calibration's per-prompt histograms of accepted drafts per step for this tree (the
    profile's ``loop_accept_hist_by_prompt``): rows then differ in acceptance (:func:`prompt_laws`) and a
    static batch's length is :func:`mixture_batch_forwards`; without them every row has the one law.
    A static batch's steps are priced at the rows still decoding (:func:`static_batch_steps`).
    ``head_fit``: a head drafter's batched draft step (:class:`HeadFit`).
    A dynamic drafter (EAGLE-2/3) priced on the trees it kept (the one-sequence prediction's pricing,
    methods.measurement.profiles.tree_predictions): ``law`` their accepted-length law (recorded_law; τ, the
    forwards and B* from it, ``tree`` sizing the step), ``draft_s`` its one-sequence draft per step in
    seconds (timed against the loop's chain): the draft at B = 1, grown with B as the target's t(B, 1)
    (:meth:`BatchCostModel.with_draft_step`), or the ``head_fit``'s at B ≥ 2 where one was timed."""
    from specsim.acceptance import from_config
    from specsim.expected import accepted_length_law
    from specsim.run_steps import run_shares

    b = int(cfg.workload.batch_size if batch_size is None else batch_size)
    cost = BatchCostModel.from_config(cfg, profile, fit, draft_fit, head_fit)
    if draft_s is not None:
        cost = cost.with_draft_step(draft_s)
    (_, tau, s, t), = speedup_curve(cfg, [b], cost, tree, law)
    at = cost.at(b)
    step = at.step_time(t)
    b_star = break_even_batch(cfg, cost, tree, law=law) if with_break_even else None
    n = int(cfg.workload.max_new_tokens)
    rows = 1 if getattr(cfg.workload, "continuous", False) else b  # continuous batching refills its rows
    forwards, draft, verify, mean_rows = float(n), at.draft_time(t), at.tree_verify_time(t), float(b)
    if t.depth > 0:
        if law is None:
            law = accepted_length_law(t, from_config(cfg.method.acceptance))
        laws = prompt_laws(prompt_hists, law) if prompt_hists else [law]
        occupancy = active_rows(laws, n, rows)
        if rows > 1:  # a static batch: its last steps run the rows still decoding
            forwards, run_draft, run_verify = static_batch_steps(cost, t, occupancy)
            draft, verify = run_draft / forwards, run_verify / forwards
            mean_rows = float(occupancy[:, 1:].sum(0) @ np.arange(1, rows + 1)) / forwards
        else:
            forwards = float(occupancy[:, 1:].sum())
        if b == 1:  # decoded alone: its last steps draft and verify what their room lets (specsim.run_steps);
            # a batch's rows cut at different steps, priced at the rows still decoding above
            shares = run_shares(at, t, law, n, cfg.method.room_spare)
            draft, verify = draft * shares.draft, verify * shares.verify
    decode = n * at.ar_time / (forwards * (draft + verify)) if t.depth > 0 else 1.0
    return BatchPrediction(b, tau, s, t.size, step, at.ar_time, b / at.ar_time, b * tau / step, b_star,
                           at.target.source, decode, forwards, at.tree_verify_time(t), at.draft_time(t),
                           draft + verify, verify, draft, mean_rows)


def best_budget_by_batch(cfg: RunConfig, batches: Sequence[int] = BATCHES,
                         cost: BatchCostModel | None = None) -> list[dict[str, Any]]:
    """Sequoia's (or a dynamic tree's) optimal tree per sequence at each B: budget (nodes, root included),
    levels, τ and S(B). Sequoia's hardware-aware selection over ``tree.budgets`` prices each budget with
    t(B, budget) and the draft at B; a dynamic tree picks the best of ``tree.budgets`` (capped by its
    total_tokens + 1) under its depth and top_k."""
    from specsim.acceptance import from_config
    from specsim.config import TreeKind
    from specsim.expected import expected_tokens
    from specsim.sequoia import optimal_tree
    from specsim.trees import acceptance_vector, sequoia_choice

    model = from_config(cfg.method.acceptance)
    cost = cost or BatchCostModel.from_config(cfg)
    kind = TreeKind(cfg.tree.kind)
    assert kind in (TreeKind.sequoia, TreeKind.dynamic), f"tree.kind {kind.value}: sized by hand, not by B"
    rows = []
    for b in batches:
        at = cost.at(b)
        if kind == TreeKind.sequoia:
            choice = sequoia_choice(cfg.tree, model, at)
            trees = [choice.tree]
        else:
            k, d = cfg.tree.top_k, cfg.tree.depth
            cap = d + 1 if k == 1 else (k ** (d + 1) - 1) // (k - 1)
            sizes = sorted({min(int(x), cap, cfg.tree.total_tokens + 1) for x in cfg.tree.budgets})
            vec = acceptance_vector(model, k)
            trees = [optimal_tree(vec, m, d + 1).tree for m in sizes]
        scored = [(expected_tokens(t, model) * at.ar_time / at.step_time(t) if t.depth > 0 else 1.0, t)
                  for t in trees]
        s, t = max(scored, key=lambda x: x[0])
        rows.append({"batch_size": int(b), "budget": t.size, "levels": t.depth + 1,
                     "tau": float(expected_tokens(t, model)), "speedup": float(s)})
    return rows


def batch_metrics(cfg: RunConfig, profile: TargetCost | None = None, fit: BatchFit | None = None
                  ) -> dict[str, Any]:
    """task=simulate's keys at workload.batch_size = B > 1: the prediction at B (``predicted_tau`` and
    ``predicted_speedup``: run.py keeps the single-row ones as ``*_batch1``), B*, and the speedup
    curve over :data:`BATCHES` (and, for Sequoia / dynamic trees, the budget chosen at each B)."""
    from specsim.config import TreeKind
    from specsim.predict import NO_DRAFTER

    p = predict_at_batch(cfg, profile, fit)
    cost = BatchCostModel.from_config(cfg, profile, fit)
    curve = speedup_curve(cfg, BATCHES, cost)
    out = p.to_metrics()
    out["tree_size_at_batch"] = out.pop("tree_size")  # simulate's tree_size / tree_parents: the B = 1 tree
    out.update(
               speedup_by_batch={str(b): s for b, _, s, _ in curve},
               tree_size_by_batch={str(b): t.size for b, _, _, t in curve})
    sized = TreeKind(cfg.tree.kind) in (TreeKind.sequoia, TreeKind.dynamic)
    if sized and cfg.method.drafter != NO_DRAFTER:
        rows = best_budget_by_batch(cfg, BATCHES, cost)
        out["budget_by_batch"] = {str(r["batch_size"]): r["budget"] for r in rows}
    return out
