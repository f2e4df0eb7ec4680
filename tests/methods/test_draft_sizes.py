"""Drafts shorter than the tree (prompt lookup finds no n-gram, or a short continuation): the calibration
counts the size of each draft the loop proposed, and the simulator prices the verify forward on that law
instead of the full tree's (methods.measurement.calibrate.SizeRecorder, profiles.verify_size_law)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from methods.core.drafter import Draft
from methods.measurement.calibrate import SizeRecorder, loop_forward_tokens, measure_profile, remeasure_reason
from methods.measurement.profiles import (
    Profile,
    timed_forward_law,
    to_measured_cost,
    tree_predictions,
    verify_size_law,
)
from specsim.tree import Tree

SMALL = ("task=calibrate", "model=random_tiny", "workload.prompt_tokens=32", "calibration.prompts=2",
         "calibration.new_tokens=8", "calibration.depth_prompts=1", "calibration.reps=2",
         "calibration.max_reps=0", "calibration.warmup=1", "calibration.width=8", "tree.budgets=[1,2,4,8]")


class _Lengths:
    """A drafter proposing chains of the given lengths in turn."""

    needs_hidden_states = False
    marker = "mine"

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.i = lengths, 0

    def propose(self, ctx) -> Draft:
        k = self.lengths[self.i % len(self.lengths)]
        self.i += 1
        return Draft(Tree.chain(k), torch.zeros(k + 1, dtype=torch.long))


def test_size_recorder_counts_drafts_away_from_the_end():
    rec = SizeRecorder(_Lengths([0, 4, 2, 4]), depth=4)
    for max_new in (48, 48, 48, 48, 3):  # the last one is cut by the generation's end: not counted
        rec.propose(SimpleNamespace(max_new=max_new))
    assert rec.sizes == {1: 1, 5: 2, 3: 1}
    assert rec.level_means == [1.0, 0.75, 0.75, 0.5, 0.5]  # nodes per depth, root first, over the 4 counted
    assert rec.marker == "mine" and rec.needs_hidden_states is False  # the rest is the drafter's


def test_size_recorder_of_every_step_counts_sizes_alone():
    """Depth 0 (the timed rounds' loop): every step's size counted and nothing else, since the recorder
    runs inside the loop's draft timer; the nodes per depth of each new tree (prompt lookup's) read its
    draft +0.02-0.04 t(1) per step above the loop's without the recorder."""
    drafter = _Lengths([0, 4, 2])
    rec = SizeRecorder(drafter, depth=0)
    drafts = [rec.propose(SimpleNamespace(max_new=n)) for n in (48, 48, 1)]
    assert rec.sizes == {1: 1, 5: 1, 3: 1}
    assert not any("depths" in vars(d.tree) for d in drafts)  # Tree.depths (cached) never computed

def test_loop_forward_is_the_mean_draft_when_drafts_fall_short():
    cfg = SimpleNamespace(method=SimpleNamespace(verify_extra_tokens=0))
    run = SimpleNamespace(drafter=object(), tree=Tree.chain(4))
    assert loop_forward_tokens(cfg, run) == 5  # no counts: the priced tree
    assert loop_forward_tokens(cfg, run, {5: 10}) == 5
    assert loop_forward_tokens(cfg, run, {1: 6, 3: 2, 5: 2}) == 2  # (6 + 6 + 10) / 10 = 2.2
    lookahead = SimpleNamespace(method=SimpleNamespace(verify_extra_tokens=6))  # its own extra tokens
    assert loop_forward_tokens(lookahead, run, {1: 6, 3: 2, 5: 2}) == 11


def _profile(sizes: dict[str, int]) -> Profile:
    t1 = 1e-3
    t_n = {1: 1e-3, 2: 1.1e-3, 3: 1.2e-3, 5: 1.4e-3, 8: 1.7e-3}
    return Profile((0.0, 0.4, 0.1, 0.5), (0.4, 0.6, 0.7, 0.8), t1, {n: t / t1 for n, t in t_n.items()},
                   0.02, "zoo", "prompt_lookup", "grounded", "cpu:test", "float32", 3, 100,
                   "2024-01-01T00:00:00+00:00", extra={"loop_tree_size": 5, "loop_verify_sizes": sizes})


def test_verify_size_law_only_for_short_drafts_of_the_loops_tree():
    law = verify_size_law(_profile({"1": 6, "3": 2, "5": 2}), Tree.chain(4))
    assert law == {1: pytest.approx(0.6), 3: pytest.approx(0.2), 5: pytest.approx(0.2)}
    assert verify_size_law(_profile({"5": 100}), Tree.chain(4)) is None  # every draft the full chain
    assert verify_size_law(_profile({"1": 6, "5": 4}), Tree.chain(7)) is None  # another tree
    assert verify_size_law(_profile({"1": 6, "9": 4}), Tree.chain(4)) is None  # drafts beyond the tree
    assert verify_size_law(_profile({}), Tree.chain(4)) is None


