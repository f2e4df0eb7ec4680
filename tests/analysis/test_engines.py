"""A sweep over engine=specsim,vllm loads into one tidy table and one figure compares the engines."""

from __future__ import annotations

import analysis
from analysis.plots import speedup_bars
from tests.analysis.conftest import measure_metrics, write_run


def test_engine_sweep_loads_into_one_table_and_one_plot(tmp_path):
    for engine, scale in (("specsim", 1.0), ("vllm", 0.5)):
        cfg, metrics = measure_metrics("vanilla", "chain", "code", 0)
        cfg.engine.name = engine
        metrics.update({"engine.name": engine, "tokens_per_s": metrics["tokens_per_s"] * scale,
                        "speedup": metrics["speedup"] * scale})
        write_run(tmp_path / f"engine={engine}", cfg, {"engine": engine, "method": "vanilla"},
                  [f"engine={engine}"], metrics)
    df = analysis.load(tmp_path)
    assert sorted(df["engine.name"]) == ["specsim", "vllm"] and (df["status"] == "ok").all()
    by = df.set_index("engine.name")["speedup"]
    assert by["vllm"] < by["specsim"]
    fig = speedup_bars(df, x="method", hue="engine.name", col=None)
    bars = [p for ax in fig.axes for p in ax.patches if p.get_height() > 0]
    assert len(bars) == 2  # one bar per engine
    assert sorted(round(b.get_height(), 6) for b in bars) == sorted(round(v, 6) for v in by)
