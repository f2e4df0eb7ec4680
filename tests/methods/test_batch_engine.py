"""The batched engine against the one-sequence engine (fp32): one forward over B rows with ragged prompts,
ragged trees (padded) and ragged commits gives every row the logits ModelEngine gives it alone, step after
step, also after rows leave (the last row moves into the freed slot) and new rows join; and the outputs of the
decoder layers a drafter asks for (``layers``: EAGLE-3's features) ModelEngine gives it alone."""

from __future__ import annotations

import copy

import pytest
import torch

from methods.core.batch_engine import BatchEngine, attention_dtype, prefill_groups
from methods.core.engine import ModelEngine
from specsim.tree import Tree

ATOL = 1e-4
TREES = [Tree.from_parents([-1, 0, 0, 1, 1, 2]), Tree.chain(3), Tree.chain(0), Tree.kary(2, 2)]
LAYERS = (1, 0)  # of the tiny target's 2: the last (after the final norm) and a middle one, in asked order


def _alone(model, fast: bool, prompt: torch.Tensor, steps: list[tuple[torch.Tensor, Tree, tuple]]):
    """The prompt's prefill features, then the logits and features of each step's tree for one row decoded
    alone (the reference)."""
    one = ModelEngine(model, fast=fast)
    pre = one.prefill(prompt[:-1], layers=LAYERS)
    outs = []
    for tokens, tree, path in steps:
        out = one.forward_tree(tokens, tree, layers=LAYERS)
        outs.append((out.logits, out.features))
        one.commit(path)
    return None if pre is None else pre.features, outs


@pytest.mark.parametrize("fast,budget", [(True, None), (False, None), (True, 12)],
                         ids=["lean", "hf", "lean-prefill-in-groups"])
def test_batch_forward_equals_rows_alone(tiny_target, fast, budget):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g) for n in (5, 13, 1, 9)]
    eng = BatchEngine(tiny_target, max_rows=4, capacity=16, fast=fast)  # small: the buffers must grow
    if budget:  # prompts of 4, 12, 0, 8 tokens: groups [0], [1], [2] (empty: no forward), [3]
        eng.prefill_tokens = budget
    assert (eng.fast is not None) == fast
    eng.add(4)
    pre = eng.prefill([p[:-1] for p in prompts], layers=LAYERS)
    history = [[] for _ in prompts]
    roots = [p[-1] for p in prompts]
    for step in range(3):
        trees = TREES[step:] + TREES[:step]  # every row gets every shape, several at once
        n = max(t.size for t in trees)
        tokens = torch.randint(0, 300, (4, n), generator=g)
        tokens[:, 0] = torch.stack(roots)
        out = eng.forward_trees(tokens, trees, layers=LAYERS)
        assert out.logits.shape == (4, n, tiny_target.config.vocab_size)
        assert out.features.shape == (4, n, len(LAYERS) * tiny_target.config.hidden_size)
        paths = [t.path_to(int(torch.randint(0, t.size, (1,), generator=g))) for t in trees]
        for b, (tree, path) in enumerate(zip(trees, paths)):
            history[b].append((tokens[b, : tree.size], tree, path, out.logits[b, : tree.size],
                               out.features[b, : tree.size]))
            roots[b] = tokens[b, path[-1]]  # any token: the next root
        eng.commit(paths)
    for b, prompt in enumerate(prompts):
        ref_pre, ref = _alone(tiny_target, fast, prompt, [h[:3] for h in history[b]])
        if ref_pre is not None:
            torch.testing.assert_close(pre.features[b, : prompt.numel() - 1], ref_pre, atol=ATOL, rtol=0)
        for (*_, logits, features), want in zip(history[b], ref):
            torch.testing.assert_close(logits, want[0], atol=ATOL, rtol=0)
            torch.testing.assert_close(features, want[1], atol=ATOL, rtol=0)
        assert eng.lengths[b] == prompt.numel() - 1 + sum(len(h[2]) for h in history[b])


def test_prefill_groups_cover_every_row_in_order_within_the_budget():
    assert prefill_groups([4, 12, 0, 8], 12) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert prefill_groups([127] * 16, 512) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert prefill_groups([3, 3, 600, 3], 512) == [(0, 2), (2, 3), (3, 4)]  # too long: alone
    assert prefill_groups([5, 5], 10**6) == [(0, 2)]


