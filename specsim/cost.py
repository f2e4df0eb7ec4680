"""Step-time model of speculative decoding: t_step = t_draft + t(n), speedup S = k̄ · t_AR / t_step.

t(n) is the target p's verify forward over n tree tokens, from a roofline (weights and KV over memory
bandwidth vs 2·params·n FLOPs, a fixed overhead, PCIe streaming when offloaded: Sequoia, Chen et al. 2024)
or a measured table. The draft q costs ρ·t(1) per draft step (Leviathan et al. 2023) or its own roofline.
For a chain with flat t(n) this is Leviathan's S = k̄ / (1 + γρ). Self-speculation (LayerSkip, Draft &
Verify) has no separate draft model: ρ is the share of the target's layers a draft step runs (E / L), and
with LayerSkip's shared cache the verify pass skips layers [0, E) for the m nodes the draft fed: it costs
(1 - ρ_v)·t(n) + ρ_v·t(n - m) instead of t(n) (ρ_v = E / L). Calibrated on a device (a measured profile),
the draft step's cost is timed (not E / L) and the shared-cache saving is the timed difference between the
full verify forward and the resumed one (``verify_saving``, in t_AR units).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import numpy as np

from specsim.config import HardwareConfig, ModelConfig, RunConfig, TreeKind
from specsim.tree import Tree


@runtime_checkable
class TargetCost(Protocol):
    source: str

    def time(self, n: int | np.ndarray) -> float | np.ndarray:
        """Seconds of one forward over n new tokens (n >= 1)."""
        ...


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs to know about a transformer."""

    params: float
    bytes_per_param: float
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int

    @classmethod
    def target(cls, m: ModelConfig) -> ModelShape:
        return cls(m.params, m.bytes_per_param, m.n_layers, m.hidden_size, m.n_heads, m.n_kv_heads)

    @classmethod
    def draft(cls, m: ModelConfig) -> ModelShape:
        """The draft model (``draft_params``…); its heads keep the target's head dimension."""
        heads = max(1, round(m.draft_hidden_size / (m.hidden_size / m.n_heads)))
        return cls(m.draft_params, m.bytes_per_param, m.draft_n_layers, m.draft_hidden_size, heads, heads)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token over all layers: 2 · layers · kv_heads · head_dim · bytes."""
        head_dim = self.hidden_size / self.n_heads
        return 2.0 * self.n_layers * self.n_kv_heads * head_dim * self.bytes_per_param


@dataclass(frozen=True)
class Roofline:
    """t(n) = overhead + max(memory time, compute time, PCIe time).

    memory  = (weight bytes + KV bytes of the context) / (bandwidth · efficiency)
    compute = (2 · params · n + 4 · layers · hidden · n · (context + n)) / (FLOP/s · efficiency); the second
              term is attention (QKᵀ and AV) of the n new tokens over the context and the tree itself
    PCIe    = weight bytes / PCIe bandwidth when the weights are offloaded (streamed every forward,
              overlapped with compute layer by layer, hence a max and not a sum)
    """

    model: ModelShape
    bandwidth: float  # bytes/s achieved
    flops: float  # FLOP/s achieved
    overhead_s: float
    context_tokens: int = 0
    pcie: float = 0.0  # bytes/s; 0 = weights resident in device memory
    source: str = "roofline"

    @classmethod
    def from_config(cls, hw: HardwareConfig, model: ModelShape, context_tokens: int) -> Roofline:
        assert not hw.offload or hw.pcie_gbs > 0, f"hardware {hw.name}: offload needs pcie_gbs > 0"
        return cls(
            model=model,
            bandwidth=hw.memory_bandwidth_gbs * 1e9 * hw.bandwidth_efficiency,
            flops=hw.peak_tflops * 1e12 * hw.flops_efficiency,
            overhead_s=hw.overhead_ms * 1e-3,
            context_tokens=context_tokens,
            pcie=hw.pcie_gbs * 1e9 if hw.offload else 0.0,
        )

    def time(self, n: int | np.ndarray) -> float | np.ndarray:
        n = np.asarray(n, dtype=float)
        m = self.model
        memory = (m.weight_bytes + m.kv_bytes_per_token * self.context_tokens) / self.bandwidth
        attention = 4.0 * m.n_layers * m.hidden_size * n * (self.context_tokens + n)
        compute = (2.0 * m.params * n + attention) / self.flops
        pcie = m.weight_bytes / self.pcie if self.pcie > 0 else 0.0
        t = self.overhead_s + np.maximum(np.maximum(memory, compute), pcie)
        return float(t) if t.ndim == 0 else t


@dataclass(frozen=True)
class MeasuredCost:
    """t(n) from a measured table (n → seconds). Linear interpolation in n: a roofline is piecewise
    linear (flat, then proportional to n), which log-log interpolation would bend. Below the smallest
    measured n the first time is used; above the largest, the last segment's slope (never negative)."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    source: str = "measured"

    def __post_init__(self) -> None:
        order = np.argsort(self.tokens)
        object.__setattr__(self, "tokens", tuple(int(self.tokens[i]) for i in order))
        object.__setattr__(self, "seconds", tuple(float(self.seconds[i]) for i in order))
        assert self.tokens and len(self.tokens) == len(self.seconds), "need matching, non-empty n and t"
        assert len(set(self.tokens)) == len(self.tokens), "duplicate n in the measured table"

    @classmethod
    def from_mapping(cls, table: Mapping[int, float]) -> MeasuredCost:
        return cls(tuple(int(k) for k in table), tuple(float(v) for v in table.values()))

    def time(self, n: int | np.ndarray) -> float | np.ndarray:
        x, y = np.asarray(self.tokens, float), np.asarray(self.seconds, float)
        n = np.asarray(n, dtype=float)
        t = np.interp(n, x, y)
        if len(x) > 1:
            slope = max(0.0, (y[-1] - y[-2]) / (x[-1] - x[-2]))
            t = np.where(n > x[-1], y[-1] + slope * (n - x[-1]), t)
        return float(t) if np.ndim(t) == 0 else t


