"""bf16 as a speed choice (methods.core.bf16): float32 where this machine's bf16 products are slow.

On a CPU without AVX512-BF16/AMX PyTorch's bf16 GEMM is tens of times slower than float32; the zoo's
training autocast and its decode dtype (``model.dtype=auto``) must then fall back to float32, and every key
that names the trained artefact must follow the choice."""

from __future__ import annotations

import math

import pytest
import torch

from methods.core import bf16
from methods.models import resolve_dtype
from methods.zoo import build, layerskip


@pytest.fixture
def bf16_speed(monkeypatch):
    def force(value: str) -> None:
        monkeypatch.setenv(bf16.ENV, value)

    return force


def test_the_probe_measures_a_finite_positive_ratio():
    r = bf16.measured_slowdown("cpu")
    assert math.isfinite(r) and r > 0


def test_the_timing_restores_torchs_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bf16.measured_slowdown.__wrapped__("cpu", rounds=2)  # uncached: times on one thread
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_an_x86_cpu_is_decided_by_torchs_probe_not_by_timing(monkeypatch):
    """A timing can be upset by load (it was: one row of a bf16 sweep decoded in float32); the CPU's flags
    cannot."""
    monkeypatch.delenv(bf16.ENV, raising=False)

    def timed(device="cpu"):
        raise AssertionError("an x86 CPU whose probe answers must not be timed")

    monkeypatch.setattr(bf16, "measured_slowdown", timed)
    monkeypatch.setattr(bf16.platform, "machine", lambda: "x86_64")
    for avx512_bf16, amx, fast in ((True, False, True), (False, True, True), (False, False, False)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert bf16.cpu_bf16_support() is fast
        assert bf16.bf16_is_fast() is fast
        assert resolve_dtype("auto") == (torch.bfloat16 if fast else torch.float32)
    monkeypatch.setattr(bf16.platform, "machine", lambda: "aarch64")  # no probe there: timed
    assert bf16.cpu_bf16_support() is None
    with pytest.raises(AssertionError, match="must not be timed"):
        bf16.bf16_is_fast()


def test_the_choice_follows_the_timing_where_the_probe_cannot_tell(monkeypatch):
    monkeypatch.delenv(bf16.ENV, raising=False)
    monkeypatch.setattr(bf16, "cpu_bf16_support", lambda: None)
    monkeypatch.setattr(bf16, "measured_slowdown", lambda device="cpu": 40.0)  # an AVX2-only CPU's figure
    assert not bf16.bf16_is_fast() and bf16.speed_dtype("bfloat16") == "float32"
    monkeypatch.setattr(bf16, "measured_slowdown", lambda device="cpu": 0.45)  # AVX512-BF16: faster
    assert bf16.bf16_is_fast() and bf16.speed_dtype("bfloat16") == "bfloat16"
    assert bf16.speed_dtype("float32") == "float32" and bf16.speed_dtype("float16") == "float16"


def test_the_environment_overrides_and_a_typo_is_refused(bf16_speed):
    bf16_speed("slow")
    assert resolve_dtype("auto") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16  # a dtype named is kept
    bf16_speed("fast")
    assert resolve_dtype("auto") == torch.bfloat16
    bf16_speed("quick")
    with pytest.raises(ValueError, match="SPECSIM_BF16"):
        bf16.bf16_is_fast()


def test_the_zoo_key_follows_the_training_dtype(bf16_speed):
    raw = build.PRESETS["default"]
    bf16_speed("fast")
    fast = build.preset("default")
    assert fast == raw and build.zoo_key(fast) == build.zoo_key(raw)  # keys of bf16 machines unchanged
    bf16_speed("slow")
    slow = build.preset("default")
    assert (slow.target.train_dtype, slow.draft.train_dtype) == ("float32", "float32")
    assert build.zoo_key(slow) != build.zoo_key(fast)
    assert build.preset("micro") == build.PRESETS["micro"]  # trained in float32 already


def test_a_zoo_model_is_recognised_under_the_key_this_machine_builds(bf16_speed, tmp_path):
    """The extra drafts (SpecInfer's boost, Online SD's prose) find their zoo from the target's checkpoint
    dir: a float32-trained zoo's key must be recognised where bf16 is slow (it was not: both methods
    refused the zoo's own target on an AVX2 machine)."""
    from methods.zoo.drafts import zoo_of

    def loaded_from(cfg=None, where: str = "") -> torch.nn.Module:
        model = torch.nn.Linear(2, 2)
        where = where or str(tmp_path / f"default-{build.zoo_key(cfg)}" / "target")
        model.config = type("Config", (), {"_name_or_path": where})()
        return model

    for speed in ("slow", "fast"):
        bf16_speed(speed)
        here = build.preset("default")
        assert zoo_of(loaded_from(here)) == here
    bf16_speed("slow")
    assert zoo_of(loaded_from(build.PRESETS["default"])) is None  # the bf16 zoo is not this machine's
    assert zoo_of(loaded_from(where=str(tmp_path / "my-checkpoint"))) is None


def test_the_layerskip_variant_key_follows_the_training_dtype(bf16_speed, tmp_path):
    target = torch.nn.Linear(4, 4)
    recipe = layerskip.LayerSkipRecipe()
    bf16_speed("fast")
    fast = layerskip.variant_dir(target, recipe, tmp_path)
    assert layerskip.for_this_machine(recipe) == recipe
    bf16_speed("slow")
    assert layerskip.for_this_machine(recipe).train_dtype == "float32"
    assert layerskip.variant_dir(target, recipe, tmp_path) != fast


def test_a_decoding_run_resolves_auto_and_simulate_keeps_it(bf16_speed, run_config):
    bf16_speed("slow")
    cfg = run_config("device=cpu")
    assert (cfg.model.dtype, cfg.model.bytes_per_param) == ("float32", 4.0)
    assert run_config("task=simulate").model.dtype == "auto"
    assert run_config("device=cpu", "model.dtype=bfloat16").model.dtype == "bfloat16"
    bf16_speed("fast")
    cfg = run_config("device=cpu")
    assert (cfg.model.dtype, cfg.model.bytes_per_param) == ("bfloat16", 2.0)


def test_head_training_autocast_is_off_where_bf16_is_slow(bf16_speed, monkeypatch):
    from methods.heads import trainer

    seen = []
    real = torch.autocast

    def spy(device_type, dtype=None, enabled=True, **kw):
        seen.append(enabled)
        return real(device_type, dtype=dtype, enabled=enabled, **kw)

    monkeypatch.setattr(trainer.torch, "autocast", spy)
    w = torch.nn.Parameter(torch.ones(2))
    for speed, expected in (("slow", False), ("fast", True)):
        bf16_speed(speed)
        seen.clear()
        trainer.fit([w], lambda g: None, lambda b: (w ** 2).sum(), trainer.LoopConfig(steps=2, lr=0.1),
                    torch.Generator().manual_seed(0))
        assert seen == [expected, expected]

