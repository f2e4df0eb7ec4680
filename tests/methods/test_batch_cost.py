"""methods.measurement.batch_cost: t(B, n) timed on the batched engine, fitted, stored and read back."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from methods.measurement import batch_cost
from specsim.batch import BATCH_FIT_FORMAT, BatchCostModel, BatchFit
from specsim.cost import MeasuredCost
from specsim.tree import Tree


def test_time_grid_times_every_cell_and_the_fit_round_trips(tiny_target, tmp_path, run_config):
    # real timings of a tiny model: only that every cell has one, positive, is asserted
    grid = batch_cost.time_grid(tiny_target, [1, 2, 3], [1, 2, 4], [8, 16], reps=1, warmup=0)
    assert set(grid) == {(b, n, c) for b in (1, 2, 3) for n in (1, 2, 4) for c in (8, 16)}
    assert all(t > 0 for t in grid.values())
    cfg = run_config("model=micro", "threads=1", "device=cpu")
    fit, got, path = batch_cost.calibrate_batch(cfg, tiny_target, [8, 16], [1, 2, 3], [1, 2, 4], reps=1,
                                                warmup=0, cache=tmp_path)
    assert path.parent == tmp_path / "profiles" and set(got) == set(grid)
    assert batch_cost.load_batch_fit(cfg, tmp_path) == fit
    assert fit.context_tokens == 8 and fit.rel_error_max >= fit.rel_error_median >= 0


def test_the_fit_is_keyed_by_the_target_not_the_drafter(run_config, tmp_path):
    a = run_config("model=micro", "method=vanilla", "threads=1", "device=cpu")
    b = run_config("model=micro", "method=prompt_lookup", "workload=grounded", "threads=1", "device=cpu")
    c = run_config("model=micro", "model.dtype=bfloat16", "threads=1", "device=cpu")
    assert batch_cost.batch_key(a) == batch_cost.batch_key(b) != batch_cost.batch_key(c)


def test_the_draft_models_fit_is_stored_beside_the_targets(run_config, tmp_path):
    """role="draft": the draft model's own t(B, n), another file; each role reads back only its own."""
    cfg = run_config("model=micro", "threads=1", "device=cpu")
    assert batch_cost.batch_key(cfg, "draft") != batch_cost.batch_key(cfg)
    draft = BatchFit(1e-4, 1e-4, 0.0, 1e-6, 0.0, 16)
    path = batch_cost.batch_profile_path(cfg, tmp_path, "draft")
    batch_cost.save_batch_fit(draft, path, {(1, 1, 16): 2e-4})
    assert batch_cost.load_batch_fit(cfg, tmp_path, "draft") == draft
    assert batch_cost.load_batch_fit(cfg, tmp_path) is None
    with pytest.raises(AssertionError):
        batch_cost.batch_key(cfg, "verifier")


def test_a_fit_of_another_format_is_not_read(run_config, tmp_path):
    cfg = run_config("model=micro", "threads=1", "device=cpu")
    fit = BatchFit(1e-3, 1e-3, 0.0, 1e-5, 0.0, 16)
    path = batch_cost.save_batch_fit(fit, batch_cost.batch_profile_path(cfg, tmp_path), {(1, 1, 16): 2e-3})
    assert batch_cost.load_batch_fit(cfg, tmp_path) == fit
    doc = path.read_text().replace(f'"format": {BATCH_FIT_FORMAT}', f'"format": {BATCH_FIT_FORMAT + 1}')
    path.write_text(doc)
    assert batch_cost.load_batch_fit(cfg, tmp_path) is None
    path.write_text("{not json")
    assert batch_cost.load_batch_fit(cfg, tmp_path) is None


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(BatchFit)][:5])
def test_every_fit_term_is_a_physical_time(field):
    fit = BatchFit(1e-3, 2e-3, 1e-8, 1e-5, 1e-9, 100, form="sum")
    bigger = dataclasses.replace(fit, **{field: getattr(fit, field) * 2})
    assert bigger.time(4, 8) > fit.time(4, 8)  # each of the five terms adds time


def test_fit_loop_recovers_a_line_and_never_goes_negative():
    assert batch_cost.fit_loop({1: 3e-4, 2: 4e-4, 8: 1e-3}) == pytest.approx((2e-4, 1e-4))
    loop0, row = batch_cost.fit_loop({1: 5e-4, 4: 4e-4, 16: 3e-4})  # falling: a constant
    assert row == 0.0 and loop0 == pytest.approx(4e-4)
    loop0, row = batch_cost.fit_loop({2: 1e-4, 4: 5e-4, 8: 13e-4})  # a negative intercept: through 0
    assert loop0 == 0.0 and row > 0
    assert batch_cost.fit_loop({4: -1e-4, 8: -2e-4}) == (0.0, 0.0)


