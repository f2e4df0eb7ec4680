"""Medusa heads, checkpoints (ours and the published layout), greedy tree construction and the drafter."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from methods.core.drafter import DraftContext
from methods.core.sampling import SamplingParams, probs
from methods.drafters.medusa import MedusaDrafter, _prune
from methods.heads.medusa.checkpoint import load_heads, save_heads, save_published
from methods.heads.medusa.heads import HeadsConfig, MedusaHeads
from methods.heads.medusa.train import IGNORE, head_labels
from methods.heads.medusa.tree import expected_tokens, greedy_tree, path_value
from methods.models import random_llama
from specsim.config import ModelConfig
from specsim.tree import Tree

TINY = ModelConfig(
    vocab_size=300,
    hidden_size=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=4,
    intermediate_size=64,
    context_length=128,
    draft_n_layers=0,
)


@pytest.fixture(scope="module")
def target():
    return random_llama(TINY, seed=3).eval()


def _heads(target, k: int = 3, layers: int = 1, seed: int = 0) -> MedusaHeads:
    """Heads from the LM head with random (non-identity) ResBlocks."""
    lm = target.get_output_embeddings().weight.detach()
    heads = MedusaHeads.from_lm_head(HeadsConfig(k, layers, lm.shape[1], lm.shape[0]), lm)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return heads.eval()


# ---- heads ------------------------------------------------------------------------------------------
def test_heads_shapes_and_identity_init(target):
    ids = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    lm = target.get_output_embeddings().weight.detach()
    heads = MedusaHeads.from_lm_head(HeadsConfig(4, 2, lm.shape[1], lm.shape[0]), lm)
    with torch.no_grad():
        h = target.base_model(input_ids=ids).last_hidden_state  # (2, 9, H) after the final norm
        logits = target(input_ids=ids).logits  # (2, 9, V)
        out = heads(h)
    assert out.shape == (4, 2, 9, TINY.vocab_size)
    for k in range(4):  # every ResBlock is the identity at init: each head is the LM head
        torch.testing.assert_close(out[k], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(heads.head_logits(h, 1), logits, rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in heads.parameters()) == 4 * (2 * (32 * 32 + 32) + 32 * TINY.vocab_size)


def test_heads_forward_is_resblock_then_projection(target):
    heads = _heads(target, k=2, layers=2)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    for k in (1, 2):
        seq = heads.heads[k - 1]
        y = x
        for block in seq[:-1]:
            y = y + F.silu(y @ block.linear.weight.T + block.linear.bias)
        torch.testing.assert_close(heads.head_logits(x, k), y @ seq[-1].weight.T)


# ---- checkpoints -------------------------------------------------------------------------------------
def test_roundtrip_our_layout(target, tmp_path):
    heads = _heads(target, k=3, layers=2)
    save_heads(heads, tmp_path / "h", meta={"accuracy": [[0.5, 0.2]] * 3})
    loaded = load_heads(tmp_path / "h")
    assert loaded.layout == "ours" and loaded.heads.cfg == heads.cfg
    assert loaded.meta["accuracy"] == [[0.5, 0.2]] * 3
    for (k1, v1), (k2, v2) in zip(heads.state_dict().items(), loaded.heads.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    x = torch.randn(4, 32)
    torch.testing.assert_close(loaded.heads(x), heads(x), rtol=0, atol=0)


def _fake_published(directory, num_heads: int, layers: int, hidden: int, vocab: int, fmt: str, seed: int):
    """A checkpoint in FasterDecoding/Medusa's layout, written by hand (not with our saver), plus the
    reference function it defines: head k = proj_k ∘ (x + SiLU(W x + b)) applied ``layers`` times."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(num_heads):
        for j in range(layers):
            state[f"{i}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.2
            state[f"{i}.{j}.linear.bias"] = torch.randn(hidden, generator=g) * 0.2
        state[f"{i}.{layers}.weight"] = torch.randn(vocab, hidden, generator=g)
    directory.mkdir(parents=True)
    if fmt == "pt":
        torch.save(state, directory / "medusa_lm_head.pt")
    else:
        save_file(state, str(directory / "medusa_lm_head.safetensors"))
    # Medusa's uploaded configs may name more heads than the file holds: ours must trust the tensors
    config = {
        "medusa_num_heads": num_heads + 1,
        "medusa_num_layers": layers,
        "base_model_name_or_path": "x/y",
    }
    (directory / "config.json").write_text(json.dumps(config))

    def reference(x: torch.Tensor) -> torch.Tensor:
        outs = []
        for i in range(num_heads):
            y = x
            for j in range(layers):
                y = y + F.silu(y @ state[f"{i}.{j}.linear.weight"].T + state[f"{i}.{j}.linear.bias"])
            outs.append(y @ state[f"{i}.{layers}.weight"].T)
        return torch.stack(outs)

    return reference


@pytest.mark.parametrize("fmt,num_heads,layers", [("pt", 3, 1), ("safetensors", 2, 2), ("pt", 1, 0)])
def test_load_published_layout(tmp_path, fmt, num_heads, layers):
    reference = _fake_published(tmp_path / "pub", num_heads, layers, hidden=16, vocab=40, fmt=fmt, seed=7)
    loaded = load_heads(tmp_path / "pub")
    assert loaded.layout == "published"
    assert loaded.heads.cfg == HeadsConfig(num_heads, layers, 16, 40)
    assert loaded.meta["config"]["base_model_name_or_path"] == "x/y"
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(loaded.heads(x), reference(x))


def test_published_roundtrip(target, tmp_path):
    heads = _heads(target, k=2, layers=1)
    save_published(heads, tmp_path / "pub", base_model="tiny")
    keys = set(json.loads((tmp_path / "pub" / "config.json").read_text()))
    assert keys == {"medusa_num_heads", "medusa_num_layers", "base_model_name_or_path"}
    loaded = load_heads(tmp_path / "pub")
    assert loaded.layout == "published" and loaded.heads.cfg == heads.cfg
    x = torch.randn(3, 32)
    torch.testing.assert_close(loaded.heads(x), heads(x), rtol=0, atol=0)


def test_drafter_rejects_heads_of_another_model(target, tmp_path):
    from methods.models import Models
    from specsim.config import MethodConfig

    _fake_published(tmp_path / "pub", 2, 1, hidden=16, vocab=40, fmt="pt", seed=0)
    models = Models(target, None, None, torch.device("cpu"), torch.float32)
    method = MethodConfig(name="medusa", drafter="medusa", params={"heads": str(tmp_path / "pub")})
    with pytest.raises(ValueError, match="hidden, vocab"):
        MedusaDrafter.from_config(method, None, models, SamplingParams(temperature=0))


def test_load_missing_directory_names_both_layouts(tmp_path):
    with pytest.raises(FileNotFoundError, match="medusa_lm_head"):
        load_heads(tmp_path)


# ---- training labels ---------------------------------------------------------------------------------
def test_head_labels_offsets():
    x = torch.arange(10).view(1, 10)
    greedy = 100 + torch.arange(10).view(1, 10)  # greedy[t] predicts x_{t+1}
    data = head_labels(x, None, 2)
    assert (
        data[0, 0, :8].tolist() == list(range(2, 10)) and (data[0, 0, 8:] == IGNORE).all()
    )  # head 1: x_{t+2}
    assert (
        data[1, 0, :7].tolist() == list(range(3, 10)) and (data[1, 0, 7:] == IGNORE).all()
    )  # head 2: x_{t+3}
    selfd = head_labels(x, greedy, 2)
    assert selfd[0, 0, :9].tolist() == list(range(101, 110)) and selfd[0, 0, 9] == IGNORE  # greedy[t+1]
    assert selfd[1, 0, :8].tolist() == list(range(102, 110)) and (selfd[1, 0, 8:] == IGNORE).all()


# ---- greedy tree ---------------------------------------------------------------------------------------
def _closed_trees(heads: int, ranks: int, size: int) -> set[frozenset]:
    """Every prefix- and sibling-closed set of ``size`` choice paths (depth <= heads, ranks < ranks), by
    adding one frontier node at a time from the empty set (every closed set is reachable that way)."""
    level = {frozenset()}
    for _ in range(size):
        nxt = set()
        for s in level:
            for p in _frontier(s, heads, ranks):
                nxt.add(s | {p})
        level = nxt or level
    return level


def _frontier(s: frozenset, heads: int, ranks: int):
    cands = {(0,)} | {p[:-1] + (p[-1] + 1,) for p in s if p[-1] + 1 < ranks}
    cands |= {p + (0,) for p in s if len(p) < heads}
    return [p for p in cands if p not in s]


@st.composite
def _monotone_tables(draw):
    heads, ranks = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rows = []
    for _ in range(heads):
        vals = sorted(draw(st.lists(st.floats(0, 1), min_size=ranks, max_size=ranks)), reverse=True)
        total = sum(vals)
        rows.append([v / max(total, 1.0) for v in vals])  # a row is a sub-distribution over ranks
    return np.array(rows)


@settings(max_examples=60, deadline=None)
@given(_monotone_tables(), st.integers(1, 7))
def test_greedy_tree_is_optimal_by_brute_force(acc, budget):
    heads, ranks = acc.shape
    got = greedy_tree(acc, budget)
    n_max = sum(ranks**d for d in range(1, heads + 1))
    assert got.tree.size == min(budget, n_max + 1)
    assert got.expected_tokens == pytest.approx(expected_tokens(got.tree, acc))
    best = max(sum(path_value(acc, p) for p in s) for s in _closed_trees(heads, ranks, got.tree.size - 1))
    assert got.expected_tokens == pytest.approx(1 + best, abs=1e-12)
    for kids in got.tree.children:  # sibling-closed: ranks 0..n-1
        assert sorted(got.tree.ranks[c] for c in kids) == list(range(len(kids)))


def test_greedy_tree_on_medusa_like_table():
    acc = np.array([[0.6, 0.1, 0.05], [0.4, 0.1, 0.05], [0.3, 0.05, 0.02]])
    got = greedy_tree(acc, 6)
    # values: (0)=.6, (0,0)=.24, (0,0,0)=.072, (1)=.1, (0,1)=.06, (2)=.05, (1,0)=.04 → top five
    assert set(got.paths) == {(0,), (0, 0), (0, 0, 0), (1,), (0, 1)}
    assert got.expected_tokens == pytest.approx(1 + 0.6 + 0.24 + 0.072 + 0.1 + 0.06)
    assert greedy_tree(acc, 3, max_depth=1).paths == ((0,), (1,))
    assert greedy_tree(acc, 1).tree.size == 1


# ---- drafter -------------------------------------------------------------------------------------------
PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def _ctx(h, max_new=50, seed=0):
    return DraftContext(
        tokens=torch.tensor([5, 9, 11]),
        hidden=h,
        generator=torch.Generator().manual_seed(seed),
        max_new=max_new,
    )


def test_drafter_topk_fills_tree_from_heads(target):
    heads, tree = _heads(target), Tree.from_paths(PATHS)
    drafter = MedusaDrafter(heads, tree, SamplingParams(temperature=0))
    drafter.reset(torch.tensor([5, 9, 11]))
    assert drafter.propose(_ctx(None)).tree.size == 1  # no hidden state yet: the autoregressive step
    h = torch.randn(2, 32, generator=torch.Generator().manual_seed(4))
    draft = drafter.propose(_ctx(h))
    assert draft.tree == tree and draft.q is None and int(draft.tokens[0]) == 11
    top = heads(h[-1]).topk(3, dim=-1).indices  # (K, 3): the LAST hidden state drives the heads
    for i in range(1, tree.size):
        assert int(draft.tokens[i]) == int(top[tree.depths[i] - 1, tree.ranks[i]])
    again = drafter.propose(_ctx(None))  # no new hidden rows: the same state is reused
    assert torch.equal(again.tokens, draft.tokens)
    short = drafter.propose(_ctx(h, max_new=2))  # at most 2 more tokens: depth 1 only
    assert short.tree.depth == 1 and short.tree.size == 4
    assert torch.equal(short.tokens, draft.tokens[:4])


@pytest.mark.parametrize("mode", ["without", "with_replacement"])
def test_drafter_sampled_candidates_and_q(target, mode):
    heads, tree = _heads(target), Tree.from_paths(PATHS)
    sampling = SamplingParams(temperature=0.8, top_k=20)
    drafter = MedusaDrafter(heads, tree, sampling, mode=mode)
    h = torch.randn(1, 32, generator=torch.Generator().manual_seed(5))
    draft = drafter.propose(_ctx(h, seed=1))
    q_heads = probs(heads(h[-1]), sampling)  # (K, V)
    assert draft.q is not None and draft.q.shape == (draft.tree.size, TINY.vocab_size)
    for i in range(draft.tree.size):
        if draft.tree.children[i]:
            torch.testing.assert_close(draft.q[i], q_heads[draft.tree.depths[i]])
    for i in range(1, draft.tree.size):  # every candidate is in its head's support
        assert q_heads[draft.tree.depths[i] - 1, draft.tokens[i]] > 0
    # nodes at one depth with one rank share the draw; without replacement, siblings are distinct
    by_key = {}
    for i in range(1, draft.tree.size):
        key = (int(draft.tree.depths[i]), draft.tree.ranks[i])
        assert by_key.setdefault(key, int(draft.tokens[i])) == int(draft.tokens[i])
    if mode == "without":
        for kids in draft.tree.children:
            toks = [int(draft.tokens[c]) for c in kids]
            assert len(set(toks)) == len(toks)


def test_drafter_without_replacement_respects_small_support(target):
    heads, tree = _heads(target), Tree.from_paths(PATHS)
    drafter = MedusaDrafter(heads, tree, SamplingParams(temperature=1.0, top_k=2), mode="without")
    draft = drafter.propose(_ctx(torch.randn(1, 32)))
    assert draft.tree.width <= 2 and max(draft.tree.ranks) <= 1  # rank-2 nodes pruned with their subtrees


def test_without_replacement_draw_law(target):
    """Gumbel-top-k has the sequential without-replacement law: P(a then b) = q_a q_b / (1 - q_a)."""
    from methods.drafters.medusa import _draw

    q = torch.tensor([0.5, 0.3, 0.2])
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = {}
    for _ in range(n):
        a, b = _draw(q, 2, "without", g).tolist()
        counts[(a, b)] = counts.get((a, b), 0) + 1
    for a, b in itertools.permutations(range(3), 2):
        expect = float(q[a] * q[b] / (1 - q[a]))
        assert abs(counts.get((a, b), 0) / n - expect) < 4 * (expect * (1 - expect) / n) ** 0.5 + 1e-3


def test_prune_keeps_closed_subtrees():
    tree = Tree.from_paths(PATHS)
    cut = _prune(tree, [2, 1])
    assert set(cut.choice_paths) == {(0,), (1,), (0, 0), (1, 0)}
    assert _prune(tree, [10, 10, 10]) is tree


# ---- through the shared decode loop -------------------------------------------------------------------
def _decode(target, drafter, prompt, sampling, verifier, max_new, seed=0):
    from methods.core.engine import ModelEngine
    from methods.core.loop import DecodeOptions, decode

    opts = DecodeOptions(verifier=verifier, sampling=sampling, max_new_tokens=max_new)
    return decode(ModelEngine(target), drafter, prompt, opts, torch.Generator().manual_seed(seed))


def _reference_greedy(target, prompt: torch.Tensor, n: int) -> list[int]:
    """Plain greedy decoding by full recomputation (no cache, no engine): the independent reference."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, target(input_ids=ids[None]).logits[0, -1].argmax().view(1)])
    return ids[prompt.numel() :].tolist()


@pytest.mark.parametrize("heads_kind", ["init", "random"])
@pytest.mark.parametrize("verifier", ["greedy", "deterministic", "typical"])
def test_greedy_equivalence_through_the_loop(target, heads_kind, verifier):
    from methods.drafters.registry import build_drafter
    from methods.models import Models
    from specsim.config import MethodConfig, Verifier

    models = Models(target, None, None, torch.device("cpu"), torch.float32)
    method = MethodConfig(
        name="medusa",
        drafter="medusa",
        verifier=Verifier(verifier),
        lossless=verifier != "typical",
        params={"heads": heads_kind, "num_heads": 3, "seed": 1},
    )
    drafter = build_drafter(method, Tree.from_paths(PATHS), models, SamplingParams(temperature=0))
    assert isinstance(drafter, MedusaDrafter) and drafter.mode == "topk"
    g = torch.Generator().manual_seed(11)
    accepted = []
    for n_prompt, max_new in ((1, 7), (5, 20), (12, 33)):
        prompt = torch.randint(0, TINY.vocab_size, (n_prompt,), generator=g)
        out = _decode(target, drafter, prompt, SamplingParams(temperature=0), Verifier(verifier), max_new)
        assert out.token_ids == _reference_greedy(target, prompt, max_new)
        assert sum(out.accepted_lengths) >= max_new and len(out.token_ids) == max_new
        accepted += out.accepted_lengths
    if heads_kind == "init":  # identity heads repeat the root: the random model's loops accept them
        assert max(accepted) > 1


def _aimed_heads(target, prompt: torch.Tensor, noise: float, seed: int) -> MedusaHeads:
    """Identity-ResBlock heads whose projections are edited (rank one) so that, at the prompt's last state h,
    head 1's logits are the target's next-token logits and head 2's those after the greedy token, plus
    Gaussian noise (``noise`` logit standard deviations): drafts get accepted at both depths, and rejected."""
    lm = target.get_output_embeddings().weight.detach()
    heads = MedusaHeads.from_lm_head(HeadsConfig(2, 1, lm.shape[1], lm.shape[0]), lm)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        h = target.base_model(input_ids=prompt[:-1][None]).last_hidden_state[0, -1]  # (H,) predicts the root
        l1 = target(input_ids=prompt[None]).logits[0, -1]
        l2 = target(input_ids=torch.cat([prompt, l1.argmax().view(1)])[None]).logits[0, -1]
        for seq, want in zip(heads.heads, (l1, l2)):
            w = seq[-1].weight
            goal = want + noise * want.std() * torch.randn(want.shape, generator=g)
            w.add_(torch.outer(goal - w @ h, h) / h.dot(h))
    return heads.eval()


@pytest.mark.slow
@pytest.mark.parametrize("verifier", ["sequoia", "specinfer"])
def test_sampled_drafts_are_lossless_chi_square(target, verifier):
    """Law of the first two emitted tokens at temperature 1, top-k 3 (p and q), against the target's own."""
    from scipy.stats import chisquare

    from methods.core.engine import ModelEngine
    from methods.core.loop import DecodeOptions, decode
    from specsim.config import Verifier

    sampling = SamplingParams(temperature=1.0, top_k=3)
    prompt = torch.tensor([3, 14, 15, 92, 65])
    heads = _aimed_heads(target, prompt, noise=0.1, seed=0)
    mode = {"sequoia": "without", "specinfer": "with_replacement"}[verifier]
    drafter = MedusaDrafter(heads, Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]]), sampling, mode)
    with torch.no_grad():
        p1 = probs(target(input_ids=prompt[None]).logits[0, -1], sampling)  # (V,)
        law = {}
        for a in torch.nonzero(p1).view(-1).tolist():
            p2 = probs(target(input_ids=torch.cat([prompt, torch.tensor([a])])[None]).logits[0, -1], sampling)
            for b in torch.nonzero(p2).view(-1).tolist():
                law[(a, b)] = float(p1[a] * p2[b])
    engine, opts = ModelEngine(target), DecodeOptions(Verifier(verifier), sampling, max_new_tokens=3)
    n, counts, lengths = 800, dict.fromkeys(law, 0), []
    for s in range(n):
        out = decode(engine, drafter, prompt, opts, torch.Generator().manual_seed(s))
        counts[tuple(out.token_ids[:2])] += 1
        lengths.append(out.accepted_lengths[0])
    assert {1, 2, 3} <= set(lengths)  # rejections at depth 1, acceptances at depth 1 and at depth 2
    cells = sorted(law)
    total = sum(law.values())  # 1 up to float32 rounding, which scipy's sum check would reject
    stat = chisquare([counts[c] for c in cells], [n * law[c] / total for c in cells])
    assert stat.pvalue > 1e-3, (stat, counts, law)


