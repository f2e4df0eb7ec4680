"""task=calibrate: a drafter against the target on this device, measured Sequoia's way (Chen et al. 2024).

p = target, q = draft. Along the target's own generation on the calibration split (greedy, or sampled at the
workload's temperature) every position gets a one-level star tree of W children — q's top-W at temperature 0,
W draws without replacement from q otherwise — verified by the matching verifier against p; the histogram of
the accepted rank is the positional vector [0, p_1, …, p_W, p_none]. Also α_d of the drafter's chain/tree in
the real loop, and the cost table — t_AR (the loop's autoregressive step, t(1)) and, as ratios of it, the
target's t(n) (tree forwards of methods.core.engine), the draft step time and the loop's verification —
timed in interleaved rounds (methods.measurement.cost_table): a methods.measurement.profiles Profile, cached
for tree=sequoia and the simulator's hardware=cpu validation unless its timings scattered.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from itertools import takewhile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from methods.core.drafter import Draft, DraftContext
from methods.core.engine import ForwardOut, ModelEngine
from methods.core.loop import DecodeOptions, DecodeResult, decode, verify_step
from methods.core.metrics import AcceptStats
from methods.core.sampling import SamplingParams, draw_candidates, draw_without_replacement, probs
from methods.core.timing import (
    forward_round,
    forward_times,
    interleaved,
    ratio_clock,
    star_inputs,
    verify_times,
)
from methods.core.verify import NODE_RULES, rank_law, verifier_params, verify
from methods.data.workloads import calibration_prompts
from methods.drafters.autoregressive import Autoregressive
from methods.drafters.registry import NEEDS_DRAFT_MODEL, backbone_of, build_drafter, drafter_class
from methods.measurement.cost_table import (
    DRAFT,
    MAX_TIMING_DISPERSION,
    QFIRST,
    QLEVEL,
    QPASS,
    QPASS_CHAIN,
    QSHAPE,
    SHARED,
    T_AR,
    TIMING_ATTEMPTS,
    VCHAIN,
    VERIFY,
    VLOOP,
    VSIZES,
    VSTEP,
    CostTable,
    cost_table,
    ratio_standard_error,
    scatter_reason,
)
from methods.measurement.draft_shapes import (
    DRAFT_SHAPES,
    LOOP_SHAPE,
    WIDE_NODES,
    WIDE_SHAPE,
    wide_member_tree,
    wide_tree,
)
from methods.measurement.profiles import (
    LOOP_ACCEPTANCE,
    Profile,
    StarRule,
    device_name,
    load_profile,
    mean_forward_ratio,
    missing_budgets,
    profile_key,
    profile_lock,
    profile_path,
    refuse_unless_calibrating,
    save_profile,
    sequoia_tree_for,
    star_rule,
    timed_forward_law,
    varied_sizes,
)
from methods.models import Models, context_length, load_models
from specsim.acceptance import from_config
from specsim.adaptive_exit import ConfidenceTable
from specsim.config import RunConfig, TreeKind, Verifier
from specsim.cost import CostModel, DraftCost
from specsim.io import atomic_write_json
from specsim.multidraft import Replay, member_ranks
from specsim.tree import Tree
from specsim.trees import build_tree

__all__ = ["CalibrationResult", "Star", "StarRule", "calibrate", "ensure_profile", "measure_profile",
           "rank_vector", "sequoia_tree_for", "star_children", "star_ranks", "star_rule", "forward_times",
           "verify_times"]


# ---- the star tree ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Star:
    children: torch.Tensor  # (k,) tokens in rank order (k <= W)
    q: torch.Tensor | None  # (V,) the law they were drawn from; None = deterministic children


def star_children(q_logits: torch.Tensor, width: int, rule: StarRule, sampling: SamplingParams,
                  generator: torch.Generator) -> list[Star]:
    """One star per row of the draft logits (T, V): the top-W, or W draws from the processed q as the run's
    drafters draw them (``rule.draw_mode``): i.i.d. for SpecInfer, else without replacement by the
    exponential race (descending q/E, E ~ Exp(1), is a sequential draw ∝ q), where a row with fewer than W
    tokens of mass gets fewer children."""
    if not rule.sample:
        cands = q_logits.topk(width, dim=-1).indices  # (T, W)
        return [Star(c, None) for c in cands]
    q = probs(q_logits, sampling)  # (T, V)
    cands, drawn = draw_candidates(q, width, rule.draw_mode, generator)  # (T, W) each
    return [Star(c[ok], qt) for c, ok, qt in zip(cands, drawn, q)]


Rank = int | None | tuple[float, ...]  # an accepted rank (None: none), or the law of the ranks (star_ranks)


def star_ranks(p: torch.Tensor, roots: torch.Tensor, stars: Sequence[Star], rule: StarRule,
               generator: torch.Generator, params: Mapping | None = None) -> list[Rank]:
    """Verify one star tree per position with the configured verifier (methods.core.verify): p (T, V)
    processed target law after each root, roots (T,) root tokens; ``params``: method.params, whose verifier
    keys (typical acceptance's ε, δ) reach the verifier. The accepted child's rank (0-based), None if none —
    where the verifier decides without coin flips (greedy, typical). Where it flips them (T > 0: the
    rejection rules of Sequoia, SpecInfer and one-hot drafts), the exact law of the rank instead
    (``methods.core.verify.rank_law``: P(rank i) per child, none = 1 − the sum), the flips integrated out; and
    where the children were drawn from q, rank 0's probability is further averaged over the first draw:
    Σ_x min(p(x), q(x)), the acceptance of x ~ q (Leviathan et al. 2023, §3.1). The later ranks stay
    conditioned on the children drawn (their average over the draws is not tractable here: the residual
    after a rejection depends on which token was rejected). Each entry's expectation is the flipped
    indicator's, so the vector has the flipped estimator's mean and a smaller variance; s8-tau2 read
    vanilla grounded's flipped depth-1 rate one binomial s.e. above the exact one."""
    kwargs = verifier_params(rule.verifier, params or {})
    out: list[Rank] = []
    for t, star in enumerate(stars):
        k = int(star.children.numel())
        if k == 0:
            out.append(None)
            continue
        one_hot = star.q is None and rule.sample  # a proposal that came without q
        verifier = Verifier.deterministic if one_hot else rule.verifier
        if verifier in NODE_RULES:
            out.append(_exact_ranks(verifier, p[t], star))
            continue
        tree = Tree.from_parents([-1] + [0] * k)  # ranks 0..k-1 in order
        tokens = torch.cat([roots[t : t + 1].to(p.device), star.children.to(p.device)])  # roots: the host's
        q = None if star.q is None else star.q.expand(k + 1, -1)  # only row 0 (the root's) is read
        # the children's rows of p only feed the bonus token after an accepted leaf: not needed here
        res = verify(verifier, Draft(tree, tokens, q), p[t].expand(k + 1, -1), generator,
                     **(kwargs if verifier == rule.verifier else {}))
        out.append(tree.ranks[res.accepted[1]] if len(res.accepted) > 1 else None)
    return out


def _exact_ranks(verifier: Verifier, p: torch.Tensor, star: Star) -> tuple[float, ...]:
    """star_ranks' law of one star's accepted rank (p: (V,) the target law at its root)."""
    q = None if star.q is None else star.q.to(p.dtype)
    law = rank_law(verifier, p, q, star.children.to(p.device))
    if q is not None and verifier in (Verifier.sequoia, Verifier.specinfer):  # child 0 ~ q, integrated out
        law[0] = torch.minimum(p, q).sum()
    return tuple(law.tolist())


def rank_weights(ranks: Sequence[Rank], width: int) -> np.ndarray:
    """Expected counts [rank 0, …, rank W−1, none] of star_ranks' entries: one per accepted rank, a law's
    probabilities, none = positions − the accepted total (exact in expectation; clipped at 0)."""
    counts = np.zeros(width + 1)
    for r in ranks:
        if isinstance(r, tuple):
            counts[: len(r)] += r
        elif r is not None:
            counts[r] += 1
    counts[width] = max(0.0, len(ranks) - counts[:width].sum())
    return counts


def rank_vector(ranks: Sequence[Rank], width: int) -> list[float]:
    """Sequoia's [0, p_1, …, p_W, p_none] from accepted ranks (0-based; None: none accepted) or laws."""
    counts = rank_weights(ranks, width)
    assert counts.sum() > 0, "no position was verified"
    return [0.0, *(counts / counts.sum()).tolist()]


def first_rank_probabilities(ranks: Sequence[Rank]) -> np.ndarray:
    """Each position's probability that its star accepted the rank-0 child (1/0 for a flipped or greedy
    rank): p_1, the rate a chain is priced on at every depth and a tree's heaviest entry."""
    return np.array([(r[0] if r else 0.0) if isinstance(r, tuple) else float(r == 0) for r in ranks],
                    dtype=float)


# ---- one calibration ------------------------------------------------------------------------------------
@dataclass
class _Run:
    cfg: RunConfig
    models: Models
    target: ModelEngine
    draft: ModelEngine | None  # the draft model's, when there is one
    drafter: Any  # methods.core.drafter.Drafter, built for the depth tree
    tree: Tree  # the drafter's chain/tree for acceptance_by_depth
    prompts: list[torch.Tensor]
    sampling: SamplingParams
    generator: torch.Generator
    bar: tqdm
    tree_built: Any = None  # :func:`tree_drafter`'s, built on first use

    @property
    def eos(self) -> int | None:
        return self.models.tokenizer.eos_token_id if self.models.tokenizer is not None else None


def depth_tree(cfg: RunConfig) -> Tree:
    """The tree whose real decoding gives acceptance_by_depth: the configured one, or a chain of tree.gamma
    when the configured tree is itself chosen from the calibration (sequoia) or per context (dynamic)."""
    if TreeKind(cfg.tree.kind) in (TreeKind.sequoia, TreeKind.dynamic, TreeKind.none):
        return Tree.chain(cfg.tree.gamma)
    return build_tree(cfg.tree, from_config(cfg.method.acceptance), CostModel.from_config(cfg))


def priced_tokens(cfg: RunConfig, tree: Tree) -> int:
    """Tokens of the loop's verify forward as the simulator prices it (specsim.cost's verify_tokens)."""
    return tree.size + (cfg.method.verify_extra_tokens if tree.depth > 0 else 0)


def loop_forward_tokens(cfg: RunConfig, run: _Run, sizes: Mapping[int, int] | None = None) -> int:
    """Tokens of the loop's verify forward, after the depth run: what the drafter counted itself
    (``run_stats()["verify_forward_tokens"]``, Lookahead: both branches, the trie as full as the pool was),
    the chain it drafted where its draft length adapts (Draft & Verify's exit: 1 + the mean draft length;
    the loop's verification overhead is its verify time less t(this), and the longest chain's t(9) read it
    0.03 t(1) where it is 0.16), the mean size of the drafts the depth run proposed where they fell short of
    the tree (``sizes``: prompt lookup proposes nothing where no n-gram matches), else the priced tree."""
    stats = run.drafter.run_stats() if hasattr(run.drafter, "run_stats") else {}
    mean = stats.get("verify_forward_tokens")
    if mean:
        return max(run.tree.size, round(mean))
    if stats.get("draft_steps") and "mean_draft_length" in stats:
        return max(1, min(run.tree.size, round(1 + stats["mean_draft_length"])))
    priced = priced_tokens(cfg, run.tree)
    if sizes and priced == run.tree.size:
        drafted = sum(n * c for n, c in sizes.items()) / max(sum(sizes.values()), 1)
        return max(1, min(priced, round(drafted)))
    return priced


class SizeRecorder:
    """A drafter that counts the size of every draft it proposes (the loop's verify forward: root
    included) and its nodes per depth, away from the generation's end — a draft cut at max_new_tokens is
    the truncation's, priced apart (specsim.expected). Everything else is the wrapped drafter's."""

    def __init__(self, drafter: Any, depth: int) -> None:
        self._drafter, self._depth = drafter, depth
        self.sizes: dict[int, int] = {}
        self._levels = np.zeros(depth + 1)  # nodes per depth (root first), summed over the counted drafts

    def propose(self, ctx: DraftContext) -> Draft:
        draft = self._drafter.propose(ctx)
        if ctx.max_new > self._depth:
            self.sizes[draft.tree.size] = self.sizes.get(draft.tree.size, 0) + 1
            if self._depth > 0:  # depth 0 counts sizes alone: inside a timed loop, its draft timer's
                # (the nodes per depth of a new tree each step, prompt lookup's: +0.02-0.04 t(1) per step)
                levels = draft.tree.level_sizes()[: self._depth + 1]
                self._levels[: levels.size] += levels
        return draft

    @property
    def level_means(self) -> list[float]:
        """Mean nodes per depth (root first) of the counted drafts: SpecInfer's merged trees share their
        members' common prefixes, a share that depends on the depth (profiles.merged_size)."""
        steps = sum(self.sizes.values())
        return (self._levels / steps).tolist() if steps else []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)


