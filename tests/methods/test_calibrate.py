"""task=calibrate and measured profiles: Sequoia's star-tree histogram (exact cases), the profile's layout,
its JSON cache and key, and the Sequoia tree built from it (methods.measurement.calibrate,
methods.measurement.profiles)."""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import methods.measurement.calibrate as calibrate_module
import methods.measurement.cost_table as cost_table_module
import methods.measurement.profiles as profiles_module
from methods.core.metrics import AcceptStats
from methods.core.sampling import SamplingParams
from methods.drafters.registry import drafter_class
from methods.measurement.calibrate import (
    WIDE_NODES,
    WIDE_SHAPE,
    Star,
    StarRule,
    calibrate,
    depth_tree,
    ensure_profile,
    measure_profile,
    pass_tree,
    rank_vector,
    remeasure_reason,
    split_sizes,
    star_children,
    star_ranks,
    times_wide_loop,
    wide_tree,
)
from methods.measurement.profiles import (
    Profile,
    apply_profile,
    calibration_cut_share,
    cold_walk_ratio,
    draft_levels,
    draft_pass_scale,
    draft_terms,
    load_profile,
    loop_forward_excess,
    loop_verify_s,
    measured_acceptance,
    prediction_metrics,
    profile_key,
    profile_path,
    save_profile,
    sequoia_config,
    sequoia_tree_for,
    to_measured_cost,
    tree_predictions,
)
from methods.models import Models
from specsim.acceptance import PositionalAcceptance
from specsim.config import Verifier
from specsim.cost import DraftCost, MeasuredCost
from specsim.expected import accepted_length_law
from specsim.io import read_json
from specsim.run_steps import room_mean
from specsim.tree import Tree, cut

BUDGETS = [1, 2, 4, 8]
SMALL = ("task=calibrate", "model=random_tiny", "workload.prompt_tokens=32", "calibration.prompts=2",
         "calibration.new_tokens=8", "calibration.depth_prompts=1", "calibration.reps=2",
         "calibration.max_reps=0", "calibration.warmup=1", "calibration.width=8",
         f"tree.budgets=[{','.join(map(str, BUDGETS))}]")
# the helper profiles record no calibration split: read as the one calibrations took before they recorded it
# (UNRECORDED_SPLIT, 32 new tokens), which the default's 64 would call too small before the reason under test
LEGACY_SPLIT = "calibration.new_tokens=32"


def _same_draft(models: Models) -> Models:
    """The target as its own draft (a separate copy: its own KV cache)."""
    return Models(models.target, copy.deepcopy(models.target), models.tokenizer, models.device, models.dtype)


def _valid_vector(v, width: int) -> None:
    assert len(v) == width + 2 and v[0] == 0.0
    assert all(x >= 0 for x in v) and sum(v[1:]) == pytest.approx(1.0, abs=1e-9)


# ---- the star-tree histogram on synthetic laws ----------------------------------------------------------
def test_greedy_star_rank_is_the_rank_of_the_target_argmax():
    V = 12
    argmax = torch.tensor([3, 7, 0, 5])
    p = torch.nn.functional.one_hot(argmax, V).float()  # (T, V) temperature 0: one-hot p
    cands = torch.tensor([[3, 1, 2], [1, 2, 7], [4, 0, 9], [1, 2, 4]])  # argmax at rank 0, 2, 1, absent
    stars = [Star(c, None) for c in cands]
    ranks = star_ranks(p, torch.zeros(4, dtype=torch.long), stars, StarRule(False, Verifier.greedy),
                       torch.Generator().manual_seed(0))
    assert ranks == [0, 2, 1, None]
    assert rank_vector(ranks, 3) == [0.0, 0.25, 0.25, 0.25, 0.25]


def test_sequoia_star_without_replacement_matches_the_closed_form():
    """V = 2, p = (.5, .5), q = (.9, .1), W = 2. First draw x1 ~ q: token 0 (0.9) accepted w.p. 5/9, token 1
    (0.1) w.p. 1, so P(rank 1) = 0.6; after rejecting 0 the residual and the renormalised q are both
    one-hot on 1: P(rank 2) = 0.4, P(none) = 0."""
    n, gen = 4000, torch.Generator().manual_seed(0)
    q_logits = torch.tensor([0.9, 0.1]).log().expand(n, 2)
    rule = StarRule(True, Verifier.sequoia)
    stars = star_children(q_logits, 2, rule, SamplingParams(temperature=1.0), gen)
    p = torch.tensor([0.5, 0.5]).expand(n, 2)
    v = rank_vector(star_ranks(p, torch.zeros(n, dtype=torch.long), stars, rule, gen), 2)
    assert v[1] == pytest.approx(0.6, abs=0.03) and v[2] == pytest.approx(0.4, abs=0.03) and v[3] == 0.0


def test_star_children_topk_and_support():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, -9.0]])
    top = star_children(logits, 3, StarRule(False, Verifier.greedy), SamplingParams(0.0), torch.Generator())
    assert [s.children.tolist() for s in top] == [[1, 3, 2], [0, 2, 1]] and top[0].q is None
    sparse = SamplingParams(temperature=1.0, top_k=2)  # q has 2 tokens of mass: at most 2 children
    gen = torch.Generator().manual_seed(1)
    drawn = star_children(logits, 3, StarRule(True, Verifier.sequoia), sparse, gen)
    assert [sorted(s.children.tolist()) for s in drawn] == [[1, 3], [0, 2]]
    assert all(torch.allclose(s.q.sum(), torch.tensor(1.0)) for s in drawn)


# ---- calibration of a real (tiny) pair ------------------------------------------------------------------
def test_draft_equal_to_target_is_always_accepted_at_rank_one(run_config, tiny_models, cache):
    """q = p: the greedy star accepts q's top-1 (= p's argmax), and the Sequoia rule accepts x ~ q with
    probability min(1, p(x)/q(x)) = 1, so p_1 = 1 at any temperature (at T > 0 the exact Σ min(p, q) = Σ p:
    1 up to float rounding)."""
    models = _same_draft(tiny_models)
    for extra in ((), ("workload.temperature=1.0", "method.verifier=sequoia")):
        prof = measure_profile(run_config(*SMALL, "method=vanilla", *extra), models, show_progress=False)
        assert prof.acceptance_vector[1] == pytest.approx(1.0, abs=1e-6) and prof.n_positions > 0
        assert prof.extra["rank_counts"][0] == pytest.approx(prof.n_positions, rel=1e-6)


def test_calibration_times_more_rounds_while_its_ratios_scatter(run_config, tiny_models):
    """``calibration.reps`` rounds, then more up to ``max_reps`` while a ratio's median is less precise than
    ``median_se`` (0: always more); a profile keeps each round's figures. max_reps <= reps: reps rounds."""
    for extra, rounds in ((("calibration.max_reps=4", "calibration.median_se=0"), 4),
                          (("calibration.max_reps=4", "calibration.median_se=1e9"), 2),
                          (("calibration.max_reps=0", "calibration.median_se=0"), 2)):
        prof = measure_profile(run_config(*SMALL, "method=vanilla", *extra), tiny_models, show_progress=False)
        assert prof.extra["timing_rounds"] == rounds
        assert set(prof.extra["timing_series"]) == set(prof.timing_dispersion)
        assert all(len(v) == rounds for v in prof.extra["timing_series"].values())
        assert prof.extra["timing_seconds"] > 0


def test_profile_layout_round_trip_and_cache(run_config, tiny_models, cache, monkeypatch):
    cfg = run_config(*SMALL, "method=vanilla")
    # the cache logic is under test here, not this machine's noise (the bound has its own tests)
    monkeypatch.setattr(cost_table_module, "MAX_TIMING_DISPERSION", float("inf"))
    calls = []
    real = calibrate_module.measure_profile

    def counting(cfg, models=None, show_progress=True):
        calls.append(1)
        return real(cfg, models, show_progress=False)

    monkeypatch.setattr(calibrate_module, "measure_profile", counting)
    prof = ensure_profile(cfg, tiny_models, show_progress=False)
    _valid_vector(prof.acceptance_vector, 8)
    loop_tree = prof.extra["loop_tree_size"]  # timed too: the loop's verification overhead beyond t(n)
    # and the wide tree the loop's verification is timed on (its forward's excess at a second size)
    assert sorted(prof.t_n) == sorted({*BUDGETS, loop_tree, WIDE_NODES})
    assert all(t > 0 for t in prof.t_n.values())
    assert prof.draft_time_s > 0 and prof.t_ar_s > 0 and 0 < prof.n_positions <= 2 * 8
    # the loop per shape (the wide tree's: its draft in the rounds that time its verification)
    shapes = {f"qshape({s})/t1" for s in ("loop", "chain1", "star8", "fan4", "fan2", WIDE_SHAPE)}
    assert set(prof.timing_dispersion) == {"t1", "draft/t1", "verify/t1", *(f"t({n})/t1" for n in prof.t_n),
                                           *shapes, f"vloop({WIDE_NODES})/t1"}
    assert prof.extra["timing_rounds"] == 2 and len(prof.extra["timing_attempts"]) >= 1
    overhead = prof.extra["verify_per_speculation_step_s"] - prof.t_n[loop_tree]
    assert prof.verify_overhead_s == pytest.approx(max(0.0, overhead))
    assert prof.acceptance_by_depth and all(0 <= a <= 1 for a in prof.acceptance_by_depth)
    # the verification per tree size and the draft level per width, timed in the same rounds
    assert set(prof.extra["verify_step_ratios"]) == {"0", *(str(n) for n in prof.t_n if n > 1)}
    assert set(prof.extra["verify_chain_ratios"]) == {str(n) for n in prof.t_n if n > 1}
    assert set(prof.extra["draft_level_ratios"]) == {"1", "2", "4", "8"} and prof.extra["draft_models"] == 1
    assert prof.extra["draft_level_timing"] == "draft_model"
    terms = draft_terms(prof)  # the level beyond F and the nodes, a wide level's extra and its per fed node
    levels, level, wide = draft_levels(cfg, prof), terms[1] * prof.t_ar_s, terms[3] * prof.t_ar_s
    per_fed = terms[4] * prof.t_ar_s
    assert levels.time(1) == pytest.approx(level)
    growth = prof.extra["draft_level_ratios"]["8"] / prof.extra["draft_level_ratios"]["1"]
    assert levels.time(8) == pytest.approx(level * growth + wide + 7 * per_fed)
    assert prof.width == 8 and prof.key == profile_key(cfg) and prof.dtype == "float32"
    path = profile_path(cfg)
    assert path.parent == cache / "profiles" and path.is_file()
    assert Profile.from_json(json.loads(path.read_text())) == prof  # JSON round trip, t_n keys back to int
    assert ensure_profile(cfg, tiny_models) == prof and len(calls) == 1  # second call: from the cache
    wider = run_config(*_with("tree.budgets=[1,2,4,8,16]", "method=vanilla"))
    assert profile_path(wider) == path  # same key, but t(16) is missing: measured again
    assert 16 in ensure_profile(wider, tiny_models).t_n and len(calls) == 2
    # calibration.sizes: timed whatever the run's budgets, so a run of the same key that selects among
    # other budgets finds them (a sweep's Sequoia-8 row calibrating before its Sequoia-32 row)
    timed = run_config(*_with("tree.budgets=[1,2,4,8]", "calibration.sizes=[32]", "method=vanilla"))
    assert profile_path(timed) == path
    path.unlink()
    prof = ensure_profile(timed, tiny_models)
    assert {32, *BUDGETS} <= set(prof.t_n) and "32" in prof.extra["draft_level_ratios"] and len(calls) == 3
    assert ensure_profile(run_config(*_with("tree.budgets=[32]", "method=vanilla")), tiny_models) == prof
    assert len(calls) == 3


def _with(*overrides: str) -> tuple[str, ...]:
    """SMALL with some of its keys replaced (Hydra refuses two values for one key)."""
    keys = {o.split("=")[0] for o in overrides}
    return (*(o for o in SMALL if o.split("=")[0] not in keys), *overrides)


def test_profile_key_follows_what_the_profile_depends_on(run_config, cache):
    base = run_config(*_with("method=vanilla"))
    assert profile_key(base) == profile_key(run_config(*_with("method=vanilla", "calibration.prompts=3")))
    # at temperature 0 every verifier sees the same greedy star: the vector does not depend on it
    assert profile_key(base) == profile_key(run_config(*_with("method=vanilla", "method.verifier=chain")))
    changes = [("tree.gamma=3",), ("method=prompt_lookup",), ("workload=prose",), ("model=micro",),
               ("calibration.width=16",), ("workload.temperature=0.7", "method.verifier=chain"),
               ("workload.prompt_tokens=48",), ("calibration.new_tokens=16",)]
    for change in changes:
        assert profile_key(run_config(*_with("method=vanilla", *change))) != profile_key(base), change
    lookup = run_config(*_with("method=prompt_lookup"))
    bigger = run_config(*_with("method=prompt_lookup", "method.params.max_ngram_size=4"))
    assert profile_key(lookup) != profile_key(bigger)
    assert profile_key(lookup).startswith("random_tiny-prompt_lookup-code-cpu-float32-")


def test_load_profile_ignores_a_stale_format(run_config, cache):
    cfg = run_config(*SMALL, "method=vanilla")
    path = profile_path(cfg)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": -1, "t_n": {}}))
    assert load_profile(cfg) is None


def test_calibrate_task_writes_profile_and_metrics(run_config, cache, tmp_path):
    cfg = run_config(*SMALL, "method=vanilla")
    res = calibrate(cfg, tmp_path / "run", show_progress=False)
    assert res.path == profile_path(cfg)
    assert read_json(tmp_path / "run" / "profile.json")["key"] == res.profile.key
    m = res.metrics
    _valid_vector(m["acceptance_vector"], 8)
    sizes = sorted({*BUDGETS, res.profile.extra["loop_tree_size"], WIDE_NODES})
    assert m["t_n_tokens"] == sizes and len(m["t_n_s"]) == len(sizes)
    assert m["verify_overhead_s"] == res.profile.verify_overhead_s >= 0
    assert m["profile_path"] == str(res.path)
    assert 1 <= m["sequoia_tree_size"] <= max(BUDGETS) and m["sequoia_predicted_tau"] >= 1.0
    json.dumps(m)


# ---- tree=sequoia from a profile --------------------------------------------------------------------------
def _profile(max_draft_depth: int = 0) -> Profile:
    t_n = {1: 1e-3, 2: 1.02e-3, 4: 1.05e-3, 8: 1.1e-3, 16: 1.3e-3, 32: 1.8e-3, 64: 3e-3, 128: 5.5e-3}
    t1 = 1.1e-3
    ratios = {n: t / t1 for n, t in t_n.items()}
    return Profile((0.0, 0.6, 0.15, 0.05, 0.2), (0.6, 0.55), t1, ratios, 1e-4 / t1,
                   "zoo", "draft_model", "code", "cpu:test", "bfloat16", 3, 100, "2024-01-01T00:00:00+00:00",
                   max_draft_depth=max_draft_depth, timing_dispersion={"t1": 0.03, "draft/t1": 0.05})


def test_measured_cost_prices_the_loop_step():
    """t(1) = the loop's autoregressive step; trees pay their forward plus the verification overhead."""
    prof = dataclasses.replace(_profile(), verify_overhead_ratio=2e-4 / 1.1e-3)
    cost = to_measured_cost(prof)
    assert cost.time(1) == pytest.approx(prof.t_ar_s)
    for n in (2, 8, 128):
        assert cost.time(n) == pytest.approx(prof.t_n[n] + 2e-4)
    assert to_measured_cost(_profile()).time(8) == pytest.approx(prof.t_n[8])


def test_verification_overhead_grows_with_the_tree():
    """The loop's verification beyond the forward, measured on the drafter's chain, is priced per tree size:
    + v(n) − v(loop tree), timed per size for trees and chains (specinfer/greedy walks cost more on trees)."""
    t1 = 1.1e-3
    prof = dataclasses.replace(_profile(), verify_overhead_ratio=2e-4 / t1)
    prof.extra.update(verify_step_ratios={"0": 0.05, "8": 0.1, "64": 0.3},
                      verify_chain_ratios={"8": 0.06, "64": 0.2})
    wide, chain = to_measured_cost(prof), to_measured_cost(prof, chain=True)
    assert wide.time(64) == pytest.approx(prof.t_n[64] + 2e-4 + (0.3 - 0.05) * t1)
    assert chain.time(64) == pytest.approx(prof.t_n[64] + 2e-4 + (0.2 - 0.05) * t1)
    assert wide.time(8) == pytest.approx(prof.t_n[8] + 2e-4 + (0.1 - 0.05) * t1)
    assert wide.time(16) == pytest.approx(prof.t_n[16] + 2e-4)  # a size it was not timed at: no growth
    assert wide.time(1) == pytest.approx(t1)
    no_loop = dataclasses.replace(prof, verify_overhead_ratio=0.0)  # vLLM: the loop's overhead not priced
    assert to_measured_cost(no_loop).time(64) == pytest.approx(prof.t_n[64])


