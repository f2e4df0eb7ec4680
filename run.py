"""specsim's command line: compose the Hydra config, validate it, run one task, write the run's outputs.

The only Hydra-aware module (layering: specsim ← methods ← run.py). The dataclass schemas of
specsim.config are registered in Hydra's ConfigStore, so every yaml preset extends one and a typo, an
unknown key or a wrong type fails at compose time; ranges are checked by specsim.config.validate.
    python run.py                                   # measure the default (method=vanilla, tree=chain, zoo)
    python run.py task=simulate method=medusa tree=sequoia hardware=a100
    python run.py -m method=vanilla,medusa workload=code,grounded hydra/launcher=parallel
Outputs (contract in docs/architecture.md): metrics.json (+ samples.jsonl for measure) in the Hydra run dir.
"""

from __future__ import annotations

import dataclasses
import math
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
    EngineConfig,
    HardwareConfig,
    MethodConfig,
    ModelConfig,
    RunConfig,
    Task,
    TreeConfig,
    TreeKind,
    Verifier,
    WorkloadConfig,
    flat,
    validate,
)
from specsim.io import atomic_write_json, atomic_write_jsonl

METRICS, SAMPLES, FAILED = "metrics.json", "samples.jsonl", "failed.json"  # as analysis.sweep reads them
CONF = Path(__file__).resolve().parent / "conf"
# config group -> schema that its presets extend (`defaults: [base_<group>, _self_]`)
GROUP_SCHEMAS = {
    "method": MethodConfig,
    "tree": TreeConfig,
    "hardware": HardwareConfig,
    "model": ModelConfig,
    "workload": WorkloadConfig,
    "engine": EngineConfig,
}
PRESET_GROUPS = (*GROUP_SCHEMAS, "experiment")  # command-line choices: conf/<group>/<name>.yaml
Q_FREE_VERIFIERS = (Verifier.greedy, Verifier.deterministic, Verifier.typical)  # never read the draft's q


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
    return resolve_auto_dtype(validate(cfg))


def resolve_auto_dtype(cfg: RunConfig) -> RunConfig:
    """``model.dtype=auto`` (the zoo's) as the dtype a decoding task runs: bfloat16 where this device's bf16
    products are fast, float32 where they are slow (``methods.core.bf16``: CPUs without AVX512-BF16/AMX).
    A bf16-sized ``model.bytes_per_param`` follows a float32 choice. task=simulate keeps ``auto``
    (it imports no torch)."""
    if cfg.model.dtype != "auto" or cfg.task == Task.simulate:
        return cfg
    from methods.core.bf16 import speed_dtype
    from methods.models import resolve_device

    dtype = speed_dtype("bfloat16", resolve_device(cfg.device))
    size = 4.0 if dtype == "float32" and cfg.model.bytes_per_param == 2.0 else cfg.model.bytes_per_param
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype, bytes_per_param=size))


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
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_run_config(compose("config", overrides=list(overrides)))


# ---- checks before any work ----------------------------------------------------------------------------
def presets(group: str) -> list[str]:
    """The presets of a config group: conf/<group>/*.yaml (the ConfigStore's base_<group> schemas are not)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def check_choices(args: list[str]) -> None:
    """`group=name` on the command line must name a preset of conf/<group>/. Checked before Hydra composes:
    its own message would also offer the schemas (base_method) as choices, and print the search path."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    except Exception:  # noqa: BLE001 - a syntax error: Hydra reports it in its own words
        return
    for o in overrides:
        group, value = o.key_or_group, o.value()
        if group not in PRESET_GROUPS or o.package is not None or o.is_delete():
            continue
        values = value.list if isinstance(value, ChoiceSweep) else [value]
        allowed = presets(group)
        for v in values:
            if isinstance(v, str) and "${" not in v and v not in allowed:  # an interpolation: Hydra's
                raise ConfigError(f"{group}={v}: no such preset (conf/{group}/{v}.yaml); "
                                  f"choose one of: {', '.join(allowed)}")


def method_drafters() -> dict[str, str]:
    """method preset → its method.drafter, read from conf/method/*.yaml (following `defaults` to the
    preset it extends), without composing."""
    import yaml

    def drafter(name: str) -> str:
        data = yaml.safe_load((CONF / "method" / f"{name}.yaml").read_text()) or {}
        if "drafter" in data:
            return str(data["drafter"])
        parents = [d for d in data.get("defaults", []) if isinstance(d, str) and d in allowed]
        return drafter(parents[0]) if parents else MethodConfig.drafter

    allowed = presets("method")
    return {name: drafter(name) for name in allowed}


