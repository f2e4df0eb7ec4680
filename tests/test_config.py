"""The real config (conf/) composes for every preset of every group and every experiment, converts to a
RunConfig and passes validate; typos, wrong types and out-of-range values fail with the key named."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import OmegaConf

from specsim.config import RANGES, ConfigError, Range, RunConfig, Task, TreeKind, Verifier, validate

CONF = Path(__file__).resolve().parents[1] / "conf"


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


GROUPS = ("method", "tree", "hardware", "workload", "model")
# presets that need a value only the user can give (validate says so when it is missing)
REQUIRED = {("model", "hub"): ["model.path=meta-llama/Llama-2-7b-hf"],
            ("model", "local"): ["model.path=/ckpt/target"]}
CASES = [(g, name) for g in GROUPS for name in presets(g)]


def test_every_group_has_presets():
    for group in GROUPS:
        assert presets(group), f"conf/{group}/ has no presets"
    assert {"a100", "a100_40gb", "a100_80gb", "h100", "h200", "l40", "rtx4090", "l40_offload", "cpu"} <= set(
        presets("hardware"))
    assert {"none", "chain", "kary", "medusa", "sequoia", "dynamic"} <= set(presets("tree"))
    mission = {"autoregressive", "vanilla", "prompt_lookup", "medusa", "eagle", "eagle2", "eagle3", "sequoia",
               "lookahead", "staged", "specinfer", "online", "layerskip", "draft_verify", "mtp"}
    assert mission <= set(presets("method"))
    assert {"code", "prose", "grounded", "mixed"} <= set(presets("workload"))
    models = {"zoo", "micro", "random_tiny", "random_12x768", "random_24x1024", "llama2_7b", "hub", "local"}
    assert models <= set(presets("model"))


@pytest.mark.parametrize(("group", "name"), CASES, ids=[f"{g}={n}" for g, n in CASES])
def test_preset_composes_and_validates(run_config, group, name):
    cfg = run_config(f"{group}={name}", *REQUIRED.get((group, name), []))
    assert isinstance(cfg, RunConfig)
    assert getattr(cfg, group).name == name, f"conf/{group}/{name}.yaml must set name: {name}"
    assert validate(cfg) is cfg


def test_default_config(run_config):
    cfg = run_config()
    assert cfg.task in (Task.simulate, Task.measure)
    assert (cfg.method.name, cfg.tree.name, cfg.hardware.name, cfg.workload.name, cfg.model.name) == (
        "vanilla", "chain", "cpu", "code", "zoo")


@pytest.mark.parametrize("method", presets("method"))
def test_method_brings_a_tree_that_fits(run_config, method):
    """Each method preset picks its natural tree; `tree=` on the command line still wins."""
    cfg = run_config(f"method={method}")
    if cfg.method.drafter == "autoregressive":
        assert cfg.tree.kind == TreeKind.none
    else:
        assert cfg.tree.kind != TreeKind.none, f"method={method} drafts nothing with tree={cfg.tree.name}"
    assert cfg.method.lossless == (cfg.method.verifier != Verifier.typical)
    assert run_config(f"method={method}", "tree=kary").tree.name == "kary"


def test_medusa_default_tree_is_the_63_node_tree(run_config):
    cfg = run_config("method=medusa")
    assert cfg.tree.kind == TreeKind.medusa and len(cfg.tree.paths) == 63
    assert max(len(p) for p in cfg.tree.paths) == cfg.method.params["num_heads"]
    assert cfg.method.verifier == Verifier.greedy and cfg.method.lossless
    typical = run_config("method=medusa_typical").method
    assert typical.verifier == Verifier.typical and not typical.lossless


def test_sequoia_carries_the_published_vector(run_config):
    """method/sequoia.yaml holds Sequoia's published vector (the copy in tests/specsim/data)."""
    ref = json.loads((Path(__file__).parent / "specsim" / "data" / "sequoia_demo.json").read_text())
    vec = run_config("method=sequoia").method.acceptance.vector
    assert vec == pytest.approx(ref["acceptance_rate_vector"], abs=0)


def test_interpolated_params_follow_the_tree(run_config):
    assert run_config("method=vanilla", "tree.gamma=7").method.params["gamma"] == 7
    assert run_config("method=prompt_lookup", "tree.gamma=10").method.params["num_pred_tokens"] == 10


def test_method_model_specialization(run_config):
    """`optional method_model: ${method}_${model}`: layerskip on Llama-2-7B exits at a fixed deeper layer; on
    the zoo the exit is chosen on the device (methods.drafters.exit_choice)."""
    zoo, big = run_config("method=layerskip"), run_config("method=layerskip", "model=llama2_7b")
    assert zoo.method.params["exit_layer"] == "auto"
    assert 2 < big.method.params["exit_layer"] < big.model.n_layers