@dataclass(frozen=True)
class DraftCost:
    """Drafting time per speculation step. Either ρ · t(1) per draft step (``ratio``, Leviathan's c) or
    the draft model's own t_q (``model``; a step over a tree level of w nodes costs t_q(w)). Draft steps:
    one per tree level below the root (a chain of γ drafts takes γ steps) or a single pass (``one_pass``:
    Medusa heads, MTP). Plus ``fixed_ratio`` · t(1) per step with drafts (drafter bookkeeping).
    Staged SD (Spector & Ré 2023) speculates the draft model itself: a second stage proposes, the draft
    model checks ``tokens_per_forward`` levels per forward on average, so the per-level steps are divided
    by it (its own lookups go into ``fixed_ratio``). Plus ``node_ratio`` · t(1) per drafted node below the
    root (the drafter's bookkeeping per node: tree masks, positions, the candidates' choice), calibrated
    from the drafter's loop on trees of several shapes (methods.measurement.profiles.draft_terms)."""

    ratio: float = 0.0
    fixed_ratio: float = 0.0
    one_pass: bool = False
    model: TargetCost | None = None
    tokens_per_forward: float = 1.0
    # a level's width = the nodes of the level above that have children (what a draft model is fed; a
    # measured per-width table, methods.measurement.profiles.draft_levels), else every node of that level
    fed_width: bool = False
    node_ratio: float = 0.0

    def widths(self, tree: Tree) -> list[int]:
        if self.one_pass:
            return [1]
        if self.fed_width:
            fed = np.zeros(tree.size, dtype=bool)
            fed[[p for p in tree.parents[1:]]] = True
            return np.bincount(tree.depths[fed], minlength=tree.depth)[: tree.depth].tolist()
        return tree.level_sizes()[: tree.depth].tolist()

    def time(self, tree: Tree, t1: float) -> float:
        if tree.depth == 0:
            return 0.0  # nothing drafted: plain decoding
        widths = self.widths(tree)
        if self.model is None:
            steps = self.ratio * t1 * len(widths)
        else:
            steps = float(np.sum(self.model.time(np.asarray(widths))))
        return steps / self.tokens_per_forward + (self.fixed_ratio + self.node_ratio * (tree.size - 1)) * t1

    def per_node(self, t1: float) -> float:
        """The draft's time per drafted node (beyond its levels and its constant per step)."""
        return self.node_ratio * t1

    def per_depth(self, t1: float) -> tuple[float, float]:
        """(time per draft step, constant per speculation step) in the form Sequoia's selection uses
        (draft_time · d + target_time); the draft model is charged t_q(1) per step (narrow levels)."""
        step = self.ratio * t1 if self.model is None else float(self.model.time(1))
        step /= self.tokens_per_forward
        fixed = self.fixed_ratio * t1
        return (0.0, fixed + step) if self.one_pass else (step, fixed)


