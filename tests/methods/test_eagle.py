"""EAGLE heads and drafters: the decode-time cache agrees with the training rollout, static and dynamic trees
stay greedy-exact, training lowers the loss, checkpoints round-trip in the published layouts."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from methods.core.drafter import Draft, DraftContext, StepFeedback
from methods.core.engine import ModelEngine
from methods.core.fast_llama import packing_works
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.drafters.autoregressive import Autoregressive
from methods.drafters.eagle import Dynamic, EagleDrafter, _rerank
from methods.drafters.registry import build_drafter
from methods.heads import trainer
from methods.heads.eagle.batch_state import BatchHeadCache
from methods.heads.eagle.checkpoint import _split, load_eagle, names, save_eagle
from methods.heads.eagle.state import HeadCache, grow_ancestors
from methods.heads.eagle.train import (
    EagleTrainConfig,
    greedy_labels,
    loss,
    make_batch,
    new_head,
    rollout,
    train,
    ttt_attention,
    ttt_mask,
)
from specsim.config import MethodConfig, TreeConfig, TreeKind, Verifier
from specsim.tree import Tree

GREEDY = SamplingParams(temperature=0.0)


def _random_head(target, variant="eagle1", layers=(), seed=0):
    cfg = EagleTrainConfig(variant=variant, feature_layers=layers).head_config(target)
    head = new_head(target, cfg, seed)
    with torch.no_grad():  # non-trivial norms / d2t-free EAGLE-3 head
        for name, p in head.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return head.eval()


def test_ttt_mask_is_the_draft_nodes_view():
    m = ttt_mask(5, 2) == 0  # (5, 15)
    # step 2, row 4: target-fed rows 0..2, step-1 row 3, itself (step-2 row 4)
    assert m[4, :5].tolist() == [True, True, True, False, False]
    assert m[4, 5:10].tolist() == [False, False, False, True, False]
    assert m[4, 10:].tolist() == [False, False, False, False, True]
    assert (m.sum(1) >= 1).all()


@pytest.mark.parametrize("steps,kv_heads", [(1, 4), (2, 4), (3, 2), (5, 1)])
def test_ttt_attention_is_sdpa_under_the_ttt_mask(steps, kv_heads):
    """The rollout's structured attention gives the values and gradients of SDPA over all steps' keys under
    ``ttt_mask`` (grouped K/V heads included)."""
    g = torch.Generator().manual_seed(steps)
    B, T, n, d = 2, 9, 4, 8
    q = torch.randn(B, T, n, d, generator=g, requires_grad=True)
    ks = [torch.randn(B, T, kv_heads, d, generator=g, requires_grad=True) for _ in range(steps + 1)]
    vs = [torch.randn(B, T, kv_heads, d, generator=g, requires_grad=True) for _ in range(steps + 1)]
    w = torch.randn(B, T, n, d, generator=g)
    ours = ttt_attention(q, ks, vs)
    grads = torch.autograd.grad((ours * w).sum(), [q, *ks, *vs])
    rep = n // kv_heads
    kt = torch.cat(ks, 1).transpose(1, 2).repeat_interleave(rep, 1)
    vt = torch.cat(vs, 1).transpose(1, 2).repeat_interleave(rep, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kt, vt,
                                                           attn_mask=ttt_mask(T, steps)).transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, torch.autograd.grad((ref * w).sum(), [q, *ks, *vs])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant,layers", [("eagle1", ()), ("eagle3", (0, 1))])
def test_decode_cache_matches_the_training_rollout(tiny_models, variant, layers):
    """Appending committed rows in pieces and feeding a chain level by level gives the same g as the
    training-time rollout (steps 0..2): the two attention layouts agree."""
    target = tiny_models.target
    head = _random_head(target, variant, layers)
    seq = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(5))
    f = trainer.target_features(target, seq, layers)
    h0 = head.fuse((f.layers if layers else f.hidden)[:, :-1])
    toks = seq[:, 1:]
    with torch.no_grad():
        outs = rollout(head, h0, toks, 2)
        cache = HeadCache(head)
        cache.append(h0[0, :7], toks[0, :7])
        cache.append(h0[0, 7:12], toks[0, 7:12])  # rows 0..11 committed; root = seq[12]
        torch.testing.assert_close(cache.last, outs[0][0, 11], rtol=1e-4, atol=1e-5)
        g1 = cache.feed(cache.last[None], toks[0, 12:13], 1, torch.tensor([-1]))
        torch.testing.assert_close(g1[0], outs[1][0, 12], rtol=1e-4, atol=1e-5)
        g2 = cache.feed(g1, toks[0, 13:14], 2, torch.tensor([0]))
        torch.testing.assert_close(g2[0], outs[2][0, 13], rtol=1e-4, atol=1e-5)


def _method(name: str, verifier=Verifier.greedy, **params) -> MethodConfig:
    return MethodConfig(name=name, drafter=name, verifier=verifier, params={"head": "random", **params})


DYNAMIC = TreeConfig(name="dynamic", kind=TreeKind.dynamic, total_tokens=12, depth=4, top_k=3)


DRAFT_VOCAB = {"feature_layers": [0, 1], "train": {"draft_vocab": 64}}  # EAGLE-3, a reduced draft vocabulary


@pytest.mark.parametrize("name,params", [("eagle", {}), ("eagle3", {"feature_layers": [0, 1]}),
                                         ("eagle3", DRAFT_VOCAB)])
def test_dynamic_tree_is_greedy_exact_and_within_budget(tiny_models, name, params):
    drafter = build_drafter(_method(name, **params), None, tiny_models, GREEDY, tree_cfg=DYNAMIC)
    assert isinstance(drafter, EagleDrafter) and drafter.dynamic is not None
    engine = ModelEngine(tiny_models.target)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (15,), generator=g)
    ref = decode(engine, Autoregressive(), prompt, DecodeOptions(max_new_tokens=30), g).token_ids
    sizes, trees = [], []
    real = drafter.propose

    def spy(ctx):
        d = real(ctx)
        sizes.append((d.tree.size, d.tree.depth))
        trees.append(d.tree)
        return d

    drafter.propose = spy
    for v in (Verifier.greedy, Verifier.deterministic):
        assert decode(engine, drafter, prompt, DecodeOptions(v, GREEDY, 30), g).token_ids == ref
    assert all(n <= 13 and d <= 4 for n, d in sizes) and max(n for n, _ in sizes) == 13
    # every dynamic tree it proposed (not the root-only drafts) is recorded for the simulator's pricing
    assert drafter.shapes == Counter(t for t in trees if t.size > 1) and sum(drafter.shapes.values()) > 1


def _first_proposals(target, *trees) -> list:
    """One random head drafting the first step of the same 12-token sequence on each tree (static Tree or
    Dynamic), from the same target features."""
    head = _random_head(target)
    seq = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    out = ModelEngine(target).prefill(seq[:-1], hidden=True)
    drafts = []
    for tree in trees:
        d = EagleDrafter(head, tree, GREEDY)
        d.reset(seq)
        drafts.append(d.propose(DraftContext(seq, out.hidden, torch.Generator(), 10)))
    return drafts


def test_confidence_temperature_one_is_eagle2_and_a_sharp_one_keeps_the_top1_chain(tiny_models):
    """method.params.confidence_temperature: T = 1 builds EAGLE-2's own trees; as T -> 0 the cumulative
    confidence of a path is ~0 only along q's top-1 children, so a budget of ``depth`` keeps that chain (the
    static chain drafter's tokens); any T stays greedy-exact."""
    engine = ModelEngine(tiny_models.target)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (15,), generator=g)
    ref = decode(engine, Autoregressive(), prompt, DecodeOptions(max_new_tokens=20), g).token_ids
    shapes = []
    for t in (None, 1.0, 0.5):  # None: the preset's default
        params = {} if t is None else {"confidence_temperature": t}
        d = build_drafter(_method("eagle", **params), None, tiny_models, GREEDY, tree_cfg=DYNAMIC)
        assert d.dynamic.temperature == (t or 1.0)
        assert decode(engine, d, prompt, DecodeOptions(Verifier.greedy, GREEDY, 20), g).token_ids == ref
        shapes.append(d.shapes)
    assert shapes[0] == shapes[1]
    drafts = _first_proposals(tiny_models.target, Tree.chain(3),
                              Dynamic(total_tokens=3, depth=3, top_k=3, temperature=1e-3))
    assert drafts[1].tree.parents == (-1, 0, 1, 2) and drafts[1].tree.ranks == (0, 0, 0, 0)
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)
    with pytest.raises(ValueError, match="confidence_temperature"):
        build_drafter(_method("eagle", confidence_temperature=0.0), None, tiny_models, GREEDY,
                      tree_cfg=DYNAMIC)


