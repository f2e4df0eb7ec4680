"""The engine against plain HF forwards (fp32): tree attention in one forward equals one full forward per
node path; commit leaves the cache a fresh prefill of the accepted sequence would; the lean Llama forward
equals HF's; contexts are enforced with a clear error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from methods.core.engine import ModelEngine
from methods.core.fast_llama import can_pack
from specsim.tree import Tree

ATOL = 1e-4


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """Next-token logits after ``ids`` from a plain HF forward without any cache."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def random_tree(n: int, seed: int) -> Tree:
    g = torch.Generator().manual_seed(seed)
    return Tree.from_parents([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])


@pytest.mark.parametrize(("fast", "pack"), [(True, None), (True, False), (False, None)],
                         ids=["lean-packed", "lean-plain", "hf"])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_forward_equals_path_forwards(tiny_target, fast, pack, seed):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 300, (13,), generator=g).tolist()
    tree = random_tree(12, seed)
    tokens = torch.randint(0, 300, (tree.size,), generator=g)
    engine = ModelEngine(tiny_target, fast=fast, pack=pack)
    assert (engine.fast is not None) == fast
    if fast:
        assert engine.fast.packed == (can_pack(tiny_target) if pack is None else pack)
    engine.prefill(torch.tensor(prompt[:-1]))
    tokens[0] = prompt[-1]
    out = engine.forward_tree(tokens, tree, hidden=True)
    assert out.logits.shape == (tree.size, tiny_target.config.vocab_size)
    assert out.hidden.shape == (tree.size, tiny_target.config.hidden_size)
    for node in range(tree.size):
        path = [int(tokens[i]) for i in tree.path_to(node)[1:]]
        ref = reference_logits(tiny_target, prompt + path)
        torch.testing.assert_close(out.logits[node], ref, atol=ATOL, rtol=0)


def test_hidden_states_are_hf_last_hidden(tiny_target):
    ids = torch.arange(5, 25)
    engine = ModelEngine(tiny_target)
    out = engine.prefill(ids, hidden=True)
    with torch.no_grad():
        ref = tiny_target(ids[None], output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(out.hidden, ref, atol=ATOL, rtol=0)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 10), seed=st.integers(0, 10_000), pick=st.integers(0, 10_000))
def test_commit_equals_fresh_prefill(tiny_target, n, seed, pick):
    """After a tree forward + commit(path), the KV cache and the next logits are those of prefilling
    prompt + path from scratch."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 300, (9,), generator=g)
    tree = random_tree(n, seed)
    tokens = torch.randint(0, 300, (n,), generator=g)
    tokens[0] = prompt[-1]
    path = tree.path_to(pick % n)
    engine = ModelEngine(tiny_target)
    engine.prefill(prompt[:-1])
    engine.forward_tree(tokens, tree)
    engine.commit(path)
    fresh = ModelEngine(tiny_target)
    fresh.prefill(torch.cat([prompt[:-1], tokens[list(path)]]))
    assert engine.length == fresh.length == 8 + len(path)
    for a, b in zip(engine.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(a.kbuf[:, :, : a.length], b.kbuf[:, :, : b.length], atol=ATOL, rtol=0)
        torch.testing.assert_close(a.vbuf[:, :, : a.length], b.vbuf[:, :, : b.length], atol=ATOL, rtol=0)
    nxt = torch.tensor([7])
    chain0 = Tree.chain(0)
    after, fresh_after = engine.forward_tree(nxt, chain0), fresh.forward_tree(nxt, chain0)
    torch.testing.assert_close(after.logits, fresh_after.logits, atol=ATOL, rtol=0)


def test_extend_by_levels_equals_one_tree_forward(tiny_target):
    """A draft model builds its tree level by level (pending nodes); the logits are the one-forward ones."""
    tree = Tree.kary(2, 3)
    tokens = torch.arange(40, 40 + tree.size)
    prompt = torch.arange(10, 20)
    one = ModelEngine(tiny_target)
    one.prefill(prompt)
    want = one.forward_tree(tokens, tree).logits
    levels = ModelEngine(tiny_target)
    levels.prefill(prompt)
    got = torch.empty_like(want)
    for d in range(tree.depth + 1):
        nodes = [i for i in range(tree.size) if tree.depths[i] == d]
        out = levels.extend(tokens[nodes], [tree.parents[i] for i in nodes])  # pending index = node id
        got[nodes] = out.logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    levels.commit(tree.path_to(tree.size - 1))
    assert levels.length == 10 + tree.depth + 1 and levels.pending == 0


def test_buffer_grows_beyond_initial_capacity(tiny_target):
    engine = ModelEngine(tiny_target, capacity=8)
    engine.prefill(torch.arange(30))
    out = engine.forward_tree(torch.tensor([3, 4]), Tree.chain(1))
    ref = reference_logits(tiny_target, list(range(30)) + [3, 4])
    torch.testing.assert_close(out.logits[1], ref, atol=ATOL, rtol=0)


def test_context_overflow_is_a_clear_error(tiny_target):
    engine = ModelEngine(tiny_target)
    ctx = tiny_target.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.prefill(torch.zeros(ctx + 1, dtype=torch.long))
    engine.prefill(torch.zeros(ctx - 2, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.forward_tree(torch.zeros(4, dtype=torch.long), Tree.chain(3))


def test_lean_forward_leaves_hf_model_intact(tiny_target):
    """The fused weights are views of the model's own storage: HF's forward still gives the same logits."""
    ids = list(range(50, 70))
    before = reference_logits(tiny_target, ids)
    engine = ModelEngine(tiny_target, fast=True)
    assert engine.fast is not None
    out = engine.prefill(torch.tensor(ids))
    torch.testing.assert_close(reference_logits(tiny_target, ids), before, atol=0, rtol=0)
    torch.testing.assert_close(out.logits[0], before, atol=ATOL, rtol=0)


def test_lean_bf16_forward_is_close_to_hf(tiny_target):
    """bf16 on CPU: projections in bf16, attention in fp32 (faster there, and closer to exact): the logits
    stay within bf16 rounding of HF's own bf16 forward."""
    import copy

    model = copy.deepcopy(tiny_target).to(torch.bfloat16)
    ids = torch.arange(30, 60)
    lean, hf = ModelEngine(model, fast=True), ModelEngine(model, fast=False)
    assert lean.fast is not None and lean.fast.attn_dtype == torch.float32
    a, b = lean.prefill(ids).logits, hf.prefill(ids).logits
    scale = b.abs().max()
    assert (a - b).abs().max() < 0.05 * scale


