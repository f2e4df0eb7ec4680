"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding"; reference code hao-ai-lab/LookaheadDecoding): no draft model. p = target; the "draft" is an
n-gram pool filled by Jacobi iteration, q is one-hot (Draft.q = None: greedy / deterministic verification).

Notation: W = window, N = n-gram size (level), G = at most G verification candidates per step. The 2D
Jacobi window holds N-1 levels (trajectories): level 0 is the oldest, W-1 tokens, level l >= 1 has W. Each
step runs ONE target forward over one tree that holds both branches:
- the verification branch: up to G pooled (N-1)-grams keyed by the root token, merged into a trie
  (nodes 0..n_verifiable-1, verified losslessly by the loop);
- the lookahead branch (later nodes, never accepted, KV dropped): level 0 is a chain from the root, c_1 …
  c_{W-1} (c_0 = the root), and the token at level l, index i has parent c_i (l = 1) or (l-1, i) (l >= 2).
  Its depth, hence its position, is i + l.
Equivalence with the paper's mask (the reference's ``j_make_causal_mask_multilevel`` and position ids):
there, level l >= 1 index i attends to the root and level-0 tokens before index i (causal block), and to
index i of levels 1..l; its position is root + i + l — exactly the ancestors and depth of the tree above,
so tree attention (each node sees its ancestors + the committed prefix) is the paper's mask, not an
approximation. The branches do not see each other (disjoint subtrees of the root).
The target's argmax at the last level's W nodes is the next Jacobi iterate: the N-grams
(c_i, level 1..N-2 at i, output i) go into the pool keyed by c_i, the window shifts one trajectory
(``ALWAYS_FWD_ONE`` of the reference), and the last level becomes the outputs. The first N-2 steps fill the
levels one by one from a level 0 of W+N-3 tokens drawn from the prompt, as the reference does.
Pool: per first token a list of at most G (N-1)-grams, least recently used dropped first; the prompt's and
the generated text's N-grams are seeded into it (the reference's POOL_FROM_PROMPT).
Departures, all without effect on the output (lossless either way): candidates sharing a prefix are merged
into a trie (the reference feeds G separate chains, duplicating shared prefixes); candidates are verified
during the N-2 warm-up steps too (the reference waits for a full window); near the end of the generation
(fewer new tokens allowed than the lookahead branch is deep) the step carries the verification branch alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from methods.core.drafter import Draft, DraftContext, StepFeedback
from methods.drafters.params import checked_params
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree


@dataclass(frozen=True)
class LookaheadParams:
    level: int = 5  # N
    window: int = 7  # W
    guess_set: int = 7  # G
    pool_from_prompt: bool = True

    @classmethod
    def from_method(cls, method: MethodConfig) -> LookaheadParams:
        out = cls(**checked_params(cls, method.params, "lookahead"))
        if out.level < 3 or out.window < 2 or out.guess_set < 1:
            raise ValueError(f"lookahead needs level (N) >= 3, window (W) >= 2, guess_set (G) >= 1, "
                             f"got {out}")
        return out

    @property
    def branch_tokens(self) -> int:
        """Nodes of a full lookahead branch: (W-1) + (N-2)·W."""
        return self.window - 1 + (self.level - 2) * self.window

    @property
    def extra_verify_tokens(self) -> int:
        """Tokens of a full step's forward beyond one chain of N-1 candidates (the tree the simulator
        prices τ on): the lookahead branch and G-1 more candidates (an upper bound: shared prefixes merge)."""
        return self.branch_tokens + (self.guess_set - 1) * (self.level - 1)


