"""specsim's command line: compose the Hydra config, validate it, run one task, write the run's outputs.

The only Hydra-aware module (layering: specsim ← methods ← run.py). The dataclass schemas of
specsim.config are registered in Hydra's ConfigStore, so every yaml preset extends one and a typo, an
unknown key or a wrong type fails at compose time; ranges are checked by specsim.config.validate.
    python run.py                                   # simulate the default config (method=vanilla, tree=chain)
    python run.py task=simulate method=medusa tree=sequoia hardware=a100
    python run.py -m method=vanilla,medusa workload=code,grounded hydra/launcher=parallel
Outputs (contract in DESIGN.md): metrics.json (+ samples.jsonl for measure) in the Hydra run dir.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from specsim.config import (
    ConfigError,
    HardwareConfig,
    MethodConfig,
    ModelConfig,
    RunConfig,
    Task,
    TreeConfig,
    WorkloadConfig,
    flat,
    validate,
)
from specsim.io import atomic_write_json, atomic_write_jsonl

METRICS, SAMPLES, FAILED = "metrics.json", "samples.jsonl", "failed.json"  # as analysis.sweep reads them
# config group -> schema that its presets extend (`defaults: [base_<group>, _self_]`)
GROUP_SCHEMAS = {
    "method": MethodConfig,
    "tree": TreeConfig,
    "hardware": HardwareConfig,
    "model": ModelConfig,
    "workload": WorkloadConfig,
}


class TaskUnavailable(RuntimeError):
    """The task's implementation is not in this checkout yet (a later issue)."""


@dataclass
class TaskResult:
    metrics: dict[str, Any]
    samples: list[dict[str, Any]] | None = None
    summary: list[str] = field(default_factory=list)


def register_configs(cs: ConfigStore | None = None) -> None:
    """Store the schemas: `base_config` (primary) and `<group>/base_<group>` (what presets extend)."""
    cs = cs or ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)


def to_run_config(dcfg: DictConfig) -> RunConfig:
    """The composed DictConfig as a validated RunConfig; every problem is a ConfigError naming the key."""
    _check_known_keys(dcfg, "")
    try:
        cfg = OmegaConf.to_object(dcfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key}: required, no value given (set it on the command line: "
                          f"{e.full_key}=...)") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None
    assert isinstance(cfg, RunConfig), f"primary config must extend base_config, got {type(cfg).__name__}"
    return validate(cfg)


def _check_known_keys(node: DictConfig, prefix: str) -> None:
    """Reject keys the schema does not have. Compose already rejects `method.gama=3`; this catches
    `+method.gama=3`, which Hydra adds to a structured node (and to_object would keep)."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return  # a free-form dict (method.params)
    allowed = [f.name for f in dataclasses.fields(schema)]
    for key in node.keys():
        if key not in allowed:
            raise ConfigError(f"{prefix}{key}: not a key of {schema.__name__}; allowed: {', '.join(allowed)}")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _check_known_keys(child, f"{prefix}{key}.")


def compose_run_config(*overrides: str) -> RunConfig:
    """The validated RunConfig that `python run.py OVERRIDES` would run, for scripts and notebooks that
    need one without the command line (benchmarks): hydra stays inside run.py."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent / "conf"), version_base="1.3"):
        return to_run_config(compose("config", overrides=list(overrides)))


def seed_everything(seed: int, with_torch: bool, threads: int = 0) -> None:
    """Seed once, here; code below receives explicit generators. torch only when the task loads it."""
    random.seed(seed)
    np.random.seed(seed)
    if with_torch:
        import torch

        torch.manual_seed(seed)
        if threads:
            torch.set_num_threads(threads)


def execute(cfg: RunConfig, out_dir: Path) -> TaskResult:
    """Dispatch on cfg.task. methods/ is imported lazily: task=simulate never imports torch."""
    if cfg.task == Task.simulate:
        from specsim.predict import simulate

        prediction = simulate(cfg).to_dict()
        return TaskResult(prediction, None, _prediction_lines(prediction))
    if cfg.task == Task.measure:
        measure = _import_task("methods.measurement.measure", "measure", cfg.task)
        result = measure(cfg)
        lines = _measure_lines(result.metrics, cfg.hardware.name)
        return TaskResult(dict(result.metrics), list(result.samples), lines)
    calibrate = _import_task("methods.measurement.calibrate", "calibrate", cfg.task)
    result = calibrate(cfg, out_dir)
    metrics = dict(getattr(result, "metrics", result) or {})
    return TaskResult(metrics, None, [f"calibration written to {out_dir}"])


def _import_task(module: str, name: str, task: Task) -> Any:
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise  # a dependency of the module is missing: a real error, keep its traceback
        raise TaskUnavailable(
            f"task={task.value} is not available in this checkout "
            f"({module.replace('.', '/')}.py is missing); available now: task=simulate"
        ) from None