@pytest.mark.parametrize("variant,layers", [("eagle1", ()), ("eagle3", (0, 1))])
def test_batch_head_cache_feeds_each_rows_own_parents(tiny_models, variant, layers):
    """BatchHeadCache fed parents of each row's own (EAGLE-2's dynamic frontiers batched: BatchEagle) gives
    every row the g that HeadCache gives it alone: rows of different committed lengths, three levels, each
    row's nodes under other parents (level 3's ancestors are its parent's, through level 2)."""
    head = _random_head(tiny_models.target, variant, layers)
    g = torch.Generator().manual_seed(3)
    width = head.fc.in_features if variant == "eagle3" else head.cfg.hidden_size
    feats = [head.fuse(torch.randn(n, width, generator=g)) for n in (5, 2, 8)]
    toks = [torch.randint(0, 256, (f.shape[0],), generator=g) for f in feats]
    fed = torch.randint(0, 256, (3, 3, 3), generator=g)  # (level, row, node)
    parents = [np.full((3, 3), -1), np.array([[0, 0, 1], [2, 1, 0], [1, 2, 2]]),
               3 + np.array([[2, 0, 1], [1, 1, 0], [0, 2, 2]])]  # pending rows: level 1 is 0-2, level 2 3-5
    batch = BatchHeadCache(head, 3, capacity=4)  # small: the buffers grow
    batch.join(3)
    batch.append([0, 1, 2], feats, toks)
    rows, h, outs = torch.arange(3)[:, None], batch.last[:3, None].expand(3, 3, -1), []
    for d, par in enumerate(parents):
        outs.append(batch.feed(h, fed[d], d + 1, par))
        if d + 1 < len(parents):
            h = outs[-1][rows, torch.from_numpy(parents[d + 1] - 3 * d)]
    assert batch.anc.shape == (3, 9, 9)
    for b in range(3):
        one = HeadCache(head)
        one.append(feats[b], toks[b])
        x = one.last.expand(3, -1)
        for d, par in enumerate(parents):
            got = one.feed(x, fed[d, b], d + 1, par[b])
            torch.testing.assert_close(outs[d][b], got, atol=1e-5, rtol=0)
            if d + 1 < len(parents):
                x = got[torch.from_numpy(parents[d + 1][b] - 3 * d)]
        assert (batch.anc[b] == one.anc).all()


