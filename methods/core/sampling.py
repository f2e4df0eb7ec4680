"""Token distributions from logits, and the randomness that verification draws.

`probs` turns logits into the processed distribution — temperature, then top-k, then top-p (nucleus,
Holtzman et al. 2020), the order of transformers' logits warpers — and is applied by the same code to the
target (p) and the draft (q): speculative sampling then reproduces the target's *processed* law.
Verifiers draw through the `Randomness` protocol; `TorchRandomness` wraps a torch.Generator, and the
exact-law tests plug in an enumerator of every random branch instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (one-hot argmax); top_k 0 = off; top_p 1 = off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """(..., V) logits -> (..., V) processed probabilities, rows summing to 1.

    float64 logits give float64 probabilities, anything else float32. temperature 0: one-hot argmax, ties to
    the lowest index. top-k keeps every token tied with the k-th largest (as transformers does). top-p keeps
    the nucleus — the most likely tokens until their mass reaches top_p — and every token tied with its least
    likely member (the top token always). Safe for ±inf and huge logits: they are clamped to the dtype's
    finite range and the row maximum is subtracted before scaling, so +inf logits share the mass and an all
    -inf row becomes uniform. NaN logits are a model bug and propagate.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    big = torch.finfo(dtype).max
    x = logits.to(dtype).clamp(-big, big)  # a new tensor: the in-place ops below never touch `logits`
    if params.temperature == 0:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    # subtract the max before dividing by T (x/T alone overflows for huge logits and small T): z <= 0, max 0
    x -= x.amax(-1, keepdim=True)
    if params.temperature != 1:
        x /= params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x.masked_fill_(x < kth, float("-inf"))
    x.exp_()
    x /= x.sum(-1, keepdim=True)  # sum >= 1 (the max contributes exp(0)): no division by 0
    if params.top_p < 1:
        x.masked_fill_(x < _nucleus_floor(x, params.top_p), 0.0)
        x /= x.sum(-1, keepdim=True)
    return x


def _nucleus_floor(p: Tensor, top_p: float) -> Tensor:
    """(..., 1) probability of the least likely nucleus token. The nucleus is a prefix of the descending
    order, so on CPU a top-k that grows until every row's nucleus ends inside it replaces a full sort of V
    (~50x cheaper at V = 32k; one host sync per try); on accelerators the full sort is cheap and sync-free."""
    V = p.shape[-1]
    k = V if p.device.type != "cpu" else min(V, 64)
    while True:
        top = torch.topk(p, k, dim=-1).values  # (..., k) descending
        inside = top.cumsum(-1) - top < top_p  # mass strictly before each is < top_p: in the nucleus
        if k == V or not bool(inside[..., -1].any()):
            return torch.where(inside, top, torch.inf).amin(-1, keepdim=True)
        k = min(V, 8 * k)


# ---- randomness ------------------------------------------------------------------------------------
@runtime_checkable
class Randomness(Protocol):
    def first_success(self, success: Tensor, then: Tensor, terminal: Sequence[bool]) -> tuple[int, int]:
        """Toss independent coins in order, coin j succeeding with probability success[j] ((k,), clamped
        to [0, 1]); i = index of the first success, k when none. If terminal[i], also draw a token from the
        unnormalised row then[i] ((k+1, V), non-negative) and return (i, token); else return (i, -1).

        Bundling a run of acceptance tests with the draw that ends it lets one verification step cost a
        single host sync, and gives the exact-law tests one primitive to enumerate."""
        ...


@dataclass(frozen=True)
class TorchRandomness:
    """Randomness from a torch.Generator. Uniforms are drawn in float64 on the generator's device and moved
    to the tensors' device, so a CPU generator works with CUDA probabilities (same stream either way).
    Every call consumes k+1 uniforms whatever the outcome, so runs are reproducible per seed."""

    generator: torch.Generator

    def first_success(self, success: Tensor, then: Tensor, terminal: Sequence[bool]) -> tuple[int, int]:
        k = success.shape[0]
        g = self.generator
        u = torch.rand(k + 1, generator=g, device=g.device, dtype=torch.float64).to(then.device)  # (k+1,)
        hit = torch.cat([u[:k] < success, torch.ones(1, dtype=torch.bool, device=then.device)])
        i = hit.int().argmax()  # first True (argmax returns the first maximum); k when no coin succeeded
        tok = inverse_cdf(then[i], u[k])
        i_, tok_ = torch.stack([i, tok]).tolist()  # the one host sync
        return i_, (tok_ if terminal[i_] else -1)


def as_randomness(source: torch.Generator | Randomness) -> Randomness:
    return TorchRandomness(source) if isinstance(source, torch.Generator) else source


def inverse_cdf(row: Tensor, u: Tensor) -> Tensor:
    """Token index for a uniform u in [0, 1) under the unnormalised, non-negative row (V,): the first token
    whose cumulative mass exceeds u·total. Zero-mass tokens are never returned (except for an all-zero row,
    which gives V-1); rounding at the top end falls back to the last token with mass. 0-d long tensor."""
    c = row.cumsum(0)  # (V,)
    x = u.to(c.dtype) * c[-1]
    idx = (c <= x).sum()
    last = row.shape[0] - 1 - (row.flip(0) > 0).int().argmax()
    return torch.minimum(idx, last)


def draw_without_replacement(q: Tensor, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """n draws without replacement from each row of q (..., V) (probabilities, need not be normalised):
    (..., n) token ids in draw order and (..., n) bool, False for the draws beyond a row's support (a row
    with fewer than n tokens of mass; those ids are meaningless). The exponential race: with E_i ~ Exp(1),
    sorting q_i / E_i in descending order is a sequential draw without replacement ∝ q (equivalently,
    Gumbel-top-k on log q). The noise comes from ``generator`` on its own device (a CPU generator works
    with CUDA rows)."""
    e = torch.empty(q.shape, dtype=q.dtype, device=generator.device).exponential_(generator=generator)
    keys, idx = (q / e.to(q.device)).topk(n, dim=-1)
    return idx, keys > 0


def draw_candidates(q: Tensor, n: int, mode: str, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """n candidate children from each row of q (..., V) in a sampled drafting mode: ``with_replacement``
    n i.i.d. draws (all valid), else a draw without replacement (draw_without_replacement: invalid beyond a
    row's support). Returns (..., n) ids and (..., n) bool."""
    if mode == "with_replacement":  # torch.multinomial takes at most 2-D: rows flattened, then restored
        idx = torch.multinomial(q.reshape(-1, q.shape[-1]), n, replacement=True, generator=generator)
        idx = idx.view(*q.shape[:-1], n)
        return idx, torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
    return draw_without_replacement(q, min(n, q.shape[-1]), generator)


def draw(rng: torch.Generator | Randomness, row: Tensor) -> int:
    """One token from the unnormalised, non-negative row (V,)."""
    return as_randomness(rng).first_success(row.new_zeros(0), row[None], (True,))[1]


def sample(prob_row: Tensor, generator: torch.Generator) -> int:
    """One token from a probability row (V,) (need not be normalised), using `generator`."""
    return draw(generator, prob_row)
