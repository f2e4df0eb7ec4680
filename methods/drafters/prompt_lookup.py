"""Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``): the draft is the
continuation of an earlier occurrence of the context's last n-gram (n = max_ngram_size down to 1), up to
num_pred_tokens tokens, in prompt + generated text. Deterministic chain (q one-hot, Draft.q = None).
Departure from transformers: the MOST RECENT earlier match is used (transformers takes the first); recent
text tends to predict the continuation better and it is what the brief of this project asks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from methods.core.drafter import (
    BatchContext,
    BatchDraft,
    BatchFeedback,
    Draft,
    DraftContext,
    StepFeedback,
    leave_slot,
)
from specsim.config import MethodConfig
from specsim.tree import Tree


@dataclass(frozen=True)
class LookupParams:
    max_ngram_size: int = 3
    num_pred_tokens: int = 10
    min_ngram_size: int = 1

    @classmethod
    def from_method(cls, method: MethodConfig, tree: Tree | None) -> LookupParams:
        known = set(cls.__dataclass_fields__)
        unknown = set(method.params) - known
        if unknown:
            raise ValueError(f"method.params: unknown prompt_lookup keys {sorted(unknown)}; "
                             f"allowed {sorted(known)}")
        params = {k: int(v) for k, v in method.params.items()}
        if "num_pred_tokens" not in params and tree is not None and tree.depth > 0:
            params["num_pred_tokens"] = tree.depth
        out = cls(**params)
        if not 1 <= out.min_ngram_size <= out.max_ngram_size or out.num_pred_tokens < 1:
            raise ValueError("prompt_lookup: need 1 <= min_ngram_size <= max_ngram_size and "
                             f"num_pred_tokens >= 1, got {out}")
        return out


class NgramIndex:
    """The lookup, incrementally: for each n in [min_ngram_size, max_ngram_size], the end of the most recent
    occurrence of every n-gram that has a successor, updated with the tokens appended since the last call —
    O(new tokens) per decode step instead of a scan of the whole context (same answers as the scan: tested
    against one in tests/methods/test_prompt_lookup.py). Successive contexts are prefix views of one growing
    buffer (the decode loop's committed tokens); another buffer, or a shorter context, starts it over."""

    def __init__(self, params: LookupParams) -> None:
        self.params = params
        self.reset()

    def reset(self) -> None:
        self.seq: list[int] = []  # the context seen so far
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram → end (exclusive) of its latest occurrence
        self.source = 0  # data_ptr of the token buffer the context is a prefix view of

    def continuation(self, tokens: torch.Tensor) -> list[int]:
        """The continuation (≤ num_pred_tokens ids) of ``tokens`` ((t,) long, host), [] when none."""
        t, p = tokens.numel(), self.params
        if t < len(self.seq) or tokens.data_ptr() != self.source:
            self.reset()  # not a longer view of the buffer indexed so far (the decode loop's): start over
            self.source = tokens.data_ptr()
        indexed = len(self.seq)  # n-grams ending (exclusive) before the known context's end are in ``ends``
        self.seq += tokens[indexed:t].tolist()
        seq, ends = self.seq, self.ends
        for end in range(indexed, t):  # an n-gram ending before t has a successor
            for n in range(p.min_ngram_size, min(p.max_ngram_size, end) + 1):
                ends[tuple(seq[end - n : end])] = end
        for n in range(min(p.max_ngram_size, t - 1), p.min_ngram_size - 1, -1):
            start = ends.get(tuple(seq[t - n :]))
            if start is not None:
                return seq[start : start + p.num_pred_tokens]
        return []


class PromptLookup:
    needs_hidden_states = False

    def __init__(self, params: LookupParams) -> None:
        self.params = params
        self.index = NgramIndex(params)
        self._chains: dict[int, Tree] = {}

    @classmethod
    def from_config(cls, method: MethodConfig, tree: Tree | None, models, sampling) -> PromptLookup:
        return cls(LookupParams.from_method(method, tree))

    def reset(self, prompt: torch.Tensor) -> None:
        self.index.reset()

    def propose(self, ctx: DraftContext) -> Draft:
        cont = self.index.continuation(ctx.tokens)[: max(ctx.max_new, 0)]
        gamma = len(cont)
        if gamma not in self._chains:
            self._chains[gamma] = Tree.chain(gamma)
        return Draft(self._chains[gamma], torch.tensor([int(ctx.tokens[-1]), *cont], dtype=torch.long))

    def feedback(self, fb: StepFeedback) -> None:
        pass

    def batched(self, max_rows: int) -> BatchPromptLookup:
        return BatchPromptLookup(self)


class BatchPromptLookup:
    """One n-gram index per row, looked up on the host row by row (cheap: O(new tokens) each)."""

    needs_hidden_states = False

    def __init__(self, one: PromptLookup) -> None:
        self.one = one
        self.rows: list[NgramIndex] = []

    def join(self, prompts: list[torch.Tensor]) -> None:
        self.rows += [NgramIndex(self.one.params) for _ in prompts]

    def leave(self, slot: int) -> None:
        leave_slot(self.rows, slot)

    def propose_batch(self, ctx: BatchContext) -> BatchDraft:
        drafts = []
        for index, c in zip(self.rows, ctx.rows):
            self.one.index = index
            drafts.append(self.one.propose(c))
        return BatchDraft.from_drafts(drafts)

    def feedback_batch(self, fb: BatchFeedback) -> None:
        pass