class NgramPool:
    """(N-1)-grams keyed by their preceding token; at most ``size`` per key, least recently used dropped."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.grams: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, gram: tuple[int, ...]) -> None:
        grams = self.grams.setdefault(key, [])
        if gram in grams:
            grams.remove(gram)  # refreshed: most recent last
        elif len(grams) >= self.size:
            del grams[0]
        grams.append(gram)

    def candidates(self, key: int) -> list[tuple[int, ...]]:
        """Most recent first."""
        return self.grams.get(key, [])[::-1]


@dataclass
class _Step:
    """What propose laid out: the lookahead outputs' nodes (empty: no lookahead branch this step) and the
    key node of each column (c_i) — read back in feedback."""

    out_nodes: list[int]
    key_tokens: list[int]


class Lookahead:
    needs_hidden_states = False

    def __init__(self, params: LookaheadParams) -> None:
        self.params = params
        self.tree = Tree.chain(params.level - 1)  # the priced tree: one chain (see extra_verify_tokens)
        self.forward_tokens = 0  # statistics over the drafter's life: nodes of the verify forwards, steps
        self.steps = 0
        self.reset(torch.zeros(0, dtype=torch.long))

    @classmethod
    def from_config(cls, method: MethodConfig, tree: Tree | None, models, sampling) -> Lookahead:
        lp = LookaheadParams.from_method(method)
        if Verifier(method.verifier) not in (Verifier.greedy, Verifier.deterministic):
            raise ValueError("lookahead drafts are deterministic n-grams: verifier greedy or deterministic")
        if method.verify_extra_tokens != lp.extra_verify_tokens:
            raise ValueError(f"lookahead {lp}: set method.verify_extra_tokens={lp.extra_verify_tokens} "
                             f"((W-1) + (N-2)W + (G-1)(N-1)), got {method.verify_extra_tokens}")
        return cls(lp)

    def reset(self, prompt: torch.Tensor) -> None:
        self.pool = NgramPool(self.params.guess_set)
        self.levels: list[list[int]] = []  # filled lazily: the first propose has the run's generator
        self.prompt = prompt.tolist()
        self._indexed = 0  # committed tokens whose N-grams are in the pool
        self._step = _Step([], [])

    def run_stats(self) -> dict[str, float]:
        """For metrics.json (warm-up decodes included): tokens per verify forward, both branches."""
        return {"verify_forward_tokens": self.forward_tokens / self.steps if self.steps else 0.0}

    # ---- propose --------------------------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> Draft:
        root = int(ctx.tokens[-1])
        if self.params.pool_from_prompt:
            self._index_text(ctx.tokens)
        if not self.levels:
            self.levels = [self._initial_level(ctx.generator)]
        parents, tokens = self._trie(root, ctx.max_new)
        n_ver = len(tokens)
        la_depth = len(self.levels[0]) + len(self.levels) - 1  # the deepest lookahead node's depth
        self._step = _Step([], [])
        if la_depth <= ctx.max_new:
            self._lookahead_branch(parents, tokens, root)
        self.forward_tokens += len(tokens)
        self.steps += 1
        tree = Tree.from_parents(parents)
        n_ver = n_ver if n_ver < len(tokens) else None  # None: no lookahead branch this step
        return Draft(tree, torch.tensor(tokens, dtype=torch.long), None, n_ver)

    def _initial_level(self, generator: torch.Generator) -> list[int]:
        """Level 0 before warm-up: W+N-3 tokens copied at random from the prompt (the reference's default)."""
        p, src = self.params, self.prompt
        idx = torch.randint(len(src), (p.window + p.level - 3,), generator=generator, device=generator.device)
        return [src[i] for i in idx.tolist()]

    def _index_text(self, tokens: torch.Tensor) -> None:
        """Seed the pool with the committed text's N-grams not yet seen (prompt, then generated)."""
        n, t = self.params.level, tokens.numel()
        if t - self._indexed < 1:
            return
        start = max(self._indexed - n + 1, 0)
        seq = tokens[start:t].tolist()
        for s in range(len(seq) - n + 1):
            self.pool.add(seq[s], tuple(seq[s + 1 : s + n]))
        self._indexed = t

    def _trie(self, root: int, max_new: int) -> tuple[list[int], list[int]]:
        """The verification branch: the root's pooled candidates (cut to ``max_new`` tokens) as a trie."""
        parents, tokens = [-1], [root]
        children: dict[tuple[int, int], int] = {}  # (parent node, token) → node
        for gram in self.pool.candidates(root):
            node = 0
            for tok in gram[:max_new]:
                nxt = children.get((node, tok))
                if nxt is None:
                    nxt = children[(node, tok)] = len(tokens)
                    parents.append(node)
                    tokens.append(tok)
                node = nxt
        return parents, tokens

    def _lookahead_branch(self, parents: list[int], tokens: list[int], root: int) -> None:
        """Append the window's levels (see the module docstring); remember where the outputs are."""
        levels = self.levels
        chain = [0]  # c_0 = root, then level 0's nodes
        for tok in levels[0]:
            parents.append(chain[-1])
            chain.append(len(tokens))
            tokens.append(tok)
        above = chain  # level l-1's node at index i (level 0: c_i)
        for level in levels[1:]:
            row = []
            for i, tok in enumerate(level):
                parents.append(above[i])
                row.append(len(tokens))
                tokens.append(tok)
            above = row
        # outputs: the last level's nodes; with level 0 alone (first warm-up step), c_1 … (the reference's)
        out = above if len(levels) > 1 else chain[1:]
        self._step = _Step(out, [root, *levels[0]])

    # ---- feedback -------------------------------------------------------------------------------------
    def feedback(self, fb: StepFeedback) -> None:
        """The Jacobi update from the target's argmax at the lookahead outputs."""
        step = self._step
        if not step.out_nodes or fb.logits is None:
            return
        outs = fb.logits[step.out_nodes].argmax(-1).tolist()
        levels, full = self.levels, len(self.levels) == self.params.level - 1
        if not full:  # warm-up: every level drops its oldest column, the outputs become a new level
            new = outs if len(levels) == 1 else outs[1:]
            self.levels = [lv[1:] for lv in levels] + [new]
            return
        for i, out in enumerate(outs):  # the N-gram along column i
            self.pool.add(step.key_tokens[i], tuple(lv[i] for lv in levels[1:]) + (out,))
        self.levels = [levels[1][1:], *levels[2:], outs]