def test_the_walk_is_priced_cold_as_the_loop_walks():
    """The loop walks right after its verify forward; the calibration times the loop tree's walk v(0) so
    (first in its round) and the per-size walks warm, later. Each size's walk is priced with that cold
    excess, v(0) − the same shape's warm walk: at the loop's own chain the price is the loop's measured
    verification exactly (T = 1 chains read 5-9% low without it), and a tree pays the excess once."""
    t1 = 1.1e-3
    prof = dataclasses.replace(_profile(), verify_overhead_ratio=0.3)
    prof.extra.update(verify_step_ratios={"0": 0.11, "4": 0.08, "32": 0.2},
                      verify_chain_ratios={"4": 0.07, "32": 0.15}, loop_verify_forward_tokens=4,
                      loop_tree_size=4, loop_tree_depth=3)
    assert cold_walk_ratio(prof) == pytest.approx(0.11 - 0.07)  # the chain's own shape
    excess = loop_forward_excess(prof)
    wide, chain = to_measured_cost(prof), to_measured_cost(prof, chain=True)
    assert chain.time(4) == pytest.approx(prof.t_n[4] + prof.verify_overhead_s)  # the loop's own verification
    assert chain.time(32) == pytest.approx(prof.t_n[32] * (1 + excess) + (0.15 + 0.04) * t1)
    assert wide.time(32) == pytest.approx(prof.t_n[32] * (1 + excess) + (0.2 + 0.04) * t1)
    assert wide.time(1) == pytest.approx(t1)
    tree = dataclasses.replace(prof, extra={**prof.extra, "loop_tree_depth": 2})  # a 4-node tree: its size
    assert cold_walk_ratio(tree) == pytest.approx(0.11 - 0.08)
    older = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items() if k != "loop_tree_size"})
    assert cold_walk_ratio(older) == 0.0
    busy = dataclasses.replace(prof, verify_overhead_ratio=0.09)  # v(0) above the loop's whole overhead
    assert cold_walk_ratio(busy) == pytest.approx(0.09 - 0.07)
    assert to_measured_cost(busy, chain=True).time(4) == pytest.approx(prof.t_n[4] + busy.verify_overhead_s)
    constant = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items()
                                                if k != "loop_verify_forward_tokens"})
    assert to_measured_cost(constant, chain=True).time(32) == pytest.approx(
        prof.t_n[32] + prof.verify_overhead_s + (0.15 - 0.07) * t1)  # growth between warm walks


def test_loop_forward_excess_scales_with_the_tree():
    """The loop's verification beyond its forward and the walk is priced in proportion to the forward
    (the drafter's work between two verify forwards refills the caches): at the loop's own forward it is
    the loop's measured verification exactly; a tree pays it on its larger forward, plus its own walk."""
    t1 = 1.1e-3
    prof = dataclasses.replace(_profile(), verify_overhead_ratio=2e-4 / t1)
    prof.extra.update(verify_step_ratios={"0": 0.05, "8": 0.1, "64": 0.3},
                      verify_chain_ratios={"8": 0.06, "64": 0.2}, loop_verify_forward_tokens=4)
    excess = loop_forward_excess(prof)
    assert excess == pytest.approx((2e-4 / t1 - 0.05) / prof.t_n_ratios[4])
    wide, chain = to_measured_cost(prof), to_measured_cost(prof, chain=True)
    loop_verify = prof.t_n[4] + prof.verify_overhead_s  # what the loop measured on its own tree
    assert wide.time(4) == pytest.approx(loop_verify)  # walk not timed at 4: the loop tree's
    assert wide.time(64) == pytest.approx(prof.t_n[64] * (1 + excess) + 0.3 * t1)
    assert chain.time(64) == pytest.approx(prof.t_n[64] * (1 + excess) + 0.2 * t1)
    assert wide.time(64) > prof.t_n[64] + prof.verify_overhead_s + (0.3 - 0.05) * t1  # more than a constant
    assert wide.time(1) == pytest.approx(t1)
    cheap = dataclasses.replace(prof, verify_overhead_ratio=0.01)  # less than the walk: no negative excess
    assert loop_forward_excess(cheap) == 0.0
    untimed = dataclasses.replace(prof, extra={**prof.extra, "loop_verify_forward_tokens": 5})
    assert loop_forward_excess(untimed) is None  # t(5) not timed: the constant overhead
    assert to_measured_cost(untimed).time(64) == pytest.approx(prof.t_n[64] + 2e-4 + (0.3 - 0.05) * t1)


def test_the_loops_forward_excess_is_measured_on_a_wide_tree():
    """Where the calibration timed the loop's verification on a wide tree too, the forward's excess over the
    timed t(n) is the line in t(n) through the two measured excesses (the loop's own tree and the wide one):
    each tree is priced at what the loop measured on it, sizes between on the line, and an excess no larger
    on the wide tree than on the chain stays the chain's (a constant, never less). Taken in proportion to
    t(n), the zoo's 26-64-node trees read their verification 10% dear with the bf16 cache's kernel."""
    t1 = 1.1e-3
    prof = dataclasses.replace(_profile(), verify_overhead_ratio=0.25)
    prof.extra.update(verify_step_ratios={"0": 0.05, "32": 0.1, "64": 0.2}, loop_verify_forward_tokens=4)
    t4, t16, t32, t64 = (prof.t_n_ratios[n] for n in (4, 16, 32, 64))
    e4 = 0.25 - 0.05  # the loop's excess at its own forward, in t(1)
    e32 = e4 + 0.1  # grows a little with the tree: less than in proportion (e4 · t32 / t4)
    assert e32 < loop_forward_excess(prof) * t32
    measured = t32 + e32 + 0.1  # the loop's verification per step on the wide tree, / t(1)
    wide = dataclasses.replace(prof, extra={**prof.extra, "loop_verify_wide": {"32": measured}})
    cost = to_measured_cost(wide)
    assert cost.time(4) == pytest.approx(prof.t_n[4] + 0.25 * t1)  # the loop's own verification
    assert cost.time(32) == pytest.approx(measured * t1)  # the wide loop's own verification
    slope = (e32 - e4) / (t32 - t4)
    # 16 on the line (its walk not timed: the loop tree's)
    assert cost.time(16) == pytest.approx(prof.t_n[16] + (e4 + slope * (t16 - t4) + 0.05) * t1)
    assert cost.time(64) == pytest.approx(prof.t_n[64] + (e4 + slope * (t64 - t4) + 0.2) * t1)
    assert cost.time(64) < to_measured_cost(prof).time(64)  # below the pricing in proportion
    assert cost.time(1) == pytest.approx(t1)
    assert loop_verify_s(wide, 32) == pytest.approx(measured * t1)
    flat = dataclasses.replace(prof, extra={**prof.extra, "loop_verify_wide": {"32": t32 + 0.1}})  # no excess
    assert to_measured_cost(flat).time(64) == pytest.approx(prof.t_n[64] + (e4 + 0.2) * t1)  # the chain's
    # a fifth of the wide loop's forwards were of 16 nodes (its last steps draft fewer): E beside their mean t
    t_mix = 0.8 * t32 + 0.2 * t16
    cut = dataclasses.replace(prof, extra={**prof.extra, "loop_verify_wide": {"32": t_mix + e32 + 0.1},
                                           "loop_verify_wide_sizes": {"32": 8, "16": 2}})
    e64 = e4 + (e32 - e4) / (t_mix - t4) * (t64 - t4)
    assert to_measured_cost(cut).time(64) == pytest.approx(prof.t_n[64] + (e64 + 0.2) * t1)
    untimed = dataclasses.replace(prof, extra={**prof.extra, "loop_verify_wide": {"48": 9.0}})  # no t(48)
    assert to_measured_cost(untimed).time(64) == pytest.approx(to_measured_cost(prof).time(64))


def test_a_profile_of_a_smaller_calibration_split_is_measured_again(run_config):
    cfg = run_config("method=vanilla", "tree.budgets=[1,2,4,8]", "calibration.new_tokens=32")
    prof = _shaped_profile(0.4, 0.2, 0.02, 0.06)
    prof.extra.update(verify_step_ratios={"0": 0.01}, loop_verify_sizes={"5": 10}, rank_runs=[[[0, -1]]],
                      loop_verify_wide={"32": 3.0})
    assert remeasure_reason(prof, cfg) == ""  # no record: the sizes it was taken at then (24 x 32, 4)
    more = run_config("method=vanilla", "tree.budgets=[1,2,4,8]", "calibration.new_tokens=32",
                      "calibration.prompts=48")
    assert profile_key(more) == profile_key(cfg)  # the same profile, asked for at more power
    assert "prompts 24 < 48" in remeasure_reason(prof, more)
    prof.extra.update(split_sizes={"prompts": 48, "new_tokens": 32, "depth_prompts": 4})
    assert remeasure_reason(prof, more) == "" and remeasure_reason(prof, cfg) == ""  # a larger one serves
    assert "new_tokens 32 < 48" in remeasure_reason(
        prof, run_config("method=vanilla", "tree.budgets=[1,2,4,8]", "calibration.new_tokens=48"))
    # the default reads the workload's whole generation (64 tokens), under a key of its own (the generation
    # length is in it); a profile of 32 found there all the same is measured again
    default = run_config("method=vanilla", "tree.budgets=[1,2,4,8]")
    assert "new_tokens 32 < 64" in remeasure_reason(prof, default)


def test_a_profile_without_the_wide_loop_is_measured_again(run_config):
    cfg = run_config(LEGACY_SPLIT, "method=vanilla", "tree.budgets=[1,2,4,8]")
    prof = _shaped_profile(0.4, 0.2, 0.02, 0.06)
    prof.extra.update(verify_step_ratios={"0": 0.01}, loop_verify_sizes={"5": 10}, rank_runs=[[[0, -1]]])
    assert "wide tree" in remeasure_reason(prof, cfg)
    prof.extra.update(loop_verify_wide={"32": 3.0})
    assert remeasure_reason(prof, cfg) == ""
    chain = run_config(LEGACY_SPLIT, "method=vanilla", "workload.temperature=1", "method.verifier=chain",
                       "tree.budgets=[1,2,4,8]")  # a verifier of chains: the wide tree under Sequoia's
    assert times_wide_loop(drafter_class("draft_model"), chain, depth_tree(chain)) is True
    assert "wide tree" in remeasure_reason(dataclasses.replace(prof, extra={
        **prof.extra, "loop_verify_wide": {}}), chain)
    lookup = run_config("method=prompt_lookup", "tree.budgets=[1,2,4,8]")  # no drafter on another tree
    assert times_wide_loop(drafter_class("prompt_lookup"), lookup, depth_tree(lookup)) is False
    medusa = run_config("method=medusa", "tree=sequoia", "tree.budgets=[1,2,4,8]")  # its pass per tree
    assert times_wide_loop(drafter_class("medusa"), medusa, depth_tree(medusa)) is True


def test_draft_levels_scale_the_loops_level_by_the_timed_growth():
    prof = dataclasses.replace(_profile(), draft_ratio=0.3)
    prof.extra.update(draft_level_ratios={"1": 0.1, "2": 0.12, "8": 0.25}, draft_models=3)
    cfg = SimpleNamespace(method=SimpleNamespace(draft_steps="depth"))
    levels = draft_levels(cfg, prof)
    assert levels.time(1) == pytest.approx(prof.draft_time_s)  # the loop's own level (all 3 members)
    assert levels.time(8) == pytest.approx(prof.draft_time_s * 2.5)
    assert draft_levels(SimpleNamespace(method=SimpleNamespace(draft_steps="once")), prof) is None


def test_cost_rounds_time_the_verification_per_size():
    from methods.measurement.cost_table import T_AR, VCHAIN, VSTEP, cost_table

    rounds = [{T_AR: 1.0, 4: 1.2, (VSTEP, 0): 0.02, (VSTEP, 4): 0.05, (VCHAIN, 4): 0.03},
              {T_AR: 2.0, 4: 2.4, (VSTEP, 0): 0.04, (VSTEP, 4): 0.12, (VCHAIN, 4): 0.06}]
    table = cost_table(rounds)
    assert table.verify_step_ratios == {(VSTEP, 0): pytest.approx(0.02), (VSTEP, 4): pytest.approx(0.055),
                                        (VCHAIN, 4): pytest.approx(0.03)}
    assert not any("vstep" in k or "vchain" in k for k in table.dispersion)  # no verdict on the rounds


def test_a_scattered_pass_timing_is_a_scattered_profile():
    """Medusa's timed passes price its draft on every tree: their scatter over the rounds is the profile's."""
    from methods.measurement.cost_table import QPASS, QPASS_CHAIN, T_AR, cost_table, scatter_reason

    rounds = [{T_AR: 1.0, 4: 1.2, (QPASS_CHAIN, 4): 0.8, (QPASS, 64): p64} for p64 in (0.9, 0.9, 4.5, 0.9)]
    rounds[1] = {**rounds[1], (QPASS, 64): 4.6}
    table = cost_table(rounds)
    assert table.verify_step_ratios[(QPASS, 64)] == pytest.approx(2.7)
    assert table.dispersion["qpass(64)/t1"] > 1 and table.dispersion["qpass_chain(4)/t1"] == 0
    assert "qpass(64)/t1" in scatter_reason(table.dispersion)


def test_a_profile_keeps_ratios_of_t1_and_re_anchors_them(run_config):
    """Costs are ratios of t(1): on another t(1) every cost scales with it and the predicted speedup of a
    tree does not move (S = k̄ · t(1) / t_step); the absolute step time does."""
    from specsim.tree import Tree

    prof = _profile()
    assert prof.t_n[8] == pytest.approx(1.1e-3) and prof.draft_time_s == pytest.approx(1e-4)
    slow = prof.with_t1(4 * prof.t_ar_s)
    assert slow.t_n_ratios == prof.t_n_ratios and slow.draft_ratio == prof.draft_ratio
    assert slow.t_n[8] == pytest.approx(4 * prof.t_n[8]) and slow.draft_time_s == pytest.approx(4e-4)
    assert to_measured_cost(slow).time(8) == pytest.approx(4 * float(to_measured_cost(prof).time(8)))
    cfg = run_config("method=vanilla", "tree=chain", "tree.gamma=4")
    here, _ = tree_predictions(cfg, prof, Tree.chain(4))
    slow_here, _ = tree_predictions(cfg, slow, Tree.chain(4))
    assert slow_here["predicted_speedup"] == pytest.approx(here["predicted_speedup"])
    assert slow_here["t_step_s"] == pytest.approx(4 * here["t_step_s"])
    doc = json.loads(json.dumps(prof.to_json()))
    assert doc["t_n_s"]["8"] == pytest.approx(1.1e-3)  # absolute figures for the reader...
    assert Profile.from_json(doc) == prof  # ... the ratios are what is read back


@pytest.mark.parametrize("hardware", ["cpu", "a100"])
def test_sequoia_tree_for_stays_within_budget(run_config, hardware):
    budgets = "tree.budgets=[1,2,4,8,16,32,64,128]"
    cfg = run_config("method=vanilla", "tree=sequoia", f"hardware={hardware}", budgets)
    prof = _profile()
    tree, here, preset = sequoia_tree_for(cfg, prof)
    assert 1 < tree.size <= 128 and tree.size in cfg.tree.budgets and tree.depth + 1 <= cfg.tree.max_levels
    assert here["cost_source"] == "measured" and preset["cost_source"] == "roofline"
    assert here["tree_size"] == preset["tree_size"] == tree.size
    assert here["predicted_tau"] == pytest.approx(preset["predicted_tau"]) and here["predicted_tau"] > 1
    assert here["t_verify_s"] == pytest.approx(float(to_measured_cost(prof).time(tree.size)))
    m = prediction_metrics(cfg, here, preset)
    main = here if hardware == "cpu" else preset  # hardware=cpu is `measured`: predicted_* use the profile
    assert m["predicted_speedup"] == main["predicted_speedup"]
    assert m["predicted_speedup_this_device"] == here["predicted_speedup"]


