"""EAGLE drafters (Li et al. 2024a EAGLE-1, 2024b EAGLE-2, 2025 EAGLE-3): a one-layer head autoregresses on
the target's features and fills a tree level by level (p = target, q = head).

Each step the committed tokens' target features (EAGLE-1: last hidden state; EAGLE-3: the fused
``feature_layers``) are appended to the head's KV cache (methods.heads.eagle.state); the last row's g gives q
of the root's children, and every expanded node is fed to the head (its parent's g, its token) for its own
children: one head forward per level.
- static trees (``tree=eagle``: EAGLE-1's tree; chain, k-ary, Sequoia, Medusa paths): a rank-r child is
  q's top-r token (greedy / deterministic / typical verifiers, ``Draft.q`` = None: lossless at any
  temperature with the deterministic rule), or the r-th draw from q (chain / specinfer with replacement,
  sequoia without), with q rows returned for the rejection verifiers.
- dynamic trees (``tree=dynamic``, EAGLE-2, also EAGLE-3's): per depth the ``top_k`` nodes with the largest
  cumulative draft probability (product of q along the path) are expanded by their top_k children; after
  ``depth`` levels all drafted nodes are reranked by that value and the best ``total_tokens`` verified.
  Deterministic top-k drafts: greedy or deterministic verifier.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from methods.core.drafter import Draft, DraftContext, StepFeedback, root_only
from methods.core.fast_llama import packing_works
from methods.core.loop import subtree
from methods.core.sampling import SamplingParams, probs
from methods.drafters.medusa import _draw
from methods.drafters.params import checked_params
from methods.heads.eagle.head import EagleHead
from methods.heads.eagle.state import HeadCache
from methods.heads.eagle.train import EagleTrainConfig, new_head
from specsim.config import MethodConfig, TreeConfig, TreeKind, Verifier
from specsim.tree import Tree

_SAMPLED = {Verifier.specinfer: "with_replacement", Verifier.chain: "with_replacement",
            Verifier.sequoia: "without"}


@dataclass(frozen=True)
class EagleParams:
    """``method.params`` of the eagle / eagle3 drafters."""

    head: str = "train"  # train (cached: methods.heads.eagle.store) | a published-layout directory | random
    feature_layers: tuple[int, ...] = ()  # eagle3: three distinct target decoder layers (0-based)
    steps: int = 150
    ttt_steps: int = 0  # eagle3's training-time test rollout steps
    seed: int = 0
    train: dict = field(default_factory=dict)  # further EagleTrainConfig fields
    # CPU: the head in the target's dtype with oneDNN-prepacked linears (methods.heads.eagle.head.pack);
    # false = float32, plain linears (the draft cost before packing, for comparison)
    pack: bool = True
    # dynamic trees: q = softmax(z / T) in the cumulative confidence that expands and reranks nodes. 1 is
    # EAGLE-2's own (the head's q); T < 1 sharpens an under-confident head's q (benchmarks/
    # eagle_calibration.py fits T on the calibration split, measures its τ). Off by default: not the paper's.
    confidence_temperature: float = 1.0

    def train_config(self, variant: str) -> EagleTrainConfig:
        extra = dict(self.train)
        if variant == "eagle3":
            extra.setdefault("noise", 0.0)
        return EagleTrainConfig(variant=variant, feature_layers=tuple(self.feature_layers), steps=self.steps,
                                ttt_steps=self.ttt_steps, seed=self.seed, **extra)

    @classmethod
    def from_method(cls, method: MethodConfig) -> EagleParams:
        out = cls(**checked_params(cls, method.params, "eagle", int_tuples=("feature_layers",)))
        if not out.confidence_temperature > 0:
            raise ValueError(f"method.params.confidence_temperature must be > 0, got "
                             f"{out.confidence_temperature}")
        return out


@dataclass(frozen=True)
class Dynamic:
    """EAGLE-2's tree: ``depth`` levels, ``top_k`` expanded nodes × children per level, ``total_tokens``."""

    total_tokens: int
    depth: int
    top_k: int
    temperature: float = 1.0  # of q in the cumulative confidence (EagleParams.confidence_temperature)


