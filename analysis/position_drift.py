"""Acceptance along the generation: does a validation row's loop accept less late in its generations?

The calibration verifies its star trees over ``calibration.new_tokens`` generated tokens per prompt while a
validation row decodes ``workload.max_new_tokens``; if acceptance drifted along the generation, the
prediction would be read off the wrong stretch. Per row, each test prompt's steady steps
(specsim.tau_error.steady_steps: the generation's cut last steps left out) are binned by the tokens
generated before them; a bin's figure is the mean over prompts of the prompt's mean accepted length there
(prompts weigh alike, as in τ's sampling error), and ``drift`` is the last bin's over the first's − 1.

    python -m analysis.position_drift multirun/validation/zoo9 [--bin 16]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.validation_report import load_validation
from specsim.tau_error import steady_steps


def bin_means(prompts, n_tokens: int, depth: int, width: int) -> list[float]:
    """Per position bin [k·width, (k+1)·width) of the generation: the mean over prompts (those with a steady
    step there) of the prompt's mean accepted length of the steps starting in the bin; NaN where none."""
    bins = max(1, math.ceil(n_tokens / width))
    per_bin: list[list[float]] = [[] for _ in range(bins)]
    for lengths in prompts:
        mine: list[list[int]] = [[] for _ in range(bins)]
        for start, length in steady_steps(lengths, n_tokens, depth):
            mine[min(start // width, bins - 1)].append(length)
        for k, got in enumerate(mine):
            if got:
                per_bin[k].append(float(np.mean(got)))
    return [float(np.mean(v)) if v else math.nan for v in per_bin]


def drift_table(df: pd.DataFrame, width: int = 16) -> pd.DataFrame:
    """One line per row of a validation table (load_validation) with per-step lengths: its bins' mean
    accepted lengths (``bin0``…), and ``drift`` = last bin / first bin − 1 (NaN without both)."""
    lines = []
    for _, r in df.iterrows():
        prompts, depth = r.get("prompt_accepted_lengths"), r.get("tree_depth")
        n = r.get("workload.max_new_tokens")
        if not isinstance(prompts, (list, tuple)) or not prompts or not (pd.notna(n) and pd.notna(depth)):
            continue
        if int(depth) < 1:  # autoregressive: one token per step, nothing to drift
            continue
        means = bin_means(prompts, int(n), int(depth), width)
        line = {"row_id": r["row_id"], "method": r.get("method"), "temperature": r.get("temperature")}
        line.update({f"bin{k}": m for k, m in enumerate(means)})
        line["drift"] = means[-1] / means[0] - 1 if means[0] > 0 else math.nan
        lines.append(line)
    return pd.DataFrame(lines)


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per temperature: rows, mean drift and its standard error over rows."""
    g = table.dropna(subset=["drift"]).groupby("temperature")["drift"]
    return pd.DataFrame({"rows": g.size(), "mean_drift": g.mean(), "se": g.std() / np.sqrt(g.size())})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--bin", type=int, default=16, help="generated tokens per position bin")
    args = ap.parse_args(argv)
    table = drift_table(load_validation(args.path), args.bin)
    with pd.option_context("display.max_rows", None, "display.width", 160, "display.precision", 3):
        print(table.to_string(index=False))
        print(summary(table).to_string())


if __name__ == "__main__":
    main()
