"""The batched form of a drafter (methods.core.drafter.BatchDrafter), and the per-row default.

A drafter with a batched path says so with ``batched(max_rows)`` (the autoregressive baseline, the draft
model on its own BatchEngine, prompt lookup, Medusa's heads on the batch's hidden states, MTP's modules and
the EAGLE-1/2/3 head over the rows); ``batched`` returning None means "not in this configuration" (sampled
EAGLE candidates): per row. Any other drafter
whose state is its own (no shared engine with the target: not ``attach``) is batched by ``PerRow``: one
instance per row, built by a factory, proposing one after the other — correct, not faster than B drafters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from methods.core.drafter import BatchContext, BatchDraft, BatchDrafter, BatchFeedback, Drafter, leave_slot


class PerRow:
    """One drafter instance per active row; instances of rows that left are reused (``reset``) by rows that
    join. ``make()`` builds a fresh instance (the run's drafter is the first)."""

    def __init__(self, first: Drafter, make: Callable[[], Drafter]):
        if getattr(first, "attach", None) is not None:
            raise ValueError(f"{type(first).__name__} drafts on the target's own engine (attach): it cannot "
                             "run per row of a batch")
        self.needs_hidden_states = bool(getattr(first, "needs_hidden_states", False))
        self.feature_layers = tuple(getattr(first, "feature_layers", ()))
        self.make = make
        self.rows: list[Drafter] = []
        self._free: list[Drafter] = [first]

    def join(self, prompts: list[torch.Tensor]) -> None:
        for prompt in prompts:
            d = self._free.pop() if self._free else self.make()
            d.reset(prompt)
            self.rows.append(d)

    def leave(self, slot: int) -> None:
        self._free.append(leave_slot(self.rows, slot))

    def propose_batch(self, ctx: BatchContext) -> BatchDraft:
        return BatchDraft.from_drafts([d.propose(c) for d, c in zip(self.rows, ctx.rows)])

    def feedback_batch(self, fb: BatchFeedback) -> None:
        for b, d in enumerate(self.rows):
            d.feedback(fb.row(b))


def batched(drafter: Drafter, max_rows: int, make: Callable[[], Drafter] | None = None) -> BatchDrafter:
    """The drafter's own batched form (where its ``batched`` gives one), or ``PerRow`` over instances from
    ``make``."""
    own = getattr(drafter, "batched", None)
    form = own(max_rows) if own is not None else None
    if form is not None:
        return form
    if make is None:
        raise ValueError(f"{type(drafter).__name__} has no batched form; give a factory for one per row")
    return PerRow(drafter, make)
