"""Every bad input fails before any work: one clear message, no traceback, nothing written (issue 12, part 3).

One row per bad input: the command-line overrides, the words its message must contain (the key, what is
allowed, the value given) and words it must not contain (wrong advice). Every row runs through run.py's own
entry point, ``run.cli()`` — what ``python run.py ARGS`` calls — in this process, from an empty working
directory, with the task dispatch replaced by a tripwire. A row passes when the exit status is not 0, the
output holds no traceback, the message has its words, the working directory is still empty (no run dir, no
outputs/ parents) and the tripwire never fired (the error came before any work: no model loaded, no zoo
built, no simulation run). SUBPROCESS repeats a few rows through a real `python run.py` process.

Grow the table with every new way to get a config wrong; a new method adds its own rows under METHOD.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

import run
from methods.drafters import registry

REPO = Path(__file__).resolve().parents[1]


class Bad(NamedTuple):
    args: tuple[str, ...]  # command-line overrides (task=measure unless they say otherwise)
    words: tuple[str, ...]  # the message must contain each
    absent: tuple[str, ...] = ()  # ... and none of these
    slow: bool = False  # more of a kind already covered: left to the full suite (-m slow), to keep it fast


METHOD_DRAFTERS = run.method_drafters()  # preset -> its method.drafter
READY = [m for m, d in METHOD_DRAFTERS.items() if d in registry.names()]
# a method preset whose drafter is not in the registry yet (None once every preset has one)
NO_DRAFTER = next((m for m, d in METHOD_DRAFTERS.items() if d not in registry.names()), None)
SCHEMAS = ("base_method", "base_tree", "base_hardware", "base_model", "base_workload", "base_config")
SLOW = True

METHOD = [
    Bad(("method=nonexistent",), ("method=nonexistent", "vanilla", "medusa", "prompt_lookup"), SCHEMAS),
    Bad(("-m", "task=simulate", "method=vanilla,nope"), ("method=nope", "vanilla")),  # a sweep: before a job
    Bad(("method.drafter=nonexistent_drafter",),
        ("method.drafter", "nonexistent_drafter", "vanilla", "prompt_lookup", "task=simulate")),
    Bad(("task=calibrate", "method.drafter=nonexistent_drafter"), ("method.drafter", "task=calibrate")),
    Bad(("method.verifier=bogus",), ("method.verifier", "bogus", "greedy", "typical")),
    Bad(("method.gama=3",), ("method.gama",)),  # typo'd key (Hydra's compose)
    Bad(("+method.gama=3",), ("method.gama", "allowed", "draft_cost_ratio")),
    Bad(("method=prompt_lookup", "method.verifier=chain", "workload.temperature=1"),
        ("method.verifier", "chain", "prompt_lookup", "deterministic")),
    Bad(("method=vanilla", "workload.temperature=0.8"), ("method.verifier", "greedy", "temperature")),
    Bad(("method=medusa", "method.verifier=chain", "workload.temperature=1"),
        ("method.verifier", "chain", "tree=medusa", "specinfer")),
    Bad(("method.verifier=typical",), ("method.lossless", "lossy")),
    Bad(("method.acceptance.alpha=1",), ("method.acceptance.alpha", "[0, 1)", "got 1")),
    Bad(("method=prompt_lookup", "method.verifier=sequoia", "workload.temperature=1"),
        ("method.verifier", "sequoia", "deterministic", "greedy"), slow=SLOW),
    Bad(("method=vanilla", "tree=kary", "method.verifier=chain", "workload.temperature=1"),
        ("method.verifier", "tree=kary", "specinfer"), slow=SLOW),
    Bad(("method.acceptance.decay=0",), ("method.acceptance.decay", "(0, 1]", "got 0"), slow=SLOW),
    Bad(("method.draft_cost_ratio=-0.1",), ("method.draft_cost_ratio", ">= 0", "-0.1"), slow=SLOW),
    Bad(("method.draft_fixed_ratio=nan",), ("method.draft_fixed_ratio", ">= 0", "nan"), slow=SLOW),
    Bad(("method.draft_node_ratio=-1",), ("method.draft_node_ratio", ">= 0", "-1"), slow=SLOW),
    Bad(("method.verify_saving_ratio=1",), ("method.verify_saving_ratio", "[0, 1)", "got 1"), slow=SLOW),
    Bad(("method.draft_steps=two",), ("method.draft_steps", "'two'", "depth, one"), slow=SLOW),
    Bad(("method.draft_cost=flops",), ("method.draft_cost", "'flops'", "ratio, roofline"), slow=SLOW),
    Bad(("method.acceptance.kind=table",), ("method.acceptance.by_depth", "required"), slow=SLOW),
    Bad(("method.acceptance.kind=table", "method.acceptance.by_depth=[0.5,1.5]"),
        ("method.acceptance.by_depth", "[0, 1]"), slow=SLOW),
    Bad(("method.acceptance.vector=[0.0,0.5]",), ("method.acceptance.vector", "p_none"), slow=SLOW),
    Bad(("method.acceptance.kind=geometric",), ("method.acceptance.kind", "geometric"), slow=SLOW),
]
if NO_DRAFTER is not None:  # a real preset before its drafter lands (stays true as drafters land)
    METHOD.append(Bad((f"method={NO_DRAFTER}",), ("method.drafter", f"method={NO_DRAFTER}", "vanilla")))

TREE = [
    Bad(("tree=binary",), ("tree=binary", "chain", "sequoia"), SCHEMAS),
    Bad(("tree.gamma=0",), ("tree.gamma", "[1, 1023]", "got 0")),
    Bad(("tree.gamma=abc",), ("tree.gamma", "abc")),  # wrong type (Hydra's compose)
    Bad(("tree=kary", "tree.k=50", "tree.depth=5"), ("tree=kary", "nodes", "1024")),
    Bad(("task=simulate", "method=sequoia", "tree.max_levels=1000"), ("tree.max_levels", "64", "1000")),
    Bad(("task=simulate", "method=sequoia", "tree.budgets=[64]", "tree.max_levels=2"),  # W = 32: 33 nodes
        ("tree.budgets", "[64]", "tree.max_levels=2", "33")),
    Bad(("tree=kary", "tree.depth=100"), ("tree.depth", "64", "100"), slow=SLOW),
    Bad(("task=simulate", "method=sequoia", "tree.max_levels=1"), ("tree.max_levels", ">= 2", "got 1"),
        slow=SLOW),
    Bad(("task=simulate", "method=sequoia", "tree.budgets=[16]", "tree.max_levels=4",
         "method.acceptance.vector=[0.0,0.9,0.1]"), ("tree.budgets", "width 1", "at most 4"), slow=SLOW),
    Bad(("task=simulate", "method=sequoia", "tree.budgets=[]"), ("tree.budgets", ">= 1"), slow=SLOW),
    Bad(("task=simulate", "method=sequoia", "tree.budgets=[8,4096]"), ("tree.budgets", "1024", "4096"),
        slow=SLOW),
    Bad(("task=simulate", "calibration.sizes=[8,0]"), ("calibration.sizes", "1024", "[0]")),
    Bad(("method=medusa", "tree.paths=[]"), ("tree.paths", "non-empty"), slow=SLOW),
    Bad(("method=medusa", "tree.paths=[[0],[0]]"), ("tree.paths", "twice"), slow=SLOW),
    Bad(("method=medusa", "tree.paths=[[0,-1]]"), ("tree.paths", ">= 0"), slow=SLOW),
    Bad(("task=simulate", "tree=dynamic", "tree.total_tokens=0"), ("tree.total_tokens", "got 0"), slow=SLOW),
    Bad(("task=simulate", "tree=dynamic", "tree.top_k=0"), ("tree.top_k", "got 0"), slow=SLOW),
    Bad(("tree.kind=star",), ("tree.kind", "star"), slow=SLOW),
]

HARDWARE = [
    Bad(("hardware=a10",), ("hardware=a10", "a100", "l40_offload"), SCHEMAS),
    Bad(("task=simulate", "hardware=l40_offload", "hardware.pcie_gbs=0"),
        ("hardware.pcie_gbs", "> 0", "hardware.offload", "got 0")),
    Bad(("task=simulate", "hardware.overhead_ms=-1"), ("hardware.overhead_ms", ">= 0", "-1")),
    Bad(("task=simulate", "hardware.peak_tflops=inf"), ("hardware.peak_tflops", "> 0", "inf")),
    Bad(("task=simulate", "hardware.pcie_gbs=-1"), ("hardware.pcie_gbs", ">= 0", "-1"), slow=SLOW),
    Bad(("task=simulate", "hardware.memory_bandwidth_gbs=0"), ("hardware.memory_bandwidth_gbs", "> 0"),
        slow=SLOW),
    Bad(("task=simulate", "hardware.flops_efficiency=1.5"), ("hardware.flops_efficiency", "(0, 1]", "1.5"),
        slow=SLOW),
    Bad(("task=simulate", "hardware.bandwidth_efficiency=0"), ("hardware.bandwidth_efficiency", "(0, 1]"),
        slow=SLOW),
    Bad(("task=simulate", "hardware.memory_gb=-24"), ("hardware.memory_gb", "> 0", "-24"), slow=SLOW),
    Bad(("hardware.offload=maybe",), ("hardware.offload", "maybe"), slow=SLOW),
]

WORKLOAD = [
    Bad(("workload=poetry",), ("workload=poetry", "code", "grounded"), SCHEMAS),
    Bad(("task=simulate", "workload.context_tokens=-5"), ("workload.context_tokens", ">= 0", "-5")),
    Bad(("task=simulate", "workload.context_tokens=100000"),
        ("workload.context_tokens", "model.context_length=1024", "100000")),
    Bad(("workload.max_new_tokens=2000",), ("workload.max_new_tokens", "model.context_length=1024", "2128")),
    Bad(("workload.temperature=-1",), ("workload.temperature", ">= 0", "-1")),
    Bad(("workload.top_p=0",), ("workload.top_p", "(0, 1]", "got 0"), slow=SLOW),
    Bad(("workload.top_k=-3",), ("workload.top_k", ">= 0", "-3"), slow=SLOW),
    Bad(("workload.num_prompts=0",), ("workload.num_prompts", ">= 1", "got 0"), slow=SLOW),
    Bad(("workload.tau_se_target=-0.01",), ("workload.tau_se_target", "[0, 1]", "-0.01")),
    Bad(("task=measure", "method=vanilla", "workload.tau_se_target=0.012", "workload.batch_size=2"),
        ("workload.tau_se_target", "one prompt at a time", "batch_size=1", "batch_size=2")),
    Bad(("workload.prompt_tokens=-1",), ("workload.prompt_tokens", ">= 1", "-1"), slow=SLOW),
    Bad(("workload.split=validation",), ("workload.split", "validation", "calibration"), slow=SLOW),
    Bad(("workload.kind=poetry",), ("workload.kind", "poetry", "prose"), slow=SLOW),
]

MODEL = [
    Bad(("model=zoo_large",), ("model=zoo_large", "micro", "hub"), SCHEMAS),
    Bad(("model=hub",), ("model.path", "required")),
    Bad(("model=hub", "model.path=/nonexistent"), ("model.path", "/nonexistent", "no such directory"),
        ("huggingface-cli download /nonexistent",)),  # the advice before issue 12, wrong for a path
    Bad(("model=hub", "model.path=specsim-test-org/no-such-model"),
        ("model.path", "Hugging Face cache", "huggingface-cli download specsim-test-org/no-such-model")),
    Bad(("model=micro", "model.draft_n_layers=0"), ("model.draft_n_layers", "draft model", "method=vanilla")),
    Bad(("task=simulate", "model.n_kv_heads=4"), ("model.n_kv_heads", "model.n_heads=6", "got 4")),
    Bad(("model=local", "model.path=/"), ("model.path", "config.json"), slow=SLOW),
    Bad(("model=local", "model.path=/nonexistent/ckpt"), ("model.path", "no such directory"), ("hub name",),
        slow=SLOW),
    Bad(("task=simulate", "method=sequoia", "model.draft_params=0"), ("model.draft_params", "roofline"),
        slow=SLOW),
    Bad(("model.dtype=int8",), ("model.dtype", "int8", "bfloat16"), slow=SLOW),
    Bad(("model.source=s3",), ("model.source", "s3", "hub"), slow=SLOW),
    Bad(("task=simulate", "model.n_heads=7"), ("model.n_heads", "model.hidden_size=384", "got 7"), slow=SLOW),
    Bad(("task=simulate", "model.n_layers=0"), ("model.n_layers", ">= 1", "got 0"), slow=SLOW),
    Bad(("task=simulate", "model.bytes_per_param=0"), ("model.bytes_per_param", "(0, 8]", "got 0"),
        slow=SLOW),
    Bad(("task=simulate", "model.vocab_size=1"), ("model.vocab_size", ">= 2", "got 1"), slow=SLOW),
]

EXPERIMENT = [
    Bad(("experiment=unknown",), ("experiment=unknown", "leviathan_table", "specbench")),
    Bad(("experiment=sequoia_scaling", "tree.budgets=[64]", "tree.max_levels=2"), ("tree.budgets", "33")),
    Bad(("experiment=leviathan_table", "method.acceptance.alpha=1.5"), ("method.acceptance.alpha", "1.5"),
        slow=SLOW),
    Bad(("experiment=specbench", "method.drafter=nonexistent_drafter"), ("method.drafter", "task=measure"),
        slow=SLOW),
]

TOP_LEVEL = [
    Bad(("task=bogus",), ("task", "bogus")),
    Bad(("task=simulate", "seed=-1"), ("seed", "[0, 4294967295]", "-1")),
    Bad(("threads=-1",), ("threads", ">= 0", "-1")),
    Bad(("+seeds=1",), ("seeds", "allowed")),
    Bad(("calibration.reps=0",), ("calibration.reps", ">= 1", "got 0")),
    Bad(("calibration.max_reps=-1",), ("calibration.max_reps", ">= 0", "-1"), slow=SLOW),
    Bad(("calibration.median_se=-0.1",), ("calibration.median_se", ">= 0", "-0.1"), slow=SLOW),
    Bad(("task=simulate", "seed=4294967296"), ("seed", "4294967296"), slow=SLOW),
    Bad(("warmup=-1",), ("warmup", ">= 0", "-1"), slow=SLOW),
    Bad(("device=tpu",), ("device", "tpu", "auto", "cpu"), slow=SLOW),
    Bad(("device=cuda:64",), ("device", "cuda:64", "CUDA device"), slow=SLOW),  # no machine has 65 GPUs
    Bad(("calibration.width=0",), ("calibration.width", "got 0"), slow=SLOW),
    Bad(("calibration.warmup=-1",), ("calibration.warmup", ">= 0", "-1"), slow=SLOW),
]

ENGINE = [
    Bad(("engine=nope",), ("engine=nope", "specsim", "vllm")),
    Bad(("engine=vllm", "method=medusa"), ("engine.name", "method=medusa", "vanilla", "prompt_lookup")),
    Bad(("engine=vllm", "task=calibrate"), ("engine.name", "task=measure", "task=calibrate")),
    Bad(("engine=vllm", "method=vanilla", "tree=sequoia"), ("tree.kind", "chain", "tree=sequoia")),
    Bad(("method=online", "workload.batch_size=4"), ("workload.batch_size", "method=online", "cannot decode",
                                                      "in order", "vanilla", "medusa", "mtp", "eagle3")),
    Bad(("method=layerskip", "workload.batch_size=2"), ("workload.batch_size", "target's own engine"),
        slow=SLOW),
    Bad(("engine=vllm", "workload.batch_size=0"), ("workload.batch_size", "got 0"), slow=SLOW),
    Bad(("engine=vllm", "engine.memory_fraction=0"), ("engine.memory_fraction", "(0, 1]"), slow=SLOW),
    Bad(("engine=vllm", "engine.kv_cache_gib=0"), ("engine.kv_cache_gib", ">= 1"), slow=SLOW),
]

GROUPS = {"method": METHOD, "tree": TREE, "hardware": HARDWARE, "workload": WORKLOAD, "model": MODEL,
          "experiment": EXPERIMENT, "engine": ENGINE, "top-level": TOP_LEVEL}
ROWS = [row for rows in GROUPS.values() for row in rows]


def _params(rows: list[Bad]) -> list:
    return [pytest.param(r, id=" ".join(r.args), marks=[pytest.mark.slow] if r.slow else []) for r in rows]


def _run_in_process(run_module, args: tuple[str, ...], cwd: Path, monkeypatch, capsys) -> tuple[int, str,
                                                                                                  list]:
    """`python run.py ARGS` through run.cli() in this process; returns (exit status, output, tasks begun)."""
    from hydra.core.global_hydra import GlobalHydra

    begun: list = []
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["run.py", *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # the user-facing error format is under test
    monkeypatch.setattr(run_module, "execute", lambda cfg, out_dir: begun.append(cfg))  # the tripwire
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # Hydra configures logging for its job
    try:
        with pytest.raises(SystemExit) as exit_:
            run_module.cli()
    finally:
        GlobalHydra.instance().clear()
        for h in set(root.handlers) - set(handlers):
            h.close()
        root.handlers[:], root.level = handlers, level
    out = capsys.readouterr()
    code = exit_.value.code
    return (code if isinstance(code, int) else 1 if code else 0), out.out + out.err, begun


def _check(row: Bad, status: int, output: str, cwd: Path) -> None:
    assert status != 0, f"exit status 0 for {row.args}:\n{output}"
    assert "Traceback" not in output, output
    for word in row.words:
        assert word in output, f"{word!r} missing from: {output}"
    for word in row.absent:
        assert word not in output, f"{word!r} should not be in: {output}"
    assert list(cwd.iterdir()) == [], f"a failed run left {sorted(p.name for p in cwd.iterdir())}"


@pytest.mark.parametrize("row", _params(ROWS))
def test_bad_input_fails_before_any_work(run_module, row, tmp_path, monkeypatch, capsys):
    status, output, begun = _run_in_process(run_module, row.args, tmp_path, monkeypatch, capsys)
    assert not begun, f"the task started: {row.args} passed the checks"
    _check(row, status, output, tmp_path)


# through a real process: exit codes, Hydra's own error printing, and what a user sees
SUBPROCESS = [
    METHOD[0],  # unknown preset: run.py's choice check
    METHOD[2],  # no drafter for task=measure (was a KeyError traceback after the zoo was built)
    MODEL[2],  # a hub model at a path that does not exist (was a traceback after loading, and wrong advice)
    METHOD[5]._replace(slow=True),  # a typo'd key: Hydra's compose error
    METHOD[7]._replace(slow=True),  # a deterministic drafter with a q-reading verifier (was a VerifyError)
    HARDWARE[1]._replace(slow=True),  # offload without PCIe bandwidth (was an AssertionError traceback)
]


@pytest.mark.parametrize("row", _params(SUBPROCESS))
def test_bad_input_through_the_command_line(cli, row, tmp_path):
    proc = cli(list(row.args), cwd=tmp_path)
    _check(row, proc.returncode, proc.stdout + proc.stderr, tmp_path)


def test_the_table_covers_every_group():
    assert len(ROWS) >= 40
    assert all(len(rows) >= 4 for rows in GROUPS.values()), {g: len(r) for g, r in GROUPS.items()}
    assert len({r.args for r in ROWS}) == len(ROWS), "a row is listed twice"
    keys = {a.split("=")[0].lstrip("+~").split(".")[0] for r in ROWS for a in r.args if "=" in a}
    assert {"method", "tree", "hardware", "workload", "model", "experiment", "task", "seed", "threads",
            "device", "calibration"} <= keys


def test_methods_with_a_drafter_are_named(run_module):
    """The no-drafter message lists presets whose drafter is registered (conf/method, defaults followed)."""
    drafters = METHOD_DRAFTERS
    assert set(drafters) == set(run_module.presets("method"))
    assert drafters["medusa_typical"] == drafters["medusa"] == "medusa"  # inherited from `defaults: [medusa]`
    assert drafters["autoregressive"] == "autoregressive" and drafters["sequoia"] == "draft_model"
    assert set(registry.DETERMINISTIC) <= set(registry.names())
    assert set(registry.NEEDS_DRAFT_MODEL) <= set(registry.names())


# ---- and good inputs still pass the same checks ----------------------------------------------------------
@pytest.mark.parametrize("method", READY)
def test_every_method_with_a_drafter_passes_the_checks(run_module, run_config, method):
    run_module.check_runnable(run_config("task=measure", f"method={method}", "model=micro"))


@pytest.mark.parametrize("args", [
    ("method=prompt_lookup", "method.verifier=deterministic", "workload.temperature=1"),
    ("method=vanilla", "method.verifier=chain", "workload.temperature=1"),
    ("method=medusa", "method.verifier=sequoia", "workload.temperature=0.7"),
    ("task=calibrate", "method=sequoia", "workload.temperature=1", "method.verifier=sequoia"),
])
def test_fitting_verifiers_pass_the_checks(run_module, run_config, args):
    run_module.check_runnable(run_config(*args, "model=micro"))


@pytest.mark.parametrize("args", [
    ["task=simulate", "method=vanilla"], ["-m", "method=vanilla,medusa", "tree=chain,sequoia"],
    ["experiment=null"], ["hydra/launcher=parallel", "-m", "workload=code,prose"], ["+method.params.x=1"],
    ["method=eagle", "method@foo=vanilla"], ["--cfg", "job"],
])
def test_existing_choices_pass(run_module, args):
    run_module.check_choices(args)