def test_sequoia_tree_for_respects_the_drafters_depth(run_config):
    cfg = run_config("method=vanilla", "tree=sequoia", "hardware=a100")
    tree, _, _ = sequoia_tree_for(cfg, _profile(max_draft_depth=2))
    assert tree.depth <= 2
    assert np.isfinite(sequoia_tree_for(cfg, _profile())[1]["predicted_speedup"])


def test_sequoia_tree_for_respects_the_drafters_top_k(run_config):
    """Medusa's TOPK bounds the children per node: ranks past it are never proposed (their mass → p_none)."""
    wide = dataclasses.replace(_profile(), acceptance_vector=(0.0, 0.3, 0.2, 0.2, 0.15, 0.1, 0.05))
    cfg = run_config("method=vanilla", "tree=sequoia", "hardware=a100")
    assert sequoia_tree_for(cfg, wide)[0].width > 2
    cfg.method.params["top_k"] = 2
    tree, here, _ = sequoia_tree_for(cfg, wide)
    assert max(tree.ranks) < 2 and tree.width <= 2
    assert sequoia_config(cfg, wide).method.acceptance.vector == pytest.approx([0.0, 0.3, 0.2, 0.5])


def test_save_and_load_round_trip(run_config, cache):
    cfg = run_config(*SMALL, "method=vanilla")
    prof = _profile()
    save_profile(prof, profile_path(cfg))
    assert load_profile(cfg) == prof


@pytest.mark.parametrize("source", ["vector", "by_depth", "config"])
def test_apply_profile_prices_with_the_measured_costs(run_config, source):
    """hardware=cpu validation of any run: measured t(n) and draft time, acceptance by ``source``."""
    from specsim.predict import simulate

    cfg = run_config("method=vanilla", "tree=chain", "tree.gamma=3")
    prof = _profile()
    p = simulate(apply_profile(cfg, prof, acceptance=source), profile=to_measured_cost(prof))
    assert p.cost_source == "measured" and p.t_ar_s == prof.t_ar_s  # the loop's AR step, not the cold t(1)
    assert p.t_draft_s == pytest.approx(3 * prof.draft_time_s)  # one draft forward per level of the chain
    assert p.acceptance_kind == {"vector": "vector", "by_depth": "table", "config": "iid"}[source]
    alpha = {"vector": 0.6, "by_depth": None, "config": cfg.method.acceptance.alpha}[source]
    if alpha is not None:  # a chain under p_1 (vector) or α: k̄ = (1 − α^{γ+1}) / (1 − α)
        assert p.predicted_tau == pytest.approx((1 - alpha**4) / (1 - alpha))
    else:
        assert p.predicted_tau == pytest.approx(1 + 0.6 + 0.6 * 0.55 + 0.6 * 0.55 * 0.55)


def test_medusa_profile_has_one_vector_per_head(run_config, tiny_models, cache):
    """Medusa's depth-d children come from head d: the calibration keeps one star-tree vector per head, the
    first being the positional vector, each from one star per position that is still inside the trajectory."""
    cfg = run_config(*SMALL, "method=medusa", "+method.params.heads=init", "method.params.num_heads=3")
    prof = measure_profile(cfg, tiny_models, show_progress=False)
    assert len(prof.acceptance_vectors_by_depth) == 3 and prof.max_draft_depth == 3
    assert prof.acceptance_vectors_by_depth[0] == prof.acceptance_vector
    for v in prof.acceptance_vectors_by_depth:
        _valid_vector(v, 8)
    assert Profile.from_json(json.loads(json.dumps(prof.to_json()))) == prof
    # the heads' pass timed per tree in the same rounds: chains of 1..3 drafts, trees 3 deep beyond them
    assert set(prof.extra["draft_pass_chain_ratios"]) == {"1", "2", "3"}
    loop_tree = str(prof.extra["loop_tree_size"])  # Medusa's own 62-node tree (3 heads), beyond the chain
    assert set(prof.extra["draft_pass_tree_ratios"]) == {"8", loop_tree}
    assert all(r > 0 for r in prof.extra["draft_pass_chain_ratios"].values())
    vanilla = measure_profile(run_config(*SMALL, "method=vanilla"), tiny_models, show_progress=False)
    assert vanilla.acceptance_vectors_by_depth == ()  # a draft model's law is positional
    assert "draft_pass_chain_ratios" not in vanilla.extra  # its draft is priced per level (draft_levels)
    assert remeasure_reason(vanilla, run_config(*SMALL, "method=vanilla")) == ""
    assert vanilla.extra["split_sizes"] == split_sizes(run_config(*SMALL, "method=vanilla"))
    older = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items() if "draft_pass" not in k})
    assert "pass per tree" in remeasure_reason(older, cfg)


def test_pass_trees_reach_the_drafters_depth_within_its_choices():
    tree = pass_tree(64, 4, 10)
    assert tree.size == 64 and tree.depth == 4 and max(tree.ranks) < 10
    assert tree.parents[:5] == (-1, 0, 1, 2, 3)  # the spine first: every head runs
    assert pass_tree(3, 4, 10).depth == 2 and pass_tree(1000, 2, 3).size == 1 + 3 + 9  # all the ranks allow


def test_each_timed_pass_follows_a_forward_of_its_trees_size():
    """As in the loop, where the heads' pass follows the verify forward of its tree (the chain of 4's pass
    read 0.48 t(1) back to back, 0.83 after a forward, the loop's own 0.84 on the zoo)."""
    from methods.measurement.calibrate import _pass_round

    log = []
    target = SimpleNamespace(forward_tree=lambda tokens, tree, hidden=False: log.append(("fwd", tree.size)),
                             drop_pending=lambda: None)

    class Drafter:
        def __init__(self, tree):
            self.tree = tree

        def reset(self, tokens):
            pass

        def propose(self, ctx):
            log.append(("pass", self.tree.size))

    trees = {n: Tree.from_parents([-1] + [0] * (n - 1)) for n in (3, 8)}
    tokens = {n: torch.zeros(n, dtype=torch.long) for n in trees}
    drafters = {("qpass_chain", 2): Drafter(Tree.chain(2)), ("qpass", 8): Drafter(pass_tree(8, 2, 4))}
    ctx = SimpleNamespace(tokens=torch.zeros(4, dtype=torch.long))
    out = _pass_round(SimpleNamespace(target=target), drafters, ctx, trees, tokens, True)
    assert set(out) == set(drafters) and all(t >= 0 for t in out.values())
    passes = [i for i, (kind, _) in enumerate(log) if kind == "pass"]
    assert len(passes) == 2 * (calibrate_module.FORWARD_REPEAT + 1)
    assert all(log[i - 1] == ("fwd", log[i][1]) for i in passes)  # each right after its size's forward


def test_a_one_pass_drafters_pass_is_priced_on_the_runs_tree(run_config):
    """Medusa's pass, measured in the loop on the calibration's chain of 4, is priced on another tree in
    proportion to the proposals timed per tree: a chain of D drafts runs D heads, a wider tree pays its
    growth by node count (the quiet sweep's 64-node tree paid 10–22% more than its chain-of-4 price)."""
    prof = dataclasses.replace(_profile(max_draft_depth=4), draft_ratio=0.6, drafter="medusa")
    prof.extra.update(draft_pass_chain_ratios={"1": 0.2, "2": 0.3, "3": 0.4, "4": 0.5},
                      draft_pass_tree_ratios={"8": 0.52, "32": 0.6, "64": 0.7},
                      loop_tree_depth=4, loop_tree_size=5)
    cfg = run_config("method=medusa", "hardware=cpu")
    wide = pass_tree(64, 4, 10)
    assert draft_pass_scale(prof, Tree.chain(4)) == pytest.approx(1.0)  # the loop's own tree
    assert draft_pass_scale(prof, wide) == pytest.approx(0.7 / 0.5)
    assert draft_pass_scale(prof, Tree.chain(2)) == pytest.approx(0.3 / 0.5)  # two heads
    shallow = Tree.from_paths([[0], [1], [2], [0, 0], [1, 0], [0, 1], [2, 0]])  # 8 nodes, 2 deep
    assert draft_pass_scale(prof, shallow) == pytest.approx((0.3 + 0.02 - 0.0) / 0.5)  # growth 5 → 8 nodes
    assert draft_pass_scale(prof, pass_tree(128, 4, 10)) == pytest.approx((0.5 + 0.2 + 0.1 / 32 * 64) / 0.5)
    here, _ = tree_predictions(cfg, prof, wide)
    chain, _ = tree_predictions(cfg, prof, Tree.chain(4))
    assert chain["t_draft_s"] == pytest.approx(prof.draft_time_s)
    assert here["t_draft_s"] == pytest.approx(prof.draft_time_s * 0.7 / 0.5)
    untimed = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items() if "draft_pass" not in k})
    assert tree_predictions(cfg, untimed, wide)[0]["t_draft_s"] == pytest.approx(prof.draft_time_s)


def test_depth_vectors_price_a_medusa_tree_below_the_positional_model(run_config):
    """With per-head vectors (and Medusa's TOPK cut) deeper nodes are priced with their own head's rates."""
    from specsim.tree import Tree

    head1, head2 = (0.0, 0.5, 0.2, 0.1, 0.2), (0.0, 0.25, 0.15, 0.1, 0.5)
    prof = dataclasses.replace(_profile(), acceptance_vector=head1,
                               acceptance_vectors_by_depth=(head1, head2))
    cfg = run_config("method=medusa", "method.params.top_k=2", "hardware=a100")
    a = measured_acceptance(cfg, prof).method.acceptance
    assert a.kind.value == "depth_vector"
    np.testing.assert_allclose(a.by_depth_vectors, [[0, .5, .2, .3], [0, .25, .15, .6]])
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    here, preset = tree_predictions(cfg, prof, tree)
    by_hand = 1 + (0.5 + 0.2) + (0.5 * 0.4 + 0.2 * 0.25) + 0.5 * 0.25 * 0.25  # depth 3 repeats head 2
    assert here["predicted_tau"] == pytest.approx(by_hand) == preset["predicted_tau"]
    assert here["cost_source"] == "measured" and preset["cost_source"] == "roofline"
    flat = dataclasses.replace(prof, acceptance_vectors_by_depth=())
    assert tree_predictions(cfg, flat, tree)[0]["predicted_tau"] > by_hand


def test_proposals_are_followed_along_the_trajectory():
    """A proposal drafter's depth-d star is the children of its depth-(d-1) node that matches the trajectory;
    the walk stops at the first mismatch, and a node without children is an empty star (the step ends)."""
    from types import SimpleNamespace

    from methods.core.drafter import Draft
    from specsim.tree import Tree

    class Fixed:  # proposes the chain 7, 8 after every context; a second child 9 under the root
        def reset(self, prompt):
            pass

        def propose(self, ctx):
            tree = Tree.from_parents([-1, 0, 0, 1], [0, 0, 1, 0])
            return Draft(tree, torch.tensor([int(ctx.tokens[-1]), 7, 9, 8]))

    run = SimpleNamespace(drafter=Fixed(), cfg=SimpleNamespace(calibration=SimpleNamespace(width=4)),
                          tree=Tree.chain(3), generator=torch.Generator())
    seq = torch.tensor([1, 2, 7, 8, 5, 9])  # prompt (1, 2); the target then produced 7, 8, 5, 9
    proposed = calibrate_module._proposed(run, seq, 2, None, 3)
    got = [(d, pos, star.children.tolist()) for d, pos, star in proposed]
    assert got == [
        (1, 1, [7, 9]), (2, 2, [8]), (3, 3, []),  # root 2: 7 matches, 8 matches, the chain ends: empty star
        (1, 2, [7, 9]),  # root 7: the trajectory goes on with 8 — neither child
        (1, 3, [7, 9]),  # root 8: next is 5
        (1, 4, [7, 9])]  # root 5: 9 matches, but the trajectory has no token after it to verify depth 2


def test_prompt_lookup_profile_has_vectors_per_depth(run_config, tiny_models, cache):
    prof = measure_profile(run_config(*SMALL, "method=prompt_lookup", "tree.gamma=3"), tiny_models,
                           show_progress=False)
    assert 1 <= len(prof.acceptance_vectors_by_depth) <= 3
    assert prof.acceptance_vectors_by_depth[0] == prof.acceptance_vector
    for v in prof.acceptance_vectors_by_depth:
        _valid_vector(v, 8)


def test_prompt_lookup_acceptance_comes_from_the_loop(run_config, tiny_models, cache):
    """Prompt lookup's matches come in runs: its acceptance is the loop's (star trees at every position
    weigh a copied span by its length), so its chain predicts the loop's own τ on the calibration split."""
    from methods.measurement.profiles import key_document

    cfg = run_config(*SMALL, "method=prompt_lookup", "tree.gamma=3")
    assert key_document(cfg)["acceptance_from"] == "loop"
    prof = measure_profile(cfg, tiny_models, show_progress=False)
    assert prof.extra["loop_steps"] > 0
    here, _ = tree_predictions(cfg, prof, Tree.chain(3))
    assert here["predicted_tau"] == pytest.approx(prof.extra["loop_tau"])


def test_loop_ranks_reproduce_the_loops_tau():
    """A loop drafter's chain vectors: a chain of the tree's depth under them predicts the loop's τ."""
    stats = AcceptStats(steps=10, hist=[4, 3, 2, 1])  # 4 steps accepted 0 drafts, 3 one, ...
    ranks = calibrate_module._loop_ranks(stats, 4)
    assert [len(r) for r in ranks] == [10, 6, 3, 1]
    assert [r.count(0) for r in ranks] == [6, 3, 1, 0]
    alphas = [r.count(0) / len(r) for r in ranks]
    assert 1 + sum(np.cumprod(alphas)) == pytest.approx(stats.tau)


def test_lookahead_profile_comes_from_the_loop(run_config, tiny_models, cache):
    over = ("method=lookahead", "method.params.window=3", "method.params.guess_set=2",
            "method.params.level=3", "method.verify_extra_tokens=7")  # 2 + 3 + 2: (W-1) + (N-2)W + (G-1)(N-1)
    prof = measure_profile(run_config(*SMALL, *over), tiny_models, show_progress=False)
    assert prof.extra["loop_steps"] > 0 and 1 <= len(prof.acceptance_vectors_by_depth) <= 2
    for v in prof.acceptance_vectors_by_depth:
        _valid_vector(v, 8)
        assert list(v[2:-1]) == [0.0] * 7  # a chain's vector: rank 0 or none
    forward = prof.extra["loop_verify_forward_tokens"]
    assert 3 <= forward <= 3 + 7 and forward in prof.t_n


def test_staged_profile_uses_the_draft_models_law(run_config, tiny_models, cache):
    prof = measure_profile(run_config(*SMALL, "method=staged", "tree.gamma=3"), tiny_models,
                           show_progress=False)
    assert prof.acceptance_vectors_by_depth == ()  # one positional vector, as the draft model's
    _valid_vector(prof.acceptance_vector, 8)
    assert prof.draft_time_s > 0


@pytest.mark.parametrize("method,extra", [("eagle", ()), ("eagle3", ("method.params.feature_layers=[0,1]",))])
def test_eagle_profile_has_a_vector_per_depth_of_its_law(run_config, tiny_models, cache, method, extra):
    """The EAGLE head's law at depth d (the training-time-test rollout along the trajectory) gives one
    star vector per level of the method's tree; depth 1 is the positional vector."""
    cfg = run_config(*SMALL, f"method={method}", "method.params.head=random", "tree=chain", "tree.gamma=3",
                     *extra)
    prof = measure_profile(cfg, tiny_models, show_progress=False)
    assert len(prof.acceptance_vectors_by_depth) == 3
    assert prof.acceptance_vectors_by_depth[0] == prof.acceptance_vector
    shapes = {s["shape"]: (s["levels"], s["nodes"]) for s in prof.extra["draft_shape_ratios"]}
    assert shapes == {"loop": (3, 3), "chain1": (1, 1), "star8": (1, 8), "fan4": (2, 8), "fan2": (2, 4),
                      WIDE_SHAPE: (5, 31)}  # the wide tree the loop's verification is timed on, its draft too
    assert all(s["ratio"] > 0 for s in prof.extra["draft_shape_ratios"])
    # each shape's first step timed apart (its excess priced once per generation: profiles.first_draft_s)
    assert set(prof.extra["draft_first_excess_ratios"]) == set(shapes)
    # the loop's verification on a wide tree, and that tree's forward, in the same rounds
    assert set(prof.extra["loop_verify_wide"]) == {str(WIDE_NODES)} and WIDE_NODES in prof.t_n_ratios
    assert prof.extra["loop_verify_wide"][str(WIDE_NODES)] > 0
    drafted = {int(n) for n in prof.extra["loop_verify_wide_sizes"]}  # its forwards' sizes
    assert WIDE_NODES in drafted and all(1 <= n <= WIDE_NODES for n in drafted)
    for v in prof.acceptance_vectors_by_depth:
        _valid_vector(v, 8)


