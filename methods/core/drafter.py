"""The one Drafter protocol every method implements, and the Draft it proposes.

Loop contract (p = target, q = draft): the committed sequence is x_1..x_t; the target's KV cache holds
x_1..x_{t-1}; the draft tree's root (node 0) is x_t. The loop runs ONE target forward over all tree nodes
(tree attention, positions = t-1 + depth), a config-chosen verifier walks the tree, the accepted path's
KV is committed and the bonus/corrected token becomes the next root. The autoregressive baseline is the
drafter whose tree is the root alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from methods.core.engine import Resume
from specsim.tree import Tree


@dataclass(frozen=True)
class Draws:
    """The laws the draft tokens were drawn from, one row per independent draw (SpecInfer's merged token
    tree of several drafts, Miao et al. 2024): draw j proposed node ``node[j]``'s token from the law
    ``q[j]``, independently of every other draw given the node's parent path. A node proposed by several
    drafts (their shared prefix, merged) has one draw per proposer; every non-root node has at least one.
    At each node the verifier tests its children's draws in draw order — an order fixed before any token
    was drawn (draft by draft), never one that depends on the drawn values."""

    node: torch.Tensor  # (M,) long, node ids in 1..N-1
    q: torch.Tensor  # (M, V) float

    def __post_init__(self) -> None:
        assert self.node.dim() == 1 and self.q.dim() == 2 and self.q.shape[0] == self.node.numel(), (
            f"draws: node {tuple(self.node.shape)} and q {tuple(self.q.shape)} need one row per draw")

    def select(self, keep: list[int]) -> Draws:
        """The draws of the kept nodes (ascending node list), renumbered as ``keep`` renumbers them."""
        index = {old: new for new, old in enumerate(keep)}
        pairs = [(j, index[n]) for j, n in enumerate(self.node.tolist()) if n in index]
        rows = torch.tensor([j for j, _ in pairs], dtype=torch.long, device=self.q.device)
        nodes = torch.tensor([n for _, n in pairs], dtype=torch.long, device=self.node.device)
        return Draws(nodes, self.q[rows])

    def to(self, device: torch.device | str) -> Draws:
        return Draws(self.node.to(device), self.q.to(device))


@dataclass(frozen=True)
class Draft:
    """A proposed draft tree.

    tree:   structure; node 0 is the root (= last committed token).
    tokens: (N,) long, token id of every node; tokens[0] is the root token.
    q:      (N, V) float or None. Row i is the (processed) draft distribution from which the children of
            node i were drawn; rows of leaves are unused. None = deterministic draft (one-hot q: greedy
            drafts, n-gram lookups, top-k expansions), verified by the deterministic rule.
    draws:  None, or the law of every node's own draw(s) (``Draws``): for trees whose siblings come from
            different laws (several draft models, merged). Takes the place of ``q`` for the SpecInfer
            verifier, which then needs no ``q``; the other verifiers ignore it.
    n_verifiable: None = every node may be accepted. Otherwise only nodes 0..n_verifiable-1 form the
            verification tree (closed under ancestors, as parents precede children); the later nodes are
            computed in the same target forward but never accepted (Lookahead's Jacobi branch): their
            target logits come back in ``StepFeedback.logits`` and their KV is dropped.
    resume: None, or (self-drafting on the target's own engine, LayerSkip) the first nodes' residual stream
            after the target's layers [0, E), whose KV the drafter left pending in the target's cache: the
            verify forward continues them from layer E instead of recomputing (methods.core.engine.Resume).
    """

    tree: Tree
    tokens: torch.Tensor
    q: torch.Tensor | None = None
    n_verifiable: int | None = None
    draws: Draws | None = None
    resume: Resume | None = None

    def __post_init__(self) -> None:
        assert self.tokens.dim() == 1 and self.tokens.numel() == self.tree.size, (
            f"tokens {tuple(self.tokens.shape)} do not match tree size {self.tree.size}"
        )
        assert self.q is None or self.q.shape[0] == self.tree.size, "q needs one row per node"
        assert self.n_verifiable is None or 1 <= self.n_verifiable <= self.tree.size, (
            f"n_verifiable {self.n_verifiable} outside 1..{self.tree.size}"
        )
        assert self.draws is None or self.q is None or self.draws.q.shape[-1] == self.q.shape[-1], (
            "draws and q differ in vocabulary size")

    def select(self, tree: Tree, keep: list[int], n_verifiable: int | None = None) -> Draft:
        """The draft restricted to the ascending node list ``keep`` (closed under ancestors), whose tree is
        ``tree``: tokens, q rows and draws follow the renumbering."""
        idx = torch.tensor(keep, device=self.tokens.device)
        q = None if self.q is None else self.q[idx.to(self.q.device)]
        draws = None if self.draws is None else self.draws.select(keep)
        return Draft(tree, self.tokens[idx], q, n_verifiable, draws)

    @property
    def verifiable(self) -> int:
        """How many leading nodes form the verification tree."""
        return self.tree.size if self.n_verifiable is None else self.n_verifiable


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may read when proposing.

    tokens:   (t,) long, all committed tokens (prompt + generated); tokens[-1] is the root.
    hidden:   (t', H) target last-layer hidden states of committed tokens not yet shown to the drafter
              (only when ``needs_hidden_states``), else None.
    generator: the run's torch.Generator (drafters that sample must use it).
    features: (t', k H) outputs of the target's decoder layers ``feature_layers`` (k of them, concatenated
              in that order; HF's ``hidden_states[i + 1]``: the last layer's after the final norm) for the
              same tokens as ``hidden``; None unless the drafter declares ``feature_layers`` (EAGLE-3's
              low/middle/high fusion).
    """

    tokens: torch.Tensor
    hidden: torch.Tensor | None
    generator: torch.Generator
    max_new: int  # tokens the run may still emit; a drafter should not propose deeper than this
    features: torch.Tensor | None = None


@dataclass(frozen=True)
class StepFeedback:
    """What verification decided, given back to the drafter.

    accepted: node indices of the accepted path, root first (len = accepted drafts + 1).
    next_token: the bonus / corrected token (the next root).
    logits: (N, V) float32 raw target logits at every node of the draft (unverifiable nodes included), as
            the verify forward computed them: Lookahead reads its Jacobi branch from them, Online SD the
            target's distributions. A reference, not a copy; valid until the next step.
    """

    draft: Draft
    accepted: tuple[int, ...]
    next_token: int
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class Backbone:
    """A target of the drafter's own, for methods that change the model (Medusa-2 fine-tunes it jointly with
    its heads): the model the method is lossless against, so the run's baseline decodes it too."""

    model: torch.nn.Module
    name: str  # said in metrics.json (``backbone``)


@runtime_checkable
class Drafter(Protocol):
    """Optional attributes: ``feature_layers: tuple[int, ...]`` (default ()): decoder layers whose outputs
    the drafter reads in ``DraftContext.features``; ``backbone: Backbone | None`` (default None): the target
    this drafter decodes against when it is not the run's (methods.drafters.registry.backbone_of);
    ``offline_seconds: float``: cumulative seconds the drafter spent on work between requests (Online SD's
    distillation, run in ``reset``); the loop leaves them out of its timers and reports them as
    ``time_offline_s``. Optional method ``attach(target: ModelEngine)``: self-drafting (LayerSkip, Draft &
    Verify) runs sub-layers of the target on the target's own engine and cache; the loop hands that engine
    over before ``reset``. Such a drafter must leave the engine with no pending node, or exactly the nodes
    its ``Draft.resume`` describes. Optional method ``batched(max_rows: int) -> BatchDrafter | None``: the
    drafter's batched form for methods.core.batch_loop (B sequences at once; None: none in this
    configuration); a drafter without it (or None) is batched per row
    by methods.core.batch_drafter.PerRow (one instance per row, when the drafter's state allows it). Optional
    method ``level_step(width, context, children, generator) -> Callable[[], None]``: one level of the
    drafter's own drafting fed ``width`` rows after ``context`` committed tokens, choosing ``children``
    children per row, on state of its own (calibration times it per width: methods.measurement.calibrate;
    draft-model drafters without it are timed on their draft model's forward). Optional method
    ``with_tree(tree) -> Drafter``: the same one-pass drafter on another tree (calibration times its pass per
    tree: Medusa's heads)."""

    needs_hidden_states: bool

    def reset(self, prompt: torch.Tensor) -> None:
        """Start a new prompt ((t,) long)."""

    def propose(self, ctx: DraftContext) -> Draft:
        """Propose a draft tree rooted at ctx.tokens[-1]."""

    def feedback(self, fb: StepFeedback) -> None:
        """Called after every verification (update caches, online learning, statistics)."""


# ---- batches (methods.core.batch_loop): B sequences decoded at once ---------------------------------------
@dataclass(frozen=True)
class BatchContext:
    """What a batched drafter may read: one ``DraftContext`` per active row (slot order; row b's context is
    exactly what the one-sequence loop would give its drafter, its generator the row's own: the draws of
    one row never shift another's) and the rows' roots (B,) long (host). A batched form that draws for all
    rows at once uses row 0's generator."""

    rows: list[DraftContext]
    roots: torch.Tensor


@dataclass(frozen=True)
class BatchDraft:
    """One draft per active row. tokens (B, n): row b's tree nodes first, then padding (any token; padded
    nodes are computed but never accepted); ``trees``: one Tree per row, or a single tree shared by every row;
    ``drafts``: the rows' own Drafts when they carry more than tokens and tree (q, n_verifiable, draws), else
    None (deterministic drafts: q one-hot)."""

    tokens: torch.Tensor
    trees: list[Tree]
    drafts: list[Draft] | None = None

    @classmethod
    def from_drafts(cls, drafts: list[Draft]) -> BatchDraft:
        tokens = torch.nn.utils.rnn.pad_sequence([d.tokens for d in drafts], batch_first=True)
        return cls(tokens, [d.tree for d in drafts], drafts)

    def tree(self, b: int) -> Tree:
        return self.trees[0] if len(self.trees) == 1 else self.trees[b]

    def row(self, b: int) -> Draft:
        if self.drafts is not None:
            return self.drafts[b]
        tree = self.tree(b)
        return Draft(tree, self.tokens[b, : tree.size])


@dataclass(frozen=True)
class BatchFeedback:
    """What verification decided for every active row (slot order): ``row(b)`` is row b's StepFeedback."""

    draft: BatchDraft
    accepted: list[tuple[int, ...]]
    next_tokens: list[int]
    logits: torch.Tensor  # (B, n, V) raw target logits, padding columns included

    def row(self, b: int) -> StepFeedback:
        d = self.draft.row(b)
        return StepFeedback(d, self.accepted[b], self.next_tokens[b], self.logits[b, : d.tree.size])


@runtime_checkable
class BatchDrafter(Protocol):
    """A drafter over the rows of a batch (slots 0..B-1, as methods.core.batch_engine.BatchEngine keeps
    them): ``join`` appends new rows at the end (their prompts (t,) long), ``leave(slot)`` removes a row and
    moves the last row into its slot, ``propose_batch`` proposes for every active row, ``feedback_batch``
    reports every row's verification. ``needs_hidden_states``: rows' contexts carry the target's hidden
    states; optional ``feature_layers`` (default ()): rows' contexts carry those decoder layers' outputs in
    ``DraftContext.features`` (both as for Drafter; the batched target forward returns them for all rows)."""

    needs_hidden_states: bool

    def join(self, prompts: list[torch.Tensor]) -> None: ...

    def leave(self, slot: int) -> None: ...

    def propose_batch(self, ctx: BatchContext) -> BatchDraft: ...

    def feedback_batch(self, fb: BatchFeedback) -> None: ...


def leave_slot(rows: list, slot: int):
    """A batch's per-row list after row ``slot`` left (BatchDrafter.leave's order: the last row moves into
    its slot); returns the item that left."""
    gone, last = rows[slot], rows.pop()
    if slot < len(rows):
        rows[slot] = last
    return gone


def root_only(root_token: int, device: torch.device | str = "cpu") -> Draft:
    """The empty proposal: the autoregressive step."""
    return Draft(Tree.chain(0), torch.tensor([root_token], dtype=torch.long, device=device))
