"""The published-table presets (issue 17, part 2): every row of conf/published/<paper>.yaml composes through
its experiment preset and predicts; the inputs are consistent with their sources (Sequoia's vector, model
shapes, datasheet bandwidth); the runner renders the table. Pure simulation: no model is built."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml

from specsim.overheads import KernelCount
from specsim.published import forecast, setting_from

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "conf" / "published"
PAPERS = sorted(p for p in PUBLISHED.glob("*.yaml") if p.stem != "runtimes")
RUNTIMES = yaml.safe_load((PUBLISHED / "runtimes.yaml").read_text())
ROWS = [(p.stem, i) for p in PAPERS for i in range(len(yaml.safe_load(p.read_text())["rows"]))]


def _paper(stem: str) -> dict:
    return yaml.safe_load((PUBLISHED / f"{stem}.yaml").read_text())


def _runner():
    spec = importlib.util.spec_from_file_location("published_runner", REPO / "benchmarks" / "published.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_issue_papers_have_rows():
    assert {"sequoia", "eagle", "medusa"} <= {p.stem for p in PAPERS}


@pytest.mark.parametrize(("stem", "index"), ROWS, ids=[f"{s}-{i}" for s, i in ROWS])
def test_every_row_composes_and_predicts(run_config, stem, index):
    paper = _paper(stem)
    row = paper["rows"][index]
    assert row["source"] and row["published"]["speedup"] > 0, "a row names its source and published figure"
    experiment = row.get("experiment", paper["experiment_default"])
    cfg = run_config(f"experiment={experiment}", "task=simulate", *row.get("overrides", []))
    s = setting_from(paper, RUNTIMES, row)
    f = forecast(cfg, s)
    assert math.isfinite(f.speedup) and f.speedup > 0 and f.t_step_ms > 0 and f.tree_size >= 2
    assert f.t_ar_ms > float(cfg.model.params * cfg.model.bytes_per_param  # never below the weight stream
                             / (cfg.hardware.memory_bandwidth_gbs * 1e9)) * 1e3 * 0.99
    if s.tau is not None:  # α was solved from the published τ: the prediction reproduces that input (a tree
        assert f.tau == pytest.approx(s.tau, rel=0.01)  # rebuilt from α (EAGLE-2) makes τ(α) step slightly)
        assert 0 < f.alpha < 1


def test_runtimes_name_what_the_papers_use():
    assert RUNTIMES["kernels"]["hf_llama_eager"]["per_layer"] > 0
    for path in PAPERS:
        paper = yaml.safe_load(path.read_text())
        for row in paper["rows"]:
            s = setting_from(paper, RUNTIMES, row)
            names = RUNTIMES["runtimes"]
            assert s.target_runtime.name in names and s.draft_runtime.name in names


def test_sequoia_inputs_are_the_published_vector(run_config):
    """method=sequoia (which sequoia_tables prices) carries the vector of the Sequoia repository's demo."""
    demo = json.loads((REPO / "tests" / "specsim" / "data" / "sequoia_demo.json").read_text())
    cfg = run_config("experiment=sequoia_tables")
    assert cfg.method.acceptance.vector == pytest.approx(demo["acceptance_rate_vector"])
    assert cfg.hardware.memory_bandwidth_gbs == 1935.0  # the A100 bandwidth Sequoia's on-chip table lists


@pytest.mark.parametrize("model", ["llama2_7b", "llama2_13b", "llama2_70b", "vicuna_7b", "vicuna_13b",
                                   "llama2_7b_32k", "llama31_8b"])
def test_model_params_match_their_shapes(run_config, model):
    """params = layers · (attention + MLP) + embedding and LM head, within 1% (norms are negligible)."""
    m = run_config(f"model={model}", "task=simulate").model
    head_dim = m.hidden_size // m.n_heads
    attention = 2 * m.hidden_size**2 + 2 * m.hidden_size * m.n_kv_heads * head_dim
    layer = attention + 3 * m.hidden_size * m.intermediate_size
    total = m.n_layers * layer + 2 * m.vocab_size * m.hidden_size
    assert m.params == pytest.approx(total, rel=0.01)