def check_runnable(cfg: RunConfig) -> None:
    """What a decoding task (measure, calibrate) needs from this checkout and this machine, checked before
    any work (models, zoo, heads): a drafter for the method and a verifier that fits it, the model's files,
    a draft model where the drafter decodes with one, the device. task=simulate needs none of them."""
    if cfg.task == Task.simulate:
        return
    _check_engine(cfg)
    from methods.drafters import registry  # cheap: the registry imports classes only when asked

    m, task = cfg.method, cfg.task.value
    if m.drafter not in registry.names():
        ready = [name for name, d in method_drafters().items() if d in registry.names()]
        raise ConfigError(
            f"method.drafter: method={m.name} drafts with {m.drafter!r}, which has no real-decoding drafter "
            f"in this checkout, so task={task} cannot run it; methods with a drafter: {', '.join(ready)} "
            f"(task=simulate works with every method)")
    if m.drafter in registry.DETERMINISTIC and m.verifier not in Q_FREE_VERIFIERS:
        raise ConfigError(
            f"method.verifier: {m.verifier.value} reads the draft probabilities q, but drafter {m.drafter} "
            f"(method={m.name}) drafts deterministically (q one-hot); use method.verifier=deterministic "
            "(lossless at any temperature) or greedy (temperature 0)")
    _check_model_files(cfg)
    if m.drafter in registry.NEEDS_DRAFT_MODEL:
        _check_draft_model(cfg)
    _check_device(cfg.device)


def _check_engine(cfg: RunConfig) -> None:
    """engine=vllm measures the methods vLLM implements; specsim's own loop decodes batches with the drafters
    that batch (methods.drafters.registry.BATCHABLE)."""
    if cfg.engine.name == "vllm":
        from methods.measurement.vllm_engine import (  # no vLLM import
            CHAIN_OF_DEPTH,
            INSTALL_HINT,
            VLLM_METHODS,
            available,
        )

        if cfg.task != Task.measure:
            raise ConfigError(f"engine.name: engine=vllm runs task=measure only, not task={cfg.task.value}")
        if cfg.method.drafter not in VLLM_METHODS:
            runs = [n for n, d in method_drafters().items() if d in VLLM_METHODS]
            raise ConfigError(
                f"engine.name: vLLM does not implement method={cfg.method.name} (drafter "
                f"{cfg.method.drafter}); engine=vllm runs: {', '.join(runs)}")
        chain_only = cfg.method.drafter not in ("autoregressive", *CHAIN_OF_DEPTH)  # EAGLE: its tree's depth
        if chain_only and TreeKind(cfg.tree.kind) != TreeKind.chain:
            raise ConfigError(f"tree.kind: vLLM speculates with chains; engine=vllm needs tree=chain (the "
                              f"chain's tree.gamma is its num_speculative_tokens), got tree={cfg.tree.name}")
        if not available():  # before the zoo, heads and profiles are built: a sweep's vllm job fails here
            raise ConfigError(f"engine.name: engine=vllm needs vLLM importable by this Python "
                              f"({sys.executable}). {INSTALL_HINT}")
    elif cfg.workload.batch_size > 1:
        from methods.drafters.registry import BATCHABLE  # a plain table: no drafter is imported

        how = BATCHABLE.get(cfg.method.drafter, "batched")  # an unknown drafter fails its own check later
        if how.startswith("no: "):
            batchable = [n for n, d in method_drafters().items()
                         if not BATCHABLE.get(d, "no: ").startswith("no: ")]
            raise ConfigError(
                f"workload.batch_size: method={cfg.method.name} (drafter {cfg.method.drafter}) cannot decode "
                f"batches ({how[4:]}); use workload.batch_size=1, or a method that batches: "
                f"{', '.join(batchable)}")


def _check_model_files(cfg: RunConfig) -> None:
    model = cfg.model
    if model.source not in ("hub", "local"):
        return
    for key, path in (("model.path", model.path), ("model.draft_path", model.draft_path)):
        problem = _checkpoint_problem(key, path, hub=model.source == "hub") if path else None
        if problem:
            raise ConfigError(f"{key}: {problem} (model={model.name}; specsim never downloads weights)")


def _checkpoint_problem(key: str, path: str, hub: bool) -> str | None:
    """Why ``path`` cannot be loaded without a download, and what to do; None when it can."""
    import re

    p = Path(path).expanduser()
    if p.is_dir():
        return None if (p / "config.json").is_file() else f"{path!r} is a directory without config.json"
    if p.exists():
        return f"{path!r} is a file, not a checkpoint directory"
    elsewhere = " or a hub name (org/name) already in the local Hugging Face cache" if hub else ""
    if not hub or path.startswith(("/", ".", "~")) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path):
        return f"no such directory {path!r}; set {key} to a local save_pretrained directory{elsewhere}"
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(path, "config.json"), str):
        return None
    return (f"{path!r} is not a local directory and not in the local Hugging Face cache; fetch it first "
            f"(`huggingface-cli download {path}`) or set {key} to a local save_pretrained directory")


def _check_draft_model(cfg: RunConfig) -> None:
    m, model = cfg.method, cfg.model
    if model.source in ("hub", "local"):
        ok, key = bool(model.draft_path), "model.draft_path"
        fix = "set model.draft_path to a draft checkpoint that shares the target's tokenizer"
    else:
        ok, key, fix = model.draft_n_layers >= 1, "model.draft_n_layers", "set model.draft_n_layers >= 1"
    if not ok:
        raise ConfigError(f"{key}: method={m.name} drafts with a separate draft model (drafter {m.drafter}) "
                          f"and model={model.name} has none; {fix}")


