"""SpecInfer with several drafts (methods.drafters.specinfer): the merged token tree and its per-draw laws,
the union tree the simulator prices, and the boost-tuned drafts of the micro zoo (methods.zoo.drafts)."""

from __future__ import annotations

import pytest
import torch

from methods.core.drafter import Draft
from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.drafters.registry import build_drafter
from methods.drafters.specinfer import merge, union_tree
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree


def _part(parents: list[int], tokens: list[int], V: int = 5, fill: float = 0.0) -> Draft:
    q = torch.full((len(tokens), V), 1.0 / V) + fill
    return Draft(Tree.from_parents(parents), torch.tensor(tokens), q / q.sum(-1, keepdim=True))


def test_merge_shares_prefixes_and_keeps_one_draw_per_proposer():
    a = _part([-1, 0, 1], [7, 1, 2])  # chain 7 -> 1 -> 2
    b = _part([-1, 0, 1], [7, 1, 3], fill=0.5)  # shares the first token, then branches
    c = _part([-1, 0, 0], [7, 4, 1])  # a root child of its own, and 1 again (a duplicate draw)
    m = merge([a, b, c], sampled=True)
    tree, toks = m.draft.tree, m.draft.tokens.tolist()
    assert toks == [7, 1, 2, 3, 4] and tree.parents == (-1, 0, 1, 1, 0)
    assert tree.ranks == (0, 0, 0, 1, 1)  # order of arrival among siblings
    assert m.where == ((0, 1, 2), (0, 1, 3), (0, 4, 1))
    assert m.draft.draws.node.tolist() == [1, 2, 1, 3, 4, 1]  # draft by draft: node 1 drawn three times
    torch.testing.assert_close(m.draft.draws.q[2], b.q[0])  # b's draw of node 1 keeps b's own law
    assert merge([a, b, c], sampled=False).draft.draws is None  # top-k drafts: deterministic, no laws


def test_union_tree_is_the_budget_without_shared_prefixes():
    assert union_tree(Tree.chain(4), 3).size == 1 + 12
    tree = Tree.from_paths([[0], [0, 0], [1]])
    u = union_tree(tree, 2)
    assert u.size == 1 + 2 * 3 and u.width == 4  # both copies' root children side by side
    assert union_tree(tree, 1) == tree


def test_a_draft_with_draws_needs_the_specinfer_verifier():
    from methods.core.verify import VerifyError, verify

    m = merge([_part([-1, 0], [7, 1]), _part([-1, 0], [7, 2])], sampled=True)
    p = torch.full((m.draft.tree.size, 5), 0.2)
    with pytest.raises(VerifyError, match="specinfer"):
        verify(Verifier.sequoia, m.draft, p, torch.Generator().manual_seed(0))
    res = verify(Verifier.specinfer, m.draft, p, torch.Generator().manual_seed(0))
    assert res.accepted[0] == 0


def test_several_drafts_accept_more_than_one_at_equal_per_draft_tree(tiny_models):
    """The merged tree of the draft and two perturbed copies accepts at least as many tokens per forward as
    the draft alone (greedy: its chain is a branch of the merged tree), and emits the same tokens."""
    greedy = SamplingParams(temperature=0.0)
    engine = ModelEngine(tiny_models.target)
    prompt = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(5))
    opts = DecodeOptions(Verifier.greedy, greedy, 40)
    out = {}
    for k in (1, 3):
        method = MethodConfig(name="specinfer", drafter="specinfer", params={"source": "copies", "drafts": k})
        drafter = build_drafter(method, Tree.chain(3), tiny_models, greedy)
        out[k] = decode(engine, drafter, prompt, opts, torch.Generator().manual_seed(0))
    assert out[3].token_ids == out[1].token_ids
    assert out[3].n_target_forwards <= out[1].n_target_forwards


@pytest.mark.slow
def test_boost_tuned_drafts_of_the_micro_zoo_are_cached_and_train_on_uncovered_examples(tmp_path):
    from methods.zoo import preset
    from methods.zoo.drafts import ExtraDrafts, drafts_dir, ensure_drafts

    zoo, spec = preset("micro"), ExtraDrafts("boost", count=2, pool_windows=48, boost_steps=10)
    paths = ensure_drafts(zoo, spec, cache=tmp_path)
    assert [p.name for p in paths] == ["draft_boost1", "draft_boost2"] and all(p.is_dir() for p in paths)
    import json

    report = json.loads((drafts_dir(zoo, spec, tmp_path) / "report.json").read_text())
    for rnd in report["rounds"]:  # the kept examples are the least covered of the pool
        assert rnd["kept_coverage"] <= rnd["pool_coverage"] and rnd["kept"] == round(0.4 * 48)
    assert ensure_drafts(zoo, spec, cache=tmp_path) == paths  # cached: no second build
    assert drafts_dir(zoo, ExtraDrafts("boost", count=3), tmp_path) != drafts_dir(zoo, spec, tmp_path)