def test_runner_renders_the_table(capsys):
    runner = _runner()
    assert runner.main(["--papers", "medusa"]) == 0
    out = capsys.readouterr().out
    assert "| Medusa | Medusa-1 Vicuna-7B | 1.97 |" in out
    assert out.count("| Medusa |") == len(_paper("medusa")["rows"])


def test_magicdec_curve(capsys):
    """MagicDec's batch table: one row per (context, α), a speedup per batch that fits, and the α reaching the
    published maximum within (0, 1)."""
    runner = _runner()
    table = runner.magicdec()
    spec = yaml.safe_load((PUBLISHED / "batch" / "magicdec.yaml").read_text())
    assert len(table) == len(spec["contexts"]) * len(spec["alphas"])
    for row in table:
        assert 0 < row["alpha_for_published"] < 1
        values = [row[f"B={b}"] for b in spec["batches"]]
        assert math.isfinite(values[0]) and values[0] > 0  # batch 1 always fits
    assert runner.main(["--magicdec"]) == 0 and "alpha_for_published" in capsys.readouterr().out


def test_magicdec_published_rows():
    """Every per-batch figure of MagicDec's page is priced: it fits the modelled memory, its α is its target's
    (LLaMA-3.1-8B's own published one, a stand-in for LLaMA-2-7B-32K), the error is (predicted − published) /
    published, the all-reduce latency lowers the prediction, and the α the published speedup needs lies in
    (0, 1) and reproduces it."""
    from specsim.magicdec import self_spec_speedup

    runner = _runner()
    spec = yaml.safe_load((PUBLISHED / "batch" / "magicdec.yaml").read_text())
    rows = runner.magicdec_rows()
    assert [(r["model"], r["context"], r["batch"]) for r in rows] == [
        (r["model"], r["context"], r["batch"]) for r in spec["rows"]]
    assert {r["model"] for r in rows} == {"llama2_7b_32k", "llama31_8b"}
    for r in rows:
        target = spec["targets"][r["model"]]
        assert r["alpha"] == target["alpha"][r["context"]] and r["alpha_source"] == target["alpha_source"]
        assert r["error"] == pytest.approx((r["predicted"] - r["published"]) / r["published"])
        assert r["predicted"] < r["no_latency"]
        assert 0 < r["alpha_for_published"] < 1
        cost = runner._magicdec_cost(spec, r["model"])
        f = runner._magicdec_latency(spec, cost)
        again = self_spec_speedup(cost, r["batch"], r["context"], spec["budget"], r["gamma"],
                                  r["alpha_for_published"], f)
        assert again == pytest.approx(r["published"], rel=0.01)
        extra = r["extra_ms_for_published"] * 1e-3
        at_extra = self_spec_speedup(cost, r["batch"], r["context"], spec["budget"], r["gamma"], r["alpha"],
                                     f + extra)
        assert at_extra == pytest.approx(r["published"], rel=1e-3)
    own = [r for r in rows if r["model"] == "llama31_8b"]
    assert own and all(r["alpha_source"].startswith("published") for r in own)


def test_magicdec_all_reduce_count_is_the_codes():
    """Two all-reduces per layer and two for the vocab-parallel argmax, 10 us each (cited in the yaml)."""
    runner = _runner()
    spec = yaml.safe_load((PUBLISHED / "batch" / "magicdec.yaml").read_text())
    cost = runner._magicdec_cost(spec)
    assert runner._magicdec_latency(spec, cost) == pytest.approx((2 * 32 + 2) * 10e-6)
    assert runner._magicdec_latency(spec, cost, latency=False) == 0.0


def test_fixed_reaching():
    runner = _runner()
    assert runner.fixed_reaching(lambda x: 2.0 - x, 1.5, hi=1.0) == pytest.approx(0.5, abs=1e-6)
    assert runner.fixed_reaching(lambda x: 1.0 - x, 1.5) == 0.0
    assert math.isnan(runner.fixed_reaching(lambda x: 2.0 - x, 0.5, hi=1.0))


