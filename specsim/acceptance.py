"""Acceptance models: how likely the target p accepts each draft token of a tree (draft q).

One interface for the tree math: ``prob(depth, rank)`` = P(the child of sibling rank ``rank`` (0-based,
sampling order) at ``depth`` (root at 0, so draft nodes have depth >= 1) is the accepted one | its parent
was accepted). Siblings are mutually exclusive, so the ranks' probabilities of one node sum to <= 1.
Models: i.i.d. α (Leviathan et al. 2023), per-depth α_d (power decay or a measured table), and Sequoia's
positional vector ``[0, p_1, …, p_W, p_none]`` (Chen et al. 2024), the layout used everywhere — one for all
depths, or one per depth for drafters whose depth-d proposals come from a different predictor (Medusa's head
d, MTP modules).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from specsim.config import AcceptanceConfig, AcceptanceKind


@runtime_checkable
class AcceptanceModel(Protocol):
    kind: str

    def prob(self, depth: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """Marginal P(child of this rank at this depth is accepted | parent accepted); broadcasts."""
        ...

    def sample_ranks(self, depth: np.ndarray, max_rank: int, rng: np.random.Generator) -> np.ndarray:
        """Simulate one verification per entry of ``depth``: the accepted rank among ``max_rank``
        candidates, or ``max_rank`` when none of them is accepted. Monte Carlo uses it."""
        ...

    def positional_vector(self, width: int) -> np.ndarray:
        """Sequoia's layout ``[0, p_1, …, p_W, p_none]`` (depth-1 view for per-depth models)."""
        ...