def test_the_loops_time_outside_the_forwards_is_timed_and_stored(tiny_models, tmp_path, run_config):
    """Real timings of a tiny model through the batched loop: only that each B has one, and that the fit
    carries it, is asserted. The draft's: the loop's speculative step beyond the AR step and the draft's
    forwards at the fit's price, each of its parts timed."""
    from methods.core.sampling import SamplingParams
    from methods.drafters.registry import build_drafter

    ar = batch_cost.time_ar_loop(tiny_models.target, [1, 2], 8, steps=3, reps=1)
    loop = {b: s.outside_s for b, s in ar.items()}
    assert set(loop) == {1, 2} and all(t > 0 for t in loop.values())
    cfg = run_config("model=micro", "threads=1", "device=cpu")
    fit, _, path = batch_cost.calibrate_batch(cfg, tiny_models.target, [8], [1, 2, 3], [1, 2, 4], reps=1,
                                              warmup=0, cache=tmp_path)
    assert fit.loop0 + fit.loop_row > 0 and batch_cost.load_batch_fit(cfg, tmp_path) == fit
    drafter = build_drafter(cfg.method, Tree.chain(2), tiny_models, SamplingParams(0.0))
    draft_loop = batch_cost.time_draft_loop(tiny_models.target, drafter, fit, [1, 2], 8, steps=3, reps=1)
    assert set(draft_loop) == {1, 2}
    for s in draft_loop.values():  # the draft's forwards were timed in the loop and priced by the fit
        assert s.forwards_s > 0 and s.grid_s > 0 and s.outside_s > s.draft_s > 0 and np.isfinite(s.beyond_s)
    dfit, _, dpath = batch_cost.calibrate_batch(cfg, tiny_models.draft, [8], [1, 2, 3], [1, 2, 4], reps=1,
                                                warmup=0, cache=tmp_path, role="draft",
                                                target=tiny_models.target, drafter=drafter)
    assert batch_cost.load_batch_fit(cfg, tmp_path, "draft") == dfit
    doc = json.loads(dpath.read_text())
    assert [row[0] for row in doc["draft_loop"]] == [1, 2, 3] and all(len(r) == 10 for r in doc["draft_loop"])


def _run(steps: int, outside_ms: float, draft_ms: float, forward_ms: float = 5.0) -> SimpleNamespace:
    """A BatchResult's timers for ``steps`` steps of these per-step milliseconds (prefill 10 ms)."""
    ms = 1e-3 * steps
    return SimpleNamespace(n_steps=steps, time_prefill_s=0.01, time_forward_s=forward_ms * ms,
                           time_draft_s=draft_ms * ms, time_total_s=0.01 + (forward_ms + outside_ms) * ms)


def test_the_draft_fits_loop_terms_carry_what_the_speculative_step_costs_beyond_the_grid(run_config):
    """The loop's speculative step outside its target forward is the autoregressive step's outside + the
    draft's forwards at the grid's price + beyond_s: beyond_s takes the forwards' excess over the grid (the
    first after a target forward: evicted caches) and the verification beyond the AR step's, which the
    draft step's host time alone (the former loop terms) left out; priced with it, the model reads the
    loop's step back at every B."""
    forwards_ms = {b: 1.8 + 0.16 * b for b in (2, 8, 32)}  # the loop's draft forwards: above the grid's price
    grid_ms = {2: 1.6, 8: 2.0, 32: 3.2}
    steps = {}
    for b in forwards_ms:
        ar = [_run(64, 0.1 + 0.01 * b, 0.05)]
        spec = [_run(20, 0.5 + 0.05 * b + forwards_ms[b] + 0.3 + 0.02 * b, 0.5 + forwards_ms[b])]
        steps[b] = batch_cost.DraftLoopStep.of(spec, ar, [(forwards_ms[b] * 20e-3, grid_ms[b] * 20e-3)])
    s = steps[32]
    assert s.forwards_s == pytest.approx(6.92e-3) and s.grid_s == pytest.approx(3.2e-3)
    assert s.verify_forward_s == pytest.approx(5e-3)  # the target's forward, not in the step's outside
    assert s.host_s == pytest.approx(0.45e-3)  # the draft timer less its forwards and the AR step's
    assert s.verify_s == pytest.approx((0.3 + 0.07 * 32 - 0.05 - 0.01 * 32) * 1e-3)
    assert s.beyond_s == pytest.approx(s.outside_s - s.ar_outside_s - s.grid_s)
    assert s.beyond_s == pytest.approx(s.host_s + (s.forwards_s - s.grid_s) + s.verify_s)
    # the model: a chain of 4 (catch-up + 3 levels = 4 forwards of 1 token: the grid's price above)
    cfg = run_config("model=zoo", "hardware=cpu", "method=vanilla", "tree=chain", "tree.gamma=4",
                     "workload.context_tokens=160")
    draft = BatchFit(0.0, 0.0, 0.0, 1e-5, 0.0, 160, "sum")
    steps = {b: dataclasses.replace(s, grid_s=4 * float(draft.time(b, 1))) for b, s in steps.items()}
    target = BatchFit(4e-3, 0.0, 1e-8, 1e-4, 0.0, 160, "sum", loop0=0.1e-3, loop_row=0.01e-3)
    draft = batch_cost.with_loop(draft, {b: s.beyond_s for b, s in steps.items()})
    cost = BatchCostModel.from_config(cfg, MeasuredCost((1, 5), (3e-3, 3.2e-3)), target, draft)
    tree = Tree.chain(4)
    for b, s in steps.items():
        at = cost.at(b)
        outside = at.step_time(tree) - float(target.time(b, tree.size))
        assert outside == pytest.approx(s.outside_s, rel=1e-6)


