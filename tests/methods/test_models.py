"""Model loading: random_tiny (with its byte tokenizer), local checkpoints of the Llama, GPT-2 and GPT-NeoX
families (created by the test with save_pretrained), tree attention and greedy-equivalent speculative decoding
on each, and the never-download rule."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.drafters.autoregressive import Autoregressive
from methods.drafters.registry import build_drafter
from methods.models import byte_tokenizer, load_models, resolve_device
from specsim.config import MethodConfig, ModelConfig, Verifier
from specsim.tree import Tree

GREEDY = SamplingParams(temperature=0.0)
ATOL = 1e-4


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_random_tiny_builds_with_a_tokenizer(run_config):
    cfg = run_config("model=random_tiny")
    models = load_models(cfg.model, "auto", cfg.model.dtype)
    assert models.device == resolve_device("auto") and models.dtype == torch.float32
    assert models.target.config.vocab_size == cfg.model.vocab_size == len(models.tokenizer)
    assert models.draft is not None and models.draft.config.num_hidden_layers == cfg.model.draft_n_layers
    text = "def f(x):\n    return x + 1  # héllo ✓"
    ids = models.tokenizer.encode(text, add_special_tokens=False)
    assert max(ids) < 256 and models.tokenizer.decode(ids) == text  # bytes: id = byte value
    assert models.tokenizer.eos_token_id == 257
    assert models.tokenizer.decode([300, 65], skip_special_tokens=True) == "A"  # filler ids decode to nothing


def test_random_models_are_deterministic():
    cfg = ModelConfig(source="random", n_layers=1, hidden_size=32, n_heads=2, n_kv_heads=2,
                      intermediate_size=64, vocab_size=300, context_length=64, draft_n_layers=0)
    a, b = load_models(cfg, "cpu", "float32"), load_models(cfg, "cpu", "float32")
    assert a.draft is None
    for pa, pb in zip(a.target.parameters(), b.target.parameters()):
        assert torch.equal(pa, pb)


def test_missing_hub_model_says_it_never_downloads(tmp_path):
    cfg = ModelConfig(source="hub", path="nobody/surely-not-a-cached-model")
    with pytest.raises(OSError, match="never downloads"):
        load_models(cfg, "cpu", "float32")


def tiny_checkpoint(family: str, path, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if family == "gpt2":
            cfg = GPT2Config(vocab_size=300, n_positions=128, n_embd=32, n_layer=2, n_head=2)
            model = GPT2LMHeadModel(cfg)
        else:
            model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64,
                                                     max_position_embeddings=128))
    model.save_pretrained(path)
    byte_tokenizer(300).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_other_families_tree_forward_and_speculative_decoding(tmp_path, family):
    target_dir = tiny_checkpoint(family, tmp_path / "target", seed=0)
    cfg = ModelConfig(source="local", path=str(target_dir), draft_path=str(target_dir))
    models = load_models(cfg, "cpu", "float32")
    engine = ModelEngine(models.target)
    assert engine.fast is None  # the generic HF path
    prompt = list(range(40, 52))
    tree = Tree.from_parents([-1, 0, 0, 1, 1, 3])
    tokens = torch.tensor([prompt[-1], 7, 8, 9, 10, 11])
    engine.prefill(torch.tensor(prompt[:-1]))
    logits = engine.forward_tree(tokens, tree).logits
    for node in range(tree.size):
        path = [int(tokens[i]) for i in tree.path_to(node)[1:]]
        ref = reference_logits(models.target, prompt + path)
        torch.testing.assert_close(logits[node], ref, atol=ATOL, rtol=0)
    g = torch.Generator().manual_seed(0)
    opts = DecodeOptions(Verifier.greedy, GREEDY, 20)
    ref = decode(engine, Autoregressive(), torch.tensor(prompt), opts, g)
    drafter = build_drafter(MethodConfig(drafter="draft_model"), Tree.chain(3), models, GREEDY)
    res = decode(engine, drafter, torch.tensor(prompt), opts, g)
    assert res.token_ids == ref.token_ids
    assert res.n_target_forwards == 5  # the target drafts for itself: blocks of γ + 1 = 4


def test_local_llama_checkpoint_uses_the_lean_forward(tmp_path, tiny_target):
    tiny_target.save_pretrained(tmp_path / "llama")
    byte_tokenizer(tiny_target.config.vocab_size).save_pretrained(tmp_path / "llama")
    models = load_models(ModelConfig(source="local", path=str(tmp_path / "llama")), "cpu", "float32")
    assert models.draft is None
    assert ModelEngine(models.target).fast is not None