@dataclass(frozen=True)
class CostModel:
    """``verify_extra`` tokens ride on every speculation step's verify forward beyond the priced tree
    (Lookahead's Jacobi branch and further candidates: the forward costs t(tree size + verify_extra))."""

    target: TargetCost
    draft: DraftCost
    verify_extra: int = 0
    verify_reuse: float = 0.0  # ρ_v: share of the layers the draft already ran for the nodes it fed
    verify_saving: float = 0.0  # calibrated: the measured shared-cache saving per step / t_AR (replaces ρ_v)
    # the nodes the draft feeds where they are not the verified tree's: a dynamic tree (EAGLE-2) expands its
    # top_k best nodes at each of its depth levels, then keeps total_tokens of them for verification
    draft_tree: Tree | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig, profile: TargetCost | None = None,
                    draft_levels: TargetCost | None = None) -> CostModel:
        """Roofline of hardware × model (or the measured ``profile``) and the method's draft cost.
        ``method.draft_cost == "roofline"`` prices the draft with the draft model's roofline; a measured
        ``draft_levels`` (seconds of one draft level fed w nodes) prices each level by its width."""
        target = profile or Roofline.from_config(
            cfg.hardware, ModelShape.target(cfg.model), cfg.workload.context_tokens
        )
        m = cfg.method
        draft_model = None
        if m.draft_cost == "roofline":  # the draft stays in device memory even when the target is offloaded
            resident = replace(cfg.hardware, offload=False)
            context = cfg.workload.context_tokens
            draft_model = Roofline.from_config(resident, ModelShape.draft(cfg.model), context)
        one = m.draft_steps == "one"
        per_forward = m.draft_tokens_per_forward
        draft = DraftCost(m.draft_cost_ratio, m.draft_fixed_ratio, one, draft_model, per_forward,
                          node_ratio=m.draft_node_ratio)
        if draft_levels is not None and not one:
            draft = replace(draft, model=draft_levels, fed_width=True)
        dynamic = TreeKind(cfg.tree.kind) == TreeKind.dynamic
        expands = Tree.beams(cfg.tree.top_k, cfg.tree.depth) if dynamic else None
        return cls(target, draft, m.verify_extra_tokens, m.verify_reuse_ratio, m.verify_saving_ratio, expands)

    @property
    def ar_time(self) -> float:
        """t_AR: one autoregressive token = a forward over 1 token."""
        return float(self.target.time(1))

    def verify_time(self, n: int | Sequence[int] | np.ndarray) -> float | np.ndarray:
        return self.target.time(np.asarray(n))

    def tree_verify_time(self, tree: Tree) -> float:
        """The verify pass of ``tree``: t(n), or with a shared cache (ρ_v > 0) the draft's layers [0, E) of
        the m nodes it fed (those with children) reused: (1 - ρ_v)·t(n) + ρ_v·t(n - m). A calibrated saving
        (``verify_saving``, measured on the device) replaces the arithmetic: t(n) - saving·t_AR."""
        full = float(self.verify_time(self.verify_tokens(tree)))
        if tree.depth == 0:
            return full
        if self.verify_saving > 0:
            return max(0.0, full - self.verify_saving * self.ar_time)
        if self.verify_reuse <= 0:
            return full
        fresh = self.verify_tokens(tree) - sum(1 for kids in tree.children if kids)  # not run by the draft
        return (1 - self.verify_reuse) * full + self.verify_reuse * float(self.verify_time(fresh))

    def draft_time(self, tree: Tree) -> float:
        """The draft of a step over ``tree``: its levels, or the dynamic drafter's expansion (``draft_tree``),
        which runs every level whatever the kept tree's depth (the zoo's: 3 levels fed 1, 4, 4 nodes for a
        kept tree 2 deep, priced as 2 levels before: EAGLE-2/3's draft term +8…+28% in validation)."""
        fed = self.draft_tree if self.draft_tree is not None and tree.depth > 0 else tree
        return self.draft.time(fed, self.ar_time)

    def verify_tokens(self, tree: Tree) -> int:
        """Tokens of the verify forward of a speculation step over ``tree`` (the root alone: no extras)."""
        return tree.size + (self.verify_extra if tree.depth > 0 else 0)

    def step_time(self, tree: Tree) -> float:
        return self.draft_time(tree) + self.tree_verify_time(tree)

    def speedup(self, tree: Tree, expected: float) -> float:
        """S = k̄ · t_AR / (t_draft + t(tree size))."""
        return expected * self.ar_time / self.step_time(tree)