def test_cpu_weights_are_prepacked_here(tiny_target):
    """This CI machine's torch has oneDNN: the CPU engines run prepacked projections (the speed the
    benchmarks report) in fp32, and in bf16 where oneDNN packs bf16 here (AVX512/AVX-NE-CONVERT); where it
    cannot, a bf16 engine runs the plain projections instead of failing."""
    import copy

    from methods.core.fast_llama import packing_works

    assert can_pack(tiny_target) and ModelEngine(tiny_target).fast.packed
    bf16 = ModelEngine(copy.deepcopy(tiny_target).to(torch.bfloat16))
    assert bf16.fast.packed == packing_works(torch.bfloat16)
    bf16.prefill(torch.arange(40, 48))
    assert bf16.forward_tree(torch.arange(3), random_tree(3, 3)).logits.isfinite().all()


def test_packed_bf16_projections_match_plain_ones(tiny_target):
    """bf16: the prepacked forward gives the plain lean forward's logits (to bf16 rounding: bit-identical on
    the CPUs measured) and the same greedy choices, prefill and tree alike."""
    import copy

    from methods.core.fast_llama import packing_works

    if not packing_works(torch.bfloat16):
        pytest.skip("no oneDNN-packed bf16 linear on this CPU (needs AVX512 or AVX-NE-CONVERT)")
    model = copy.deepcopy(tiny_target).to(torch.bfloat16)
    packed, plain = ModelEngine(model, pack=True), ModelEngine(model, pack=False)
    ids, tree = torch.arange(40, 80), random_tree(9, 3)
    tokens = torch.randint(0, 300, (tree.size,), generator=torch.Generator().manual_seed(3))
    for engine in (packed, plain):
        engine.prefill(ids)
    a, b = packed.forward_tree(tokens, tree).logits, plain.forward_tree(tokens, tree).logits
    torch.testing.assert_close(a, b, atol=0.02 * b.abs().max().item(), rtol=0)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_projections_run_as_float32_mm_on_few_rows(tiny_target, dtype):
    """Packed engines run a tiny projection on at most ``rows`` rows as a float32 mm (oneDNN's per-call cost
    dominates there), more rows on the packed weight; both give the plain forward's logits to rounding and
    its greedy choices, one node (decode) and a tree alike."""
    import copy

    from methods.core.fast_llama import SMALL_MACS, _Dual, packing_works

    if not packing_works(dtype):
        pytest.skip(f"no oneDNN-packed {dtype} linear on this CPU (bf16 needs AVX512 or AVX-NE-CONVERT)")
    model = copy.deepcopy(tiny_target).to(dtype)
    packed, plain = ModelEngine(model, pack=True), ModelEngine(model, pack=False)
    duals = [w for lay in packed.fast.layers for w in (lay.w_qkv, lay.w_o, lay.w_gate_up, lay.w_down)
             if isinstance(w, _Dual)]
    assert duals and all(d.rows == SMALL_MACS[dtype] // d.t32.numel() >= 1 for d in duals)
    assert all(d.t32.dtype == torch.float32 for d in duals)
    ids, tree = torch.arange(40, 80), random_tree(9, 3)
    tokens = torch.randint(0, 300, (tree.size,), generator=torch.Generator().manual_seed(3))
    for engine in (packed, plain):
        engine.prefill(ids)
    for forward in (lambda e: e.extend(tokens[:1], [-1]), lambda e: e.forward_tree(tokens, tree)):
        a, b = forward(packed).logits, forward(plain).logits
        torch.testing.assert_close(a, b, atol=0.02 * b.abs().max().item(), rtol=0)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        packed.drop_pending(), plain.drop_pending()


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain"])
def test_in_place_weight_loads_reach_every_engine(tiny_target, pack):
    """Fusing is idempotent and shares storage, packed copies follow the parameters' version counters: a
    later load_state_dict (e.g. Medusa-2's jointly trained target) changes what every engine computes."""
    import copy

    model = copy.deepcopy(tiny_target)
    first, second = ModelEngine(model, pack=pack), ModelEngine(model, pack=pack)
    other = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(other)
    ids = list(range(70, 90))
    want = reference_logits(model, ids)
    for engine in (first, second):
        torch.testing.assert_close(engine.prefill(torch.tensor(ids)).logits[0], want, atol=ATOL, rtol=0)


def test_model_made_under_inference_mode_gets_an_engine(tiny_target):
    """Parameters created under inference_mode have no version counter (e.g. a model loaded inside it): the
    packed engine still builds and computes the model's logits."""
    import copy

    with torch.inference_mode():
        model = copy.deepcopy(tiny_target)
        engine = ModelEngine(model)
        out = engine.prefill(torch.arange(10, 30))
    torch.testing.assert_close(out.logits[0], reference_logits(tiny_target, list(range(10, 30))), atol=ATOL,
                               rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_norm_and_rope_are_hf_bit_for_bit(tiny_target, dtype):
    """The lean forward's RMSNorm (one fused kernel) and RoPE (roll with a signed sin table) give HF's
    LlamaRMSNorm and apply_rotary_pos_emb exactly, in fp32 and bf16."""
    import copy

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from methods.core.fast_llama import _rope

    model = copy.deepcopy(tiny_target).to(dtype)
    fast, layer = ModelEngine(model).fast, model.model.layers[0]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, model.config.hidden_size, generator=g) * 3).to(dtype)
    assert torch.equal(fast._rms(x, layer.input_layernorm.weight), layer.input_layernorm(x))
    pos = torch.tensor([0, 3, 9, 4, 17, 2, 5])
    q = torch.randn(7, 4, fast.head_dim, generator=g).to(dtype)
    k = torch.randn(7, 2, fast.head_dim, generator=g).to(dtype)
    cos, sin = fast.cos[pos], fast.sin[pos]  # HF's own rotary table (the model's rotary_emb)
    heads_first = (q.transpose(0, 1)[None], k.transpose(0, 1)[None])  # HF's (1, heads, n, D)
    want_q, want_k = apply_rotary_pos_emb(*heads_first, cos[None], sin[None])
    table = fast._rope_table[pos]  # what the forward gathers: (n, 2, 1, D)
    assert torch.equal(table[:, 0, 0], cos) and torch.equal(table[:, 1, 0], fast.sin_rot[pos])
    assert torch.equal(_rope(q, table[:, 0], table[:, 1]), want_q[0].transpose(0, 1))
    assert torch.equal(_rope(k, table[:, 0], table[:, 1]), want_k[0].transpose(0, 1))