def run_metrics(cfg: RunConfig, results: dict[str, Any], experiment: str | None = None) -> dict[str, Any]:
    """metrics.json: identity keys first (contract), the config's scalar inputs, then the results."""
    identity = {
        "task": cfg.task.value,
        "method": cfg.method.name,
        "tree": cfg.tree.name,
        "hardware": cfg.hardware.name,
        "workload": cfg.workload.name,
        "model": cfg.model.name,
        "seed": cfg.seed,
    }
    if experiment:
        identity["experiment"] = experiment
    out = dict(identity)
    out.update({k: v for k, v in flat(cfg).items() if k not in identity})
    out.update({k: v for k, v in results.items() if k not in identity})
    return out


def write_outputs(out_dir: Path, metrics: dict[str, Any], samples: list[dict[str, Any]] | None) -> None:
    """samples first, metrics.json last: its presence marks a completed run (sweeps skip those)."""
    if samples is not None:
        atomic_write_jsonl(out_dir / SAMPLES, samples)
    atomic_write_json(out_dir / METRICS, metrics)


def _fmt(x: Any, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "n/a"


def _prediction_lines(p: dict[str, Any]) -> list[str]:
    return [
        f"tree: {p.get('tree_size', '?')} tokens incl. root, depth {p.get('tree_depth', '?')}",
        f"predicted tau (tokens per target forward): {_fmt(p.get('predicted_tau'), '.3f')}",
        f"predicted speedup over autoregressive: {_fmt(p.get('predicted_speedup'), '.2f')}x",
    ]


def _measure_lines(m: dict[str, Any], hardware: str) -> list[str]:
    here = m.get("predicted_speedup_this_device", m.get("predicted_speedup"))  # what this run validates
    speedup, predicted = _fmt(m.get("speedup"), ".2f"), _fmt(here, ".2f")
    lines = [
        f"tau {_fmt(m.get('tau'), '.3f')} (predicted {_fmt(m.get('predicted_tau'), '.3f')})",
        f"{_fmt(m.get('tokens_per_s'), '.1f')} tokens/s vs {_fmt(m.get('baseline_tokens_per_s'), '.1f')} "
        f"autoregressive: speedup {speedup}x, {_fmt(m.get('decode_speedup'), '.2f')}x without prefill "
        f"(predicted {predicted}x on this device)",
    ]
    if "predicted_speedup_hardware" in m:  # a drafter's measured profile: the run's hardware preset too
        lines.append(f"predicted on the {hardware} preset's roofline: "
                     f"{_fmt(m.get('predicted_speedup_hardware'), '.2f')}x")
    return lines


def _remove_run_dir(out_dir: Path, cwd: Path) -> None:
    """Delete a failed run's dir, and the parents it created inside the working dir if now empty."""
    shutil.rmtree(out_dir, ignore_errors=True)
    parent = out_dir.parent
    while parent != cwd and cwd in parent.parents:
        try:
            parent.rmdir()  # only succeeds when empty
        except OSError:
            break
        parent = parent.parent


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    hc = HydraConfig.get()
    out_dir, sweeping = Path(hc.runtime.output_dir), hc.mode == RunMode.MULTIRUN
    experiment = hc.runtime.choices.get("experiment")
    if sweeping:
        from analysis.sweep import completed

        if completed(out_dir):
            print(f"[skip] {out_dir} already has {METRICS}")
            return
    try:
        cfg = to_run_config(dcfg)
        seed_everything(cfg.seed, with_torch=cfg.task != Task.simulate, threads=cfg.threads)
        result = execute(cfg, out_dir)
        write_outputs(out_dir, run_metrics(cfg, result.metrics, experiment), result.samples)
        if result.metrics.get("drafter_updates") is not None:  # a drafter that learns while serving
            from analysis.online import save_run_curve

            save_run_curve(out_dir, result.metrics)
    except (ConfigError, TaskUnavailable) as e:
        _fail(e, out_dir, Path(hc.runtime.cwd), sweeping, expected=True)
        return
    except Exception as e:
        _fail(e, out_dir, Path(hc.runtime.cwd), sweeping, expected=False)
        return
    except BaseException:  # Ctrl-C, kill: a single run leaves nothing; a sweep job stays unfinished
        if not sweeping:
            _remove_run_dir(out_dir, Path(hc.runtime.cwd))
        raise
    (out_dir / FAILED).unlink(missing_ok=True)  # a retried job that now succeeded
    title = f"{cfg.task.value}: method={cfg.method.name} tree={cfg.tree.name} hardware={cfg.hardware.name} " \
            f"workload={cfg.workload.name} model={cfg.model.name}"
    print("\n  ".join([title, *result.summary, f"-> {out_dir / METRICS}"]))


def _fail(e: BaseException, out_dir: Path, cwd: Path, sweeping: bool, expected: bool) -> None:
    """A sweep records the failure (failed.json) and goes on; a single run leaves nothing and exits 2.
    Expected failures (bad config, task not available) print one paragraph and no traceback."""
    if sweeping:
        from analysis.sweep import record_failure

        record_failure(out_dir, e)
        print(f"[failed] {out_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        return
    _remove_run_dir(out_dir, cwd)
    if expected:
        kind = "invalid config" if isinstance(e, ConfigError) else "task not available"
        print(f"Error ({kind}): {e}. Nothing was written.", file=sys.stderr)
        sys.exit(2)
    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    print(f"Error: the run failed ({type(e).__name__}); nothing was written.", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
    register_configs()
    main()
