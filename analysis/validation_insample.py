"""A finished sweep's rows re-run in-sample (issue 17, part 1): on the calibration split's own prompts, as
their profile was calibrated (prompts, count, new tokens, seed), with the very profile the row was
predicted with. A row's τ error on the test split mixes the model's error with the two splits' difference
(each ~55 stdlib modules); in-sample, only the model's error is left (and, at T = 1, fresh sampling noise).

    python -m analysis.validation insample SWEEP_DIR [--rows PATTERNS] [--tau-misses] [--out DIR]

Each row runs as ``run.py experiment=validation <the row's overrides> workload.split=calibration ...
calibration.cached_only=true`` into ``<out>/<row id>/`` (resumable like ``run``). ``cached_only`` makes the
run fail rather than calibrate anew; a run whose profile is another file than the sweep row's is refused
too (its metrics.json set aside as metrics.rejected.json, failed.json written).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from analysis import validation_rows as vr
from analysis.sweep import FAILED, completed
from specsim.io import atomic_write_json, cache_root

SUFFIX = "_insample"
REJECTED = "metrics.rejected.json"


def default_out(sweep: Path) -> Path:
    """Where a sweep's in-sample rows go: beside it, ``<sweep>_insample``."""
    sweep = Path(sweep).resolve()
    return sweep.with_name(sweep.name + SUFFIX)


def _metrics(row_dir: Path) -> dict:
    return json.loads((Path(row_dir) / "metrics.json").read_text())


def profile_name(row_dir: Path) -> str | None:
    """The file name of the profile the sweep row was predicted with (None: no profile, autoregressive)."""
    path = _metrics(row_dir).get("profile_path")
    return Path(path).name if path else None


def row_overrides(row_dir: Path) -> list[str]:
    """The sweep row's own overrides (validation_row.json)."""
    doc = vr.read_row(Path(row_dir)) or {}
    if "overrides" not in doc:
        raise ValueError(f"{row_dir}: no validation_row.json with the row's overrides")
    return list(doc["overrides"])


def acceptance_tokens(row_dir: Path, cache: Path, calibration_tokens: int) -> int:
    """New tokens per calibration prompt that the row's acceptance was measured on: the profile's loop's
    (``loop_new_tokens``: a loop drafter's acceptance comes from decoding every calibration prompt as long as
    the workload's generations; every other drafter's loop decodes ``calibration_tokens``, the calibration's
    new tokens, which a profile without the record takes too); a dynamic tree's, the tokens its trees were
    recorded on."""
    m = _metrics(row_dir)
    if m.get("dynamic_shapes_path"):
        return int(json.loads((Path(cache) / "profiles" / Path(m["dynamic_shapes_path"]).name).read_text())
                   ["new_tokens"])
    profile = json.loads((Path(cache) / "profiles" / Path(m["profile_path"]).name).read_text())
    return int(profile.get("extra", {}).get("loop_new_tokens") or calibration_tokens)


def insample_overrides(row_dir: Path, cache: Path) -> list[str]:
    """The row's overrides, then the calibration split as the row's profile (in ``cache``) was calibrated on
    it: the calibration's prompts and seed read from the row's own config (.hydra/config.yaml), the new
    tokens its acceptance was measured on (:func:`acceptance_tokens`). The calibration's own length is
    pinned: it follows the workload's by default and is in the profile key, so a run of another length
    would look for another profile."""
    row_dir = Path(row_dir)
    cfg = OmegaConf.load(row_dir / ".hydra" / "config.yaml")
    calibrated = int(cfg.calibration.new_tokens)
    tokens = acceptance_tokens(row_dir, cache, calibrated)
    return [*row_overrides(row_dir), "workload.split=calibration",
            f"workload.num_prompts={int(cfg.calibration.prompts)}", f"workload.max_new_tokens={tokens}",
            "workload.tau_se_target=0", f"seed={int(cfg.seed)}", f"calibration.new_tokens={calibrated}",
            "calibration.cached_only=true"]


def refusals(row_dirs: Sequence[Path], cache: Path) -> dict[Path, str]:
    """Why :func:`check_cached` refuses each refused row (a profile whose timings scattered is never
    cached, so its rows are refused)."""
    out = {}
    for d in row_dirs:
        try:
            check_cached(d, cache)
        except ValueError as e:
            out[d] = str(e)
    return out