def _check_device(device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device[5:]) if device.startswith("cuda:") else 0
    if index >= count:
        raise ConfigError(f"device: {device} requested but torch sees {count} CUDA device(s); use "
                          "device=auto (cuda when there is one, else cpu) or device=cpu")


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
        if cfg.workload.batch_size > 1:  # the batched step: speedup at B, B*, the curve over B
            from specsim.batch import batch_metrics

            single = {f"{k}_batch1": prediction[k] for k in ("predicted_tau", "predicted_speedup")}
            prediction.update({**single, **batch_metrics(cfg)})
        return TaskResult(prediction, None, _prediction_lines(prediction))
    if cfg.task == Task.measure:
        if cfg.engine.name == "vllm":
            measure = _import_task("methods.measurement.vllm_measure", "measure_vllm", cfg.task)
        else:
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
    ] + ([f"at batch {p['batch_size']} (speedup of the batched step); break-even batch B*: "
          f"{_fmt(p.get('break_even_batch'), '.1f')}"] if p.get("batch_size", 1) > 1 else [])


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _tau_se(m: dict[str, Any]) -> float | None:
    """The measured τ's relative standard error where there is one (none, or 0 without any spread: None)."""
    se = m.get("tau_se_rel")
    return se if _number(se) and se > 0 else None


def _tau_spread(m: dict[str, Any]) -> str:
    """The measured τ's standard error and the prompts behind it: at the default's sizes the prompts' own
    spread is several percent, the scale on which a prediction can be judged."""
    se, n = _tau_se(m), m.get("num_prompts")
    if se is None:
        return ""
    return f" ± {se:.1%} (s.e. over {n} prompts)" if n else f" ± {se:.1%} (s.e.)"


def _tau_error(m: dict[str, Any]) -> str:
    """The prediction's signed error against the measured τ, and in the measured s.e. where one is known."""
    tau, pred, se = m.get("tau"), m.get("predicted_tau"), _tau_se(m)
    if not (_number(tau) and _number(pred)) or tau <= 0:
        return ""
    err = pred / tau - 1
    in_se = f", {err / se:+.1f} s.e." if se is not None else ""
    return f" ({err:+.1%}{in_se})"


def _measure_lines(m: dict[str, Any], hardware: str) -> list[str]:
    here = m.get("predicted_speedup_this_device", m.get("predicted_speedup"))  # what this run validates
    # the prediction of the decode alone (the run's generation length, no prefill) goes beside decode_speedup
    decode_here = m.get("predicted_decode_speedup_this_device", m.get("predicted_decode_speedup"))
    speedup, decode = _fmt(m.get("speedup"), ".2f"), ""
    predicted = f"predicted {_fmt(here, '.2f')}x"
    if "decode_speedup" in m:
        decode = f", {_fmt(m['decode_speedup'], '.2f')}x decode only"
        if isinstance(decode_here, (int, float)):
            predicted = f"predicted {decode_here:.2f}x decode only"
    engine = f" ({m['engine']}, batch {m.get('batch_size', 1)})" if "engine" in m else ""
    if not engine and m.get("batch_size", 1) > 1:  # specsim's batched loop
        engine = f" (batch {m['batch_size']}{', continuous' if m.get('continuous') else ''})"
    lines = [
        f"tau {_fmt(m.get('tau'), '.3f')}{_tau_spread(m)}, predicted {_fmt(m.get('predicted_tau'), '.3f')}"
        f"{_tau_error(m)}",
        f"{_fmt(m.get('tokens_per_s'), '.1f')} tokens/s vs {_fmt(m.get('baseline_tokens_per_s'), '.1f')} "
        f"autoregressive{engine}: speedup {speedup}x{decode} ({predicted} on this device)",
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


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")  # absolute: import-safe
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
        check_runnable(cfg)
        seed_everything(cfg.seed, with_torch=cfg.task != Task.simulate, threads=cfg.threads)
        if cfg.compile and cfg.task != Task.simulate:
            from methods.core.engine import set_compile

            set_compile(True)
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
        _exit_clean(e)
    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    print(f"Error: the run failed ({type(e).__name__}); nothing was written.", file=sys.stderr)
    sys.exit(1)


def _exit_clean(e: ConfigError | TaskUnavailable) -> None:
    kind = "invalid config" if isinstance(e, ConfigError) else "task not available"
    print(f"Error ({kind}): {e}. Nothing was written.", file=sys.stderr)
    sys.exit(2)


def cli() -> None:
    """`python run.py ARGS`: the command-line choices, then Hydra's composition and main."""
    register_configs()
    try:
        check_choices(sys.argv[1:])
    except ConfigError as e:
        _exit_clean(e)
    main()


if __name__ == "__main__":
    cli()
