"""analysis: read specsim run outputs (metrics.json + .hydra/ per run dir, any sweep) into tidy pandas
tables; compare the simulator's predicted τ and speedup with measurements; render tables and figures.

Imports pandas/seaborn but never hydra or torch (layering: analysis reads outputs and may use specsim).
"""

from analysis.compare import error_summary, prediction_error
from analysis.load import load, load_samples, sweep_axes
from analysis.sweep import completed, job_status, latest_sweep, list_sweeps

__all__ = [
    "completed", "error_summary", "job_status", "latest_sweep", "list_sweeps", "load", "load_samples",
    "prediction_error", "sweep_axes",
]