@pytest.mark.parametrize("method,extra", [("eagle", ("tree=chain", "tree.gamma=3")),
                                          ("eagle2", ("tree=dynamic", "tree.total_tokens=6", "tree.depth=3",
                                                      "tree.top_k=2"))])
def test_eagle_draft_levels_are_timed_on_its_head_not_the_draft_model(run_config, tiny_models, cache,
                                                                        monkeypatch, method, extra):
    """EAGLE's per-width draft level is its head's (the drafter's ``level_step``), though the zoo has a draft
    model: a head whose level costs w extra seconds on calibration's clock gives ratios growing as w."""
    from methods.drafters.eagle import EagleDrafter

    offset, widths, calls, real = [0.0], [], [], EagleDrafter.level_step

    def slow(self, width, context, children, generator):
        step = real(self, width, context, children, generator)
        widths.append(width)

        def run():
            step()
            calls.append(width)
            offset[0] += 1000.0 * width

        return run

    monkeypatch.setattr(EagleDrafter, "level_step", slow)
    monkeypatch.setattr(calibrate_module, "time",
                        SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0]))
    cfg = run_config(*SMALL, f"method={method}", "method.params.head=random", *extra)
    prof = measure_profile(cfg, tiny_models, show_progress=False)
    ratios = prof.extra["draft_level_ratios"]
    assert set(widths) == {1, 2, 4, 8} and set(ratios) == {"1", "2", "4", "8"}
    assert calls and calls == [1, 2, 4, 8] * (len(calls) // 4)  # the widths interleaved
    for w in (2, 4, 8):
        assert ratios[str(w)] / ratios["1"] == pytest.approx(w, rel=1e-3)
    assert prof.extra["draft_models"] == 0 and prof.extra["draft_level_timing"] == "drafter"
    assert remeasure_reason(prof, cfg) == ""
    old = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items() if k != "draft_level_timing"})
    assert "draft levels" in remeasure_reason(old, cfg)  # timed on the draft model before: measured again


def test_eagle_level_step_feeds_its_width_through_the_head(run_config, tiny_models):
    """One level of the hook: the head fed ``width`` rows after the context, its logits, the children."""
    from methods.drafters.registry import build_drafter
    from methods.heads.eagle.state import HeadCache

    cfg = run_config("method=eagle", "method.params.head=random", "tree=chain", "tree.gamma=3")
    drafter = build_drafter(cfg.method, Tree.chain(3), tiny_models, SamplingParams(0.0))
    fed, logits, real_feed, real_logits = [], [], HeadCache.feed, drafter.head.logits

    def feed(self, h, tokens, depth, parents):
        fed.append((self.length, h.shape[0]))
        return real_feed(self, h, tokens, depth, parents)

    def count(g):
        logits.append(g.shape[0])
        return real_logits(g)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HeadCache, "feed", feed)
        mp.setattr(drafter.head, "logits", count)
        step = drafter.level_step(4, 40, 3, torch.Generator().manual_seed(0))
        step(), step()
    assert fed == [(40, 4), (40, 4)] and logits == [4, 4]
    assert drafter.cache.length == 0  # the drafter's own cache is untouched


def test_dynamic_tree_is_priced_as_the_best_static_tree_of_its_budget(run_config):
    """EAGLE-2's tree is priced as the DP tree of total_tokens + 1 nodes, depth and top_k capped, under the
    measured vectors: a better measured vector (more mass on rank 1) predicts a larger tau."""
    from methods.measurement.profiles import dynamic_tree_for

    cfg = run_config("method=eagle2", "tree=dynamic", "tree.total_tokens=12", "tree.depth=3", "tree.top_k=3")
    weak = dataclasses.replace(_profile(), acceptance_vector=(0.0, 0.3, 0.2, 0.1, 0.4))
    strong = dataclasses.replace(_profile(), acceptance_vector=(0.0, 0.8, 0.1, 0.05, 0.05))
    taus = []
    for prof in (weak, strong):
        tree = dynamic_tree_for(cfg, prof)
        assert tree.size <= 13 and tree.depth <= 3 and tree.width <= 3
        taus.append(tree_predictions(cfg, prof, tree)[0]["predicted_tau"])
    assert 1 < taus[0] < taus[1]


def test_dynamic_tree_with_recorded_shapes_is_priced_as_those_trees(run_config):
    """The kept trees a dynamic drafter recorded replace the static DP tree's τ (not its step): a drafter
    that kept only wide shallow trees is priced below the static tree of the same budget."""
    from methods.measurement.profiles import dynamic_tree_for
    from specsim.tree import Tree

    cfg = run_config("method=eagle2", "tree=dynamic", "tree.total_tokens=3", "tree.depth=3", "tree.top_k=3")
    prof = dataclasses.replace(_profile(), acceptance_vector=(0.0, 0.8, 0.1, 0.05, 0.05))
    tree = dynamic_tree_for(cfg, prof)
    static_here, static_preset = tree_predictions(cfg, prof, tree)
    wide = Tree.from_paths([[0], [1], [2]])
    here, preset = tree_predictions(cfg, prof, tree, {wide: 1})
    assert here["predicted_tau"] == pytest.approx(1 + 0.8 + 0.1 + 0.05) == preset["predicted_tau"]
    assert here["predicted_tau"] < static_here["predicted_tau"]
    assert here["t_step_s"] == static_here["t_step_s"] and preset["t_step_s"] == static_preset["t_step_s"]
    ratio = here["predicted_tau"] / static_here["predicted_tau"]
    assert here["predicted_speedup"] == pytest.approx(static_here["predicted_speedup"] * ratio)


def test_dynamic_draft_is_priced_as_the_loop_chain_times_its_timed_scale(run_config):
    """A dynamic drafter's draft per step is the profile's loop draft on its chain (per level × the chain's
    depth) times the scale recorded beside its trees (timed against that chain); the trees' τ and the verify
    term are unchanged. A scale timed against another chain depth is not used (the levels' pricing)."""
    from methods.measurement.profiles import dynamic_tree_for
    from specsim.tree import Tree
    from specsim.trees import RecordedTrees

    cfg = run_config("method=eagle2", "tree=dynamic", "tree.total_tokens=3", "tree.depth=3", "tree.top_k=3")
    prof = dataclasses.replace(_profile(), acceptance_vector=(0.0, 0.8, 0.1, 0.05, 0.05))
    prof.extra["loop_tree_depth"] = 4
    tree = dynamic_tree_for(cfg, prof)
    wide = {Tree.from_paths([[0], [1], [2]]): 1}
    levels = tree_predictions(cfg, prof, tree, RecordedTrees(wide))[0]
    here = tree_predictions(cfg, prof, tree, RecordedTrees(wide, draft_scale=(1.3, 4)))[0]
    assert here["t_draft_s"] == pytest.approx(prof.draft_time_s * 4 * 1.3) != levels["t_draft_s"]
    assert here["t_verify_s"] == levels["t_verify_s"] and here["predicted_tau"] == levels["predicted_tau"]
    assert here["t_step_s"] == pytest.approx(here["t_draft_s"] + here["t_verify_s"])
    tau, ar, step = here["predicted_tau"], here["t_ar_s"], here["t_step_s"]
    assert here["predicted_speedup"] == pytest.approx(tau * ar / step)
    other = tree_predictions(cfg, prof, tree, RecordedTrees(wide, draft_scale=(1.3, 3)))[0]
    assert other["t_draft_s"] == levels["t_draft_s"]


def test_a_batch_prices_a_dynamic_drafters_kept_trees_not_the_static_tree(run_config, monkeypatch):
    """measure's prediction at B > 1 prices a dynamic drafter's recorded trees as the one-sequence one does:
    τ from their law (not the static DP tree's, an upper bound: the zoo's EAGLE-2 at B = 4 read 3.81
    against 3.33 measured), its draft from the timed scale; the static tree's figures kept beside."""
    import methods.measurement.measure as measure_module
    from methods.measurement.profiles import dynamic_tree_for
    from specsim.tree import Tree
    from specsim.trees import RecordedTrees

    monkeypatch.setattr(measure_module, "load_batch_fit", lambda cfg, role="target": None)
    monkeypatch.setattr(measure_module, "load_head_fit", lambda cfg: None)
    cfg = run_config("method=eagle2", "tree=dynamic", "tree.total_tokens=3", "tree.depth=3", "tree.top_k=3",
                     "workload.batch_size=4")
    prof = dataclasses.replace(_profile(), acceptance_vector=(0.0, 0.8, 0.1, 0.05, 0.05))
    prof.extra["loop_tree_depth"] = 4
    tree = dynamic_tree_for(cfg, prof)
    wide = {Tree.from_paths([[0], [1], [2]]): 1}
    shapes = RecordedTrees(wide, draft_scale=(1.3, 4))
    one = tree_predictions(cfg, prof, tree, shapes)[0]
    static = measure_module.batch_prediction(cfg, prof, tree, {})
    kept = measure_module.batch_prediction(cfg, prof, tree, {}, shapes)
    levels = measure_module.batch_prediction(cfg, prof, tree, {}, RecordedTrees(wide))
    assert kept["predicted_tau"] == pytest.approx(one["predicted_tau"]) == pytest.approx(1 + 0.8 + 0.1 + 0.05)
    assert kept["predicted_tau"] < static["predicted_tau"] == kept["predicted_tau_static_tree_batch"]
    assert kept["predicted_batch_forwards"] > static["predicted_batch_forwards"]
    assert kept["predicted_decode_speedup_static_tree_batch"] == static["predicted_decode_speedup"]
    assert kept["batch_tree_pricing"] == "calibration_trees" and static["batch_tree_pricing"] == "tree"
    assert kept["batch_dynamic_draft"] == "timed" and levels["batch_dynamic_draft"] is None
    assert kept["predicted_t_draft_s"] != pytest.approx(levels["predicted_t_draft_s"])
    assert levels["predicted_tau"] == kept["predicted_tau"]


def test_loop_measured_acceptance_keys_its_profile_apart(run_config):
    """Lookahead's acceptance is the loop's (a draft stopped short is a rejection at that depth), so its
    profile's key differs from one measured on star trees; Draft & Verify's early exit is priced by its
    own law (specsim.adaptive_exit), not a second time here."""
    from methods.measurement.calibrate import LOOP_DRAFTERS, _loop_ranks
    from methods.measurement.profiles import key_document

    assert "lookahead" in LOOP_DRAFTERS and "draft_verify" not in LOOP_DRAFTERS
    la = key_document(run_config("task=calibrate", "method=lookahead", "model=micro"))
    va = key_document(run_config("task=calibrate", "method=vanilla", "model=micro"))
    assert la["acceptance_from"] == "loop" and "acceptance_from" not in va
    # steps accepting 0, 1, 1, 2 drafts of a chain of 3: per-depth ratios P(>= d) / P(>= d - 1)
    stats = AcceptStats()
    for k in (0, 1, 1, 2):
        stats.record(Tree.chain(3), tuple(range(k + 1)))
    ranks = _loop_ranks(stats, 3)
    assert [r.count(0) / len(r) for r in ranks[:2]] == [3 / 4, 1 / 3] and ranks[2] == [None]


# ---- sampled drafts and several drafts ---------------------------------------------------------------------
SMALL_SELF = ("model=random_tiny", "workload.prompt_tokens=16", "calibration.prompts=2",
              "calibration.new_tokens=6", "calibration.depth_prompts=1", "calibration.reps=2",
              "calibration.warmup=0", "calibration.width=4",
              "calibration.max_reps=0", "tree.budgets=[1,2,4,8]")


@pytest.mark.slow
def test_draft_verify_sampled_exit_is_calibrated_at_the_runs_temperature(run_config, tiny_models, cache):
    """At temperature 1 the drafter draws x ~ q and exits when q(x) < γ_th: the confidence table is the
    law of q(x) with the rejection rule's acceptance min(1, p/q) (before: T = 0 only, a full chain priced)."""
    from methods.measurement.profiles import exit_prediction

    cfg = run_config(*SMALL_SELF, "method=draft_verify", "method.params.skip=config",
                     "method.params.skip_mlp=[0]", "method.params.gamma=4", "tree=chain", "tree.gamma=4",
                     "workload.temperature=1", "method.verifier=chain")
    prof = ensure_profile(cfg, tiny_models, show_progress=False)
    table = prof.extra["exit_confidence"]
    assert table["sampled"] and table["positions"] == 2 * 6 and sum(table["mass"]) == pytest.approx(1.0)
    assert 0 < table["alpha"] < 1
    run = exit_prediction(cfg, prof, Tree.chain(4))
    here, _ = tree_predictions(cfg, prof, Tree.chain(4))
    assert here["predicted_tau"] == pytest.approx(run.tau) and 1 <= run.tau <= 1 + run.draft_length


@pytest.mark.slow
def test_specinfer_profile_replays_its_drafts(run_config, tiny_models, cache):
    """SpecInfer's calibration keeps each draft's proposals along the trajectories, and its prediction prices
    the merged tree's τ from them (specsim.multidraft), on the union budget of its members."""
    from methods.drafters.specinfer import union_tree
    from specsim.multidraft import Replay, expected_tokens

    cfg = run_config(*SMALL_SELF, "method=specinfer", "method.params.source=copies", "tree=chain",
                     "tree.gamma=3")
    prof = ensure_profile(cfg, tiny_models, show_progress=False)
    doc = prof.extra["multi_draft"]
    assert doc["members"] == 3 and len(doc["ranks"]) == 2 and len(doc["ranks"][0][0]) == 3
    here, preset = tree_predictions(cfg, prof, union_tree(Tree.chain(3), 3))
    tau = expected_tokens(Replay.from_json(doc), Tree.chain(3))
    assert here["predicted_tau"] == pytest.approx(tau) == pytest.approx(preset["predicted_tau"])
    assert here["tree_size"] == 1 + 3 * 3  # the union's budget (its draft, each member's chain)
    # ... verified at the merged drafts' size: the loop's overhead beside their mean forward, and the loop's
    # own tree priced at that mean (shared prefixes verified once)
    sizes = {int(n): c for n, c in prof.extra["loop_verify_sizes"].items()}
    mean = sum(n * c for n, c in sizes.items()) / sum(sizes.values())
    assert prof.extra["loop_verify_forward_tokens"] == max(1, round(mean)) <= 1 + 3 * 3
    assert sum(prof.extra["loop_verify_level_sizes"]) == pytest.approx(mean)
    assert here["predicted_mean_verify_tokens"] == pytest.approx(mean)
    # the loop timed on member trees of every shape (each draft model fills one); the loop on its member chain
    shapes = {s["shape"]: s for s in prof.extra["draft_shape_ratios"]}
    assert set(shapes) == {"loop", "chain1", "star8", "fan4", "fan2", WIDE_SHAPE}
    assert shapes["loop"]["nodes"] == 3
    assert all(s["ratio"] > 0 for s in shapes.values())
    # ... and its verification on member trees of the depth and size it runs (20 drafts, 8 deep, each)
    assert shapes[WIDE_SHAPE]["nodes"] == 20 and shapes[WIDE_SHAPE]["levels"] == 8
    assert set(prof.extra["loop_verify_wide"]) == {"61"} and 61 in prof.t_n_ratios
    assert all(1 <= int(n) <= 61 for n in prof.extra["loop_verify_wide_sizes"])


