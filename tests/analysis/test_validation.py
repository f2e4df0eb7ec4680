"""analysis.validation*: the sweep's rows (invalid combinations left out), the error and summary math, the
term attribution of a speedup miss, the driver's resume and failure handling, and the report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import validation_rows as vr
from analysis.validation_terms import (
    TERMS,
    errors,
    steady_lengths,
    summary,
    tau_prompt_standard_error,
    tau_standard_error,
    term_contributions,
)

REPO = Path(__file__).resolve().parents[2]


# ---- rows -----------------------------------------------------------------------------------------------
def test_every_method_with_a_real_drafter_has_rows():
    import run

    real = {m for m, d in run.method_drafters().items() if d in _registry_names()}
    # presets that are variants of a swept method (same drafter and tree family) need no rows of their own
    variants = {"lookahead_large", "medusa_typical"}
    assert real - variants <= set(vr.TREES), sorted(real - variants - set(vr.TREES))
    assert {r.method for r in vr.rows()} == set(vr.TREES)


def _registry_names() -> set[str]:
    from methods.drafters import registry

    return set(registry.names())


def test_rows_leave_the_excluded_combinations_out():
    rows = vr.rows()
    pairs = {(r.method, "sequoia" if r.tree.startswith("sequoia") else r.tree) for r in rows}
    assert not pairs & set(vr.EXCLUDED)
    assert ("prompt_lookup", "sequoia") in vr.EXCLUDED and vr.excluded("prompt_lookup", "sequoia32")
    assert vr.excluded("medusa", "sequoia8") is None
    assert len({r.row_id for r in rows}) == len(rows)  # one dir per row


def test_no_row_at_temperature_one_reads_q_of_a_deterministic_drafter():
    deterministic = {"prompt_lookup", "lookahead", "staged"}
    for r in vr.rows(temperatures=[1.0]):
        verifier = next(o.split("=")[1] for o in r.overrides if o.startswith("method.verifier="))
        assert verifier != "greedy"  # greedy is not lossless at T > 0 (specsim.config rejects it)
        if r.method in deterministic:
            assert verifier == "deterministic", r
        if r.tree == "chain" or r.method in ("vanilla", "online", "layerskip", "draft_verify", "mtp"):
            assert verifier in ("chain", "deterministic"), r  # a branching verifier on a chain is not needed
    assert not any(o.startswith("method.verifier") for r in vr.rows(temperatures=[0.0]) for o in r.overrides)


def test_rows_come_natural_trees_first_then_workloads_then_trees_then_temperature():
    rows = vr.rows()
    first = rows[: len(vr.TREES) + 1]  # sequoia has two natural rows
    assert {r.workload for r in first} == {"code"} and {r.temperature for r in first} == {0.0}
    assert all(r.tree == vr.NATURAL or r.method == "sequoia" for r in first)
    temps = [r.temperature for r in rows]
    assert temps == sorted(temps)
    assert vr.tree_overrides("sequoia32") == ["tree=sequoia", "tree.budgets=[32]"]


def test_every_row_decodes_to_the_same_precision_with_the_small_sweep_kept_small():
    """The sequential rule sets every row's test prompts (no per-method or per-workload counts): the
    experiment's cap and τ standard-error target hold for every row; the small CI sweep switches it off and
    decodes its 2 prompts."""
    import run

    cfg = run.compose_run_config("experiment=validation")
    assert 0 < cfg.workload.tau_se_target <= 0.012 and cfg.workload.num_prompts >= 32
    # the prediction's error: a calibration split at least the test's cap (32 × 48 tokens)
    assert cfg.calibration.prompts * cfg.calibration.new_tokens >= 32 * 48
    # ... over the generation positions the test decodes (acceptance drifts along a greedy generation)
    assert cfg.calibration.new_tokens == cfg.workload.max_new_tokens
    longer = run.compose_run_config("experiment=validation", "workload.max_new_tokens=96")
    assert longer.calibration.new_tokens == 96
    assert not any(o.startswith("workload.num_prompts=") for r in vr.rows() for o in r.overrides)
    row = vr.rows(["vanilla"], extra=vr.SMALL)[0]
    small = run.compose_run_config("experiment=validation", *row.overrides)
    assert small.workload.tau_se_target == 0 and small.workload.num_prompts == 2


@pytest.mark.parametrize("row", vr.rows(temperatures=[0.0, 1.0])[::7], ids=lambda r: r.row_id)
def test_rows_compose_and_validate(row):
    """Every row (a sample of them) is a valid config that run.py accepts before any work."""
    import run

    cfg = run.compose_run_config("experiment=validation", *row.overrides)
    run.check_runnable(cfg)
    assert cfg.method.name == row.method and cfg.workload.temperature == row.temperature


def test_unknown_methods_are_refused():
    with pytest.raises(ValueError, match="nope"):
        vr.rows(["nope"])


def test_row_ids_round_trip():
    r = vr.rows(["medusa"], ["prose"], [1.0])[-1]
    parsed = vr.parse_row_id(r.row_id)
    assert (parsed["method"], parsed["tree"], parsed["workload"], parsed["temperature"]) == \
        (r.method, r.tree, r.workload, r.temperature)
    assert vr.parse_row_id("not_a_row") is None


def test_set_appends_overrides_to_every_row_and_refuses_a_bare_word(capsys):
    """``run --set KEY=VALUE`` (a power study's larger splits) reaches every row's command line, after the
    row's own overrides; a word without '=' is refused before any row runs."""
    from analysis import validation

    assert validation.main(["run", "--full", "--methods", "vanilla", "medusa", "--workloads", "code",
                            "--set", "calibration.prompts=192", "workload.num_prompts=128", "--dry-run"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("excluded:")]
    assert len(lines) == len(vr.rows(["vanilla", "medusa"], ["code"])) > 2
    for ln in lines:
        assert ln.endswith("calibration.prompts=192 workload.num_prompts=128"), ln
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        validation.main(["run", "--full", "--set", "calibration.prompts", "--dry-run"])


# ---- the driver -----------------------------------------------------------------------------------------
def test_driver_skips_done_rows_and_records_failures(tmp_path):
    rows = vr.rows(["vanilla"], ["code"], [0.0])
    done = tmp_path / rows[0].row_id
    done.mkdir()
    metrics = {k: "x" for k in ("task", "method", "tree", "hardware", "workload", "model")} | {"seed": 0}
    (done / "metrics.json").write_text(json.dumps(metrics))
    bad = vr.Row("vanilla", "chain", "code", 0.0, ("method=vanilla", "workload.num_prompts=-1"))
    out = vr.run_rows([*rows, bad], tmp_path, progress=False)
    assert [o.status for o in out] == ["skipped", "failed"]
    assert "num_prompts" in out[1].error
    failed = json.loads((tmp_path / bad.row_id / "failed.json").read_text())
    assert failed["status"] == "failed" and failed["command"][0].endswith("run.py")
    assert not (tmp_path / bad.row_id / vr.CLAIM).exists()


def test_a_failed_rows_error_is_the_exceptions_message_not_run_pys_closing_line():
    stderr = ("calibrating mtp on zoo/prose\nTraceback (most recent call last):\n"
              "  File \"run.py\", line 446\n"
              "ValueError: only 139 usable prompts of this kind in the split (asked for 192)\n"
              "Error: the run failed (ValueError); nothing was written.\n")
    assert vr._last_error(stderr).startswith("ValueError: only 139 usable prompts")
    assert vr._last_error("Error (invalid config): no such tree. Nothing was written.\n").startswith(
        "Error (invalid config)")
    assert vr._last_error("Error: the run failed (OSError); nothing was written.\n").startswith(
        "Error: the run failed")  # nothing better to say


def test_claims_are_exclusive_and_dead_ones_taken_over(tmp_path):
    assert vr.claim(tmp_path / "a")
    assert not vr.claim(tmp_path / "a")  # held by this (live) process
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / vr.CLAIM).write_text(dead)
    assert vr.claim(tmp_path / "b")


# ---- errors, summary, terms -----------------------------------------------------------------------------
def _run(**over) -> dict:
    """A measure run's metrics as measure.py writes them: 10 steps of τ 3 (hist), baseline 0.01 s/token."""
    m = {"status": "ok", "method": "vanilla", "tree": "chain", "workload": "code", "row_tree": "natural",
         "temperature": 0.0, "tree_size": 5,
         "tau": 3.0, "accept_hist": [0, 2, 6, 2, 0], "n_target_forwards": 10, "n_tokens": 30,
         "baseline_n_target_forwards": 30, "baseline_n_tokens": 30,
         "time_total_s": 0.21, "time_prefill_s": 0.01, "time_draft_s": 0.05, "time_verify_s": 0.15,
         "baseline_time_s": 0.32, "baseline_time_prefill_s": 0.02,
         "predicted_tau": 3.0, "predicted_t_ar_s_this_device": 0.01, "predicted_t_draft_s_this_device": 0.005,
         "predicted_t_verify_s_this_device": 0.015}
    m.update(over)
    # measured decode speedup: (30/0.2) / (30/0.3) = 1.5; the prediction's own formula
    m.setdefault("decode_speedup", (m["n_tokens"] / (m["time_total_s"] - m["time_prefill_s"]))
                 / (m["baseline_n_tokens"] / (m["baseline_time_s"] - m["baseline_time_prefill_s"])))
    m.setdefault("speedup", m["decode_speedup"])
    m.setdefault("predicted_speedup", m["predicted_tau"] * m["predicted_t_ar_s_this_device"]
                 / (m["predicted_t_draft_s_this_device"] + m["predicted_t_verify_s_this_device"]))
    return m


def test_a_perfect_prediction_has_no_error_and_no_term():
    t = errors(pd.DataFrame([_run()]))
    assert t.loc[0, "speedup_meas"] == pytest.approx(1.5) and t.loc[0, "speedup_pred"] == pytest.approx(1.5)
    assert t.loc[0, "tau_err"] == pytest.approx(0) and t.loc[0, "speedup_err"] == pytest.approx(0)
    assert t.loc[0, list(TERMS)].abs().max() == pytest.approx(0, abs=1e-12)
    assert t.loc[0, "diagnosis"] == "" and t.loc[0, "tau_ok"] and t.loc[0, "speedup_ok"]
    assert pd.isna(t.loc[0, "dominant_term"])  # nothing moved


@pytest.mark.parametrize(("over", "term"), [
    ({"predicted_tau": 3.6}, "acceptance"),
    ({"predicted_t_draft_s_this_device": 0.0}, "draft"),
    ({"predicted_t_verify_s_this_device": 0.025}, "verify"),
    ({"time_total_s": 0.31}, "overhead"),  # 0.1 s of the loop in neither draft nor verify
    ({"n_tokens": 24}, "truncation"),  # the last steps cut at max_new_tokens
])
def test_a_miss_is_attributed_to_the_term_that_is_wrong(over, term):
    t = errors(pd.DataFrame([_run(**over)]))
    assert abs(t.loc[0, "speedup_err"]) > 0.10
    assert t.loc[0, "dominant_term"] == term
    assert f"mostly {term}" in t.loc[0, "diagnosis"]
    others = [x for x in TERMS if x != term]
    assert t.loc[0, others].abs().max() < 1e-9


def test_the_draft_term_compares_the_runs_mean_step_with_the_runs():
    """The measured draft per forward is the mean over the run's steps, the generation's cut last ones
    included: the prediction's run mean (``predicted_t_draft_run_s``) is what it is compared with, where a
    run recorded it; the full step's draft (older runs' only figure) would read the draft term dear."""
    full = _run(predicted_t_draft_s_this_device=0.006, predicted_decode_speedup=1.5 * 0.02 / 0.021)
    mean = _run(predicted_t_draft_s_this_device=0.006, predicted_t_draft_run_s_this_device=0.005,
                predicted_t_verify_run_s_this_device=0.015, predicted_decode_speedup=1.5)
    t = errors(pd.DataFrame([full, mean]))
    assert t.loc[0, "draft"] < -0.04 and t.loc[0, "dominant_term"] == "draft"
    assert t.loc[1, list(TERMS)].abs().max() < 1e-9 and t.loc[1, "speedup_err"] == pytest.approx(0)
    assert t.loc[1, "t_draft_pred"] == pytest.approx(0.005)


def test_a_machine_slower_than_at_calibration_moves_no_term():
    # every predicted cost 30% above this run's: the same ratios to t(1), the same speedup
    t = errors(pd.DataFrame([_run(predicted_t_ar_s_this_device=0.013, predicted_t_draft_s_this_device=0.0065,
                                  predicted_t_verify_s_this_device=0.0195)])).loc[0]
    assert t["speedup_err"] == pytest.approx(0) and t["load"] == pytest.approx(0.3)
    assert t[list(TERMS)].abs().max() < 1e-9
    assert t[["draft_ratio_log", "verify_ratio_log"]].abs().max() < 1e-9  # the ratios to t(1) held


def test_the_ratio_logs_compare_each_part_to_its_own_sides_t1():
    """A verify 10% dear against t(1) on a machine 30% slower at calibration: verify_ratio_log reads the
    10% alone (not the 30% as well), the draft's reads 0."""
    t = errors(pd.DataFrame([_run(predicted_t_ar_s_this_device=0.013, predicted_t_draft_s_this_device=0.0065,
                                  predicted_t_verify_s_this_device=0.0195 / 1.1)])).loc[0]
    assert t["verify_ratio_log"] == pytest.approx(np.log(1.1))
    assert t["draft_ratio_log"] == pytest.approx(0, abs=1e-12) and t["load"] == pytest.approx(0.3)


def test_a_cost_miss_beside_a_profile_t1_off_the_runs_says_so():
    """A cost-driven miss where the profile's t(1) is more than T1_OFF off the run's own names it (the
    profile's ratios were timed on a machine in another state); an acceptance-driven miss does not."""
    off = errors(pd.DataFrame([_run(predicted_t_ar_s_this_device=0.0085,
                                    predicted_t_draft_s_this_device=0.00425,
                                    predicted_t_verify_s_this_device=0.02)])).loc[0]
    assert off["load"] == pytest.approx(-0.15) and "mostly verify" in off["diagnosis"]
    assert "t(1) -15% off this run's own" in off["diagnosis"]
    near = errors(pd.DataFrame([_run(predicted_t_verify_s_this_device=0.025)])).loc[0]
    assert "off this run's" not in near["diagnosis"]
    tau = errors(pd.DataFrame([_run(predicted_tau=3.6, predicted_t_ar_s_this_device=0.0085,
                                    predicted_t_draft_s_this_device=0.00425,
                                    predicted_t_verify_s_this_device=0.01275)])).loc[0]
    assert "mostly acceptance" in tau["diagnosis"] and "off this run's" not in tau["diagnosis"]


def test_a_predicted_cut_at_max_new_tokens_matches_the_measured_one():
    # the simulator's τ_N (tokens per forward for max_new_tokens) equals the measured 24 tokens / 10 forwards
    run = _run(n_tokens=24, predicted_tokens_per_forward=2.4)
    run["predicted_decode_speedup"] = 2.4 * 0.01 / 0.02
    t = errors(pd.DataFrame([run])).loc[0]
    assert t["speedup_err"] == pytest.approx(0) and t["steady_speedup_pred"] == pytest.approx(1.5)
    assert t[list(TERMS)].abs().max() < 1e-9


def test_the_terms_add_up_to_the_log_error():
    rng = np.random.default_rng(0)
    runs = [_run(predicted_tau=3 * rng.uniform(0.8, 1.2), time_draft_s=0.05 * rng.uniform(0.5, 2),
                 time_total_s=0.25, predicted_t_verify_s_this_device=0.015 * rng.uniform(0.8, 1.5),
                 predicted_t_ar_s_this_device=0.01 * rng.uniform(0.7, 1.3),
                 n_tokens=int(rng.integers(26, 31))) for _ in range(20)]
    df = pd.DataFrame(runs)
    c = term_contributions(df)
    log_err = np.log(df["predicted_speedup"] / df["decode_speedup"])
    assert np.allclose(c[list(TERMS)].sum(axis=1), log_err)
    assert c["residual"].abs().max() < 1e-12


def test_steady_lengths_leave_out_the_steps_the_generations_end_cut():
    # 12 tokens, a tree 4 deep: steps at 12, 9, 6 tokens left draft the whole tree; at 3 and 1 left the loop
    # drafts at most 3 and 1 deep (ctx.max_new), whatever the acceptance
    assert steady_lengths([3, 3, 3, 2, 1], 12, 4) == [3, 3, 3]
    assert steady_lengths([5, 5, 1, 1], 12, 4) == [5, 5]  # 2 left after two steps of 5
    assert steady_lengths([2], 1, 1) == [2]  # room 1 >= depth 1: the whole tree was drafted


def test_tau_is_measured_on_the_steps_the_generations_end_did_not_cut():
    """Two generations of 12 tokens by a chain of 4 accepting 2 drafts a step until the end, whose last steps
    accept at most what is left: the loop's τ reads 24 / 10 = 2.4, the steady-state τ the model predicts
    is 3. The cut is the truncation term's (τ_N = 2.4 predicted), so nothing misses."""
    lengths = [[3, 3, 3, 2, 1], [3, 3, 3, 2, 1]]
    run = _run(tau=2.4, accept_hist=[2, 2, 6], n_tokens=24, n_target_forwards=10, baseline_n_tokens=24,
               baseline_n_target_forwards=24, time_total_s=0.21, baseline_time_s=0.26,
               predicted_tokens_per_forward=2.4, prompt_accepted_lengths=lengths,
               **{"workload.max_new_tokens": 12, "tree_depth": 4})
    run["predicted_decode_speedup"] = 2.4 * 0.01 / 0.02
    t = errors(pd.DataFrame([run])).loc[0]
    assert t["tau_loop"] == pytest.approx(2.4) and t["tau_meas"] == pytest.approx(3.0)
    assert t["tau_err"] == pytest.approx(0) and t["tau_ok"]
    assert t["speedup_err"] == pytest.approx(0) and t[list(TERMS)].abs().max() < 1e-9


def test_tau_standard_error():
    # accepted 1, 2, 3 draft tokens in 2, 6, 2 of 10 steps: mean 2, sample variance 4/9
    assert tau_standard_error([0, 2, 6, 2, 0]) == pytest.approx(math.sqrt(4 / 9 / 10))
    assert math.isnan(tau_standard_error([1])) and math.isnan(tau_standard_error(None))


def test_tau_standard_error_across_prompts():
    """Prompts as the sampled units: two prompts of τ 1 and τ 3 (5 steps each) measure τ 2 ± 1 (their
    difference), far more than the steps' own spread says when τ is a property of the prompt."""
    per_prompt = [[1] * 5, [3] * 5]
    assert tau_prompt_standard_error(per_prompt) == pytest.approx(math.sqrt((25 + 25) / 2) / 5)
    assert math.isnan(tau_prompt_standard_error([[2, 2]])) and math.isnan(tau_prompt_standard_error(None))
    hist = [0, 5, 0, 5]  # the same 10 steps pooled: 5 accepting 0 drafts, 5 accepting 2
    pooled = errors(pd.DataFrame([_run(tau=2.0, accept_hist=hist, predicted_tau=2.8)])).loc[0]
    by_prompt = errors(pd.DataFrame([_run(tau=2.0, accept_hist=hist, predicted_tau=2.8,
                                          prompt_accepted_lengths=per_prompt)])).loc[0]
    assert pooled["tau_se_rel"] == pytest.approx(tau_standard_error(hist) / 2)
    assert by_prompt["tau_se_rel"] == pytest.approx(0.5) and pooled["tau_se_rel"] < 0.2
    assert "acceptance model" in pooled["diagnosis"] and "sampling noise" in by_prompt["diagnosis"]


def test_tau_standard_error_across_modules():
    """Prompts of one source module are alike: four prompts from two modules measure τ as two draws would
    (the report takes the module-wise error where samples.jsonl's prompt ids name the modules)."""
    from analysis.validation_report import prompt_module

    per_prompt = [[1] * 5, [1] * 5, [3] * 5, [3] * 5]
    run = _run(tau=2.0, accept_hist=[0, 10, 0, 10], predicted_tau=2.0, prompt_accepted_lengths=per_prompt)
    by_prompt = errors(pd.DataFrame([run])).loc[0, "tau_se_rel"]
    modules = [prompt_module(p) for p in ("code/a/f@L1", "code/a/g@L9", "code/b/f@L1", "code/b/h@L5")]
    assert modules == ["a", "a", "b", "b"] and prompt_module("no-module") == "no-module"
    by_module = errors(pd.DataFrame([{**run, "prompt_modules": modules}])).loc[0, "tau_se_rel"]
    assert by_prompt == pytest.approx(tau_prompt_standard_error(per_prompt) / 2)
    assert by_module == pytest.approx(tau_prompt_standard_error([[1] * 10, [3] * 10]) / 2)
    assert by_module > by_prompt
    misaligned = errors(pd.DataFrame([{**run, "prompt_modules": modules[:3]}])).loc[0, "tau_se_rel"]
    assert misaligned == pytest.approx(by_prompt)  # modules that do not match the prompts are not used


def test_a_tau_miss_within_sampling_error_is_called_noise():
    noisy = errors(pd.DataFrame([_run(predicted_tau=3.2)])).loc[0]  # s.e. of τ: 0.21/3 = 7%
    assert not noisy["tau_ok"] and "sampling noise" in noisy["diagnosis"]
    wide = errors(pd.DataFrame([_run(predicted_tau=4.0, accept_hist=[0, 0, 100, 0, 0],
                                     n_target_forwards=100)])).loc[0]
    assert "acceptance model" in wide["diagnosis"]


def test_summary_statistics():
    runs = [_run(), _run(predicted_tau=3.06), _run(predicted_tau=3.6),
            _run(predicted_t_draft_s_this_device=0.0)]
    s = summary(errors(pd.DataFrame(runs)))
    assert s["rows"] == 4
    assert s["tau_err_median"] == pytest.approx(0.01) and s["tau_err_max"] == pytest.approx(0.2)
    assert s["share_tau_within_3pct"] == 0.75
    # speedup errors: 0, +2%, +20%, +33%
    assert s["speedup_err_max"] == pytest.approx(1 / 3) and s["speedup_err_median"] == pytest.approx(0.11)
    assert s["share_speedup_within_10pct"] == 0.5 and s["share_both"] == 0.5


def test_the_rows_sharing_a_prompt_draw_are_summarised_together():
    from analysis.validation_terms import draw_table

    runs = [_run(workload="code", predicted_tau=3.06), _run(workload="code", predicted_tau=3.3),
            _run(workload="prose", predicted_tau=2.94), _run(workload="prose", method="autoregressive")]
    d = draw_table(errors(pd.DataFrame(runs)))
    assert d.loc[("code", 0.0), "rows"] == 2 and d.loc[("prose", 0.0), "rows"] == 1  # baselines left out
    assert d.loc[("code", 0.0), "mean τ err"] == pytest.approx(0.06)
    assert d.loc[("code", 0.0), "within 3%"] == 0.5 and d.loc[("prose", 0.0), "within 3%"] == 1.0


def test_the_loops_own_tau_is_compared_with_the_prediction_that_includes_the_ends_cut():
    from analysis.validation_report import summary_lines

    runs = [_run(tau=2.8, predicted_tokens_per_forward=2.8), _run(tau=2.5, predicted_tokens_per_forward=2.75)]
    t = errors(pd.DataFrame(runs))
    assert t["tau_loop_err"].tolist() == pytest.approx([0.0, 0.1])
    s = summary(t)
    assert s["loop_tau_rows"] == 2 and s["loop_tau_err_max"] == pytest.approx(0.1)
    assert s["share_loop_tau_within_3pct"] == 0.5
    assert any("loop's own τ" in line for line in summary_lines(s))
    old = summary(errors(pd.DataFrame([_run()])))  # runs without τ_N: no such line
    assert "loop_tau_rows" not in old and not any("loop's own" in x for x in summary_lines(old))


def test_the_summary_reports_how_often_greedy_output_equalled_the_baseline():
    """bf16 flips argmax near-ties between a tree forward and a one-token forward: the report gives the
    rate over the greedy rows (sampled rows and the baseline's own rows left out), with its dtype."""
    from analysis.validation_report import summary_lines

    runs = [_run(greedy_equal_rate=1.0, dtype="bfloat16"), _run(greedy_equal_rate=0.75, dtype="bfloat16"),
            _run(greedy_equal_rate=0.0, dtype="bfloat16", temperature=1.0),
            _run(greedy_equal_rate=0.5, dtype="bfloat16", method="autoregressive")]
    s = summary(errors(pd.DataFrame(runs)))
    assert (s["greedy_rows"], s["greedy_rows_all_equal"]) == (2, 1)
    assert s["greedy_equal_mean"] == pytest.approx(0.875) and s["greedy_equal_min"] == pytest.approx(0.75)
    line = next(x for x in summary_lines(s) if x.startswith("- greedy output"))
    assert "bfloat16" in line and "1 of 2 rows" in line and "87.5%" in line and "75.0%" in line
    old = summary(errors(pd.DataFrame([_run()])))  # runs that did not record it: no such line
    assert "greedy_rows" not in old and not any(x.startswith("- greedy") for x in summary_lines(old))


def test_the_report_names_rows_that_decoded_in_another_dtype():
    """model.dtype=auto resolves per run; a bf16 sweep's row once ran in float32 (methods.core.bf16)."""
    from analysis.validation_report import mixed_dtypes

    runs = [_run(dtype="bfloat16", row_id="a"), _run(dtype="bfloat16", row_id="b"),
            _run(dtype="float32", row_id="c")]
    line, = mixed_dtypes(errors(pd.DataFrame(runs)))
    assert "other 2 rows' bfloat16" in line and "c (float32)" in line and "a (" not in line
    assert mixed_dtypes(errors(pd.DataFrame(runs[:2]))) == []
    assert mixed_dtypes(errors(pd.DataFrame([_run()]))) == []  # runs that did not record it


def test_failed_and_unmeasured_runs_are_not_rows():
    df = pd.DataFrame([_run(), {"status": "failed", "method": "medusa"}, _run(status="missing")])
    assert len(errors(df)) == 1


# ---- real runs ------------------------------------------------------------------------------------------
MICRO = REPO / "tests" / "data" / "validation_micro"  # committed: `run --small --workloads code` (real runs)


def test_the_committed_small_sweep_is_the_drivers_small_sweep_of_real_runs():
    from analysis.validation_report import load_validation

    df = load_validation(MICRO)
    expected = {r.row_id for r in vr.rows(vr.SMALL_METHODS, ["code"], [0.0, 1.0], vr.SMALL)}
    assert set(df["row_id"]) == expected and (df["status"] == "ok").all()
    assert set(df["model"]) == {"micro"} and set(df["task"]) == {"measure"}
    t = errors(df)
    real = t[t["method"] != "autoregressive"]
    # every drafter row carries the prediction's parts and the measured ones: the terms are all there
    assert real[[f"{p}_pred" for p in ("t_ar", "t_draft", "t_verify")]].notna().all().all()
    assert real["residual"].abs().max() < 1e-9
    assert (t["tau_meas"] >= 1).all() and (t["speedup_meas"] > 0).all()


def test_report_of_the_committed_small_sweep():
    from analysis.validation_report import report

    text = report(MICRO)
    assert "## Summary" in text and "- rows: 10" in text
    assert "| sequoia | sequoia32 | 32 | code | 1 |" in text
    assert "## Signed τ error by prompt draw" in text and "| code | 1 |" in text


def test_compare_on_the_command_line_layers_its_sweeps(capsys):
    """``compare BEFORE DIR DIR``: a later sweep's row replaces an earlier one's of the same id, so the
    committed small sweep twice is the sweep once, and beside itself every row reads x → x."""
    from analysis import validation
    from analysis.validation_report import layered_errors, load_validation

    one, twice = errors(load_validation(MICRO)), layered_errors([MICRO, MICRO])
    assert len(twice) == len(one) and set(twice["row_id"]) == set(one["row_id"])
    assert validation.main(["compare", str(MICRO), str(MICRO), str(MICRO)]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and "__" in ln]
    assert len(rows) == (one["method"] != "autoregressive").sum()
    for ln in rows:
        cells = [c.strip() for c in ln.strip("|").split("|")][1:]
        assert all(c.split(" → ")[0] == c.split(" → ")[1] for c in cells), ln


@pytest.mark.slow
def test_the_driver_runs_real_rows_on_micro(tmp_path):
    from analysis.validation_report import load_validation

    rows = vr.rows(["autoregressive", "prompt_lookup"], ["code"], [0.0], vr.SMALL)
    out = vr.run_rows(rows, tmp_path, progress=False)
    assert [o.status for o in out] == ["done", "done"], [o.error for o in out]
    t = errors(load_validation(tmp_path))
    assert list(t.sort_values("method")["method"]) == ["autoregressive", "prompt_lookup"]
    pl = t[t["method"] == "prompt_lookup"].iloc[0]
    assert np.isfinite(pl["speedup_err"]) and abs(pl["residual"]) < 1e-9
    assert np.isfinite(pl["tau_se_rel"])
    again = vr.run_rows(rows, tmp_path, progress=False)  # resumable: nothing runs twice
    assert [o.status for o in again] == ["skipped", "skipped"]


def test_a_cost_miss_on_a_profile_timed_under_load_says_so():
    busy = errors(pd.DataFrame([_run(predicted_t_draft_s_this_device=0.0, timing_dispersion=1.3),
                                _run(timing_dispersion=0.05)]))
    assert "busy machine" in busy.loc[0, "diagnosis"] and busy.loc[1, "diagnosis"] == ""
    s = summary(busy)
    assert s["rows_timings_held"] == 1 and s["speedup_err_max_held"] == pytest.approx(0)
    assert s["speedup_err_max"] == pytest.approx(1 / 3)
    run_busy = errors(pd.DataFrame([_run(predicted_t_draft_s_this_device=0.0, timing_dispersion=0.05,
                                         run_t1_dispersion=0.5)]))
    assert "busy machine" in run_busy.loc[0, "diagnosis"] and summary(run_busy)["rows_timings_held"] == 0
    tau_miss = errors(pd.DataFrame([_run(predicted_tau=3.6, timing_dispersion=1.3)])).loc[0, "diagnosis"]
    assert "busy machine" not in tau_miss  # a τ-driven miss is not the clock's fault


def test_the_prediction_has_its_own_standard_error_and_misses_are_judged_on_both():
    """The predicted τ's error comes from the calibration split (24 prompts × 32 tokens = 768 tokens): the
    row's relative error scaled by sqrt(test tokens / calibration tokens). A miss inside 2 combined s.e.
    (measured ⊕ predicted) is sampling noise, not model error, even beyond 2 s.e. of the measurement alone."""
    sizes = {"profile_path": "p.json", "num_prompts": 4, "workload.max_new_tokens": 48,
             "calibration.prompts": 24, "calibration.new_tokens": 32}
    meas = math.sqrt(4 / 9 / 10) / 3  # the histogram's s.e. of τ 3: 7.0%
    pred = meas * math.sqrt(4 * 48 / (24 * 32))  # 3.5%
    both = math.hypot(meas, pred)
    t = errors(pd.DataFrame([_run(predicted_tau=3 * 1.15, **sizes)])).loc[0]  # +15%: in (2·7.0%, 2·7.9%]
    assert t["tau_se_rel"] == pytest.approx(meas) and t["tau_pred_se_rel"] == pytest.approx(pred)
    assert t["tau_combined_se_rel"] == pytest.approx(both)
    assert abs(t["tau_err"]) > 2 * meas and t["tau_within_2se"] and "sampling noise" in t["diagnosis"]
    far = errors(pd.DataFrame([_run(predicted_tau=3 * 1.17, **sizes)])).loc[0]
    assert not far["tau_within_2se"] and "acceptance model" in far["diagnosis"]
    bare = _run(predicted_tau=3 * 1.15, **{**sizes, "profile_path": None})
    no_profile = errors(pd.DataFrame([bare])).loc[0]
    assert math.isnan(no_profile["tau_pred_se_rel"]) and not no_profile["tau_within_2se"]
    s = summary(errors(pd.DataFrame([_run(predicted_tau=3 * 1.15, **sizes), _run(predicted_tau=3 * 1.17,
                                                                                  **sizes)])))
    assert s["share_tau_within_2se_combined"] == 0.5 and s["share_tau_within_2se"] == 0.0
    assert s["tau_pred_se_median"] == pytest.approx(pred)


def test_a_learning_drafters_trajectory_spread_enters_both_standard_errors():
    """A drafter that learns between requests: one trajectory's τ spreads over the orders its requests come
    in (predicted_tau_order_sd_rel, from the calibration's orders). The run is one trajectory (its s.e. gains
    the whole spread), the prediction the mean of 3 orders (it gains the spread over sqrt(3))."""
    sizes = {"profile_path": "p.json", "num_prompts": 4, "workload.max_new_tokens": 48,
             "calibration.prompts": 24, "calibration.new_tokens": 32}
    plain = errors(pd.DataFrame([_run(predicted_tau=3 * 1.18, **sizes)])).loc[0]
    learner = errors(pd.DataFrame([_run(predicted_tau=3 * 1.18, predicted_tau_order_sd_rel=0.05,
                                        predicted_tau_orders=3, **sizes)])).loc[0]
    assert learner["tau_se_rel"] == pytest.approx(math.hypot(plain["tau_se_rel"], 0.05))
    pred = math.hypot(plain["tau_pred_se_rel"], 0.05 / math.sqrt(3))
    assert learner["tau_pred_se_rel"] == pytest.approx(pred)
    # +18%: beyond 2 combined s.e. of the steps alone (7.9%), within them with the trajectories' (9.7%)
    assert not plain["tau_within_2se"] and learner["tau_within_2se"]


def test_a_prediction_from_exact_star_acceptance_has_a_smaller_standard_error():
    """τ priced from star vectors read without coin flips (T > 0): the prediction's s.e. is the flipped
    estimator's times the square root of the variance share the exact one keeps (0.25 → half)."""
    sizes = {"profile_path": "p.json", "num_prompts": 4, "workload.max_new_tokens": 48,
             "calibration.prompts": 24, "calibration.new_tokens": 32}
    flipped = errors(pd.DataFrame([_run(predicted_tau=3.1, **sizes)])).loc[0, "tau_pred_se_rel"]
    exact = errors(pd.DataFrame([_run(predicted_tau=3.1, predicted_tau_star_variance_ratio=0.25,
                                      **sizes)])).loc[0, "tau_pred_se_rel"]
    assert exact == pytest.approx(flipped / 2) and flipped > 0


def test_compare_sets_each_row_beside_the_same_row_of_the_earlier_sweep():
    """A power study's table: the rows both sweeps have, 1× → 4×, with the goals and a summary line;
    autoregressive rows and rows only the later sweep has are left out."""
    from analysis.validation_report import compare

    def table(*runs: dict) -> pd.DataFrame:
        return errors(pd.DataFrame(list(runs)))

    before = table(_run(row_id="vanilla__natural__code__T0", predicted_tau=3.15),
                   _run(row_id="medusa__natural__code__T0", method="medusa", predicted_tau=3.0),
                   _run(row_id="autoregressive__natural__code__T0", method="autoregressive"))
    after = table(_run(row_id="vanilla__natural__code__T0", predicted_tau=3.06),
                  _run(row_id="medusa__natural__code__T0", method="medusa", predicted_tau=3.0),
                  _run(row_id="autoregressive__natural__code__T0", method="autoregressive"),
                  _run(row_id="staged__natural__code__T0", method="staged"))
    out = compare(before, after)
    lines = out.splitlines()
    assert [ln.split(" | ")[0].lstrip("| ") for ln in lines[2:4]] == ["medusa__natural__code__T0",
                                                                      "vanilla__natural__code__T0"]
    assert "| +5.0% → +2.0% |" in lines[3] and "| no → yes |" in lines[3]  # τ 3.15 → 3.06 of a 3.00
    assert lines[-1].startswith("2 rows: |τ err| median 2.5% → 1.0%, max 5.0% → 2.0%; within 3%: 1 → 2")
    assert "staged" not in out and "autoregressive" not in out
    assert compare(before, table(_run(row_id="other__natural__code__T0"))).startswith("no row")


def test_report_layers_sweeps_a_later_finished_row_replacing_an_earlier_one(tmp_path):
    """``report DIR DIR``: a power study's finished row replaces the full sweep's (and says which sweep it
    came from); its failed row replaces nothing: the earlier row stands and no row is listed as failed."""
    import json
    import shutil

    from analysis import validation
    from analysis.validation_report import load_layered, load_validation, report

    later = tmp_path / "power"
    for row in ("vanilla__natural__code__T0", "sequoia__sequoia8__code__T0"):
        shutil.copytree(MICRO / row, later / row)
    metrics = later / "vanilla__natural__code__T0" / "metrics.json"
    m = json.loads(metrics.read_text())
    m["predicted_tau"] = m["tau"] * 1.25  # the later row's prediction: τ error +25%
    metrics.write_text(json.dumps(m))
    (later / "sequoia__sequoia8__code__T0" / "metrics.json").write_text(
        json.dumps({"status": "failed", "error": "boom"}))

    one = load_validation(MICRO)
    df = load_layered([MICRO, later])
    assert len(df) == len(one) and set(df["row_id"]) == set(one["row_id"])
    by_id = df.set_index("row_id")
    assert by_id.loc["vanilla__natural__code__T0", "sweep"] == "power"
    assert by_id.loc["vanilla__natural__code__T0", "predicted_tau"] == pytest.approx(m["predicted_tau"])
    assert by_id.loc["sequoia__sequoia8__code__T0", "sweep"] == MICRO.name  # the failed one replaced nothing
    assert (df["status"] == "ok").all()

    text = report([MICRO, later])
    assert f"- rows by sweep (a later sweep's row replaces an earlier one's): {MICRO.name} 9, power 1" in text
    vanilla = next(ln for ln in text.splitlines() if ln.startswith("| vanilla | natural | 5 | code | 0 |"))
    assert "| +25.0% |" in vanilla and vanilla.rstrip(" |").endswith("power")
    assert "## Failed rows" not in text  # the earlier sweep's row stands
    assert validation.main(["report", str(MICRO), str(later)]) == 0
