"""Draft & Verify's adaptive draft-exit (Zhang et al. 2023, Algorithm 2) in the simulator: the law of the
draft length, the accepted length and the draft forwards of a chain drafted under the exit rule, and the
rule's threshold over a run.

Notation: p = target, q = draft, γ = the longest draft, c = q's confidence in its drafted token (top-1
probability at temperature 0; q(x) of the drawn token x when drafts are sampled), a = whether p accepts that
token (p's argmax agrees at temperature 0; the rejection rule's coin, w.p. min(1, p(x)/q(x)), when sampled),
γ_th = the exit threshold. The draft's first token is always kept; drafting goes on to depth d ≥ 2 only while
c_d ≥ γ_th. A forward that falls below the threshold has been paid for, so a draft of k < γ tokens costs
k + 1 draft forwards (γ when it runs to γ).

Positions are taken as independent draws of (c, a) from a calibrated :class:`ConfidenceTable` (the draft's
confidence histogram with the acceptance rate in each bin, measured along the target's own generations). With
s = P(c ≥ γ_th), β = P(c ≥ γ_th, a) and α_1 = P(a):
    P(k ≥ d) = s^{d-1},   P(accepted ≥ d) = α_1·β^{d-1}   (d = 1..γ),   E[forwards] = 1 + Σ_{d=2}^{γ} s^{d-2}.
The rule after each step (AR = accepted / drafted of that step):
    AR~ <- β1·AR~ + (1-β1)·AR;  γ~ = γ_th + ε if AR~ < α_target else γ_th - ε;  γ_th <- β2·γ_th + (1-β2)·γ~,
clipped to [0, 1]. :func:`threshold_path` follows it in expectation, step by step over a run's tokens: each
step moves γ_th by its expected change at the current law (:func:`drift`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specsim.cost import CostModel
from specsim.expected import tokens_per_forward
from specsim.run_steps import RunShares
from specsim.tree import Tree


@dataclass(frozen=True)
class ExitRule:
    """The draft-exit threshold's initial value and its update (module docstring); the drafter's own rule."""

    threshold: float = 0.6
    adaptive: bool = True
    target_acceptance: float = 0.8  # α_target
    step: float = 0.01  # ε
    beta1: float = 0.5
    beta2: float = 0.9


def next_state(rule: ExitRule, threshold: float, smoothed: float, rate: float) -> tuple[float, float]:
    """One update of the rule: (γ_th, AR~) after a step whose acceptance rate was ``rate``."""
    smoothed = rule.beta1 * smoothed + (1 - rule.beta1) * rate
    moved = threshold + (rule.step if smoothed < rule.target_acceptance else -rule.step)
    return min(1.0, max(0.0, rule.beta2 * threshold + (1 - rule.beta2) * moved)), smoothed


@dataclass(frozen=True)
class ConfidenceTable:
    """The draft's confidence histogram: bins [edges[i], edges[i+1]) of c with their probability mass and the
    acceptance rate of the positions in them (c uniform within a bin)."""

    edges: tuple[float, ...]  # len = bins + 1, ascending, from 0 to 1
    mass: tuple[float, ...]  # sums to 1
    accept: tuple[float, ...]  # P(a | bin)

    def __post_init__(self) -> None:
        assert len(self.edges) == len(self.mass) + 1 == len(self.accept) + 1, "edges, mass, accept mismatch"
        assert abs(sum(self.mass) - 1) < 1e-6, f"bin masses sum to {sum(self.mass)}"
        assert all(0 <= a <= 1 for a in self.accept), "acceptance rates outside [0, 1]"

    @classmethod
    def from_samples(cls, confidence: Sequence[float], accepted: Sequence[float], bins: int = 50,
                     weights: Sequence[float] | None = None) -> ConfidenceTable:
        """From positions' (c, a): ``accepted`` a bool or the probability that p accepts the token, and
        ``weights`` the probability of each (c, a) pair. Temperature 0: one pair per position (q's argmax, a
        whether p's argmax agrees). Sampled drafts: every token x of q at each position, c = q(x), a =
        min(1, p(x)/q(x)) (the rejection rule), weight q(x)/positions — the exact law of a drawn token."""
        c, a = np.clip(np.asarray(confidence, float), 0, 1), np.asarray(accepted, float)
        assert c.size and c.size == a.size, "need as many acceptances as confidences"
        w = np.ones(c.size) if weights is None else np.asarray(weights, float)
        assert w.size == c.size and (w >= 0).all() and w.sum() > 0, "weights: one >= 0 per confidence"
        edges = np.linspace(0, 1, bins + 1)
        idx = np.minimum((c * bins).astype(int), bins - 1)
        count = np.bincount(idx, weights=w, minlength=bins)
        hits = np.bincount(idx, weights=w * a, minlength=bins)
        rate = np.clip(np.divide(hits, count, out=np.zeros(bins), where=count > 0), 0, 1)
        return cls(tuple(edges.tolist()), tuple((count / count.sum()).tolist()), tuple(rate.tolist()))

    @property
    def alpha(self) -> float:
        """α_1 = P(a): acceptance of a token drafted whatever its confidence (the first one)."""
        return float(np.dot(self.mass, self.accept))

    def above(self, threshold: float) -> tuple[float, float]:
        """(s, β) = (P(c ≥ γ_th), P(c ≥ γ_th and a)): the bin holding γ_th counts for its share above it."""
        lo, hi = np.asarray(self.edges[:-1]), np.asarray(self.edges[1:])
        share = np.clip((hi - threshold) / (hi - lo), 0, 1)
        mass = np.asarray(self.mass) * share
        return float(mass.sum()), float(np.dot(mass, self.accept))

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """n i.i.d. (c, a) draws (the Monte Carlo check of the law)."""
        b = rng.choice(len(self.mass), size=n, p=np.asarray(self.mass) / sum(self.mass))
        lo, hi = np.asarray(self.edges)[b], np.asarray(self.edges)[b + 1]
        return lo + (hi - lo) * rng.random(n), rng.random(n) < np.asarray(self.accept)[b]


@dataclass(frozen=True)
class ExitLaw:
    """At one threshold: the joint law of (draft length k, accepted drafts j) and the derived figures."""

    joint: np.ndarray  # (γ + 1, γ + 1): P(k, j), k = 1..γ (row 0 empty), j = 0..k
    forwards: float  # E[draft forwards]

    @property
    def drafted(self) -> np.ndarray:
        """P(k = d), d = 0..γ."""
        return self.joint.sum(1)

    @property
    def tau(self) -> float:
        """E[j] + 1: accepted drafts and the bonus token."""
        return float(np.dot(self.joint.sum(0), np.arange(self.joint.shape[1]))) + 1.0

    def _rates(self) -> np.ndarray:
        k = np.arange(self.joint.shape[0])[:, None]
        j = np.arange(self.joint.shape[1])[None, :]
        return np.divide(j, k, out=np.zeros(self.joint.shape), where=k > 0)

    @property
    def rate(self) -> float:
        """E[j / k]: the per-step acceptance rate the rule reads."""
        return float((self.joint * self._rates()).sum())

    @property
    def rate_var(self) -> float:
        return max(0.0, float((self.joint * self._rates() ** 2).sum()) - self.rate ** 2)


def drift(rule: ExitRule, law: ExitLaw) -> float:
    """E[γ_th change] of one step at this law: (1 - β2)·ε·(P(AR~ < α_target) - P(AR~ ≥ α_target)), AR~ (an
    exponential average of the steps' rates) taken normal with the rate's mean and the average's variance
    Var(AR)·(1 - β1) / (1 + β1). Replacing AR~ by its mean instead would move γ_th at full speed whenever the
    mean is below target, which a noisy AR~ does not."""
    sd = math.sqrt(law.rate_var * (1 - rule.beta1) / (1 + rule.beta1))
    z = (rule.target_acceptance - law.rate) / sd if sd > 0 else math.copysign(math.inf, rule.target_acceptance
                                                                              - law.rate)
    below = 0.5 * (1 + math.erf(z / math.sqrt(2))) if math.isfinite(z) else float(z > 0)
    return (1 - rule.beta2) * rule.step * (2 * below - 1)


def exit_law(table: ConfidenceTable, threshold: float, gamma: int) -> ExitLaw:
    """The law of a chain of at most γ drafts under a fixed threshold (module docstring), by a walk over the
    depths with the state (still drafting, still accepting)."""
    assert gamma >= 1, f"the longest draft {gamma} must be >= 1"
    s, beta = table.above(threshold)
    a1 = table.alpha
    joint = np.zeros((gamma + 1, gamma + 1))
    # depth 1 is always drafted: accepted (j = 1 so far) or not (j = 0, stays 0)
    live = {1: a1, 0: 1 - a1}  # j → P(drafting on to the next depth is still possible, accepted so far j)
    for d in range(2, gamma + 1):  # depth d is drafted iff c_d ≥ γ_th
        nxt: dict[int, float] = {}
        for j, pr in live.items():
            joint[d - 1, j] += pr * (1 - s)  # stopped: k = d - 1
            accepting = j == d - 1
            nxt[j + 1 if accepting else j] = nxt.get(j + 1 if accepting else j, 0) + pr * (beta if accepting
                                                                                           else s)
            if accepting:
                nxt[j] = nxt.get(j, 0) + pr * (s - beta)
        live = nxt
    for j, pr in live.items():
        joint[gamma, j] += pr  # drafted all γ
    drafted = joint.sum(1)  # a stop after k < γ tokens paid k + 1 forwards; a full draft γ
    forwards = float(sum(drafted[k] * (k + 1 if k < gamma else gamma) for k in range(1, gamma + 1)))
    return ExitLaw(joint, forwards)


@dataclass(frozen=True)
class RunPrediction:
    """A run under the rule, in expectation: per step its threshold and law. ``cut``: the laws of the steps
    a generation's end cut (fewer tokens left than γ; :func:`replay_path` walks them, the mean field does
    not), which τ leaves out and the run's time does not."""

    thresholds: tuple[float, ...]
    laws: tuple[ExitLaw, ...]
    cut: tuple[ExitLaw, ...] = ()

    @property
    def tau(self) -> float:
        """Tokens per step over the run: Σ τ_s / steps."""
        return float(np.mean([law.tau for law in self.laws]))

    @property
    def forwards(self) -> float:
        return float(np.mean([law.forwards for law in self.laws]))

    @property
    def draft_length(self) -> float:
        return float(np.mean([np.dot(law.drafted, np.arange(law.drafted.size)) for law in self.laws]))

    @property
    def tau_law(self) -> np.ndarray:
        """(γ + 2,) pmf of τ = accepted drafts + 1 over the run's steps (a step drawn at random): the
        mixture of the steps' laws. Its mean is :attr:`tau`."""
        law = np.mean([law.joint.sum(0) for law in self.laws], axis=0)
        return np.concatenate([[0.0], law])

    def tokens_per_forward(self, n_tokens: int) -> float:
        """Tokens per target forward of a generation of ``n_tokens``, the last step cut at the budget
        (specsim.expected.tokens_per_forward under :attr:`tau_law`): the exit law's, not the full chain's,
        whose τ law reaches γ + 1 tokens a step that the rule seldom drafts."""
        return tokens_per_forward(self.tau_law, n_tokens)

    def decode_speedup(self, cost: CostModel, n_tokens: int) -> float:
        """The speedup of a generation of ``n_tokens`` (a measure run's decode_speedup): the tokens per
        forward after the last step's cut, over the mean step of the run, its cut steps included (they draft
        and verify no further than the room: Draft & Verify code T0, 48 × 32, γ = 5, one step in nine)."""
        return self.tokens_per_forward(n_tokens) * cost.ar_time / self.step_time(cost, run=True)

    def step_time(self, cost: CostModel, run: bool = False) -> float:
        """Mean seconds per step: the draft forwards at the cost model's draft step and the verify of the
        chain actually drafted (its expectation over the draft length); ``run``: over the cut steps too."""
        step = cost.draft.per_depth(cost.ar_time)[0]
        verify = {k: cost.tree_verify_time(Tree.chain(k)) for k in range(self.laws[0].drafted.size)}
        laws = self.laws + self.cut if run else self.laws
        return float(np.mean([law.forwards * step + sum(p * verify[k] for k, p in enumerate(law.drafted))
                              for law in laws]))

    def draft_time(self, cost: CostModel, run: bool = False) -> float:
        """Mean seconds of drafting per step: the draft forwards the exit rule lets run, at the draft step;
        ``run``: over the cut steps too."""
        laws = self.laws + self.cut if run else self.laws
        return float(np.mean([law.forwards for law in laws])) * cost.draft.per_depth(cost.ar_time)[0]

    def run_shares(self, cost: CostModel) -> RunShares:
        """The run's mean draft and verify per step over the kept steps' (specsim.run_steps.RunShares): the
        cut steps drafted no further than their room (1.0 without cut steps)."""
        draft, step = self.draft_time(cost), self.step_time(cost)
        run_draft, run_step = self.draft_time(cost, run=True), self.step_time(cost, run=True)
        return RunShares(run_draft / draft if draft > 0 else 1.0,
                         (run_step - run_draft) / (step - draft) if step > draft else 1.0)

    def speedup(self, cost: CostModel) -> float:
        """S = τ · t_AR / t_step over the run (its tokens over its time)."""
        return self.tau * cost.ar_time / self.step_time(cost)


def threshold_path(table: ConfidenceTable, rule: ExitRule, gamma: int, tokens: float,
                   skip_tokens: float = 0.0, generation: float = 0.0) -> RunPrediction:
    """The rule's threshold step by step (mean field) until ``tokens`` are generated; the steps of the first
    ``skip_tokens`` (a warm-up the run does not measure) are left out of the result but move the threshold.
    ``generation``: the tokens of one generation (0: one unending generation). The step that ends a
    generation moves no threshold: the loop ends the generation before that step's feedback."""
    th, done, in_generation = rule.threshold, 0.0, 0.0
    kept_th, kept_law = [], []
    laws: dict[float, ExitLaw] = {}
    while done < tokens or not kept_law:
        key = round(th, 6)
        law = laws.get(key) or laws.setdefault(key, exit_law(table, th, gamma))
        if done >= skip_tokens:
            kept_th.append(th)
            kept_law.append(law)
        done += law.tau
        in_generation += law.tau
        if generation > 0 and in_generation >= generation:
            in_generation = 0.0  # the generation's last step: no feedback
        elif rule.adaptive:
            th = min(1.0, max(0.0, th + drift(rule, law)))
    return RunPrediction(tuple(kept_th), tuple(kept_law))


def _point_law(gamma: int, k: int, accepted: np.ndarray, forwards: int) -> ExitLaw:
    """One step's law: k drafts, ``accepted`` the law of the accepted count j = 0..k."""
    joint = np.zeros((gamma + 1, gamma + 1))
    joint[k, : k + 1] = accepted
    return ExitLaw(joint, float(forwards))


def _accepted_law(acc: int | np.ndarray, k: int) -> np.ndarray:
    """The law of a step's accepted count j = 0..k: a point at min(k, acc) where ``acc`` is the leading run
    (temperature 0); P(j ≥ m) = a_1···a_m where it is the drafts' acceptance probabilities (sampled)."""
    law = np.zeros(k + 1)
    if np.ndim(acc) == 0:
        law[min(k, int(acc))] = 1.0
        return law
    survive = np.concatenate([[1.0], np.cumprod(np.clip(np.asarray(acc, float)[:k], 0, 1))])
    law[:k] = survive[:k] - survive[1 : k + 1]
    law[k] = survive[k]
    return law


def replay_path(runs: Sequence[tuple[Sequence[Sequence[float]], Sequence]], rule: ExitRule, gamma: int,
                tokens: float, skip_tokens: float = 0.0, replicas: int = 8, seed: int = 0) -> RunPrediction:
    """The rule replayed on the calibration's own trajectories and the drafter's own chains instead of
    independent draws from the table.

    ``runs``: per trajectory, per root t in order, (c_1..c_g) — the confidences of the chain the drafter
    drafts from t without the exit (its depth-d forward reads its earlier drafts' KV) — and its acceptance:
    at temperature 0 how many of its leading drafts p's greedy tokens accept; for sampled drafts the rejection
    rule's probability of each draft (a_1..a_g). The loop walks the trajectory: a step rooted at t drafts
    depth d ≥ 2 while c_d ≥ γ_th, accepts j drafts (min(k, leading run); sampled: P(j ≥ m) = a_1···a_m, kept
    as the step's law, the walk going on by a draw from it — the trajectory's own next token standing for the
    one the rejection resamples — over ``replicas`` walks), and the next step is rooted where it ended; the
    rule's state carries from step to step and trajectory to trajectory, the trajectories taken in turn until
    ``tokens`` are generated. Why: the table reads depth d's confidence as depth 1's at an independent
    position, where the chain's deeper drafts read the drafter's own KV and easy text comes in runs (Draft &
    Verify code T0, 64 × 48 calibration: the table's rule settled at 0.96, the loop's at 0.845, τ −2.9%).
    Steps the trajectory's end cuts (fewer roots left than γ) move the rule but are left out, as a measured τ
    leaves them out (specsim.tau_error.steady_lengths); so are the steps of the first ``skip_tokens``. Chains
    recorded shorter than γ draft at most as deep as recorded. The step that ends a trajectory moves no
    threshold: the loop (methods.core.loop) ends a generation before that step's feedback (updating there too
    put the replay's threshold one update per generation ahead of the loop's: Draft & Verify code T0
    in-sample, 48 × 32, τ +3.8%, where the loop's own thresholds replay its every step exactly)."""
    assert gamma >= 1, f"the longest draft {gamma} must be >= 1"
    seqs = [([np.asarray(c, float) for c in confs], [a if np.ndim(a) == 0 else np.asarray(a, float)
                                                      for a in acc]) for confs, acc in runs]
    assert seqs and all(len(c) == len(a) for c, a in seqs), "each trajectory: one acceptance per root"
    assert any(len(c) >= gamma for c, _ in seqs), f"no trajectory holds a full draft of {gamma}"
    sampled = any(np.ndim(a) > 0 for _, acc in seqs for a in acc)
    rng = np.random.default_rng(seed)
    kept_th: list[float] = []
    kept_law: list[ExitLaw] = []
    cut_law: list[ExitLaw] = []
    for _ in range(replicas if sampled else 1):
        th, smoothed, done, i, kept = rule.threshold, rule.target_acceptance, 0.0, 0, 0
        while done < tokens or not kept:
            confs, acc = seqs[i % len(seqs)]
            i += 1
            t, n = 0, len(confs)
            while t < n:
                conf = confs[t]
                g = max(1, min(gamma, n - t, conf.size))
                k = 1
                while k < g and conf[k] >= th:
                    k += 1
                law = _accepted_law(acc[t], k)
                j = int(rng.choice(k + 1, p=law)) if sampled else int(np.argmax(law))
                forwards = k + 1 if k < g else k  # a forward below the threshold was paid for
                if done >= skip_tokens:  # past the warm-up: a kept step, or one the trajectory's end cut
                    step = _point_law(gamma, k, law, forwards)
                    if n - t >= gamma:
                        kept_th.append(th)
                        kept_law.append(step)
                        kept += 1
                    else:
                        cut_law.append(step)
                done += min(j + 1, n - t)
                t += j + 1
                if rule.adaptive and t < n:  # the step that ends the generation gets no feedback in the loop
                    th, smoothed = next_state(rule, th, smoothed, j / k)
    return RunPrediction(tuple(kept_th), tuple(kept_law), tuple(cut_law))
