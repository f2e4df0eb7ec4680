"""The engine's one extension for self-drafting (LayerSkip: Elhoushi et al. 2024; Draft & Verify: Zhang et al.
2023), fp32 against plain forwards: an early exit's logits are the target's norm + LM head on layer E's
output; skipping sub-layers equals a hand-written residual stream; a tree verified by resuming the draft's
layers [0, E) (shared KV) gives the plain forward's logits, and its commit leaves the cache of a fresh
prefill (rollback); a drafter that drops its partial nodes leaves the cache untouched."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from methods.core.engine import ModelEngine, Resume
from methods.core.fast_llama import SubLayers
from specsim.tree import Tree

ATOL = 1e-4


def early_exit_reference(model, ids: list[int], exit_layer: int) -> torch.Tensor:
    """HF's own outputs: hidden_states[E] is layer E-1's output; the shared final norm and LM head on it."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        h = out.hidden_states[exit_layer][0, -1]
        return model.lm_head(model.model.norm(h)).float()


def test_early_exit_equals_norm_and_head_on_layer_output(tiny_target):
    ids = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(0))
    engine = ModelEngine(tiny_target)
    engine.prefill(ids[:-1])
    out = engine.extend(ids[-1:], [-1], sub=SubLayers(stop=1))
    torch.testing.assert_close(out.logits[0], early_exit_reference(tiny_target, ids.tolist(), 1),
                               atol=ATOL, rtol=0)
    assert engine.cache.layers[0].length == 11 and engine.cache.layers[1].length == 10  # layer 1 not run
    engine.drop_pending()
    assert all(layer.length == 10 for layer in engine.cache.layers)


def test_skipped_sublayers_equal_a_hand_written_stream(tiny_target):
    """Skip layer 0's MLP and layer 1's attention: x + attn0(x), then + mlp1(...)."""
    ids = torch.randint(0, 300, (7,), generator=torch.Generator().manual_seed(1))
    engine = ModelEngine(tiny_target)
    sub = SubLayers(skip_attn=frozenset({1}), skip_mlp=frozenset({0}))
    out = engine.extend(ids, list(range(-1, 6)), sub=sub)
    layers = tiny_target.model.layers
    with torch.no_grad():
        x = tiny_target.model.embed_tokens(ids[None])
        pos = torch.arange(7)[None]
        emb = tiny_target.model.rotary_emb(x, pos)
        causal = torch.full((7, 7), float("-inf")).triu(1)[None, None]
        x = x + layers[0].self_attn(layers[0].input_layernorm(x), emb, causal)[0]
        x = x + layers[1].mlp(layers[1].post_attention_layernorm(x))
        ref = tiny_target.lm_head(tiny_target.model.norm(x))[0].float()
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)
    assert engine.cache.layers[1].length == 0  # its attention never ran: no KV


def random_tree(n: int, seed: int) -> Tree:
    g = torch.Generator().manual_seed(seed)
    return Tree.from_parents([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 8), m_pick=st.integers(0, 100), seed=st.integers(0, 10_000), pick=st.integers(0, 100))
def test_resumed_tree_equals_plain_forward_and_rolls_back(tiny_target, n, m_pick, seed, pick):
    """The draft runs nodes 0..m-1 through layer 0 on the engine; the verify resumes them at layer 1."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 300, (9,), generator=g)
    tree, m = random_tree(n, seed), 1 + m_pick % n
    tokens = torch.randint(0, 300, (n,), generator=g)
    tokens[0] = prompt[-1]
    plain = ModelEngine(tiny_target)
    plain.prefill(prompt[:-1])
    want = plain.forward_tree(tokens, tree).logits
    engine = ModelEngine(tiny_target)
    engine.prefill(prompt[:-1])
    parents = [tree.parents[i] if i else -1 for i in range(m)]
    part = engine.extend(tokens[:m], parents, sub=SubLayers(stop=1))
    got = engine.forward_tree(tokens, tree, resume=Resume(1, part.residual))
    torch.testing.assert_close(got.logits, want, atol=ATOL, rtol=0)
    path = tree.path_to(pick % n)
    engine.commit(path)
    fresh = ModelEngine(tiny_target)
    fresh.prefill(torch.cat([prompt[:-1], tokens[list(path)]]))
    for a, b in zip(engine.cache.layers, fresh.cache.layers):
        assert a.length == b.length == 8 + len(path)
        torch.testing.assert_close(a.kbuf[:, :, : a.length], b.kbuf[:, :, : b.length], atol=ATOL, rtol=0)
        torch.testing.assert_close(a.vbuf[:, :, : a.length], b.vbuf[:, :, : b.length], atol=ATOL, rtol=0)


def test_mismatched_pending_nodes_are_refused(tiny_target):
    engine = ModelEngine(tiny_target)
    engine.prefill(torch.arange(5))
    part = engine.extend(torch.tensor([7]), [-1], sub=SubLayers(skip_attn=frozenset({0})))
    with pytest.raises(AssertionError, match="layers"):  # layer 0 holds no KV for the pending node
        engine.forward_tree(torch.tensor([7, 8]), Tree.chain(1), resume=Resume(1, part.residual))