@pytest.mark.parametrize(("rows", "prefix", "heads", "kv_heads"), [(1, 0, 4, 4), (1, 9, 4, 2), (3, 5, 4, 2)])
def test_blocked_attention_equals_sdpa(rows, prefix, heads, kv_heads):
    """The long-forward attention (query blocks over the keys up to each block's last node) is SDPA's with the
    full mask, for a causal prefill, a tree over a prefix, several rows with their own masks, and GQA."""
    from methods.core.fast_llama import attention, blocked_attention

    g = torch.Generator().manual_seed(rows + prefix)
    m, d = 70, 16
    width = prefix + m
    q = torch.randn(rows, heads, m, d, generator=g)
    k, v = (torch.randn(rows, kv_heads, width, d, generator=g) for _ in range(2))
    allowed = torch.ones(rows, 1, m, width, dtype=torch.bool)
    for r in range(rows):
        tree = random_tree(m, seed=r) if prefix else Tree.chain(m - 1)  # new node i sees only nodes <= i
        allowed[r, 0, :, prefix:] = torch.from_numpy(tree.ancestor_mask)
    mask = torch.zeros(rows, 1, m, width).masked_fill(~allowed, torch.finfo(torch.float32).min)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5,
                                                            enable_gqa=heads != kv_heads)
    torch.testing.assert_close(blocked_attention(q, k, v, mask, d**-0.5, block=16), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(attention(q, k, v, mask, d**-0.5, heads != kv_heads), want, atol=1e-5, rtol=0)


def test_long_prefill_and_tree_equal_hf(tiny_target):
    """A prefill and a tree of more nodes than BLOCKED_MIN_ROWS (the blocked attention) give HF's logits."""
    from methods.core.fast_llama import BLOCKED_MIN_ROWS

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 300, (BLOCKED_MIN_ROWS + 20,), generator=g).tolist()
    engine = ModelEngine(tiny_target)
    out = engine.prefill(torch.tensor(prompt), hidden=True)
    with torch.no_grad():
        ref = tiny_target(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(out.hidden, ref, atol=ATOL, rtol=0)
    tree = random_tree(BLOCKED_MIN_ROWS + 6, seed=4)
    tokens = torch.randint(0, 300, (tree.size,), generator=g)
    tokens[0] = prompt[-1]
    engine.reset()
    engine.prefill(torch.tensor(prompt[:-1]))
    logits = engine.forward_tree(tokens, tree).logits
    for node in (0, tree.size // 2, tree.size - 1):
        path = [int(tokens[i]) for i in tree.path_to(node)[1:]]
        want = reference_logits(tiny_target, prompt + path)
        torch.testing.assert_close(logits[node], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("last_only", [False, True])
def test_extend_logits_from_a_row(tiny_target, last_only):
    """``logits_from`` (and ``last_only``): the same rows as the full forward's, and only those."""
    ids = torch.arange(7, 19)
    full = ModelEngine(tiny_target).extend(ids, list(range(-1, 11))).logits
    engine = ModelEngine(tiny_target)
    out = engine.extend(ids, list(range(-1, 11)), last_only=last_only, logits_from=9).logits
    torch.testing.assert_close(out, full[11:] if last_only else full[9:], atol=ATOL, rtol=0)
    with pytest.raises(AssertionError, match="logits from row"):
        engine.extend(ids[:2], [11, 12], logits_from=2)


def test_small_macs_bound_sends_few_row_draft_projections_to_mm():
    """bf16: a 128-hidden draft's q/k/v (384 x 128) takes the float32 mm on up to 2 rows and its MLP down
    projection (128 x 256) on up to 4 (staged's catch-up and guess forwards); a 384-hidden target's
    smallest projection (384 x 384) stays on the packed weight even on one row."""
    from methods.core.fast_llama import _Dual, _dual, packing_works

    if not packing_works(torch.bfloat16):
        pytest.skip("no oneDNN-packed bf16 linear on this CPU")
    qkv, down = (_dual(torch.zeros(shape, dtype=torch.bfloat16)) for shape in ((384, 128), (128, 256)))
    assert isinstance(qkv, _Dual) and qkv.rows == 2
    assert isinstance(down, _Dual) and down.rows == 4
    assert not isinstance(_dual(torch.zeros(384, 384, dtype=torch.bfloat16)), _Dual)


@pytest.mark.parametrize(("keep", "want"),
                         [([0, 1, 2], None), ([0, 1, 4], 9), ([0, 3], 8), ([0, 2, 3], [7, 8]), ([], None)])
def test_commit_moves_only_the_nodes_off_their_slot(keep, want):
    """commit's KV move: the kept nodes before the first one off its final slot are not copied; one moved
    node is a slice copy (its slot), several a gather of their slots (prefix of 5 committed tokens)."""
    from methods.core.engine import _moved_slots

    moved = next((i for i, k in enumerate(keep) if k != i), len(keep))
    got = _moved_slots(keep[moved:], 5, torch.device("cpu"))
    assert (got.tolist() if isinstance(got, torch.Tensor) else got) == want
