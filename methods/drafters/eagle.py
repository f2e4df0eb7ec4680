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
from methods.core.fast_llama import packing_works
from methods.core.loop import limit_depth
from methods.core.sampling import SamplingParams, draw_candidates, probs
from methods.drafters.params import checked_params
from methods.heads.eagle.batch_state import BatchHeadCache
from methods.heads.eagle.head import EagleHead
from methods.heads.eagle.state import HeadCache
from methods.heads.eagle.train import EagleTrainConfig, new_head
from specsim.config import MethodConfig, TreeConfig, TreeKind, Verifier
from specsim.tree import Tree, cut, subtree

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
    # draft over the N most frequent target tokens of the train split only (EagleHead.restrict_vocabulary, at
    # inference, no retraining: EAGLE-1's frozen LM head or a full-vocabulary EAGLE-3 head); 0 = the whole
    # vocabulary. Lossless (the target verifies); a smaller LM head per level (benchmarks/eagle_cost.py).
    draft_vocab: int = 0

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
        if not (isinstance(out.draft_vocab, int) and out.draft_vocab >= 0):
            raise ValueError(f"method.params.draft_vocab must be an int >= 0 (0 = the whole vocabulary), got "
                             f"{out.draft_vocab!r}")
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
        # dynamic trees: per (depth, rank) of a kept node whose parent was accepted, how often it was kept
        # ([0]) and accepted ([1]): the acceptance of the nodes q keeps (specsim.trees.kept_acceptance)
        self.kept = np.zeros((2, self.dynamic.depth, self.dynamic.top_k), dtype=np.int64) if self.dynamic \
            else None
        self._plans: dict[Tree, _Plan] = {}  # static trees (cut to the remaining budget): their levels
        self._trees: dict[tuple, Tree] = {}  # dynamic trees: (parents, ranks) → Tree, built once per shape
        self.fast_chain = True  # chains in topk mode: ``_chain`` (False: the general ``_static``, to compare)

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

    def clear_records(self) -> None:
        """Forget the dynamic trees recorded so far (shapes, kept nodes' outcomes, sizes): measure calls it
        after the warm-up, whose decodes (B copies of the warm prompt in a batch) are not the run's."""
        self.shapes.clear()
        self._sizes = [0, 0]
        if self.kept is not None:
            self.kept[:] = 0

    # ---- protocol -----------------------------------------------------------------------------------
    def reset(self, prompt: torch.Tensor) -> None:
        self.cache.reset()

    def feedback(self, fb: StepFeedback) -> None:
        """Nothing to learn (the accepted tokens' features arrive in the next DraftContext); dynamic trees
        count their kept nodes' outcomes: every child of an accepted node was tried, the next one on the
        accepted path was accepted."""
        if self.kept is None or fb.draft.tree.size < 2:
            return
        tree, path = fb.draft.tree, fb.accepted
        depths, ranks = tree.depths, np.asarray(tree.ranks)
        tried = [c for u in path for c in tree.children[u]]
        np.add.at(self.kept[0], (depths[tried] - 1, ranks[tried]), 1)
        if len(path) > 1:
            hit = np.asarray(path[1:])
            np.add.at(self.kept[1], (depths[hit] - 1, ranks[hit]), 1)

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
                tree = self._tree_of(parents, ranks.tolist())
                self.shapes[tree] += 1
                return Draft(tree, torch.from_numpy(tokens.astype(np.int64)).to(ctx.tokens.device))
            return self._static(root, depth, ctx)
        finally:
            self.cache.drop_pending()

    def _tree_of(self, parents: list[int], ranks: list[int]) -> Tree:
        """The kept tree, built once per shape (a Tree validates its parents in Python)."""
        key = (tuple(parents), tuple(ranks))
        tree = self._trees.get(key)
        if tree is None:
            tree = self._trees[key] = Tree.from_parents(parents, ranks)
        return tree

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

    def batched(self, max_rows: int):
        """The batched form (BatchEagle: EAGLE-1's static top-k trees), else None."""
        return batched_eagle(self, max_rows)

    # ---- calibration ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def level_step(self, width: int, context: int, children: int, generator: torch.Generator):
        """Drafter protocol hook (calibration's draft level): a callable running one level of this
        drafter's drafting fed ``width`` rows after ``context`` committed rows: the head's forward of the
        rows (their pending attention), its LM head, the choice of ``children`` children per row in the
        drafter's mode (EAGLE-2's dynamic trees: the top_k of log q). On a head cache of its own, committed
        rows from random features (a level's cost does not depend on their values)."""
        p = self.head.fc.weight
        gen = torch.Generator().manual_seed(0)
        vocab = self.head.embed.shape[0]  # the target's ids (the fed tokens' embedding)
        cache = HeadCache(self.head, capacity=context + 2 * width)
        h = torch.randn(max(context, 1), self.head.cfg.hidden_size, generator=gen).to(p.device, p.dtype)
        cache.append(h, torch.randint(vocab, (h.shape[0],), generator=gen).to(p.device))
        rows = cache.last.expand(width, -1)
        tokens = torch.randint(vocab, (width,), generator=gen).to(p.device)
        parents = np.full(width, -1)

        @torch.inference_mode()
        def step() -> None:
            cache.drop_pending()
            g = cache.feed(rows, tokens, 1, parents)
            if self.dynamic is not None:
                self._top_log_q(g)
            else:
                self._children(self.head.logits(g), children, generator)

        return step

    # ---- static trees --------------------------------------------------------------------------------
    def _static(self, root: int, depth: int, ctx: DraftContext) -> Draft:
        """Level by level: one head forward over the level's fed nodes, one choice of children for all of
        their rows (q's top-r token for a rank-r child, or the r-th draw from q), the tree's bookkeeping on
        the host in numpy (node → row of the level's g, the children's tokens). Sampled children come with
        q's rows for the rejection verifiers; children beyond q's support (draws without replacement) or the
        vocabulary are dropped with their subtrees."""
        tree = cut(self.tree, depth)
        if self.mode == "topk" and tree.size == tree.depth + 1 and self.fast_chain:
            return self._chain(tree, root, ctx.tokens.device)
        plan = self._plans.get(tree) or self._plans.setdefault(tree, _Plan.of(tree))
        N, V = tree.size, self.head.cfg.vocab_size
        tokens, keep = np.full(N, root, dtype=np.int64), np.ones(N, dtype=bool)
        q = torch.zeros(N, V) if self.mode != "topk" else None  # q[p]: the law of p's children
        slot = np.zeros(N, dtype=np.int64)  # node → its row in g / z (the last fed level)
        g, z = self.cache.last[None], self.head.logits(self.cache.last[None])  # the fed level's rows
        fed, first = np.zeros(1, dtype=np.int64), -1  # the fed nodes; their first pending row (-1: the root)
        for d in range(1, depth + 1):
            kids = plan.kids[d - 1][keep[plan.kids[d - 1]]]
            if kids.size == 0:
                break
            cand, valid, qp = self._children(z, plan.width[d - 1], ctx.generator)  # (rows, w)
            if q is not None:
                q[torch.from_numpy(fed)] = qp.cpu()
            r, s = plan.ranks[kids], slot[plan.parents[kids]]
            ok = r < cand.shape[1]
            ok[ok] = valid[s[ok], r[ok]]
            tokens[kids[ok]] = cand[s[ok], r[ok]]
            if not ok.all():
                keep &= ~plan.below[kids[~ok]].any(0)
            fed = plan.expand[d][keep[plan.expand[d]]] if d < depth else plan.expand[d][:0]
            if fed.size == 0:
                continue
            pidx = slot[plan.parents[fed]]
            prow = pidx + first if first >= 0 else np.full(fed.size, -1)
            first = self.cache.pending
            rows, fed_tokens = torch.from_numpy(pidx).to(g.device), torch.from_numpy(tokens[fed]).to(g.device)
            g = self.cache.feed(g[rows], fed_tokens, d, prow)
            z = self.head.logits(g)
            slot[fed] = np.arange(fed.size)
        ids = torch.from_numpy(tokens)
        if not keep.all():
            kept = np.flatnonzero(keep).tolist()
            tree, ids, q = subtree(tree, kept), ids[kept], q[kept] if q is not None else None
        dev = ctx.tokens.device
        return Draft(tree, ids.to(dev), None if q is None else q.to(dev))

    def _chain(self, tree: Tree, root: int, device) -> Draft:
        """A chain's top-1 drafts (topk mode): ``_static``'s levels without its tree bookkeeping (the same
        ops on the head: one row fed per level, its q's top-1 by the same top-k), ~0.1 t(1) less host time
        per step on the zoo (benchmarks/eagle_cost.py)."""
        tokens = [root]
        g = self.cache.last[None]
        for d in range(1, tree.depth + 1):
            tokens.append(int(self.head.logits(g).float().topk(1).indices[0, 0]))
            if d < tree.depth:
                # the depth-d node's parent: pending row d - 2 (-1 at depth 1: a child of the root)
                g = self.cache.feed(g, torch.tensor(tokens[-1:], device=g.device), d, np.array([d - 2]))
        return Draft(tree, torch.tensor(tokens, dtype=torch.long, device=device))

    def _children(self, z: torch.Tensor, width: int, gen
                  ) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None]:
        """Candidates (rows, w) for every fed row at once, whether each exists, and q's rows (sampled modes):
        q's top-w tokens; w i.i.d. draws (with replacement); or a draw without replacement (fewer where q's
        support is smaller)."""
        z = z.float()
        if self.mode == "topk":
            idx = z.topk(min(width, z.shape[-1])).indices.cpu().numpy()
            return idx, np.ones(idx.shape, dtype=bool), None
        qp = probs(z, self.sampling)  # (rows, V)
        idx, drawn = draw_candidates(qp, width, self.mode, gen)
        return idx.cpu().numpy(), drawn.cpu().numpy(), qp

    # ---- EAGLE-2's dynamic tree ----------------------------------------------------------------------
    def _dynamic(self, root: int, depth: int) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
        """(parents, tokens, ranks, scores) of the best ``total_tokens`` drafted nodes, parents first (scores:
        cumulative log q, 0 for the root). Per level one head forward over the frontier and one top-k of its
        rows on the device; the candidates' bookkeeping (cumulative scores, the next frontier, the rerank) on
        the host in numpy: the per-level small tensor ops cost as much as the head's matmuls on CPU."""
        K = self.dynamic.top_k
        val, idx = self._top_log_q(self.cache.last[None])  # (1, K)
        tok, score, par, dep = [idx[0]], [val[0]], [np.full(K, -1)], [np.ones(K, dtype=np.int64)]
        front, fscore, ftok = np.arange(K), val[0], torch.from_numpy(idx[0])
        h, prow, count = self.cache.last.expand(K, -1), np.full(K, -1), K
        for d in range(2, depth + 1):
            first = self.cache.pending  # the frontier's pending rows: first .. first + n - 1
            out = self.cache.feed(h, ftok.to(h.device), d - 1, prow)
            val, idx = self._top_log_q(out)  # (n, K)
            n = out.shape[0]
            cand = (fscore[:, None] + val).ravel()  # (n K,) cumulative log q
            tok.append(idx.ravel()), score.append(cand), par.append(np.repeat(front, K))
            dep.append(np.full(n * K, d))
            if d < depth:
                best = np.argsort(-cand, kind="stable")[:K]  # the next frontier: the K most confident
                j = best // K  # the parent's slot in this level
                front, fscore, prow = count + best, cand[best], first + j
                h, ftok = out[torch.from_numpy(j).to(out.device)], torch.from_numpy(idx.ravel()[best])
            count += n * K
        ranks = np.tile(np.arange(K), count // K)
        return _rerank(np.concatenate(par), np.concatenate(tok), ranks, np.concatenate(score),
                       np.concatenate(dep), self.dynamic.total_tokens, root)

    def _top_log_q(self, g: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(values, indices) (n, top_k) on the host: the top_k children of each row by log q, q = softmax(z /
        T) of the head's logits z (T: Dynamic.temperature; 1 is EAGLE-2's own q)."""
        z = self.head.logits(g).float()
        t = self.dynamic.temperature
        top = (z if t == 1.0 else z / t).log_softmax(-1).topk(self.dynamic.top_k)  # (faster than logsumexp)
        return top.values.cpu().numpy(), top.indices.cpu().numpy()


@dataclass(frozen=True, eq=False)
class _Plan:
    """A static tree's levels as index arrays: ``expand[d]`` the depth-d nodes that have children (fed to the
    head at level d, their children filled from its output), ``width[d]`` the most children any of them
    has, ``kids[d]`` the depth-(d+1) nodes; ``parents`` / ``ranks`` per node, ``below[k, j]``: j is k or
    one of its descendants (a child dropped beyond the vocabulary takes its subtree)."""

    expand: tuple[np.ndarray, ...]
    width: tuple[int, ...]
    kids: tuple[np.ndarray, ...]
    parents: np.ndarray
    ranks: np.ndarray
    below: np.ndarray

    @classmethod
    def of(cls, tree: Tree) -> _Plan:
        children, depths = tree.children, tree.depths
        nodes = np.arange(tree.size)
        expand = tuple(np.array([i for i in range(tree.size) if depths[i] == d and children[i]],
                                dtype=np.int64) for d in range(tree.depth + 1))
        width = tuple(max([max(tree.ranks[k] for k in children[i]) + 1 for i in level], default=0)
                      for level in expand)
        kids = tuple(nodes[depths == d] for d in range(1, tree.depth + 1))
        return cls(expand, width, kids, np.asarray(tree.parents), np.asarray(tree.ranks),
                   tree.ancestor_mask.T.copy())


def _rerank(par, tok, rank, score, dep, total, root) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """Keep the ``total`` best drafted nodes by cumulative log q (shallower first on ties, so a kept node's
    ancestors are kept: scores never increase along a path; then creation order), renumbered parents-first.
    Arrays over the drafted nodes in creation order; ``par`` their parent's index there (-1: the root)."""
    m = score.size
    best = np.lexsort((np.arange(m), dep, -score))[:total]
    chosen = best[np.lexsort((best, dep[best]))]
    index = np.zeros(m + 1, dtype=np.int64)  # drafted node → its kept index (1-based), 0: the root / dropped
    index[chosen] = np.arange(1, chosen.size + 1)
    p = par[chosen]
    assert (index[p[p >= 0]] > 0).all(), "a kept node lost its parent"
    parents = [-1, *np.where(p < 0, 0, index[p]).tolist()]
    return (parents, np.concatenate([[root], tok[chosen]]), np.concatenate([[0], rank[chosen]]),
            np.concatenate([[0.0], score[chosen]]))


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
    if ep.draft_vocab:
        if ep.draft_vocab > head.cfg.vocab_size:
            raise ValueError(f"method.params.draft_vocab must be <= the target's vocabulary "
                             f"({head.cfg.vocab_size}), got {ep.draft_vocab}")
        from methods.heads.eagle.store import frequent_ids

        head.restrict_vocabulary(frequent_ids(models.tokenizer, ep.draft_vocab, head.cfg.vocab_size))
    w = target.get_output_embeddings().weight
    # the target's dtype, with oneDNN-prepacked weights on CPU (bf16 packed: ~1.4x less time per draft level
    # than float32 unpacked, measured); float32 where packing is off or does not work (unpacked bf16 linears
    # are no faster than float32 there). The attention is float32 either way; the K/V cache is in the head's
    # bf16 / fp16 where the float32-accumulating kernel reads it (methods.heads.eagle.state.kv_cache_dtype).
    cpu = w.device.type == "cpu"
    dtype = torch.float32 if cpu and not (ep.pack and packing_works(w.dtype)) else w.dtype
    head = head.to(device=w.device, dtype=dtype).eval()
    if ep.pack:
        head.pack()
    return head


