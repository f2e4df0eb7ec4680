"""Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``): the draft is the
continuation of an earlier occurrence of the context's last n-gram (n = max_ngram_size down to 1), up to
num_pred_tokens tokens, in prompt + generated text. Deterministic chain (q one-hot, Draft.q = None).
Departure from transformers: the MOST RECENT earlier match is used (transformers takes the first); recent
text tends to predict the continuation better and it is what the brief of this project asks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from methods.drafter import Draft, DraftContext, StepFeedback
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


def find_continuation(tokens: torch.Tensor, params: LookupParams) -> torch.Tensor:
    """(k,) continuation of the most recent earlier occurrence of the longest matching suffix n-gram of
    ``tokens`` ((t,) long, host), k ≤ num_pred_tokens; empty when nothing matches."""
    t = tokens.numel()
    for n in range(min(params.max_ngram_size, t - 1), params.min_ngram_size - 1, -1):
        windows = tokens[: t - 1].unfold(0, n, 1)  # (t-n, n): every n-gram that has a successor
        hits = (windows == tokens[t - n :]).all(-1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start : start + params.num_pred_tokens]
    return tokens[:0]


class PromptLookup:
    needs_hidden_states = False

    def __init__(self, params: LookupParams) -> None:
        self.params = params
        self._chains: dict[int, Tree] = {}

    @classmethod
    def from_config(cls, method: MethodConfig, tree: Tree | None, models, sampling) -> PromptLookup:
        return cls(LookupParams.from_method(method, tree))

    def reset(self, prompt: torch.Tensor) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Draft:
        cont = find_continuation(ctx.tokens, self.params)[: max(ctx.max_new, 0)]
        gamma = cont.numel()
        if gamma not in self._chains:
            self._chains[gamma] = Tree.chain(gamma)
        return Draft(self._chains[gamma], torch.cat([ctx.tokens[-1:], cont]))

    def feedback(self, fb: StepFeedback) -> None:
        pass
