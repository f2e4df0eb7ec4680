"""A cached profile against the run that reads it: is its t(1) still this machine's?

A profile's costs are ratios of t(1), the decode loop's autoregressive step (methods.measurement.cost_table).
Every task=measure run also decodes its prompts autoregressively (the same-run baseline), so it measures its
own t(1). When the two disagree by more than :data:`T1_TOLERANCE` the machine was not in the state it was
calibrated in (busy then, or busy now): the run says so on stderr and in metrics.json, predicts with its own
t(1) times the profile's ratios, and marks the cached profile stale, so that the next run measures it again.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from methods.core.timing import relative_iqr
from methods.measurement.profiles import Profile, profile_lock
from specsim.io import atomic_write_json, read_json

T1_TOLERANCE = 0.25  # stale when the profile's t(1) is over 1.25× or under 1/1.25× the run's own


def t1_disagrees(profile_t1: float, run_t1: float, tolerance: float = T1_TOLERANCE) -> bool:
    """True when the two t(1) differ by more than ``tolerance`` (relative, in either direction)."""
    ratio = profile_t1 / run_t1
    return max(ratio, 1.0 / ratio) > 1.0 + tolerance


def judge_profile(profile: Profile, path: Path, run_steps: Sequence[float]) -> tuple[Profile, dict[str, Any]]:
    """Compare ``profile``'s t(1) with the run's own autoregressive step (``run_steps``: seconds per step of
    each baseline decode, prefill left out). Returns the profile to predict with — re-anchored on the run's
    t(1) when stale — and the metrics.json keys of the comparison. A stale profile cached at ``path`` is
    marked so (:func:`mark_stale`)."""
    run_t1 = sorted(run_steps)[len(run_steps) // 2] if run_steps else 0.0
    out: dict[str, Any] = {
        "profile_t1_s": profile.t_ar_s, "run_t1_s": run_t1,
        "profile_t1_ratio": profile.t_ar_s / run_t1 if run_t1 > 0 else None,
        "profile_t1_tolerance": T1_TOLERANCE,
        "timing_dispersion": profile.worst_dispersion,  # of the profile's timing rounds (ratios and t(1))
        "timing_dispersion_by_series": dict(profile.timing_dispersion),
        "run_t1_dispersion": relative_iqr(run_steps),  # of this run's baseline, prompt by prompt
    }
    stale = run_t1 > 0 and t1_disagrees(profile.t_ar_s, run_t1)
    out.update(profile_stale=stale, prediction_t1_source="run" if stale else "profile")
    if not stale:
        return profile, out
    why = (f"its t(1) {profile.t_ar_s * 1e3:.2f} ms is {profile.t_ar_s / run_t1:.2f}x this run's own "
           f"autoregressive step {run_t1 * 1e3:.2f} ms (tolerance {T1_TOLERANCE:.0%})")
    marked = mark_stale(path, profile, why)
    print(f"measure: the device profile is stale: {why}; predicting with this run's t(1) and the profile's "
          f"ratios; {'marked stale: the next run re-measures it' if marked else 'it was not cached'} "
          f"({path})", file=sys.stderr, flush=True)
    return profile.with_t1(run_t1), out


def mark_stale(path: Path, profile: Profile, why: str) -> bool:
    """Mark the cached profile at ``path`` stale (methods.measurement.calibrate.ensure_profile measures it
    again), if it is still the one judged — another run may have re-measured it meanwhile. True if marked."""
    with profile_lock(path):
        if not path.is_file():
            return False
        doc = read_json(path)
        if doc.get("key") != profile.key or doc.get("created") != profile.created:
            return False
        atomic_write_json(path, {**doc, "stale": why})
    return True
