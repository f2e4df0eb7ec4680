"""Medusa drafter (Cai et al., 2024): K heads on the target's last hidden state fill a static tree.

p = target, q = heads. After a verification the last accepted node's hidden state h (the one whose LM-head
output gave the new root x_t) is all the heads read: head d's top-k are candidates for x_{t+d}, so a node at
depth d with rank r (Tree.ranks = top-k index) gets the rank-r candidate of head d — Medusa's cartesian
candidate construction. The candidates of depth d do not depend on the tokens chosen above them, so the q
row of every depth-d node (the law its children were drawn from) is head d+1's distribution.

How this meets each verifier (chosen by config, never by what is returned here):
- greedy / typical (lossy) / deterministic: candidates are the deterministic top-k (q=None). They are a
  function of the committed context only, so the deterministic (one-hot q) recursive rejection is lossless
  at any temperature, and greedy verification reproduces greedy decoding.
- specinfer / sequoia / chain: children are *sampled* from q (with / without replacement, using the run's
  generator; rank r = the r-th draw, one draw sequence per depth, shared by that depth's nodes) and q rows
  are returned: the paper's rejection verifiers are then lossless with the heads' q. Sharing a depth's draw
  is sound: a path visits each depth once and each depth's draw is independent of everything above it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from methods.core.drafter import (
    Backbone,
    BatchContext,
    BatchDraft,
    BatchFeedback,
    Draft,
    DraftContext,
    StepFeedback,
    leave_slot,
    root_only,
)
from methods.core.loop import kept_nodes
from methods.core.sampling import SamplingParams, draw_candidates, probs
from methods.core.verify import VERIFIER_PARAMS
from methods.drafters.params import checked_params
from methods.heads.medusa.checkpoint import load_heads
from methods.heads.medusa.heads import HeadsConfig, MedusaHeads
from methods.heads.medusa.train import TrainConfig
from methods.heads.medusa.tree import greedy_tree
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree, subtree

_SAMPLED = {
    Verifier.specinfer: "with_replacement",
    Verifier.chain: "with_replacement",
    Verifier.sequoia: "without",
}

# keys of method.params that belong to a verifier (typical acceptance's ε, δ), not to the drafter
_VERIFIER_KEYS = frozenset(k for names in VERIFIER_PARAMS.values() for k in names)


@dataclass(frozen=True)
class MedusaParams:
    """``method.params`` of the medusa drafter."""

    # "train" (cached: methods.heads.medusa.store) | a heads directory (ours or published) | "init" | "random"
    heads: str = "train"
    num_heads: int = 4
    num_layers: int = 1
    steps: int = 200
    teacher: str = "self"
    joint: bool = False  # Medusa-2
    joint_steps: int = 30
    tree_budget: int = 0  # > 0: Medusa's greedy tree of this many nodes from the heads' measured accuracies
    top_k: int = 10  # Medusa's TOPK: the tree's choice indices must be < top_k
    seed: int = 0
    train: dict = field(default_factory=dict)  # further TrainConfig fields (batch_tokens, lr, ...)

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            num_heads=self.num_heads,
            num_layers=self.num_layers,
            steps=self.steps,
            teacher=self.teacher,
            joint=self.joint,
            joint_steps=self.joint_steps,
            seed=self.seed,
            **self.train,
        )

    @classmethod
    def from_method(cls, method: MethodConfig) -> MedusaParams:
        """The drafter's keys of ``method.params``; typical acceptance's keys belong to the verifier."""
        mine = {k: v for k, v in method.params.items() if k not in _VERIFIER_KEYS}
        return cls(**checked_params(cls, mine, "medusa"))


class MedusaDrafter:
    needs_hidden_states = True

    def __init__(self, heads: MedusaHeads, tree: Tree, sampling: SamplingParams, mode: str = "topk",
                 backbone: Backbone | None = None) -> None:
        assert mode in ("topk", "with_replacement", "without"), f"unknown candidate mode {mode!r}"
        assert tree.depth <= heads.num_heads, f"tree depth {tree.depth} > {heads.num_heads} Medusa heads"
        self.heads, self.tree, self.sampling, self.mode = heads.eval(), tree, sampling, mode
        self.backbone = backbone  # Medusa-2: the tuned target, decoded by the method and its baseline
        self._h: torch.Tensor | None = None
        self._trees: dict[int, tuple[Tree, list[int]]] = {}

    @classmethod
    def from_config(
        cls, method: MethodConfig, tree: Tree | None, models, sampling: SamplingParams
    ) -> MedusaDrafter:
        """Heads per ``method.params`` (MedusaParams); tree = the configured one, or Medusa's greedy tree of
        ``tree_budget`` nodes built from the accuracies measured with the heads. Medusa-2 (``joint``) changes
        the model: its jointly trained target is the drafter's ``backbone`` (``models.target`` is left as
        it is), which the run decodes on both sides (methods.drafters.registry.backbone_of)."""
        mp = MedusaParams.from_method(method)
        verifier = Verifier(method.verifier)
        heads, accuracy, backbone = _heads(mp, models)
        if mp.tree_budget > 0:
            assert accuracy is not None, "tree_budget needs measured accuracies (heads=train or a saved dir)"
            tree = greedy_tree(accuracy, mp.tree_budget, max_depth=heads.num_heads).tree
        elif tree is None:
            tree = Tree.chain(heads.num_heads)
        if tree.depth > heads.num_heads:  # e.g. a Sequoia tree sized without knowing K: heads stop at K
            warnings.warn(f"medusa: tree depth {tree.depth} cut to the {heads.num_heads} heads", stacklevel=2)
            tree = _prune(tree, [tree.size] * heads.num_heads)
        if max(tree.ranks) >= mp.top_k:
            raise ValueError(f"tree uses choice index {max(tree.ranks)} but method.params.top_k={mp.top_k}")
        if verifier == Verifier.chain and tree.width > 1:
            raise ValueError(f"verifier chain needs a chain tree, got {tree}: use specinfer or sequoia")
        mode = "topk" if sampling.greedy else _SAMPLED.get(verifier, "topk")
        return cls(heads, tree, sampling, mode, backbone)

    # ---- protocol -----------------------------------------------------------------------------------
    def reset(self, prompt: torch.Tensor) -> None:
        self._h = None

    def feedback(self, fb: StepFeedback) -> None:
        """Nothing to learn: the next hidden state arrives in the next DraftContext."""

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft:
        root = int(ctx.tokens[-1])
        if ctx.hidden is not None and ctx.hidden.shape[0] > 0:
            self._h = ctx.hidden[-1]  # (H,) the state that predicted the root; head d predicts root + d
        depth = min(self.tree.depth, ctx.max_new - 1)
        if self._h is None or depth < 1:
            return root_only(root, ctx.tokens.device)
        tree, widths = self._layout(depth)
        w = self.heads.heads[0][-1].weight
        h = self._h.to(w.device, w.dtype)
        logits = torch.stack([self.heads.head_logits(h, d) for d in range(1, depth + 1)]).float()  # (D, V)
        if self.mode == "topk":
            cands = [logits[d].topk(widths[d]).indices for d in range(depth)]
            q = None
        else:
            q_heads = probs(logits, self.sampling)  # (D, V) the heads' processed q
            cands = [_draw(q_heads[d], widths[d], self.mode, ctx.generator) for d in range(depth)]
            tree = _prune(tree, [c.numel() for c in cands])  # a support smaller than the width
            q = q_heads[np.minimum(tree.depths, depth - 1)]  # (N, V) row i: law of node i's children
        table = torch.full((depth + 1, max(widths)), root, dtype=torch.long, device=logits.device)  # (D+1, W)
        for d, c in enumerate(cands, start=1):
            table[d, : c.numel()] = c
        tokens = table[torch.as_tensor(tree.depths), torch.as_tensor(tree.ranks)]  # (N,) the root at [0, 0]
        dev = ctx.tokens.device
        return Draft(tree, tokens.to(dev), None if q is None else q.to(dev))

    def batched(self, max_rows: int) -> BatchMedusa:
        return BatchMedusa(self)

    @property
    def max_depth(self) -> int:
        """Levels the drafter can fill below the root: one head per depth."""
        return int(self.heads.num_heads)

    def with_tree(self, tree: Tree) -> MedusaDrafter:
        """The same heads, candidate mode and backbone on another tree (the calibration times the heads'
        pass per tree: one head per depth, each head's candidates, every node's token)."""
        return MedusaDrafter(self.heads, tree, self.sampling, self.mode, self.backbone)

    def _layout(self, depth: int) -> tuple[Tree, list[int]]:
        """The configured tree cut to ``depth`` levels and the candidates it needs from each head
        (memoised: at most tree.depth variants)."""
        if depth not in self._trees:
            tree = _prune(self.tree, [10**9] * depth)
            self._trees[depth] = (tree, _widths(tree))
        return self._trees[depth]


class BatchMedusa:
    """Medusa over a batch: the heads run once on the rows' hidden states (B, H); with deterministic top-k
    candidates and every row's full tree, the candidate table is built for all rows at once. Rows near
    their length limit, rows without a hidden state yet and sampled candidates go row by row through the
    one-sequence drafter."""

    needs_hidden_states = True

    def __init__(self, one: MedusaDrafter) -> None:
        self.one = one
        self.h: list[torch.Tensor | None] = []

    def join(self, prompts: list[torch.Tensor]) -> None:
        self.h += [None] * len(prompts)

    def leave(self, slot: int) -> None:
        leave_slot(self.h, slot)

    def feedback_batch(self, fb: BatchFeedback) -> None:
        pass

    @torch.inference_mode()
    def propose_batch(self, ctx: BatchContext) -> BatchDraft:
        for b, c in enumerate(ctx.rows):
            if c.hidden is not None and c.hidden.shape[0] > 0:
                self.h[b] = c.hidden[-1]
        one, full = self.one, self.one.tree.depth
        room = min(c.max_new for c in ctx.rows) - 1
        if one.mode != "topk" or room < full or any(h is None for h in self.h):
            drafts = []
            for h, c in zip(self.h, ctx.rows):
                one._h = h
                drafts.append(one.propose(c))
            return BatchDraft.from_drafts(drafts)
        tree, widths = one._layout(full)
        w = one.heads.heads[0][-1].weight
        h = torch.stack(self.h).to(w.device, w.dtype)  # (B, H)
        table = ctx.roots.to(w.device)[:, None, None].repeat(1, full + 1, max(widths))  # (B, D+1, W)
        for d in range(1, full + 1):
            table[:, d, : widths[d - 1]] = one.heads.head_logits(h, d).float().topk(widths[d - 1]).indices
        tokens = table[:, torch.as_tensor(tree.depths), torch.as_tensor(tree.ranks)]  # (B, N)
        return BatchDraft(tokens.to(ctx.roots.device), [tree])


def _widths(tree: Tree) -> list[int]:
    """Candidates needed from head d (entry d-1): the largest rank at depth d, plus one."""
    out = np.zeros(tree.depth, dtype=np.int64)
    np.maximum.at(out, tree.depths[1:] - 1, np.asarray(tree.ranks[1:]) + 1)
    return out.tolist()


def _prune(tree: Tree, widths: list[int]) -> Tree:
    """Drop each node deeper than len(widths) or whose rank at depth d is >= widths[d-1], and its subtree."""
    ok = [d <= len(widths) and r < widths[d - 1] for d, r in zip(tree.depths, tree.ranks)]
    keep = kept_nodes(tree, ok)
    return tree if len(keep) == tree.size else subtree(tree, keep)


def _draw(q: torch.Tensor, n: int, mode: str, generator: torch.Generator) -> torch.Tensor:
    """n candidates from q (V,): i.i.d. (with replacement), or a without-replacement sequence (fewer when q's
    support is smaller than n)."""
    cands, drawn = draw_candidates(q, n, mode, generator)
    return cands[drawn]


def _heads(mp: MedusaParams, models) -> tuple[MedusaHeads, np.ndarray | None, Backbone | None]:
    """Load / train / initialise the heads on the target's device and dtype; measured accuracy if known;
    Medusa-2's tuned target (a new model on the target's device and dtype; None for Medusa-1)."""
    target = models.target
    lm = target.get_output_embeddings().weight  # (V, H)
    cfg = HeadsConfig(mp.num_heads, mp.num_layers, hidden_size=lm.shape[1], vocab_size=lm.shape[0])
    accuracy, backbone = None, None
    if mp.heads in ("init", "random"):
        heads = MedusaHeads.from_lm_head(cfg, lm.detach())
        if mp.heads == "random":  # random ResBlocks: heads that disagree with the LM head (tests)
            g = torch.Generator().manual_seed(mp.seed)
            with torch.no_grad():
                for p in heads.parameters():
                    p.add_(torch.randn(p.shape, generator=g).to(p) * 0.5 * p.std().clamp_min(0.02))
    elif mp.heads == "train":
        from methods.heads.medusa.store import ensure_medusa  # heavy (corpus, training): only when asked

        built = ensure_medusa(target, models.tokenizer, mp.train_config())
        loaded = load_heads(built.heads_dir)
        heads, accuracy = loaded.heads, built.accuracy
        if built.target_dir is not None:  # Medusa-2: the jointly trained target, a model of its own
            from transformers import AutoModelForCausalLM

            tuned = AutoModelForCausalLM.from_pretrained(built.target_dir, local_files_only=True)
            tuned = tuned.to(device=lm.device, dtype=lm.dtype).eval()
            backbone = Backbone(tuned, f"medusa-2 tuned target {built.root.name}")
    else:
        loaded = load_heads(Path(mp.heads))
        heads = loaded.heads
        acc = loaded.meta.get("accuracy")
        accuracy = np.asarray(acc) if acc is not None else None
    got = (heads.cfg.hidden_size, heads.cfg.vocab_size)
    if got != (cfg.hidden_size, cfg.vocab_size):
        raise ValueError(
            f"medusa heads {mp.heads!r} are for (hidden, vocab) = {got}, the target has "
            f"{(cfg.hidden_size, cfg.vocab_size)}"
        )
    return heads.to(device=lm.device, dtype=lm.dtype).eval(), accuracy, backbone
