"""Speculative decoding against batch size (issue 16): the speedup of each method over batched autoregressive
decoding at each B, measured and predicted, with the break-even batch B* drawn; and the tokens/s of batched
autoregressive decoding next to the cost model's (specsim.batch: t(B, 1) of the roofline or the fit).

A sweep ``python run.py -m method=autoregressive,vanilla workload.batch_size=1,2,4,8,16,32`` loaded with
``analysis.load`` is the input: one row per run with ``workload.batch_size``, the measured ``speedup`` and
``baseline_tokens_per_s`` (the batched autoregressive side of the same run), and, where the run has them,
the batch-aware prediction (``predicted_speedup`` at the run's B when ``prediction_batch_size`` is the batch,
``break_even_batch``, ``ar_tokens_per_s``). A predicted curve can also be passed in (``prediction``: a frame
of batch_size, predicted_speedup[, method, ar_tokens_per_s, break_even_batch] from specsim.batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis.tables import ok_runs
from specsim.batch import first_loss

BATCH = "workload.batch_size"
NO_DRAFTER = "autoregressive"


def batch_table(df: pd.DataFrame, batch: str = BATCH) -> pd.DataFrame:
    """Per method × B over the finished runs: mean and sd of the measured speedup, mean measured tokens/s
    of both sides, and the run's own batch-aware prediction where it has one (NaN otherwise)."""
    data = ok_runs(df).copy()
    if batch not in data.columns:
        raise ValueError(f"no column {batch!r}: not a batch sweep")
    data[batch] = pd.to_numeric(data[batch], errors="coerce")
    pred = pd.to_numeric(data.get("predicted_speedup"), errors="coerce")
    # a run without the key predicted one sequence (B = 1 runs take the one-sequence path)
    at_b = pd.to_numeric(data.get("prediction_batch_size", pd.Series(np.nan, index=data.index)),
                         errors="coerce").fillna(1)
    data["predicted_at_batch"] = pred.where(at_b == data[batch])  # a one-sequence prediction is not S(B)
    dec = pd.to_numeric(data.get("predicted_decode_speedup", pd.Series(np.nan, index=data.index)),
                        errors="coerce")
    data["predicted_decode_at_batch"] = dec.where(at_b == data[batch])
    cols = {"speedup": ["mean", "std"], "decode_speedup": ["mean"], "tokens_per_s": ["mean"],
            "baseline_tokens_per_s": ["mean"], "baseline_decode_tokens_per_s": ["mean"],
            "predicted_at_batch": ["mean"],
            "predicted_decode_at_batch": ["mean"], "break_even_batch": ["median"],
            "ar_tokens_per_s": ["mean"]}
    cols = {k: v for k, v in cols.items() if k in data.columns}
    for k in cols:
        data[k] = pd.to_numeric(data[k], errors="coerce")
    out = data.groupby(["method", batch]).agg(cols)
    out.columns = [f"{k}_{a}" if a in ("std", "median") else k for k, a in out.columns]
    return out.reset_index().sort_values(["method", batch])


# measured (the run's timers, seconds per batched step) vs predicted (specsim.batch) per term of the step
TERMS = (  # (label, measured column, predicted column)
    ("AR forward", "baseline_forward_step_s", "predicted_t_ar_forward_s"),
    ("AR outside", "baseline_outside_step_s", "predicted_t_loop_s"),
    ("spec forward", "forward_step_s", "predicted_t_forward_s"),
    ("spec outside", "spec_outside_s", "predicted_spec_outside_s"),
    ("spec step", "step_s", "predicted_t_step_s"),
    ("forwards/batch", "forwards_per_batch", "predicted_batch_forwards"),
)


