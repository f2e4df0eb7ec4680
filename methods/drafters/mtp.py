"""MTP drafter: DeepSeek-V3-style sequential multi-token prediction modules (methods.heads.mtp) on the frozen
target p draft chains and trees (q_k = module k); verification is the loop's, lossless.

After a verification the target's hidden states of the committed tokens arrive in ``DraftContext.hidden``;
module 1 reads the last ``window`` of them with the committed tokens shifted by one and its last position
gives the root's children; module k reads module k-1's states with the tokens shifted by k. In a tree each
expanded depth-(k-1) node v gets its own row in module k (tree attention: the shared committed prefix plus
v's draft ancestors), reading v's token and module k-1's state at v's parent, so v's children are module
k's top-k given v's own path, as in calibration where module k reads the true tokens (filling every depth
from the top-1 path's candidates, Medusa's way, lost ~20% of tau on Sequoia trees: issue 14). One module
call per depth over n-k+1 prefix rows plus the tree's nodes of depths 1..k-1 (q = None: greedy /
deterministic verifiers, lossless at any temperature). With chain / specinfer at temperature > 0 the chain
is drawn from the modules' processed laws and their rows returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from methods.core.drafter import (
    BatchContext,
    BatchDraft,
    BatchFeedback,
    Draft,
    DraftContext,
    StepFeedback,
    leave_slot,
    root_only,
)
from methods.core.sampling import SamplingParams, probs
from methods.drafters.params import checked_params
from methods.heads.mtp.module import MTPModules
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree, cut, subtree

_SAMPLED = {Verifier.chain, Verifier.specinfer}


@dataclass(frozen=True)
class MTPParams:
    modules: str = "train"  # "train" (cached) | "random" (untrained modules: tests)
    num_heads: int = 3  # D: modules (draft depth)
    window: int = 32
    steps: int = 400
    seed: int = 0
    train: dict = field(default_factory=dict)  # further MTPTrainConfig fields

    @classmethod
    def from_method(cls, method: MethodConfig) -> MTPParams:
        return cls(**checked_params(cls, method.params, "mtp"))


@dataclass(frozen=True)
class _Plan:
    """Module k's rows in a tree: ``nodes`` (depths 1..k-1, on a path to depth k, tree order), ``src`` (the
    row of each one's parent among module k-1's states: 0 the root, i+1 module k-1's node i), ``anc`` their
    ancestor mask, ``expand`` the depth-(k-1) nodes with children (``expand_rows`` their state rows) and
    their children ``kids`` (``kid_parent`` their parent's index in ``expand``, ``kid_rank`` their rank)."""

    nodes: torch.Tensor
    src: torch.Tensor
    anc: torch.Tensor
    depths: torch.Tensor
    expand: torch.Tensor
    expand_rows: torch.Tensor
    width: int
    kids: torch.Tensor
    kid_parent: torch.Tensor
    kid_rank: torch.Tensor

    @classmethod
    def build(cls, tree: Tree, k: int, prev: list[int]) -> _Plan:
        expand = [v for v in range(tree.size) if tree.depths[v] == k - 1 and tree.children[v]]
        keep: set[int] = set()
        for v in expand:
            while v > 0 and v not in keep:
                keep.add(v)
                v = tree.parents[v]
        nodes = sorted(keep)
        prev_row = {0: 0} | {v: i + 1 for i, v in enumerate(prev)}
        row = {0: 0} | {v: i + 1 for i, v in enumerate(nodes)}
        kids = [(c, e, tree.ranks[c]) for e, v in enumerate(expand) for c in tree.children[v]]
        t = partial(torch.tensor, dtype=torch.long)
        return cls(t(nodes), t([prev_row[tree.parents[v]] for v in nodes]),
                   torch.as_tensor(tree.ancestor_mask[np.ix_(nodes, nodes)]), t(tree.depths[nodes].tolist()),
                   t(expand), t([row[v] for v in expand]), max(r for *_, r in kids) + 1,
                   t([c for c, *_ in kids]), t([e for _, e, _ in kids]), t([r for *_, r in kids]))


class MTPDrafter:
    needs_hidden_states = True

    def __init__(self, heads: MTPModules, tree: Tree, sampling: SamplingParams, sample: bool = False) -> None:
        keep = [i for i in range(tree.size) if tree.depths[i] <= heads.num_heads]
        self.heads, self.tree = heads.eval(), subtree(tree, keep) if len(keep) < tree.size else tree
        self.sampling, self.sample = sampling, sample
        assert not sample or self.tree.width <= 1, "sampled MTP drafts are chains"
        self._h: list[torch.Tensor] = []
        self._cut: dict[int, Tree] = {}
        self._plans: dict[tuple[int, int, int], _Plan] = {}

    @classmethod
    def from_config(cls, method: MethodConfig, tree: Tree | None, models, sampling: SamplingParams
                    ) -> MTPDrafter:
        from methods.heads.mtp.train import MTPTrainConfig, ensure_mtp, new_modules

        mp = MTPParams.from_method(method)
        cfg = MTPTrainConfig(depths=mp.num_heads, window=mp.window, steps=mp.steps, seed=mp.seed, **mp.train)
        if mp.modules == "train":
            heads, _ = ensure_mtp(models.target, models.tokenizer, cfg)
        elif mp.modules == "random":
            heads = new_modules(models.target, cfg)
        else:
            raise ValueError(f"mtp: modules {mp.modules!r}: allowed train, random")
        w = models.target.get_output_embeddings().weight
        heads = heads.to(device=w.device, dtype=w.dtype)
        sample = not sampling.greedy and Verifier(method.verifier) in _SAMPLED
        if sample and tree is not None and tree.width > 1:
            raise ValueError(f"mtp: sampled verification ({method.verifier}) needs a chain, got {tree}")
        return cls(heads, tree if tree is not None and tree.size > 1 else Tree.chain(mp.num_heads), sampling,
                   sample)

    # ---- protocol -----------------------------------------------------------------------------------
    def reset(self, prompt: torch.Tensor) -> None:
        self._h = []

    def feedback(self, fb: StepFeedback) -> None:
        """Nothing to learn: the next hidden states arrive in the next DraftContext."""

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft:
        if ctx.hidden is not None and ctx.hidden.shape[0]:
            self._h.append(ctx.hidden)
        window = self.heads.cfg.window
        if sum(h.shape[0] for h in self._h) > 2 * window:  # keep the last window (+ slack) only
            self._h = [torch.cat(self._h)[-window:]]
        root, t = int(ctx.tokens[-1]), ctx.tokens.numel()
        depth = min(self.tree.depth, ctx.max_new - 1)
        if not self._h or depth < 1:
            return root_only(root, ctx.tokens.device)
        h = torch.cat(self._h)[-window:]  # (n, H): positions t-1-n .. t-2, the last predicted the root
        tree = self._layout(min(depth, h.shape[0]))  # module k keeps n-k+1 prefix rows
        ext = ctx.tokens[t - h.shape[0] :].tolist()  # x_{t-n} .. x_{t-1} (the root last)
        tokens = torch.full((tree.size,), root, dtype=torch.long)
        q = torch.zeros(tree.size, self.heads.lm_head.shape[0]) if self.sample else None
        states = h[-1:]  # rows: the root, then the plan's nodes (module k's state where it read them)
        for k in range(1, tree.depth + 1):
            plan = self._plan(tree, k)
            h, states = self._module(k, plan, h, states, ext, tokens)
            logits = self.heads.logits(k, states[plan.expand_rows]).float()  # (E, V): q_k of their children
            if self.sample:
                law = probs(logits, self.sampling)
                top = torch.multinomial(law, 1, generator=ctx.generator)
                q[plan.expand] = law.cpu()
            else:
                top = logits.topk(plan.width).indices
            tokens[plan.kids] = top.cpu()[plan.kid_parent, plan.kid_rank]
        return Draft(tree, tokens.to(ctx.tokens.device), q)

    def _module(self, k: int, plan: _Plan, h: torch.Tensor, states: torch.Tensor, ext: list[int],
                tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Module k over the committed prefix (its n-k+1 positions read x up to the root) and, with tree
        attention, one row per draft node v of depths 1..k-1 that leads to a depth-k node: row v reads
        v's token and module k-1's state at v's parent, so every node's children are conditioned on its
        own path (calibration conditions module k on the true tokens the same way). Returns the prefix
        rows of h^k and the states module k+1 reads (the root's: the last prefix row; then the nodes')."""
        n_pre = h.shape[0] - (k > 1)  # module k-1's prefix less its root row
        m = len(plan.nodes)
        h_in = torch.cat([h[:n_pre], states[plan.src.to(h.device)]])
        toks = torch.cat([torch.tensor(ext[k - 1 : k - 1 + n_pre]), tokens[plan.nodes]]).to(h.device)
        allowed = torch.ones(n_pre + m, n_pre + m, dtype=torch.bool).tril()
        allowed[n_pre:, n_pre:] = plan.anc  # draft nodes: the whole prefix, then their own ancestors
        pos = torch.cat([torch.arange(n_pre), n_pre - 1 + plan.depths])
        out = self.heads.step(k, h_in[None], toks[None], allowed, pos)[0]
        return out[:n_pre], out[n_pre - 1 :]

    def _plan(self, tree: Tree, k: int) -> _Plan:
        """Which nodes module k reads and expands in ``tree`` (cached per tree and depth)."""
        key = (tree.size, tree.depth, k)  # trees here are cuts of self.tree by depth
        if key not in self._plans:
            self._plans[key] = _Plan.build(tree, k, self._plan(tree, k - 1).nodes.tolist() if k > 1 else [])
        return self._plans[key]

    def _layout(self, depth: int) -> Tree:
        if depth not in self._cut:
            self._cut[depth] = cut(self.tree, depth)
        return self._cut[depth]

    def batched(self, max_rows: int) -> BatchMTP:
        return BatchMTP(self)


class BatchMTP:
    """MTP over a batch: each row keeps the last ``window`` target hidden states of its committed tokens (the
    modules recompute over that window, no KV cache of their own); rows with the same window length and
    draft depth run each module as ONE call over all of them ((G, T, H), the same tree attention and
    positions as ``MTPDrafter._module`` per row), and pick their children with one top-k (or one draw from
    the modules' laws, sampled chains). Rows are grouped by (window length, depth): in steady state every
    row has a full window and one group holds the batch; short prompts and rows near their length limit
    form groups of their own. Each row's draft is exactly the one-sequence drafter's."""

    needs_hidden_states = True

    def __init__(self, one: MTPDrafter) -> None:
        self.one = one
        self.h: list[torch.Tensor | None] = []  # per row: (n ≤ window, H) the last hidden states

    def join(self, prompts: list[torch.Tensor]) -> None:
        self.h += [None] * len(prompts)

    def leave(self, slot: int) -> None:
        leave_slot(self.h, slot)

    def feedback_batch(self, fb: BatchFeedback) -> None:
        """Nothing to learn: the next hidden states arrive in the next contexts."""

    @torch.inference_mode()
    def propose_batch(self, ctx: BatchContext) -> BatchDraft:
        window, one = self.one.heads.cfg.window, self.one
        groups: dict[tuple[int, int], list[int]] = {}
        for b, c in enumerate(ctx.rows):
            if c.hidden is not None and c.hidden.shape[0]:
                h = self.h[b]
                self.h[b] = (c.hidden if h is None else torch.cat([h, c.hidden]))[-window:]
            depth = min(one.tree.depth, c.max_new - 1)
            n = 0 if self.h[b] is None else self.h[b].shape[0]
            groups.setdefault((n, min(depth, n)), []).append(b)
        drafts: list[Draft | None] = [None] * len(ctx.rows)
        for (n, depth), rows in groups.items():
            if depth < 1:
                for b in rows:
                    drafts[b] = root_only(int(ctx.roots[b]), ctx.rows[b].tokens.device)
                continue
            drafts_g = self._group(rows, n, depth, ctx)
            for b, d in zip(rows, drafts_g):
                drafts[b] = d
        if len(groups) == 1 and not one.sample:  # one tree for every row: no per-row drafts to carry
            tree = drafts[0].tree
            return BatchDraft(torch.stack([d.tokens for d in drafts]), [tree])
        return BatchDraft.from_drafts(drafts)

    def _group(self, rows: list[int], n: int, depth: int, ctx: BatchContext) -> list[Draft]:
        """The drafts of rows with n hidden states each and one depth: each module once over the group."""
        one = self.one
        tree = one._layout(depth)
        h = torch.stack([self.h[b] for b in rows])  # (G, n, H)
        ext = torch.stack([ctx.rows[b].tokens[-n:].cpu() for b in rows])  # (G, n) x_{t-n} .. the root
        g = len(rows)
        tokens = ctx.roots[rows][:, None].repeat(1, tree.size).cpu()  # (G, N)
        q = torch.zeros(g, tree.size, one.heads.lm_head.shape[0]) if one.sample else None
        states = h[:, -1:]
        for k in range(1, tree.depth + 1):
            plan = one._plan(tree, k)
            h, states = self._module(k, plan, h, states, ext, tokens)
            logits = one.heads.logits(k, states[:, plan.expand_rows.to(h.device)]).float()  # (G, E, V)
            if one.sample:
                law = probs(logits, one.sampling)
                top = torch.multinomial(law.flatten(0, 1), 1, generator=ctx.rows[rows[0]].generator)
                top = top.view(g, -1, 1)
                q[:, plan.expand] = law.cpu()
            else:
                top = logits.topk(plan.width).indices
            tokens[:, plan.kids] = top.cpu()[:, plan.kid_parent, plan.kid_rank]
        dev = ctx.rows[rows[0]].tokens.device
        return [Draft(tree, tokens[i].to(dev), None if q is None else q[i].to(dev)) for i in range(g)]

    def _module(self, k: int, plan: _Plan, h: torch.Tensor, states: torch.Tensor, ext: torch.Tensor,
                tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``MTPDrafter._module`` over a group of rows: h (G, n', H), states (G, 1 + nodes, H), ext (G, n),
        tokens (G, N)."""
        n_pre = h.shape[1] - (k > 1)
        m = len(plan.nodes)
        h_in = torch.cat([h[:, :n_pre], states[:, plan.src.to(h.device)]], 1)
        toks = torch.cat([ext[:, k - 1 : k - 1 + n_pre], tokens[:, plan.nodes]], 1).to(h.device)
        allowed = torch.ones(n_pre + m, n_pre + m, dtype=torch.bool).tril()
        allowed[n_pre:, n_pre:] = plan.anc
        pos = torch.cat([torch.arange(n_pre), n_pre - 1 + plan.depths])
        out = self.one.heads.step(k, h_in, toks, allowed, pos)
        return out[:, :n_pre], out[:, n_pre - 1 :]
