"""Draft & Verify's adaptive draft-exit priced by specsim.adaptive_exit: the law of the draft length, the
accepted length and the draft forwards against a Monte Carlo of the rule itself (the drafter's stop test and
its threshold update, next_state), and the run's step time under a cost model."""

from __future__ import annotations

import numpy as np
import pytest

from specsim.adaptive_exit import ConfidenceTable, ExitRule, exit_law, next_state, replay_path, threshold_path
from specsim.cost import CostModel, DraftCost, MeasuredCost
from specsim.tree import Tree


def _table(seed: int = 0) -> ConfidenceTable:
    """Confidences skewed high, acceptance rising with confidence (as a draft's calibration shows)."""
    rng = np.random.default_rng(seed)
    c = rng.beta(2, 1, 4000)
    return ConfidenceTable.from_samples(c, rng.random(4000) < c, bins=20)


def _draft(c: np.ndarray, a: np.ndarray, threshold: float) -> tuple[int, int, int]:
    """The drafter's loop (methods.drafters.draft_verify.propose) on drawn (c, a) per depth: (drafted k,
    accepted j, forwards)."""
    k = forwards = 0
    for d in range(c.size):
        forwards += 1
        if d > 0 and c[d] < threshold:
            break
        k += 1
    j = 0
    while j < k and a[j]:
        j += 1
    return k, j, forwards


@pytest.mark.parametrize("threshold", [0.0, 0.35, 0.72, 1.0])
def test_exit_law_matches_a_monte_carlo_of_the_rule(threshold):
    table, gamma, n = _table(), 5, 20000
    rng = np.random.default_rng(1)
    c, a = table.sample(n * gamma, rng)
    runs = np.array([_draft(ci, ai, threshold) for ci, ai in zip(c.reshape(n, gamma), a.reshape(n, gamma))])
    law = exit_law(table, threshold, gamma)
    se = runs.std(0) / np.sqrt(n) + 1e-9
    drafted = np.dot(law.drafted, np.arange(gamma + 1))
    assert abs(drafted - runs[:, 0].mean()) < 5 * se[0] + 1e-6
    assert abs(law.tau - 1 - runs[:, 1].mean()) < 5 * se[1] + 1e-6
    assert abs(law.forwards - runs[:, 2].mean()) < 5 * se[2] + 1e-6
    rate = (runs[:, 1] / runs[:, 0]).mean()
    assert law.rate == pytest.approx(rate, abs=0.02)
    assert law.joint.sum() == pytest.approx(1.0)


def test_extreme_thresholds_are_the_plain_chain_and_a_single_draft():
    table, gamma = _table(), 4
    alpha = table.alpha
    free = exit_law(table, 0.0, gamma)  # never stops: Leviathan's chain of γ with α
    assert free.tau == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha))
    assert free.forwards == pytest.approx(gamma)
    one = exit_law(table, 1.0, gamma)  # always stops after the first token, paying a second forward
    assert one.tau == pytest.approx(1 + alpha) and one.forwards == pytest.approx(2)


def test_threshold_path_follows_the_adaptive_rule_in_expectation():
    """Mean-field path against many Monte Carlo runs of the literal rule (stop test + next_state)."""
    table, gamma, rule, tokens = _table(), 6, ExitRule(threshold=0.3, target_acceptance=0.8), 600
    path = threshold_path(table, rule, gamma, tokens)
    rng = np.random.default_rng(2)
    taus, finals = [], []
    for _ in range(60):
        th, smoothed, done, accepted = rule.threshold, rule.target_acceptance, 0, []
        while done < tokens:
            c, a = table.sample(gamma, rng)
            k, j, _ = _draft(c, a, th)
            accepted.append(j + 1)
            done += j + 1
            th, smoothed = next_state(rule, th, smoothed, j / k)
        taus.append(np.mean(accepted))
        finals.append(th)
    assert path.tau == pytest.approx(np.mean(taus), rel=0.03)
    assert path.thresholds[-1] == pytest.approx(np.mean(finals), abs=0.03)
    assert path.thresholds[-1] > rule.threshold  # acceptance below the target raises the threshold


def test_fixed_rule_keeps_its_threshold_and_warmup_steps_are_left_out():
    table = _table()
    fixed = threshold_path(table, ExitRule(threshold=0.5, adaptive=False), 4, 200)
    assert set(fixed.thresholds) == {0.5}
    whole = threshold_path(table, ExitRule(threshold=0.3), 4, 400)
    measured = threshold_path(table, ExitRule(threshold=0.3), 4, 400, skip_tokens=200)
    assert len(measured.thresholds) < len(whole.thresholds)
    assert measured.thresholds[-1] == pytest.approx(whole.thresholds[-1])


def test_run_step_time_prices_the_forwards_and_the_drafted_chain():
    t = MeasuredCost.from_mapping({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7})
    cost = CostModel(t, DraftCost(ratio=0.4))
    run = threshold_path(_table(), ExitRule(threshold=0.6, adaptive=False), 3, 100)
    law = run.laws[0]
    verify = sum(p * cost.tree_verify_time(Tree.chain(k)) for k, p in enumerate(law.drafted))
    assert run.step_time(cost) == pytest.approx(law.forwards * 0.4 + verify)
    assert run.speedup(cost) == pytest.approx(law.tau / (law.forwards * 0.4 + verify))
    assert run.draft_time(cost) == pytest.approx(law.forwards * 0.4)  # the breakdown metrics.json reports


