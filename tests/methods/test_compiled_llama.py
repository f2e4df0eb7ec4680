"""The compiled forward (methods.core.compiled_llama) against the eager lean forward, in float32.

Fast tests run the graph's module uncompiled (``_compile`` replaced by the identity): the same code path
through the engine (buffers reserved, K/V written inside the module, start position), bit-equal to the eager
forward. The slow tests compile it with inductor: logits to float rounding, greedy decoding (target and draft
compiled) equal to the eager engine's, and two models of one shape keep their own weights."""

from __future__ import annotations

import pytest
import torch

from methods.core import compiled_llama
from methods.core.engine import ModelEngine, set_compile
from methods.core.fast_llama import BLOCKED_MIN_ROWS, can_pack
from methods.core.loop import DecodeOptions, decode
from methods.drafters.autoregressive import Autoregressive
from methods.drafters.staged import StagedDrafter, StagedParams
from methods.models import random_llama
from specsim.tree import Tree
from tests.methods.conftest import TINY, perturbed_copy, sharpen
from tests.methods.test_engine import random_tree

ROOT = Tree.from_parents([-1])


@pytest.fixture
def uncompiled(monkeypatch):
    """The compiled path with the module run eagerly; counts the modules handed to the compiler."""
    built = []

    def identity(module):
        built.append(module)
        return module

    monkeypatch.setattr(compiled_llama, "_compile", identity)
    monkeypatch.setattr(compiled_llama, "_COMPILED", type(compiled_llama._COMPILED)())
    return built


def _run_tree(engine: ModelEngine, prompt: torch.Tensor, tree: Tree, tokens: torch.Tensor):
    engine.prefill(prompt)
    out = engine.forward_tree(tokens, tree, hidden=True)
    return out, [(lay.kbuf[:, :, : lay.length].clone(), lay.vbuf[:, :, : lay.length].clone())
                 for lay in engine.cache.layers]


@pytest.mark.parametrize("n", [1, 2, 12])
def test_compiled_path_equals_eager_forward(tiny_target, uncompiled, n):
    g = torch.Generator().manual_seed(n)
    prompt, tree = torch.randint(0, 300, (9,), generator=g), random_tree(n, n)
    tokens = torch.randint(0, 300, (n,), generator=g)
    want, want_kv = _run_tree(ModelEngine(tiny_target, pack=False, compile=False), prompt, tree, tokens)
    assert not uncompiled
    engine = ModelEngine(tiny_target, pack=False, compile=True)
    got, got_kv = _run_tree(engine, prompt, tree, tokens)
    assert len(uncompiled) == 1  # the tree forward ran through the module (the prefill stays eager)
    torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
    torch.testing.assert_close(got.hidden, want.hidden, atol=0, rtol=0)
    for (k, v), (k0, v0) in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(k, k0, atol=0, rtol=0)
        torch.testing.assert_close(v, v0, atol=0, rtol=0)
    engine.commit(tree.path_to(n - 1))  # commit works on the buffers the module wrote
    assert engine.length == 9 + len(tree.path_to(n - 1))


def test_one_module_per_model_and_rebuilt_when_weights_change(uncompiled):
    model = sharpen(random_llama(TINY, seed=5), 8.0).eval()
    ids = torch.arange(3, 10)
    engines = [ModelEngine(model, pack=False, compile=True) for _ in range(2)]
    for e in engines:
        e.prefill(ids)
        e.forward_tree(ids[:1], ROOT)
    assert len(uncompiled) == 1  # a second engine (a drafter rebuilt per pass) reuses the model's
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)
    e = engines[0]
    e.drop_pending()
    got = e.forward_tree(ids[:1], ROOT).logits
    assert len(uncompiled) == 2
    e.drop_pending()
    e.fast.compiled = False
    torch.testing.assert_close(got, e.forward_tree(ids[:1], ROOT).logits, atol=0, rtol=0)


def test_long_forwards_and_taps_stay_eager(tiny_target, uncompiled):
    engine = ModelEngine(tiny_target, pack=False, compile=True)
    engine.prefill(torch.arange(BLOCKED_MIN_ROWS))  # a prefill of BLOCKED_MIN_ROWS: blocked attention
    engine.forward_tree(torch.tensor([1, 2]), Tree.chain(1), layers=(0,))  # features: eager
    assert not uncompiled


def test_process_default(tiny_target, uncompiled):
    try:
        set_compile(True)
        assert ModelEngine(tiny_target, pack=False).fast.compiled
        assert not ModelEngine(tiny_target, pack=False, compile=False).fast.compiled
    finally:
        set_compile(False)
    assert not ModelEngine(tiny_target, pack=False).fast.compiled


def test_small_model_on_the_mm_path_stays_eager(tiny_target, uncompiled):
    """Every projection of the tiny model is small enough for the packed path's float32 mm at one row (a
    small draft's case), where the eager forward is the faster one."""
    if not can_pack(tiny_target):
        pytest.skip("no oneDNN-prepacked linears on this machine")
    packed = ModelEngine(tiny_target, pack=True, compile=True)
    assert not packed.fast.compiled
    packed.prefill(torch.arange(5))
    packed.forward_tree(torch.tensor([1]), ROOT)
    assert not uncompiled


# ---- inductor ------------------------------------------------------------------------------------------
needs_compiler = pytest.mark.skipif(not compiled_llama.compile_works(), reason="no C++ compiler for inductor")


@pytest.mark.slow
@needs_compiler
def test_inductor_graph_greedy_equals_eager():
    """Target and draft compiled: staged decoding (trees with masks, n = 1 and n > 1, the draft's chains)
    gives the eager engine's tokens, and the compiled logits agree to float rounding."""
    target = sharpen(random_llama(TINY, seed=7), 8.0).eval()
    draft = perturbed_copy(target, 0.3, seed=8)
    opts, params = DecodeOptions(max_new_tokens=24), StagedParams(depth=3, top_k=2)
    prompt = torch.randint(0, 300, (17,), generator=torch.Generator().manual_seed(3))

    def run(compile: bool) -> list[int]:
        engine, drafter = ModelEngine(target, pack=False, compile=compile), StagedDrafter(draft, params)
        drafter.engine = ModelEngine(draft, pack=False, compile=compile)  # the drafter's own, compiled
        assert drafter.engine.fast.compiled == engine.fast.compiled == compile
        return decode(engine, drafter, prompt, opts, torch.Generator().manual_seed(0)).token_ids

    want = decode(ModelEngine(target), Autoregressive(), prompt, opts, torch.Generator()).token_ids
    assert run(False) == want
    assert run(True) == want
    a, b = ModelEngine(target, pack=False, compile=False), ModelEngine(target, pack=False, compile=True)
    tree, tokens = random_tree(9, 4), torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(5))
    (want_out, want_kv), (got_out, got_kv) = (_run_tree(e, prompt, tree, tokens) for e in (a, b))
    torch.testing.assert_close(got_out.logits, want_out.logits, atol=1e-4, rtol=1e-4)
    for (k, v), (k0, v0) in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(k, k0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v0, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@needs_compiler
def test_two_models_of_one_shape_keep_their_weights():
    """Frozen weights are constants of a graph: a second model of the same shape must not run the first's."""
    ids = torch.arange(5, 12)
    for seed in (11, 12):
        model = sharpen(random_llama(TINY, seed=seed), 8.0).eval()
        a, b = ModelEngine(model, pack=False, compile=False), ModelEngine(model, pack=False, compile=True)
        a.prefill(ids)
        b.prefill(ids)
        want, got = (e.forward_tree(ids[:1], ROOT).logits for e in (a, b))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