def dry_run_lines(selected: list[Path], cache: Path) -> list[str]:
    """What ``insample --dry-run`` prints: each row's in-sample overrides, or why it would be refused."""
    refused = refusals(selected, cache)
    return [f"{d.name} refused: {refused[d]}" if d in refused else
            f"{d.name} {' '.join(insample_overrides(d, cache))}" for d in selected]


def insample_row(row_dir: Path, cache: Path) -> vr.Row:
    doc = vr.read_row(Path(row_dir)) or {}
    return vr.Row(doc["method"], doc["tree"], doc["workload"], float(doc["temperature"]),
                  tuple(insample_overrides(row_dir, cache)))


def check_cached(row_dir: Path, cache: Path) -> None:
    """Refuse (ValueError) a row whose profile is not in ``cache`` — its run would calibrate anew — or is
    another calibration than the one the row was predicted with (its t(1), timed once per calibration,
    differs from the row's ``profile_t1_s``: a later row of the sweep measured it again)."""
    name = profile_name(row_dir)
    if not name:
        return
    path = Path(cache) / "profiles" / name
    if not path.is_file():
        raise ValueError(f"{Path(row_dir).name}: its profile {name} is not in {cache}/profiles: the run "
                         "would calibrate anew (copy the sweep's profiles there)")
    cached, used = json.loads(path.read_text()).get("t_ar_s"), _metrics(row_dir).get("profile_t1_s")
    if used is not None and cached != used:
        raise ValueError(f"{Path(row_dir).name}: {path} is another calibration than the row's (t(1) {cached} "
                         f"against the row's {used}): it was measured again after the row")


def check_same_profile(row_dir: Path, run_dir: Path) -> str:
    """"" when the in-sample run used the sweep row's profile (the same file, the same calibration's t(1));
    else why not, with its metrics set aside (metrics.rejected.json) and failed.json written, so that no
    report reads it."""
    want, got = _metrics(row_dir), _metrics(run_dir)
    names = [Path(m["profile_path"]).name if m.get("profile_path") else None for m in (want, got)]
    t1s = [m.get("profile_t1_s") for m in (want, got)]
    if names[0] == names[1] and (None in t1s or t1s[0] == t1s[1]):
        return ""
    why = (f"the in-sample run used profile {names[1]} (t(1) {t1s[1]}), the sweep row {names[0]} "
           f"(t(1) {t1s[0]})")
    (Path(run_dir) / "metrics.json").replace(Path(run_dir) / REJECTED)
    atomic_write_json(Path(run_dir) / FAILED, {"status": "failed", "error": why})
    return why


def select(sweep: Path, patterns: Sequence[str] | None = None, tau_misses: bool = False) -> list[Path]:
    """The sweep's finished rows with a profile, matching one of ``patterns`` (shell patterns of the row
    id) or, with ``tau_misses``, missing the τ goal; both: either."""
    import fnmatch

    dirs = sorted(d for d in Path(sweep).iterdir() if completed(d) and profile_name(d))
    if not patterns and not tau_misses:
        return dirs
    keep = {d for d in dirs if any(fnmatch.fnmatchcase(d.name, p) for p in patterns or ())}
    if tau_misses:
        from analysis.validation_report import load_validation
        from analysis.validation_terms import errors

        table = errors(load_validation(sweep))
        missed = set(table.loc[~table["tau_ok"].astype(bool), "row_id"])
        keep |= {d for d in dirs if d.name in missed}
    return [d for d in dirs if d in keep]


def run_insample(row_dirs: Sequence[Path], out: Path, cache: Path | None = None,
                 python: str = sys.executable, deadline: float | None = None) -> list[vr.Outcome]:
    """Re-run each row in-sample under ``out`` (resumable; several drivers may share it). A row that
    :func:`check_cached` refuses is not run: its outcome is "refused" (every refusal is known before the
    first run), and the other rows run."""
    cache = cache or cache_root()
    refused = refusals(row_dirs, cache)
    outcomes, runnable = [], [d for d in row_dirs if d not in refused]
    for d, why in refused.items():
        doc = vr.read_row(Path(d)) or {}
        row = vr.Row(doc.get("method", ""), doc.get("tree", ""), doc.get("workload", ""),
                     float(doc.get("temperature", 0.0)), ())
        outcomes.append(vr.Outcome(row, "refused", 0.0, why))
        print(f"{Path(d).name}: refused: {why}", file=sys.stderr, flush=True)
    by_id = {Path(d).name: Path(d) for d in runnable}
    rows = [insample_row(d, cache) for d in runnable]
    return outcomes + vr.run_rows(rows, Path(out), python, deadline,
                                  check=lambda row, run_dir: check_same_profile(by_id[row.row_id], run_dir))