class FirstDraftTimer:
    """A drafter whose proposals are timed, each generation's first apart from its later ones: work done
    once per generation in the first step (EAGLE's head appends the prompt's rows to its cache there) is a
    cost per generation, not per step. In a generation of N tokens it adds E / steps to the mean step, which
    the calibration's 32-token loops and a run's longer generations (fewer steps per token at high τ, more
    steps at 48 tokens) share out differently: fitted per step, it priced EAGLE-1's trees' draft 5-19% high
    on the grounded workload's 384-token prompts (quiet sweep zoo10). Everything else is the wrapped
    drafter's."""

    def __init__(self, drafter: Any) -> None:
        self._drafter = drafter
        self._first: list[float] = []  # per generation, its first proposal (seconds)
        self._later: list[float] = []  # per generation, the mean of its later proposals
        self._times: list[float] = []

    def reset(self, prompt: torch.Tensor) -> None:
        self._close()
        self._drafter.reset(prompt)

    def propose(self, ctx: DraftContext) -> Draft:
        t0 = time.perf_counter()
        draft = self._drafter.propose(ctx)
        self._times.append(time.perf_counter() - t0)
        return draft

    def _close(self) -> None:
        if len(self._times) >= 2:  # a generation of one step tells nothing apart
            self._first.append(self._times[0])
            self._later.append(float(np.mean(self._times[1:])))
        self._times = []

    def excess_s(self) -> float:
        """The first step's proposal beyond a later step's, mean over the generations so far (seconds)."""
        self._close()
        return float(np.mean(self._first) - np.mean(self._later)) if self._first else 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)


def _steady_draft(r: DecodeResult, timer: FirstDraftTimer, name: str) -> dict:
    """A decode's draft per step without its first step's excess E (``timer``, wrapping its drafter), as
    (QSHAPE, name), and E as (QFIRST, name): the per-step terms are fitted on the former
    (profiles.draft_terms), E is priced once per generation (profiles.first_draft_s)."""
    excess = timer.excess_s()
    steps = max(r.n_target_forwards, 1)
    return {(QSHAPE, name): (r.time_draft_s - excess) / steps, (QFIRST, name): excess}


def _forward_all(engine: ModelEngine, seq: torch.Tensor, hidden: bool = False) -> ForwardOut:
    """Logits (and hidden states) at every position of seq (T,), causally, leaving the engine empty."""
    engine.reset()
    out = engine.extend(seq.to(engine.device), list(range(-1, seq.numel() - 1)), hidden=hidden)
    engine.drop_pending()
    return out


def _draft_model_law(run: _Run, seq: torch.Tensor, target: ForwardOut, roots: torch.Tensor, depth: int = 1
                     ) -> torch.Tensor:
    """q after each root: the draft model's logits over the same sequence (depth 1 only: at depth d the draft
    model reads the true prefix, so its star there is a depth-1 star at a later position)."""
    assert depth == 1, "the draft model's law is positional"
    return _forward_all(run.draft, seq).logits[roots]  # (T, V)


def _medusa_law(run: _Run, seq: torch.Tensor, target: ForwardOut, roots: torch.Tensor, depth: int = 1
                ) -> torch.Tensor:
    """q of the depth-``depth`` children: Medusa head ``depth`` on the hidden state that predicted the root
    (as its drafter proposes them: every head reads that one state)."""
    heads = run.drafter.heads
    h = target.hidden[roots - 1]  # (T, H)
    with torch.inference_mode():
        return heads.head_logits(h.to(heads.heads[0][-1].weight.dtype), depth).float()  # (T, V)


def _eagle_law(run: _Run, seq: torch.Tensor, target: ForwardOut, roots: torch.Tensor, depth: int = 1
               ) -> torch.Tensor:
    """q of the depth-``depth`` children of the EAGLE head along the trajectory: training-time-test rollout
    step depth-1 (methods.heads.eagle.train.rollout), which is exactly the drafter's depth-d node with the
    accepted path as its ancestors (tests/methods/test_eagle.py checks the two agree). Row r+d-2 holds the
    node whose committed context ends at the root r."""
    from methods.heads import trainer
    from methods.heads.eagle.train import rollout

    head = run.drafter.head
    feats = trainer.target_features(run.models.target, seq[None].to(run.models.device),
                                    tuple(run.drafter.feature_layers), desc="eagle law")
    src = feats.layers if run.drafter.feature_layers else feats.hidden  # (1, T, k H)
    w = head.fc.weight
    with torch.inference_mode():
        h0 = head.fuse(src[:, :-1].to(w.device, w.dtype))
        g = rollout(head, h0, seq[None, 1:].to(w.device), depth - 1)[-1][0]  # (T-1, H)
        return head.logits(g[roots + depth - 2]).float()  # (T', V)


def _self_draft_law(run: _Run, seq: torch.Tensor, target: ForwardOut, roots: torch.Tensor, depth: int = 1
                    ) -> torch.Tensor:
    """q after each root (ascending positions) from the drafter's own sub-layers of the target
    (``drafter.sub``: LayerSkip's early exit, Draft & Verify's skipped sub-layers) as the loop drafts it:
    the root through the sub-layers over the target's full KV of the committed prefix (the verify forward
    wrote it), then the root committed by a full forward. A sub-layer forward over the whole sequence is
    the same for LayerSkip (its layers [0, E) see the same inputs either way) but not for Draft & Verify:
    its later kept layers would read a prefix KV the skipped layers never fed, a worse draft than the loop's
    (prose T = 1 read τ −5.0% on 33 prompts). Positional: deeper Draft & Verify drafts also read the earlier
    drafts' skipped-layer KV, which this law does not (an approximation at depth > 1)."""
    assert depth == 1, "the self-draft law is positional"
    engine, rows = run.target, []
    engine.reset()
    for r in roots.tolist():
        engine.prefill(seq[engine.length : r].to(engine.device))  # the full model's KV before the root
        rows.append(engine.extend(seq[r : r + 1].to(engine.device), [-1], sub=run.drafter.sub).logits[-1])
        engine.drop_pending()
    return torch.stack(rows)  # (T, V)


def _mtp_law(run: _Run, seq: torch.Tensor, target: ForwardOut, roots: torch.Tensor, depth: int = 1
             ) -> torch.Tensor:
    """q of the depth-``depth`` children: MTP module ``depth`` along the trajectory (modules 1..depth over
    the target's hidden states with the true tokens, which are the accepted prefix), at the position whose
    hidden state predicted the root; its attention window as in drafting."""
    heads = run.drafter.heads
    h = target.hidden[None].to(heads.lm_head.dtype)  # (1, T-1, H): position i predicted seq[i + 1]
    n = h.shape[1]
    with torch.inference_mode():
        for k in range(1, depth + 1):
            toks = seq[k : k + n].to(h.device)
            h = heads.step(k, h[:, : toks.numel()], toks[None])
        return heads.logits(depth, h[0, roots - 1]).float()  # (R, V)


Law = Callable[..., torch.Tensor]  # (run, seq, target ForwardOut, roots (T,), depth) → q logits (T, V)
LAWS: dict[str, Law] = {  # drafter name → its law q
    "draft_model": _draft_model_law,
    "medusa": _medusa_law,
    "staged": _draft_model_law,  # the spine's children are the draft model's top-k at the true prefix
    "eagle": _eagle_law,
    "eagle3": _eagle_law,
    "layerskip": _self_draft_law,
    "draft_verify": _self_draft_law,
    "mtp": _mtp_law,
}
# drafters whose proposals follow the verifications (Lookahead's Jacobi window lives on the target's outputs
# at its lookahead branch): no star tree can be drawn off-line, their acceptance comes from the real loop
LOOP_DRAFTERS = LOOP_ACCEPTANCE  # acceptance from the loop's histogram, not from star trees


def star_depths(run: _Run) -> int:
    """Depths that get their own star vector: Medusa's heads (head d drafts depth d); for a proposal drafter
    (no law here) and EAGLE's head the depth tree's depth; 1 for a positional law (the draft model)."""
    if run.cfg.method.drafter not in LAWS or run.cfg.method.drafter in ("eagle", "eagle3"):
        return max(1, run.tree.depth)  # EAGLE: its law at every depth of the depth tree
    heads = getattr(run.drafter, "heads", None)
    per_depth = run.cfg.method.drafter in ("medusa", "mtp")  # one law per depth (head / module d)
    return int(heads.num_heads) if per_depth and heads is not None else 1


def _law_stars(
    run: _Run, law: Law, rule: StarRule, seq: torch.Tensor, target: ForwardOut, roots: torch.Tensor,
    depths: int,
) -> Iterator[tuple[torch.Tensor, list[Star]]]:
    """Per depth d = 1, 2, …: (parent positions, stars) drawn from the law of depth d at each root whose
    depth-d node is still inside the trajectory; the parent token sits d-1 positions after the root."""
    for d in range(1, depths + 1):
        at = roots[: roots.numel() - (d - 1)]
        yield at + d - 1, star_children(law(run, seq, target, at, d), run.cfg.calibration.width,
                                        rule, run.sampling, run.generator)


def _by_depth(proposed: list[tuple[int, int, Star]], depths: int
              ) -> Iterator[tuple[torch.Tensor, list[Star]]]:
    """_proposed's (depth, parent position, star) grouped per depth d = 1, 2, …, as _law_stars yields them."""
    for d in range(1, depths + 1):
        at = [(pos, star) for depth, pos, star in proposed if depth == d]
        yield torch.tensor([pos for pos, _ in at], dtype=torch.long), [star for _, star in at]


PROPOSAL_STARS = "sampled drafts: depth 1"  # _proposed's rule for drafts sampled from q (a profile mark)