def test_prefill_in_groups_equals_one_forward_and_runs_one_forward_per_group(tiny_target, monkeypatch):
    """Rows prefilled in groups (``prefill_tokens``) get the logits, hidden states and cache of the same rows
    prefilled in one forward; one forward per group of rows that has tokens."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 300, (n,), generator=g) for n in (4, 12, 0, 5, 3)]
    whole, split = BatchEngine(tiny_target, max_rows=5), BatchEngine(tiny_target, max_rows=5)
    split.prefill_tokens = 12
    calls = []
    run = BatchEngine._run
    monkeypatch.setattr(BatchEngine, "_run", lambda self, tokens, *a, **k: (
        calls.append((self is split, tokens.shape[0])), run(self, tokens, *a, **k))[1])
    outs = []
    for eng in (whole, split):
        eng.add(5)
        outs.append(eng.prefill(ids, hidden=True, layers=LAYERS))
    assert [c for s, c in calls if s] == [1, 1, 2, 1] and [c for s, c in calls if not s] == [5]
    a, b = outs
    assert a.logits.shape == b.logits.shape == (5, 1, tiny_target.config.vocab_size)
    assert a.hidden.shape == b.hidden.shape == (5, 12, tiny_target.config.hidden_size)
    assert a.features.shape == b.features.shape == (5, 12, 2 * tiny_target.config.hidden_size)
    for r, x in enumerate(ids):
        if x.numel():
            torch.testing.assert_close(b.logits[r], a.logits[r], atol=ATOL, rtol=0)
            torch.testing.assert_close(b.hidden[r, : x.numel()], a.hidden[r, : x.numel()], atol=ATOL, rtol=0)
            torch.testing.assert_close(b.features[r, : x.numel()], a.features[r, : x.numel()], atol=ATOL,
                                       rtol=0)
        n = x.numel()
        torch.testing.assert_close(split.k[:, r, :, :n], whole.k[:, r, :, :n], atol=ATOL, rtol=0)
    assert split.lengths == whole.lengths == [x.numel() for x in ids]


def test_rows_leave_and_join(tiny_target):
    """remove() moves the last row into the freed slot; a joining row is prefilled alone; AR steps after
    that match each sequence decoded alone."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in (7, 4, 11)]
    eng = BatchEngine(tiny_target, max_rows=3)
    eng.add(3)
    eng.prefill([s[:-1] for s in seqs])
    eng.remove(0)  # row 2 moves to slot 0
    seqs = [seqs[2], seqs[1]]
    new = torch.randint(0, 300, (6,), generator=g)
    slot = eng.add()
    assert slot == 2
    eng.prefill([new[:-1]], rows=slice(2, 3))
    seqs.append(new)
    assert eng.lengths == [s.numel() - 1 for s in seqs]
    for _ in range(2):
        roots = torch.stack([s[-1] for s in seqs])[:, None]
        out = eng.forward_trees(roots, [Tree.chain(0)])
        eng.commit_counts([1, 1, 1])
        nxt = out.logits[:, 0].argmax(-1)
        for b, s in enumerate(seqs):
            with torch.no_grad():
                ref = tiny_target(s[None]).logits[0, -1]
            torch.testing.assert_close(out.logits[b, 0], ref, atol=ATOL, rtol=0)
        seqs = [torch.cat([s, nxt[b : b + 1]]) for b, s in enumerate(seqs)]


