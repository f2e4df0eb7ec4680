"""MTP drafter: DeepSeek-V3-style sequential multi-token prediction modules (methods.heads.mtp) on the frozen
target p draft chains and trees (q_k = module k); verification is the loop's, lossless.

After a verification the target's hidden states of the committed tokens arrive in ``DraftContext.hidden``;
module 1 reads the last ``window`` of them with the committed tokens shifted by one and its last position
gives the depth-1 candidates; module k reads module k-1's states with the tokens shifted by k, the draft's
own depth-(k-1) token (the spine: each depth's top candidate, or its draw) standing in for the token not yet
committed. Trees are filled Medusa's way: a depth-d node of rank r gets module d's rank-r candidate along
the spine (q = None: greedy / deterministic verifiers, lossless at any temperature). With chain /
specinfer at temperature > 0 the chain is drawn from the modules' processed laws and their rows returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
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
        self._cut: dict[int, tuple[Tree, list[int]]] = {}

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
        n = h.shape[0]
        tree, widths = self._layout(depth)
        ext = ctx.tokens[t - n :].tolist()  # x_{t-n} .. x_{t-1} (the root last)
        cands, q_rows = [], []
        for k in range(1, depth + 1):  # module k at position i reads x_{i+k}: window tokens shifted by k
            toks = torch.tensor(ext[k - 1 : k - 1 + n], device=h.device)[None]
            h = self.heads.step(k, h[None], toks)[0]  # (n, H)
            logits = self.heads.logits(k, h[-1]).float()  # (V,) q_k of x_{t-1+k}
            if self.sample:
                q = probs(logits[None], self.sampling)[0]
                top = torch.multinomial(q, 1, generator=ctx.generator)
                q_rows.append(q)
            else:
                top = logits.topk(widths[k - 1]).indices
            cands.append(top)
            ext.append(int(top[0]))
        table = torch.full((depth + 1, max(widths)), root, dtype=torch.long)
        for d, c in enumerate(cands, start=1):
            table[d, : c.numel()] = c.cpu()
        tokens = table[torch.as_tensor(tree.depths), torch.as_tensor(tree.ranks)]
        q = None
        if self.sample:
            q = torch.zeros(tree.size, q_rows[0].numel())
            q[:depth] = torch.stack(q_rows).cpu()
        return Draft(tree, tokens.to(ctx.tokens.device), q)

    def _layout(self, depth: int) -> tuple[Tree, list[int]]:
        if depth not in self._cut:
            tree = self.tree
            if tree.depth > depth:
                tree = subtree(tree, [i for i in range(tree.size) if tree.depths[i] <= depth])
            widths = np.zeros(depth, dtype=np.int64)
            np.maximum.at(widths, np.asarray(tree.depths[1:]) - 1, np.asarray(tree.ranks[1:]) + 1)
            self._cut[depth] = (tree, widths.tolist())
        return self._cut[depth]