def test_specinfer_draft_is_priced_on_each_members_tree(run_config):
    """Every draft model of SpecInfer fills the member tree on its own cache: a level of the merged tree feeds
    each model the member's nodes, not the union's K times as many. The profile's level is the loop's (all K
    models, one level of the union of K chains), so the loop's own tree is priced at the loop's draft
    (levels × the loop's level) and a wider member tree by the member's widths; priced on the union's
    widths, the quiet sweep's 61-node merged tree read its draft 6-28% high. τ and the verify term (the
    union's forward) are the replay's and the union's, unchanged."""
    from methods.measurement.profiles import draft_levels
    from specsim.multidraft import union_tree

    cfg = run_config("method=specinfer", "tree=chain", "tree.gamma=3")
    ranks = [[[0, 0, 1], [0, -1, 0], [1, 0, 0], [0, 0, 0]]]  # one prompt, 4 positions, 3 drafts
    prof = dataclasses.replace(_profile(), drafter="specinfer")
    prof.extra.update(multi_draft={"members": 3, "ranks": ranks}, loop_tree_depth=3, loop_tree_size=10,
                      draft_level_ratios={"1": 0.1, "2": 0.15, "4": 0.25, "8": 0.45})  # a level grows with w
    loop = union_tree(Tree.chain(3), 3)
    here = tree_predictions(cfg, prof, loop)[0]
    assert here["t_draft_s"] == pytest.approx(3 * prof.draft_time_s)  # the loop's own draft per step
    assert here["t_step_s"] == pytest.approx(here["t_draft_s"] + here["t_verify_s"])
    tau, ar, step = here["predicted_tau"], here["t_ar_s"], here["t_step_s"]
    assert here["predicted_speedup"] == pytest.approx(tau * ar / step)
    member = Tree.from_paths([[0, 0], [0, 1], [1, 0], [1, 1]])  # fed widths 1, 2
    wide = tree_predictions(cfg, prof, union_tree(member, 3))[0]
    levels = draft_levels(cfg, prof)
    assert wide["t_draft_s"] == pytest.approx(levels.time(1) + levels.time(2))  # not (1, 6): the union's
    assert wide["t_draft_s"] < levels.time(1) + levels.time(6)
    assert wide["tree_size"] == 1 + 3 * 6  # the verify forward: the merged budget


def _merging_profile(levels: list[float] | None) -> Profile:
    """A SpecInfer profile whose loop (3 drafts, the union of 3 chains of 4: 13 nodes) merged its drafts
    to ``levels`` nodes per depth on average (None: an older calibration without the counts)."""
    ranks = [[[0, 0, 1], [0, -1, 0], [1, 0, 0], [0, 0, 0]]]
    prof = dataclasses.replace(_profile(), drafter="specinfer")
    prof.extra.update(multi_draft={"members": 3, "ranks": ranks}, loop_tree_depth=4, loop_tree_size=13)
    if levels is not None:
        prof.extra["loop_verify_level_sizes"] = levels
    return prof


def test_specinfer_verify_is_priced_at_the_merged_trees_size(run_config):
    """SpecInfer's K drafts share their common prefixes: the verify forward is the merged tree's, not the
    union's budget. Per depth the union's nodes are kept in the share the calibration's loop kept (its
    merged chains); below the loop's depth the drafts still together part at the loop's last rate: on the
    loop's own tree the price is the loop's mean merged forward; τ (the replay's) is unchanged. Priced on
    the union, the quiet sweep's 61-node tree read its verification 14-30% high at T = 0 (about 40 of its
    61 nodes were verified)."""
    from methods.measurement.profiles import merged_size
    from specsim.multidraft import union_tree

    cfg = run_config("method=specinfer", "tree=chain", "tree.gamma=4")
    levels = [1.0, 1.2, 1.5, 1.8, 2.1]
    prof, old = _merging_profile(levels), _merging_profile(None)
    assert merged_size(prof, Tree.chain(4), 3) == pytest.approx(sum(levels))  # the loop's own tree
    member = Tree.from_paths([[0, 0, 0, 0, 0, 0], [0, 1]])  # 6 deep: depth 2 has 2 nodes, 5-6 past the loop
    share = [x / 3 for x in levels[1:]]
    together = [(3 - x) / 2 for x in levels[1:]]  # drafts still together at depths 1-4: 0.9 .. 0.45
    rate = together[3] / together[2]  # 0.45 / 0.6: they part at this rate per depth below the loop's 4
    deeper = [(3 - 2 * together[3] * rate ** j) / 3 for j in (1, 2)]  # depths 5 and 6
    kept = 3 * (share[0] + 2 * share[1] + share[2] + share[3] + deeper[0] + deeper[1])
    assert merged_size(prof, member, 3) == pytest.approx(1 + kept)
    assert merged_size(old, member, 3) is None
    not_chains = dataclasses.replace(prof, extra={**prof.extra, "loop_tree_size": 9})
    assert merged_size(not_chains, member, 3) is None  # the loop's tree was not the union of 3 chains
    union = union_tree(member, 3)
    here, preset = tree_predictions(cfg, prof, union)
    base, base_preset = tree_predictions(cfg, old, union)  # before: the union's forward
    measured = to_measured_cost(prof)
    assert here["predicted_mean_verify_tokens"] == pytest.approx(1 + kept) and 1 + kept < union.size
    assert here["t_verify_s"] == pytest.approx(float(measured.time(1 + kept)))
    assert here["t_verify_s"] < base["t_verify_s"]
    assert base["t_verify_s"] == pytest.approx(float(measured.time(union.size)))
    assert here["predicted_tau"] == base["predicted_tau"] and here["t_draft_s"] == base["t_draft_s"]
    assert here["t_step_s"] == pytest.approx(here["t_draft_s"] + here["t_verify_s"])
    tau, ar, step = here["predicted_tau"], here["t_ar_s"], here["t_step_s"]
    assert here["predicted_speedup"] == pytest.approx(tau * ar / step)
    assert preset["t_verify_s"] < base_preset["t_verify_s"]  # the roofline's prediction likewise


def test_specinfer_profile_without_merged_counts_is_measured_again(run_config):
    cfg = run_config(LEGACY_SPLIT, "method=specinfer", "tree.budgets=[1,2,4,8]")
    prof = _merging_profile([1.0, 1.2, 1.5, 1.8, 2.1])
    prof.extra.update(verify_step_ratios={"0": 0.01}, loop_verify_sizes={"7": 10},
                      draft_shape_ratios=_shaped_profile(0.4, 0.2, 0.02, 0.06).extra["draft_shape_ratios"])
    assert remeasure_reason(prof, cfg) == ""
    old = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items()
                                           if k != "loop_verify_level_sizes"})
    assert "merged draft sizes" in remeasure_reason(old, cfg)  # an older calibration: measured again


class _Copier:
    """A proposal drafter whose chain of 3 copies the trajectory (the tokens after the context), sampled from
    a law q (``sampled``) or deterministic."""

    def __init__(self, seq: torch.Tensor, sampled: bool) -> None:
        self.seq, self.sampled = seq, sampled

    def reset(self, prompt) -> None:
        pass

    def propose(self, ctx):
        from methods.core.drafter import Draft

        t = ctx.tokens.numel()
        tokens = torch.cat([ctx.tokens[-1:], self.seq[t : t + 3]])
        n = tokens.numel()
        q = torch.full((n, 8), 1 / 8) if self.sampled else None
        return Draft(Tree.chain(n - 1), tokens, q)


def test_sampled_proposals_give_depth_one_stars_only():
    """A drafter's own proposals are followed down the trajectory where its child equals the trajectory's
    token: the prefix a deterministic verification accepted (prompt lookup's copied spans). A child sampled
    from q equal to the trajectory's sampled token is a coincidence of two draws, not the rejection
    verifier's acceptance: its stars stop at depth 1 (Online's T = 1 profile read deeper acceptance 0.63-1.0
    from few such stars and predicted τ +19%)."""
    from methods.measurement.calibrate import _proposed

    seq = torch.arange(12) % 8
    run = SimpleNamespace(cfg=SimpleNamespace(calibration=SimpleNamespace(width=4)), generator=None)
    for sampled, depths in ((False, {1, 2, 3}), (True, {1})):
        run.drafter = _Copier(seq, sampled)
        out = _proposed(run, seq, 4, None, max_depth=3)
        assert {d for d, _, _ in out} == depths
        assert sum(d == 1 for d, _, _ in out) == seq.numel() - 4  # one depth-1 star per generated position


def test_sampled_proposal_profile_without_the_mark_is_measured_again(run_config):
    from methods.measurement.calibrate import PROPOSAL_STARS, shape_names

    budgets = "tree.budgets=[1,2,4,8]"
    cfg = run_config(LEGACY_SPLIT, "method=specinfer", "workload.temperature=1", "method.verifier=chain",
                     "tree=chain", budgets)
    prof = dataclasses.replace(_profile(), drafter="specinfer")
    prof.extra.update(verify_step_ratios={"0": 0.01}, loop_verify_sizes={"5": 10},
                      proposal_stars=PROPOSAL_STARS, multi_draft={"members": 3}, loop_verify_level_sizes=[1],
                      draft_shape_ratios=[{"shape": n, "fed": 1} for n in [*shape_names(), WIDE_SHAPE]],
                      loop_verify_wide={"33": 1.0}, draft_level_timing="drafter", star_estimator="exact")
    assert remeasure_reason(prof, cfg) == ""
    old = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items() if k != "proposal_stars"})
    assert "sampled proposals" in remeasure_reason(old, cfg)
    greedy = run_config(LEGACY_SPLIT, "method=specinfer", "tree=chain", budgets)
    old.extra["draft_shape_ratios"] = [{"shape": n, "fed": 1} for n in [*shape_names(), WIDE_SHAPE]]
    assert remeasure_reason(old, greedy) == ""  # greedy stars: as before (its draft on the wide tree too)
    # Online SD's acceptance is its loop's (it learns between requests): no star trees to mark
    online = run_config(LEGACY_SPLIT, "method=online", "workload.temperature=1", "method.verifier=chain",
                        budgets)
    assert remeasure_reason(dataclasses.replace(old, drafter="online"), online) == ""


GROWTH = {"1": 0.1, "2": 0.12, "8": 0.25}  # a draft level's timed growth with the nodes fed to it


def _grown(fed: list[int]) -> float:
    """Σ over the levels of the timed level's growth r(w) / r(1) (linear between the timed widths)."""
    w, r = np.array([1, 2, 8]), np.array([GROWTH[k] for k in ("1", "2", "8")]) / GROWTH["1"]
    return float(np.sum(np.interp(fed, w, r)))


def _looped(prof: Profile, shape: dict, full) -> dict:
    """``shape`` with its loop's draft per step as calibration times it: the mean over the steps of a
    generation of calibration.new_tokens (32) of ``full(fed, nodes)``, the step drafting the levels fed
    ``fed`` and ``nodes`` nodes, its last steps cut at the room left (specsim.run_steps)."""
    tree = profiles_module._shape_tree(shape, shape["fed"])
    law = accepted_length_law(tree, PositionalAcceptance(tuple(prof.acceptance_vector)))
    widths = DraftCost(fed_width=True).widths

    def at(d: int) -> float:
        kept = cut(tree, d)
        return full(widths(kept), kept.size - 1)

    return {**shape, "ratio": float(room_mean(law, 32, tree.depth, profiles_module.room_spare(prof), at))}


def _shaped_profile(fixed: float, level: float, node: float, wide: float, trees: bool = True,
                    per_fed: float = 0.0) -> Profile:
    """A draft-model profile whose loop drafted F + a · Σ g(w) + b · nodes + e · levels fed > 1 node + c ·
    their fed nodes beyond the first (t(1)) on its chain of 4, a chain of 1 and (``trees``) a star of 8,
    fans of 2 and of 4 and the wide tree; its draft ratio per level is the chain's / 4, as calibrated."""
    shapes = [("loop", [1] * 4, 4), ("chain1", [1], 1)]
    if trees:
        shapes += [("star8", [1], 8), ("fan4", [1, 4], 8), ("fan2", [1, 2], 4),
                   (WIDE_SHAPE, [1, 2, 4, 8, 1], 31)]
    prof = dataclasses.replace(_profile(), draft_ratio=(fixed + 4 * (level + node)) / 4)

    def full(fed: list[int], n: int) -> float:  # one step's draft, in t(1)
        return (fixed + level * _grown(fed) + node * n + wide * sum(w > 1 for w in fed)
                + per_fed * sum(w - 1 for w in fed if w > 1)) if fed else 0.0

    drafted = [_looped(prof, {"shape": s, "levels": len(fed), "nodes": n, "fed": fed}, full)
               for s, fed, n in shapes]
    prof.extra.update(loop_tree_depth=4, loop_tree_size=5, draft_level_ratios=dict(GROWTH),
                      draft_shape_ratios=drafted)
    return prof


def test_the_draft_is_priced_per_step_per_level_and_per_node(run_config):
    """The loop's draft timed on its chain of 4, a chain of 1, a star of 8 and a fan of 4 (a level fed 4
    nodes) gives a constant per step, a cost per level (growing with the nodes it is fed as the level's
    timing grows), one per node and one per level fed several nodes: each timed shape is priced at its own
    timed draft. Priced as the chain's draft / 4 per level, a shallow tree read low (EAGLE-1 Sequoia-8 prose
    T0: 0.62 t(1) priced, 0.99 measured, quiet sweep)."""
    cfg = run_config("method=vanilla", "tree=chain", "tree.gamma=4")
    prof = _shaped_profile(0.4, 0.2, 0.02, 0.06)
    assert draft_terms(prof) == pytest.approx((0.4, 0.2, 0.02, 0.06, 0.0))
    t1 = prof.t_ar_s
    fan = Tree.from_paths([[0], [1], [2], [3], [0, 0], [1, 0], [2, 0], [3, 0]])
    for tree, fed, nodes in ((Tree.chain(4), [1] * 4, 4), (Tree.chain(1), [1], 1), (Tree.kary(8, 1), [1], 8),
                             (fan, [1, 4], 8)):
        priced = tree_predictions(cfg, prof, tree)[0]["t_draft_s"]
        wide = 0.06 * sum(w > 1 for w in fed)
        assert priced == pytest.approx((0.4 + 0.2 * _grown(fed) + 0.02 * nodes + wide) * t1)
    sequoia8 = Tree.from_paths([[0], [1], [2], [3], [0, 0], [0, 1], [1, 0]])  # fed 1, then 2 nodes
    priced = tree_predictions(cfg, prof, sequoia8)[0]["t_draft_s"]
    assert priced == pytest.approx((0.4 + 0.2 * _grown([1, 2]) + 0.02 * 7 + 0.06) * t1)
    assert priced > prof.draft_time_s * _grown([1, 2])  # the chain's level × the levels: the old, low price
    chains = _shaped_profile(0.4, 0.2, 0.02, 0.06, trees=False)  # a chain verifier: a level carries its node
    assert draft_terms(chains) == pytest.approx((0.4, 0.22, 0.0, 0.0, 0.0))
    assert draft_terms(dataclasses.replace(prof, extra={**prof.extra, "draft_shape_ratios": []})) is None


def test_specinfer_member_tree_pays_the_loops_constant_and_its_cost_per_member_node(run_config):
    """SpecInfer's loop timed on member trees of four shapes (each draft model fills the member tree, the K
    drafts merged): the member tree is priced F + a · Σ g(w) + b · member nodes + e · wide levels, the
    member chain of the loop at the loop's own draft. At T = 1 a member level fed several nodes costs the
    loop far more than the timed level's growth: priced by the loop's chain levels alone, the quiet sweep's
    61-node tree (member levels fed 1, 1, 1, 3, 3, 3, 3, 3) read its draft 15-21% low."""
    from specsim.multidraft import union_tree

    cfg = run_config("method=specinfer", "tree=chain", "tree.gamma=4")
    shaped = _shaped_profile(0.4, 0.2, 0.05, 0.06)  # the member chain of 4 is the loop's shape
    prof = _merging_profile([1.0, 1.2, 1.5, 1.8, 2.1])
    prof = dataclasses.replace(prof, draft_ratio=shaped.draft_ratio)
    prof.extra.update(draft_level_ratios=dict(GROWTH), draft_shape_ratios=shaped.extra["draft_shape_ratios"])
    t1 = prof.t_ar_s
    loop = tree_predictions(cfg, prof, union_tree(Tree.chain(4), 3))[0]["t_draft_s"]
    assert loop == pytest.approx((0.4 + 4 * 0.2 + 4 * 0.05) * t1)  # the loop's own draft per step
    member = Tree.from_paths([[0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]])  # fed 1, 2, 4: 10 member nodes
    priced = tree_predictions(cfg, prof, union_tree(member, 3))[0]["t_draft_s"]
    assert priced == pytest.approx((0.4 + 0.2 * _grown([1, 2, 4]) + 0.05 * 10 + 2 * 0.06) * t1)
    assert priced > prof.draft_time_s * _grown([1, 2, 4])  # the loop's level × the levels: the old, low price


