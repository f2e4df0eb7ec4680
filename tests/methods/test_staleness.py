"""Calibration that does not lie when the machine is busy (methods.measurement.calibrate, .cost_table,
.staleness): scripted timing rounds that scatter keep a profile out of the cache, and a profile whose t(1)
disagrees with a run's own autoregressive step is reported, re-anchored and marked stale for the next run."""

from __future__ import annotations

import dataclasses
import json

import pytest

import methods.measurement.calibrate as calibrate_module
from methods.measurement.calibrate import calibrate, ensure_profile
from methods.measurement.cost_table import DRAFT, QSHAPE, T_AR, TIMING_ATTEMPTS, VERIFY, VLOOP
from methods.measurement.measure import measure
from methods.measurement.profiles import (
    Profile,
    load_profile,
    profile_config,
    profile_path,
    save_profile,
    tree_predictions,
)
from methods.measurement.staleness import T1_TOLERANCE, judge_profile, mark_stale, t1_disagrees
from specsim.tree import Tree

SMALL = ("model=random_tiny", "workload.prompt_tokens=16", "calibration.prompts=1",
         "calibration.new_tokens=4", "calibration.depth_prompts=1", "calibration.reps=2",
         "calibration.warmup=0", "calibration.width=4", "tree.budgets=[1,2,4,8]",
         "calibration.max_reps=0", "method=vanilla")


def _rounds(t1: list[float], sizes, wide: int | None = None) -> list[dict]:
    """Scripted rounds on a machine whose slowdown is t1[r] / 1e-3: every cost scales with it (the draft
    model's loop drafts 0.3 + 0.2 per level + 0.01 per node, the calibration's chain of 4 among them; its
    loop verifies a ``wide``-node tree in 1.1 t(wide))."""
    shapes = {(QSHAPE, "loop"): 1.14, (QSHAPE, "chain1"): 0.51, (QSHAPE, "star8"): 0.58,
              (QSHAPE, "fan4"): 0.8, (QSHAPE, "fan2"): 0.7}
    if wide is not None:
        sizes = sorted({*sizes, wide})
        shapes[(VLOOP, wide)] = 1.1 * (1 + 0.05 * wide)
        shapes[(QSHAPE, "wide")] = 0.3 + 0.2 * 5 + 0.01 * 31  # and drafts it (calibrate.wide_tree)
    return [{T_AR: a, DRAFT: 0.2 * a, VERIFY: 1.3 * a, **{n: (1 + 0.05 * n) * a for n in sizes},
             **{k: r * a for k, r in shapes.items()}} for a in t1]


def _script(monkeypatch, *series: list[float]) -> list[int]:
    """Replace the timing rounds of the calibration by ``series`` (one t(1) list per timing, reused cyclically
    if the calibration times more often); returns the list the calls are counted in."""
    calls: list[int] = []

    def scripted(run, context, sizes, wide=None):
        calls.append(1)
        size = None if wide is None else wide.tree.size
        return _rounds(series[(len(calls) - 1) % len(series)], sizes, size)

    monkeypatch.setattr(calibrate_module, "_cost_rounds", scripted)
    return calls


QUIET = [1.0e-3, 1.02e-3, 0.98e-3, 1.01e-3, 0.99e-3, 1.0e-3]
SLOW_FIRST_HALF = [4.0e-3, 4.1e-3, 3.9e-3, 1.0e-3, 1.02e-3, 0.98e-3]


def test_quiet_timings_are_cached_as_ratios(run_config, tiny_models, cache, monkeypatch):
    calls = _script(monkeypatch, QUIET)
    cfg = run_config(*SMALL)
    prof = ensure_profile(cfg, tiny_models, show_progress=False)
    assert len(calls) == 1 and profile_path(cfg).is_file() and load_profile(cfg) == prof
    assert prof.t_ar_s == pytest.approx(1.0e-3) and prof.draft_ratio == pytest.approx(0.2)
    assert prof.t_n_ratios == {n: pytest.approx(1 + 0.05 * n) for n in prof.t_n_ratios}
    tree = prof.extra["loop_tree_size"]
    assert prof.verify_overhead_ratio == pytest.approx(max(0.0, 1.3 - (1 + 0.05 * tree)))
    assert prof.worst_dispersion < 0.05 and ensure_profile(cfg, tiny_models) == prof and len(calls) == 1


