"""A sweep over engine=specsim,vllm loads into one tidy table (analysis.load) and one figure compares the
engines: measured against predicted τ and speedup per engine (analysis.engines), on fabricated runs."""

from __future__ import annotations

import pytest

import analysis
from analysis.engines import engine_of, engine_table, engines_figure, main
from analysis.plots import speedup_bars
from tests.analysis.conftest import measure_metrics, write_run

# engine → (scale of the measured speedup, scale of the predicted speedup): vLLM slower and over-predicted
SCALE = {"specsim": (1.0, 1.0), "vllm": (0.5, 0.6)}


def _sweep(root, methods=("vanilla",)):
    for method in methods:
        for engine, (measured, predicted) in SCALE.items():
            cfg, metrics = measure_metrics(method, "chain", "code", 0)
            cfg.engine.name = engine
            metrics.update({"engine.name": engine, "tokens_per_s": metrics["tokens_per_s"] * measured,
                            "speedup": metrics["speedup"] * measured,
                            "predicted_speedup": metrics["predicted_speedup"] * predicted})
            if engine == "vllm":  # vllm_measure writes these; specsim's one-sequence loop does not
                metrics.update(engine="vllm", batch_size=1)
            overrides = [f"engine={engine}", f"method={method}"]
            write_run(root / ",".join(overrides), cfg, {"engine": engine, "method": method}, overrides,
                      metrics)
    return analysis.load(root)


def test_engine_sweep_loads_into_one_table_and_one_plot(tmp_path):
    df = _sweep(tmp_path)
    assert sorted(df["engine.name"]) == ["specsim", "vllm"] and (df["status"] == "ok").all()
    by = df.set_index("engine.name")["speedup"]
    assert by["vllm"] < by["specsim"]
    fig = speedup_bars(df, x="method", hue="engine.name", col=None)
    bars = [p for ax in fig.axes for p in ax.patches if p.get_height() > 0]
    assert sorted(round(b.get_height(), 6) for b in bars) == sorted(round(v, 6) for v in by)


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """Two methods × two engines."""
    return _sweep(tmp_path_factory.mktemp("engines"), ("vanilla", "prompt_lookup"))


def test_engine_table_has_each_engines_error(two_by_two):
    df = two_by_two
    table = engine_table(df)
    assert list(table["engine"]) == ["specsim", "vllm", "specsim", "vllm"]  # by method, then engine
    assert (table["batch_size"] == 1).all()  # vLLM's metrics say it; specsim's come from the config
    row = table.iloc[1]
    want = (row["predicted_speedup"] - row["speedup"]) / row["speedup"]
    assert row["speedup_rel_error"] == pytest.approx(want)
    # the fabricated vLLM speedup is over-predicted by 0.6 / 0.5 relative to specsim's own error
    spec = table.iloc[0]
    assert (1 + row["speedup_rel_error"]) == pytest.approx((1 + spec["speedup_rel_error"]) * 0.6 / 0.5)


def test_engines_figure_draws_measured_bars_and_predicted_marks_per_engine(two_by_two):
    df = two_by_two
    table = engine_table(df)
    fig = engines_figure(df)
    assert len(fig.axes) == 2
    for ax, metric in zip(fig.axes, ("tau", "speedup")):
        bars = sorted(round(p.get_height(), 6) for p in ax.patches)
        assert bars == sorted(round(v, 6) for v in table[metric])  # one bar per (method, engine)
        marks = sorted(round(y, 6) for c in ax.collections for _, y in c.get_offsets())
        assert marks == sorted(round(v, 6) for v in table[f"predicted_{metric}"])
        assert "specsim" in ax.get_title() and "vllm" in ax.get_title()
        assert [t.get_text() for t in ax.get_xticklabels()] == ["prompt_lookup", "vanilla"]


def test_engine_of_falls_back_to_metrics_then_specsim():
    import pandas as pd

    df = pd.DataFrame({"engine": [None, "vllm", None], "engine.name": [None, None, "vllm"]})
    assert list(engine_of(df)) == ["specsim", "vllm", "vllm"]
    assert list(engine_of(pd.DataFrame(index=[0, 1]))) == ["specsim", "specsim"]


def test_engines_command_prints_the_table_and_writes_the_figure(tmp_path, capsys):
    _sweep(tmp_path, ("vanilla", "prompt_lookup"))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "vllm" in out and "speedup_rel_error" in out
    assert (tmp_path / "engines.png").stat().st_size > 0 and (tmp_path / "engines.pdf").exists()


def test_engines_figure_without_measured_runs_is_a_clear_error(tmp_path):
    import pandas as pd

    with pytest.raises(ValueError, match="no finished task=measure run"):
        engines_figure(pd.DataFrame({"status": ["ok"], "method": ["vanilla"]}))