def _proposed(run: _Run, seq: torch.Tensor, n_prompt: int, hidden: torch.Tensor | None, max_depth: int
              ) -> list[tuple[int, int, Star]]:
    """Drafters without a law here (stateless ones such as prompt lookup; verification feedback is not
    given): their own proposal at each position, followed along the trajectory. Returns (depth, parent
    position, star): the root's children at depth 1, and at depth d the children of the depth-(d-1) node
    that equals the trajectory's token — the prefix a verification accepted — down to ``max_depth``. A node
    without children there is an empty star (the step ends: counted as none accepted).

    Drafts sampled from q (``Draft.q`` given: Online SD's draft model at T > 0) give depth-1 stars only. A
    sampled child equal to the trajectory's token (itself a draw from p) is a coincidence of two draws, not
    the rejection verifier's acceptance (min(1, p/q)): the stars below it are conditioned on positions where
    p and q are both peaked, and few (Online's prose T = 1 profile read 0.59, 0.63, 1.0 at depths 1-3 and
    predicted τ +19% over the test run; the depth-1 vector i.i.d. predicts 2.25 against 2.26 measured). Such
    a drafter's q at a later position is its depth-1 law there (a draft model reads the accepted prefix)."""
    run.drafter.reset(seq[:n_prompt])
    width, last, out = run.cfg.calibration.width, seq.numel() - 1, []
    for t in range(n_prompt - 1, last):
        h = hidden[t - 1 : t] if hidden is not None and t >= 1 else None
        draft = run.drafter.propose(DraftContext(seq[: t + 1], h, run.generator, last - t))
        tree, node, depth = draft.tree, 0, 1
        deepest = 1 if draft.q is not None else max_depth
        while depth <= deepest and t + depth - 1 < last:
            kids = sorted(tree.children[node], key=lambda c: tree.ranks[c])[:width]
            q = None if draft.q is None else draft.q[node]
            out.append((depth, t + depth - 1, Star(draft.tokens[list(kids)], q)))
            match = [c for c in kids if int(draft.tokens[c]) == int(seq[t + depth])]
            if not match:
                break
            node, depth = match[0], depth + 1
    return out


def _trajectories(run: _Run) -> list[torch.Tensor]:
    """The target's own continuations (prompt + generated) of the calibration prompts."""
    seqs = []
    for ids in run.prompts:
        r = decode(run.target, Autoregressive(), ids, _ar_opts(run), run.generator)
        seqs.append(torch.cat([ids, torch.tensor(r.token_ids, dtype=torch.long)]))
        run.bar.update()
    return seqs


def _star_ranks(run: _Run, seqs: list[torch.Tensor]
                ) -> tuple[list[list[Rank]], list[list[list[int]]] | None, list[int]]:
    """Accepted ranks of the star trees, per depth: [0] at every position (the positional vector); [d-1] for
    d >= 2 for drafters whose depth-d children come from their own law (Medusa's head d), verified against
    the target's law d-1 tokens further along the trajectory (the prefix the tree reached), and for
    proposal drafters (prompt lookup: a copied span's tokens are right or wrong together), see _proposed.
    Second: the same ranks per trajectory and depth, by root (−1: none accepted), where they are the greedy
    loop's own (a law's top-W stars at temperature 0: specsim.replay), else None. Third: each trajectory's
    number of depth-1 stars (the prompts as sampling units of the vector: _exact_extra)."""
    rule, law = star_rule(run.cfg), LAWS.get(run.cfg.method.drafter)
    want_hidden = bool(getattr(run.drafter, "needs_hidden_states", False))
    depths = star_depths(run)
    ranks: list[list[Rank]] = [[] for _ in range(depths)]
    runs: list[list[list[int]]] | None = [] if records_rank_runs(run.cfg) else None  # where the walk is exact
    sizes: list[int] = []
    for ids, seq in zip(run.prompts, seqs):
        n_prompt = ids.numel()
        roots = torch.arange(n_prompt - 1, seq.numel() - 1)  # (T,) positions the target generated after
        out = _forward_all(run.target, seq, hidden=want_hidden)
        stars = (_law_stars(run, law, rule, seq, out, roots, depths) if law is not None
                 else _by_depth(_proposed(run, seq, n_prompt, out.hidden, depths), depths))
        mine: list[list[int]] = []
        for d, (parent, group) in enumerate(stars, 1):  # verified against p after the parent token
            got = star_ranks(probs(out.logits[parent], run.sampling), seq[parent], group, rule,
                             run.generator, run.cfg.method.params) if group else []
            ranks[d - 1] += got
            if d == 1:
                sizes.append(len(got))
            if runs is not None:  # a law's: root t's at [t]
                mine.append([-1 if r is None else int(r) for r in got] if run.sampling.greedy
                            else trajectory_ranks(group, seq[parent + 1]))
        if runs is not None:
            runs.append(mine)
        run.bar.update()
    return ranks, runs, sizes


def trajectory_ranks(stars: Sequence[Star], tokens: torch.Tensor) -> list[int]:
    """Per star, the rank of the trajectory's next token (``tokens``: one per star) among its children, −1
    if absent: at T > 0 the child a one-hot verifier accepts when the loop emits the trajectory's token.
    Recursive rejection of one-hot drafts accepts child x_j with probability p(x_j) and otherwise draws
    from p off the children, so the token it emits is a draw from p and the accepted child is the one equal
    to it: the loop is the walk along a trajectory sampled from p (specsim.replay), exactly."""
    out = []
    for star, tok in zip(stars, tokens.tolist()):
        hit = (star.children == tok).nonzero()
        out.append(int(hit[0, 0]) if hit.numel() else -1)
    return out


def _spec_opts(run: _Run, new_tokens: int | None = None) -> DecodeOptions:
    """The method's own decoding options (its verifier and that verifier's parameters, e.g. typical's)."""
    new = run.cfg.calibration.new_tokens if new_tokens is None else new_tokens
    return DecodeOptions.for_method(run.cfg.method, run.sampling, new, run.eos)


def _tree_opts(run: _Run) -> DecodeOptions:
    """The decoding options the loop is timed with on a tree that is not its own (the shapes, the wide tree):
    the method's, under :func:`tree_verifier`."""
    return DecodeOptions.for_method(tree_method(run.cfg), run.sampling, run.cfg.calibration.new_tokens,
                                    run.eos)


def _ar_opts(run: _Run) -> DecodeOptions:
    s = run.sampling
    return DecodeOptions(Verifier.greedy if s.greedy else Verifier.chain, s, run.cfg.calibration.new_tokens,
                         run.eos)


def _loop_ranks(stats: AcceptStats, depths: int) -> list[list[int | None]]:
    """A loop drafter's acceptance as a chain's star ranks: at depth d, of the steps that accepted d-1
    drafts, one rank-0 acceptance per step that accepted a d-th, None per step that did not — the ratio
    P(≥ d accepted) / P(≥ d-1) of the loop's histogram, so that a chain of ``depths`` predicts the loop's τ
    (Lookahead: τ from the measured acceptance of its verification branch, whatever its trie's shape)."""
    hist = stats.hist  # hist[k]: steps that accepted k drafts
    out = []
    for d in range(1, depths + 1):
        reached, accepted = sum(hist[d - 1 :]), sum(hist[d:])
        out.append([0] * accepted + [None] * (reached - accepted))
    return out


def _depth_run(run: _Run, n_prompts: int, new_tokens: int
               ) -> tuple[AcceptStats, list[list[int]], SizeRecorder, list[int], list[int]]:
    """The drafter's chain/tree through the real loop on ``n_prompts`` prompts, ``new_tokens`` each: its
    acceptance stats (α_d, by rank), each prompt's histogram of accepted drafts per step (the spread of
    acceptance over prompts: a batch's slowest row, specsim.batch.prompt_laws), how many of its drafts
    had each size and their nodes per depth (SizeRecorder: the law of the verify forward, where drafts can
    fall short of the tree or, SpecInfer's, merge), and per prompt the updates a drafter that learns between
    requests (``updates``: Online SD) had had when it decoded it (specsim.learning; all 0 for the others).
    A drafter that learns decodes the prompts again in LEARNING_ORDERS - 1 seeded orders, each with a fresh
    drafter (its trajectories: ``orders``, the order each histogram came from; all 0 for the others)."""
    stats, per_prompt, updates, orders = AcceptStats(), [], [], []
    recorder = drafter = SizeRecorder(run.drafter, run.tree.depth)  # the first order's drafts
    first, n_orders = run.prompts[:n_prompts], learning_orders(run)
    prompts = first
    if run.bar.total is not None:  # measure_profile counted one pass
        run.bar.total += (n_orders - 1) * len(prompts)
    for order in range(n_orders):
        if order:  # the run's drafter stays the first order's (timed below): later ones are built afresh
            drafter = build_drafter(run.cfg.method, run.tree if run.tree.size > 1 else None, run.models,
                                    run.sampling)
            shuffle = random.Random(f"specsim-learning-order|{order}|{run.cfg.seed}")
            prompts = shuffle.sample(first, len(first))
        for ids in prompts:
            one = decode(run.target, drafter, ids, _spec_opts(run, new_tokens), run.generator).stats
            stats.merge(one)
            per_prompt.append(list(one.hist))
            updates.append(len(getattr(drafter, "updates", ())))  # its reset distils before the prompt
            orders.append(order)
            run.bar.update()
    return stats, per_prompt, recorder, updates, orders


LEARNING_ORDERS = 3  # orders of the calibration prompts a drafter that learns between requests decodes


def learning_orders(run: _Run) -> int:
    """How many orders the depth run decodes its prompts in: LEARNING_ORDERS for a drafter that learns
    between requests (specsim.learning), else 1."""
    return LEARNING_ORDERS if getattr(run.drafter, "learns_every", 0) else 1


FORWARD_REPEAT = 3  # timed forwards of each size per round (their median): one forward is a noisy figure


def _cost_rounds(run: _Run, context: torch.Tensor, sizes: list[int], wide: Any = None) -> list[dict]:
    """Interleaved timing (methods.core.timing.interleaved): per round one autoregressive decode (the loop's
    step, t(1)), one decode with the drafter (seconds per draft step: one draft forward per level, or one
    pass for a single-pass drafter; the loop's verification per speculation step) and, for each size, the
    median of FORWARD_REPEAT tree forwards after ``context`` (t(n)). Round r decodes calibration prompt r
    (cycling). ``wide`` (:func:`wide_drafter`): the drafter on a wide tree, decoded once per round for the
    loop's verification per step on that tree (its forward and walk are timed beside ``sizes``')."""
    cal, m = run.cfg.calibration, run.cfg.method
    levels = max(run.tree.depth if m.draft_steps == "depth" else 1, 1)
    timed = sorted({*sizes, *([wide.tree.size] if wide is not None else [])})  # forwards and walks
    trees, tokens = star_inputs(run.target, timed, run.cfg.seed)
    prompt = {"ar": 0, "spec": 0, "wide": 0, **{name: 0 for name in DRAFT_SHAPES}}

    def next_prompt(path: str) -> torch.Tensor:
        i, prompt[path] = prompt[path], prompt[path] + 1
        return run.prompts[i % len(run.prompts)]

    def ar() -> dict:
        r = decode(run.target, Autoregressive(), next_prompt("ar"), _ar_opts(run), run.generator)
        return {T_AR: (r.time_total_s - r.time_prefill_s) / max(r.n_target_forwards, 1)}

    def spec() -> dict:
        before = _draft_counts(run.drafter)
        counted = SizeRecorder(run.drafter, 0)  # every step: the forwards whose verification is timed
        timer = FirstDraftTimer(counted)
        r = decode(run.target, timer, next_prompt("spec"), _spec_opts(run), run.generator)
        steps = max(r.n_target_forwards, 1)
        per_step = _forwards_per_step(before, _draft_counts(run.drafter)) or levels
        loop = _steady_draft(r, timer, LOOP_SHAPE) if shapes else {}
        sized = {(VSIZES, n): c for n, c in counted.sizes.items()}
        return {DRAFT: r.time_draft_s / steps / per_step, VERIFY: r.time_verify_s / steps, **loop, **sized}

    shapes = shape_drafters(run)

    def shaped() -> dict:  # the drafter's loop on each other tree shape, on the round's prompt
        out = {}
        for name, drafter in shapes.items():
            timer = FirstDraftTimer(drafter)
            r = decode(run.target, timer, next_prompt(name), _tree_opts(run), run.generator)
            out.update(_steady_draft(r, timer, name))
        return out

    def widened() -> dict:  # the loop's verification per step on the wide tree, on the round's prompt, and
        # (a drafter timed on the shapes) its draft there: the shape wide levels are priced from
        timer = FirstDraftTimer(wide)
        r = decode(run.target, timer, next_prompt("wide"), _tree_opts(run), run.generator)
        steps = max(r.n_target_forwards, 1)
        drafted = _steady_draft(r, timer, WIDE_SHAPE) if shapes else {}
        return {(VLOOP, wide.tree.size): r.time_verify_s / steps, **drafted}

    shared = {"on": True}
    checks = _verify_inputs(run, timed)
    levels_in = _draft_level_inputs(run, sizes)
    passes = _pass_inputs(run, context, sizes)

    def forwards() -> dict:
        run.target.reset()
        run.target.prefill(context)
        out = forward_round(run.target, trees, tokens, repeat=FORWARD_REPEAT)
        out.update(_verify_round(run, checks))
        if levels_in is not None:
            out.update(levels_in(context))
        if passes is not None:
            out.update(_pass_round(run, *passes))
        if shared["on"]:
            ratio = shared_verify_ratio(run, context)
            shared["on"] = ratio is not None and run.tree.size in out
            # the round's full t(n) of the chain's size times the saving timed back to back on one thread
            out.update({SHARED: ratio * out[run.tree.size]} if shared["on"] else {})
        return out

    paths = [ar, spec, forwards, *([shaped] if shapes else []), *([widened] if wide is not None else [])]
    return interleaved(paths, cal.reps, cal.warmup, cal.max_reps,
                       lambda done: ratio_standard_error(done) > cal.median_se)


