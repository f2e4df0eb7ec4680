"""Speculative decoding with a separate draft model q (Leviathan et al. 2023; Chen et al. 2023), any tree.

A chain of γ, or any ``Tree`` preset filled level by level: ONE draft forward per level with tree attention
over the draft's own KV cache (SpecInfer/Sequoia style). Children of a node are, by the configured verifier:
greedy / deterministic / typical → the top-k tokens of q (deterministic, Draft.q = None); chain / specinfer →
drawn i.i.d. from q (with replacement); sequoia → drawn without replacement (the exponential race of
sampling.draw_without_replacement); the sampled modes return q rows. The draft cache follows the accepted
path: accepted nodes that were fed stay, the rest is dropped, and committed tokens the draft has not read
(last accepted leaf, bonus) are fed next time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from methods.core.drafter import Draft, DraftContext, StepFeedback
from methods.core.engine import ModelEngine
from methods.core.loop import kept_nodes, subtree
from methods.core.sampling import SamplingParams, draw_without_replacement, probs
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree

_MODES = {
    Verifier.greedy: "topk",
    Verifier.deterministic: "topk",
    Verifier.typical: "topk",
    Verifier.chain: "with_replacement",
    Verifier.specinfer: "with_replacement",
    Verifier.sequoia: "without_replacement",
}


@dataclass(frozen=True)
class _Level:
    """How depth d is filled: the children of ``parents`` (depth d-1 nodes, rows of the last logits)."""

    parents: list[int]
    kids: torch.Tensor  # (K,) node ids at depth d
    rows: torch.Tensor  # (K,) index of each kid's parent in ``parents``
    cols: torch.Tensor  # (K,) the kid's rank = column of its token in the top-k / draw matrix
    width: int  # columns needed (max rank + 1)
    feed: list[int]  # depth-d nodes with children: fed to the draft model for the next level


class DraftModelDrafter:
    needs_hidden_states = False

    def __init__(self, model, tree: Tree, sampling: SamplingParams, mode: str = "topk") -> None:
        assert mode in ("topk", "with_replacement", "without_replacement"), mode
        self.engine = ModelEngine(model)
        self.tree, self.sampling, self.mode = tree, sampling, mode
        self._plans: dict[Tree, list[_Level]] = {}
        self._fed: dict[int, int] = {}  # node of the last draft → its pending index in the draft cache
        self._node_ids: list[int] | None = None  # after pruning: node of the returned draft → original node

    @classmethod
    def from_config(
        cls, method: MethodConfig, tree: Tree | None, models, sampling: SamplingParams
    ) -> DraftModelDrafter:
        if models.draft is None:
            raise ValueError(f"method {method.name}: drafter {method.drafter} needs a draft model "
                             "(model.draft_n_layers > 0 for random models, model.draft_path for hub/local)")
        unknown = set(method.params) - {"gamma"}
        if unknown:
            raise ValueError(f"method.params: unknown {method.drafter} keys {sorted(unknown)}; "
                             "allowed: ['gamma']")
        gamma = method.params.get("gamma")
        if tree is None or tree.size == 1:
            tree = Tree.chain(int(gamma or 4))
        verifier = Verifier(method.verifier)
        if verifier == Verifier.chain and tree.width > 1:
            raise ValueError(f"verifier chain needs a chain tree, got {tree}: use specinfer or sequoia")
        return cls(models.draft, tree, sampling, _MODES[verifier])

    def reset(self, prompt: torch.Tensor) -> None:
        """Prefill the draft's cache with x_1..x_{t-1} (the root x_t is fed by the first propose): the loop
        times reset as prefill, so the draft's prompt prefill stays out of the draft / decode time."""
        self.engine.reset()
        self.engine.prefill(prompt[:-1].to(self.engine.device))

    # ---- propose --------------------------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> Draft:
        tree = self._limit(ctx.max_new)
        eng, dev = self.engine, self.engine.device
        missing = ctx.tokens[eng.length :]  # committed tokens the draft has not read, the root last
        logits = eng.extend(missing.to(dev), range(-1, missing.numel() - 1), last_only=True).logits  # (1, V)
        eng.commit(range(missing.numel()))
        tokens = torch.empty(tree.size, dtype=torch.long, device=dev)
        tokens[0] = missing[-1]
        q = None if self.mode == "topk" else torch.zeros(tree.size, logits.shape[-1], device=dev)
        valid = torch.ones(tree.size, dtype=torch.bool, device=dev)
        self._fed, self._node_ids = {}, None
        for level in self._plan(tree):
            self._fill(level, logits, tokens, q, valid, ctx.generator)
            if not level.feed:
                break
            parents = [self._fed.get(tree.parents[n], -1) for n in level.feed]  # the root is committed: -1
            logits = eng.extend(tokens[level.feed], parents).logits  # (len(feed), V)
            first = eng.pending - len(level.feed)
            self._fed.update({n: first + j for j, n in enumerate(level.feed)})
        if self.mode == "without_replacement" and not bool(valid.all()):
            return self._prune(Draft(tree, tokens, q), valid)
        return Draft(tree, tokens, q)

    def _fill(self, level: _Level, logits: torch.Tensor, tokens, q, valid, generator) -> None:
        """Tokens of depth d from the parents' draft logits (P, V)."""
        if self.mode == "topk":
            choice = logits.topk(level.width, dim=-1).indices  # (P, width), rank order
        else:
            rows_q = probs(logits, self.sampling)  # (P, V)
            q[level.parents] = rows_q
            if self.mode == "with_replacement":
                choice = torch.multinomial(rows_q, level.width, replacement=True, generator=generator)
            else:
                choice, drawn = draw_without_replacement(rows_q, level.width, generator)
                valid[level.kids] = drawn[level.rows, level.cols]  # fewer tokens with mass than children
        tokens[level.kids] = choice[level.rows, level.cols]

    def _plan(self, tree: Tree) -> list[_Level]:
        plan = self._plans.get(tree)
        if plan is None:
            plan, parents = [], [0]
            while parents:
                pairs = [(i, c) for i, p in enumerate(parents) for c in tree.children[p]]
                if not pairs:
                    break
                rows, kids = zip(*pairs)
                cols = [tree.ranks[c] for c in kids]
                feed = [c for c in kids if tree.children[c]]
                dev = self.engine.device
                kids_t, rows_t, cols_t = (torch.tensor(x, device=dev) for x in (kids, rows, cols))
                plan.append(_Level(list(parents), kids_t, rows_t, cols_t, max(cols) + 1, feed))
                parents = feed
            self._plans[tree] = plan
        return plan

    def _limit(self, max_new: int) -> Tree:
        if self.tree.depth <= max_new:
            return self.tree
        return subtree(self.tree, [i for i in range(self.tree.size) if self.tree.depths[i] <= max_new])

    def _prune(self, draft: Draft, valid: torch.Tensor) -> Draft:
        """Drop children that had no q mass left to be drawn (and their subtrees)."""
        keep = kept_nodes(draft.tree, valid.tolist())
        self._node_ids = keep
        tree = draft.tree
        idx = torch.tensor(keep, device=draft.tokens.device)
        return Draft(subtree(tree, keep), draft.tokens[idx], draft.q[idx])

    # ---- feedback -------------------------------------------------------------------------------------
    def feedback(self, fb: StepFeedback) -> None:
        """Keep the draft KV of accepted nodes that were fed (a prefix of the path); drop the rest."""
        path = fb.accepted[1:]
        if self._node_ids is not None:
            path = [self._node_ids[n] for n in path]
        self.engine.commit([self._fed[n] for n in path if n in self._fed])
