"""Workload prompts: deterministic, exact length, drawn from the right split, grounded ones copy context."""

from __future__ import annotations

import socket

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from methods.data.corpus import corpus, module_sources, split_of
from methods.data.workloads import Prompt, load_prompts
from methods.zoo.tokenizer import EOS, train_tokenizer, wrap
from specsim.config import WorkloadConfig


def byte_tokenizer():
    """A byte-level tokenizer with no merges: one token per byte (256 ids + eos)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return wrap(tok)


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def tokenizer(request):
    if request.param == "bytes":
        return byte_tokenizer()
    texts = [d.text for d in corpus("train")[:40]]  # a small BPE like the zoo's, trained in a second
    return train_tokenizer(texts, vocab_size=600)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def workload(kind: str, **kw) -> WorkloadConfig:
    kw.setdefault("prompt_tokens", 96)
    return WorkloadConfig(name=kind, kind=kind, num_prompts=kw.pop("num_prompts", 6), **kw)


def _check_prompts(prompts: list[Prompt], w: WorkloadConfig, tokenizer) -> None:
    assert len(prompts) == w.num_prompts
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    for p in prompts:
        assert len(p.token_ids) == w.prompt_tokens
        assert p.text == tokenizer.decode(p.token_ids)
        assert p.reference and split_of(p.module) == w.split
        assert p.prompt_id.startswith(f"{p.kind}/{p.module}/")


@pytest.mark.parametrize("kind", ["code", "prose"])
def test_prompts_are_deterministic_exact_length_and_from_the_split(kind, tokenizer, no_network):
    w = workload(kind)
    prompts = load_prompts(w, tokenizer, seed=3)
    _check_prompts(prompts, w, tokenizer)
    assert all(p.kind == kind for p in prompts)
    assert load_prompts(w, tokenizer, seed=3) == prompts
    assert [p.prompt_id for p in load_prompts(w, tokenizer, seed=4)] != [p.prompt_id for p in prompts]


def test_code_prompts_are_the_source_cut_inside_a_function(tokenizer):
    sources = module_sources()
    for p in load_prompts(workload("code", split="calibration"), tokenizer, seed=0):
        # the prompt's end and the reference are contiguous text of the held-out module
        assert p.text[-60:] + p.reference[:60] in sources[p.module]
        assert p.reference.startswith("\n")


def test_grounded_continuations_copy_the_context(tokenizer):
    w = workload("grounded", prompt_tokens=600 if tokenizer.vocab_size < 300 else 256, num_prompts=5)
    prompts = load_prompts(w, tokenizer, seed=1)
    _check_prompts(prompts, w, tokenizer)
    for p in prompts:
        ref_lines = [ln.strip() for ln in p.reference.splitlines() if ln.strip()]
        context = {ln.strip() for ln in p.text.splitlines()}
        copied = sum(ln in context for ln in ref_lines) / len(ref_lines)
        assert copied >= 0.5, (p.prompt_id, copied)
        assert "\n# " in p.text, "the prompt carries the instruction"


def test_mixed_interleaves_the_kinds_deterministically(tokenizer):
    w = workload("mixed", num_prompts=6, prompt_tokens=400 if tokenizer.vocab_size < 300 else 160)
    prompts = load_prompts(w, tokenizer, seed=0)
    _check_prompts(prompts, w, tokenizer)
    assert [p.kind for p in prompts] == ["code", "prose", "grounded"] * 2
    assert load_prompts(w, tokenizer, seed=0) == prompts


def test_too_many_prompts_is_an_error_not_a_short_list(tokenizer):
    with pytest.raises(ValueError, match="usable prompts"):
        load_prompts(workload("grounded", prompt_tokens=24, num_prompts=3), tokenizer, seed=0)
