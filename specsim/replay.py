"""τ's law at temperature 0 by replaying the decode loop over the calibration's trajectories.

p = target, q = draft. At temperature 0 the speculative loop emits the target's own greedy continuation, so
its steps are a walk along that trajectory: a step rooted at position t accepts the depth-1 child whose rank
among the drafter's children is the rank of the trajectory's token t in q, then the depth-2 child holding
token t + 1 (q of depth 2 read at the accepted, i.e. true, prefix), and so on, and the next step is rooted
where this one ended. The calibration records, at every root of its trajectories and every depth d its
drafter has a law for, that rank (methods.measurement.calibrate: ``rank_runs``), so the loop can be replayed
exactly for any tree whose children are q's top-k (greedy stars, Sequoia's and static trees).

Why not the positional vectors alone (specsim.acceptance): they are marginals over every position of the
trajectories, and the tree law multiplies them as if independent. The loop does neither: acceptance comes in
runs (easy and hard stretches), which lengthens a step that started well, and the loop roots more steps where
the text is hard (short steps), which shortens the mean. On the zoo's calibration split (T = 0, 24 prompts)
the vector read τ within −3.1…+2.8% of the replayed loop on the same trajectories, of either sign by drafter,
workload and tree (draft model on grounded Sequoia-32: 4.839 against 4.691; EAGLE prose Sequoia-32: 3.996
against 4.107).

Depths past the recorded ones (a tree deeper than the drafter's laws) read the deepest law at a later root,
as the vectors repeat their last one. Steps the trajectory's end would cut (fewer tokens left than the tree is
deep) are left out, as a measured τ leaves them out (specsim.tau_error.steady_lengths).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from specsim.acceptance import AcceptanceLike
from specsim.expected import accepted_length_law
from specsim.tau_error import steady_lengths
from specsim.tree import Tree


@dataclass(frozen=True)
class RankRuns:
    """Per trajectory, per depth d = 1..D: ``prompts[i][d - 1][t]`` is the rank (0-based) of the trajectory's
    token t + d − 1 among the depth-d children the drafter proposes from root t with the true prefix as
    ancestors; −1 when it is not among them (none accepted)."""

    prompts: tuple[tuple[tuple[int, ...], ...], ...]

    def __post_init__(self) -> None:
        runs = tuple(tuple(tuple(int(r) for r in depth) for depth in p) for p in self.prompts)
        object.__setattr__(self, "prompts", runs)
        assert runs and all(p and p[0] for p in runs), "need at least one trajectory with a recorded root"
        assert len({len(p) for p in runs}) == 1, "every trajectory records the same depths"

    @property
    def depths(self) -> int:
        return len(self.prompts[0])

    def to_json(self) -> list:
        return [[list(d) for d in p] for p in self.prompts]

    @classmethod
    def from_json(cls, doc: Sequence) -> RankRuns:
        return cls(tuple(tuple(tuple(d) for d in p) for p in doc))


def accepted_drafts(runs: Sequence[Sequence[int]], t: int, tree: Tree, kids: list[dict[int, int]]) -> int:
    """Drafts a greedy verification of ``tree`` accepts from root t of one trajectory (``runs[d - 1]``: the
    depth-d ranks by root): the deepest node whose path the trajectory's ranks trace."""
    node, d, deepest = 0, 1, len(runs)
    while kids[node]:
        depth, root = min(d, deepest), t + max(0, d - deepest)  # past the recorded depths: the deepest law
        if root >= len(runs[depth - 1]):
            break
        child = kids[node].get(runs[depth - 1][root])
        if child is None:
            break
        node, d = child, d + 1
    return d - 1


def child_by_rank(tree: Tree) -> list[dict[int, int]]:
    """Per node, its children by the rank of the token each drafts (the walks' lookup)."""
    return [{int(tree.ranks[c]): c for c in tree.children[v]} for v in range(tree.size)]