def times_draft_shapes(drafter: Any, cfg: RunConfig, tree: Tree) -> bool:
    """Whether calibration times the drafter's loop on DRAFT_SHAPES beside its chain ``tree``: drafters that
    fill trees level by level with a model of their own (the draft model's, EAGLE's head: ``level_step``;
    SpecInfer's draft models, each on its member tree: ``fills_member_trees``), a chain at least 2 deep
    (SpecInfer: the member chain); ``drafter`` an instance or its class."""
    own = (hasattr(drafter, "level_step") or cfg.method.drafter in NEEDS_DRAFT_MODEL
           or getattr(drafter, "fills_member_trees", False))
    return own and cfg.method.draft_steps == "depth" and tree.width <= 1 and tree.depth >= 2


def shape_tree(run: _Run) -> Tree:
    """The tree the drafter's levels fill: SpecInfer's member tree (each draft model fills it on its own
    cache; the loop's union of K chains is merged from them), else the calibration's chain/tree."""
    member = getattr(run.drafter, "member_tree", None)
    return run.tree if member is None else member


def shape_drafters(run: _Run) -> dict[str, Any]:
    """The drafter built on each of DRAFT_SHAPES (none where :func:`times_draft_shapes` is false; SpecInfer:
    K members on each shape, merged), under :func:`tree_verifier` (a verifier of chains only, Leviathan's,
    verifies no tree: the key's tree verifier then). Timed in the workload's sampling mode: at T = 1 a
    sampled tree pays per node what a greedy one does not (q's rows, the draws; SpecInfer's merge stacks a q
    row per member node)."""
    if not times_draft_shapes(run.drafter, run.cfg, shape_tree(run)):
        return {}
    return {name: build_drafter(tree_method(run.cfg), DRAFT_SHAPES[name], run.models, run.sampling)
            for name in shape_names() if name != LOOP_SHAPE}


def shape_names() -> list[str]:
    """The calibration's own chain and every shape of DRAFT_SHAPES, whatever the run's verifier (the trees
    under :func:`tree_verifier`)."""
    return [LOOP_SHAPE, *DRAFT_SHAPES]


def tree_verifier(cfg: RunConfig) -> Verifier:
    """The verifier the calibration times trees with (the tree shapes' loops, the wide loop, the walks of
    trees, the draft's levels and passes on trees): the run's own, or where it verifies chains only
    (Leviathan's ``chain``), the one of the profile key's star rule (profiles.star_rule: Sequoia's at T > 0,
    greedy at T = 0), the verifier of the rows that share its key and verify trees. The key leaves the
    verifier out, and one profile serves both: on a chain Sequoia's verifier is Leviathan's walk
    (methods.core.verify._on_chain) and a draw of one child without replacement is a draw with it, so the
    loop's own chain is measured alike under either. Timed under the chain verifier alone, a profile lacked
    the trees a Sequoia row of its key prices and was measured again, overwriting the one the chain row
    was priced from (zoo11, zoo12: six chain T = 1 profiles, docs/validation.md)."""
    v = Verifier(cfg.method.verifier)
    return star_rule(cfg).verifier if v == Verifier.chain else v


def tree_method(cfg: RunConfig) -> Any:
    """``cfg.method`` under :func:`tree_verifier` (``cfg.method`` itself where that is its own verifier)."""
    v = tree_verifier(cfg)
    return cfg.method if v == Verifier(cfg.method.verifier) else replace(cfg.method, verifier=v)


def drafts_trees(drafter: Any, cfg: RunConfig, tree: Tree) -> bool:
    """Whether the calibration times ``drafter`` on trees beside its chain: level by level on the tree shapes
    (:func:`times_draft_shapes`) or one pass per tree (:func:`times_pass_per_tree`)."""
    return times_draft_shapes(drafter, cfg, tree) or times_pass_per_tree(drafter, cfg)


def tree_drafter(run: _Run) -> Any:
    """The drafter as :func:`tree_method` builds it (its candidate mode: Sequoia's draws without replacement
    where the run's chain verifier draws with it), for its timings on trees (the wide tree's pass, the
    passes and levels per tree); the run's own where the verifier is the same, or it drafts no tree."""
    if run.tree_built is None:
        method = tree_method(run.cfg)
        same = method is run.cfg.method or not drafts_trees(run.drafter, run.cfg, shape_tree(run))
        run.tree_built = run.drafter if same else build_drafter(method, run.tree, run.models, run.sampling)
    return run.tree_built


def times_wide_loop(drafter: Any, cfg: RunConfig, tree: Tree) -> bool:
    """Whether calibration times the loop's verification on a wide tree (:func:`wide_drafter`): a drafter
    built on any tree level by level (the shapes' drafters) or a one-pass drafter following its tree
    (Medusa's ``with_tree``), whose own tree is smaller, whatever the run's verifier (a verifier of chains
    only: under :func:`tree_verifier`); ``drafter`` an instance or its class, ``tree`` the tree its levels
    fill (SpecInfer's member tree: :func:`shape_tree`). SpecInfer too: its merged trees are timed at about
    their size (:func:`wide_shape_tree`); scaled in proportion to t(n) from its loop's union of 3 chains of
    4 (13 nodes) to the zoo's 61-node tree, its verify read 1-5% and its draft 2-5% of the step low
    (zoo10)."""
    return tree.size < WIDE_NODES and drafts_trees(drafter, cfg, tree)


def wide_drafter(run: _Run) -> Any | None:
    """The drafter on a tree of about WIDE_NODES nodes (None where :func:`times_wide_loop` is false): a
    one-pass drafter on its own kind of tree as deep as it drafts (pass_tree), else on
    :func:`wide_shape_tree` (SpecInfer: its member tree, merged from its K members)."""
    if not times_wide_loop(run.drafter, run.cfg, shape_tree(run)):  # SpecInfer: its member tree
        return None
    if times_pass_per_tree(run.drafter, run.cfg):
        top_k = int(run.cfg.method.params.get("top_k", 0) or 0) or LEVEL_CHILDREN
        return tree_drafter(run).with_tree(pass_tree(WIDE_NODES, int(run.drafter.max_depth), top_k))
    return build_drafter(tree_method(run.cfg), wide_shape_tree(run), run.models, run.sampling)


def wide_shape_tree(run: _Run) -> Tree:
    """The tree the wide loop's drafter is built on, the draft shape WIDE_SHAPE: :func:`wide_tree`, or for a
    drafter that fills member trees (SpecInfer), :func:`wide_member_tree`: the depth and, merged, the size
    its trees run at."""
    return wide_member_tree() if getattr(run.drafter, "fills_member_trees", False) else wide_tree()


LEVEL_WIDTHS = (1, 2, 4, 8, 16, 32)  # draft levels timed per width (nodes fed), up to the largest size
LEVEL_CHILDREN = 4  # children drawn per fed node when a level is timed


def _draft_modes(run: _Run) -> tuple[str, int] | None:
    """(sampling mode, draft models) of a drafter that fills trees level by level with a draft model (the
    vanilla/Sequoia drafter, SpecInfer's members; the mode :func:`tree_drafter`'s), else None."""
    members = getattr(tree_drafter(run), "members", None) or [tree_drafter(run)]
    mode = getattr(members[0], "mode", None)
    if run.draft is None or mode is None or run.cfg.method.draft_steps != "depth" or _own_level(run):
        return None
    return mode, len(members)


def times_own_level(drafter: Any, cfg: RunConfig) -> bool:
    """Whether calibration times the drafter's own draft level (the protocol's optional ``level_step``:
    EAGLE's head), drafting level by level; ``drafter`` an instance or its class."""
    return hasattr(drafter, "level_step") and cfg.method.draft_steps == "depth"


def times_pass_per_tree(drafter: Any, cfg: RunConfig) -> bool:
    """Whether calibration times the drafter's one pass per tree (the optional ``with_tree``: Medusa's
    heads); ``drafter`` an instance or its class."""
    return hasattr(drafter, "with_tree") and cfg.method.draft_steps == "one"


def _own_level(run: _Run) -> bool:
    return times_own_level(run.drafter, run.cfg)


def _draft_level_inputs(run: _Run, sizes: list[int]) -> Callable[[torch.Tensor], dict] | None:
    """The timing of one draft level fed w nodes, w in LEVEL_WIDTHS up to the largest size, after a context:
    the drafter's own level (``level_step``), else the draft model's forward of star trees of w nodes and
    the choice of children in the drafter's sampling mode; None for drafters with neither."""
    widths = [w for w in LEVEL_WIDTHS if w <= max(sizes)]
    if _own_level(run):
        return lambda context: _own_level_round(run, context, widths)
    modes = _draft_modes(run)
    if modes is None:
        return None
    trees, tokens = star_inputs(run.draft, widths, run.cfg.seed)
    return lambda context: _draft_level_round(run, context, trees, tokens, modes[0])


def _own_level_round(run: _Run, context: torch.Tensor, widths: list[int]) -> dict:
    """Seconds of the drafter's own draft level fed w nodes after ``context`` (its ``level_step``: its
    forward of the w rows, its LM head, LEVEL_CHILDREN children per row), median of FORWARD_REPEAT, the
    widths interleaved after one untimed step each (timed one width after the other, w = 1 read 4-14% above
    w = 2 in 3 of 4 zoo profiles, 3% below it interleaved). Keyed (QLEVEL, w)."""
    level = tree_drafter(run).level_step  # children in the mode of the trees' verifier
    steps = {w: level(w, context.numel(), LEVEL_CHILDREN, run.generator) for w in widths}
    times: dict[int, list[float]] = {w: [] for w in widths}
    for step in steps.values():
        step()
    for _ in range(FORWARD_REPEAT):
        for w, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[w].append(time.perf_counter() - t0)
    return {(QLEVEL, w): float(np.median(t)) for w, t in times.items()}