@pytest.mark.parametrize("path", sorted((CONF / "method_model").glob("*.yaml")), ids=lambda p: p.stem)
def test_method_model_files_name_real_presets(path):
    """A specialization whose name matches no (method, model) pair would be silently ignored."""
    pairs = {f"{m}_{mo}" for m in presets("method") for mo in presets("model")}
    assert path.stem in pairs, f"{path.name}: not <method>_<model> of existing presets"


def _experiment_grid(compose_config, name: str) -> dict[str, list[str]]:
    hydra_cfg = compose_config(f"experiment={name}", hydra=True).hydra
    params = OmegaConf.to_container(hydra_cfg.sweeper.params) or {}
    parser = OverridesParser.create()
    return {k: list(parser.parse_override(f"{k}={v}").sweep_string_iterator()) for k, v in params.items()}


@pytest.mark.parametrize("name", presets("experiment"))
def test_experiment_composes(compose_config, run_config, name):
    """The overlay composes and validates, and so does every value of every swept parameter."""
    cfg = run_config(f"experiment={name}")
    grid = _experiment_grid(compose_config, name)
    assert grid, f"experiment {name} defines no sweep (hydra.sweeper.params)"
    for key, values in grid.items():
        for value in values:
            run_config(f"experiment={name}", f"{key}={value}")
    expected_task = {"leviathan_table": Task.simulate, "sequoia_scaling": Task.simulate,
                     "specbench": Task.measure}
    if name in expected_task:
        assert cfg.task == expected_task[name]


def test_experiments_of_issue_5_exist():
    assert {"leviathan_table", "sequoia_scaling", "specbench"} <= set(presets("experiment"))
    for path in (CONF / "experiment").glob("*.yaml"):
        assert path.read_text().startswith("# @package _global_"), f"{path.name}: a _global_ delta overlay"


# ---- failures ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("override", ["method.gama=3", "hardware.bandwith_gbs=1", "gamma=4"])
def test_typo_fails_at_compose(compose_config, override):
    with pytest.raises(ConfigCompositionException, match=re.escape(override.split("=")[0])):
        compose_config(override)


@pytest.mark.parametrize(("override", "key"), [("+method.gama=3", "method.gama"), ("+seeds=1", "seeds"),
                                               ("+method.acceptance.alfa=0.5", "method.acceptance.alfa")])
def test_appended_unknown_key_fails(run_config, override, key):
    """`+key=value` slips through compose on a structured node; to_run_config rejects it."""
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: not a key of .*; allowed: "):
        run_config(override)


@pytest.mark.parametrize("override", ["tree.gamma=abc", "method.verifier=bogus", "hardware.offload=maybe",
                                      "method.acceptance.kind=geometric"])
def test_wrong_type_fails_at_compose(compose_config, override):
    with pytest.raises(ConfigCompositionException, match=re.escape(override.split("=")[0])):
        compose_config(override)


@pytest.mark.parametrize("override", ["method=nope", "hardware=a10", "tree=binary", "experiment=unknown"])
def test_unknown_choice_fails_at_compose(compose_config, override):
    with pytest.raises(HydraException, match="Could not find"):
        compose_config(override)


OUT_OF_RANGE = [
    ("method.acceptance.alpha=1.5", "method.acceptance.alpha"),
    ("method.acceptance.decay=0", "method.acceptance.decay"),
    ("method.draft_cost_ratio=-0.1", "method.draft_cost_ratio"),
    ("method.verifier=typical", "method.lossless"),
    ("tree.gamma=0", "tree.gamma"),
    ("hardware.memory_bandwidth_gbs=0", "hardware.memory_bandwidth_gbs"),
    ("hardware.flops_efficiency=1.5", "hardware.flops_efficiency"),
    ("workload.top_p=0", "workload.top_p"),
    ("workload.kind=poetry", "workload.kind"),
    ("model=hub", "model.path"),
    ("model.dtype=int8", "model.dtype"),
    ("threads=-1", "threads"),
    ("method.acceptance.kind=depth_vector", "method.acceptance.by_depth_vectors"),
    ("method.acceptance.by_depth_vectors=[[0.0,0.5,0.4]]", "method.acceptance.by_depth_vectors[0]"),
]


