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

import numpy as np
import torch

from methods.core.batch_engine import BatchEngine
from methods.core.drafter import BatchContext, BatchDraft, BatchFeedback, Draft, DraftContext, StepFeedback
from methods.core.engine import ModelEngine
from methods.core.loop import kept_nodes
from methods.core.sampling import SamplingParams, draw_candidates, probs
from methods.core.verify import argmax_host
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree, cut, subtree

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
            choice, drawn = draw_candidates(rows_q, level.width, self.mode, generator)
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
        return cut(self.tree, max_new)

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

    def batched(self, max_rows: int) -> BatchDraftModel:
        return BatchDraftModel(self, max_rows)


@dataclass(frozen=True)
class _Feeds:
    """The shared tree's fed nodes as the draft engine's pending nodes: level l's nodes see the earlier
    levels' fed nodes and their own (anc (1, f_l, P_l) over the pending order), at depth - 1 (the root is
    committed); ``index``: node → pending index."""

    anc: list[torch.Tensor]
    depths: list[torch.Tensor]
    index: dict[int, int]


class BatchDraftModel:
    """The draft model over a batch: its own BatchEngine with one row per target row; each level of the tree
    is ONE draft forward of all rows (the tree is the same for every row; rows near their length limit get it
    cut afterwards, rows whose without-replacement draws ran out of mass get those nodes pruned)."""

    needs_hidden_states = False

    def __init__(self, one: DraftModelDrafter, max_rows: int) -> None:
        self.one, self.tree = one, one.tree
        self.engine = BatchEngine(one.engine.model, max_rows)
        self._feeds: dict[Tree, _Feeds] = {}
        self._node_ids: list[list[int] | None] = []
        self._causal: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # width → (1, w, w) causal, (1, w) depths

    def join(self, prompts: list[torch.Tensor]) -> None:
        first = self.engine.add(len(prompts))
        self.engine.prefill([p[:-1] for p in prompts], rows=slice(first, first + len(prompts)))

    def leave(self, slot: int) -> None:
        self.engine.remove(slot)

    @torch.inference_mode()
    def propose_batch(self, ctx: BatchContext) -> BatchDraft:
        eng, tree, one = self.engine, self.tree, self.one
        last = self._catch_up(ctx)  # (B, V) the draft's logits at every root
        b = eng.rows
        tokens = torch.empty(b, tree.size, dtype=torch.long, device=eng.device)
        tokens[:, 0] = ctx.roots.to(eng.device)
        q = None if one.mode == "topk" else torch.zeros(b, tree.size, last.shape[-1], device=eng.device)
        valid = torch.ones(b, tree.size, dtype=torch.bool, device=eng.device)
        feeds, logits = self._feeds_of(tree), last[:, None]  # (B, P, V)
        for i, level in enumerate(one._plan(tree)):
            self._fill(level, logits, tokens, q, valid, ctx.rows[0].generator)
            if not level.feed:
                break
            logits = eng.extend(tokens[:, level.feed], feeds.anc[i], feeds.depths[i]).logits  # (B, f, V)
        return self._rows(ctx, tokens, q, valid)

    def _catch_up(self, ctx: BatchContext) -> torch.Tensor:
        """Feed each row the committed tokens its draft cache lacks (its root last), in one forward; the LM
        head runs on each row's last one only."""
        eng = self.engine
        m = [c.tokens.shape[0] - n for c, n in zip(ctx.rows, eng.lengths)]
        width = max(m)
        if width == 1:  # every row lacks only its root
            ids = ctx.roots[:, None]
        else:
            missing = [c.tokens[n:] for c, n in zip(ctx.rows, eng.lengths)]
            ids = torch.nn.utils.rnn.pad_sequence(missing, batch_first=True)  # (B, width)
        causal = self._causal.get(width)
        if causal is None:
            causal = self._causal[width] = (np.tri(width, dtype=bool)[None], np.arange(width)[None])
        last = torch.tensor(m, device=eng.device) - 1
        logits = eng.extend(ids, *causal, last=last).logits  # (B, 1, V)
        eng.commit_counts(m)
        return logits[:, 0]

    def _fill(self, level, logits: torch.Tensor, tokens, q, valid, generator) -> None:
        """Tokens of depth d for every row from the parents' draft logits (B, P, V)."""
        mode = self.one.mode
        if mode == "topk" and level.width == 1:  # top-1 (a chain): numpy's argmax, ~10x torch's topk on CPU
            choice = torch.from_numpy(argmax_host(logits)[..., None]).to(logits.device)  # (B, P, 1)
        elif mode == "topk":
            choice = logits.topk(level.width, dim=-1).indices  # (B, P, width)
        else:
            rows_q = probs(logits, self.one.sampling)  # (B, P, V)
            q[:, level.parents] = rows_q
            choice, drawn = draw_candidates(rows_q, level.width, mode, generator)
            valid[:, level.kids] = drawn[:, level.rows, level.cols]
        tokens[:, level.kids] = choice[:, level.rows, level.cols]

    def _rows(self, ctx: BatchContext, tokens: torch.Tensor, q, valid: torch.Tensor) -> BatchDraft:
        """The rows' drafts: the shared tree, or per row the tree cut to its room / pruned of invalid
        draws (``_node_ids`` maps the row's nodes back to the shared tree's)."""
        tree = self.tree
        room = [c.max_new for c in ctx.rows]
        self._node_ids = [None] * len(room)
        whole = min(room) >= tree.depth and (self.one.mode != "without_replacement" or bool(valid.all()))
        if whole and q is None:
            return BatchDraft(tokens, [tree])
        drafts, ok = [], valid.tolist()
        for b, r in enumerate(room):
            draft = Draft(tree, tokens[b], None if q is None else q[b])
            keep = kept_nodes(tree, [v and d <= r for v, d in zip(ok[b], tree.depths)])
            if len(keep) < tree.size:
                self._node_ids[b] = keep
                draft = draft.select(subtree(tree, keep), keep)
            drafts.append(draft)
        return BatchDraft.from_drafts(drafts)

    def _feeds_of(self, tree: Tree) -> _Feeds:
        hit = self._feeds.get(tree)
        if hit is None:
            anc, depths, order = [], [], []
            dev = self.engine.device
            for level in self.one._plan(tree):
                order += level.feed
                rows = tree.ancestor_mask[np.ix_(level.feed, order)] if level.feed else np.zeros((0, 0), bool)
                anc.append(torch.from_numpy(np.ascontiguousarray(rows))[None].to(dev))
                depths.append(torch.as_tensor(tree.depths[level.feed] - 1, device=dev)[None])
            hit = self._feeds[tree] = _Feeds(anc, depths, {n: i for i, n in enumerate(order)})
        return hit

    def feedback_batch(self, fb: BatchFeedback) -> None:
        """Each row keeps the draft KV of its accepted nodes that were fed; the rest is dropped."""
        index = self._feeds_of(self.tree).index
        keeps = []
        for path, ids in zip(fb.accepted, self._node_ids):
            nodes = path[1:] if ids is None else [ids[n] for n in path[1:]]
            keeps.append([index[n] for n in nodes if n in index])
        self.engine.commit(keeps)