class EagleDrafter:
    needs_hidden_states = True
    variant = "eagle1"
    reads_tree_config = True  # registry: from_config also gets the tree preset (dynamic trees)

    def __init__(self, head: EagleHead, tree: Tree | Dynamic, sampling: SamplingParams, mode: str = "topk"):
        assert mode in ("topk", "with_replacement", "without"), f"unknown candidate mode {mode!r}"
        self.head, self.sampling, self.mode = head.eval(), sampling, mode
        self.dynamic = tree if isinstance(tree, Dynamic) else None
        self.tree = tree if isinstance(tree, Tree) else _dynamic_budget(tree)
        self.feature_layers = head.cfg.feature_layers if head.cfg.variant == "eagle3" else ()
        self.needs_hidden_states = head.cfg.variant == "eagle1"
        self.cache = HeadCache(self.head)
        self._sizes = [0, 0]  # dynamic trees: nodes proposed, proposals (for the mean tree size)
        # dynamic trees: each kept shape (parents, sibling ranks) → times proposed, so that the simulator
        # prices the trees this drafter builds (specsim.trees.recorded_law), not the best static one
        self.shapes: Counter[Tree] = Counter()
        self._plans: dict[Tree, _Plan] = {}  # static trees (cut to the remaining budget): their levels

    @property
    def mean_tree_size(self) -> float | None:
        """Mean size (root included) of the dynamic trees proposed so far; None for static trees."""
        return self._sizes[0] / self._sizes[1] if self.dynamic is not None and self._sizes[1] else None

    @classmethod
    def from_config(cls, method: MethodConfig, tree: Tree | None, models, sampling: SamplingParams,
                    tree_cfg: TreeConfig | None = None) -> EagleDrafter:
        ep = EagleParams.from_method(method)
        head = _head(ep, cls.variant, models)
        verifier = Verifier(method.verifier)
        if tree_cfg is not None and TreeKind(tree_cfg.kind) == TreeKind.dynamic:
            if verifier not in (Verifier.greedy, Verifier.deterministic):
                raise ValueError(f"dynamic trees are deterministic top-k drafts: use verifier=deterministic "
                                 f"(or greedy), not {verifier.value}")
            return cls(head, Dynamic(tree_cfg.total_tokens, tree_cfg.depth, tree_cfg.top_k,
                                     float(ep.confidence_temperature)), sampling)
        tree = tree if tree is not None else Tree.chain(5)
        if verifier == Verifier.chain and tree.width > 1:
            raise ValueError(f"verifier chain needs a chain tree, got {tree}: use specinfer or sequoia")
        return cls(head, tree, sampling, "topk" if sampling.greedy else _SAMPLED.get(verifier, "topk"))

    # ---- protocol -----------------------------------------------------------------------------------
    def reset(self, prompt: torch.Tensor) -> None:
        self.cache.reset()

    def feedback(self, fb: StepFeedback) -> None:
        """Nothing to learn: the accepted tokens' features arrive in the next DraftContext."""

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft:
        self._catch_up(ctx)
        root = int(ctx.tokens[-1])
        depth = min(self.dynamic.depth if self.dynamic else self.tree.depth, ctx.max_new - 1)
        if self.cache.last is None or depth < 1:
            return root_only(root, ctx.tokens.device)
        try:
            if self.dynamic is not None:
                parents, tokens, ranks, _ = self._dynamic(root, depth)
                self._sizes[0], self._sizes[1] = self._sizes[0] + len(tokens), self._sizes[1] + 1
                ids, tree = torch.tensor(tokens, device=ctx.tokens.device), Tree.from_parents(parents, ranks)
                self.shapes[tree] += 1
                return Draft(tree, ids)
            return self._static(root, depth, ctx)
        finally:
            self.cache.drop_pending()

    def _catch_up(self, ctx: DraftContext) -> None:
        """Append the committed rows not yet in the head's cache: features of x_j paired with x_{j+1}."""
        src = ctx.features if self.feature_layers else ctx.hidden
        if src is None or src.shape[0] == 0:
            return
        n, t = src.shape[0], ctx.tokens.shape[0]
        assert self.cache.length == t - 1 - n, f"head cache {self.cache.length} rows, expected {t - 1 - n}"
        p = self.head.fc.weight
        h = self.head.fuse(src.to(p.device, p.dtype))
        self.cache.append(h, ctx.tokens[t - n :].to(p.device))

    # ---- static trees --------------------------------------------------------------------------------
    def _static(self, root: int, depth: int, ctx: DraftContext) -> Draft:
        tree = _cut(self.tree, depth)
        plan = self._plans.get(tree) or self._plans.setdefault(tree, _Plan.of(tree))
        N, V = tree.size, self.head.cfg.vocab_size
        tokens = torch.full((N,), root, dtype=torch.long)
        q = torch.zeros(N, V) if self.mode != "topk" else None
        keep = np.ones(N, dtype=bool)
        g, z = self.cache.last[None], self.head.logits(self.cache.last[None]).float()  # the fed level's rows
        slot = {0: 0}  # node → its row in g / z (the last fed level)
        for d in range(1, depth + 1):
            parents = [p for p in plan.expand[d - 1] if keep[p]]
            if not parents:
                break
            rows = z[[slot[p] for p in parents]]  # (n, V)
            if self.mode == "topk":  # one top-k for the level: q's top-r token for a rank-r child
                self._fill_topk(parents, rows.topk(min(plan.width[d - 1], V)).indices.tolist(), tree, tokens,
                                keep)
            else:
                for p, lp in zip(parents, rows):
                    self._fill(p, tree.children[p], tree, lp, tokens, q, keep, ctx.generator)
            fed = [i for i in plan.expand[d] if keep[i]] if d < depth else []
            if fed:
                base = self.cache.pending - len(slot) if d > 1 else None
                pidx = torch.tensor([slot[tree.parents[i]] for i in fed])
                prow = pidx + base if base is not None else torch.full((len(fed),), -1)
                g = self.cache.feed(g[pidx], tokens[fed].to(g.device), d, prow)
                z = self.head.logits(g).float()
                slot = {i: j for j, i in enumerate(fed)}
        keep_idx = np.flatnonzero(keep).tolist()
        dev = ctx.tokens.device
        if len(keep_idx) < N:
            tree = subtree(tree, keep_idx)
            tokens = tokens[keep_idx]
            q = q[keep_idx] if q is not None else None
        return Draft(tree, tokens.to(dev), None if q is None else q.to(dev))

    @staticmethod
    def _fill_topk(parents: list[int], cands: list[list[int]], tree: Tree, tokens, keep) -> None:
        for p, c in zip(parents, cands):
            for k in tree.children[p]:
                if tree.ranks[k] < len(c):
                    tokens[k] = c[tree.ranks[k]]
                else:  # beyond the vocabulary: drop the child and its subtree
                    keep[[j for j in range(k, tree.size) if _descends(tree, j, k)]] = False

    def _fill(self, p: int, kids, tree: Tree, logits: torch.Tensor, tokens, q, keep, gen) -> None:
        """Tokens of node p's children: the r-th draw from q (r = rank); children beyond q's support
        (without replacement) are dropped with their subtrees."""
        width = max(tree.ranks[k] for k in kids) + 1
        qp = probs(logits, self.sampling)
        q[p] = qp.cpu()
        cands = _draw(qp, width, self.mode, gen).cpu()
        for k in kids:
            if tree.ranks[k] < cands.numel():
                tokens[k] = cands[tree.ranks[k]]
            else:
                keep[[j for j in range(k, tree.size) if _descends(tree, j, k)]] = False

    # ---- EAGLE-2's dynamic tree ----------------------------------------------------------------------
    def _dynamic(self, root: int, depth: int) -> tuple[list[int], list[int], list[int], list[float]]:
        """(parents, tokens, ranks, scores) of the best ``total_tokens`` drafted nodes, parents first (scores:
        cumulative log q, 0 for the root). Per level one head forward over the frontier, one top-k of its
        children, one top-k of the next frontier."""
        K, T = self.dynamic.top_k, self.dynamic.temperature
        top = self._log_q(self.cache.last, T).topk(K)
        ranks = torch.arange(K)
        tok, score, par, rank, dep = [top.indices], [top.values], [torch.full((K,), -1)], [ranks], [1] * K
        front = torch.arange(K)  # node ids of the frontier (drafted nodes numbered in creation order)
        h, prow, ftok, fscore = self.cache.last.expand(K, -1), torch.full((K,), -1), top.indices, top.values
        count = K
        for d in range(2, depth + 1):
            first = self.cache.pending  # the frontier's pending rows: first .. first + n - 1
            out = self.cache.feed(h, ftok.to(h.device), d - 1, prow)
            top = self._log_q(out, T).topk(K)  # (n, K)
            n = out.shape[0]
            cand = (fscore.to(top.values.device)[:, None] + top.values).flatten()  # cumulative log q
            tok.append(top.indices.flatten()), score.append(cand), par.append(front.repeat_interleave(K))
            rank.append(ranks.repeat(n)), dep.extend([d] * (n * K))
            if d < depth:
                best = cand.topk(min(K, n * K)).indices
                j = best // K  # the parent's slot in this level
                front, h, prow = count + best, out[j], first + j
                ftok, fscore = top.indices.flatten()[best], cand[best]
            count += n * K
        return _rerank(torch.cat(par).tolist(), torch.cat(tok).tolist(), torch.cat(rank).tolist(),
                       torch.cat(score).tolist(), dep, self.dynamic.total_tokens, root)

    def _log_q(self, g: torch.Tensor, temperature: float) -> torch.Tensor:
        z = self.head.logits(g).float()
        return (z if temperature == 1.0 else z / temperature).log_softmax(-1)


