"""A multirun sweep killed halfway and re-run into the same sweep dir completes, without duplicates (issue 5).

Simulate jobs are used (no torch, ~1 s each) so the kill lands between jobs of a real Hydra sweep; the
resume logic in run.py is the same for measure jobs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GRID = ["method=vanilla,prompt_lookup", "tree=chain,kary", "workload=code,grounded"]  # 2×2×2


def _sweep_cmd(sweep_dir: Path) -> list[str]:
    return [sys.executable, "run.py", "-m", "task=simulate", *GRID, f"hydra.sweep.dir={sweep_dir}"]


def _done(sweep_dir: Path) -> list[Path]:
    return sorted(sweep_dir.glob("*/metrics.json"))


@pytest.mark.slow
def test_killed_sweep_resumes_without_duplicates(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(
        _sweep_cmd(sweep), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while len(_done(sweep)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # halfway: some jobs done, the rest never started
    proc.wait()
    first = {p.parent.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in _done(sweep)}
    assert 3 <= len(first) < 8, f"the kill should land mid-sweep, {len(first)} of 8 jobs were done"

    out = subprocess.run(_sweep_cmd(sweep), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("[skip]") == len(first), out.stdout

    done = _done(sweep)
    assert len(done) == 8, [p.parent.name for p in done]
    job_dirs = [d for d in sweep.iterdir() if d.is_dir()]
    assert len(job_dirs) == 8, sorted(d.name for d in job_dirs)  # one dir per grid point, none duplicated
    for name, (mtime, data) in first.items():  # completed jobs were not re-run or rewritten
        p = sweep / name / "metrics.json"
        assert p.stat().st_mtime_ns == mtime and p.read_bytes() == data
    combos = {(m["method"], m["tree"], m["workload"]) for m in (json.loads(p.read_text()) for p in done)}
    assert len(combos) == 8