def test_grow_ancestors_per_row_equals_each_row_alone():
    anc = grow_ancestors(np.zeros((0, 0), dtype=bool), np.array([-1, -1]))  # shared: two roots' children
    parents = np.array([[0, 1, -1], [1, 1, 0]])
    grown = grow_ancestors(anc, parents)  # (2, 5, 5): one relation per row
    for b in range(2):
        assert (grown[b] == grow_ancestors(anc, parents[b])).all()
    assert grown[0, 2].tolist() == [True, False, True, False, False]
    assert grown[1, 4].tolist() == [True, False, False, False, True]
    again = grow_ancestors(grown, np.array([[2, -1], [3, 4]]))
    assert again[0, 5].tolist() == [True, False, True, False, False, True, False]
    assert again[1, 5].tolist() == [False, True, False, True, False, True, False]


def test_dynamic_tree_refuses_sampling_verifiers(tiny_models):
    with pytest.raises(ValueError, match="deterministic"):
        build_drafter(_method("eagle", Verifier.specinfer), None, tiny_models, GREEDY, tree_cfg=DYNAMIC)


def test_rerank_keeps_the_best_nodes_parents_first():
    # drafted: 1-level a(-0.1), b(-1.0); a's children c(-0.3), d(-2.0); c's child e(-0.4)
    par, tok, rank = [-1, -1, 0, 0, 2], [10, 11, 12, 13, 14], [0, 1, 0, 1, 0]
    score, dep = [-0.1, -1.0, -0.3, -2.0, -0.4], [1, 1, 2, 2, 3]
    parents, tokens, ranks, scores = _rerank(*map(np.array, (par, tok, rank, score, dep)), 3, 99)
    assert tokens.tolist() == [99, 10, 12, 14] and parents == [-1, 0, 1, 2] and ranks.tolist() == [0, 0, 0, 0]
    assert scores.tolist() == [0.0, -0.1, -0.3, -0.4]
    Tree.from_parents(parents, ranks)
    # ties: shallower first (a kept node's parent before it), then creation order; 4 kept: b's tie with c
    score = [-0.1, -0.3, -0.3, -2.0, -0.4]
    parents, tokens, _, _ = _rerank(*map(np.array, (par, tok, rank, score, dep)), 4, 99)
    assert tokens.tolist() == [99, 10, 11, 12, 14] and parents == [-1, 0, 0, 1, 3]


def test_eagle_training_lowers_the_loss(tiny_models):
    toks = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0))
    for cfg in (EagleTrainConfig(steps=30, train_windows=8, seq_len=24, batch_windows=4, lr=3e-3),
                EagleTrainConfig(variant="eagle3", feature_layers=(0, 1), steps=30, train_windows=8,
                                 seq_len=24, batch_windows=4, ttt_steps=2, noise=0.0, lr=3e-3)):
        r = train(tiny_models.target, toks, cfg)
        assert len(r.losses) == 30
        assert sum(r.losses[-5:]) < sum(r.losses[:5]), cfg.variant


@pytest.mark.parametrize("variant,layers", [("eagle1", ()), ("eagle3", (0, 1))])
def test_checkpoint_round_trip_in_the_published_layout(tiny_models, tmp_path, variant, layers):
    target = tiny_models.target
    head = _random_head(target, variant, layers)
    save_eagle(head, tmp_path / "h", meta={"x": 1})
    keys = set(json.loads((tmp_path / "h" / "config.json").read_text()))
    assert {"hidden_size", "num_attention_heads", "vocab_size"} <= keys
    loaded, meta = load_eagle(tmp_path / "h", target)
    assert meta == {"x": 1} and loaded.cfg == head.cfg
    h = torch.randn(1, 6, head.fc.in_features - (head.cfg.hidden_size if variant == "eagle1" else 0))
    tok, pos = torch.randint(0, 256, (1, 6)), torch.arange(6)
    with torch.no_grad():
        torch.testing.assert_close(loaded(loaded.fuse(h), tok, pos), head(head.fuse(h), tok, pos))