def test_capacity_and_context_errors(tiny_target):
    eng = BatchEngine(tiny_target, max_rows=1)
    eng.add()
    with pytest.raises(ValueError, match="exceeds the model's context"):
        eng.prefill([torch.zeros(tiny_target.config.max_position_embeddings + 1, dtype=torch.long)])
    with pytest.raises(AssertionError, match="exceed max_rows"):
        eng.add()


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-cache", "float32-cache"])
def test_bf16_rows_agree_with_rows_alone_in_either_kv_dtype(tiny_target, monkeypatch, mixed):
    """A bf16 model's batched attention in bf16 (bf16 cache: half the bytes a decode forward reads per row)
    or in float32 (the default where bf16 attention is slow, as the one-sequence engine's), over a bf16
    cache (the mixed-precision kernel) or a float32 one: each agrees with each row decoded alone in float32
    attention (the one-sequence engine) to bf16 rounding, rows and ragged prompts included."""
    monkeypatch.setattr(BatchEngine, "mixed_cache", mixed)
    model = copy.deepcopy(tiny_target).to(torch.bfloat16)  # the session's fixture stays float32
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g) for n in (7, 3, 11)]
    tree = Tree.chain(3)
    tokens = torch.randint(0, 300, (3, tree.size), generator=g)
    tokens[:, 0] = torch.stack([p[-1] for p in prompts])
    outs = {}
    for dtype in (torch.bfloat16, torch.float32):
        eng = BatchEngine(model, max_rows=3, capacity=8, attn_dtype=dtype)  # grows past 8
        assert eng.fast.attn_dtype == dtype
        assert eng.k.dtype == (torch.bfloat16 if mixed else dtype)
        eng.add(3)
        eng.prefill([p[:-1] for p in prompts])
        outs[dtype] = eng.forward_trees(tokens, [tree]).logits
    for b, p in enumerate(prompts):
        ((want, _),) = _alone(model, True, p, [(tokens[b], tree, (0,))])[1]
        for got in outs.values():
            torch.testing.assert_close(got[b], want.float(), atol=0.1, rtol=0.05)


def test_mixed_cache_holds_the_float32_caches_values_and_gives_its_logits(tiny_target, monkeypatch):
    """The bf16 cache under float32 attention (cache_dtype) is lossless: the lean forward computes a bf16
    model's keys and values in bf16, so the cache holds exactly what the float32 cache holds (layer 0, whose
    input is the same embedding in both), and a prefill plus tree steps give the float32 cache's logits up to
    the attention's summation order (bf16 rounding of its output)."""
    model = copy.deepcopy(tiny_target).to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=g) for n in (9, 4, 13, 1)]
    engines = {}
    for mixed in (True, False):
        monkeypatch.setattr(BatchEngine, "mixed_cache", mixed)
        engines[mixed] = BatchEngine(model, max_rows=4, capacity=8)
        engines[mixed].add(4)
    assert engines[True].k.dtype == torch.bfloat16 and engines[False].k.dtype == torch.float32
    outs = {mixed: [eng.prefill([p[:-1] for p in prompts]).logits] for mixed, eng in engines.items()}
    roots = torch.stack([p[-1] for p in prompts])
    for step in range(3):
        tree = TREES[step]
        tokens = torch.randint(0, 300, (4, tree.size), generator=g)
        tokens[:, 0] = roots
        path = tree.path_to(tree.size - 1)
        for mixed, eng in engines.items():
            outs[mixed].append(eng.forward_trees(tokens, [tree]).logits)
            eng.commit([path] * 4)
        roots = tokens[:, path[-1]]
    lens = engines[True].lengths
    assert lens == engines[False].lengths
    for b, n in enumerate(lens):
        for name in ("k", "v"):
            mixed, full = (getattr(engines[m], name)[0, b, :, :n] for m in (True, False))
            assert torch.equal(mixed.float(), full)
    for got, want in zip(outs[True], outs[False]):
        good = torch.ones(got.shape[0], dtype=torch.bool) if got.shape[1] > 1 else torch.tensor(
            [p.numel() > 1 for p in prompts])  # a 1-token prompt's prefill logits are garbage
        torch.testing.assert_close(got[good], want[good], atol=0.05, rtol=0.02)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-cache", "float32-cache"])