def test_short_drafts_are_verified_at_their_size(run_config):
    """Each step's verify at its draft's size: E[t_loop(n)] with the root alone at the loop's t(1); the
    prediction with every draft the full chain is what it was. bf16 weights, named: the roofline's t(n) of
    float32 weights (``model.dtype=auto`` on a CPU with slow bf16) is flat to 5 tokens on the cpu preset."""
    cfg = run_config("method=prompt_lookup", "tree=chain", "tree.gamma=4", "hardware=cpu",
                     "model.dtype=bfloat16")
    short, full = _profile({"1": 6, "3": 2, "5": 2}), _profile({"5": 10})
    here, preset = tree_predictions(cfg, short, Tree.chain(4))
    base, base_preset = tree_predictions(cfg, full, Tree.chain(4))
    cost = to_measured_cost(short, chain=True)
    expect = 0.6 * cost.time(1) + 0.2 * cost.time(3) + 0.2 * cost.time(5)
    assert here["t_verify_s"] == pytest.approx(expect) and base["t_verify_s"] == pytest.approx(cost.time(5))
    assert here["predicted_tau"] == base["predicted_tau"]  # a short draft is a rejection: τ as before
    assert here["t_draft_s"] == base["t_draft_s"]
    assert here["predicted_speedup"] == pytest.approx(base["predicted_speedup"] * base["t_step_s"]
                                                      / here["t_step_s"])
    assert here["predicted_decode_speedup"] > base["predicted_decode_speedup"]
    assert here["predicted_mean_verify_tokens"] == pytest.approx(2.2)
    assert preset["t_verify_s"] < base_preset["t_verify_s"]  # the roofline's prediction likewise


def test_short_drafts_price_the_loops_own_verification_at_calibration(run_config):
    """With the loop's excess (its verification beyond the timed forward, in proportion: taken at the
    mean draft's forward), every step of the speculative loop, the root alone included, pays it: on a
    linear t(n) the law's price is the loop's measured verification exactly (the root alone at the
    autoregressive loop's t(1) read it low)."""
    cfg = run_config("method=prompt_lookup", "tree=chain", "tree.gamma=4", "hardware=cpu")
    t1, walk, loop_verify = 1e-3, 0.02, 1.12  # ratios of t(1); the loop's verification per step
    linear = {n: 0.6 + 0.03 * (n - 1) for n in (1, 2, 3, 5, 8)}  # t(n)/t(1), timed back to back
    over = loop_verify - linear[2]  # the loop's verification beyond t(2), its mean draft's forward
    prof = dataclasses.replace(_profile({"1": 5, "3": 5}), t_n_ratios=linear, verify_overhead_ratio=over)
    prof.extra.update(verify_step_ratios={"0": walk}, verify_chain_ratios={}, loop_verify_forward_tokens=2)
    here, _ = tree_predictions(cfg, prof, Tree.chain(4))
    assert here["t_verify_s"] == pytest.approx(loop_verify * t1)
    assert here["t_verify_s"] > 0.5 * t1 + 0.5 * float(to_measured_cost(prof, chain=True).time(3))


def test_short_drafts_on_a_bent_t_n_price_the_loops_own_verification(run_config):
    """The loop forwarded the root alone on most steps and its full chain on the rest (prompt lookup's
    grounded T = 1 loop: 58% and 40%, a mean 2.65 tokens); t(n) bends (0.80 at 1, 1.00 from 3): its
    overhead taken beside the mean t(k) of its sizes, not beside t(3) of their rounded mean, prices the
    loop's own law at its measured verification (beside t(3), 10% below it on the quiet sweep)."""
    cfg = run_config("method=prompt_lookup", "tree=chain", "tree.gamma=4", "hardware=cpu")
    t1, walk, loop_verify = 1e-3, 0.1, 1.1  # ratios of t(1); the loop's verification per step
    bent = {1: 0.8, 2: 0.89, 3: 1.0, 4: 1.01, 5: 1.01, 8: 1.29}
    prof = dataclasses.replace(_profile({"1": 585, "3": 13, "5": 408}), t_n_ratios=bent, t_ar_s=t1,
                               verify_overhead_ratio=loop_verify - bent[3])
    prof.extra.update(verify_step_ratios={"0": walk}, verify_chain_ratios={}, loop_verify_forward_tokens=3,
                      verify_per_speculation_step_s=loop_verify * t1)
    here, _ = tree_predictions(cfg, prof, Tree.chain(4))
    assert here["t_verify_s"] == pytest.approx(loop_verify * t1)
    untimed = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items()
                                               if k != "verify_per_speculation_step_s"})
    assert tree_predictions(cfg, untimed, Tree.chain(4))[0]["t_verify_s"] < 0.95 * loop_verify * t1


