"""Staged speculative decoding (Spector & Ré 2023, "Accelerating LLM Inference with Staged Speculative
Decoding"): a tree-structured draft from the draft model q, and the draft model itself sped up by a cheaper
second stage, so that q runs fewer forwards per step. p = target, q = draft model.

The tree is a spine with branches: the spine is q's greedy path of depth D from the root, and every spine node
at depth d < D gets q's top-k as children (rank 0 = the spine's next node, ranks 1..k-1 = leaves), so k·D
draft nodes. Only spine nodes need q's logits: without a second stage that is one q forward per level (the
catch-up forward over the committed tokens q has not read, then D-1 spine forwards). The second stage guesses
how the spine goes on (``ngram``: an n-gram table of q's own greedy outputs, keyed by the previous ``order``
tokens and backing off to shorter keys; ``prompt_lookup``: the prompt-lookup index of
methods.drafters.prompt_lookup over the committed text) and q checks the guess in the same forward (a chain in
q's cache, tree attention): the guessed tokens that equal q's own argmax are spine nodes whose logits came for
free — q's greedy path is exactly the same, only reached in fewer forwards. Drafts are deterministic (top-k,
Draft.q = None): greedy verification at temperature 0, the deterministic rule at T > 0, both lossless.
Departures from the paper: its trees are expanded by q's probabilities under a budget and its second stage is
a Katz back-off n-gram model of the corpus; here the tree shape is fixed (D, k) and the second stage learns
online from q's own outputs, backing off without discounting (or copies the context). Sampled children
(SpecInfer-style q rows at T > 0) are not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from methods.core.drafter import Draft, DraftContext, StepFeedback
from methods.core.engine import ModelEngine
from methods.core.verify import argmax_rows
from methods.drafters.prompt_lookup import LookupParams, NgramIndex
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree

STAGE2 = ("none", "ngram", "prompt_lookup")


@dataclass(frozen=True)
class StagedParams:
    depth: int = 0  # D; 0 = the configured tree's depth (4 without one)
    top_k: int = 2  # k children per spine node
    stage2: str = "ngram"
    stage2_gamma: int = 4  # tokens the second stage guesses per draft forward
    order: int = 2  # ngram: tokens of context per key; prompt_lookup: its max_ngram_size

    @classmethod
    def from_method(cls, method: MethodConfig, tree: Tree | None) -> StagedParams:
        known = set(cls.__dataclass_fields__)
        unknown = set(method.params) - known
        if unknown:
            raise ValueError(f"method.params: unknown staged keys {sorted(unknown)}; allowed {sorted(known)}")
        out = cls(**dict(method.params))
        if out.depth == 0:
            depth = tree.depth if tree is not None and tree.depth else 4
            out = cls(**{**dict(method.params), "depth": depth})
        if out.stage2 not in STAGE2 or min(out.depth, out.top_k, out.order) < 1 or out.stage2_gamma < 0:
            raise ValueError(f"staged: need stage2 in {STAGE2}, depth, top_k, order >= 1, got {out}")
        return out


def spine_tree(depth: int, k: int) -> Tree:
    """Root, the spine (node d at depth d = 1..D), then per depth d the k-1 leaves under spine node d-1
    (ranks 1..k-1; the spine node is rank 0). The spine first keeps an accepted spine path a prefix of the
    nodes, so the target commits its KV in place (no copy)."""
    parents = list(range(-1, depth)) + [d for d in range(depth) for _ in range(k - 1)]
    return Tree.from_parents(parents, [0] * (depth + 1) + list(range(1, k)) * depth)


class OwnNgrams:
    """The second stage ``ngram``: q's argmax after each context of 1..``order`` tokens it has computed
    (latest wins), chained to guess how q's greedy path goes on. Each guess backs off to the longest
    context seen (the paper's second stage is a back-off n-gram model too, Katz's; here without
    discounting): an ``order``-token context q has not met yet still gets the guess of its shorter
    suffix, which spares a draft forward whenever that guess is right and costs a few rows of one when
    it is wrong."""

    def __init__(self, order: int) -> None:
        self.order = order
        self.next: list[dict[tuple[int, ...], int]] = [{} for _ in range(order)]  # [n-1]: n-token keys

    def learn(self, context: list[int], argmax: int) -> None:
        for n in range(1, min(self.order, len(context)) + 1):
            self.next[n - 1][tuple(context[-n:])] = argmax

    def guess(self, context: list[int], count: int) -> list[int]:
        out, tail = [], list(context[-self.order :])
        while len(out) < count:
            tok = None
            for n in range(len(tail), 0, -1):  # the longest context with an entry
                tok = self.next[n - 1].get(tuple(tail[-n:]))
                if tok is not None:
                    break
            if tok is None:
                break
            out.append(tok)
            tail = (tail + [tok])[-self.order :]
        return out


class StagedDrafter:
    needs_hidden_states = False

    def __init__(self, model, params: StagedParams) -> None:
        self.engine = ModelEngine(model)
        self.params = params
        self.tree = spine_tree(params.depth, params.top_k)
        self._trees = {params.depth: self.tree}
        self.own = OwnNgrams(params.order)
        self.lookup = NgramIndex(LookupParams(max_ngram_size=params.order, num_pred_tokens=1))
        self.draft_forwards = 0  # statistics over the drafter's life: q forwards and speculation steps
        self.steps = 0

    @classmethod
    def from_config(cls, method: MethodConfig, tree: Tree | None, models, sampling) -> StagedDrafter:
        if models.draft is None:
            raise ValueError("method staged needs a draft model")
        if Verifier(method.verifier) not in (Verifier.greedy, Verifier.deterministic):
            raise ValueError("staged drafts are q's top-k (deterministic): verifier greedy or deterministic")
        return cls(models.draft, StagedParams.from_method(method, tree))

    def reset(self, prompt: torch.Tensor) -> None:
        """A new prompt: q's cache and the lookup index start over; the n-gram model of q's own outputs
        is kept (it models q, not the prompt)."""
        self.engine.reset()
        self.lookup.reset()

    @property
    def forwards_per_step(self) -> float:
        return self.draft_forwards / self.steps if self.steps else 0.0

    def run_stats(self) -> dict[str, float]:
        """For metrics.json (warm-up decodes included): the draft model's forwards per speculation step."""
        return {"draft_forwards_per_step": self.forwards_per_step, "stage2": self.params.stage2}

    # ---- propose --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft:
        """q's spine (greedy path) to depth D with the second stage's guesses checked along, then the tree."""
        eng, depth = self.engine, min(self.params.depth, ctx.max_new)
        missing = ctx.tokens[eng.length :].to(eng.device)  # committed tokens q has not read, the root last
        # the context's tail: the second stage's keys and lookups read at most ``order`` tokens back
        committed = ctx.tokens[-(self.params.order + 1) :].tolist()
        if self.params.stage2 == "prompt_lookup":
            self.lookup.continuation(ctx.tokens)  # index the committed text (incremental)
        spine, rows, self._fed = [committed[-1]], [], {}  # spine tokens; q logits at spine depths 0..
        feed, parents = missing, list(range(-1, missing.numel() - 1))  # the catch-up chain
        while len(rows) < depth:
            guess = self._guess(committed[:-1] + spine, depth - 1 - len(rows))
            first = eng.pending + len(feed) - 1  # pending index of the spine node being fed
            tokens = feed
            if guess:
                tokens = torch.cat([feed, torch.tensor(guess, dtype=torch.long, device=eng.device)])
            # (1 + len(guess), V): the spine node's logits, then the guesses' (none for the catch-up's others)
            logits = eng.extend(tokens, parents + list(range(first, first + len(guess))),
                                logits_from=len(feed) - 1).logits
            self.draft_forwards += 1
            self._accept(spine, rows, logits, guess, first, committed)
            if len(rows) < depth:  # the next spine node: fed with the next guesses
                feed, parents = torch.tensor(spine[-1:], device=eng.device), [self._fed[len(rows) - 1]]
        self.steps += 1
        return self._draft(spine, rows, depth)

    def _accept(self, spine: list[int], rows: list, logits: torch.Tensor, guess: list[int], first: int,
                committed: list[int]) -> None:
        """Spine nodes settled by one q forward: the fed node, and the guesses while they equal q's argmax."""
        argmax = argmax_rows(logits)
        context = committed[:-1] + spine
        j = 0
        while True:
            self._fed[len(spine) - 1] = first + j
            rows.append(logits[j])
            self.own.learn(context, argmax[j])
            if j >= len(guess) or guess[j] != argmax[j]:
                break
            spine.append(guess[j])
            context.append(guess[j])
            j += 1
        spine.append(argmax[j])  # q's next spine token (its logits come with the next forward)

    def _guess(self, context: list[int], room: int) -> list[int]:
        room = min(room, self.params.stage2_gamma)
        if room <= 0 or self.params.stage2 == "none":
            return []
        if self.params.stage2 == "ngram":
            return self.own.guess(context, room)
        ends, seq = self.lookup.ends, self.lookup.seq  # prompt lookup on the committed text
        for n in range(min(self.params.order, len(context)), 0, -1):
            end = ends.get(tuple(context[-n:]))
            if end is not None:
                return seq[end : end + room]
        return []

    def _draft(self, spine: list[int], rows: list[torch.Tensor], depth: int) -> Draft:
        """The spine tree's tokens: each spine node's children are q's top-k there, its spine child first."""
        tree = self._trees.get(depth)
        if tree is None:
            tree = self._trees[depth] = spine_tree(depth, self.params.top_k)
        k, leaves = self.params.top_k, []
        if k > 1:  # one top-k over the D rows' logits
            tops = torch.stack(rows[:depth]).topk(min(k + 1, rows[0].numel())).indices.tolist()
            for d, top in enumerate(tops):
                leaves += [t for t in top if t != spine[d + 1]][: k - 1]
        tokens = spine[: depth + 1] + leaves
        return Draft(tree, torch.tensor(tokens, dtype=torch.long), None)

    # ---- feedback -------------------------------------------------------------------------------------
    def feedback(self, fb: StepFeedback) -> None:
        """Keep q's KV of the committed tokens it read and of the accepted spine nodes it was fed; drop the
        rest (leaves, rejected spine nodes, wrong guesses)."""
        keep = []
        for node in fb.accepted[1:]:
            d = node  # spine node d is node d (spine_tree); a leaf's index is past the spine's
            if fb.draft.tree.depths[node] != d or d not in self._fed:  # a leaf, or the unfed last spine node
                break
            keep.append(self._fed[d])
        self.engine.commit(list(range(self._fed[0] + 1)) + keep)
