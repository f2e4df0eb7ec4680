"""Smoke test of benchmarks/vs_transformers.py (specsim vs transformers' generate — plain, static cache,
torch.compile —, assisted generation with its default and a constant schedule, and prompt lookup): one prompt,
a few tokens, one repetition on the random tiny Llama pair in float32, where every lossless path must
reproduce HF greedy exactly; plus its helpers (benchmarks/hf_configs.py, candidates.py, physical_limit.py).
Timings are not asserted (a shared machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "vs_transformers.py"
RATIOS = ("ar_vs_hf_greedy", "vanilla_vs_hf_assisted", "pld_vs_hf_pld", "best_vs_hf_greedy",
          "best_vs_hf_fastest")
HF_PATHS = ("hf greedy", "hf greedy static", "hf greedy static+compile", "hf greedy compiled forward",
            "hf greedy static+compiled forward", "hf assisted chain g=4", "hf assisted default (heuristic)",
            "hf prompt_lookup g=10 n<=3")
# assisted generation with a static cache: transformers 5.0-5.2x refuse it ("not supported with Static cache
# classes"), 5.24 runs it; the benchmark times it where it works and reports the error where it does not
HF_STATIC_ASSISTED = "hf assisted chain g=4 static"


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, str]:
    args = ["--model", "random_tiny", "--workload", "code", "--num-prompts", "1", "--max-new-tokens", "12",
            "--reps", "1", "--dtype", "float32", "--chain-gammas", "2", "--pld-gammas", "4",
            "--sequoia-budgets", "6", "--calibration-prompts", "1", "--medusa", "off", "--hf-compile", "all",
            "--dram-mib", "8"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path_factory.mktemp("bench"),
                          env={**os.environ, "HYDRA_FULL_ERROR": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), proc.stdout


@pytest.mark.slow
def test_last_line_is_the_json_summary_with_the_ratios(result):
    summary, _ = result
    for key in (*RATIOS, "best_method", "all_outputs_equal", "dtype", "device", "tokens_per_s", "equal_rate"):
        assert key in summary, f"missing {key!r} in {sorted(summary)}"
    for key in RATIOS:
        assert summary[key] > 0, (key, summary[key])
    assert summary["dtype"] == "float32" and summary["num_prompts"] == 1
    assert set(summary["targets_met"]) == set(RATIOS)
    # every HF greedy configuration works on this CPU; where transformers refuses assisted generation with a
    # static cache, the benchmark says so with the error instead of failing, and otherwise it times the path
    assert set(summary["hf_failed"]) <= {HF_STATIC_ASSISTED}, summary["hf_failed"]
    if HF_STATIC_ASSISTED in summary["hf_failed"]:
        assert "not supported with Static cache" in summary["hf_failed"][HF_STATIC_ASSISTED]
        assert HF_STATIC_ASSISTED not in summary["tokens_per_s"]
    else:
        assert summary["tokens_per_s"][HF_STATIC_ASSISTED] > 0


@pytest.mark.slow
def test_hf_configurations_are_all_timed_and_the_fastest_is_one_of_them(result):
    summary, _ = result
    hf = [n for n in summary["tokens_per_s"] if n.startswith("hf")]
    static_assisted = [] if HF_STATIC_ASSISTED in summary["hf_failed"] else [HF_STATIC_ASSISTED]
    assert sorted(hf) == sorted([*HF_PATHS, *static_assisted])
    assert list(summary["hf_vs_hf_greedy"]) == hf and summary["hf_vs_hf_greedy"]["hf greedy"] == 1.0
    assert summary["hf_fastest"] in hf
    fastest = max(hf, key=summary["tokens_per_s"].get)
    assert summary["hf_fastest"] == fastest
    assert summary["hf_assisted_default_vs_constant"] > 0
    # every HF greedy variant takes one target forward per token, as plain HF greedy
    for name in HF_PATHS[:5]:
        assert summary["tau"][name] == 1.0, name


@pytest.mark.slow
def test_physical_limit_line(result):
    summary, stdout = result
    limit = summary["physical_limit"]
    assert limit["weight_bytes"] > 0 and limit["dram_test_bytes"] == 8 << 20
    for clock in ("cpu", "wall"):
        one = limit[clock]
        read = one["bandwidth_at_weights_size_GBps"]["read_GBps"]
        assert read > 0 and one["bandwidth_dram_GBps"]["read_GBps"] > 0 and one["t1_ms"] > 0
        stream = limit["weight_bytes"] / (read * 1e9) * 1e3
        assert one["t_stream_ms"]["weights_size"] == pytest.approx(stream, rel=1e-2, abs=1e-4)
        assert one["t1_over_stream"]["weights_size"] == pytest.approx(one["t1_ms"] / stream, rel=2e-2)
    assert "physical limit: the target's weights" in stdout
    assert HF_STATIC_ASSISTED in stdout
    if HF_STATIC_ASSISTED in summary["hf_failed"]:
        assert "FAILED: ValueError" in stdout


@pytest.mark.slow
def test_every_path_reproduces_hf_greedy_in_float32(result):
    summary, _ = result
    assert summary["all_outputs_equal"] is True, summary["equal_rate"]
    assert set(summary["equal_rate"].values()) == {1.0}
    assert set(summary["equal_rate_vs_specsim_ar"].values()) == {1.0}


@pytest.mark.slow
def test_table_lists_every_path_and_the_best_is_a_timed_one(result):
    summary, stdout = result
    names = list(summary["tokens_per_s"])
    assert {"hf greedy", "specsim autoregressive"} <= set(names)
    assert any(n.startswith("hf assisted") for n in names)
    assert any(n.startswith("hf prompt_lookup") for n in names)
    table = stdout.strip().splitlines()[:-1]
    for name in names:
        assert any(line.startswith(name) for line in table), f"{name} not in the table"
    assert summary["best_method"] in {n.removeprefix("best? ") for n in names}
    # autoregressive decoding takes one target forward per token; HF greedy too (counted with a hook)
    assert summary["tau"]["specsim autoregressive"] == 1.0 and summary["tau"]["hf greedy"] == 1.0


# ---- the helpers, without a subprocess ---------------------------------------------------------------------
def _tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_skips_the_gathered_embedding_table_unless_tied(tied):
    from benchmarks.physical_limit import weight_bytes

    model = _tiny_llama(tied)
    every = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups tied ones
    table = model.get_input_embeddings().weight
    expected = every if tied else every - table.numel() * table.element_size()
    assert weight_bytes(model) == expected
    assert weight_bytes(model.to(torch.bfloat16)) == expected // 2


def test_assistant_settings_are_per_path_and_the_heuristic_gamma_persists_in_its_own_state():
    from types import SimpleNamespace

    from benchmarks.hf_configs import ASSISTANT_KEYS, _swapped

    gc = SimpleNamespace(**dict.fromkeys(ASSISTANT_KEYS))
    draft = SimpleNamespace(generation_config=gc)
    heuristic = dict.fromkeys(ASSISTANT_KEYS)  # transformers' defaults
    constant = {"num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0}
    with _swapped(draft, heuristic):
        assert gc.num_assistant_tokens is None
        gc.num_assistant_tokens = 23  # what transformers' heuristic schedule leaves on q after a call
    assert gc.num_assistant_tokens is None and heuristic["num_assistant_tokens"] == 23
    with _swapped(draft, constant):
        assert (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule) == (4, "constant")
    with _swapped(draft, heuristic):
        assert gc.num_assistant_tokens == 23  # the heuristic path resumes from its own γ
    assert vars(gc) == dict.fromkeys(ASSISTANT_KEYS)


def test_a_failing_hf_configuration_is_reported_and_the_others_run():
    from benchmarks.hf_configs import HF_GREEDY, HFConfig, working_paths
    from methods.models import load_models
    from run import compose_run_config

    models = load_models(compose_run_config("model=random_tiny").model, "cpu", "float32")
    configs = [HFConfig(HF_GREEDY), HFConfig("broken", {"cache_implementation": "no_such_cache"}),
               HFConfig(f"{HF_GREEDY} static", {"cache_implementation": "static"})]
    paths, failed = working_paths(configs, models, 4, torch.tensor([5, 6, 7]))
    assert [p.name for p in paths] == [HF_GREEDY, f"{HF_GREEDY} static"] and all(p.hf for p in paths)
    assert list(failed) == ["broken"] and "no_such_cache" in failed["broken"]
    assert len(paths[1].run(torch.tensor([5, 6, 7])).tokens) == 4


def test_every_registered_drafter_competes_for_best():
    """A drafter enters the race through its factory or, by default, through its lossless presets."""
    from benchmarks.candidates import FACTORIES, lossless_presets
    from methods.drafters.registry import names

    for drafter in names():
        assert drafter in FACTORIES or lossless_presets(drafter), drafter
    assert "medusa_typical" not in lossless_presets("medusa")  # typical acceptance is lossy
    assert {"vanilla", "sequoia"} <= set(lossless_presets("draft_model"))
    assert lossless_presets("specinfer") == ["specinfer"]  # the multi-draft preset has its own drafter


def test_eagle_ladder_rungs_verify_the_same_budget():
    """benchmarks/eagle_ladder.py: each rung composes to a config verifying k + … + k^D tokens at depth D,
    the dynamic ones from a pool of at least that many nodes."""
    from benchmarks.eagle_ladder import budget, dynamic_pool, ladder
    from run import compose_run_config
    from specsim.tree import Tree

    assert budget(2, 3) == 14 and budget(3, 2) == 12
    for k, depth in ((2, 3), (3, 2), (2, 4), (1, 4)):
        rungs = ladder(k, depth)
        assert set(rungs) == {"medusa", "eagle", "eagle2", "eagle3"}
        for name, over in rungs.items():
            cfg = compose_run_config(*over)
            assert cfg.method.name == name
            if cfg.tree.kind.value == "dynamic":
                assert (cfg.tree.total_tokens, cfg.tree.depth) == (budget(k, depth), depth)
                assert dynamic_pool(cfg.tree.top_k, depth) >= budget(k, depth) and cfg.tree.top_k >= 2
            else:
                tree = Tree.kary(cfg.tree.k, cfg.tree.depth)
                assert (tree.size - 1, tree.depth) == (budget(k, depth), depth)


def test_eagle_ladder_budget_rule():
    """The dynamic tree drafts top_k + (D - 1) top_k² nodes; the ladder takes the smallest top_k >= 2 whose
    pool holds N (the default top_k 2 at depth 3 drafts 10 < 14: last session's unequal budgets)."""
    from benchmarks.eagle_ladder import dynamic_pool, dynamic_top_k, ladder, unequal

    assert [dynamic_pool(k, 3) for k in (1, 2, 3)] == [3, 10, 21] and dynamic_pool(3, 4) == 30
    assert dynamic_top_k(14, 3) == 3 and dynamic_top_k(30, 4) == 3 and dynamic_top_k(4, 4) == 2
    assert dynamic_top_k(10, 3) == 2 and dynamic_top_k(11, 3) == 3 and dynamic_top_k(3, 3, least=1) == 1
    assert dynamic_top_k(5, 1) == 5  # depth 1: the pool is top_k itself
    for bad in ((0, 3), (4, 0)):
        with pytest.raises(ValueError):
            dynamic_top_k(*bad)
    assert "tree.top_k=4" in ladder(2, 3, top_k=4)["eagle2"]
    with pytest.raises(ValueError, match="drafts 10 < 14"):
        ladder(2, 3, top_k=2)
    assert unequal({"eagle": 15.0, "eagle2": 14.4, "eagle3": 14.2}) == ["eagle3"]
    assert unequal({"eagle": 15.0, "eagle2": 10.9}, tolerance=0.3) == []


def test_each_pass_starts_with_a_fresh_drafter_so_no_pass_has_seen_its_prompts():
    """A path whose state carries across prompts (staged's n-gram table of q's outputs) must not time a pass
    on prompts it met in the warm-up or an earlier pass; within a pass the state carries over."""
    from benchmarks.harness import BenchPath, Output, measure

    seen_before: list[int] = []  # per run: how many prompts this drafter had decoded before

    def make():
        return {"decoded": 0}

    state = [make()]

    def run(ids):
        seen_before.append(state[0]["decoded"])
        state[0]["decoded"] += 1
        return Output([int(ids[0, 0])], 1)

    def ref(ids):
        return Output([int(ids[0, 0])], 1)

    path = BenchPath("stateful", run, fresh=lambda: state.__setitem__(0, make()))
    target = torch.nn.Linear(1, 1)
    prompts = [torch.tensor([[i, 1]]) for i in range(3)]
    measure([path, BenchPath("ref", ref), BenchPath("ar", ref)], prompts, 2, target, ("ref", "ar"))
    timed = seen_before[2:]  # after the two warm-up calls: the selection pass and two reps
    assert timed == [0, 1, 2] * 3
    assert path.equal == path.runs == 9


def test_eagle3_ablation_rows_and_arguments(tmp_path):
    """benchmarks/eagle3_ablation.py: the budget curve at the preset's layers and the layer choice at a fixed
    step count, windows scaled as the preset scales them, each row composing to the EAGLE-3 train config it
    names; argument checks; the cached head found by its config."""
    import argparse
    import json

    from benchmarks.eagle3_ablation import (
        Head,
        cached_report,
        heads,
        parse_layers,
        parse_rung,
        preset,
        row_cells,
        same_run,
        train_config,
    )

    base = preset()
    assert base[2] == (0, 2, 4) and base[1] * 5 == base[0] * 2  # the preset: 2 windows per 5 steps
    rows = heads([1000, 4400], [(0, 2, 4), (0, 1, 2)], 1000, (2200, 880, (0, 2, 4)))
    assert rows == [Head(1000, 400, (0, 2, 4)), Head(4400, 1760, (0, 2, 4)), Head(1000, 400, (0, 1, 2))]
    assert rows[2].label == "s1000-L012"
    cfg = train_config(rows[2].overrides())
    assert (cfg["steps"], cfg["train_windows"], cfg["feature_layers"]) == (1000, 400, [0, 1, 2])
    assert cfg["variant"] == "eagle3" and cfg["labels"] == "greedy"  # the rest is the preset's
    assert parse_layers("2,3,4") == (2, 3, 4) and parse_rung("1:4") == (1, 4)
    for bad in ("0,0,2", "a,b", "-1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_layers(bad)
    for bad in ("2", "0:3", "x:y"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rung(bad)
    assert row_cells([3.5, None], [3.6, 3.0]) == ["3.500 (-2.8%)", "-"]
    assert row_cells([3.5], [None]) == ["3.500"]
    for name, config in (("a", cfg), ("b", {**cfg, "steps": 2200})):
        (tmp_path / "eagle" / name).mkdir(parents=True)
        (tmp_path / "eagle" / name / "report.json").write_text(json.dumps({"config": config, "x": name}))
    assert cached_report(cfg, tmp_path)["entry"] == "a"
    assert cached_report({**cfg, "steps": 7}, tmp_path) is None
    assert not same_run(tmp_path / "nothing", rows[0].overrides())
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "metrics.json").write_text("{}")
    recorded = ["method=eagle3", "threads=1", "hydra.run.dir=x", *rows[0].overrides()]
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in recorded))
    assert same_run(run, ["method=eagle3", "threads=1", *rows[0].overrides()])
    assert not same_run(run, ["method=eagle3", "threads=1", *rows[1].overrides()])
    assert not same_run(run, ["method=eagle3", "threads=2", *rows[0].overrides()])


