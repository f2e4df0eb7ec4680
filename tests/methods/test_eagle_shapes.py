"""EAGLE-2's dynamic trees are priced from the trees its drafter keeps on the calibration split (recorded
once, cached beside the profile), not from the run's own prompts (methods.measurement.dynamic_shapes)."""

from __future__ import annotations

import pytest

from methods.data import workloads
from methods.measurement import dynamic_shapes
from methods.measurement.dynamic_shapes import ensure_shapes, from_json, nodes_per_depth, to_json
from methods.measurement.profiles import profile_config
from methods.models import load_models
from specsim.io import read_json
from specsim.replay import lengths_law
from specsim.tree import Tree
from specsim.trees import kept_acceptance, recorded_law

SMALL = ("model=random_tiny", "method=eagle2", "method.params.head=random", "tree=dynamic",
         "tree.total_tokens=5", "tree.depth=3", "tree.top_k=2", "workload.num_prompts=2",
         "workload.prompt_tokens=24", "workload.max_new_tokens=10", "warmup=1", "calibration.prompts=2",
         "calibration.new_tokens=8", "calibration.depth_prompts=1", "calibration.reps=2",
         "calibration.max_reps=0", "calibration.warmup=1", "calibration.width=4", "tree.budgets=[1,2,4,8]")


def test_shapes_are_recorded_on_the_calibration_split_and_cached(run_config, cache, monkeypatch):
    cfg = run_config("task=measure", *SMALL)
    models = load_models(cfg.model, cfg.device, cfg.model.dtype)
    splits = []
    real = workloads.load_prompts  # calibration_prompts draws through it

    def spy(w, tokenizer, seed):
        splits.append((w.split, w.num_prompts, w.max_new_tokens))
        return real(w, tokenizer, seed)

    monkeypatch.setattr(workloads, "load_prompts", spy)
    shapes, path = ensure_shapes(cfg, profile_config(cfg), models, show_progress=False)
    # the calibration prompts, as long as the workload's generations
    assert splits == [("calibration", 2, 10)]
    assert path.is_file() and path.parent == cache / "profiles"
    assert shapes and all(t.size <= 6 and t.depth <= 3 and t.width <= 2 for t in shapes)
    doc = read_json(path)
    assert doc["steps"] == sum(shapes.values()) and doc["nodes_per_depth"] == nodes_per_depth(shapes)
    assert sum(doc["nodes_per_depth"]) == pytest.approx(sum(c * (t.size - 1) for t, c in shapes.items())
                                                        / sum(shapes.values()))
    # with the kept nodes' outcomes (tried, accepted per depth × rank), which price the trees
    tried, accepted = doc["kept"]
    assert len(tried) == 3 and len(tried[0]) == 2 and sum(map(sum, accepted)) <= sum(map(sum, tried))
    assert shapes.acceptance == kept_acceptance(tried, accepted)
    assert doc["draft_scale"] is None and shapes.draft_scale is None  # no loop chain given: not timed
    # with the loop's own accepted lengths per prompt and step: its law of τ on the steady steps prices τ
    assert len(doc["loop_lengths"]) == 2 and doc["loop_depth"] == 3
    law = lengths_law(doc["loop_lengths"], 10, 3)
    assert shapes.loop == pytest.approx(tuple(law))
    assert recorded_law(shapes, [0.0, 1.0, 0.0]) == pytest.approx(law)

    def fail(*a, **k):
        raise AssertionError("recorded again")

    monkeypatch.setattr(dynamic_shapes, "record_shapes", fail)
    again, same = ensure_shapes(cfg, profile_config(cfg), models, show_progress=False)
    assert again == shapes and same == path  # the cache, read back exactly
    other = run_config("task=measure", *SMALL, "tree.total_tokens=4")  # another tree: another file
    assert dynamic_shapes.shapes_path(profile_config(other), other.tree) != path
    with pytest.raises(AssertionError, match="recorded again"):
        ensure_shapes(other, profile_config(other), models, show_progress=False)
    with pytest.raises(AssertionError, match="recorded again"):  # a scale against a chain: its own file
        ensure_shapes(cfg, profile_config(cfg), models, show_progress=False, chain_depth=2)


