"""The autoregressive baseline as a drafter: it proposes the root alone (no draft tokens), so the shared loop
runs one target forward per token and the next token is the target's own. Same loop and timers as every
speculative method, which makes the measured speedup an apples-to-apples ratio."""

from __future__ import annotations

import torch

from methods.core.drafter import BatchContext, BatchDraft, BatchFeedback, Draft, DraftContext, StepFeedback
from specsim.config import MethodConfig
from specsim.tree import Tree


class Autoregressive:
    needs_hidden_states = False

    def __init__(self) -> None:
        self._root = Tree.chain(0)

    @classmethod
    def from_config(cls, method: MethodConfig, tree: Tree | None, models, sampling) -> Autoregressive:
        return cls()

    def reset(self, prompt: torch.Tensor) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Draft:
        return Draft(self._root, ctx.tokens[-1:])

    def feedback(self, fb: StepFeedback) -> None:
        pass

    def batched(self, max_rows: int) -> BatchAutoregressive:
        return BatchAutoregressive()


class BatchAutoregressive:
    """Every row proposes its root alone: one (B, 1) tensor, no per-row work."""

    needs_hidden_states = False

    def __init__(self) -> None:
        self._root = [Tree.chain(0)]

    def join(self, prompts: list[torch.Tensor]) -> None:
        pass

    def leave(self, slot: int) -> None:
        pass

    def propose_batch(self, ctx: BatchContext) -> BatchDraft:
        return BatchDraft(ctx.roots[:, None], self._root)

    def feedback_batch(self, fb: BatchFeedback) -> None:
        pass
