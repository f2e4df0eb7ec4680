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

import torch

from methods.core.drafter import Draft, DraftContext, StepFeedback, root_only
from methods.core.loop import subtree
from methods.core.sampling import SamplingParams, probs
from methods.drafters.params import checked_params
from methods.heads.mtp.module import MTPModules
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree

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


class MTPDrafter:
    needs_hidden_states = True

    def __init__(self, heads: MTPModules, tree: Tree, sampling: SamplingParams, sample: bool = False) -> None:
        keep = [i for i in range(tree.size) if tree.depths[i] <= heads.num_heads]
        self.heads, self.tree = heads.eval(), subtree(tree, keep) if len(keep) < tree.size else tree
        self.sampling, self.sample = sampling, sample
        assert not sample or self.tree.width <= 1, "sampled MTP drafts are chains"
        self._h: list[torch.Tensor] = []
        self._cut: dict[int, Tree] = {}

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
        states: dict[int, torch.Tensor] = {}  # node -> h^{k-1} row of the module that read it
        for k in range(1, tree.depth + 1):
            h, states = self._module(k, h, ext, tree, tokens, states)
            for v in self._expanding(tree, k - 1):
                logits = self.heads.logits(k, states[v]).float()  # (V,) q_k of v's children
                kids = tree.children[v]
                if self.sample:
                    law = probs(logits[None], self.sampling)[0]
                    top = torch.multinomial(law, 1, generator=ctx.generator)
                    q[v] = law.cpu()
                else:
                    top = logits.topk(max(tree.ranks[c] for c in kids) + 1).indices
                top = top.cpu()
                for c in kids:
                    tokens[c] = top[tree.ranks[c]]
        return Draft(tree, tokens.to(ctx.tokens.device), q)

    def _module(self, k: int, h: torch.Tensor, ext: list[int], tree: Tree, tokens: torch.Tensor,
                states: dict[int, torch.Tensor]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Module k over the committed prefix (its n-k+1 positions read x up to the root) and, with tree
        attention, one row per draft node v of depths 1..k-1 that leads to a depth-k node: row v reads
        v's token and module k-1's state at v's parent, so every node's children are conditioned on its
        own path (calibration conditions module k on the true tokens the same way). Returns the prefix
        rows of h^k and the state of every node that module k+1 reads (the root: the last prefix row)."""
        n_pre = h.shape[0] - (k > 1)  # module k-1's prefix less its root row
        nodes = [v for v in self._needed(tree, k) if v]  # depth 1..k-1, topological
        prev = [states[tree.parents[v]] for v in nodes]
        h_in = torch.cat([h[:n_pre]] + [p[None] for p in prev]) if nodes else h[:n_pre]
        toks = ext[k - 1 : k - 1 + n_pre] + [int(tokens[v]) for v in nodes]
        t = n_pre + len(nodes)
        allowed = torch.zeros(t, t, dtype=torch.bool)
        allowed[:n_pre, :n_pre] = torch.ones(n_pre, n_pre, dtype=torch.bool).tril()
        row = {v: n_pre + i for i, v in enumerate(nodes)}
        pos = torch.arange(t)
        for v, r in row.items():
            allowed[r, :n_pre] = True
            u = v
            while u:  # the node and its draft ancestors
                allowed[r, row[u]] = True
                u = tree.parents[u]
            pos[r] = n_pre - 1 + int(tree.depths[v])
        out = self.heads.step(k, h_in[None], torch.tensor(toks, device=h.device)[None], allowed, pos)[0]
        new = {0: out[n_pre - 1]} | {v: out[r] for v, r in row.items()}
        return out[:n_pre], new

    @staticmethod
    def _expanding(tree: Tree, d: int) -> list[int]:
        return [v for v in range(tree.size) if tree.depths[v] == d and tree.children[v]]

    def _needed(self, tree: Tree, k: int) -> list[int]:
        """Nodes of depth <= k-1 on a path to a depth-k node (the root included), in tree order."""
        keep: set[int] = set()
        for v in self._expanding(tree, k - 1):
            while v >= 0 and v not in keep:
                keep.add(v)
                v = tree.parents[v]
        return sorted(keep)

    def _layout(self, depth: int) -> Tree:
        if depth not in self._cut:
            tree = self.tree
            if tree.depth > depth:
                tree = subtree(tree, [i for i in range(tree.size) if tree.depths[i] <= depth])
            self._cut[depth] = tree
        return self._cut[depth]