def test_prompt_lookup_profile_counts_its_draft_sizes(run_config, tiny_models, cache):
    cfg = run_config(*SMALL, "method=prompt_lookup", "tree.gamma=3")
    prof = measure_profile(cfg, tiny_models, show_progress=False)
    sizes = {int(n): c for n, c in prof.extra["loop_verify_sizes"].items()}
    assert sizes and sum(sizes.values()) > 0 and all(1 <= n <= prof.extra["loop_tree_size"] for n in sizes)
    assert remeasure_reason(prof, cfg) == ""
    old = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items() if k != "loop_verify_sizes"})
    assert "draft sizes" in remeasure_reason(old, cfg)  # a profile from before the counts: measured again
    timed = {int(n): c for n, c in prof.extra["loop_verify_timed_sizes"].items()}  # every timed step
    assert sum(timed.values()) >= cfg.calibration.reps and all(1 <= n <= 4 for n in timed)
    varied = dataclasses.replace(prof, extra={**prof.extra, "loop_verify_sizes": {"1": 5, "4": 5}})
    assert remeasure_reason(varied, cfg) == ""
    untimed = dataclasses.replace(varied, extra={k: v for k, v in varied.extra.items()
                                                 if k != "loop_verify_timed_sizes"})
    assert "timed loop's forwards" in remeasure_reason(untimed, cfg)  # varied drafts, uncounted: again
    one_size = dataclasses.replace(untimed, extra={**untimed.extra, "loop_verify_sizes": {"4": 10}})
    assert remeasure_reason(one_size, cfg) == ""  # a drafter of one size prices its own t(n) as before


def test_the_loops_excess_is_taken_beside_the_forwards_its_timed_rounds_ran(run_config):
    """The timed rounds decode calibration.new_tokens per prompt, the depth run (the law priced) the
    workload's length, and their drafts' sizes differ (Lookahead's pool fills as a generation goes on; a
    few timed prompts draw their own mix): the loop's verification exceeds its own forwards by e, and that
    excess is taken beside the mean t(k) of the forwards the timed loop ran (``loop_verify_timed_sizes``).
    Beside the depth run's law it read 4% where the loop paid 10% (every step priced near its bare t(k)).
    Where both decoded generations of one length (a depth run of calibration.new_tokens: SpecInfer's, Draft
    & Verify's), the depth run's law stands."""
    cfg = run_config("method=prompt_lookup", "tree=chain", "tree.gamma=4", "hardware=cpu")
    t1, walk, excess = 1e-3, 0.003, 0.1
    bent = {1: 0.9, 2: 1.0, 3: 1.08, 5: 1.2, 8: 1.5}  # t(n)/t(1), timed back to back
    timed_forwards = 0.7 * bent[1] + 0.3 * bent[5]  # the timed loop: the root alone on 70% of its steps
    loop_verify = timed_forwards * (1 + excess) + walk
    prof = dataclasses.replace(_profile({"1": 5, "5": 5}), t_n_ratios=bent, t_ar_s=t1,
                               verify_overhead_ratio=loop_verify - timed_forwards)
    prof.extra.update(verify_step_ratios={"0": walk}, verify_chain_ratios={}, loop_verify_forward_tokens=3,
                      verify_per_speculation_step_s=loop_verify * t1,
                      loop_verify_timed_sizes={"1": 7, "5": 3}, loop_new_tokens=48,
                      split_sizes={"prompts": 48, "new_tokens": 32, "depth_prompts": 4})
    here, _ = tree_predictions(cfg, prof, Tree.chain(4))
    expect = 0.5 * bent[1] * (1 + excess) + 0.5 * bent[5] * (1 + excess) + walk  # the depth run's law
    assert here["t_verify_s"] == pytest.approx(expect * t1)
    older = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items()
                                             if k != "loop_verify_timed_sizes"})
    assert tree_predictions(cfg, older, Tree.chain(4))[0]["t_verify_s"] == pytest.approx(loop_verify * t1)
    same_length = dataclasses.replace(prof, extra={**prof.extra, "loop_new_tokens": 32})
    same = tree_predictions(cfg, same_length, Tree.chain(4))[0]["t_verify_s"]
    assert same == pytest.approx(loop_verify * t1)
    assert timed_forward_law({"1": 5, "5": 5}, {"1": 7, "5": 3}, (48, 32)) == {1: pytest.approx(0.7),
                                                                               5: pytest.approx(0.3)}
    # a drafter whose drafts are all one size (its generation's cut last ones aside): its chain's t(n) stands
    assert timed_forward_law({"5": 10}, {"5": 9, "3": 1}, (48, 32)) is None