def test_a_runs_metrics_keep_the_drafts_timings_behind_its_price(run_config):
    """A profile timed on a busy machine is not cached: the run's metrics keep the draft's timed shapes,
    levels and terms, so that its draft term can be re-priced afterwards."""
    from methods.measurement.measure import calibrated_costs

    prof = _shaped_profile(0.4, 0.2, 0.02, 0.06)
    out = calibrated_costs(run_config("method=vanilla"), prof)
    assert out["calibration_draft_terms"] == pytest.approx([0.4, 0.2, 0.02, 0.06, 0.0])
    assert out["calibration_draft_shape_ratios"] == prof.extra["draft_shape_ratios"]
    assert out["calibration_draft_level_ratios"] == GROWTH
    assert "calibration_draft_terms" not in calibrated_costs(run_config("method=vanilla"), _profile())


def test_a_specinfer_profile_without_the_member_shapes_is_measured_again(run_config):
    from methods.measurement.profiles import profile_config

    # as measure calibrates
    cfg = profile_config(run_config(LEGACY_SPLIT, "method=specinfer", "tree.budgets=[1,2,4,8]"))
    prof = _merging_profile([1.0, 1.2, 1.5, 1.8, 2.1])
    prof.extra.update(verify_step_ratios={"0": 0.01}, loop_verify_sizes={"7": 10})
    assert "every tree shape" in remeasure_reason(prof, cfg)
    prof.extra["draft_shape_ratios"] = _shaped_profile(0.4, 0.2, 0.02, 0.06).extra["draft_shape_ratios"]
    assert "wide tree" in remeasure_reason(prof, cfg)  # its loop at the merged size it runs (below)
    prof.extra["loop_verify_wide"] = {"64": 3.0}
    assert remeasure_reason(prof, cfg) == ""


def test_specinfer_times_its_loop_on_member_trees_of_the_depth_and_size_it_runs(run_config):
    """SpecInfer's verified tree is the merge of its K members' trees: its calibration's loop (the union of 3
    chains of 4, 13 nodes) is a quarter of the zoo's 61-node merged tree, and its verification's excess,
    scaled from there in proportion to t(n), read the six zoo10 rows' verify 1-5% of the step low, their
    draft (member trees 8 levels deep; timed shapes up to 4) 2-5% low. Its wide loop is the drafter on member
    trees of the preset's shape (8 levels, 20 drafts each: a 61-node union); its draft there is a shape of the
    draft's fit, recorded with its parents (profiles._shape_tree reads them back)."""
    from methods.drafters.specinfer import SpecInferDrafter
    from methods.measurement.calibrate import wide_shape_tree
    from methods.measurement.draft_shapes import wide_member_tree
    from methods.measurement.profiles import _shape_tree, profile_config
    from specsim.multidraft import union_tree

    cfg = profile_config(run_config("method=specinfer", "tree.budgets=[1,2,4,8]"))
    assert times_wide_loop(SpecInferDrafter, cfg, depth_tree(cfg))  # its member chain, as remeasure asks
    member = wide_member_tree()
    preset = Tree.from_paths(run_config("method=specinfer").tree.paths)
    assert sorted(member.paths) == sorted(preset.paths)  # the preset's member tree
    assert member.depth == 8 and union_tree(member, 3).size == 61

    class _Run:  # what wide_shape_tree reads of the calibration's run
        drafter = SpecInferDrafter.__new__(SpecInferDrafter)

    assert wide_shape_tree(_Run) == member
    _Run.drafter = object()  # any other drafter: the binary tree of WIDE_NODES
    assert wide_shape_tree(_Run) == wide_tree()
    fed = [1, 1, 1, 3, 3, 3, 3, 3]
    record = {"shape": WIDE_SHAPE, "levels": 8, "nodes": 20, "fed": fed, "parents": list(member.parents)}
    assert _shape_tree(record, fed) == member
    assert _shape_tree({**record, "parents": None}, fed) is None  # not the binary tree of 21 nodes'


def test_a_wide_level_pays_per_fed_node_where_the_fans_tell_it(run_config):
    """The fans of 2 and of 4 separate a wide level's constant e from its cost per further fed node c: a level
    fed w > 1 nodes costs a · g(w) + e + c · (w − 1). SpecInfer's loop at T = 1 paid 0.44 / 0.87 / 1.45 t(1)
    for a level fed 2 / 4 / 8 (its chain's level 0.49): priced at the fan of 4's constant, its member tree's
    levels fed 3 read its draft +10-26% high (load). Without the fan of 2 (an older calibration) c is 0 and
    the fan of 4's wide level is e, as before."""
    cfg = run_config("method=vanilla", "tree=chain", "tree.gamma=4")
    prof = _shaped_profile(0.4, 0.2, 0.02, 0.06, per_fed=0.1)
    assert draft_terms(prof) == pytest.approx((0.4, 0.2, 0.02, 0.06, 0.1))
    t1 = prof.t_ar_s
    three = Tree.from_paths([[0], [1], [2], [0, 0], [1, 0], [2, 0]])  # fed 1, then 3 nodes
    priced = tree_predictions(cfg, prof, three)[0]["t_draft_s"]
    assert priced == pytest.approx((0.4 + 0.2 * _grown([1, 3]) + 0.02 * 6 + 0.06 + 0.1 * 2) * t1)
    older = [s for s in prof.extra["draft_shape_ratios"] if s["shape"] not in ("fan2", WIDE_SHAPE)]
    terms = draft_terms(dataclasses.replace(prof, extra={**prof.extra, "draft_shape_ratios": older}))
    assert terms[4] == 0.0 and terms[3] == pytest.approx(0.06 + 3 * 0.1)


def test_the_wide_tree_pins_the_drafts_terms_where_the_small_shapes_extrapolate(run_config):
    """EAGLE's chains take a faster path than its trees: its loop pays a constant k per step on any tree
    beyond its chain's, nothing per node. The chain of 1, the star of 8 and the fans (1-8 nodes, one level
    fed 2 or 4) tell k from a cost per node by the star alone (k / 7 per node) and per fed node by the fans,
    which a 31-node tree multiplies: EAGLE-1's Sequoia-32 trees read their draft 22-57% high (quiet sweep
    zoo8, T = 0). The loop's draft on the wide tree its verification is timed on (31 nodes, levels fed 1, 2,
    4, 8, 1) is a sixth shape of the fit: the wide tree and EAGLE-1's Sequoia-32 tree are priced within 1% of
    their draft, where five shapes price them 7% high (on the sweep, with the fans' timing noise, more)."""
    cfg = run_config("method=vanilla", "tree=chain", "tree.gamma=4")
    fixed, level, k, wide = 0.2, 0.28, 0.06, 0.1

    def drafted(fed: list[int], tree: bool) -> float:  # the loop's draft per step, in t(1)
        return fixed + level * _grown(fed) + (k if tree else 0.0) + wide * sum(w > 1 for w in fed)

    shapes = [("loop", [1] * 4, 4, False), ("chain1", [1], 1, False), ("star8", [1], 8, True),
              ("fan4", [1, 4], 8, True), ("fan2", [1, 2], 4, True), (WIDE_SHAPE, [1, 2, 4, 8, 1], 31, True)]
    prof = dataclasses.replace(_profile(), draft_ratio=drafted([1] * 4, False) / 4)
    timed = [_looped(prof, {"shape": s, "levels": len(fed), "nodes": n, "fed": fed},
                     lambda fed, n: drafted(fed, n > len(fed)) if fed else 0.0)  # a tree: nodes > levels
             for s, fed, n, _ in shapes]
    prof.extra.update(loop_tree_depth=4, loop_tree_size=5, draft_level_ratios=dict(GROWTH),
                      draft_shape_ratios=timed)
    small = dataclasses.replace(prof, extra={**prof.extra, "draft_shape_ratios": timed[:-1]})
    # levels fed 1, 3, 4, 4, 5, 6: EAGLE-1's Sequoia-32 tree on code at T = 0
    sequoia32 = Tree.from_parents([-1, 0, 0, 0, 1, 1, 1, 2, 3, 4, 4, 5, 7, 8, 9, 9, 10, 11, 12, 14, 14, 15,
                                   16, 17, 18, 19, 19, 20, 21, 22, 23, 24])
    fed = DraftCost(fed_width=True).widths
    assert fed(sequoia32) == [1, 3, 4, 4, 5, 6] and fed(wide_tree()) == [1, 2, 4, 8, 1]
    for tree in (wide_tree(), sequoia32):
        truth = drafted(fed(tree), True) * prof.t_ar_s
        assert tree_predictions(cfg, prof, tree)[0]["t_draft_s"] == pytest.approx(truth, rel=0.02)
        assert tree_predictions(cfg, small, tree)[0]["t_draft_s"] > 1.05 * truth  # five shapes: +7%
    # the loop's own chain stays near its timed draft (a least-squares fit now: six shapes, five terms)
    chain = tree_predictions(cfg, prof, Tree.chain(4))[0]["t_draft_s"]
    assert chain == pytest.approx(drafted([1] * 4, False) * prof.t_ar_s, rel=0.05)


def test_a_profile_without_the_drafts_shapes_is_measured_again(run_config):
    cfg = run_config(LEGACY_SPLIT, "method=vanilla", "tree.budgets=[1,2,4,8]")
    prof = _shaped_profile(0.4, 0.2, 0.02, 0.06)
    prof.extra.update(verify_step_ratios={"0": 0.01}, loop_verify_sizes={"5": 10},
                      loop_verify_wide={"32": 3.0}, rank_runs=[[[0, -1]]], star_estimator="exact")
    assert remeasure_reason(prof, cfg) == ""
    narrow = [s for s in prof.extra["draft_shape_ratios"] if s["shape"] != WIDE_SHAPE]  # the eighth session's
    assert "draft not timed on the wide tree" in remeasure_reason(
        dataclasses.replace(prof, extra={**prof.extra, "draft_shape_ratios": narrow}), cfg)
    old = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items() if k != "draft_shape_ratios"})
    assert "every tree shape" in remeasure_reason(old, cfg)
    no_fan2 = [s for s in narrow if s["shape"] != "fan2"]  # the sixth session's
    assert "every tree shape" in remeasure_reason(
        dataclasses.replace(prof, extra={**prof.extra, "draft_shape_ratios": no_fan2}), cfg)
    no_fan = [s for s in no_fan2 if s["shape"] != "fan4"]  # the sixth session's first
    assert "every tree shape" in remeasure_reason(
        dataclasses.replace(prof, extra={**prof.extra, "draft_shape_ratios": no_fan}), cfg)
    chain = run_config(LEGACY_SPLIT, "method=vanilla", "workload.temperature=1", "method.verifier=chain",
                       "tree.budgets=[1,2,4,8]")
    # a chain verifier's request reads the trees too (a Sequoia row shares its key): an older calibration
    # under it, which timed the chains alone, is measured again
    assert remeasure_reason(prof, chain) == ""
    assert "every tree shape" in remeasure_reason(
        dataclasses.replace(prof, extra={**prof.extra, "draft_shape_ratios": no_fan[:2]}), chain)
    lookup = dataclasses.replace(old, drafter="prompt_lookup")  # no draft levels of its own: none timed
    lookup_cfg = run_config(LEGACY_SPLIT, "method=prompt_lookup", "tree.budgets=[1,2,4,8]")
    assert remeasure_reason(lookup, lookup_cfg) == ""


def test_a_greedy_profile_records_each_roots_accepted_rank(run_config, tiny_models, cache):
    """Temperature 0: the accepted rank of every root's star, per trajectory and depth (what the greedy loop
    walks: specsim.replay), the same ranks the positional vector counts; a sampled profile records none."""
    prof = measure_profile(run_config(*SMALL, "method=vanilla"), tiny_models, show_progress=False)
    runs = prof.extra["rank_runs"]
    assert len(runs) == 2 and all(len(r) == 1 and len(r[0]) == 8 for r in runs)  # 2 prompts × 8 roots
    width = prof.width
    counts = np.bincount([width if r < 0 else r for p in runs for r in p[0]], minlength=width + 1)
    assert counts.tolist() == prof.extra["rank_counts"]
    sampled = run_config(*SMALL, "method=vanilla", "workload.temperature=1.0", "method.verifier=sequoia")
    assert "rank_runs" not in measure_profile(sampled, tiny_models, show_progress=False).extra


def test_greedy_tau_is_the_loop_replayed_on_the_trajectories(run_config):
    """A T = 0 profile with each root's rank: τ of the run's tree is the greedy loop replayed on them (runs of
    three hits then a miss: every step of a chain of 4 accepts 3, τ = 4), not the vector's 3.05; its finite
    run's cut and speedup follow the same law. At T = 1, or without the ranks, the vector's law stands."""
    from methods.measurement.profiles import replayed_law
    from specsim.expected import tokens_per_forward

    cfg = run_config("method=vanilla", "tree=chain", "tree.gamma=4", "workload.max_new_tokens=48")
    prof = dataclasses.replace(_profile(), acceptance_vector=(0.0, 0.75, 0.0, 0.0, 0.25))
    tree = Tree.chain(4)
    vector_here, _ = tree_predictions(cfg, prof, tree)
    assert vector_here["predicted_tau"] == pytest.approx(3.05078125)
    prof.extra["rank_runs"] = [[[0, 0, 0, -1] * 12]]
    here, preset = tree_predictions(cfg, prof, tree)
    law = replayed_law(cfg, prof, tree)
    assert here["predicted_tau"] == pytest.approx(4.0) == preset["predicted_tau"]
    assert here["tokens_per_forward"] == pytest.approx(tokens_per_forward(law, 48))
    assert here["t_step_s"] == vector_here["t_step_s"]  # the step is priced as before
    assert here["predicted_speedup"] == pytest.approx(vector_here["predicted_speedup"] * 4.0 / 3.05078125)
    sampled = run_config("method=vanilla", "tree=chain", "tree.gamma=4", "workload.temperature=1",
                         "method.verifier=chain")
    assert replayed_law(sampled, prof, tree) is None
    assert tree_predictions(sampled, prof, tree)[0]["predicted_tau"] == pytest.approx(3.05078125)


def test_one_hot_tau_at_t1_takes_its_level_from_the_exact_vectors(run_config):
    """T = 1, one-hot drafts (deterministic): the replay walks one sampled trajectory per prompt, whose
    tokens hit rank 0 at 0.6 (replay τ 59/23 = 2.565 on a chain of 3, its own ranks' i.i.d. law 2.176),
    while the exact vector (the coin flips integrated out) says p_1 = 1/2 (i.i.d. 1.875): the prediction
    keeps the replay's structure and takes the exact level, 2.565 − 2.176 + 1.875, and the prediction's
    standard error is the exact vectors' (their variance ratio). At T = 0 the replay stands as it is."""
    from methods.measurement.profiles import replayed_law

    tree = Tree.chain(3)
    prof = dataclasses.replace(_profile(), acceptance_vector=(0.0, 0.5, 0.0, 0.0, 0.5))
    prof.extra["rank_runs"] = [[[0, -1, 0, 0, -1, 0, 0, 0, -1, -1] * 6]]
    one_hot = run_config("method=staged", "workload.temperature=1", "method.verifier=deterministic",
                         "workload.max_new_tokens=48")
    want = 59 / 23 - 2.176 + 1.875
    law = replayed_law(one_hot, prof, tree)
    assert law.sum() == pytest.approx(1.0) and law.min() >= 0
    assert float(np.dot(np.arange(law.size), law)) == pytest.approx(want)
    prof.extra["star_exact"] = {"variance_ratio": 0.6}  # the flips' share of the variance gone with them
    here = tree_predictions(one_hot, prof, tree)[0]
    assert here["predicted_tau"] == pytest.approx(want) and here["predicted_tau_star_variance_ratio"] == 0.6
    assert here["predicted_tau_replay_draw"] == pytest.approx(59 / 23)  # the draw's own, for comparison
    greedy = run_config("method=staged", "workload.max_new_tokens=48")
    assert float(np.dot(np.arange(5), replayed_law(greedy, prof, tree))) == pytest.approx(59 / 23)
    assert "predicted_tau_star_variance_ratio" not in tree_predictions(greedy, prof, tree)[0]