class _TrialsModel:
    """Shared maths of the models where each sibling is tried in turn and succeeds with α_d.

    An i.i.d. α applied to a tree means: the drafted children of a node are verified one after another in
    sampling order and each succeeds independently with α_d (the residual after a rejection is as good as
    the original, an idealisation of SpecInfer/Sequoia's multi-step verification). So the child of rank
    r (0-based) is the accepted one with α_d (1 − α_d)^r. For a chain (rank 0 only) this is plain α_d.
    """

    kind = "trials"

    def alpha_at(self, depth: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def prob(self, depth: np.ndarray, rank: np.ndarray) -> np.ndarray:
        a = self.alpha_at(np.asarray(depth))
        return a * (1.0 - a) ** np.asarray(rank)

    def sample_ranks(self, depth: np.ndarray, max_rank: int, rng: np.random.Generator) -> np.ndarray:
        a = self.alpha_at(np.asarray(depth))  # (S,)
        trials = rng.random((a.shape[0], max_rank)) < a[:, None]  # (S, R) Bernoulli successes
        first = np.argmax(trials, axis=1)
        return np.where(trials.any(axis=1), first, max_rank)

    def positional_vector(self, width: int) -> np.ndarray:
        p = self.prob(np.ones(width, dtype=np.int64), np.arange(width))
        return np.concatenate([[0.0], p, [max(0.0, 1.0 - p.sum())]])


@dataclass(frozen=True)
class IIDAcceptance(_TrialsModel):
    """Every draft token is accepted with the same α."""

    alpha: float
    kind = "iid"

    def __post_init__(self) -> None:
        assert 0.0 <= self.alpha <= 1.0, f"alpha must be in [0, 1], got {self.alpha}"

    def alpha_at(self, depth: np.ndarray) -> np.ndarray:
        return np.full(np.shape(depth), float(self.alpha))


@dataclass(frozen=True)
class PowerAcceptance(_TrialsModel):
    """Per-depth curve α_d = α · decay^(d−1): drafts get worse the further they look ahead."""

    alpha: float
    decay: float = 1.0
    kind = "power"

    def __post_init__(self) -> None:
        assert 0.0 <= self.alpha <= 1.0 and 0.0 < self.decay <= 1.0, "need alpha in [0,1], decay in (0,1]"

    def alpha_at(self, depth: np.ndarray) -> np.ndarray:
        d = np.maximum(np.asarray(depth), 1)
        return self.alpha * self.decay ** (d - 1.0)


@dataclass(frozen=True)
class TableAcceptance(_TrialsModel):
    """Measured per-depth α_d: ``by_depth[d-1]``; depths past the table repeat its last entry."""

    by_depth: tuple[float, ...]
    kind = "table"

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_depth", tuple(float(a) for a in self.by_depth))
        assert self.by_depth and all(0.0 <= a <= 1.0 for a in self.by_depth), "by_depth entries in [0, 1]"

    def alpha_at(self, depth: np.ndarray) -> np.ndarray:
        table = np.asarray(self.by_depth)
        return table[np.clip(np.asarray(depth) - 1, 0, len(table) - 1)]


@dataclass(frozen=True)
class PositionalAcceptance:
    """Sequoia's positional model: the i-th child in sampling order is the accepted one with p_i, at
    every depth; ranks past W are never accepted. ``vector = [0, p_1, …, p_W, p_none]``."""

    vector: tuple[float, ...]
    kind = "vector"

    def __post_init__(self) -> None:
        v = tuple(float(x) for x in np.asarray(self.vector, dtype=float).ravel())
        object.__setattr__(self, "vector", v)
        assert len(v) >= 3, "layout is [0, p_1, …, p_W, p_none]"
        assert all(x >= 0 for x in v), "acceptance probabilities must be >= 0"
        assert sum(v[1:-1]) <= 1 + 1e-6, f"p_1..p_W sum to {sum(v[1:-1]):.6f} > 1"

    @property
    def width(self) -> int:
        """W, the number of ranks with an acceptance probability."""
        return len(self.vector) - 2

    @property
    def ranks(self) -> np.ndarray:
        """(W,) p_1..p_W: the probability of 0-based rank r is ``ranks[r]``."""
        return np.asarray(self.vector[1:-1])

    def prob(self, depth: np.ndarray, rank: np.ndarray) -> np.ndarray:
        rank = np.asarray(rank)
        padded = np.concatenate([self.ranks, [0.0]])  # rank >= W maps to the trailing 0
        return padded[np.minimum(rank, self.width)] * np.ones(np.shape(depth))

    def sample_ranks(self, depth: np.ndarray, max_rank: int, rng: np.random.Generator) -> np.ndarray:
        p = np.concatenate([self.ranks, [max(0.0, 1.0 - self.ranks.sum())]])  # last outcome: none
        r = rng.choice(len(p), size=np.shape(depth), p=p / p.sum())
        return np.where(r < min(max_rank, self.width), r, max_rank)

    def positional_vector(self, width: int | None = None) -> np.ndarray:
        if width is None or width == self.width:
            return np.asarray(self.vector)
        p = np.concatenate([self.ranks, np.zeros(max(0, width - self.width))])[:width]
        return np.concatenate([[0.0], p, [max(0.0, 1.0 - p.sum())]])


@dataclass(frozen=True)
class DepthVectorAcceptance:
    """A positional vector per depth: ``vectors[d-1] = [0, p_1(d), …, p_W(d), p_none(d)]``; depths past the
    table repeat its last vector. Measured for Medusa one head at a time (methods.measurement.calibrate):
    head d proposes the depth-d children, and a later head is right less often than the first."""

    vectors: tuple[tuple[float, ...], ...]
    kind = "depth_vector"

    def __post_init__(self) -> None:
        levels = tuple(PositionalAcceptance(tuple(v)) for v in self.vectors)  # validates each layout
        assert levels, "need at least one depth's vector"
        width = max(m.width for m in levels)
        object.__setattr__(self, "vectors", tuple(tuple(m.positional_vector(width)) for m in levels))
        # (D, W + 1): p_1..p_W of each depth, then a 0 column that ranks >= W map to
        object.__setattr__(self, "_table", np.array([[*v[1:-1], 0.0] for v in self.vectors]))

    @property
    def width(self) -> int:
        return len(self.vectors[0]) - 2

    def _rows(self, depth: np.ndarray) -> np.ndarray:
        return np.clip(np.asarray(depth) - 1, 0, len(self.vectors) - 1)

    def prob(self, depth: np.ndarray, rank: np.ndarray) -> np.ndarray:
        depth, rank = np.broadcast_arrays(np.asarray(depth), np.asarray(rank))
        return self._table[self._rows(depth), np.minimum(rank, self.width)]

    def sample_ranks(self, depth: np.ndarray, max_rank: int, rng: np.random.Generator) -> np.ndarray:
        p = self._table[self._rows(depth), : self.width]  # (S, W)
        cdf = np.cumsum(p, axis=-1)
        u = rng.random(p.shape[:-1])  # (S,)
        r = (u[..., None] >= cdf).sum(-1)  # first rank whose cumulative mass exceeds u; W = none
        return np.where(r < min(max_rank, self.width), r, max_rank)

    def positional_vector(self, width: int | None = None) -> np.ndarray:
        """The depth-1 vector (what Sequoia's DP, which assumes one vector for all depths, is given)."""
        return PositionalAcceptance(self.vectors[0]).positional_vector(width)


AcceptanceLike = AcceptanceModel | Sequence[float] | np.ndarray


def as_acceptance(acceptance: AcceptanceLike) -> AcceptanceModel:
    """A model as is; a raw list/array is read as a Sequoia vector ``[0, p_1, …, p_W, p_none]``."""
    if isinstance(acceptance, AcceptanceModel):
        return acceptance
    return PositionalAcceptance(tuple(np.asarray(acceptance, dtype=float).ravel()))


def from_config(cfg: AcceptanceConfig) -> AcceptanceModel:
    """The model a method's ``acceptance`` group describes."""
    kind = AcceptanceKind(cfg.kind)
    if kind == AcceptanceKind.vector:
        return PositionalAcceptance(tuple(cfg.vector))
    if kind == AcceptanceKind.depth_vector:
        return DepthVectorAcceptance(tuple(tuple(v) for v in cfg.by_depth_vectors))
    if kind == AcceptanceKind.table:
        return TableAcceptance(tuple(cfg.by_depth))
    if kind == AcceptanceKind.power:
        return PowerAcceptance(cfg.alpha, cfg.decay)
    return IIDAcceptance(cfg.alpha)