def test_scattered_timings_are_timed_again_then_kept_out_of_the_cache(
    run_config, tiny_models, cache, monkeypatch, capsys
):
    calls = _script(monkeypatch, SLOW_FIRST_HALF)
    cfg = run_config(*SMALL)
    prof = ensure_profile(cfg, tiny_models, show_progress=False)
    assert len(calls) == TIMING_ATTEMPTS == len(prof.extra["timing_attempts"])
    assert not profile_path(cfg).exists()  # never cached
    err = capsys.readouterr().err
    assert "timing again" in err and "NOT cached" in err and "t1" in err
    assert prof.timing_dispersion["t1"] > 1.0 and prof.draft_ratio == pytest.approx(0.2)  # ratios hold
    ensure_profile(cfg, tiny_models, show_progress=False)  # the next run measures again
    assert len(calls) == 2 * TIMING_ATTEMPTS


def test_a_second_quiet_timing_is_cached(run_config, tiny_models, cache, monkeypatch, capsys):
    calls = _script(monkeypatch, SLOW_FIRST_HALF, QUIET)
    cfg = run_config(*SMALL)
    prof = ensure_profile(cfg, tiny_models, show_progress=False)
    assert len(calls) == 2 and load_profile(cfg) == prof and prof.worst_dispersion < 0.05
    assert "timing again" in capsys.readouterr().err


def test_task_calibrate_reports_a_profile_it_did_not_cache(run_config, cache, monkeypatch, tmp_path):
    _script(monkeypatch, SLOW_FIRST_HALF)
    res = calibrate(run_config(*SMALL, "task=calibrate"), tmp_path / "run", show_progress=False)
    assert res.metrics["profile_cached"] is False and "scattered" in res.metrics["not_cached_reason"]
    assert res.metrics["timing_dispersion"] == res.profile.worst_dispersion > 1.0
    assert not res.path.exists() and (tmp_path / "run" / "profile.json").is_file()


SHAPES = (("loop", [1] * 4, 4, 0.8), ("chain1", [1], 1, 0.35), ("star8", [1], 8, 0.42),  # the loop's draft
          ("fan4", [1, 4], 8, 0.6), ("fan2", [1, 2], 4, 0.5),  # per tree shape
          ("wide", [1, 2, 4, 8, 1], 31, 1.61))


def _cached(cfg, t1: float, created: str = "2024-01-01T00:00:00+00:00") -> Profile:
    """A profile of ``cfg`` with t(1) = ``t1`` saved in the cache (ratios as a real one has)."""
    ratios = {1: 1.0, 2: 1.02, 4: 1.05, 5: 1.06, 8: 1.1}
    prof = Profile((0.0, 0.7, 0.1, 0.1, 0.1), (0.7, 0.6, 0.5), t1, ratios, 0.2, "random_tiny", "draft_model",
                   "code", "cpu:test", "float32", 3, 50, created,
                   key=calibrate_module.profile_key(cfg), verify_overhead_ratio=0.1,
                   timing_dispersion={"t1": 0.02},
                   extra={"verify_step_ratios": {"0": 0.02, "8": 0.05},
                          "loop_verify_sizes": {"5": 40},  # as a current calibration has
                          "loop_verify_wide": {"32": 2.0},
                          "rank_runs": [[[0, 0, -1, 0]]],  # (greedy: each root's accepted rank)
                          "draft_shape_ratios": [{"shape": s, "levels": len(fed), "nodes": n, "fed": fed,
                                                  "ratio": r} for s, fed, n, r in SHAPES]})
    save_profile(prof, profile_path(cfg))
    return prof


def test_t1_tolerance_is_symmetric():
    bound = 1 + T1_TOLERANCE
    assert not t1_disagrees(1.0, 1.0)
    assert not t1_disagrees(bound * 0.99, 1.0) and not t1_disagrees(1.0, bound * 0.99)
    assert t1_disagrees(bound * 1.01, 1.0) and t1_disagrees(1.0, bound * 1.01)


def test_judge_profile_re_anchors_a_stale_profile_and_marks_it(run_config, cache, capsys):
    cfg = profile_config(run_config(*SMALL))
    prof = _cached(cfg, t1=10e-3)  # calibrated on a busy machine
    steps = [2.3e-3, 2.5e-3, 2.4e-3]  # this run's own autoregressive step, prompt by prompt
    used, out = judge_profile(prof, profile_path(cfg), steps)
    assert out["profile_stale"] is True and out["prediction_t1_source"] == "run"
    assert out["run_t1_s"] == 2.4e-3 and out["profile_t1_ratio"] == pytest.approx(10 / 2.4)
    assert out["timing_dispersion"] == 0.02 and out["run_t1_dispersion"] > 0
    assert used == prof.with_t1(2.4e-3) and used.draft_time_s == pytest.approx(0.2 * 2.4e-3)
    assert "stale" in capsys.readouterr().err
    cached = load_profile(cfg)
    assert "4.17x" in cached.stale and dataclasses.replace(cached, stale="") == prof