def test_a_greedy_profile_without_the_roots_ranks_is_measured_again(run_config):
    from methods.measurement.calibrate import records_rank_runs

    budgets = "tree.budgets=[1,2,4,8]"
    cfg = run_config(LEGACY_SPLIT, "method=vanilla", budgets)
    prof = _shaped_profile(0.4, 0.2, 0.02, 0.06)
    prof.extra.update(verify_step_ratios={"0": 0.01}, loop_verify_sizes={"5": 10},
                      loop_verify_wide={"32": 3.0})
    assert records_rank_runs(cfg) and "accepted rank per root" in remeasure_reason(prof, cfg)
    prof.extra["rank_runs"] = [[[0, -1]]]
    assert remeasure_reason(prof, cfg) == ""
    sampled = run_config("method=vanilla", "workload.temperature=1", "method.verifier=chain", budgets)
    assert not records_rank_runs(sampled)
    assert not records_rank_runs(run_config("method=prompt_lookup", budgets))  # no law: proposals


def test_a_drafter_that_learns_is_calibrated_through_the_loop_as_a_run_serves_it(run_config, tiny_models,
                                                                                  cache):
    """Online SD distils its draft between requests: its calibration decodes every prompt through the loop
    with one drafter (as a run serves its requests), records the updates it had at each, and a run's τ is
    the mixture of those prompts' histograms by its own requests' update counts (specsim.learning) — not
    one law of the drafter as loaded (quiet zoo7: Online grounded T = 0 read τ −12.9%)."""
    from methods.measurement.calibrate import LEARNING_ORDERS, LOOP_DRAFTERS
    from methods.measurement.profiles import key_document
    from specsim.learning import served_law

    cfg = run_config(*SMALL_SELF, "method=online", "method.params.draft=zoo", "method.params.update_every=1",
                     "method.params.mask=all", "tree=chain", "tree.gamma=3", "calibration.prompts=3")
    assert "online" in LOOP_DRAFTERS and key_document(cfg)["acceptance_from"] == "loop"
    prof = ensure_profile(cfg, tiny_models, show_progress=False)
    extra = prof.extra
    # the prompts in LEARNING_ORDERS orders, each with a fresh drafter: its updates restart with each order
    assert extra["learns_every"] == 1 and extra["loop_updates_by_prompt"] == [0, 1, 2] * LEARNING_ORDERS
    assert extra["loop_order_by_prompt"] == [o for o in range(LEARNING_ORDERS) for _ in range(3)]
    assert len(extra["loop_accept_hist_by_prompt"]) == 3 * LEARNING_ORDERS
    here, preset = tree_predictions(cfg, prof, Tree.chain(3))
    law = served_law(extra["loop_accept_hist_by_prompt"], extra["loop_updates_by_prompt"], 1, cfg.warmup,
                     cfg.workload.num_prompts)
    tau = float(np.dot(np.arange(law.size), law))
    assert here["predicted_tau"] == pytest.approx(tau) == pytest.approx(preset["predicted_tau"])
    assert here["predicted_tau_orders"] == LEARNING_ORDERS and here["predicted_tau_order_sd_rel"] >= 0
    one_order = {k: v for k, v in extra.items() if k != "loop_order_by_prompt"}
    assert "one order" in remeasure_reason(dataclasses.replace(prof, extra=one_order), cfg)  # older: again


# ---- exact star acceptance at T > 0 (issue 17): the flips integrated out ---------------------------------
def _flipped_ranks(p: torch.Tensor, stars, gen: torch.Generator) -> list:
    """The estimator star_ranks replaced: the Sequoia verifier run on each star, its coin flips drawn."""
    from methods.core.drafter import Draft
    from methods.core.verify import verify

    out = []
    for t, star in enumerate(stars):
        k = int(star.children.numel())
        tree = Tree.from_parents([-1] + [0] * k)
        tokens = torch.cat([torch.zeros(1, dtype=torch.long), star.children])
        res = verify(Verifier.sequoia, Draft(tree, tokens, star.q.expand(k + 1, -1)), p[t].expand(k + 1, -1),
                     gen)
        out.append(tree.ranks[res.accepted[1]] if len(res.accepted) > 1 else None)
    return out


def test_rank_law_is_the_closed_form_of_the_sequoia_star():
    """The docstring case of test_sequoia_star_without_replacement_matches_the_closed_form, without flips:
    children (0, 1) accept rank 0 w.p. 5/9, then rank 1 w.p. 1 (the residual and the renormalised q are
    one-hot on 1); children (1, 0): rank 0 w.p. min(1, .5/.1) = 1."""
    from methods.core.verify import rank_law

    p, q = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])
    assert rank_law(Verifier.sequoia, p, q, torch.tensor([0, 1])).tolist() == pytest.approx([5 / 9, 4 / 9])
    assert rank_law(Verifier.sequoia, p, q, torch.tensor([1, 0])).tolist() == pytest.approx([1.0, 0.0])
    # one-hot drafts: p(x_0), then p(x_1) renormalised without x_0
    det = rank_law(Verifier.deterministic, torch.tensor([0.5, 0.3, 0.2]), None, torch.tensor([1, 2]))
    assert det.tolist() == pytest.approx([0.3, 0.7 * 0.2 / 0.7])


def test_exact_star_acceptance_is_unbiased_with_less_variance_than_the_flips():
    """Random p and q over 6 tokens, stars of 2 children drawn from q without replacement: over 120 seeds the
    positional vector of star_ranks (the flips integrated out, rank 0 also the first draw: Σ min(p, q)) has
    the flipped verifier's mean at every rank, within 4 of the flipped estimator's standard errors of the
    mean, and rank 0 equals the closed form's average; its variance over seeds is below the flips' at every
    rank, and below half of it for none accepted."""
    n, width, seeds = 40, 2, 120
    law_gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, 6, generator=law_gen).mul(1.5).softmax(-1)
    q_logits = torch.randn(n, 6, generator=law_gen).mul(1.5)
    rule, sampling = StarRule(True, Verifier.sequoia), SamplingParams(temperature=1.0)
    exact, flipped = [], []
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        stars = star_children(q_logits, width, rule, sampling, gen)
        exact.append(rank_vector(star_ranks(p, torch.zeros(n, dtype=torch.long), stars, rule, gen), width))
        flipped.append(rank_vector(_flipped_ranks(p, stars, gen), width))
    exact, flipped = np.array(exact)[:, 1:], np.array(flipped)[:, 1:]  # (seeds, W + 1): ranks, none
    se = flipped.std(0, ddof=1) / np.sqrt(seeds)
    assert np.all(np.abs(exact.mean(0) - flipped.mean(0)) <= 4 * se)
    closed = torch.minimum(p, q_logits.softmax(-1)).sum(-1).mean().item()
    assert exact[:, 0] == pytest.approx(closed, abs=1e-6)  # rank 0: no randomness left at all
    var, flips = exact.var(0, ddof=1), flipped.var(0, ddof=1)
    assert np.all(var < flips) and var[-1] < 0.5 * flips[-1]  # rank 1 keeps its draw (0.0016 vs 0.0026)


def test_a_sampled_profile_records_the_exact_estimator_and_an_older_one_is_measured_again(
        run_config, tiny_models, cache):
    """T > 0: the star acceptance is the exact law (the profile's mark, and how much of a flipped estimator's
    per-position variance it keeps, in [0, 1]); a profile without the mark is measured again, at T = 0 not."""
    cfg = run_config(*SMALL, "method=vanilla", "workload.temperature=1.0", "method.verifier=sequoia")
    prof = measure_profile(cfg, tiny_models, show_progress=False)
    assert prof.extra["star_estimator"] == "exact"
    exact = prof.extra["star_exact"]
    assert exact["positions"] == prof.n_positions and 0.0 <= exact["variance_ratio"] <= 1.0
    assert remeasure_reason(prof, cfg) == ""
    old = dataclasses.replace(prof, extra={k: v for k, v in prof.extra.items() if k != "star_estimator"})
    assert "coin flips" in remeasure_reason(old, cfg)
    greedy = measure_profile(run_config(*SMALL, "method=vanilla"), tiny_models, show_progress=False)
    assert "star_exact" not in greedy.extra
    no_mark = dataclasses.replace(greedy, extra={k: v for k, v in greedy.extra.items()
                                                 if k != "star_estimator"})
    assert remeasure_reason(no_mark, run_config(*SMALL, "method=vanilla")) == ""


def test_the_prediction_carries_the_exact_stars_variance_share_only_where_tau_comes_from_them(run_config):
    """tree_predictions hands the star_exact variance share on (predicted_tau_star_variance_ratio) where τ is
    the star vectors' (a sampled chain), not where the greedy loop is replayed instead (T = 0)."""
    from methods.measurement.profiles import tree_predictions

    prof = _profile()
    prof.extra.update(star_exact={"positions": 100, "rank0_rate": 0.6, "variance_ratio": 0.3})
    sampled = run_config("method=vanilla", "workload.temperature=1", "method.verifier=chain", "tree=chain")
    here, preset = tree_predictions(sampled, prof, Tree.chain(4))
    assert here["predicted_tau_star_variance_ratio"] == preset["predicted_tau_star_variance_ratio"] == 0.3
    greedy = run_config("method=vanilla", "tree=chain")
    replayed = dataclasses.replace(prof, extra={**prof.extra, "rank_runs": [[[0, 0, -1, 0, 0, 0]]]})
    assert "predicted_tau_star_variance_ratio" not in tree_predictions(greedy, replayed, Tree.chain(4))[0]


def test_the_exact_estimators_variance_share_is_that_of_the_rank_zero_rate():
    """p_1 at .2 on half the positions and .8 on the others, alternating: a flipped indicator's variance is
    .5 · .5, the exact law's the positions' spread (.09 · n/(n−1)): a share of .36; greedy ranks record
    nothing."""
    from methods.measurement.calibrate import _exact_extra

    got = _exact_extra([(0.2, 0.5), (0.8, 0.1)] * 50)["star_exact"]
    assert got["rank0_rate"] == pytest.approx(0.5) and got["positions"] == 100
    assert got["variance_ratio"] == pytest.approx(0.09 * 100 / 99 / 0.25)
    assert _exact_extra([0, None, 1, 0]) == {}
    # the same positions as two prompts, one all .2 and one all .8: the prompts' spread (.09 of the mean's
    # variance) dominates both estimators, the flips add .16 · 100 / 100²: the exact one keeps 98%
    by_prompt = _exact_extra([(0.2,)] * 50 + [(0.8,)] * 50, [50, 50])["star_exact"]
    assert by_prompt["variance_ratio"] == pytest.approx(0.09 / (0.09 + 0.0016))


def test_one_hot_drafts_at_t1_record_the_trajectorys_ranks_and_the_loop_is_replayed(run_config, tiny_models,
                                                                                     cache):
    """T > 0 with one-hot drafts (verifier=deterministic): the verifier accepts child x_j with probability
    p(x_j) (its rank law is p at the children), so the loop is the walk along a trajectory sampled from p:
    the profile records, per root, the rank of the trajectory's token among the drafter's top-W, and τ of a
    tree is that walk replayed (profiles.replayed_law); Sequoia's sampled stars record none."""
    from methods.core.verify import rank_law
    from methods.measurement.calibrate import trajectory_ranks
    from methods.measurement.profiles import replayed_law

    p = torch.tensor([0.1, 0.4, 0.3, 0.2])
    assert rank_law(Verifier.deterministic, p, None, torch.tensor([2, 0, 3])).tolist() == pytest.approx(
        [0.3, 0.1, 0.2])
    stars = [Star(torch.tensor([5, 7, 2]), None), Star(torch.tensor([1]), None)]
    assert trajectory_ranks(stars, torch.tensor([2, 3])) == [2, -1]
    cfg = run_config(*SMALL, "method=vanilla", "workload.temperature=1.0", "method.verifier=deterministic")
    prof = measure_profile(cfg, tiny_models, show_progress=False)
    runs = prof.extra["rank_runs"]
    assert len(runs) == 2 and all(len(r) == 1 and len(r[0]) == 8 for r in runs)  # 2 prompts × 8 roots
    assert all(-1 <= r < prof.width for p_ in runs for r in p_[0])
    assert remeasure_reason(prof, cfg) == ""
    assert replayed_law(cfg, prof, Tree.chain(3)) is not None
    sampled = run_config(*SMALL, "method=vanilla", "workload.temperature=1.0", "method.verifier=sequoia")
    assert replayed_law(sampled, prof, Tree.chain(3)) is None  # its loop draws children: no walk
    assert "rank_runs" not in measure_profile(sampled, tiny_models, show_progress=False).extra


def test_specinfer_stars_draw_with_replacement_as_its_drafters_do(run_config):
    """SpecInfer's drafters draw a node's children i.i.d.: V = 2, p = (.5, .5), q = (.9, .1), W = 2. Rank 0
    is Σ min(p, q) = .6; after rejecting token 0 the residual is one-hot on 1 and the second draw is 0 again
    w.p. .9 (accepted w.p. 0) or 1 (accepted): P(rank 1) = .9 · 4/9 · .1 = .04, none .36 — where Sequoia's
    stars (without replacement) read .4 and 0. The rule is in the profile key (its name)."""
    from methods.measurement.profiles import key_document, star_rule

    spec = run_config("method=vanilla", "workload.temperature=1", "method.verifier=specinfer")
    assert star_rule(spec) == StarRule(True, Verifier.specinfer)
    assert star_rule(spec).draw_mode == "with_replacement"
    seq = run_config("method=vanilla", "workload.temperature=1", "method.verifier=sequoia")
    assert star_rule(seq).draw_mode == "without_replacement"
    assert key_document(spec)["star"] != key_document(seq)["star"]
    n, gen = 4000, torch.Generator().manual_seed(0)
    q_logits = torch.tensor([0.9, 0.1]).log().expand(n, 2)
    rule = star_rule(spec)
    stars = star_children(q_logits, 2, rule, SamplingParams(temperature=1.0), gen)
    assert any(int(s.children[0]) == int(s.children[1]) for s in stars)  # repeats happen
    p = torch.tensor([0.5, 0.5]).expand(n, 2)
    v = rank_vector(star_ranks(p, torch.zeros(n, dtype=torch.long), stars, rule, gen), 2)
    assert v[1] == pytest.approx(0.6) and v[2] == pytest.approx(0.04, abs=0.01) and v[3] == pytest.approx(
        0.36, abs=0.01)


CUDA_PRESETS = ("vanilla", "prompt_lookup", "staged", "lookahead", "layerskip")  # no zoo-only preset