def test_published_eagle3_layout_with_a_draft_vocabulary(tiny_models, tmp_path):
    """A checkpoint as EAGLE-3 publishes it (pytorch_model.bin, draft vocabulary of 100 tokens with d2t / t2d
    maps): draft logits land on their target ids, every other target id gets -inf."""
    target = tiny_models.target
    H, V, Vd = 64, 320, 100
    g = torch.Generator().manual_seed(0)
    ref = _random_head(target, "eagle3", (0, 1))
    ref_state = ref.state_dict()
    state = {pub: part.clone() for ours, pubs in names("eagle3").items() if ours != "d2t"
             for pub, part in zip(pubs, _split(ours, ref_state[ours], ref.cfg))}
    target_ids = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
    state["lm_head.weight"] = torch.randn(Vd, H, generator=g)
    state["d2t"] = target_ids - torch.arange(Vd)
    state["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill(0, target_ids, True)
    state["embed_tokens.weight"] = torch.randn(V, H)  # published heads may bundle it: ignored
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, "vocab_size": V,
        "draft_vocab_size": Vd,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}}))
    head, _ = load_eagle(tmp_path, target)
    z = head.logits(torch.randn(3, H, generator=g))
    assert z.shape == (3, V) and torch.isinf(z[:, ~state["t2d"]]).all()
    assert torch.isfinite(z[:, target_ids]).all()
    # the saved layout of that head writes the same maps back
    save_eagle(head, tmp_path / "again")
    from safetensors.torch import load_file

    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert torch.equal(again["d2t"], state["d2t"]) and torch.equal(again["t2d"], state["t2d"])
    save_file({"fc.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))  # safetensors wins
    with pytest.raises(ValueError, match="missing"):
        load_eagle(tmp_path, target)


@pytest.mark.slow
def test_store_trains_once_reports_accuracy_by_depth_and_notes_it_next_to_the_zoo(tiny_models, tmp_path):
    """A head for a target loaded from a zoo directory: trained on first use (even under inference_mode),
    cached by config, its per-depth accuracy reported, and listed by ``python -m methods.zoo report``."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    import methods.heads.eagle.store as store
    from methods.zoo.__main__ import heads_report

    zoo = tmp_path / "zoo"
    tiny_models.target.save_pretrained(zoo / "target")
    (zoo / "zoo_config.json").write_text("{}")
    target = AutoModelForCausalLM.from_pretrained(zoo / "target").eval()
    cfg = EagleTrainConfig(steps=4, train_windows=4, seq_len=32, batch_windows=2)
    ev = store.EagleEval(prompts=2, prompt_len=16, new_tokens=12, depths=3, train_chars=20_000,
                         test_chars=10_000)
    with torch.inference_mode():
        built = store.ensure_eagle(target, tiny_models.tokenizer, cfg, ev, cache_root=tmp_path / "cache")
    acc = built.report["top1_by_depth"]
    assert len(acc) == 3 and all(0 <= a <= 1 for a in acc) and built.report["train_seconds"] > 0
    head, meta = load_eagle(built.head_dir, target)
    assert meta["top1_by_depth"] == acc and head.cfg.variant == "eagle1"
    again = store.ensure_eagle(target, tiny_models.tokenizer, cfg, ev, cache_root=tmp_path / "cache")
    assert again.root == built.root and again.report == built.report  # cached: not trained again
    tau = built.report["held_out_tau"]
    assert tau["chain"] == store.TAU_CHAIN and 1 <= tau["tau"] <= store.TAU_CHAIN + 1
    text = heads_report(SimpleNamespace(target_dir=zoo / "target"))
    assert "eagle1" in text and f"{acc[0]:.3f}" in text and f"tau {tau['tau']:.3f}" in text


def test_dynamic_tree_with_one_child_per_level_is_the_static_chain(tiny_models):
    """top_k = 1: EAGLE-2's expansion is the greedy chain the static drafter proposes on a chain tree."""
    drafts = _first_proposals(tiny_models.target, Tree.chain(4), Dynamic(total_tokens=4, depth=4, top_k=1))
    assert drafts[0].tree.parents == drafts[1].tree.parents
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)


@pytest.mark.parametrize("variant,layers", [("eagle1", ()), ("eagle3", (0, 1))])
def test_vllm_export_round_trips_through_our_loader(tiny_models, tmp_path, variant, layers):
    """The layout vLLM loads: EAGLE-1's fc bias folded into a bundled embedding (vLLM's fc has none),
    EAGLE-3's layer ids counted from the embeddings (ours + 1); our loader reads it back to the same head."""
    from safetensors.torch import load_file

    from methods.heads.eagle.vllm_export import export_for_vllm

    target = tiny_models.target
    head = _random_head(target, variant, layers)
    with torch.no_grad():
        if variant == "eagle1":
            head.fc.bias.normal_(0, 0.5)  # a bias that matters
    n_layers = target.config.num_hidden_layers
    out = export_for_vllm(head, tmp_path / "v", n_layers, meta={"x": 1})
    w = load_file(str(tmp_path / "v" / "model.safetensors"))
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert "fc.bias" not in w and config["bias"] is False
    if variant == "eagle1":
        assert "embed_tokens.weight" in w and out.fold_residual < 1e-4
        assert not torch.equal(w["embed_tokens.weight"], target.get_input_embeddings().weight.float())
    else:
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in layers]
        assert "d2t" not in w and "t2d" not in w  # a full draft vocabulary: vLLM takes no maps
        assert out.aux_layer_ids == tuple(i + 1 for i in layers)
    assert out.exact == (n_layers - 1 not in layers)
    loaded, meta = load_eagle(tmp_path / "v", target)
    assert loaded.cfg == head.cfg and meta["x"] == 1
    h = torch.randn(1, 6, head.fc.in_features - (head.cfg.hidden_size if variant == "eagle1" else 0))
    tok, pos = torch.randint(0, 256, (1, 6)), torch.arange(6)
    with torch.no_grad():
        torch.testing.assert_close(loaded(loaded.fuse(h), tok, pos), head(head.fuse(h), tok, pos),
                                   rtol=1e-4, atol=1e-4)


def test_vllm_export_marks_a_head_on_the_top_layer_inexact(tiny_models, tmp_path):
    """vLLM taps a layer's residual before the final norm, our top layer is after it: not exact."""
    from methods.heads.eagle.vllm_export import export_for_vllm

    target = tiny_models.target
    top = target.config.num_hidden_layers - 1
    head = _random_head(target, "eagle3", (0, top))
    out = export_for_vllm(head, tmp_path / "v", top + 1)
    assert not out.exact
    assert json.loads((tmp_path / "v" / "config.json").read_text())["specsim"]["vllm_exact"] is False