def terms_table(df: pd.DataFrame, batch: str = BATCH) -> pd.DataFrame:
    """Per speculative method × B (B ≥ 2: the runs priced with the batched loop) the step's terms measured
    and predicted and their ratio predicted / measured − 1: the autoregressive step's target forward and
    the loop's time outside it, the speculative step's target forward and its time outside it (drafting,
    verification, commit, the rows' bookkeeping; predicted: the draft step + the loop's time), the whole
    speculative step, and the forwards per static batch. Rows without the keys (older runs) are dropped."""
    data = ok_runs(df).copy()
    derived = ("spec_outside_s", "predicted_spec_outside_s")
    need = [c for _, m, p in TERMS for c in (m, p) if c not in derived]
    if any(c not in data.columns for c in need + ["predicted_t_draft_s"]):
        return pd.DataFrame()
    data = data[data["method"] != NO_DRAFTER]
    num = lambda c: pd.to_numeric(data[c], errors="coerce")  # noqa: E731
    data["spec_outside_s"] = num("step_s") - num("forward_step_s")
    data["predicted_spec_outside_s"] = num("predicted_t_step_s") - num("predicted_t_forward_s")
    rows = []
    for (method, b), g in data.groupby(["method", batch]):
        row = {"method": method, batch: int(b)}
        for label, meas, pred in TERMS:
            m, p_ = (pd.to_numeric(g[c], errors="coerce").mean() for c in (meas, pred))
            row.update({f"{label} measured": m, f"{label} predicted": p_, f"{label} error": p_ / m - 1})
        rows.append(row)
    out = pd.DataFrame(rows)
    return out[out[batch] > 1].sort_values(["method", batch]) if len(out) else out


def measured_break_even(table: pd.DataFrame, method: str, batch: str = BATCH, column: str = "speedup"
                        ) -> float | None:
    """B* of the measured means (first crossing of 1 going down, interpolated in log B; None: never);
    ``column``: which speedup (``speedup``: with the prompts' prefill; ``decode_speedup``; the runs' own
    prediction of it, ``predicted_decode_at_batch``)."""
    if column not in table:
        return None
    sub = table[table["method"] == method].dropna(subset=[column])
    return first_loss(sub[column].tolist(), sub[batch].astype(int).tolist()) if len(sub) else None


def speedup_vs_batch(df: pd.DataFrame, methods: Sequence[str] | None = None,
                     prediction: pd.DataFrame | None = None, batch: str = BATCH) -> Figure:
    """Two panels. Left: speedup over batched autoregressive decoding against B (log2 axis), measured
    means ± sd (markers), the predicted curve (lines: ``prediction`` if given, else the runs' own
    batch-aware predictions), predicted B* (dashed vertical) and measured B* (dotted), 1× dashed.
    Right: tokens/s of batched autoregressive decoding (every run measures it) against B, with the cost
    model's B / t(B, 1) where known (``ar_tokens_per_s``; ``roofline_ar_tokens_per_s`` in ``prediction``:
    the hardware preset's uncalibrated roofline as well)."""
    table = batch_table(df, batch)
    spec = [m for m in table["method"].unique() if m != NO_DRAFTER]
    methods = [m for m in (methods or spec) if m in spec]
    if not methods:
        raise ValueError("no speculative method with finished runs in this frame")
    palette = dict(zip(methods, sns.color_palette(n_colors=len(methods))))
    with sns.axes_style("whitegrid"):
        fig = Figure(figsize=(10.5, 4.0), layout="constrained")
        left, right = fig.subplots(1, 2)
        for m in methods:
            _speedup(left, table, prediction, m, palette[m], batch)
        left.axhline(1.0, color="0.3", lw=1, ls="--", zorder=0)
        left.set(xscale="log", xlabel="batch size B", ylabel="speedup over batched autoregressive",
                 title="speculative vs autoregressive at batch B")
        left.xaxis.set_major_formatter("{x:g}")
        left.legend(fontsize="small")
        _throughput(right, table, prediction, batch)
    return fig