def _calibrate_on(device: str, preset: str, run_config, tiny_models, *extra: str):
    dev = torch.device(device)
    m = tiny_models
    target, draft = copy.deepcopy(m.target).to(dev), copy.deepcopy(m.draft).to(dev)
    models = Models(target, draft, m.tokenizer, dev, m.dtype)
    return measure_profile(run_config(*SMALL, f"method={preset}", *extra), models, show_progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", CUDA_PRESETS)
def test_calibration_runs_on_cuda_and_agrees_with_the_cpu(run_config, tiny_models, cache, preset):
    """The whole calibration with the models on a CUDA device (the prompts, trajectories and held-out windows
    are built on the host): it ran into cross-device ops twice (star_ranks' cat, LayerSkip's exit report).
    A drafter with a law (vanilla: one star per position of the trajectory) sees the same positions as on the
    CPU and, at T = 0, the argmax's acceptance up to float near-ties of the tiny random models; proposal
    drafters' positions follow the trajectories' n-grams, which near-ties may move."""
    gpu = _calibrate_on("cuda", preset, run_config, tiny_models)
    _valid_vector(gpu.acceptance_vector, len(gpu.acceptance_vector) - 2)
    assert gpu.n_positions > 0
    if preset == "vanilla":
        cpu = _calibrate_on("cpu", preset, run_config, tiny_models)
        assert gpu.n_positions == cpu.n_positions
        assert np.allclose(gpu.acceptance_vector, cpu.acceptance_vector, atol=0.1)
        sampled = _calibrate_on("cuda", preset, run_config, tiny_models, "workload.temperature=1.0",
                                "method.verifier=sequoia")  # sampled stars, the generator on the host
        _valid_vector(sampled.acceptance_vector, len(sampled.acceptance_vector) - 2)


def test_the_generations_cut_last_steps_are_priced_as_the_loop_drafts_them(run_config):
    """The loop drafts at most the tokens left (ctx.max_new): a generation's last steps draft and verify cut
    trees. τ_N counted their tokens; their cost is priced too (specsim.run_steps): the decode's step is the
    mean of the run's steps, below the full step where the generation is short, equal to it where it is long,
    and the decode speedup is τ_N · t(1) over that mean step (the steady speedup keeps the full step)."""
    prof = _shaped_profile(0.2, 0.28, 0.02, 0.1)
    seq = Tree.from_parents([-1, 0, 0, 1, 1, 2, 3, 4, 6, 8])  # 6 deep
    for n, low in ((6, True), (48, True), (400, False)):
        cfg = run_config("method=vanilla", "tree=chain", "tree.gamma=4", f"workload.max_new_tokens={n}")
        here = tree_predictions(cfg, prof, seq)[0]
        draft, verify = here["t_draft_run_s"], here["t_verify_run_s"]
        assert draft < here["t_draft_s"] and verify < here["t_verify_s"]
        if not low:
            assert draft == pytest.approx(here["t_draft_s"], rel=0.03)
        assert here["predicted_decode_speedup"] == pytest.approx(
            here["tokens_per_forward"] * here["t_ar_s"] / (draft + verify))
        assert here["predicted_speedup"] == pytest.approx(
            here["predicted_tau"] * here["t_ar_s"] / (here["t_draft_s"] + here["t_verify_s"]))
    short = tree_predictions(run_config("method=vanilla", "workload.max_new_tokens=6"), prof, seq)[0]
    assert short["t_draft_run_s"] < 0.8 * short["t_draft_s"]  # 6 tokens, 6 deep: most steps are cut


def test_the_drafts_fit_reads_the_shapes_loops_as_means_over_their_cut_steps(run_config):
    """The calibration's loops on the shapes are generations of calibration.new_tokens: their draft per step
    is the mean over steps whose last ones the generation cut. Timed so (the loops' means of a true full-step
    law), the fit recovers the full step's terms: the chain's and the wide tree's full draft within 1%."""
    fixed, level, node, wide = 0.2, 0.28, 0.02, 0.1
    prof = _shaped_profile(fixed, level, node, wide)
    growth_cost = MeasuredCost.from_mapping({int(w): r / GROWTH["1"] for w, r in GROWTH.items()})
    truth = np.array([fixed, level, node, wide, 0.0])
    for s in prof.extra["draft_shape_ratios"]:  # the loop's timing: the mean over its generation's rooms
        tree = profiles_module._shape_tree(s, s["fed"])
        s["ratio"] = float(np.dot(profiles_module._loop_fit_row(prof, tree, growth_cost), truth))
    terms = draft_terms(prof)
    assert terms[:4] == pytest.approx(tuple(truth[:4]), abs=2e-3)
    cfg = run_config("method=vanilla", "tree=chain", "tree.gamma=4")
    for tree, fed in ((Tree.chain(4), [1] * 4), (wide_tree(), [1, 2, 4, 8, 1])):
        full = (fixed + level * _grown(fed) + node * (tree.size - 1) + wide * sum(w > 1 for w in fed))
        priced = tree_predictions(cfg, prof, tree)[0]["t_draft_s"]
        assert priced == pytest.approx(full * prof.t_ar_s, rel=0.01)


def test_a_draft_timed_per_step_over_the_calibrations_cut_steps_is_priced_as_a_full_step(run_config):
    """A drafter priced per level from its loop (no shapes timed: LayerSkip, MTP, Medusa) had its draft per
    step timed over generations of calibration.new_tokens, whose last steps drafted what their room let: at
    32 tokens and every chain of 4 accepted (5 tokens a step), 7 steps drafted 4, 4, 4, 4, 4, 4 and 2 levels
    (2 tokens left). The full step's level is the loop's mean over 26 / 28 of the full levels, so the run's
    own cut (specsim.run_steps) is not counted twice."""
    cfg = run_config("method=layerskip")
    prof = dataclasses.replace(_profile(), drafter="layerskip")
    prof.extra.update(loop_tree_depth=4, loop_tree_size=5, split_sizes={"new_tokens": 32})
    plain = apply_profile(cfg, prof).method.draft_cost_ratio
    prof.extra["loop_accept_hist"] = [0, 0, 0, 0, 10]
    assert apply_profile(cfg, prof).method.draft_cost_ratio == pytest.approx(plain * 28 / 26)
    assert calibration_cut_share(prof, one_pass=False) == pytest.approx(26 / 28)
    assert calibration_cut_share(prof, one_pass=True) == pytest.approx(1.0)  # one pass at every room


def test_a_generations_first_draft_is_priced_once_per_generation(run_config):
    """Work a drafter does once per generation in its first step (EAGLE's head appends the prompt's rows to
    its cache: 3-4 t(1) on the grounded workload's 384-token prompts) is timed apart from the shapes' per-step
    draft and priced once per generation: E · τ_N / N on the run's mean step, less per step the longer the
    generation. Fitted per step on the calibration's 32-token loops, it priced EAGLE-1's trees' draft 5-19%
    high on the grounded rows (quiet sweep zoo10). The full step (the steady speedup's) does not pay it."""
    plain = _shaped_profile(0.2, 0.28, 0.02, 0.1)
    prof = dataclasses.replace(plain, extra={**plain.extra, "draft_first_excess_ratios": {"loop": 3.0,
                                                                                          "chain1": 2.0}})
    seq = Tree.from_parents([-1, 0, 0, 1, 1, 2, 3, 4, 6, 8])
    added = {}
    for n in (32, 48, 400):
        cfg = run_config("method=vanilla", "tree=chain", "tree.gamma=4", f"workload.max_new_tokens={n}")
        base, here = tree_predictions(cfg, plain, seq)[0], tree_predictions(cfg, prof, seq)[0]
        assert here["t_draft_s"] == base["t_draft_s"]  # the full step: unchanged
        added[n] = here["t_draft_run_s"] - base["t_draft_run_s"]
        assert added[n] == pytest.approx(2.5 * prof.t_ar_s * here["tokens_per_forward"] / n)
        assert here["predicted_decode_speedup"] == pytest.approx(
            here["tokens_per_forward"] * here["t_ar_s"] / (here["t_draft_run_s"] + here["t_verify_run_s"]))
        assert here["predicted_decode_speedup"] < base["predicted_decode_speedup"]
        assert prediction_metrics(cfg, here, here)["predicted_t_draft_first_s"] == pytest.approx(
            2.5 * prof.t_ar_s)
    assert added[32] > added[48] > added[400] > 0
    shapes = {**prof.extra, "draft_shape_ratios": []}  # no per-step terms: the draft's own figure has it
    none = dataclasses.replace(prof, extra=shapes)
    cfg = run_config("method=vanilla", "tree=chain", "tree.gamma=4")
    assert "predicted_t_draft_first_s" not in tree_predictions(cfg, none, seq)[0]


def test_the_first_draft_timer_takes_the_first_steps_excess_out_of_the_shapes_step(monkeypatch):
    """The calibration's loops time each generation's first proposal apart (calibrate.FirstDraftTimer): its
    excess over the later ones, E, is (QFIRST, shape), and the shape's per-step draft leaves it out."""
    clock = [0.0]
    monkeypatch.setattr(calibrate_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class Fake:
        costs: list[float] = []

        def reset(self, prompt):
            pass

        def propose(self, ctx):
            clock[0] += self.costs.pop(0)
            return "draft"

        level_step = "delegated"

    inner = Fake()
    timer = calibrate_module.FirstDraftTimer(inner)
    for costs in ([5.0, 1.0, 1.0, 1.0], [4.0, 2.0, 2.0]):  # two generations: E = 4.5 - 1.5
        inner.costs = list(costs)
        timer.reset(None)
        for _ in costs:
            assert timer.propose(None) == "draft"
    assert timer.level_step == "delegated"
    r = SimpleNamespace(time_draft_s=18.0, n_target_forwards=7)
    out = calibrate_module._steady_draft(r, timer, "fan4")
    assert out[(calibrate_module.QFIRST, "fan4")] == pytest.approx(3.0)
    assert out[(calibrate_module.QSHAPE, "fan4")] == pytest.approx((18.0 - 3.0) / 7)
    one = calibrate_module.FirstDraftTimer(Fake())
    assert one.excess_s() == 0.0  # nothing timed: nothing to take out


@pytest.mark.parametrize("first, second", [("chain", "sequoia"), ("sequoia", "chain")])
def test_one_profile_serves_the_chain_and_the_tree_verifier(run_config, tiny_models, cache, monkeypatch,
                                                            first, second):
    """At T = 1 a chain row (Leviathan's verifier: chains only) and a Sequoia row (Sequoia's verifier) of one
    drafter share the profile key (the star rule is Sequoia's for both). Whichever calibrates first, the
    other reuses its profile: the calibration times the wide loop, the tree-shaped drafts and the walks of
    trees under a tree verifier whatever the run's (zoo12: six chain T1 profiles were measured twice, the
    Sequoia rows finding "the loop's verification not timed on a wide tree")."""
    monkeypatch.setattr(cost_table_module, "MAX_TIMING_DISPERSION", float("inf"))  # the cache under test
    calls = []
    real = calibrate_module.measure_profile

    def counting(cfg, models=None, show_progress=True):
        calls.append(cfg.method.verifier)
        return real(cfg, models, show_progress=False)

    monkeypatch.setattr(calibrate_module, "measure_profile", counting)
    rows = {"chain": run_config(*_with("method=vanilla", "workload.temperature=1", "method.verifier=chain")),
            "sequoia": run_config(*_with("method=vanilla", "tree=sequoia", "workload.temperature=1",
                                         "method.verifier=sequoia", f"tree.budgets={BUDGETS}"))}
    cfgs = {v: profiles_module.profile_config(cfg) for v, cfg in rows.items()}
    path = profile_path(cfgs[first])
    assert profile_path(cfgs[second]) == path  # one key: the verifier is not in it
    prof = ensure_profile(cfgs[first], tiny_models, show_progress=False)
    before = path.read_text()
    assert ensure_profile(cfgs[second], tiny_models, show_progress=False) == prof
    assert len(calls) == 1 and path.read_text() == before  # reused: the same file, the same created stamp
    for cfg in cfgs.values():
        assert remeasure_reason(prof, cfg) == ""
    # what the Sequoia row's prediction reads: the loop's verification on the wide tree, the draft on every
    # tree shape, the verifier's walk of trees at each timed size
    assert prof.extra["loop_verify_wide"] and str(WIDE_NODES) in prof.extra["loop_verify_wide"]
    timed = {s["shape"] for s in prof.extra["draft_shape_ratios"] if "fed" in s}
    assert timed == {"loop", "chain1", "star8", "fan4", "fan2", WIDE_SHAPE}
    assert set(prof.extra["verify_step_ratios"]) == {"0", *(str(n) for n in prof.t_n if n > 1)}
    assert draft_terms(prof) is not None
    for v, tree in (("sequoia", wide_tree(8)), ("chain", Tree.chain(4))):  # each row's tree priced
        here, _ = tree_predictions(rows[v], prof, tree)
        assert here["predicted_speedup"] > 0


def test_a_chain_verifiers_calibration_times_medusas_trees_in_the_tree_verifiers_mode(
        run_config, tiny_models, cache, monkeypatch):
    """Medusa's chain row at T = 1 (Leviathan's verifier: the heads draw with replacement) calibrates the
    profile its Sequoia rows read: its pass per tree and its wide loop are timed with the heads drawing as
    Sequoia's verifier has them draw (without replacement), so the Sequoia row finds all it needs."""
    monkeypatch.setattr(cost_table_module, "MAX_TIMING_DISPERSION", float("inf"))
    medusa = ("method=medusa", "+method.params.heads=init", "method.params.num_heads=3",
              "workload.temperature=1")
    chain = run_config(*_with(*medusa, "tree=chain", "method.verifier=chain"))
    sequoia = run_config(*_with(*medusa, "tree=sequoia", f"tree.budgets={BUDGETS}",
                                "method.verifier=sequoia"))
    pchain, pseq = profiles_module.profile_config(chain), profiles_module.profile_config(sequoia)
    assert calibrate_module.tree_verifier(pchain) == Verifier.sequoia
    assert calibrate_module.tree_verifier(pseq) == Verifier.sequoia
    run = calibrate_module._setup(pchain, tiny_models, SimpleNamespace(update=lambda *a: None))
    assert run.drafter.mode == "with_replacement" and calibrate_module.tree_drafter(run).mode == "without"
    assert calibrate_module.wide_drafter(run).mode == "without"
    prof = ensure_profile(pchain, tiny_models, show_progress=False)
    assert prof.extra["loop_verify_wide"] and prof.extra["draft_pass_tree_ratios"]
    assert remeasure_reason(prof, pseq) == "" and remeasure_reason(prof, pchain) == ""


@pytest.mark.slow
def test_specinfer_merged_trees_are_counted_on_the_runs_own_tree(run_config, tiny_models, cache, monkeypatch):
    """SpecInfer's verify is priced at the merged trees the run's own drafter proposes on the run's own tree,
    counted on the calibration split (methods.measurement.merged_trees) and cached beside the profile: the
    mean size over the steps with room for the whole tree, as a loop that logs every proposal counts it;
    merged_size reads it for that union only."""
    import methods.measurement.merged_trees as merged_module
    from methods.core.engine import ModelEngine
    from methods.core.loop import DecodeOptions, decode
    from methods.data.workloads import load_prompts
    from methods.drafters.registry import build_drafter
    from methods.measurement.measure import run_tree
    from methods.measurement.profiles import merged_size, profile_config
    from specsim.multidraft import union_tree

    cfg = run_config(*SMALL_SELF, "method=specinfer", "method.params.source=copies", "tree=chain",
                     "tree.gamma=3")
    tree = run_tree(cfg)
    doc = merged_module.ensure_merged(cfg, profile_config(cfg), tiny_models, tree, show_progress=False)
    assert merged_module.merged_path(profile_config(cfg), tree).is_file()
    # an independent count: the same drafter through the loop, every proposal logged with its room
    w, cal = cfg.workload, cfg.calibration
    sampling = SamplingParams(w.temperature, w.top_k, w.top_p)
    n = cal.new_tokens
    prompts = load_prompts(dataclasses.replace(w, split="calibration", num_prompts=cal.prompts,
                                               max_new_tokens=n), tiny_models.tokenizer, cfg.seed)
    drafter = build_drafter(cfg.method, tree, tiny_models, sampling, tree_cfg=cfg.tree)
    seen, propose = [], drafter.propose

    def logged(ctx):
        draft = propose(ctx)
        seen.append((draft.tree.size, ctx.max_new))
        return draft

    drafter.propose = logged
    target = ModelEngine(tiny_models.target)
    for p in prompts:
        decode(target, drafter, torch.tensor(p.token_ids), DecodeOptions.for_method(cfg.method, sampling, n),
               torch.Generator().manual_seed(cfg.seed))
    full = [size for size, room in seen if room > drafter.tree.depth]
    assert doc["steps"] == len(full) > 0 and doc["size"] == pytest.approx(np.mean(full))
    assert doc["union_size"] == drafter.tree.size == 1 + 3 * 3
    assert 1 + 3 <= doc["size"] <= drafter.tree.size  # shared prefixes verified once
    # cached: a second call reads the file
    monkeypatch.setattr(merged_module, "count_merged", lambda *a, **k: pytest.fail("counted again"))
    again = merged_module.ensure_merged(cfg, profile_config(cfg), tiny_models, tree, show_progress=False)
    assert again == doc
    prof = merged_module.with_merged(_merging_profile([1.0, 1.2, 1.5, 1.8, 2.1]), doc)
    assert merged_size(prof, Tree.chain(3), 3) == pytest.approx(doc["size"])  # the counted union
    assert merged_size(prof, Tree.chain(4), 3) == pytest.approx(1.0 + 1.2 + 1.5 + 1.8 + 2.1)  # another one
    here, _ = tree_predictions(cfg, prof, union_tree(Tree.chain(3), 3))
    assert here["predicted_mean_verify_tokens"] == pytest.approx(doc["size"])