@pytest.mark.parametrize(("override", "key"), OUT_OF_RANGE, ids=[o for o, _ in OUT_OF_RANGE])
def test_out_of_range_names_the_key(run_config, override, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
        run_config(override)


def _numeric_keys(obj, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            keys += _numeric_keys(v, f"{prefix}{f.name}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            keys.append(f"{prefix}{f.name}")
    return keys


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _set(cfg, key: str, value) -> None:
    path, _, last = key.rpartition(".")
    setattr(_get(cfg, path) if path else cfg, last, value)


def test_every_numeric_field_is_range_checked(run_config):
    """Issue 12: every numeric field of every group rejects an out-of-range value, and NaN / inf for floats,
    with a message naming the key, the allowed range (specsim.config.RANGES) and the value. A new field
    fails here until it gets its range."""
    base = run_config("task=simulate")
    keys = _numeric_keys(base)
    assert len(keys) >= 40 and {"hardware.pcie_gbs", "workload.context_tokens", "seed"} <= set(keys)
    for key in keys:
        floating = isinstance(_get(base, key), float)
        for bad in (-10**12, *((math.nan, math.inf) if floating else ())):
            cfg = copy.deepcopy(base)
            _set(cfg, key, bad)
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: .*must be") as err:
                validate(cfg)
            assert str(bad) in str(err.value), err.value
            if key in RANGES:
                assert str(RANGES[key]) in str(err.value)


@pytest.mark.parametrize(("override", "key"), [
    ("hardware.offload=true", "hardware.pcie_gbs"),  # cpu preset: pcie_gbs 0
    ("workload.context_tokens=5000", "workload.context_tokens"),
    ("tree.budgets=[64]", "tree.budgets"), ("model.n_kv_heads=4", "model.n_kv_heads"),
])
def test_cross_field_checks_name_the_key(run_config, override, key):
    extra = ("tree=sequoia", "tree.max_levels=2") if key == "tree.budgets" else ()
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
        run_config("task=simulate", override, *extra)


def test_range_text():
    assert str(Range(0, 1, hi_open=True)) == "in [0, 1)" and str(Range(0, lo_open=True)) == "> 0"
    assert 1 in Range(1) and 0.5 not in Range(1) and math.nan not in Range() and math.inf not in Range()
    assert True not in Range()  # a bool is not a number here


# ---- outputs, launchers ------------------------------------------------------------------------------
def test_output_dirs(compose_config):
    hc = compose_config("task=simulate", hydra=True).hydra
    run_dir = OmegaConf.to_container(hc.run, resolve=False)["dir"]
    sweep = OmegaConf.to_container(hc.sweep, resolve=False)
    assert run_dir.startswith("outputs/${task}/${now:")
    assert sweep["dir"].startswith("multirun/${now:") and sweep["subdir"] == "${hydra.job.override_dirname}"
    assert hc.job.chdir is False and hc.output_subdir == ".hydra"


@pytest.mark.parametrize(("preset", "target"), [("parallel", "joblib"), ("slurm", "submitit")])
def test_installed_launcher_presets_compose(compose_config, preset, target):
    launcher = compose_config(f"hydra/launcher={preset}", hydra=True).hydra.launcher
    assert target in launcher._target_.lower()
    if preset == "parallel":
        assert launcher.n_jobs >= 1


def test_ray_launcher_preset(compose_config):
    """hydra-ray-launcher is an optional extra: compose when installed, else check the yaml's shape."""
    path = CONF / "hydra" / "launcher" / "ray.yaml"
    data = yaml.safe_load(path.read_text())
    assert data["defaults"] == ["ray"] and set(data) <= {"defaults", "ray"}
    assert set(data["ray"]) <= {"init", "remote"}  # RayLauncherConf.ray = RayConf(init, remote)
    assert OmegaConf.create({k: v for k, v in data.items() if k != "defaults"})
    try:
        import hydra_plugins.hydra_ray_launcher  # noqa: F401
    except ImportError:
        return
    launcher = compose_config("hydra/launcher=ray", hydra=True).hydra.launcher
    assert "ray" in launcher._target_.lower()


# ---- comments name the source of numbers (STYLE: presets hold values with a reason) --------------------
NUMERIC = re.compile(r"^\s*[\w.]+:\s*-?[\d.]+(e-?\d+)?\s*(#.*)?$")
SOURCED_KEYS = re.compile(r"^\s*(memory_bandwidth_gbs|peak_tflops|memory_gb|pcie_gbs|overhead_ms|alpha|decay|"
                          r"draft_cost_ratio|draft_fixed_ratio|params|draft_params):")


@pytest.mark.parametrize("path", sorted(CONF.glob("*/*.yaml")), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_numbers_carry_their_source(path: Path):
    for line in path.read_text().splitlines():
        if NUMERIC.match(line) and SOURCED_KEYS.match(line):
            assert "#" in line, f"{path.relative_to(CONF)}: `{line.strip()}` needs a comment with its source"