def test_the_dynamic_draft_is_timed_against_the_loops_chain(run_config, cache):
    """With the profile's loop chain depth the record carries the dynamic drafter's loop draft per step over
    that chain's (interleaved decodes of the calibration prompts), read back as RecordedTrees.draft_scale."""
    cfg = run_config("task=measure", *SMALL)
    models = load_models(cfg.model, cfg.device, cfg.model.dtype)
    shapes, path = ensure_shapes(cfg, profile_config(cfg), models, show_progress=False, chain_depth=2)
    doc = read_json(path)
    assert doc["draft_scale_depth"] == 2 and doc["draft_scale"] > 0 and path.name.endswith("-c2.json")
    assert shapes.draft_scale == (doc["draft_scale"], 2)
    again, _ = ensure_shapes(cfg, profile_config(cfg), models, show_progress=False, chain_depth=2)
    assert again == shapes


def test_shapes_round_trip_with_ranks():
    wide, deep = Tree.from_paths([[0], [1], [2]]), Tree.from_parents([-1, 0, 1, 0], [0, 0, 0, 1])
    shapes = {wide: 3, deep: 1}
    assert from_json(to_json(shapes)) == shapes
    assert nodes_per_depth(shapes) == [(3 * 3 + 2) / 4, 1 / 4]


@pytest.mark.slow
def test_measure_prices_the_calibration_trees_and_reports_its_own(run_config, cache, monkeypatch):
    """predicted_tau is the calibration trees' mixture under the profile; the run's own kept trees are only
    a diagnostic (predicted_tau_in_run_trees)."""
    from methods.measurement import cost_table
    from methods.measurement.measure import measure
    from methods.measurement.profiles import Profile, dynamic_tree_for, tree_predictions

    # the profile is read back from its file below: cached whatever the machine's load (a busy machine's
    # scattered timings left it uncached, and this test failed about every other run)
    monkeypatch.setattr(cost_table, "MAX_TIMING_DISPERSION", float("inf"))

    cfg = run_config("task=measure", *SMALL)
    m = measure(cfg, show_progress=False).metrics
    assert m["greedy_equal_rate"] == 1.0
    assert m["dynamic_tree_pricing"] == "calibration_trees"
    shapes = dynamic_shapes.recorded(read_json(m["dynamic_shapes_path"]))  # priced with the kept nodes' rates
    assert m["dynamic_nodes_per_depth_calibration"] == nodes_per_depth(shapes)
    profile = Profile.from_json(read_json(m["profile_path"]))
    here = tree_predictions(cfg, profile, dynamic_tree_for(cfg, profile), shapes)[0]
    assert m["predicted_tau"] == pytest.approx(here["predicted_tau"])
    static = tree_predictions(cfg, profile, dynamic_tree_for(cfg, profile), dict(shapes))[0]  # former pricing
    assert "predicted_tau_kept_static_vectors" in m
    assert m["predicted_tau_kept_static_vectors"] == pytest.approx(static["predicted_tau"])
    assert m["predicted_tau_in_run_trees"] >= 1.0 and len(m["dynamic_nodes_per_depth"]) >= 1


@pytest.mark.parametrize("batch", [1, 2])
def test_the_warm_up_is_not_in_the_runs_recorded_trees(run_config, cache, batch):
    """measure's warm-up decodes (a batch: B copies of the warm prompt) are left out of the trees the drafter
    records in the run (its shapes, mean tree size): greedy, the measured prompts' trees are the same with
    and without a warm-up."""
    from methods.measurement.measure import measure

    runs = [measure(run_config("task=measure", *SMALL, f"warmup={w}", f"workload.batch_size={batch}"),
                    show_progress=False).metrics for w in (0, 2)]
    keys = ("dynamic_trees_recorded", "dynamic_mean_tree_size", "dynamic_nodes_per_depth")
    assert runs[0]["dynamic_trees_recorded"] > 0
    assert [runs[0][k] for k in keys] == [runs[1][k] for k in keys]
    assert runs[0]["n_target_forwards"] == runs[1]["n_target_forwards"]


def test_a_cached_only_run_records_no_trees(run_config, cache, monkeypatch):
    """calibration.cached_only (analysis.validation insample): trees not recorded for this run's tokens →
    NotCalibrating, nothing decoded."""
    from methods.measurement.profiles import NotCalibrating

    monkeypatch.setattr(dynamic_shapes, "record_shapes", lambda *a, **k: pytest.fail("recorded"))
    cfg = run_config("task=measure", *SMALL, "calibration.cached_only=true")
    with pytest.raises(NotCalibrating, match="no dynamic trees"):
        ensure_shapes(cfg, profile_config(cfg), None, show_progress=False)