def test_a_finite_run_is_cut_on_the_exit_law_not_on_the_full_chain():
    """The decode speedup of N tokens: the run's τ law is the exit law's (mean τ, at most γ + 1), and the
    last step's cut at N matches a Monte Carlo of the rule drafting N tokens; it can only lower the speedup
    (the full chain's law read 7.3 tokens per forward at τ 2.3 and a decode speedup above the steady one)."""
    table, gamma, n_tokens = _table(), 8, 12
    run = threshold_path(table, ExitRule(threshold=0.6, adaptive=False), gamma, 1000)
    law = run.tau_law
    assert law.size == gamma + 2 and law[0] == 0 and law.sum() == pytest.approx(1.0)
    assert np.dot(np.arange(law.size), law) == pytest.approx(run.tau)
    rng, forwards = np.random.default_rng(3), []
    for _ in range(4000):
        left = steps = 0
        while left < n_tokens:
            c, a = table.sample(gamma, rng)
            left, steps = left + _draft(c, a, 0.6)[1] + 1, steps + 1
        forwards.append(steps)
    per_forward = n_tokens / np.mean(forwards)
    se = per_forward * np.std(forwards) / np.mean(forwards) / np.sqrt(len(forwards))
    assert run.tokens_per_forward(n_tokens) == pytest.approx(per_forward, abs=5 * se)
    assert run.tokens_per_forward(n_tokens) < run.tau
    t = MeasuredCost.from_mapping({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, 16: 2.0})
    cost = CostModel(t, DraftCost(ratio=0.4))
    assert run.decode_speedup(cost, n_tokens) < run.speedup(cost)
    assert run.decode_speedup(cost, 10**5) == pytest.approx(run.speedup(cost), rel=1e-3)


def test_confidence_table_rejects_bad_input():
    with pytest.raises(AssertionError, match="sum"):
        ConfidenceTable((0.0, 0.5, 1.0), (0.5, 0.4), (0.5, 0.5))
    with pytest.raises(AssertionError, match="as many"):
        ConfidenceTable.from_samples([0.5, 0.6], [True])


def test_weighted_table_is_the_law_of_a_sampled_draft():
    """Sampled drafts (temperature > 0): the table built from every token x of q with weight q(x), c = q(x)
    and acceptance min(1, p(x)/q(x)) is the law that drawing x ~ q and tossing the rejection coin gives."""
    rng = np.random.default_rng(3)
    V, T = 6, 40
    p, q = rng.dirichlet(np.full(V, 0.7), T), rng.dirichlet(np.full(V, 0.7), T)
    exact = ConfidenceTable.from_samples(q.ravel(), np.minimum(1, p / q).ravel(), bins=10,
                                         weights=(q / T).ravel())
    pos = rng.integers(0, T, 200_000)
    x = (rng.random(pos.size)[:, None] > q[pos].cumsum(1)).sum(1)
    c = q[pos, x]
    mc = ConfidenceTable.from_samples(c, rng.random(pos.size) < np.minimum(1, p[pos, x] / c), bins=10)
    np.testing.assert_allclose(exact.mass, mc.mass, atol=0.005)
    assert abs(exact.alpha - mc.alpha) < 0.005
    assert abs(exact.alpha - np.minimum(p, q).sum(1).mean()) < 1e-9  # α = E Σ_x min(p, q)
    for s in (0.3, 0.5):
        np.testing.assert_allclose(exact.above(s), mc.above(s), atol=0.01)


def _chains(c: list[float], a: list[bool], depth: int = 4) -> tuple[list[list[float]], list[int]]:
    """Per root t the chain a positional drafter drafts: confidences c[t : t + depth], its accepted run the
    leading a's."""
    confs = [c[t : t + depth] for t in range(len(c))]
    runs = [next((i for i, x in enumerate(a[t : t + depth]) if not x), len(a[t : t + depth]))
            for t in range(len(a))]
    return confs, runs


def _blocks() -> tuple[list[list[float]], list[int]]:
    """A trajectory of 100 roots in runs: 10 easy (c 0.9, accepted), 10 hard (c 0.1, rejected), 5 times."""
    easy = [True] * 10 + [False] * 10
    return _chains([0.9 if e else 0.1 for e in easy] * 5, easy * 5)


