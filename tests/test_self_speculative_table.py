"""benchmarks/self_speculative.py: every row's overrides compose into a real config (Medusa-2's joint flag
failed to compose before), and the table prints every row with LayerSkip's exit layer."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import self_speculative as bench


@pytest.mark.parametrize("name", list(bench.METHODS))
def test_every_row_composes(name):
    args = argparse.Namespace(threads=1, num_prompts=2, calibration_prompts=4)
    cfg = bench.row_config(name, "prose", args)
    assert cfg.workload.kind == "prose" and cfg.calibration.prompts == 4 and cfg.threads == 1
    assert cfg.method.drafter == {"medusa1": "medusa", "medusa2": "medusa"}.get(name, name.split("_plain")[0])
    assert bool(cfg.method.params.get("joint", False)) == (name == "medusa2")
    if name.startswith("layerskip"):
        assert cfg.method.params["exit_layer"] == "auto"
        assert cfg.method.params["variant"] == ("none" if name == "layerskip_plain" else "train")


def test_table_has_a_line_per_row_and_shows_the_exit_layer():
    row = {"tau": 2.0, "predicted_tau": 2.1, "draft_cost_ratio": 0.4, "draft_steps": "depth", "speedup": 0.9,
           "decode_speedup": 0.9, "predicted_speedup": 1.0, "extra_params_trained": 1e6, "trained": "x",
           "training_seconds": 10.0}
    rows = [dict(row, method="layerskip", workload="code", exit_layer=5),
            dict(row, method="medusa2", workload="prose", exit_layer=None, training_seconds=None)]
    lines = bench.table(rows).splitlines()
    assert len(lines) == 4 and "layerskip (E=5) | code" in lines[2]
    assert lines[3].startswith("| medusa2 | prose")
