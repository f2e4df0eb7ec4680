"""Tiny random models for the engine tests (fp32: exactness), and a draft that agrees with the target often.

A random-init model is fine for losslessness: what is checked is that speculative decoding reproduces the
target's own greedy output / law, whatever the target is. The draft is a perturbed copy of the target so that
acceptance actually happens (and sometimes fails)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from methods.models import Models, byte_tokenizer, random_llama
from specsim.config import ModelConfig

TINY = ModelConfig(
    name="random_tiny", source="random", n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2,
    intermediate_size=128, vocab_size=320, context_length=256, draft_n_layers=1, draft_hidden_size=32,
)


def perturbed_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """The model with Gaussian noise of ``scale`` × each weight's std added: a draft that often agrees."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft.eval()


def sharpen(model: LlamaForCausalLM, factor: float) -> LlamaForCausalLM:
    """Scale the LM head so the random model's next-token law is peaked instead of ~uniform."""
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Profiles, heads and fits go to a temporary cache root (SPECSIM_CACHE), never the user's."""
    monkeypatch.setenv("SPECSIM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny matmuls are latency-bound: a second OpenMP thread only adds synchronisation (and on a shared
    2-core machine, waiting for a busy core), so these tests run single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_target() -> LlamaForCausalLM:
    return sharpen(random_llama(TINY, seed=0), 8.0).eval()


@pytest.fixture(scope="session")
def tiny_models(tiny_target) -> Models:
    """Target + perturbed-copy draft + byte tokenizer, fp32 on CPU."""
    draft = perturbed_copy(tiny_target, 0.3, seed=1)
    return Models(tiny_target, draft, byte_tokenizer(TINY.vocab_size), torch.device("cpu"), torch.float32)


def peaked_small_vocab_llama(n_layers: int, seed: int) -> LlamaForCausalLM:
    """A random Llama with a vocabulary of 48 and a peaked law (chi-square tests get enough samples per
    cell)."""
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return sharpen(LlamaForCausalLM(cfg), 15.0).eval()


@pytest.fixture(scope="session")
def small_vocab_models() -> Models:
    """Vocabulary of 48 and a peaked law: chi-square tests get enough samples per cell."""
    target = peaked_small_vocab_llama(1, seed=3)
    draft = perturbed_copy(target, 0.3, seed=4)
    return Models(target, draft, None, torch.device("cpu"), torch.float32)