@dataclass(frozen=True)
class _Plan:
    """A static tree's levels: ``expand[d]`` the depth-d nodes that have children (fed to the head at level d,
    their children filled from its output), ``width[d]`` the most children any of them has."""

    expand: tuple[tuple[int, ...], ...]
    width: tuple[int, ...]

    @classmethod
    def of(cls, tree: Tree) -> _Plan:
        kids, depths = tree.children, tree.depths
        expand = tuple(tuple(i for i in range(tree.size) if depths[i] == d and kids[i])
                       for d in range(tree.depth + 1))
        width = tuple(max([max(tree.ranks[k] for k in kids[i]) + 1 for i in level], default=0)
                      for level in expand)
        return cls(expand, width)


def _rerank(par, tok, rank, score, dep, total, root) -> tuple[list[int], list[int], list[int], list[float]]:
    """Keep the ``total`` best drafted nodes by cumulative log q (shallower first on ties, so a kept node's
    ancestors are kept: scores never increase along a path), renumbered parents-first."""
    best = sorted(range(len(tok)), key=lambda i: (-score[i], dep[i], i))[:total]
    chosen = sorted(best, key=lambda i: (dep[i], i))
    index = {old: new + 1 for new, old in enumerate(chosen)}
    assert all(par[i] < 0 or par[i] in index for i in chosen), "a kept node lost its parent"
    parents = [-1] + [0 if par[i] < 0 else index[par[i]] for i in chosen]
    return (parents, [root] + [tok[i] for i in chosen], [0] + [rank[i] for i in chosen],
            [0.0] + [score[i] for i in chosen])