def test_gpu_forward_reads_real_shapes_through_the_presets_defaults_and_times_a_forward():
    """benchmarks/gpu_forward.py on the CPU (its smoke path): a preset's shape includes what its defaults
    list inherits (Llama-2-13B's vocabulary comes from the 7B preset), and a forward over a cache reports
    per n the wall and host time and the kernels (here: top-level aten ops), the cache put back each time."""
    from benchmarks import gpu_forward

    assert gpu_forward.shape_of("llama2_13b")["vocab_size"] == 32000
    assert gpu_forward.shape_of("llama2_13b")["n_layers"] == 40
    with pytest.raises(SystemExit, match="no conf/model/no_such_model.yaml"):
        gpu_forward.shape_of("no_such_model")
    out = gpu_forward.forward("random_tiny", [1, 3], context=16, reps=2, attention="eager")
    assert out["device"] == "cpu" and [r["n"] for r in out["rows"]] == [1, 3]
    for r in out["rows"]:
        assert r["kernels"] > 0 and r["wall_ms"] > 0 and r["host_ms"] > 0
        assert r["host_us_per_kernel"] == pytest.approx(1e3 * r["host_ms"] / r["kernels"])
    # the same forward again (a fresh cache of 16 tokens) counts the same ops: the cache was cropped back
    again = gpu_forward.forward("random_tiny", [1, 3], context=16, reps=2, attention="eager")
    assert [r["kernels"] for r in again["rows"]] == [r["kernels"] for r in out["rows"]]


def test_gpu_medusa_step_names_a_missing_checkout_and_times_parts_only_when_split(tmp_path):
    """benchmarks/gpu_medusa_step.py runs Medusa's own code from a user-supplied checkout, never fetched: a
    folder without Medusa's package is refused by name; its clock records the parts of a step only in the
    split pass (the timed generations run untouched, as the answer files time them)."""
    from benchmarks import gpu_medusa_step as g

    with pytest.raises(SystemExit, match="not a FasterDecoding/Medusa checkout"):
        g.medusa_api(tmp_path)
    synced = []
    off, on = g.Clock(lambda: synced.append(1), split=False), g.Clock(lambda: synced.append(1), split=True)
    for clock in (off, on):
        clock.start()
        for part in g.PARTS:
            clock.lap(part)
    assert all(v == [] for v in off.parts.values())
    assert all(len(v) == 1 and v[0] >= 0 for v in on.parts.values())
    assert len(synced) == 1 + len(g.PARTS)