def test_with_ar_fits_the_loops_one_token_forward_at_its_context():
    steps = {b: batch_cost.LoopStep(1e-4, 2e-3 + 3e-4 * b, 135.5) for b in (1, 2, 4, 8)}
    fit = batch_cost.with_ar(BatchFit(1e-3, 1e-3, 1e-9, 1e-5, 0.0, 160), steps)
    assert (fit.ar0, fit.ar_row, fit.ar_context) == pytest.approx((2e-3, 3e-4, 135.5))
    assert fit.time(8, 1, 135.5) == pytest.approx(2e-3 + 8 * 3e-4)
    assert batch_cost.with_ar(fit, {}) == fit


def test_the_loops_one_token_forward_is_timed_and_prices_the_fit(tiny_models, tmp_path, run_config):
    """Real timings of a tiny model: each B has a forward and a time outside it, at the prompts' context
    plus half the steps; calibrate_batch's fit prices n = 1 from them and keeps them beside the grid."""
    ar = batch_cost.time_ar_loop(tiny_models.target, [1, 2], 8, steps=3, reps=1)
    assert set(ar) == {1, 2} and all(s.forward_s > 0 and s.outside_s > 0 for s in ar.values())
    assert all(s.context == pytest.approx(9.0) for s in ar.values())  # 8 cached, then 9, 10
    cfg = run_config("model=micro", "threads=1", "device=cpu")
    fit, _, path = batch_cost.calibrate_batch(cfg, tiny_models.target, [8], [1, 2, 3], [1, 2, 4], reps=1,
                                              warmup=0, cache=tmp_path)
    assert fit.ar_context == pytest.approx(8 + 7.5) and fit.ar0 + fit.ar_row > 0  # 16 steps
    assert batch_cost.load_batch_fit(cfg, tmp_path) == fit
    doc = json.loads(path.read_text())
    assert [row[0] for row in doc["loop_forward"]] == [1, 2, 3]


def test_time_consecutive_times_each_forward_of_a_run(tiny_target):
    times = batch_cost.time_consecutive(tiny_target, 2, 8, k=3, rounds=2)
    assert len(times) == 3 and all(t > 0 for t in times)


def test_time_consecutive_runs_the_draft_model_after_the_targets_forward(tiny_models):
    """--draft-check's order: a (γ + 1)-token forward of the target, then the draft model's forwards."""
    times = batch_cost.time_consecutive(tiny_models.draft, 2, 8, k=2, rounds=1, before=tiny_models.target,
                                        before_n=3)
    assert len(times) == 2 and all(t > 0 for t in times)


def test_the_calibration_loop_runs_across_the_grids_contexts():
    assert batch_cost.loop_steps([128, 192]) == 64  # the code workload: prompt 128, 64 new tokens
    assert batch_cost.loop_steps([128]) == 16 and batch_cost.loop_steps([8, 12]) == 16