def test_default_kv_dtype_is_float32_for_reduced_precision_on_cpus_without_amx(tiny_target, monkeypatch, amx,
                                                                                mixed):
    """Without AMX PyTorch's bf16 SDPA is several times slower than float32 at one query per row (a decode
    step): the default attention is float32 there, over a bf16 cache with the mixed-precision kernel
    (``mixed_cache``, cache_dtype), else over a float32 cache; with AMX both are the model's dtype; a float32
    model stays float32 and an explicit attn_dtype wins."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(BatchEngine, "mixed_cache", mixed)
    model = copy.deepcopy(tiny_target).to(torch.bfloat16)
    assert attention_dtype(model) == (None if amx else torch.float32)
    eng = BatchEngine(model, max_rows=2, capacity=8)
    assert eng.fast.attn_dtype == (torch.bfloat16 if amx else torch.float32)
    assert eng.k.dtype == (torch.bfloat16 if amx or mixed else torch.float32)
    assert BatchEngine(model, max_rows=2, capacity=8, attn_dtype=torch.bfloat16).k.dtype == torch.bfloat16
    assert attention_dtype(tiny_target) is None
    assert BatchEngine(tiny_target, max_rows=2, capacity=8).k.dtype == torch.float32
    assert BatchEngine(model, max_rows=2, capacity=8, fast=False).k.dtype == torch.bfloat16  # HF's forward


def test_extend_with_last_gives_those_nodes_logits_and_the_same_cache(tiny_target):
    """``extend(..., last=)``: each row's logits at its node last[b] only (B, 1, V), equal to the full
    forward's at that node, and the cache (hence every later forward) as without it."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g) for n in (4, 9, 2)]
    ids = torch.randint(0, 300, (3, 3), generator=g)
    causal, depths = torch.ones(3, 3, dtype=torch.bool).tril()[None], torch.arange(3)[None]
    last, counts = torch.tensor([2, 0, 1]), [3, 1, 2]
    outs = []
    for picked in (None, last):
        eng = BatchEngine(tiny_target, max_rows=3)
        eng.add(3)
        eng.prefill(prompts)
        outs.append(eng.extend(ids, causal, depths, last=picked).logits)
        eng.commit_counts(counts)
        outs.append(eng.extend(ids[:, :1], causal[:, :1, :1], depths[:, :1]).logits)
    full, after_full, picked, after_picked = outs
    assert picked.shape == (3, 1, tiny_target.config.vocab_size)
    torch.testing.assert_close(picked[:, 0], full[torch.arange(3), last], atol=ATOL, rtol=0)
    torch.testing.assert_close(after_picked, after_full, atol=0, rtol=0)


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-cache", "float32-cache"])
def test_bf16_one_sequence_engine_keeps_the_batched_engines_cache_dtype_and_logits(tiny_target, monkeypatch,
                                                                                    mixed):
    """The one-sequence engine stores a bf16 model's KV like the batched engine (mixed_attention.cache_dtype:
    bf16 under float32 attention where the kernel is built), so a row decoded in a batch and alone attend
    through the same kernel over the same values: their logits are equal bit for bit over ragged prompts and
    tree steps (greedy bf16 rows then agree with their prompt decoded alone); with the float32 cache on both
    sides the one-sequence logits are unchanged to bf16 rounding."""
    monkeypatch.setattr("methods.core.engine.MIXED_CACHE", mixed)
    monkeypatch.setattr(BatchEngine, "mixed_cache", mixed)
    model = copy.deepcopy(tiny_target).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g) for n in (12, 5, 9)]
    eng = BatchEngine(model, max_rows=3, capacity=8)
    eng.add(3)
    eng.prefill([p[:-1] for p in prompts])
    roots, steps = torch.stack([p[-1] for p in prompts]), []
    for tree in TREES[:2]:
        tokens = torch.randint(0, 300, (3, tree.size), generator=g)
        tokens[:, 0] = roots
        path = tree.path_to(tree.size - 1)
        steps.append((tokens, tree, path, eng.forward_trees(tokens, [tree]).logits))
        eng.commit([path] * 3)
        roots = tokens[:, path[-1]]
    assert eng.k.dtype == (torch.bfloat16 if mixed else torch.float32)
    for b, p in enumerate(prompts):
        one = ModelEngine(model)
        one.prefill(p[:-1])
        assert one.cache.layers[0].kbuf.dtype == eng.k.dtype
        for tokens, tree, path, batched in steps:
            alone = one.forward_tree(tokens[b], tree).logits
            if mixed:
                assert torch.equal(alone.float(), batched[b].float())
            else:
                torch.testing.assert_close(alone.float(), batched[b].float(), atol=0.1, rtol=0.05)
            one.commit(path)