def test_replay_walks_the_trajectory_where_easy_text_comes_in_runs():
    """Fixed threshold 0.5, γ = 4, by hand: each block of 20 is 2 steps of 5 tokens (4 drafts accepted) and
    10 of 1; the trajectory's last 3 steps (fewer than γ positions left) are cut and left out: 97 tokens in
    57 steps. The table of the same positions takes depths as independent draws (s = β = α = 1/2): τ 1.9375,
    14% off the loop that walks them."""
    c, a = _blocks()
    rule = ExitRule(threshold=0.5, adaptive=False)
    run = replay_path([(c, a)], rule, 4, 97)
    assert len(run.laws) == 57 and run.tau == pytest.approx(97 / 57)
    table = ConfidenceTable.from_samples([x[0] for x in c], [r > 0 for r in a], bins=10)
    assert threshold_path(table, rule, 4, 97).tau == pytest.approx(1.9375)
    # drafts: 2 of 4 per easy run; a hard run 9 of 1 and its last 1 of 4 (the easy run ahead is confident);
    # the last hard run's 7 kept steps 1 each
    assert run.draft_length == pytest.approx((4 * (8 + 9 + 4) + 8 + 7) / 57)


def test_replayed_rule_is_the_drafters_rule_step_by_step():
    """Adaptive: the replay's thresholds are the drafter's stop test and next_state on the trajectory, the
    rule's state carried across trajectories (no update after a trajectory's last step, as the loop gives
    none) and the warm-up's steps left out."""
    easy = ([True] * 10 + [False] * 10) * 5
    pc, pa = [0.9 if e else 0.1 for e in easy], easy
    rule = ExitRule(threshold=0.3, target_acceptance=0.8)
    runs = [_chains(pc, pa), _chains(pc[:50], pa[:50])]
    whole = replay_path(runs, rule, 4, 300)
    th, smoothed, seen = rule.threshold, rule.target_acceptance, []
    for cc, aa in [(pc, pa), (pc[:50], pa[:50])] * 2:
        t = 0
        while t < len(cc):
            g = min(4, len(cc) - t)
            k, j, _ = _draft(np.asarray(cc[t:t + g]), np.asarray(aa[t:t + g]), th)
            if g == 4:
                seen.append((th, j + 1))
            t += j + 1
            if t < len(cc):  # the generation's last step ends it before the drafter's feedback
                th, smoothed = next_state(rule, th, smoothed, j / k)
    assert whole.thresholds == pytest.approx([x for x, _ in seen][:len(whole.thresholds)])
    assert whole.tau == pytest.approx(np.mean([n for _, n in seen][:len(whole.laws)]))
    later = replay_path(runs, rule, 4, 300, skip_tokens=100)
    assert later.thresholds == whole.thresholds[-len(later.thresholds):]


def test_replay_reads_the_chains_own_deeper_confidences():
    """A drafter unsure at depth 1 but sure deeper (its depth-2 forward reads its own draft's KV): the chain's
    c_2 decides the exit, not depth 1's confidence at the next position the table would read."""
    confs, acc = [[0.1, 0.9, 0.2, 0.2]] * 40, [4] * 40  # every chain accepted to its end
    run = replay_path([(confs, acc)], ExitRule(threshold=0.5, adaptive=False), 4, 30)
    assert run.draft_length == pytest.approx(2) and run.tau == pytest.approx(3)
    assert run.forwards == pytest.approx(3)  # the third forward fell below the threshold


def test_sampled_replay_keeps_each_steps_law_of_accepted_drafts():
    """Sampled drafts: a_d is the rejection rule's probability of draft d, so P(j ≥ m) = a_1···a_m; a fixed
    threshold every root drafts 3: P(j) = (1/2, 1/4, 1/8, 1/8), τ = 1 + 7/8 at every kept step whatever the
    walk draws. a_d = 1 throughout is the greedy replay of chains accepted to their end."""
    confs = [[0.9, 0.9, 0.9]] * 60
    rule = ExitRule(threshold=0.5, adaptive=False)
    run = replay_path([(confs, [[0.5, 0.5, 0.5]] * 60)], rule, 3, 200, replicas=4, seed=3)
    assert run.tau == pytest.approx(1.875)
    assert run.laws[0].joint[3] == pytest.approx([0.5, 0.25, 0.125, 0.125])
    sure = replay_path([(confs, [[1.0, 1.0, 1.0]] * 60)], rule, 3, 200, replicas=4)
    greedy = replay_path([(confs, [3] * 60)], rule, 3, 200)
    assert sure.tau == pytest.approx(greedy.tau) == pytest.approx(4.0)
    assert len(sure.laws) == 4 * len(greedy.laws)  # replicas of one walk where nothing is drawn


def test_threshold_path_gives_a_generations_last_step_no_update():
    """The loop ends a generation before its last step's feedback: the mean-field path leaves the threshold
    where it was after the step that completes ``generation`` tokens, and moves it after every other."""
    table, rule = _table(), ExitRule(threshold=0.3, target_acceptance=0.95)  # below target: γ_th rises
    every = threshold_path(table, rule, 4, 300)
    cut = threshold_path(table, rule, 4, 300, generation=20)
    done, still = 0.0, 0
    for i, law in enumerate(cut.laws[:-1]):
        done += law.tau
        if done >= 20:
            done = 0.0
            still += 1
            assert cut.thresholds[i + 1] == cut.thresholds[i]
        else:
            assert cut.thresholds[i + 1] > cut.thresholds[i]
    assert still >= 10 and cut.thresholds[-1] < every.thresholds[-1]