def _draft_level_round(run: _Run, context: torch.Tensor, trees: dict, tokens: dict, mode: str) -> dict:
    """Seconds of one draft level fed w nodes: the draft model's forward of w nodes after ``context``
    (median of FORWARD_REPEAT) plus the choice of LEVEL_CHILDREN children from each of the w rows in the
    drafter's mode (top-k, draws with or without replacement). Keyed (QLEVEL, w)."""
    run.draft.reset()
    run.draft.prefill(context[: min(context.numel(), context_length(run.models.draft) - 64)])
    fwd = forward_round(run.draft, trees, tokens, repeat=FORWARD_REPEAT)
    run.draft.reset()
    out = {}
    for w in trees:
        logits = torch.randn(w, int(run.draft.model.config.get_text_config().vocab_size))
        times = []
        for _ in range(FORWARD_REPEAT):
            t0 = time.perf_counter()
            if mode == "topk":
                logits.topk(LEVEL_CHILDREN, dim=-1)
            elif mode == "with_replacement":
                torch.multinomial(probs(logits, run.sampling), LEVEL_CHILDREN, replacement=True,
                                  generator=run.generator)
            else:
                draw_without_replacement(probs(logits, run.sampling), LEVEL_CHILDREN, run.generator)
            times.append(time.perf_counter() - t0)
        out[(QLEVEL, w)] = fwd[w] + float(np.median(times))
    return out


def pass_tree(n: int, depth: int, top_k: int) -> Tree:
    """A tree of n nodes, ``depth`` deep (its rank-0 spine first), then filled breadth-first with every
    node's next choice (rank < ``top_k``) as a one-pass drafter's own trees are (Medusa's 64-node tree);
    the largest such tree where n exceeds what the ranks allow."""
    parents, ranks, kids = [-1], [0], [0]
    depths = [0]
    for d in range(1, min(depth, n - 1) + 1):  # the spine: the pass reaches every head
        parents.append(d - 1), ranks.append(0), depths.append(d), kids.append(0)
        kids[d - 1] = 1
    grew = True
    while len(parents) < n and grew:
        grew = False
        for i in range(len(parents)):
            if len(parents) >= n:
                break
            if depths[i] < depth and kids[i] < top_k:
                parents.append(i), ranks.append(kids[i]), depths.append(depths[i] + 1), kids.append(0)
                kids[i] += 1
                grew = True
    return Tree.from_parents(parents, ranks)


def _pass_inputs(run: _Run, context: torch.Tensor, sizes: list[int]) -> tuple | None:
    """A one-pass drafter whose pass follows its tree (``with_tree``: Medusa runs one head per depth, takes
    each head's candidates and builds every node's token): the drafter on chains of 1..K drafts (K its
    ``max_depth``) and on trees K deep of n nodes, n in ``sizes`` beyond the chain of K (pass_tree); a
    context with the target's hidden state to propose in; and star trees of each drafter's size for the
    target forward that precedes each pass, as the loop's verify forward does. The loop times the pass on
    the calibration's chain only; these price it on another tree in proportion (profiles.draft_pass_scale):
    Medusa's 64-node tree paid 0.67–0.80 t(1) for the heads' pass where its chain of 4 paid 0.60–0.65
    (quiet sweep). None for other drafters."""
    if not times_pass_per_tree(run.drafter, run.cfg):
        return None
    with_tree = tree_drafter(run).with_tree  # candidates in the mode of the trees' verifier
    k = int(run.drafter.max_depth)
    top_k = int(run.cfg.method.params.get("top_k", 0) or 0) or LEVEL_CHILDREN
    drafters = {(QPASS_CHAIN, d): with_tree(Tree.chain(d)) for d in range(1, k + 1)}
    drafters.update({(QPASS, n): with_tree(pass_tree(n, k, top_k)) for n in sizes if n > k + 1})
    trees, tokens = star_inputs(run.target, sorted({d.tree.size for d in drafters.values()}), run.cfg.seed)
    run.target.reset()
    start = max(0, context.numel() - 64)
    pre = run.target.prefill(context[start:], hidden=True)
    run.target.reset()
    want = bool(getattr(run.drafter, "needs_hidden_states", False))
    ctx = DraftContext(context, pre.hidden[-1:] if want else None, run.generator, k + 2)
    return drafters, ctx, trees, tokens, want


def _pass_round(run: _Run, drafters: dict, ctx: DraftContext, trees: dict, tokens: dict, want: bool) -> dict:
    """Seconds of each drafter's proposal in ``ctx``, each right after a target forward of its tree's size
    after the committed context (in the loop the pass follows the verify forward of the tree: a 64-node
    forward's activations and logits leave the heads' weights colder than a chain's); median of
    FORWARD_REPEAT, after a warm one."""
    out = {}
    for key, drafter in drafters.items():
        n = drafter.tree.size
        drafter.reset(ctx.tokens)
        times = []
        for i in range(FORWARD_REPEAT + 1):
            run.target.forward_tree(tokens[n], trees[n], hidden=want)
            run.target.drop_pending()
            t0 = time.perf_counter()
            drafter.propose(ctx)
            if i:  # the first is the warm one
                times.append(time.perf_counter() - t0)
        out[key] = float(np.median(times))
    return out