def test_medusa_rows_price_the_counted_step():
    """Medusa's file prices its reference loop as counted (46 kernels, a 2-kernel KV gather, 10 syncs, eager
    scores, heads over the 64-node tree): every Medusa row's step pays for the syncs, and its one-index KV
    gather costs less than the generic 2-per-layer copies. (At its own transformers' kernel count, 4.34, the
    7B forward is host-bound, so the step is no longer dearer than the generic model's on every row.)"""
    from dataclasses import replace as dc_replace

    from run import compose_run_config

    paper = _paper("medusa")
    for row in paper["rows"]:
        s = setting_from(paper, RUNTIMES, row)
        assert (s.step_fixed_kernels, s.gather_kernels, s.step_syncs, s.head_tokens, s.score_bytes) == (
            46, 2, 10, 64, 28.0)
        cfg = compose_run_config(f"experiment={paper['experiment_default']}", "task=simulate",
                                 *row["overrides"])
        step = forecast(cfg, s).t_step_ms
        assert step > forecast(cfg, dc_replace(s, step_syncs=0)).t_step_ms
        assert step < forecast(cfg, dc_replace(s, gather_kernels=None)).t_step_ms
        assert step >= forecast(cfg, dc_replace(s, score_bytes=0.0)).t_step_ms


def test_alpha_reaching_is_nan_out_of_reach():
    runner = _runner()
    assert runner.alpha_reaching(lambda a: 1.0 + a, 1.5) == pytest.approx(0.5, abs=1e-3)
    assert math.isnan(runner.alpha_reaching(lambda a: 1.0 + a, 3.0))


def test_acceptance_inputs_are_published():
    """No row of EAGLE or Medusa runs on a method preset's guessed acceptance: each gives a published τ that α
    is solved from (Medusa-1's rows once ran on method=medusa's guess, α 0.6 / decay 0.8)."""
    for stem in ("eagle", "medusa"):
        paper = _paper(stem)
        for row in paper["rows"]:
            s = setting_from(paper, RUNTIMES, row)
            assert s.tau is not None and s.tau == row["published"]["tau"], row["id"]


@pytest.mark.parametrize(("index", "nodes"), [(0, 128), (1, 128), (2, 64), (3, 64)])
def test_sequoia_on_chip_rows_use_the_published_tree_size(run_config, index, nodes):
    """The A100 rows price a tree of the size of the growmap Sequoia's repository ships for them (128 nodes
    for Llama-2-7B, 64 for Llama-2-13B), not the simulator's own pick."""
    paper = _paper("sequoia")
    row = paper["rows"][index]
    cfg = run_config(f"experiment={paper['experiment_default']}", "task=simulate", *row["overrides"])
    assert forecast(cfg, setting_from(paper, RUNTIMES, row)).tree_size == nodes


def test_published_figures_agree_with_each_other():
    """Where a source gives time per token with and without speculation, their ratio is its speedup (a typo in
    a transcribed figure shows here)."""
    checked = 0
    for path in PAPERS:
        for row in yaml.safe_load(path.read_text())["rows"]:
            pub = row["published"]
            if "tbt_ms" in pub and "baseline_ms" in pub:
                ratio = pub["baseline_ms"] / pub["tbt_ms"]
                assert ratio == pytest.approx(pub["speedup"], rel=0.02), row["id"]
                checked += 1
    assert checked >= 4


def test_published_step_time_sets_its_own_error():
    """A row that publishes the speculation step's time gets predicted beside it and its error, and a step
    that misses alone is reported as a miss (the cost side apart from τ); rows without one show NaN."""
    from specsim.published import Forecast, misses, table_row

    f = Forecast(speedup=2.0, tau=2.5, t_ar_ms=14.0, t_step_ms=16.0, tree_size=64, tree_depth=4, alpha=0.5,
                 roofline_speedup=2.1)
    with_step = table_row("P", {"id": "a", "published": {"speedup": 2.0, "step_ms": 25.0}}, f)
    assert with_step["published_step_ms"] == 25.0 and with_step["predicted_step_ms"] == 16.0
    assert with_step["step_error"] == pytest.approx(16.0 / 25.0 - 1.0)
    without = table_row("P", {"id": "b", "published": {"speedup": 2.0}}, f)
    assert math.isnan(without["step_error"])
    assert [r["row"] for r in misses([with_step, without])] == ["a"]  # speedup exact: the step alone misses