def _descends(tree: Tree, j: int, k: int) -> bool:
    while j > k:
        j = tree.parents[j]
    return j == k


def _cut(tree: Tree, depth: int) -> Tree:
    if tree.depth <= depth:
        return tree
    return subtree(tree, [i for i in range(tree.size) if tree.depths[i] <= depth])


def _dynamic_budget(dyn: Dynamic) -> Tree:
    """The static tree reported for a dynamic one (its size and depth): a k-ary tree cut to total_tokens."""
    full = Tree.kary(dyn.top_k, dyn.depth)
    return subtree(full, list(range(min(full.size, dyn.total_tokens + 1))))


class Eagle3Drafter(EagleDrafter):
    variant = "eagle3"


def _head(ep: EagleParams, variant: str, models) -> EagleHead:
    """Train (cached) / load / randomly initialise the head, on the target's device and dtype."""
    target = models.target
    if ep.head == "random":  # an untrained head: fast tests of the drafting machinery
        cfg = ep.train_config(variant).head_config(target)
        head = new_head(target, cfg, ep.seed)
    elif ep.head == "train":
        from methods.heads.eagle.checkpoint import load_eagle
        from methods.heads.eagle.store import ensure_eagle  # heavy (corpus, training): only when asked

        built = ensure_eagle(target, models.tokenizer, ep.train_config(variant))
        head, _ = load_eagle(built.head_dir, target)
    else:
        from methods.heads.eagle.checkpoint import load_eagle

        head, _ = load_eagle(Path(ep.head), target)
    if head.cfg.variant != variant:
        raise ValueError(f"{ep.head}: an {head.cfg.variant} head, the drafter is {variant}")
    w = target.get_output_embeddings().weight
    # the target's dtype, with oneDNN-prepacked weights on CPU (bf16 packed: ~1.4x less time per draft level
    # than float32 unpacked, measured); float32 where packing is off or does not work (unpacked bf16 linears
    # are no faster than float32 there). The head's K/V and attention are float32 either way (HeadCache).
    cpu = w.device.type == "cpu"
    dtype = torch.float32 if cpu and not (ep.pack and packing_works(w.dtype)) else w.dtype
    head = head.to(device=w.device, dtype=dtype).eval()
    if ep.pack:
        head.pack()
    return head