def test_judge_profile_keeps_a_fresh_profile(run_config, cache):
    cfg = profile_config(run_config(*SMALL))
    prof = _cached(cfg, t1=2.6e-3)
    before = profile_path(cfg).read_text()
    used, out = judge_profile(prof, profile_path(cfg), [2.4e-3, 2.3e-3, 2.2e-3])
    assert used == prof and out["profile_stale"] is False and out["prediction_t1_source"] == "profile"
    assert profile_path(cfg).read_text() == before


def test_mark_stale_leaves_a_newer_profile_alone(run_config, cache):
    """Another run re-measured the profile after this one read it: the new one is not marked."""
    cfg = profile_config(run_config(*SMALL))
    old = _cached(cfg, t1=10e-3, created="2024-01-01T00:00:00+00:00")
    _cached(cfg, t1=2.4e-3, created="2024-01-02T00:00:00+00:00")
    assert mark_stale(profile_path(cfg), old, "busy") is False and load_profile(cfg).stale == ""


def test_ensure_profile_measures_a_stale_profile_again(run_config, tiny_models, cache, monkeypatch, capsys):
    calls = _script(monkeypatch, QUIET)
    cfg = profile_config(run_config(*SMALL))
    prof = _cached(cfg, t1=10e-3)
    assert ensure_profile(cfg, tiny_models) == prof and not calls  # fresh: from the cache
    mark_stale(profile_path(cfg), prof, "its t(1) was 4x a run's")
    new = ensure_profile(cfg, tiny_models, show_progress=False)
    assert len(calls) == 1 and new.stale == "" and new.t_ar_s == pytest.approx(1e-3)
    assert load_profile(cfg) == new and "stale: its t(1) was 4x" in capsys.readouterr().err


def test_measure_predicts_with_its_own_t1_when_the_profile_is_stale(run_config, cache, capsys):
    """A profile calibrated on a (scripted) 1000x slower machine: the run reports it, predicts with its own
    t(1) and the profile's ratios (the speedup does not depend on t(1), the step time does), and marks it."""
    cfg = run_config(*SMALL, "task=measure", "workload.num_prompts=2", "workload.max_new_tokens=8",
                     "warmup=0", "tree=chain", "tree.gamma=4")
    pcfg = profile_config(cfg)
    prof = _cached(pcfg, t1=1000.0)
    m = measure(cfg, show_progress=False).metrics
    assert m["profile_stale"] is True and m["prediction_t1_source"] == "run"
    assert m["profile_t1_ratio"] == pytest.approx(1000.0 / m["run_t1_s"]) and m["profile_t1_ratio"] > 1e3
    assert m["timing_dispersion"] == 0.02 and "run_t1_dispersion" in m
    here, _ = tree_predictions(cfg, prof.with_t1(m["run_t1_s"]), Tree.chain(4))
    assert m["predicted_t_step_s_this_device"] == pytest.approx(here["t_step_s"])
    as_profiled, _ = tree_predictions(cfg, prof, Tree.chain(4))
    assert m["predicted_speedup"] == pytest.approx(as_profiled["predicted_speedup"])
    assert load_profile(pcfg).stale and "profile is stale" in capsys.readouterr().err
    json.dumps(m)


def test_a_cached_only_run_never_calibrates(run_config, tiny_models, cache, monkeypatch):
    """calibration.cached_only (analysis.validation insample): no profile cached → NotCalibrating, nothing
    measured; a stale mark is no reason to measure (t(1) only: each run re-anchors it on its own baseline)."""
    from methods.measurement.profiles import NotCalibrating

    calls = _script(monkeypatch, QUIET)
    cfg = profile_config(run_config(*SMALL, "calibration.cached_only=true"))
    with pytest.raises(NotCalibrating, match="no profile yet"):
        ensure_profile(cfg, tiny_models, show_progress=False)
    assert not calls and not profile_path(cfg).exists()
    prof = _cached(cfg, t1=10e-3)
    mark_stale(profile_path(cfg), prof, "its t(1) was 4x a run's")
    served = ensure_profile(cfg, tiny_models, show_progress=False)
    assert not calls and served.stale and dataclasses.replace(served, stale="") == prof