# ---- the report's section ---------------------------------------------------------------------------------
def insample_table(test: pd.DataFrame, inside: pd.DataFrame) -> pd.DataFrame:
    """The rows of both tables (analysis.validation_terms.errors of the sweep and of its in-sample rows),
    in-sample τ error beside the test split's. ``insample_se``: the in-sample τ's sampling error at T > 0
    (the run samples afresh; NaN at T = 0, where the run decodes the calibration's own tokens)."""
    t = inside.merge(test[["row_id", "tau_pred", "tau_meas", "tau_err"]], on="row_id", suffixes=("", "_test"))
    sampled = t["temperature"].astype(float) > 0
    return pd.DataFrame({
        "row_id": t["row_id"], "method": t["method"], "tree": t["row_tree"], "workload": t["workload"],
        "temperature": t["temperature"].astype(float), "tau_pred": t["tau_pred"],
        "tau_insample": t["tau_meas"], "insample_err": t["tau_err"],
        "insample_se": t["tau_combined_se_rel"].where(sampled),
        "tau_test": t["tau_meas_test"], "test_err": t["tau_err_test"],
        "same_prediction": np.isclose(t["tau_pred"], t["tau_pred_test"], rtol=1e-9),
    }).sort_values(["method", "tree", "workload", "temperature"]).reset_index(drop=True)


def insample_markdown(table: pd.DataFrame) -> list[str]:
    """Summary lines and the table, as Markdown lines."""
    from analysis.tables import to_markdown
    from analysis.validation_report import finite, pct
    from analysis.validation_terms import TAU_GOAL

    err, test = table["insample_err"].abs(), table["test_err"].abs()
    sampled = table["insample_se"].notna()
    beyond = (err > 2 * table["insample_se"]) & sampled
    lines = [
        f"- rows: {len(table)} (same profile and same predicted τ as the sweep's row: "
        f"{int(table['same_prediction'].sum())})",
        f"- in-sample τ error: median {err.median():.1%}, max {err.max():.1%}; within 3%: "
        f"{(err <= TAU_GOAL).mean():.0%} of rows; T > 0 rows beyond 2 s.e.: {int(beyond.sum())} of "
        f"{int(sampled.sum())}",
        f"- the same rows on the test split: median {test.median():.1%}, max {test.max():.1%}; within 3%: "
        f"{(test <= TAU_GOAL).mean():.0%}",
        f"- test-split misses (> 3%) that are in-sample within 3% (the split's): "
        f"{int(((test > TAU_GOAL) & (err <= TAU_GOAL)).sum())} of {int((test > TAU_GOAL).sum())}",
    ]
    three = "{:.3f}".format
    shown = pd.DataFrame({
        "method": table["method"], "tree": table["tree"], "workload": table["workload"],
        "T": table["temperature"].map(lambda x: f"{x:g}"), "τ pred": table["tau_pred"].map(three),
        "τ in-sample": table["tau_insample"].map(three), "in-sample err": table["insample_err"].map(pct),
        "s.e. (T > 0)": table["insample_se"].map(finite(".1%")), "τ test": table["tau_test"].map(three),
        "test err": table["test_err"].map(pct),
    })
    return [*lines, "", to_markdown(shown)]


def insample_section(test: pd.DataFrame, path: Path) -> list[str]:
    """The report's in-sample section from the rows under ``path`` ([] when none finished)."""
    from analysis.validation_report import load_validation
    from analysis.validation_terms import errors

    inside = errors(load_validation(path))
    if inside.empty:
        return []
    return ["## In-sample: the rows again on the calibration split, with the same profile (the model's error "
            "alone; the test split's error also holds the two splits' difference)",
            *insample_markdown(insample_table(test, inside))]