def test_the_ar_step_is_read_at_the_speculative_steps_active_rows():
    """A static batch's speculative rows finish steps apart (its steps ran ~22 rows of 32 on the zoo), the
    AR rows together: what the speculative step costs beyond the AR step is taken at the rows it ran, on
    the AR steps' line over B, and the loop terms are a law over those rows."""
    steps = {}
    for b, rows in ((2, 1.8), (8, 6.0), (32, 22.0)):
        ar = [SimpleNamespace(**vars(_run(64, 0.1 + 0.01 * b, 0.05)), row_steps=64 * b)]
        spec = [SimpleNamespace(**vars(_run(20, 0.5 + 0.04 * rows, 0.3)), row_steps=round(20 * rows))]
        steps[b] = batch_cost.DraftLoopStep.of(spec, ar)
    assert [s.rows for s in steps.values()] == pytest.approx([1.8, 6.0, 22.0])
    assert all(s.beyond_s == pytest.approx(s.outside_s - s.ar_outside_s) for s in steps.values())  # not yet
    read = batch_cost.at_rows(steps)
    for s in read.values():
        assert s.ar_rows_s == pytest.approx((0.1 + 0.01 * s.rows) * 1e-3)
        assert s.beyond_s == pytest.approx((0.4 + 0.03 * s.rows) * 1e-3)  # the drafter's own, at its rows
    terms = batch_cost.loop_terms(read)
    assert sorted(terms) == pytest.approx([1.8, 6.0, 22.0])
    assert batch_cost.fit_loop(terms) == pytest.approx((0.4e-3, 0.03e-3))
    # read at B (the former accounting) the per-row term comes out wrong
    at_b = batch_cost.fit_loop({b: s.beyond_s for b, s in steps.items()})
    assert at_b[1] != pytest.approx(0.03e-3, rel=0.1)


def test_calibrate_head_times_a_head_drafter_in_the_loop_and_stores_its_line(tiny_models, tmp_path,
                                                                              run_config):
    """Real timings of a tiny EAGLE head (random) through the batched loop on prompts: each B has its
    step beyond the AR step at its active rows; the line is stored under the method's own key and read
    back (format and key checked)."""
    from methods.core.sampling import SamplingParams
    from methods.drafters.registry import build_drafter
    from specsim.config import MethodConfig

    tree = Tree.from_parents([-1, 0, 0, 1, 3])
    drafter = build_drafter(MethodConfig(name="eagle", drafter="eagle", params={"head": "random"}), tree,
                            tiny_models, SamplingParams(0.0))
    g = torch.Generator().manual_seed(3)
    texts = [torch.randint(0, 300, (n,), generator=g) for n in (9, 6, 12)]
    cfg = run_config("model=micro", "threads=1", "device=cpu", "method=eagle")
    fit, runs, path = batch_cost.calibrate_head(cfg, tiny_models.target, drafter, tree.depth, texts,
                                                [1, 2, 3], steps=6, reps=1, cache=tmp_path)
    assert set(runs) == {1, 2, 3} and fit.levels == 3
    assert all(0 < s.rows <= b and s.outside_s > 0 and np.isfinite(s.beyond_s) for b, s in runs.items())
    assert batch_cost.load_head_fit(cfg, tmp_path) == fit
    assert path.name.startswith("batch-head-eagle-") and batch_cost.load_batch_fit(cfg, tmp_path) is None
    other = run_config("model=micro", "threads=1", "device=cpu", "method=mtp")
    assert batch_cost.batch_key(other, "head") != batch_cost.batch_key(cfg, "head")
    assert batch_cost.load_head_fit(other, tmp_path) is None
    doc = json.loads(path.read_text())
    assert doc["format"] == BATCH_FIT_FORMAT
    path.write_text(json.dumps({**doc, "format": BATCH_FIT_FORMAT - 1}))
    assert batch_cost.load_head_fit(cfg, tmp_path) is None


def test_a_dynamic_trees_head_step_is_timed_over_its_expansions_levels(run_config):
    """EAGLE-2's head runs every level of its expansion (tree.depth) whatever the depth of the tree it keeps
    or of its static budget tree (the zoo's 8/4/2: 3 levels): its head line is timed over tree.depth levels
    and so prices the draft at B as timed; over the budget tree's depth it would read 4/3 of it."""
    from specsim.batch import BatchCostModel, BatchFit, HeadFit
    from specsim.cost import MeasuredCost

    cfg = run_config("model=zoo", "hardware=cpu", "method=eagle2", "tree=dynamic", "tree.total_tokens=8",
                     "tree.depth=4", "tree.top_k=2")
    budget = Tree.from_parents([-1, 0, 0, 1, 1, 2, 2, 3, 3])  # 9 nodes, 3 levels (the k-ary tree cut)
    assert budget.depth == 3 and batch_cost.head_levels(cfg, budget) == 4
    static = run_config("model=zoo", "method=eagle", "tree=chain", "tree.gamma=3")
    assert batch_cost.head_levels(static, Tree.chain(3)) == 3
    head = HeadFit(2e-3, 5e-4, batch_cost.head_levels(cfg, budget))
    fit = BatchFit(2e-3, 0.0, 1e-8, 4e-4, 0.0, 160, "sum", loop0=2e-4, loop_row=3e-5)
    cost = BatchCostModel.from_config(cfg, MeasuredCost((1, 9), (3e-3, 3.6e-3)), fit, head_fit=head)
    assert cost.at(4).draft_time(budget) == pytest.approx(head.time(4))