def test_eagle3_fusion_starts_from_the_top_layer(tiny_models):
    """fuse_init=top: before training, EAGLE-3's committed input is the target's top feature (EAGLE-1's h);
    a random init mixes the layers."""
    target = tiny_models.target
    n_layers = target.config.num_hidden_layers
    layers = (0, n_layers - 1)
    cfg = EagleTrainConfig(variant="eagle3", feature_layers=layers, steps=0, train_windows=2, seq_len=8)
    toks = torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(1))
    head = train(target, toks, cfg).head
    seq = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    f = trainer.target_features(target, seq, layers)
    with torch.no_grad():
        torch.testing.assert_close(head.fuse(f.layers), f.hidden)
        rand = train(target, toks, EagleTrainConfig(**{**cfg.__dict__, "fuse_init": "random"})).head
        assert not torch.allclose(rand.fuse(f.layers), f.hidden, atol=1e-3)


def test_recipe_keys_of_eagle1_heads_are_unchanged_by_eagle3_only_fields():
    d = EagleTrainConfig(steps=300).to_dict()
    assert "fuse_init" not in d and "feature_weight" not in d  # heads cached before these fields stay valid
    e3 = EagleTrainConfig(variant="eagle3", feature_layers=(1, 3, 5))
    assert e3.to_dict()["fuse_init"] == "top" and e3.feature_loss_weight == 0.0
    weighted = EagleTrainConfig(variant="eagle3", feature_layers=(1,), feature_weight=0.5)
    assert weighted.to_dict()["feature_weight"] == 0.5 and weighted.feature_loss_weight == 0.5


