"""benchmarks/step_split.py: the per-phase split of a batch-1 decode step adds up, and its timers leave the
engine, the drafter and the loop as they were."""

from __future__ import annotations

import re

import pytest

import methods.core.loop as loop
from benchmarks import step_split


@pytest.mark.slow  # three methods on the micro zoo: ~10 s
def test_split_adds_up_and_leaves_no_wrapper_behind(capsys):
    verify_step = loop.verify_step
    step_split.main(["--model", "micro", "--dtype", "float32", "--num-prompts", "1", "--max-new", "8",
                     "--warmup-prompts", "1", "--gamma", "2", "--staged-depth", "3"])
    out = capsys.readouterr().out
    assert loop.verify_step is verify_step
    blocks = out.split("== ")[1:]
    assert [b.split(":")[0] for b in blocks] == ["staged", "vanilla", "autoregressive"]
    for block in blocks:
        shares = {m[0]: float(m[1]) for m in re.findall(r"^  (\w[\w ]*?)\s+[\d.]+ ms/step\s+([\d.]+)%", block,
                                                           re.M)}
        assert {"target forward", "verify", "rest"} <= set(shares)
        assert abs(sum(shares.values()) - 100) < 0.5  # top-level phases and the rest: the whole step
        assert shares["target forward"] > 0
    assert "draft forwards/step" in blocks[0] and "draft model" in blocks[1]