# ---- training on the micro zoo (cached like the zoo) -----------------------------------------------------
MICRO_TRAIN = dict(num_heads=3, steps=12, batch_tokens=256, train_windows=16, seq_len=64)


@pytest.fixture(scope="module")
def micro():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from methods.zoo import ensure_zoo

    paths = ensure_zoo("micro")
    model = AutoModelForCausalLM.from_pretrained(paths.target_dir, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(paths.tokenizer_dir)


def _micro_eval():
    from methods.heads.medusa.store import EvalConfig

    return EvalConfig(
        windows=2, prompts=2, prompt_len=32, new_tokens=24, ranks=6, train_chars=60_000, test_chars=30_000
    )


@pytest.mark.slow
def test_medusa1_on_micro_zoo_trains_reports_and_is_cached(micro, tmp_path, monkeypatch):
    import methods.heads.medusa.store as store
    from methods.heads.medusa.train import TrainConfig

    target, tok = micro
    before = {k: v.clone() for k, v in target.state_dict().items()}
    cfg, ev = TrainConfig(**MICRO_TRAIN), _micro_eval()
    with torch.inference_mode():  # as a calibration builds its drafter: training must still get gradients
        built = store.ensure_medusa(target, tok, cfg, ev, cache_root=tmp_path)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # Medusa-1: target frozen
    r = built.report
    assert built.target_dir is None and r["medusa"] == 1
    assert r["loss_last"] < r["loss_first"]
    assert built.accuracy.shape == (3, 6) and np.all(built.accuracy.sum(1) <= 1 + 1e-9)
    for key in ("top1_forced", "top1_generated"):
        top5 = r[key.replace("top1", "top5")]
        assert len(r[key]) == 3 and all(0 <= a <= b <= 1 for a, b in zip(r[key], top5))
    loaded = load_heads(built.heads_dir)
    assert loaded.layout == "ours" and np.allclose(loaded.meta["accuracy"], built.accuracy)

    def no_training(*args, **kwargs):
        raise AssertionError("a cached entry must not be trained again")

    monkeypatch.setattr(store, "train", no_training)
    again = store.ensure_medusa(target, tok, TrainConfig(**MICRO_TRAIN), _micro_eval(), cache_root=tmp_path)
    assert again.root == built.root and again.report == r
    with pytest.raises(AssertionError, match="cached"):  # another config is another entry
        store.ensure_medusa(
            target, tok, TrainConfig(**MICRO_TRAIN, seed=1), _micro_eval(), cache_root=tmp_path
        )


@pytest.mark.slow
def test_medusa2_on_micro_zoo_tunes_a_copy_of_the_target(micro, tmp_path):
    from transformers import AutoModelForCausalLM

    import methods.heads.medusa.store as store
    from methods.heads.medusa.train import TrainConfig

    target, tok = micro
    cfg = TrainConfig(**MICRO_TRAIN, joint=True, joint_steps=3, joint_batch=2)
    built = store.ensure_medusa(target, tok, cfg, _micro_eval(), cache_root=tmp_path)
    assert built.report["medusa"] == 2 and built.target_dir is not None
    drift = built.report["target_drift"]
    assert drift["ppl_original"] > 0 and drift["ppl_tuned"] > 0 and 0 <= drift["greedy_agreement"] <= 1
    tuned = AutoModelForCausalLM.from_pretrained(built.target_dir, local_files_only=True)
    changed = [k for k, v in tuned.state_dict().items() if not torch.equal(v, target.state_dict()[k])]
    assert changed  # the jointly trained target differs from the original, which stays untouched
    # the drafter loads the tuned weights into the run's target: looking up with it finds the same entry
    again = store.ensure_medusa(tuned.eval(), tok, cfg, _micro_eval(), cache_root=tmp_path)
    assert again.root.resolve() == built.root.resolve() and again.report == built.report


@pytest.mark.slow
def test_trained_heads_greedy_tree_and_equivalence_on_micro_zoo(micro, tmp_path):
    import methods.heads.medusa.store as store
    from methods.drafters.registry import build_drafter
    from methods.heads.medusa.train import TrainConfig
    from methods.models import Models
    from specsim.config import MethodConfig, Verifier

    target, tok = micro
    built = store.ensure_medusa(target, tok, TrainConfig(**MICRO_TRAIN), _micro_eval(), cache_root=tmp_path)
    models = Models(target, None, tok, torch.device("cpu"), torch.float32)
    method = MethodConfig(
        name="medusa",
        drafter="medusa",
        verifier=Verifier.greedy,
        params={"heads": str(built.heads_dir), "num_heads": 3, "tree_budget": 9},
    )
    drafter = build_drafter(method, None, models, SamplingParams(temperature=0))
    assert drafter.tree == greedy_tree(built.accuracy, 9, max_depth=3).tree
    g = torch.Generator().manual_seed(5)
    for n_prompt in (3, 17):
        prompt = torch.randint(0, len(tok), (n_prompt,), generator=g)
        out = _decode(target, drafter, prompt, SamplingParams(temperature=0), Verifier.greedy, 30)
        assert out.token_ids == _reference_greedy(target, prompt, 30)


def test_from_config_reads_the_preset_params(target):
    from methods.models import Models
    from specsim.config import MethodConfig, Verifier

    models = Models(target, None, None, torch.device("cpu"), torch.float32)
    preset = {
        "num_heads": 4,
        "top_k": 10,
        "posterior_threshold": 0.09,
        "posterior_alpha": 0.3,
        "heads": "init",
    }
    method = MethodConfig(name="medusa", drafter="medusa", verifier=Verifier.sequoia, params=preset)
    deep = Tree.chain(6)  # deeper than the heads: cut to 4 levels
    with pytest.warns(UserWarning, match="cut to the 4 heads"):
        drafter = MedusaDrafter.from_config(method, deep, models, SamplingParams(temperature=0.7))
    assert drafter.tree == Tree.chain(4) and drafter.mode == "without"
    assert MedusaDrafter.from_config(method, None, models, SamplingParams(temperature=0)).mode == "topk"
    with pytest.raises(ValueError, match="unknown medusa keys"):
        MedusaDrafter.from_config(
            MethodConfig(params={"heads": "init", "nope": 1}), None, models, SamplingParams()
        )
    with pytest.raises(ValueError, match="top_k"):
        MedusaDrafter.from_config(
            MethodConfig(params={"heads": "init", "top_k": 2}), Tree.kary(3, 1), models, SamplingParams()
        )


@pytest.mark.slow
def test_medusa2_drafter_brings_its_tuned_target(micro, tmp_path, monkeypatch):
    """heads=train with joint=True: the drafter's backbone is Medusa-2's tuned target (the run's target is
    left as it is), and decoding with the drafter stays greedy-equivalent to that (tuned) target."""
    import copy

    from methods.models import Models
    from specsim.config import MethodConfig, Verifier

    monkeypatch.setenv("SPECSIM_CACHE", str(tmp_path))
    target, tok = micro
    run_target = copy.deepcopy(target)
    params = {
        "heads": "train",
        "num_heads": 2,
        "steps": 6,
        "joint": True,
        "joint_steps": 2,
        "train": {"batch_tokens": 256, "train_windows": 8, "seq_len": 64, "joint_batch": 2},
    }
    models = Models(run_target, None, tok, torch.device("cpu"), torch.float32)
    method = MethodConfig(name="medusa2", drafter="medusa", params=params)
    drafter = MedusaDrafter.from_config(
        method, Tree.from_paths([[0], [1], [0, 0]]), models, SamplingParams(0)
    )
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in run_target.state_dict().items())
    tuned = drafter.backbone.model
    assert drafter.backbone.name.startswith("medusa-2 tuned target")
    assert any(not torch.equal(v, target.state_dict()[k]) for k, v in tuned.state_dict().items())
    prompt = torch.randint(0, len(tok), (9,), generator=torch.Generator().manual_seed(2))
    out = _decode(tuned, drafter, prompt, SamplingParams(temperature=0), Verifier.greedy, 20)
    assert out.token_ids == _reference_greedy(tuned, prompt, 20)