# ---- batches (issue 16) ----------------------------------------------------------------------------------
def batched_eagle(one: EagleDrafter, max_rows: int) -> BatchEagle | None:
    """The batched form of ``one``, or None where the configuration has none (per row)."""
    if one.mode != "topk":
        return None
    return BatchEagle(one, max_rows)


class BatchEagle:
    """EAGLE-1/3's top-k drafts over a batch (greedy, deterministic, typical verifiers): the head's cache
    holds every row (methods.heads.eagle.batch_state.BatchHeadCache) and each draft level is ONE head forward
    over every row's fed nodes and one top-k over all their rows. Static trees: every row drafts the
    configured tree; rows near their length limit get it cut to their own depth afterwards (a static top-k
    tree's shallow nodes do not depend on the deeper levels). EAGLE-2's dynamic trees: every row's frontier
    is its own top_k most confident nodes (its cumulative log q), each row's pending nodes with their own
    ancestors; each row's drafted nodes are reranked alone, over the levels its own depth allows (the rerank
    of a shallower tree is not a cut of the deeper one's). Either way every row's draft is exactly the
    one-sequence drafter's. EAGLE-3's rows are fused from their ``feature_layers`` (which the batch loop asks
    of the target forward), EAGLE-1's from the last hidden state. Sampled candidates have no batched form
    here (``batched_eagle``: None): they are batched per row (methods.core.batch_drafter.PerRow)."""

    def __init__(self, one: EagleDrafter, max_rows: int) -> None:
        self.one = one
        self.needs_hidden_states = one.needs_hidden_states
        self.feature_layers = one.feature_layers
        self.cache = BatchHeadCache(one.head, max_rows)
        self.has_last: list[bool] = []

    def join(self, prompts: list[torch.Tensor]) -> None:
        self.cache.join(len(prompts))
        self.has_last += [False] * len(prompts)

    def leave(self, slot: int) -> None:
        self.cache.leave(slot)
        leave_slot(self.has_last, slot)

    def feedback_batch(self, fb: BatchFeedback) -> None:
        """Nothing to learn (the accepted tokens' features arrive in the next contexts); dynamic trees count
        every row's kept nodes' outcomes in the one-sequence drafter's tally (EagleDrafter.feedback)."""
        if self.one.kept is not None:
            for b in range(len(fb.accepted)):
                self.one.feedback(fb.row(b))

    @torch.inference_mode()
    def propose_batch(self, ctx: BatchContext) -> BatchDraft:
        self._catch_up(ctx)
        one = self.one
        most = one.dynamic.depth if one.dynamic is not None else one.tree.depth
        depths = [min(most, c.max_new - 1) if ok else 0 for c, ok in zip(ctx.rows, self.has_last)]
        if max(depths) < 1:
            return BatchDraft.from_drafts([root_only(int(r)) for r in ctx.roots])
        try:
            if one.dynamic is not None:
                return self._dynamic(ctx.roots, depths)
            return self._static(ctx.roots, depths)
        finally:
            self.cache.drop_pending()

    def _static(self, roots: torch.Tensor, depths: list[int]) -> BatchDraft:
        one, cache, depth = self.one, self.cache, max(depths)
        tree = cut(one.tree, depth)
        plan = one._plans.get(tree) or one._plans.setdefault(tree, _Plan.of(tree))
        b = len(depths)
        tokens = np.repeat(roots.numpy()[:, None], tree.size, 1)  # (B, N)
        slot = np.zeros(tree.size, dtype=np.int64)  # node → its column in g / z (the last fed level)
        g = cache.last[:b, None]  # (B, 1, H)
        z = one.head.logits(g)
        first = -1
        for d in range(1, depth + 1):
            kids = plan.kids[d - 1]
            cand = z.float().topk(plan.width[d - 1]).indices.cpu().numpy()  # (B, fed, w)
            tokens[:, kids] = cand[:, slot[plan.parents[kids]], plan.ranks[kids]]
            fed = plan.expand[d] if d < depth else plan.expand[d][:0]
            if fed.size == 0:
                continue
            pidx = slot[plan.parents[fed]]
            prow = pidx + first if first >= 0 else np.full(fed.size, -1)
            first = cache.pending
            sel = torch.from_numpy(pidx).to(g.device)
            g = cache.feed(g[:, sel], torch.from_numpy(tokens[:, fed]).to(g.device), d, prow)
            z = one.head.logits(g)
            slot[fed] = np.arange(fed.size)
        ids = torch.from_numpy(tokens)
        if all(x == depth for x in depths):
            return BatchDraft(ids, [tree])
        return BatchDraft.from_drafts([limit_depth(Draft(tree, ids[i]), x) if x >= 1 else root_only(int(r))
                                       for i, (x, r) in enumerate(zip(depths, roots))])

    def _dynamic(self, roots: torch.Tensor, depths: list[int]) -> BatchDraft:
        """EagleDrafter._dynamic on every row at once: per level one head forward over every row's frontier
        (B, top_k) and one top-k of all their rows; the cumulative scores and the next frontiers in numpy
        with a row axis; then each row's rerank (``_rerank``, the one-sequence drafter's) over its first
        levels. Rows drafting nothing (depth 0) get the root alone."""
        one, cache, depth = self.one, self.cache, max(depths)
        K, b = one.dynamic.top_k, len(depths)
        val, idx = one._top_log_q(cache.last[:b, None])  # (B, 1, K)
        val, idx = val[:, 0], idx[:, 0]
        tok, score, par = [idx], [val], [np.full((b, K), -1)]  # per level (B, m_d): the drafted nodes
        front, fscore, ftok = np.broadcast_to(np.arange(K), (b, K)), val, torch.from_numpy(idx)
        h, prow, count = cache.last[:b, None].expand(b, K, -1), np.full((b, K), -1), K
        rows = np.arange(b)[:, None]
        for d in range(2, depth + 1):
            first = cache.pending  # the frontier's pending rows: first .. first + K - 1 in every row
            out = cache.feed(h, ftok.to(h.device), d - 1, prow)  # (B, K, H)
            val, idx = one._top_log_q(out)  # (B, K, K)
            cand = (fscore[:, :, None] + val).reshape(b, K * K)  # cumulative log q
            tok.append(idx.reshape(b, K * K)), score.append(cand), par.append(np.repeat(front, K, 1))
            if d < depth:
                best = np.argsort(-cand, axis=-1, kind="stable")[:, :K]  # each row's K most confident
                j = best // K  # the parent's slot in this level
                front, fscore, prow = count + best, cand[rows, best], first + j
                h = out[torch.from_numpy(rows).to(out.device), torch.from_numpy(j).to(out.device)]
                ftok = torch.from_numpy(tok[-1][rows, best])
            count += K * K
        drafts = []
        for i, (x, root) in enumerate(zip(depths, roots.tolist())):
            if x < 1:
                drafts.append(root_only(root))
                continue
            levels = range(x)
            dep = np.concatenate([np.full(tok[d].shape[1], d + 1) for d in levels])
            parents, tokens, ranks, _ = _rerank(
                np.concatenate([par[d][i] for d in levels]), np.concatenate([tok[d][i] for d in levels]),
                np.tile(np.arange(K), dep.size // K), np.concatenate([score[d][i] for d in levels]), dep,
                one.dynamic.total_tokens, root)
            tree = one._tree_of(parents, ranks.tolist())
            one._sizes[0], one._sizes[1] = one._sizes[0] + len(tokens), one._sizes[1] + 1
            one.shapes[tree] += 1
            drafts.append(Draft(tree, torch.from_numpy(tokens.astype(np.int64))))
        return BatchDraft.from_drafts(drafts)

    def _catch_up(self, ctx: BatchContext) -> None:
        """Append each row's committed rows not yet in the head's cache (features of x_j paired with
        x_{j+1}: EAGLE-3's fused feature_layers, EAGLE-1's hidden state), all rows in one head forward."""
        rows, hs, toks = [], [], []
        p = self.one.head.fc.weight
        for b, c in enumerate(ctx.rows):
            src = c.features if self.feature_layers else c.hidden
            if src is None or src.shape[0] == 0:
                continue
            n, t = src.shape[0], c.tokens.shape[0]
            assert self.cache.lengths[b] == t - 1 - n, f"row {b}: head cache {self.cache.lengths[b]} rows, " \
                                                       f"expected {t - 1 - n}"
            rows.append(b)
            hs.append(self.one.head.fuse(src.to(p.device, p.dtype)))
            toks.append(c.tokens[t - n :].to(p.device))
            self.has_last[b] = True
        if rows:
            self.cache.append(rows, hs, toks)