@pytest.mark.parametrize(("index", "context", "step_ms"), [(0, 504, 25.3), (1, 532, 35.7), (2, 532, None)])
def test_medusa_mt_bench_rows_use_the_measured_workload(run_config, index, context, step_ms):
    """Medusa's MT-bench rows run at the KV length measured on Medusa's own MT-bench answer files (504 tokens
    on Vicuna-7B, 532 on 13B, not the preset's 512 guess), and the report rows carry those files' step
    time."""
    paper = _paper("medusa")
    row = paper["rows"][index]
    cfg = run_config(f"experiment={paper['experiment_default']}", "task=simulate", *row["overrides"])
    assert cfg.workload.context_tokens == context
    assert row["published"].get("step_ms") == step_ms


def test_magicdec_verify_ratio_for_published():
    """The diagnostic column: at the model's own speedup the verification costs what the model prices it
    (t(B, γ + 1; L) / t(B, 1; L)); at the published one, a step of γ modelled drafts plus that many baseline
    forwards gives the published speedup back."""
    from specsim.expected import chain_expected_tokens
    from specsim.magicdec import forward_times, verify_ratio_for

    runner = _runner()
    spec = yaml.safe_load((PUBLISHED / "batch" / "magicdec.yaml").read_text())
    for r in runner.magicdec_rows():
        cost = runner._magicdec_cost(spec, r["model"])
        f = runner._magicdec_latency(spec, cost)
        ar, draft, verify = forward_times(cost, r["batch"], r["context"], spec["budget"], r["gamma"], f)
        assert r["verify_ar_model"] == pytest.approx(verify / ar, rel=1e-9)
        tau = float(chain_expected_tokens(r["alpha"], r["gamma"]))
        step = r["gamma"] * draft + r["verify_ar_for_published"] * ar
        assert tau * ar / step == pytest.approx(r["published"], rel=1e-9)
    assert verify_ratio_for(cost, 8, 8000, 512, 3, 0.8, 1.0, 0.0) > verify_ratio_for(
        cost, 8, 8000, 512, 3, 0.8, 2.0, 0.0)  # a lower published speedup needs a dearer verification


def test_rows_price_the_transformers_their_paper_ran():
    """Each paper file names the transformers its Llama code comes from (s8-host: Medusa's copy of v4.34,
    EAGLE's of v4.31, Sequoia's pinned 4.36.2), and every row's kernel count and eager runtimes are that
    version's entries in runtimes.yaml, never the project's own transformers 5 ones."""
    own = RUNTIMES["kernels"]["hf_llama_eager"]["transformers"]
    for path in PAPERS:
        paper = yaml.safe_load(path.read_text())
        version = paper["setting"]["transformers"]
        assert version != own, f"{path.stem}: priced with the project's transformers, not the paper's"
        for row in paper["rows"]:
            merged = {**paper["setting"], **row.get("setting", {})}
            counted = RUNTIMES["kernels"][merged["kernels"]]
            assert counted["transformers"] == version
            s = setting_from(paper, RUNTIMES, row)
            assert s.kernels == KernelCount(counted["per_layer"], counted["fixed"])
            for runtime in (s.target_runtime, s.draft_runtime):
                if not runtime.graph:
                    assert RUNTIMES["runtimes"][runtime.name]["transformers"] == version, (path.stem, runtime)


def test_the_kernel_count_of_the_installed_transformers_is_measured():
    """--count-kernels on the installed transformers reproduces runtimes.yaml's entry for that version: the
    counts the rows load are the microbenchmark's, not typed in."""
    import transformers

    entries = [k for k in RUNTIMES["kernels"].values() if k["transformers"] == transformers.__version__]
    assert entries, f"runtimes.yaml counts no kernels for transformers {transformers.__version__}"
    got = _runner().count_kernels(reps=2)
    assert got["transformers"] == transformers.__version__
    assert (got["ops_per_layer"], got["fixed_ops"]) == (entries[0]["per_layer"], entries[0]["fixed"])
    assert got["host_us_per_layer_min"] > 0


def test_transformers_path_refuses_an_already_imported_transformers(tmp_path):
    import transformers  # noqa: F401  (imported: a second version can no longer be put first)

    with pytest.raises(AssertionError, match="transformers-path"):
        _runner().main(["--count-kernels", "--transformers-path", str(tmp_path)])