@pytest.mark.parametrize("variant,layers", [("eagle1", ()), ("eagle3", (0, 1))])
def test_a_batched_level_equals_feeding_its_nodes_one_by_one(tiny_models, variant, layers):
    """One head forward over a level's nodes (each seeing only its own ancestors) gives the g each node gets
    when fed alone along its path."""
    target = tiny_models.target
    head = _random_head(target, variant, layers)
    seq = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(4))
    f = trainer.target_features(target, seq, layers)
    h0 = head.fuse((f.layers if layers else f.hidden)[:, :-1])[0]
    toks = seq[0, 1:]
    level1, level2 = torch.tensor([5, 9, 17]), torch.tensor([30, 31, 40, 41])
    parents2 = torch.tensor([0, 0, 2, 2])  # level-2 node j is a child of level-1 node parents2[j]
    with torch.no_grad():
        cache = HeadCache(head, capacity=4)  # small: the buffers grow on the way
        cache.append(h0, toks)
        g1 = cache.feed(cache.last.expand(3, -1), level1, 1, torch.full((3,), -1))
        g2 = cache.feed(g1[parents2], level2, 2, parents2)
        for j in range(4):
            alone = HeadCache(head)
            alone.append(h0, toks)
            a1 = alone.feed(alone.last[None], level1[parents2[j : j + 1]], 1, torch.tensor([-1]))
            a2 = alone.feed(a1, level2[j : j + 1], 2, torch.tensor([0]))
            torch.testing.assert_close(g2[j], a2[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(g1[parents2[j]], a1[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant,layers", [("eagle1", ()), ("eagle3", (0, 1))])
def test_packed_head_computes_what_the_plain_one_does(tiny_models, variant, layers):
    head = _random_head(tiny_models.target, variant, layers)
    width = head.cfg.n_features * head.cfg.hidden_size
    h = torch.randn(1, 6, width, generator=torch.Generator().manual_seed(0))
    toks = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = head.logits(head(head.fuse(h), toks, torch.arange(6)))
        assert head.pack() == packing_works(torch.float32)  # packs where oneDNN can (this CPU: yes)
        assert bool(head.packed) == packing_works(torch.float32)
        got = head.logits(head(head.fuse(h), toks, torch.arange(6)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_held_out_chain_tau_is_the_decode_loops(tiny_models):
    """store.chain_accepts (the head's held-out τ in the zoo report) replays the decode loop's steps: the same
    accepted lengths as decoding with the EAGLE drafter on a chain tree, greedy, on the same prompt."""
    from methods.heads.eagle.store import chain_accepts, chain_tau

    target = tiny_models.target
    toks = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0))
    head = train(target, toks, EagleTrainConfig(steps=40, train_windows=8, seq_len=24, batch_windows=4,
                                                lr=3e-3)).head
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(7))
    opts = DecodeOptions(Verifier.greedy, GREEDY, 40)
    res = decode(ModelEngine(target), EagleDrafter(head, Tree.chain(3), GREEDY), prompt, opts,
                 torch.Generator().manual_seed(0))
    continued = torch.cat([prompt, torch.tensor(res.token_ids)])[None]
    steps = chain_accepts(head, target, continued, prompt.numel(), 3)
    assert steps == res.accepted_lengths[: len(steps)] and len(steps) >= len(res.accepted_lengths) - 2
    assert max(steps) > 1  # some drafts accepted: the comparison is not all ones
    assert chain_tau(head, target, continued, prompt.numel(), 3) == sum(steps) / len(steps)


@pytest.mark.parametrize("variant,layers", [("eagle1", ()), ("eagle3", (0, 1))])
def test_packed_head_logits_of_no_rows(tiny_models, variant, layers):
    """Calibration asks for the logits of zero roots where a depth has none (EAGLE rows on prose at T = 1
    crashed: a 0-row reshape with -1 is ambiguous): zero rows of the target vocabulary, packed or not."""
    head = _random_head(tiny_models.target, variant, layers)
    head.pack()
    g = torch.zeros(0, head.cfg.hidden_size)
    with torch.no_grad():
        out = head.logits(g)
    assert out.shape == (0, head.cfg.vocab_size)


def test_dynamic_drafter_counts_its_kept_nodes_outcomes(tiny_models):
    """feedback: per (depth, rank), the kept nodes under an accepted parent ([0]) and those accepted ([1]):
    the accepted ones are the loop's own per-depth and per-rank counts, every accepted one was tried."""
    drafter = build_drafter(_method("eagle"), None, tiny_models, GREEDY, tree_cfg=DYNAMIC)
    engine = ModelEngine(tiny_models.target)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (15,), generator=g)
    stats = decode(engine, drafter, prompt, DecodeOptions(Verifier.greedy, GREEDY, 30), g).stats
    tried, accepted = drafter.kept
    assert (accepted <= tried).all()
    by_depth, by_rank = accepted.sum(1).tolist(), accepted.sum(0).tolist()
    assert by_depth[: len(stats.depth_accepted)] == stats.depth_accepted
    assert by_rank[: len(stats.rank_accepted)] == stats.rank_accepted
    assert sum(by_rank) == sum(stats.rank_accepted)
    # every step tries the root's kept children: depth 1's tries are the depth-1 nodes of every proposed tree
    depth1 = sum(c * int((t.depths == 1).sum()) for t, c in drafter.shapes.items())
    assert tried[0].sum() == depth1
    # by hand: root → a (rank 0), b (rank 1); a → c (0), d (1); c → e (0). Accepted root, a, c: tried a, b,
    # c, d, e; accepted a, c
    drafter.kept[:] = 0
    tree = Tree.from_parents([-1, 0, 0, 1, 1, 3], [0, 0, 1, 0, 1, 0])
    drafter.feedback(StepFeedback(Draft(tree, torch.arange(6)), (0, 1, 3), 7))
    np.testing.assert_array_equal(drafter.kept[0], [[1, 1, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(drafter.kept[1], [[1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]])


def test_eagle3_draft_vocabulary_is_the_most_frequent_train_tokens_and_q_stays_a_distribution(tiny_models):
    """draft_vocab = Vd: the head's LM head covers the Vd most frequent tokens of the train stream (rows
    from the target's, d2t mapping them back), its q is a distribution over those target ids only, and
    training on p restricted to them lowers the loss."""
    target = tiny_models.target
    V, Vd = target.config.vocab_size, 16
    g = torch.Generator().manual_seed(3)
    frequent = torch.randperm(V, generator=g)[:Vd]  # tokens 20x as likely as the rest
    weights = torch.ones(V).index_fill(0, frequent, 20.0)
    toks = torch.multinomial(weights, 4000, replacement=True, generator=g)
    cfg = EagleTrainConfig(variant="eagle3", feature_layers=(0, 1), steps=0, train_windows=8, seq_len=24,
                           batch_windows=4, ttt_steps=1, noise=0.0, draft_vocab=Vd)
    head = train(target, toks, cfg).head
    ids = head.draft_ids()
    assert head.cfg.draft_vocab_size == Vd and ids.tolist() == sorted(frequent.tolist())
    torch.testing.assert_close(head.lm_head, target.get_output_embeddings().weight[ids].float())
    with torch.no_grad():
        q = head.logits(torch.randn(5, head.cfg.hidden_size, generator=g)).softmax(-1)
    torch.testing.assert_close(q.sum(-1), torch.ones(5))
    outside = torch.ones(V, dtype=torch.bool).index_fill(0, ids, False)
    assert (q[:, outside] == 0).all() and (q[:, ids] > 0).all()
    r = train(target, toks, EagleTrainConfig(**{**cfg.__dict__, "steps": 30, "lr": 3e-3}))
    assert all(np.isfinite(r.losses)) and sum(r.losses[-5:]) < sum(r.losses[:5])


def test_draft_vocab_enters_the_cache_key_only_when_set_and_bad_sizes_are_refused(tiny_models):
    base = EagleTrainConfig(variant="eagle3", feature_layers=(0, 1))
    assert "draft_vocab" not in base.to_dict()  # heads cached before the field keep their key
    sized = EagleTrainConfig(variant="eagle3", feature_layers=(0, 1), draft_vocab=8)
    assert sized.to_dict()["draft_vocab"] == 8
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match="draft_vocab"):
            EagleTrainConfig(variant="eagle3", feature_layers=(0, 1), draft_vocab=bad)
    with pytest.raises(ValueError, match="eagle3"):
        EagleTrainConfig(draft_vocab=8)
    too_big = EagleTrainConfig(variant="eagle3", feature_layers=(0, 1), draft_vocab=10**6)
    with pytest.raises(ValueError, match="<= the target's vocabulary"):
        too_big.head_config(tiny_models.target)


@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_greedy_labels_train_q_on_the_targets_argmax(tiny_models, draft_vocab):
    """labels=greedy: the rollout's CE is against the argmax of p (restricted to the draft vocabulary when
    there is one), not p itself; the field enters the cache key only when set, bad values are refused."""
    target = tiny_models.target
    base = dict(variant="eagle3", feature_layers=(0, 1), ttt_steps=2, noise=0.0, draft_vocab=draft_vocab)
    soft, greedy = EagleTrainConfig(**base), EagleTrainConfig(**base, labels="greedy")
    assert "labels" not in soft.to_dict() and greedy.to_dict()["labels"] == "greedy"
    with pytest.raises(ValueError, match="labels"):
        EagleTrainConfig(**base, labels="hard")
    head = _random_head(target, "eagle3", (0, 1))
    if draft_vocab:
        head = new_head(target, soft.head_config(target))
        ids = torch.arange(0, 2 * draft_vocab, 2)
        head.d2t.copy_(ids - torch.arange(draft_vocab))
    seq = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    feats = trainer.target_features(target, seq, (0, 1))
    lm = target.get_output_embeddings().weight.detach().float()[head.draft_ids()]
    b = make_batch(feats, seq, torch.arange(2), lm)
    with torch.no_grad():
        outs = rollout(head, head.fuse(b.h), b.tokens, 2)
        labels = b.p_logits.argmax(-1)
        want = sum(greedy.step_decay**s * torch.nn.functional.cross_entropy(
            head.draft_logits(g)[:, s:].flatten(0, 1), labels[:, s:].flatten()) for s, g in enumerate(outs))
        torch.testing.assert_close(loss(head, b, greedy), want)
        assert not torch.allclose(loss(head, b, soft), want)
        # the labels computed once for all windows (training's pipeline) are the batch's argmax
        cached = make_batch(feats, seq, torch.arange(2), lm, greedy_labels(feats, lm, chunk=1))
        assert cached.p_logits is None and torch.equal(cached.labels(), labels)
        torch.testing.assert_close(loss(head, cached, greedy), want)


@pytest.mark.parametrize("variant,layers", [("eagle1", ()), ("eagle3", (0, 1))])
def test_bf16_head_cache_attends_like_the_float32_one(tiny_models, variant, layers):
    """A bf16 head stores its K/V in bf16 where the float32-accumulating kernel is built (kv_cache_dtype) and
    attends through it: the keys and values are the float32 cache's (computed in bf16, exactly representable),
    so the attention equals the float32 SDPA's to float32 summation order (tight tolerance); g then differs at
    most where a float32 attention output rounds to another bf16 value before o_proj (one bf16 ulp, 2^-8
    relative), and the chain's greedy drafts are the same. A float32 head keeps float32 K/V (exact path)."""
    from methods.core import mixed_attention
    from methods.core.fast_llama import attention

    head32 = _random_head(tiny_models.target, variant, layers)
    assert HeadCache(head32).kv_dtype == torch.float32
    head = _random_head(tiny_models.target, variant, layers).to(torch.bfloat16)
    fast, ref = HeadCache(head), HeadCache(head, mixed_ok=False)
    assert ref.kv_dtype == torch.float32
    assert fast.kv_dtype == (torch.bfloat16 if mixed_attention.available() else torch.float32)
    g = torch.Generator().manual_seed(7)
    width = head.fc.in_features if variant == "eagle3" else head.cfg.hidden_size
    h0 = head.fuse(torch.randn(30, width, generator=g).to(torch.bfloat16))
    toks = torch.randint(0, 256, (30,), generator=g)
    with torch.no_grad():
        for c in (fast, ref):
            c.append(h0[:20], toks[:20])
            c.append(h0[20:], toks[20:])
        torch.testing.assert_close(fast.last.float(), ref.last.float(), rtol=2e-2, atol=2e-2)
        d = head.cfg.head_dim
        q = torch.randn(1, head.cfg.num_heads, 3, d, generator=g)
        mask = torch.zeros(3, 30)
        mask[1, 5:] = float("-inf")
        gqa, m = head.cfg.num_heads != head.cfg.num_kv_heads, mask[None, None]  # as HeadCache._rows attends
        att = attention(q, fast.k[:, :30].transpose(1, 2), fast.v[:, :30].transpose(1, 2), m, d ** -0.5, gqa)
        want = attention(q, ref.k[:, :30].transpose(1, 2), ref.v[:, :30].transpose(1, 2), m, d ** -0.5, gqa)
        torch.testing.assert_close(att, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(fast.k[:, :30].float(), ref.k[:, :30])  # the same values, half the bytes
        chains = []
        for c in (fast, ref):
            x, tok, out = c.last[None], [], []
            for depth in range(1, 4):
                tok.append(int(head.logits(x).float().argmax()))
                x = c.feed(x, torch.tensor(tok[-1:]), depth, np.array([depth - 2]))
                out.append(x)
            chains.append((tok, out))
            c.drop_pending()
        assert chains[0][0] == chains[1][0]
        for a, b in zip(chains[0][1], chains[1][1]):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_bf16_batch_head_cache_rows_are_the_one_sequence_caches(tiny_models):
    """BatchHeadCache keeps the one-sequence cache's K/V dtype (bf16 through the kernel for a bf16 head) and
    gives every row the g that HeadCache gives it alone."""
    head = _random_head(tiny_models.target).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    feats = [torch.randn(n, head.cfg.hidden_size, generator=g).to(torch.bfloat16) for n in (5, 9)]
    toks = [torch.randint(0, 256, (f.shape[0],), generator=g) for f in feats]
    fed = torch.randint(0, 256, (2, 2), generator=g)  # (row, node)
    batch = BatchHeadCache(head, 2)
    assert batch.kv_dtype == HeadCache(head).kv_dtype
    with torch.no_grad():
        batch.join(2)
        batch.append([0, 1], feats, toks)
        out = batch.feed(batch.last[:2, None].expand(2, 2, -1), fed, 1, np.full(2, -1))
        for b in range(2):
            one = HeadCache(head)
            one.append(feats[b], toks[b])
            torch.testing.assert_close(batch.last[b].float(), one.last.float(), rtol=2e-2, atol=2e-2)
            got = one.feed(one.last.expand(2, -1), fed[b], 1, np.full(2, -1))
            torch.testing.assert_close(out[b].float(), got.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("variant,layers", [("eagle1", ()), ("eagle3", (0, 1))])
def test_restricted_vocabulary_keeps_the_heads_logits_on_its_ids(tiny_models, variant, layers):
    """restrict_vocabulary(ids): the logits on ``ids`` are the full head's, -inf elsewhere (q a distribution
    over ids), packed or not; draft_ids are ``ids``; a reduced head cannot be reduced again."""
    head = _random_head(tiny_models.target, variant, layers)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, head.cfg.hidden_size, generator=g)
    ids = torch.randperm(head.cfg.vocab_size, generator=g)[:40].sort().values
    with torch.no_grad():
        full = head.logits(x)
        head.restrict_vocabulary(ids)
        assert head.cfg.draft_vocab_size == 40 and head.draft_ids().tolist() == ids.tolist()
        for packed in (False, True):
            if packed:
                head.pack()
            z = head.logits(x)
            torch.testing.assert_close(z[:, ids], full[:, ids], rtol=1e-4, atol=1e-4)
            outside = torch.ones(head.cfg.vocab_size, dtype=torch.bool).index_fill(0, ids, False)
            assert torch.isinf(z[:, outside]).all() and torch.isfinite(z[:, ids]).all()
    with pytest.raises(ValueError, match="already reduced"):
        head.restrict_vocabulary(ids)


def _greedy_reference(tiny_models):
    """(engine, generator, a 15-token prompt, the target's greedy 30 tokens after it): seed 0."""
    engine = ModelEngine(tiny_models.target)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (15,), generator=g)
    ref = decode(engine, Autoregressive(), prompt, DecodeOptions(max_new_tokens=30), g).token_ids
    return engine, g, prompt, ref


def _on_proposals(drafter, seen) -> None:
    """Wrap ``drafter.propose`` so that every proposal is also handed to ``seen(ctx, draft)``."""
    real = drafter.propose

    def spy(ctx):
        d = real(ctx)
        seen(ctx, d)
        return d

    drafter.propose = spy


@pytest.mark.parametrize("tree_cfg,tree", [(None, Tree.chain(4)), (DYNAMIC, None)])
def test_inference_draft_vocab_is_greedy_exact_and_drafts_frequent_tokens(tiny_models, tree_cfg, tree):
    """method.params.draft_vocab = N on an EAGLE-1 head: its drafts are among the N most frequent train-split
    tokens (store.frequent_ids), the output is still the target's greedy one."""
    from methods.heads.eagle.store import frequent_ids

    drafter = build_drafter(_method("eagle", draft_vocab=32), tree, tiny_models, GREEDY, tree_cfg=tree_cfg)
    allowed = frequent_ids(tiny_models.tokenizer, 32, tiny_models.target.config.vocab_size)
    assert drafter.head.draft_ids().tolist() == allowed.tolist()
    engine, g, prompt, ref = _greedy_reference(tiny_models)
    drafted = []
    _on_proposals(drafter, lambda ctx, d: drafted.extend(d.tokens[1:].tolist()))
    assert decode(engine, drafter, prompt, DecodeOptions(Verifier.greedy, GREEDY, 30), g).token_ids == ref
    assert drafted and set(drafted) <= set(allowed.tolist())


def test_inference_draft_vocab_bad_values_are_refused(tiny_models):
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match="draft_vocab"):
            build_drafter(_method("eagle", draft_vocab=bad), Tree.chain(2), tiny_models, GREEDY)
    with pytest.raises(ValueError, match="<= the target's vocabulary"):
        build_drafter(_method("eagle", draft_vocab=10**6), Tree.chain(2), tiny_models, GREEDY)
    with pytest.raises(ValueError, match="already reduced"):  # an EAGLE-3 head trained on a draft vocabulary
        build_drafter(_method("eagle3", draft_vocab=16, **DRAFT_VOCAB), Tree.chain(2), tiny_models, GREEDY)


def test_chain_fast_path_drafts_what_the_tree_path_drafts(tiny_models):
    """EagleDrafter._chain (chains in topk mode) proposes the general static-tree path's draft, step after
    step of a greedy decode (the same head cache state), and that decode is the target's greedy output."""
    head = _random_head(tiny_models.target)
    fast, slow = EagleDrafter(head, Tree.chain(4), GREEDY), EagleDrafter(head, Tree.chain(4), GREEDY)
    slow.fast_chain = False
    engine, g, prompt, ref = _greedy_reference(tiny_models)
    pairs = []

    def beside(ctx, d):
        slow.cache = fast.cache  # the same committed rows (propose drops its pending ones)
        pairs.append((d, slow.propose(DraftContext(ctx.tokens, None, ctx.generator, ctx.max_new))))

    _on_proposals(fast, beside)
    assert decode(engine, fast, prompt, DecodeOptions(Verifier.greedy, GREEDY, 30), g).token_ids == ref
    assert len(pairs) > 3 and any(a.tree.size == 5 for a, _ in pairs)
    for a, b in pairs:
        assert a.tree == b.tree and torch.equal(a.tokens, b.tokens) and a.q is None and b.q is None
    assert not fast._plans and slow._plans  # the fast one never built the tree path's plan