def loop_steps(n: int, depth: int, walk: Callable[[int], int]) -> Iterator[tuple[int, bool]]:
    """The greedy loop over one trajectory of ``n`` positions: each step rooted where the last one ended,
    ``walk(t)`` the drafts a step rooted at t accepts; per step (its accepted drafts, whether it counts: a
    step with fewer positions left than ``depth`` would have its draft cut)."""
    t = 0
    while t < n:
        a = min(walk(t), n - t)
        yield a, n - t >= depth
        t += a + 1


def loop_law(runs: RankRuns, tree: Tree) -> np.ndarray:
    """(tree.depth + 2,) pmf of τ (accepted drafts + the bonus token; pmf[0] = 0) over the steps of the greedy
    loop replayed on every trajectory from its first position, each step rooted where the last one ended;
    steps with fewer positions left than the tree's depth are not counted (their draft would be cut)."""
    law = np.zeros(tree.depth + 2)
    if tree.size == 1:
        law[1] = 1.0
        return law
    kids = child_by_rank(tree)
    for one in runs.prompts:
        for a, counted in loop_steps(len(one[0]), tree.depth,
                                     lambda t, one=one: accepted_drafts(one, t, tree, kids)):
            law[1 + a] += counted
    assert law.sum() > 0, "no step of the replay had the tree's depth left: trajectories too short"
    return law / law.sum()


def lengths_law(generations: Sequence[Sequence[int]], n_tokens: int, depth: int) -> np.ndarray:
    """(depth + 2,) pmf of τ over the steady steps (:func:`steady_lengths`) of real loop generations of
    ``n_tokens`` each with a tree ``depth`` deep: the loop's own law, where it ran on the calibration split
    (a dynamic drafter's recorded decodes, methods.measurement.dynamic_shapes)."""
    law = np.zeros(depth + 2)
    for lengths in generations:
        for k in steady_lengths(lengths, n_tokens, depth):
            law[min(k, depth + 1)] += 1
    assert law.sum() > 0, "no steady step in the generations"
    return law / law.sum()


def hit_vectors(runs: RankRuns, width: int) -> list[list[float]]:
    """Per recorded depth, the positional vector ``[0, p_1, …, p_W, p_none]`` of the ranks the trajectories'
    own tokens took (rank −1 or ≥ W: none): the replay's acceptance, marginal over its roots."""
    out = []
    for d in range(runs.depths):
        ranks = np.concatenate([np.asarray(p[d], dtype=np.int64) for p in runs.prompts])
        counts = np.bincount(np.where((ranks >= 0) & (ranks < width), ranks, width), minlength=width + 1)
        out.append([0.0, *(counts / max(1, ranks.size)).tolist()])
    return out


def flips_integrated(law: np.ndarray, tree: Tree, hits: AcceptanceLike, exact: AcceptanceLike) -> np.ndarray:
    """The replayed ``law`` of τ with the verifier's coin flips integrated out (temperature > 0): the
    replay walks ONE sampled trajectory per prompt, so its level carries the luck of those draws (whether
    the sampled token happened to be q's top-1), which every row of a workload × drafter shares, while the
    calibration also has each position's exact law of that rank (``exact``: the star vectors). A control
    variate on the pmf: ``law`` − the i.i.d. tree law of the replay's own rank marginals (``hits``) + the
    i.i.d. law of the exact vectors — the replay keeps what the vectors miss (acceptance in runs, steps
    rooted where the text is hard) and the exact vectors set the level. The calibration's code trajectories
    hit q's top-1 at 0.289 where the exact law is 0.258 (2.8 binomial s.e., shared by Staged SD, EAGLE-3
    and Medusa's code profiles), so staged code T = 1 was predicted τ +3.3% from that draw alone. At
    temperature 0 the two vectors are the same ranks and the law is unchanged. Entries the shift would push
    below 0 are clipped and the rest renormalised (τ then moves by less than the shift): only where the
    replay's law is far narrower than the i.i.d. ones, which the calibration's trajectories are not."""
    base, got = accepted_length_law(tree, hits), accepted_length_law(tree, exact)
    n = max(law.size, base.size)
    out = np.clip(sum(np.pad(x, (0, n - x.size)) * s for x, s in ((law, 1), (base, -1), (got, 1))), 0.0, None)
    out[0] = 0.0
    return out / out.sum()
