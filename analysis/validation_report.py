"""The validation sweep as a report: load its rows, render the per-row table, the summary statistics, the
per-term breakdown and the worst rows as Markdown (docs/validation.md is made from it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.load import load, load_samples
from analysis.tables import to_markdown
from analysis.validation_rows import read_row
from analysis.validation_terms import TERMS, draw_table, errors, summary, term_table


def load_validation(path: str | Path) -> pd.DataFrame:
    """analysis.load's table of the sweep's runs, with each row's own description (``row_id``,
    ``row_tree`` — natural, chain, sequoia<budget> — and ``temperature``) from validation_row.json."""
    df = load(path)
    samples = load_samples(path)  # each prompt's accepted lengths: τ's sampling error across prompts
    if "accepted_lengths" in samples.columns:
        per_run = samples.groupby("run_dir")["accepted_lengths"].apply(list)
        df["prompt_accepted_lengths"] = df["run_dir"].astype(str).map(per_run)
    if "prompt_id" in samples.columns:  # "<kind>/<module>/<where>": τ's error clusters by module
        modules = samples["prompt_id"].astype(str).map(prompt_module)
        df["prompt_modules"] = df["run_dir"].astype(str).map(modules.groupby(samples["run_dir"]).apply(list))
    rows = [read_row(Path(d)) or {} for d in df["run_dir"]]
    df["row_id"] = [r.get("row_id", Path(d).name) for r, d in zip(rows, df["run_dir"])]
    df["row_tree"] = [r.get("tree", t) for r, t in zip(rows, df.get("tree", [None] * len(df)))]
    temps = pd.to_numeric(df.get("workload.temperature", pd.Series(np.nan, index=df.index)), errors="coerce")
    df["temperature"] = [r.get("temperature", t) for r, t in zip(rows, temps)]
    return df


def prompt_module(prompt_id: str) -> str:
    """The source module of a prompt id ``<kind>/<module>/<where>`` (methods.data.workloads.Prompt); the id
    itself when it has no module part."""
    parts = prompt_id.split("/")
    return parts[1] if len(parts) >= 3 else prompt_id


def load_layered(paths: Sequence[str | Path]) -> pd.DataFrame:
    """:func:`load_validation` of several sweeps as one table, each row tagged with its sweep (``sweep``:
    the folder's name): a later sweep's finished row replaces an earlier one's of the same ``row_id`` (a
    power study's rows over the full sweep's), while a later failed or unfinished row replaces nothing."""
    tables = [load_validation(p).assign(sweep=Path(p).name) for p in paths]
    merged = pd.concat(tables, ignore_index=True)
    finished = merged["status"] == "ok"
    done = merged[finished].drop_duplicates("row_id", keep="last")
    pending = merged[~finished & ~merged["row_id"].isin(done["row_id"])]
    pending = pending.drop_duplicates("row_id", keep="last")
    return pd.concat([done, pending]).sort_index().reset_index(drop=True)


def failures(df: pd.DataFrame) -> pd.DataFrame:
    bad = df[df["status"] != "ok"]
    return bad[["row_id", "status", "error"]].reset_index(drop=True)


def finite(spec: str) -> Callable[[float], str]:
    """A formatter of numbers by ``spec`` that prints a non-finite one as "–"."""
    return lambda x: "–" if not np.isfinite(x) else format(x, spec)


pct = finite("+.1%")


def row_table(table: pd.DataFrame, sort: bool = True) -> pd.DataFrame:
    """The per-row table as it is published: methods first, then trees, workloads, temperature (or in
    the table's own order)."""
    t = table.sort_values(["method", "row_tree", "workload", "temperature"]) if sort else table
    return pd.DataFrame({
        "method": t["method"], "tree": t["row_tree"], "n": t["tree_size"].map(lambda x: f"{x:.0f}"),
        "workload": t["workload"],
        "T": t["temperature"].map(lambda x: f"{x:g}"),
        "τ pred": t["tau_pred"].map("{:.2f}".format), "τ meas": t["tau_meas"].map("{:.2f}".format),
        "τ err": t["tau_err"].map(pct), "τ s.e.": t["tau_se_rel"].map(lambda x: f"{x:.1%}"),
        "pred s.e.": t["tau_pred_se_rel"].map(finite(".1%")),
        "≤2σ": t["tau_within_2se"].map(lambda x: "yes" if x else "no"),
        "prompts": t["prompts"].map(finite(".0f")),
        "S pred": t["speedup_pred"].map("{:.2f}".format), "S meas": t["speedup_meas"].map("{:.2f}".format),
        "S err": t["speedup_err"].map(pct), "diagnosis": t["diagnosis"],
        **({"sweep": t["sweep"]} if "sweep" in t.columns and t["sweep"].nunique() > 1 else {}),
    })


def summary_lines(s: dict) -> list[str]:
    return [
        f"- rows: {s['rows']}",
        f"- τ error (|pred/meas − 1|): median {s['tau_err_median']:.1%}, max {s['tau_err_max']:.1%}; "
        f"within 3%: {s['share_tau_within_3pct']:.0%} of rows; within 2 standard errors of the measured τ: "
        f"{s['share_tau_within_2se']:.0%}; within 2 combined s.e. (measured ⊕ predicted): "
        f"{s['share_tau_within_2se_combined']:.0%}",
        f"- τ's sampling error (median): measured {s['tau_se_median']:.1%}, predicted (calibration split) "
        f"{s['tau_pred_se_median']:.1%}",
        f"- speedup error: median {s['speedup_err_median']:.1%}, max {s['speedup_err_max']:.1%}; within 10%: "
        f"{s['share_speedup_within_10pct']:.0%} of rows",
        f"- both goals: {s['share_both']:.0%} of rows",
        *([f"- the loop's own τ (the generation's cut last steps included) against the predicted τ with the "
           f"end's cut (τ_N): median {s['loop_tau_err_median']:.1%}, max {s['loop_tau_err_max']:.1%}; "
           f"within 3%: {s['share_loop_tau_within_3pct']:.0%} of {s['loop_tau_rows']} rows"]
          if "loop_tau_rows" in s else []),
        *([f"- greedy output (T = 0, {s['greedy_dtypes']}) equal to the same run's autoregressive output on "
           f"every prompt: {s['greedy_rows_all_equal']} of {s['greedy_rows']} rows; share of prompts equal: "
           f"mean {s['greedy_equal_mean']:.1%}, lowest {s['greedy_equal_min']:.1%} (float32 is exact; in "
           "bf16 argmax near-ties flip)"] if "greedy_rows" in s else []),
        f"- rows whose timings held (profile and run timing dispersion <= 25%): {s['rows_timings_held']}; "
        "their "
        f"speedup error: median {s['speedup_err_median_held']:.1%}, max {s['speedup_err_max_held']:.1%}, "
        f"within 10%: {s['share_speedup_within_10pct_held']:.0%}",
    ]


def mixed_dtypes(table: pd.DataFrame) -> list[str]:
    """A warning line when the rows decoded in more than one dtype (``model.dtype=auto`` resolves per run:
    a bf16 sweep's row once ran in float32, methods.core.bf16), naming the rows outside the commonest."""
    if "dtype" not in table.columns:
        return []
    dtypes = table["dtype"].fillna("not recorded").astype(str)
    counts = dtypes.value_counts()
    if len(counts) < 2:
        return []
    main = counts.index[0]
    odd = ", ".join(f"{r} ({d})" for r, d in zip(table.loc[dtypes != main, "row_id"], dtypes[dtypes != main]))
    return [f"- **rows in another dtype than the other {counts[main]} rows' {main}**: {odd}; their errors "
            f"belong to another engine's numbers (run them again with model.dtype={main})"]


def _draws(table: pd.DataFrame) -> pd.DataFrame:
    d = draw_table(table).reset_index()
    shown = d.assign(temperature=d["temperature"].map(lambda x: f"{x:g}"),
                     **{"mean τ err": d["mean τ err"].map(pct),
                        "s.d.": d["s.d."].map(finite(".1%")),
                        "within 3%": d["within 3%"].map(lambda x: f"{x:.0%}")})
    return shown.rename(columns={"temperature": "T"})


def report(path: str | Path | Sequence[str | Path], worst: int = 10, insample: str | Path | None = None
           ) -> str:
    """The sweep at ``path`` as Markdown; with its in-sample rows (``insample``, default ``<path>_insample``
    where it exists: analysis.validation_insample) beside the test split's. Several sweeps (a sequence) are
    layered (:func:`load_layered`: a later sweep's row replaces an earlier one's; the in-sample default is
    the first sweep's) and the rows say which sweep each came from."""
    from analysis.validation_insample import default_out, insample_section

    paths = [path] if isinstance(path, (str, Path)) else list(path)
    df = load_layered(paths)
    table = errors(df)
    if table.empty:
        return f"no finished validation rows under {', '.join(map(str, paths))}"
    worst_rows = table.reindex(table["speedup_err"].abs().sort_values(ascending=False).index[:worst])
    lines = summary_lines(summary(table)) + mixed_dtypes(table)
    if len(paths) > 1:
        counts = table["sweep"].value_counts()
        lines.append("- rows by sweep (a later sweep's row replaces an earlier one's): " + ", ".join(
            f"{Path(p).name} {int(counts.get(Path(p).name, 0))}" for p in paths))
    parts = ["## Summary", *lines, "",
             "## Terms (mean contribution to S_pred/S_meas − 1)",
             to_markdown(term_table(table).map(pct).reset_index()), "",
             "## Signed τ error by prompt draw (the rows of a workload and temperature share their test "
             "prompts: their errors are not independent)", to_markdown(_draws(table)), "",
             f"## Worst {worst} rows by speedup error", to_markdown(row_table(worst_rows, sort=False)), "",
             "## Rows", to_markdown(row_table(table))]
    insample = Path(insample) if insample else default_out(Path(paths[0]))
    if insample.is_dir():
        parts[len(lines) + 2:0] = [*insample_section(table, insample), ""]
    bad = failures(df)
    if len(bad):
        parts += ["", "## Failed rows", to_markdown(bad)]
    return "\n".join(parts)


def layered_errors(paths: list[str | Path]) -> pd.DataFrame:
    """The validation table of several sweeps' rows, a later sweep's row replacing an earlier one's of the
    same ``row_id`` (a power study's rows with some of them run again)."""
    return errors(load_layered(paths))


def compare(before: pd.DataFrame, after: pd.DataFrame) -> str:
    """Markdown: each row of ``after`` (validation tables, :func:`errors`) beside the same row of
    ``before`` — measured τ, τ error, combined s.e., the two goals, speedup error — and a summary line over
    the rows both have (autoregressive rows left out: nothing to predict)."""
    a = before.set_index("row_id")
    b = after[(after["method"] != "autoregressive") & after["row_id"].isin(a.index)].set_index("row_id")
    b = b.sort_index()
    a = a.loc[b.index]
    if b.empty:
        return "no row of the second table is in the first"

    def arrow(x: pd.Series, y: pd.Series, fmt: Callable[[float], str]) -> list[str]:
        return [f"{fmt(u)} → {fmt(v)}" for u, v in zip(x, y)]

    def yes(ok: pd.Series) -> pd.Series:
        return ok.map(lambda v: "yes" if v else "no")

    table = pd.DataFrame({
        "row": b.index, "τ meas": arrow(a["tau_meas"], b["tau_meas"], "{:.2f}".format),
        "τ err": arrow(a["tau_err"], b["tau_err"], pct),
        "combined s.e.": arrow(a["tau_combined_se_rel"], b["tau_combined_se_rel"], finite(".1%")),
        "within 3%": arrow(yes(a["tau_ok"]), yes(b["tau_ok"]), str),
        "≤2σ": arrow(yes(a["tau_within_2se"]), yes(b["tau_within_2se"]), str),
        "S err": arrow(a["speedup_err"], b["speedup_err"], pct)})

    def both(stat: Callable[[pd.DataFrame], float], fmt: str = "{:.1%}") -> str:
        return f"{fmt.format(stat(a))} → {fmt.format(stat(b))}"

    line = (f"{len(b)} rows: |τ err| median {both(lambda t: t['tau_err'].abs().median())}, max "
            f"{both(lambda t: t['tau_err'].abs().max())}; within 3%: "
            f"{both(lambda t: t['tau_ok'].sum(), '{}')}; "
            f"combined s.e. median {both(lambda t: t['tau_combined_se_rel'].median())}; |S err| median "
            f"{both(lambda t: t['speedup_err'].abs().median())}, within 10%: "
            f"{both(lambda t: t['speedup_ok'].sum(), '{}')}")
    return "\n".join([to_markdown(table), "", line])


__all__ = ["TERMS", "compare", "failures", "layered_errors", "load_layered", "load_validation", "pct",
           "report", "row_table", "summary_lines"]