def _verify_inputs(run: _Run, sizes: list[int]) -> dict[tuple[str, int], tuple[Draft, torch.Tensor]]:
    """Drafts with random tokens, draft laws and target logits for the method's verifier: (VSTEP, n) a
    binary tree of n nodes (walked by :func:`tree_verifier`: a verifier of chains only, Leviathan's, walks
    none), (VCHAIN, n) a chain of n nodes, n > 1 in ``sizes``; (VSTEP, 0) the loop's own tree."""
    gen = torch.Generator().manual_seed(run.cfg.seed)
    vocab = int(run.target.model.config.get_text_config().vocab_size)
    dev = run.target.device
    shapes = {(VSTEP, 0): run.tree}
    for n in (n for n in sizes if n > 1):
        shapes[(VCHAIN, n)] = Tree.chain(n - 1)
        shapes[(VSTEP, n)] = Tree.from_parents([-1] + [(i - 1) // 2 for i in range(1, n)])
    out = {}
    for key, tree in shapes.items():
        toks = torch.randperm(vocab, generator=gen)[: tree.size]  # distinct: sampled without replacement
        q = torch.randn(tree.size, vocab, generator=gen).softmax(-1)
        logits = torch.randn(tree.size, vocab, generator=gen)
        out[key] = (Draft(tree, toks.to(dev), q.to(dev)), logits.to(dev))
    return out


def _verify_round(run: _Run, checks: dict[tuple[str, int], tuple[Draft, torch.Tensor]]) -> dict:
    """Seconds of the loop's verification of each ``checks`` draft from its logits (methods.core.loop's
    verify_step: the target's law, the verifier's walk), median of FORWARD_REPEAT. The loop's overhead
    beyond the verify forward grows with the tree (greedy: every node's argmax and the ancestor test);
    the loop's own tree anchors it on the overhead the loop measured. Trees other than the loop's are
    walked under :func:`tree_verifier`."""
    opts, trees, out = _spec_opts(run), _tree_opts(run), {}
    for key, (draft, logits) in checks.items():
        walk = trees if key[0] == VSTEP and key[1] > 0 else opts
        times = []
        for _ in range(FORWARD_REPEAT):
            t0 = time.perf_counter()
            verify_step(draft, logits, walk, run.generator)
            times.append(time.perf_counter() - t0)
        out[key] = float(np.median(times))
    return out


def _draft_counts(drafter) -> tuple[int, int] | None:
    """(draft forwards, drafting steps) so far of a drafter that counts them (Draft & Verify: its adaptive
    exit drafts fewer levels than its chain and pays one forward beyond a stop)."""
    stats = drafter.run_stats() if hasattr(drafter, "run_stats") else {}
    return (stats["draft_forwards"], stats["draft_steps"]) if "draft_forwards" in stats else None


def _forwards_per_step(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    if before is None or after is None or after[1] == before[1]:
        return 0.0
    return (after[0] - before[0]) / (after[1] - before[1])


@torch.inference_mode()
def shared_verify_ratio(run: _Run, context: torch.Tensor, clock: Callable[[], float] | None = None
                        ) -> float | None:
    """Self-speculation's verify forward as the loop runs it (LayerSkip) over the full verify forward of the
    same chain: the drafter drafts its chain after ``context`` on the target's engine, the verify resumes on
    the draft's shared KV (``Draft.resume``), then the same tokens are verified from scratch; median of
    FORWARD_REPEAT ratios, after an untimed pair. Timed back to back with this thread's CPU time when torch
    runs one thread (wall seconds read the resumed verify 0.6-0.7x the full one at load ~20 where thread
    CPU read 0.98x: a shared machine's preemptions fall out of the ratio). None for a drafter whose drafts
    resume nothing."""
    attach = getattr(run.drafter, "attach", None)
    if attach is None:
        return None
    clock = clock or ratio_clock()
    attach(run.target)
    ratios = []
    for i in range(FORWARD_REPEAT + 1):
        run.target.reset()
        run.target.prefill(context[:-1])
        draft = run.drafter.propose(DraftContext(context, None, run.generator, run.tree.depth))
        if draft.resume is None:
            run.target.reset()
            return None
        t0 = clock()
        run.target.forward_tree(draft.tokens, draft.tree, resume=draft.resume)
        t1 = clock()
        run.target.drop_pending()
        run.target.forward_tree(draft.tokens, draft.tree)
        t2 = clock()
        if i:  # the first pair is the untimed warm one
            ratios.append((t1 - t0) / max(t2 - t1, 1e-9))
    run.target.reset()
    return float(np.median(ratios))


@torch.inference_mode()
def multi_draft_replay(run: _Run, seqs: list[torch.Tensor]) -> dict[str, Any] | None:
    """For a drafter merging K draft models (SpecInfer's ``members``): what each draft proposes at every
    position of the target's own trajectories given the true prefix — the rank of the target's token in q_k
    at temperature 0; the whole laws p and q_k otherwise (kept beside the profile in an .npz: a top-M cut of
    a flat q misprices acceptance) — the replay its merged tree's τ is priced with (specsim.multidraft: the
    correlation within a draft's branch kept)."""
    members = getattr(run.drafter, "members", None)
    if not members or run.cfg.method.drafter != "specinfer":
        return None
    greedy, ranks, p_rows, q_rows = run.sampling.greedy, [], [], []
    for ids, seq in zip(run.prompts, seqs):
        roots = torch.arange(ids.numel() - 1, seq.numel() - 1)
        logits = [_forward_all(m.engine, seq).logits[roots].float() for m in members]  # K × (T, V)
        if greedy:
            nxt = seq[roots + 1].numpy()
            width = run.cfg.calibration.width
            ranks.append(member_ranks(nxt, [x.cpu().numpy() for x in logits], width))
            continue
        p_rows.append(probs(_forward_all(run.target, seq).logits[roots].float(), run.sampling).cpu().numpy())
        q_rows.append(torch.stack([probs(x, run.sampling) for x in logits], 1).cpu().numpy())  # (T, K, V)
    replay = Replay(ranks=tuple(ranks), p_rows=tuple(p_rows), q_rows=tuple(q_rows))
    rows = None if greedy else profile_path(run.cfg).with_suffix(".replay.npz")
    if rows is not None:
        rows.parent.mkdir(parents=True, exist_ok=True)
    return {"members": len(members), **replay.to_json(None if rows is None else str(rows))}


@torch.inference_mode()
def exit_confidence(run: _Run, seqs: list[torch.Tensor]) -> dict[str, Any] | None:
    """For a drafter with a draft-exit rule (Draft & Verify's ``rule``): its confidence in the token it drafts
    and whether p accepts it, at every position the target generated along its own trajectories — the table
    (specsim.adaptive_exit.ConfidenceTable) its exit is priced with. Temperature 0: q's top-1 probability
    and whether p's greedy token agrees. Sampled drafts (the drafter's ``sample``): the exact law of a drawn
    token x ~ q, c = q(x) and acceptance min(1, p(x)/q(x)), the laws processed at the run's temperature.
    Positional: a depth-d draft is taken to meet the confidences of depth 1 (see _self_draft_law)."""
    law = LAWS.get(run.cfg.method.drafter)
    if getattr(run.drafter, "rule", None) is None or law is None:
        return None
    sampled = bool(getattr(run.drafter, "sample", False))
    if not run.sampling.greedy and not sampled:  # deterministic drafts verified at T > 0: not modelled
        return None
    conf, agree, weight, positions, runs = [], [], [], 0, []
    for ids, seq in zip(run.prompts, seqs):
        roots = torch.arange(ids.numel() - 1, seq.numel() - 1)
        positions += roots.numel()
        logits = law(run, seq, None, roots, 1).float()
        if not sampled:
            top = logits.softmax(-1).max(-1)  # (T,)
            conf += top.values.tolist()
            agree += (top.indices == seq[roots + 1].to(top.indices.device)).tolist()
            runs.append(_exit_chains(run, ids, seq))
            continue
        q = probs(logits, run.sampling)  # (T, V), as the drafter draws
        p = probs(_forward_all(run.target, seq).logits[roots].float(), run.sampling).to(q.device)
        keep = q > 1e-7  # tokens q draws (the rest weigh nothing)
        conf.append(q[keep].cpu().numpy())
        agree.append((p[keep] / q[keep]).clamp(max=1.0).cpu().numpy())
        weight.append(q[keep].cpu().numpy())
        runs.append(_exit_chains(run, ids, seq, sampled=True))
    if sampled:
        conf, agree, weight = np.concatenate(conf), np.concatenate(agree), np.concatenate(weight)
    table = ConfidenceTable.from_samples(conf, agree, weights=weight if sampled else None)
    # per trajectory and root, the drafter's own chain (specsim.adaptive_exit.replay_path)
    return {"edges": list(table.edges), "mass": list(table.mass), "accept": list(table.accept),
            "positions": positions, "alpha": table.alpha, "sampled": sampled, "runs": runs}


@torch.inference_mode()
def _exit_chains(run: _Run, ids: torch.Tensor, seq: torch.Tensor, sampled: bool = False) -> list[list]:
    """One trajectory: at every root the drafter's own chain as its loop drafts it, without the exit — the
    target's KV of the committed prefix, then the root and each draft through the drafter's sub-layers
    (``drafter.sub``), every depth reading the earlier drafts' skipped-layer KV — up to its longest draft
    (``drafter.gamma``) or the trajectory's end: [per root the confidences c_1..c_g, per root the
    acceptance]. Temperature 0: c_d is q's top-1 probability and the acceptance how many leading drafts p's
    greedy tokens accept. Sampled drafts: x_d is drawn from q's processed law with the run's generator, c_d =
    q(x_d), and the acceptance is the rejection rule's probability of each draft, min(1, p(x_d)/q(x_d)), p
    read by one target forward over the chain. The positional table reads depth d's confidence at root
    t + d − 1 over a fully drafted prefix instead: on Draft & Verify code (64 × 48) its rule settled at 0.96
    where the loop's did at 0.845 (τ −2.9%); at T = 1 (48 × 32) it drafted 2.66 tokens a step where the loop
    drafted 2.25 (τ +9.4% in-sample)."""
    eng, sub, depth = run.target, run.drafter.sub, max(1, int(run.drafter.gamma))
    seq = seq.to(eng.device)
    eng.reset()
    eng.prefill(seq[: ids.numel() - 1])  # the loop's prefill: the prompt but its last token (the root)
    confs, accepted = [], []
    for r in range(ids.numel() - 1, seq.numel() - 1):
        tokens, conf, run_len = [int(seq[r])], [], None
        for d in range(min(depth, seq.numel() - 1 - r)):
            out = eng.extend(torch.tensor(tokens[d : d + 1], device=eng.device), [d - 1], last_only=True,
                             sub=sub)
            if sampled:  # as the drafter draws (DraftVerifyDrafter.propose)
                q = probs(out.logits, run.sampling)[0]
                tok = int(torch.multinomial(q, 1, generator=run.generator))
                conf.append(float(q[tok]))
            else:
                c, top = out.logits[0].float().softmax(-1).max(-1)
                tok = int(top)
                conf.append(float(c))
                if run_len is None and tok != int(seq[r + 1 + d]):
                    run_len = d
            tokens.append(tok)
        eng.drop_pending()
        if sampled:  # p at each draft given the chain before it
            g = len(conf)
            chain = eng.forward_tree(torch.tensor(tokens, device=eng.device), Tree.chain(g))
            p = probs(chain.logits[:g].float(), run.sampling)
            eng.drop_pending()
            accepted.append([round(min(1.0, float(p[d, tokens[d + 1]]) / max(conf[d], 1e-12)), 5)
                             for d in range(g)])
        else:
            accepted.append(len(conf) if run_len is None else run_len)
        eng.prefill(seq[r : r + 1])  # the step commits the true token: the next root's prefix
        confs.append([round(c, 5) for c in conf])
    return [confs, accepted]


def _setup(cfg: RunConfig, models: Models, bar: tqdm) -> _Run:
    w = cfg.workload
    sampling = SamplingParams(w.temperature, w.top_k, w.top_p)
    prompts = calibration_prompts(cfg, models.tokenizer, cfg.calibration.new_tokens)
    ids = [torch.tensor(p.token_ids, dtype=torch.long) for p in prompts]
    tree = depth_tree(cfg)
    drafter = build_drafter(cfg.method, tree if tree.size > 1 else None, models, sampling)
    tree = getattr(drafter, "tree", tree)  # a drafter may have cut the tree (Medusa: depth <= its heads)
    generator = torch.Generator(device=models.device).manual_seed(cfg.seed)
    draft = ModelEngine(models.draft) if models.draft is not None else None
    target = ModelEngine(backbone_of(drafter, models, cfg.model.name)[0])  # Medusa-2: its tuned target
    return _Run(cfg, models, target, draft, drafter, tree, ids, sampling, generator, bar)


@dataclass(frozen=True)
class _Measured:
    ranks: list[list[Rank]]  # accepted rank (None: none) or its law (star_ranks) of each star, per depth
    stats: AcceptStats  # the drafter's chain/tree in the loop
    table: CostTable  # t(1) and the ratios of the other costs to it, from interleaved rounds
    attempts: list[dict[str, float]]  # dispersion of every timing attempt (the last one is ``table``'s)
    context: int
    setup_s: float
    forward_tokens: int  # mean tokens of the loop's verify forward (loop_forward_tokens)
    exit_table: dict[str, Any] | None = None  # exit_confidence's table (drafters with a draft-exit rule)
    prompt_hists: list[list[int]] = field(default_factory=list)  # per prompt: steps accepting k drafts
    replay: dict[str, Any] | None = None  # multi_draft_replay's (drafters merging several draft models)
    sizes: dict[int, int] = field(default_factory=dict)  # drafts of each size in the depth run (SizeRecorder)
    levels: list[float] = field(default_factory=list)  # their mean nodes per depth, root first
    wide_sizes: dict[int, int] = field(default_factory=dict)  # the wide loop's drafts of each size, all steps
    rank_runs: list[list[list[int]]] | None = None  # _star_ranks' per trajectory and depth (walkable stars)
    updates: list[int] = field(default_factory=list)  # per loop prompt: the drafter's updates (_depth_run)
    star_sizes: list[int] = field(default_factory=list)  # depth-1 stars per trajectory (_star_ranks)
    loop_new_tokens: int = 0  # new tokens per prompt of the depth run (``sizes``' generations)
    timing_s: float = 0.0  # seconds of the timed rounds, every attempt's (warm-up rounds included)
    orders: list[int] = field(default_factory=list)  # per loop prompt: the order it came in (_depth_run)


def _timed_table(run: _Run, context: torch.Tensor, sizes: list[int], wide: Any = None
                 ) -> tuple[CostTable, list[dict]]:
    """The cost table, timed again (up to TIMING_ATTEMPTS) while its rounds scatter beyond the bound."""
    attempts: list[dict[str, float]] = []
    for attempt in range(1, TIMING_ATTEMPTS + 1):
        table = cost_table(_cost_rounds(run, context, sizes, wide))
        attempts.append(table.dispersion)
        why = scatter_reason(table.dispersion)
        if not why:
            break
        again = "timing again" if attempt < TIMING_ATTEMPTS else "giving up"
        print(f"calibrate: {why}; {again}", file=sys.stderr, flush=True)
    return table, attempts


def _measure(cfg: RunConfig, models: Models, bar: tqdm) -> tuple[_Run, _Measured]:
    start, cal = time.perf_counter(), cfg.calibration
    run = _setup(cfg, models, bar)
    setup_s = time.perf_counter() - start  # loading (and, Medusa, training heads on first use)
    seqs = _trajectories(run)
    # a loop drafter's acceptance: every calibration prompt through the loop, as long as the workload's
    # generations (Lookahead's window warms up and its pool fills as a generation goes on)
    loop = cfg.method.drafter in LOOP_DRAFTERS
    ranks, runs, star_sizes = ([], None, []) if loop else _star_ranks(run, seqs)
    exit_table = exit_confidence(run, seqs)
    replay = multi_draft_replay(run, seqs)
    n_prompts, new_tokens = ((cal.prompts, max(cal.new_tokens, cfg.workload.max_new_tokens)) if loop
                             else (cal.depth_prompts, cal.new_tokens))
    stats, prompt_hists, recorder, updates, orders = _depth_run(run, n_prompts, new_tokens)
    drafted = dict(sorted(recorder.sizes.items()))
    if loop:  # one vector per depth of the drafter's chain: a draft that stops early is a rejection there
        ranks = _loop_ranks(stats, max(1, run.tree.depth))
    ctx = min(cal.context_tokens or cfg.workload.context_tokens, context_length(models.target) - 2)
    context = torch.cat(seqs).repeat(ctx // sum(s.numel() for s in seqs) + 1)[:ctx]  # real tokens
    # the loop's verify forward: t(n) for its overhead, at the drafts' mean size where they fell short of the
    # tree — SpecInfer's merged drafts too: its members' shared prefixes are verified once (at T = 0 the
    # zoo's union of 3 chains of 4 verified 5-9 of its 13 nodes; beside t(13) its overhead read 0)
    forward = loop_forward_tokens(cfg, run, drafted)
    sizes = sorted({1, run.tree.size, forward, *(int(b) for b in (*cfg.tree.budgets, *cal.sizes))})
    wide = wide_drafter(run)  # every step's draft counted, the generation's cut last ones too (depth 0)
    wide = SizeRecorder(wide, 0) if wide is not None else None
    timing = time.perf_counter()
    table, attempts = _timed_table(run, context, sizes, wide)  # its tree's t(n) and walk too
    timing = time.perf_counter() - timing
    bar.update()
    return run, _Measured(ranks, stats, table, attempts, ctx, setup_s, forward, exit_table, prompt_hists,
                          replay, drafted, recorder.level_means, wide.sizes if wide is not None else {},
                          runs, updates, star_sizes, new_tokens, timing, orders)


def _extra(cfg: RunConfig, run: _Run, m: _Measured, loads: list[float]) -> dict[str, Any]:
    """The calibration's own figures, kept in the profile for inspection."""
    width, t = cfg.calibration.width, m.table
    counts = rank_weights(m.ranks[0], width)  # none last; expected counts where the ranks' laws are exact
    return {
        "rank_counts": [int(c) if float(c).is_integer() else float(c) for c in counts],
        "star_rule": star_rule(cfg).name, "star_estimator": STAR_ESTIMATOR, "self_draft_law": SELF_DRAFT_LAW,
        **_exact_extra(m.ranks[0], m.star_sizes),
        "temperature": cfg.workload.temperature,
        "split_sizes": split_sizes(cfg),
        "room_spare": cfg.method.room_spare,  # the loops' cut last steps (profiles.room_spare)
        "loop_tau": m.stats.tau, "loop_accept_hist": m.stats.hist,
        "loop_accept_hist_by_prompt": m.prompt_hists,
        # a drafter that learns between requests (Online SD): how often, and its updates at each prompt
        **({"learns_every": int(run.drafter.learns_every), "loop_updates_by_prompt": m.updates,
            "loop_order_by_prompt": m.orders} if getattr(run.drafter, "learns_every", 0) else {}),
        "loop_acceptance_by_rank": m.stats.by_rank(),
        "loop_tree_size": run.tree.size, "loop_tree_depth": run.tree.depth, "loop_steps": m.stats.steps,
        "loop_verify_forward_tokens": m.forward_tokens,
        # drafts of each size (root included) the loop proposed, away from the generation's end: the law of
        # the verify forward where drafts fall short of the tree (profiles.verify_size_law)
        "loop_verify_sizes": {str(n): c for n, c in m.sizes.items()},
        "loop_verify_level_sizes": m.levels,  # their mean nodes per depth, root first (profiles.merged_size)
        # the verify forwards' sizes over the timed rounds' loop, every step: where drafts vary by step, its
        # verification's excess over its forwards is taken beside their mean t(k) (profiles.timed_forward_law)
        "loop_verify_timed_sizes": {str(n): c for n, c in t.verify_sizes.items()},
        "loop_new_tokens": m.loop_new_tokens,  # the depth run's generations (the timed rounds': new_tokens)
        "proposal_stars": PROPOSAL_STARS,  # how _proposed follows a drafter's own proposals
        "draft_steps": cfg.method.draft_steps,
        "verify_per_speculation_step_s": t.verify_ratio * t.t1_s,
        # the loop's verification from the logits, per draft size / t(1) ("0": the loop's own tree): the
        # verification overhead of a tree of n nodes is the loop's measured one + v(n) − v(0)
        "verify_step_ratios": {str(n): r for (kind, n), r in t.verify_step_ratios.items() if kind == VSTEP},
        "verify_chain_ratios": {str(n): r for (kind, n), r in t.verify_step_ratios.items() if kind == VCHAIN},
        # the loop's verification per step / t(1) with the drafter on a wide tree of n nodes (its forward's
        # excess over t(n) at a second size: profiles.forward_excess_ratio)
        "loop_verify_wide": {str(n): r for (kind, n), r in t.verify_step_ratios.items() if kind == VLOOP},
        # and how many of its verify forwards had each size (the steps at the generation's end draft fewer)
        "loop_verify_wide_sizes": {str(n): c for n, c in sorted(m.wide_sizes.items())},
        # one draft level fed w nodes / t(1) (draft-model drafters), and how many draft models run each level
        "draft_level_ratios": {str(n): r for (kind, n), r in t.verify_step_ratios.items() if kind == QLEVEL},
        "draft_models": (_draft_modes(run) or ("", 0))[1],
        # the loop's draft per speculation step / t(1) on trees of other shapes (levels and drafted nodes
        # below the root) beside its own chain's: profiles.draft_terms
        **_shape_extra(run, t),
        # the first step's proposal beyond a later one's / t(1), per shape: once per generation
        # (profiles.first_draft_s; the shapes' per-step ratios above leave it out)
        **({"draft_first_excess_ratios": {name: r for (kind, name), r in t.verify_step_ratios.items()
                                          if kind == QFIRST}}
           if any(kind == QFIRST for kind, _ in t.verify_step_ratios) else {}),
        # a one-pass drafter's proposal / t(1) on chains of d drafts and on trees of n nodes its full depth
        # (Medusa's heads: profiles.draft_pass_scale prices the loop's pass on another tree in proportion)
        **_pass_extra(t),
        "draft_level_timing": "drafter" if _own_level(run) else "draft_model" if _draft_modes(run) else None,
        "context_tokens": m.context, "timing_rounds": t.rounds, "timing_attempts": m.attempts,
        "timing_seconds": m.timing_s,
        # the kept attempt's rounds, per series of its dispersion (cost_table.round_series)
        "timing_series": {k: [float(f"{x:.5g}") for x in v] for k, v in t.series.items()},
        "max_timing_dispersion": MAX_TIMING_DISPERSION,
        "torch_threads": torch.get_num_threads(), "setup_seconds": m.setup_s,
        "loadavg_1min": loads,  # a busy machine slows t(n): see how busy it was
        **_self_draft_extra(cfg, run, m),
        **({"multi_draft": m.replay} if m.replay is not None else {}),
        # temperature 0: the accepted rank at every root, per trajectory and depth: τ of any tree by replaying
        # the greedy loop on the trajectories (specsim.replay; profiles.replayed_law)
        **({"rank_runs": m.rank_runs} if m.rank_runs else {}),
    }


def _exact_extra(ranks: Sequence[Rank], sizes: Sequence[int] = ()) -> dict[str, Any]:
    """Where the depth-1 stars' ranks are exact laws (star_ranks, T > 0): the share of a flipped estimator's
    variance of p_1 (the rank-0 rate: a chain's at every depth, a tree's heaviest entry) the exact one keeps,
    V_exact / V_flipped. Each V is the larger of the positions-as-draws variance of the mean and the
    prompts-as-units one (``sizes``: positions per trajectory, in order; as τ's own error,
    specsim.tau_error): a flipped indicator at a position of rank-0 probability s_t adds s_t (1 − s_t) to
    the exact s_t's spread, so V_flipped is p̄_1 (1 − p̄_1) / N position-wise and V_exact + Σ s_t (1 − s_t) /
    N² prompt-wise. The prediction's own standard error scales by the share's square root
    (analysis.validation_terms.prediction_standard_error). Nothing where every rank was read without flips
    (greedy, typical)."""
    if not any(isinstance(r, tuple) for r in ranks):
        return {}
    s = first_rank_probabilities(ranks)
    n, mean = s.size, float(s.mean())
    if n < 2 or not 0 < mean < 1:
        return {"star_exact": {"positions": int(n), "rank0_rate": mean, "variance_ratio": 1.0}}
    exact, flipped = s.var(ddof=1) / n, mean * (1 - mean) / n
    if len(sizes) >= 2 and sum(sizes) == n:
        bounds = np.cumsum([0, *sizes])
        totals = np.array([s[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])])
        k = len(sizes)
        clustered = float(((totals - mean * np.array(sizes)) ** 2).sum() * k / (k - 1)) / n ** 2
        exact = max(exact, clustered)
        flipped = max(flipped, clustered + float((s * (1 - s)).sum()) / n ** 2)
    return {"star_exact": {"positions": int(n), "rank0_rate": mean,
                           "variance_ratio": float(min(1.0, exact / flipped))}}


def _shape_extra(run: _Run, t: CostTable) -> dict[str, Any]:
    trees = {LOOP_SHAPE: shape_tree(run), **DRAFT_SHAPES, WIDE_SHAPE: wide_shape_tree(run)}
    fed = DraftCost(fed_width=True).widths  # the nodes fed to the drafter per level
    shapes = [{"shape": name, "levels": trees[name].depth, "nodes": trees[name].size - 1,
               "fed": fed(trees[name]), "parents": list(trees[name].parents), "ratio": r}
              for (kind, name), r in t.verify_step_ratios.items() if kind == QSHAPE]
    return {"draft_shape_ratios": shapes} if shapes else {}


def _pass_extra(t: CostTable) -> dict[str, Any]:
    chains = {str(n): r for (kind, n), r in t.verify_step_ratios.items() if kind == QPASS_CHAIN}
    if not chains:
        return {}
    trees = {str(n): r for (kind, n), r in t.verify_step_ratios.items() if kind == QPASS}
    return {"draft_pass_chain_ratios": chains, "draft_pass_tree_ratios": trees}


def _self_draft_extra(cfg: RunConfig, run: _Run, m: _Measured) -> dict[str, Any]:
    """Self-drafting's calibrated figures: the shared-cache verify of the loop's chain (LayerSkip) beside the
    full forward of as many tokens, and the draft-exit confidence table (Draft & Verify)."""
    out: dict[str, Any] = {}
    if m.table.shared_ratio > 0:
        n = run.tree.size
        full = m.table.t_n_ratios[n]
        out["shared_verify"] = {"tokens": n, "ratio": m.table.shared_ratio, "full_ratio": full,
                                "saving_ratio": full - m.table.shared_ratio}
    if m.exit_table is not None:
        out["exit_confidence"] = m.exit_table
    stats = run.drafter.run_stats() if hasattr(run.drafter, "run_stats") else {}
    if "draft_forwards_per_step" in stats and "draft_forwards" in stats:
        out["loop_draft_forwards_per_step"] = stats["draft_forwards_per_step"]
        out["loop_mean_draft_length"] = stats["mean_draft_length"]
    return out


def measure_profile(cfg: RunConfig, models: Models | None = None, show_progress: bool = True) -> Profile:
    """Calibrate ``cfg``'s drafter against its target on this device (see the module docstring)."""
    start, cal, load = time.perf_counter(), cfg.calibration, os.getloadavg()[0]
    models = models or load_models(cfg.model, cfg.device, cfg.model.dtype)
    loop = cfg.method.drafter in LOOP_DRAFTERS  # no star trees; every prompt through the loop
    total = 2 * cal.prompts + 1 if loop else 2 * cal.prompts + cal.depth_prompts + 1
    bar = tqdm(total=total, desc=f"calibrate {cfg.method.drafter}",
               disable=not show_progress)
    with bar:
        run, m = _measure(cfg, models, bar)
    extra = {**_extra(cfg, run, m, [load, os.getloadavg()[0]]), "seconds": time.perf_counter() - start}
    if max(extra["loadavg_1min"]) > (os.cpu_count() or 1):
        print(f"calibrate: the machine was busy (1-min load up to {max(extra['loadavg_1min']):.1f} on "
              f"{os.cpu_count()} CPUs): t(1) reads slow; the ratios of the costs to it were timed "
              f"interleaved (timing dispersion {m.table.worst[1]:.0%})", file=sys.stderr)
    heads = getattr(run.drafter, "heads", None)  # Medusa: the tree cannot be deeper than its heads
    return Profile(
        acceptance_vector=tuple(rank_vector(m.ranks[0], cal.width)),
        acceptance_vectors_by_depth=tuple(tuple(rank_vector(r, cal.width)) for r in takewhile(bool, m.ranks))
        if len(m.ranks) > 1 else (),
        acceptance_by_depth=tuple(m.stats.by_depth()),
        t_ar_s=m.table.t1_s, t_n_ratios=m.table.t_n_ratios, draft_ratio=m.table.draft_ratio,
        verify_overhead_ratio=m.table.verify_overhead_ratio(m.forward_tokens if run.tree.size > 1 else 1,
                                                            timed_forward(m, cal.new_tokens)),
        timing_dispersion=m.table.dispersion,
        model=cfg.model.name, drafter=cfg.method.drafter, workload=cfg.workload.name,
        device=device_name(cfg.device), dtype=str(models.dtype).removeprefix("torch."), width=cal.width,
        n_positions=len(m.ranks[0]), created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        key=profile_key(cfg), max_draft_depth=int(heads.num_heads) if heads is not None else 0, extra=extra,
    )


def timed_forward(m: _Measured, timed_new_tokens: int) -> float | None:
    """Where the drafter's drafts varied by step and the depth run's generations had another length than
    the timed rounds' (``timed_new_tokens``), the mean t(k) / t(1) of the forwards the timed loop ran
    (profiles.timed_forward_law): its verification's overhead is taken beside the forwards it paid for, not
    beside t of the depth run's rounded mean draft (prompt lookup's grounded T = 0 loop verified at 1.14
    t(1) beside t(4) = 1.22 where its forwards averaged 1.09: an overhead clamped to 0). None otherwise."""
    law = timed_forward_law(m.sizes, m.table.verify_sizes, (m.loop_new_tokens, timed_new_tokens))
    return mean_forward_ratio(m.table.t_n_ratios, law) if law else None


# ---- task=calibrate ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationResult:
    metrics: dict[str, Any]  # run.py writes these into metrics.json
    profile: Profile
    path: Path  # the cached profile


def calibrate(cfg: RunConfig, out_dir: Path | str, show_progress: bool = True) -> CalibrationResult:
    """Measure afresh, cache the profile (replacing an older one) unless its timings scattered, and copy it
    into the run dir."""
    path = profile_path(cfg)
    with profile_lock(path):
        profile = measure_profile(cfg, show_progress=show_progress)
        not_cached = _cache_unless_scattered(profile, path)
    atomic_write_json(Path(out_dir) / "profile.json", profile.to_json())
    metrics = {**profile_metrics(cfg, profile, path), "profile_cached": not not_cached,
               "not_cached_reason": not_cached}
    return CalibrationResult(metrics, profile, path)


def _cache_unless_scattered(profile: Profile, path: Path) -> str:
    """Save ``profile`` at ``path`` unless its timings scattered beyond the bound; returns why not ("" when
    saved). A busy phase during the calibration must not become every later run's prediction."""
    why = scatter_reason(profile.timing_dispersion)
    if why:
        print(f"calibrate: profile NOT cached ({why}, in each of {TIMING_ATTEMPTS} timings): this run uses "
              f"it, the next one measures again", file=sys.stderr, flush=True)
        return why
    save_profile(profile, path)
    return ""


def profile_metrics(cfg: RunConfig, profile: Profile, path: Path) -> dict[str, Any]:
    """metrics.json of a calibrate run: the profile's figures, and the Sequoia tree they select on this
    device (and on cfg.hardware) with the simulator's predictions for it."""
    tree, here, preset = sequoia_tree_for(cfg, profile)
    n = sorted(profile.t_n)
    return {
        "acceptance_vector": list(profile.acceptance_vector),
        "acceptance_by_depth": list(profile.acceptance_by_depth),
        "acceptance_vectors_by_depth": [list(v) for v in profile.acceptance_vectors_by_depth],
        "t_n_tokens": n, "t_n_s": [profile.t_n[k] for k in n],
        "draft_time_s": profile.draft_time_s, "t_ar_s": profile.t_ar_s,
        "verify_overhead_s": profile.verify_overhead_s,
        "width": profile.width, "n_positions": profile.n_positions,
        "loop_tau": profile.extra["loop_tau"], "calibration_seconds": profile.extra["seconds"],
        "device": profile.device, "dtype": profile.dtype,
        "profile_path": str(path), "profile_key": profile.key,
        "t_n_ratios": [profile.t_n_ratios[k] for k in n], "draft_ratio": profile.draft_ratio,
        "timing_dispersion": profile.worst_dispersion,
        "timing_dispersion_by_series": profile.timing_dispersion,
        "sequoia_tree_size": tree.size, "sequoia_tree_depth": tree.depth,
        "sequoia_predicted_tau": here["predicted_tau"],
        "sequoia_predicted_speedup_this_device": here["predicted_speedup"],
        "sequoia_predicted_speedup_hardware": preset["predicted_speedup"],
    }


def ensure_profile(
    cfg: RunConfig, models=None, cache: Path | None = None, show_progress: bool = True
) -> Profile:
    """The cached profile, or calibrate now (printing a notice) and cache it (unless its timings scattered:
    :func:`_cache_unless_scattered`). ``models`` (methods.models.Models) avoids loading them twice when the
    caller has them. A profile without t(n) for one of cfg.tree.budgets, or one that a later run found stale
    (its t(1) off that run's own: methods.measurement.staleness), is measured again."""
    path = profile_path(cfg, cache)
    with profile_lock(path):
        profile = load_profile(cfg, cache)
        why = remeasure_reason(profile, cfg)
        if not why:
            return profile
        refuse_unless_calibrating(cfg, why, path)
        print(f"calibrating {cfg.method.drafter} on {cfg.model.name}/{cfg.workload.name} ({why}; "
              f"cached for later runs in {path})", file=sys.stderr, flush=True)
        profile = measure_profile(cfg, models, show_progress=show_progress)
        _cache_unless_scattered(profile, path)
    return profile


def remeasure_reason(profile: Profile | None, cfg: RunConfig) -> str:
    """Why a cached profile cannot serve ``cfg`` ("" when it can)."""
    if profile is None:
        return "no profile yet"
    if smaller := smaller_split(profile, cfg):
        return f"calibrated on a smaller split than asked ({smaller})"
    if missing_budgets(profile, cfg):
        return f"no t(n) for budgets {missing_budgets(profile, cfg)}"
    if profile.stale and not cfg.calibration.cached_only:  # a stale t(1): every run re-anchors its own
        return f"the cached profile is stale: {profile.stale}"
    if "verify_step_ratios" not in profile.extra:
        return "no per-size verification timing (a profile of an older calibration)"
    if "loop_verify_sizes" not in profile.extra:
        return "no law of the loop's draft sizes (a profile of an older calibration)"
    if varied_sizes(profile.extra["loop_verify_sizes"]) and not profile.extra.get("loop_verify_timed_sizes"):
        return "drafts of varied sizes, the timed loop's forwards not counted (an older calibration)"
    kind = drafter_class(cfg.method.drafter)
    if times_pass_per_tree(kind, cfg) and "draft_pass_chain_ratios" not in profile.extra:
        return "no timed pass per tree (a profile of an older calibration)"
    if times_own_level(kind, cfg) and profile.extra.get("draft_level_timing") != "drafter":
        return "draft levels timed on the draft model, not the drafter's own (an older calibration)"
    timed = {s["shape"] for s in profile.extra.get("draft_shape_ratios") or [] if "fed" in s}
    if times_draft_shapes(kind, cfg, depth_tree(cfg)) and not timed >= set(shape_names()):
        return "the loop's draft not timed on every tree shape (an older calibration)"
    if times_wide_loop(kind, cfg, depth_tree(cfg)) and not profile.extra.get("loop_verify_wide"):
        return "the loop's verification not timed on a wide tree (an older calibration)"
    if (times_draft_shapes(kind, cfg, depth_tree(cfg)) and times_wide_loop(kind, cfg, depth_tree(cfg))
            and WIDE_SHAPE not in timed):
        return "the loop's draft not timed on the wide tree (an older calibration)"
    if records_rank_runs(cfg) and not profile.extra.get("rank_runs"):
        return "no accepted rank per root to replay the greedy loop on (an older calibration)"
    if flips_stars(cfg) and profile.extra.get("star_estimator") != STAR_ESTIMATOR:
        return "star acceptance read from the verifier's coin flips (an older calibration)"
    if profile.extra.get("learns_every") and "loop_order_by_prompt" not in profile.extra:
        return "a learning drafter's prompts decoded in one order only (an older calibration)"
    return missing_self_draft(profile, cfg)


# the calibration split's sizes before profiles recorded them (CalibrationConfig's defaults since format 8)
UNRECORDED_SPLIT = {"prompts": 24, "new_tokens": 32, "depth_prompts": 4}


def split_sizes(cfg: RunConfig) -> dict[str, int]:
    """How much of the calibration split a calibration of ``cfg`` reads (kept in the profile)."""
    c = cfg.calibration
    return {"prompts": int(c.prompts), "new_tokens": int(c.new_tokens), "depth_prompts": int(c.depth_prompts)}


def smaller_split(profile: Profile, cfg: RunConfig) -> str:
    """The sizes where ``profile`` read less of the calibration split than ``cfg`` asks ("" if none): the
    number of prompts is not in the profile key (a larger sample estimates the same acceptance), so a profile
    of 24 x 32 positions would otherwise serve a request for 48 x 32; a larger one serves a smaller request.
    The generation length is in the key (profiles.key_document): new_tokens differs only in a profile
    written before it was."""
    had = profile.extra.get("split_sizes") or UNRECORDED_SPLIT
    return ", ".join(f"{k} {had.get(k, 0)} < {v}" for k, v in split_sizes(cfg).items() if had.get(k, 0) < v)


STAR_ESTIMATOR = "exact"  # star_ranks' laws where the verifier flips coins (a profile mark)
SELF_DRAFT_LAW = "full prefix KV"  # _self_draft_law's q: the root's sub-layers over the target's prefix KV


def flips_stars(cfg: RunConfig) -> bool:
    """Whether a calibration of ``cfg`` verifies star trees with a verifier that flips coins (T > 0, Sequoia's
    or the one-hot rule: star_ranks gives their exact laws); loop drafters verify no stars."""
    return (cfg.workload.temperature > 0 and cfg.method.drafter not in LOOP_DRAFTERS
            and star_rule(cfg).verifier in NODE_RULES)


def records_rank_runs(cfg: RunConfig) -> bool:
    """Whether a calibration of ``cfg`` records each root's accepted rank per depth (_star_ranks' second
    part): a drafter with a law here (not a loop drafter) whose stars are its top-W verified by a rule that
    makes the loop a walk along the trajectory — greedy at temperature 0, or one-hot drafts at T > 0
    (trajectory_ranks). Not Sequoia's sampled stars: their children are draws, not the drafter's own."""
    drafter, rule = cfg.method.drafter, star_rule(cfg)
    return (drafter in LAWS and drafter not in LOOP_DRAFTERS and not rule.sample
            and rule.verifier in (Verifier.greedy, Verifier.deterministic))


def missing_self_draft(profile: Profile, cfg: RunConfig) -> str:
    """Self-drafting's calibrated figures a profile measured before they were taken lacks ("" if none)."""
    drafter, extra = cfg.method.drafter, profile.extra
    sampled = Verifier(cfg.method.verifier) in (Verifier.chain, Verifier.specinfer)  # the drafter draws
    if drafter == "draft_verify" and "exit_confidence" not in extra and (cfg.workload.temperature == 0
                                                                          or sampled):
        return "no draft-exit confidence table"  # greedy, or sampled drafts (the drafter's own rule)
    table = extra.get("exit_confidence") or {}
    if drafter == "draft_verify" and table and "runs" not in table:
        return "no draft-exit trajectories (the exit rule is replayed on them)"
    drafted = extra.get("loop_mean_draft_length")
    if drafter == "draft_verify" and drafted is not None and (
            int(extra.get("loop_verify_forward_tokens") or 0) > round(1 + float(drafted))):
        return "verification overhead taken beside the longest draft's forward, not the drafted one's"
    if drafter == "draft_verify" and extra.get("self_draft_law") != SELF_DRAFT_LAW:
        return "its q read by a sub-layer forward over the whole sequence (an older calibration)"
    if drafter == "layerskip" and "shared_verify" not in extra:
        return "no timed shared-cache verify"
    if (drafter not in LAWS and drafter not in LOOP_DRAFTERS and cfg.workload.temperature > 0
            and extra.get("proposal_stars") != PROPOSAL_STARS):
        return "sampled proposals' stars followed below depth 1 (an older calibration)"
    if drafter == "specinfer" and "multi_draft" not in extra:
        return "no multi-draft replay"
    if drafter == "specinfer" and "loop_verify_level_sizes" not in extra:
        return "no merged draft sizes per depth (overhead taken beside the union's forward)"
    return ""