def _speedup(ax: Axes, table: pd.DataFrame, prediction: pd.DataFrame | None, method: str, color,
             batch: str) -> None:
    sub = table[table["method"] == method]
    ax.errorbar(sub[batch], sub["speedup"], yerr=sub.get("speedup_std"), fmt="o", color=color, capsize=3,
                label=f"{method} measured")
    if "predicted_decode_at_batch" in sub and sub["predicted_decode_at_batch"].notna().any():
        # the run's length: a static batch waits for its slowest row (decode time, prefill left out)
        ax.plot(sub[batch], sub["decode_speedup"], "s", color=color, mfc="none",
                label=f"{method} measured, decode only")
        ax.plot(sub[batch], sub["predicted_decode_at_batch"], ":", color=color,
                label=f"{method} predicted, run length (slowest row)")
    pred = _prediction_for(prediction, method, batch) if prediction is not None else _own(sub, batch)
    if pred is not None and len(pred):
        ax.plot(pred[batch], pred["predicted_speedup"], "-", color=color, label=f"{method} predicted")
        b_star = pd.to_numeric(pred["break_even_batch"], errors="coerce").dropna() if (
            "break_even_batch" in pred) else pd.Series(dtype=float)
        if len(b_star):
            ax.axvline(float(b_star.median()), color=color, ls="--", lw=1,
                       label=f"{method} predicted B* = {float(b_star.median()):.1f}")
    measured = measured_break_even(table, method, batch)
    if measured is not None:
        ax.axvline(measured, color=color, ls=":", lw=1.5, label=f"{method} measured B* = {measured:.1f}")


def _own(sub: pd.DataFrame, batch: str) -> pd.DataFrame | None:
    """The runs' own batch-aware predictions as a curve (None when no run has one)."""
    if "predicted_at_batch" not in sub or not sub["predicted_at_batch"].notna().any():
        return None
    cols = {"predicted_at_batch": "predicted_speedup", "break_even_batch_median": "break_even_batch"}
    keep = [batch, *(c for c in cols if c in sub)]
    return sub[keep].rename(columns=cols).dropna(subset=["predicted_speedup"])


def _prediction_for(prediction: pd.DataFrame, method: str, batch: str) -> pd.DataFrame | None:
    p = prediction.rename(columns={"batch_size": batch}) if batch not in prediction else prediction
    if "method" in p.columns:
        p = p[p["method"] == method]
    return p.sort_values(batch) if len(p) else None


def _throughput(ax: Axes, table: pd.DataFrame, prediction: pd.DataFrame | None, batch: str) -> None:
    if "baseline_tokens_per_s" in table:
        ar = table.groupby(batch)["baseline_tokens_per_s"].mean()
        ax.plot(ar.index, ar.values, "o-", color="0.2", label="batched AR, measured")
    if "baseline_decode_tokens_per_s" in table and table["baseline_decode_tokens_per_s"].notna().any():
        # what B / t(B, 1) prices: the decode steps, without the prompts' prefill (8-26% of the run)
        dec = table.groupby(batch)["baseline_decode_tokens_per_s"].mean()
        ax.plot(dec.index, dec.values, "s--", color="0.2", mfc="none",
                label="batched AR, measured, decode only")
    model = None
    if prediction is not None and "ar_tokens_per_s" in prediction:
        p = prediction.rename(columns={"batch_size": batch}) if batch not in prediction else prediction
        model = p.groupby(batch)["ar_tokens_per_s"].first()
    elif "ar_tokens_per_s" in table and table["ar_tokens_per_s"].notna().any():
        model = table.groupby(batch)["ar_tokens_per_s"].mean()
    if model is not None:
        ax.plot(model.index, model.values, "--", color="tab:red", label="cost model B / t(B, 1)")
    if prediction is not None and "roofline_ar_tokens_per_s" in prediction:
        p = prediction.rename(columns={"batch_size": batch}) if batch not in prediction else prediction
        roof = p.groupby(batch)["roofline_ar_tokens_per_s"].first()
        ax.plot(roof.index, roof.values, ":", color="tab:purple", label="datasheet roofline B / t(B, 1)")
    ax.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="tokens / s",
           title="batched autoregressive throughput")
    ax.xaxis.set_major_formatter("{x:g}")
    ax.legend(fontsize="small")
