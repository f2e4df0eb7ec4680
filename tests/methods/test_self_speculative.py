"""Self-speculative drafters (LayerSkip, Draft & Verify) and MTP modules: losslessness at temperature 1
through the registry (chi-square on the first tokens, as tests/methods/test_statistical.py), Draft & Verify's
adaptive exit threshold, the skip-set search, MTP training on the shared trainer, and the LayerSkip variant
(trained, cached, loaded in place: greedy decoding equals the variant's own autoregressive decoding)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from methods.core.drafter import Draft, StepFeedback
from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.drafters.autoregressive import Autoregressive
from methods.drafters.registry import build_drafter
from methods.models import Models, byte_tokenizer
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree
from tests.methods.conftest import peaked_small_vocab_llama
from tests.methods.test_statistical import PROMPT, chi2_pvalue, exact_marginals

T1 = SamplingParams(temperature=1.0)
N_SAMPLES = 1500
PARAMS = {
    "layerskip": {"exit_layer": 1},
    "draft_verify": {"skip": "config", "skip_mlp": [0], "exit_threshold": 0.05},
    "mtp": {"modules": "random", "num_heads": 3},
}


@pytest.fixture(scope="module")
def two_layer_small_vocab() -> Models:
    """Vocabulary 48, two layers (an early exit needs a layer after it), a peaked law."""
    return Models(peaked_small_vocab_llama(2, seed=5), None, None, torch.device("cpu"), torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARAMS))
def test_sampled_chains_follow_the_target(two_layer_small_vocab, name):
    models = two_layer_small_vocab
    method = MethodConfig(name=name, drafter=name, verifier=Verifier.chain, params=dict(PARAMS[name]))
    drafter = build_drafter(method, Tree.chain(3), models, T1)
    engine = ModelEngine(models.target)
    g = torch.Generator().manual_seed(99)
    opts = DecodeOptions(Verifier.chain, T1, 3)
    rows = np.asarray([decode(engine, drafter, PROMPT, opts, g).token_ids for _ in range(N_SAMPLES)])
    for i, law in enumerate(exact_marginals(models.target, T1)):
        pvalue = chi2_pvalue(rows[:, i], law)
        assert pvalue > 1e-4, f"{name} token {i + 1}: p-value {pvalue:.2e}"


def _feedback(drafter, accepted: int, drafted: int = 4) -> None:
    tree = Tree.chain(drafted)
    drafter.feedback(StepFeedback(Draft(tree, torch.zeros(tree.size, dtype=torch.long)),
                                  tuple(range(accepted + 1)), 0))


def test_draft_exit_threshold_follows_the_acceptance(tiny_models):
    method = MethodConfig(name="dv", drafter="draft_verify", params={"skip": "config", "skip_mlp": [0]})
    low = build_drafter(method, Tree.chain(4), tiny_models, SamplingParams(0.0))
    high = build_drafter(method, Tree.chain(4), tiny_models, SamplingParams(0.0))
    start = low.threshold
    for _ in range(20):
        _feedback(low, 0)
        _feedback(high, 4)
    assert low.threshold > start > high.threshold  # rejections → stricter exits; acceptances → longer drafts


def test_skip_search_walks_the_greedy_path(tiny_models):
    from methods.drafters.skip_search import SearchConfig, predicted_speedup, search

    assert predicted_speedup(0.0, 0.5, [1.0, 1.0, 1.0]) == (1.0, 0)  # nothing accepted: plain decoding wins
    s, gamma = predicted_speedup(0.9, 0.1, [1.0, 1.0, 1.0])
    assert gamma == 2 and s == pytest.approx((1 + 0.9 + 0.81) / 1.2)
    out = search(tiny_models.target, tiny_models.tokenizer, SearchConfig(prompts=2, prompt_tokens=24,
                                                                         max_gamma=2, reps=1))
    assert out["evaluations"] == 4 + 3 + 2  # 2 layers = 4 sub-layers; never all skipped
    sizes = [len(r["skip_attn"]) + len(r["skip_mlp"]) for r in out["path"]]
    assert sizes == [1, 2, 3] and out["chosen"] in out["path"]
    assert all(0 <= r["alpha"] <= 1 for r in out["path"])


def test_mtp_modules_learn_on_the_shared_trainer(tiny_target):
    from methods.heads import trainer
    from methods.heads.mtp.train import MTPTrainConfig, mtp_loss, new_modules

    cfg = MTPTrainConfig(depths=2, window=8)
    mods = new_modules(tiny_target, cfg).train()
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 300, (8, 24), generator=g)
    feats = trainer.target_features(tiny_target, windows)
    batch = (feats.hidden[:, :8], windows[:, :10], feats.greedy[:, :10])
    with torch.no_grad():
        before = float(mtp_loss(mods, *batch))
    trainer.fit(mods.trainable(), lambda gen: batch, lambda b: mtp_loss(mods, *b),
                trainer.LoopConfig(30, 3e-3, autocast=False), g)
    with torch.no_grad():
        assert float(mtp_loss(mods, *batch)) < 0.7 * before


def test_layerskip_variant_decodes_as_its_own_autoregression(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSIM_CACHE", str(tmp_path))
    target = copy.deepcopy(tiny_target)  # the variant is loaded into the target in place
    models = Models(target, None, byte_tokenizer(320), torch.device("cpu"), torch.float32)
    train = {"steps": 3, "seq_len": 32, "train_chars": 20_000, "eval_tokens": 64}
    method = MethodConfig(name="ls", drafter="layerskip", params={"exit_layer": 1, "variant": "train",
                                                                   "train": train})
    with torch.inference_mode():  # as a calibration builds its drafter: training must still get gradients
        drafter = build_drafter(method, Tree.chain(3), models, SamplingParams(0.0))
    assert not torch.equal(target.lm_head.weight, tiny_target.lm_head.weight)  # continued training moved it
    again = build_drafter(method, Tree.chain(3), models, SamplingParams(0.0))  # a variant is not retrained
    assert len(list((tmp_path / "layerskip").glob("*/model"))) == 1 and again.exit_layer == 1
    engine = ModelEngine(target)
    prompt = torch.arange(40, 60)
    g = torch.Generator().manual_seed(0)
    ref = decode(engine, Autoregressive(), prompt, DecodeOptions(max_new_tokens=20), g).token_ids
    assert decode(engine, drafter, prompt, DecodeOptions(max_new_tokens=20), g).token_ids == ref


def test_exit_layers_are_ranked_by_predicted_speedup():
    from methods.zoo.layerskip import choose_exit, drop_rates, exit_weights

    flat = {1: 1.0, 16: 1.0}  # memory-bound t(n): verifying more tokens is free
    ranked = choose_exit([0.1, 0.9, 0.95, 0.97, 0.98, 1.0], flat)
    assert [r["exit_layer"] for r in ranked][:2] == [2, 3] and ranked[-1]["exit_layer"] == 1
    assert ranked == sorted(ranked, key=lambda r: -r["speedup"])
    # timed draft steps (exit_costs) replace E / L: a per-forward overhead makes shallow exits dearer
    agreement = [0.5, 0.55, 0.95, 0.97, 0.98, 1.0]
    assert choose_exit(agreement, flat)[0]["exit_layer"] == 3
    timed = {1: 0.45, 2: 0.5, 3: 0.9, 4: 0.95, 5: 0.97}
    ranked = choose_exit(agreement, flat, draft_cost=timed)
    assert {r["exit_layer"]: r["rho"] for r in ranked} == timed and ranked[0]["exit_layer"] != 3
    assert drop_rates(6, 0.2)[0] == 0 and drop_rates(6, 0.2)[-1] == pytest.approx(0.2)
    first, last = exit_weights(6, 0.2, 0, 400), exit_weights(6, 0.2, 399, 400)
    assert first == [0, 0, 0, 0, 0, 1.0] and sum(last) == pytest.approx(1) and all(w > 0 for w in last[1:])


def test_auto_exit_layer_is_chosen_by_calibration_and_cached(tiny_target, tmp_path, monkeypatch):
    """exit_layer=auto: the best predicted speedup of the calibrated table (α_E measured, ρ_E timed), cached
    per model and device, decoded with, and reported through run_stats (metrics.json)."""
    from methods.drafters import exit_choice
    from methods.zoo.layerskip import choose_exit

    monkeypatch.setenv("SPECSIM_CACHE", str(tmp_path))
    models = Models(tiny_target, None, byte_tokenizer(320), torch.device("cpu"), torch.float32)
    # τ of a greedy chain from runs of agreement: positions 0..3 of [T, T, F, T, T, T] start runs 2, 1, 0, 3
    agree = [torch.tensor([True, True, False, True, True, True])]
    assert exit_choice.chain_tau(agree, 3) == pytest.approx(1 + (2 + 1 + 0 + 3) / 4)
    small = exit_choice.ExitChoiceConfig(prompts=2, prompt_tokens=24, new_tokens=12, reps=2)
    table = exit_choice.exit_table(tiny_target, models.tokenizer, 3, small)
    n_layers = tiny_target.config.num_hidden_layers
    assert sorted(r["exit_layer"] for r in table["ranked"]) == list(range(1, n_layers))
    assert all(0 <= r["alpha"] <= 1 and r["rho"] > 0 and r["gamma"] == 3 and 1 <= r["tau"] <= 4
               for r in table["ranked"])
    again = choose_exit([r["alpha"] for r in sorted(table["ranked"], key=lambda r: r["exit_layer"])] + [1.0],
                        {1: 1.0, 4: table["verify_over_t1"]},
                        draft_cost={r["exit_layer"]: r["rho"] for r in table["ranked"]}, gamma=3,
                        tau={r["exit_layer"]: r["tau"] for r in table["ranked"]})
    assert table["chosen"] == again[0]["exit_layer"] == max(table["ranked"], key=lambda r: r["speedup"])[
        "exit_layer"]
    monkeypatch.setattr(exit_choice, "DEFAULT", small)
    method = MethodConfig(name="ls", drafter="layerskip", params={"exit_layer": "auto"})
    drafter = build_drafter(method, Tree.chain(3), models, SamplingParams(0.0))
    cached = list((tmp_path / "profiles").glob("layerskip-exit-*.json"))
    assert len(cached) == 1 and drafter.exit_layer == exit_choice.json.loads(cached[0].read_text())["chosen"]
    stats = drafter.run_stats()
    assert stats["exit_layer"] == drafter.exit_layer and stats["exit_layer_source"] == "auto (calibrated)"
    assert len(stats["exit_predicted_speedup_by_layer"]) == n_layers - 1
    fixed = build_drafter(MethodConfig(name="ls", drafter="layerskip", params={"exit_layer": 1}),
                          Tree.chain(3), models, SamplingParams(0.0))
    assert fixed.run_stats() == {"exit_layer": 1, "exit_layer_source": "config"}
    engine = ModelEngine(tiny_target)
    prompt = torch.arange(40, 60)
    g = torch.Generator().manual_seed(0)
    ref = decode(engine, Autoregressive(), prompt, DecodeOptions(max_new_tokens=12), g).token_ids
    assert decode(engine, drafter, prompt, DecodeOptions(max_new_tokens=12), g).token_ids == ref
