"""benchmarks/eagle_ladder.py's budget rule against the drafter it sizes, and the verified-nodes count every
run reports (metrics.json ``verified_nodes_per_step``) against the trees the loop verified."""

from __future__ import annotations

import pytest
import torch

from benchmarks.eagle_ladder import dynamic_pool, dynamic_top_k
from methods.core.drafter import DraftContext
from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.metrics import AcceptStats
from methods.core.sampling import SamplingParams
from methods.drafters.eagle import Dynamic, EagleDrafter
from methods.heads.eagle.train import EagleTrainConfig, new_head
from specsim.tree import Tree

GREEDY = SamplingParams(temperature=0.0)


def _drafter(target, tree) -> EagleDrafter:
    head = new_head(target, EagleTrainConfig().head_config(target), seed=0).eval()
    return EagleDrafter(head, tree, GREEDY)


@pytest.mark.parametrize("top_k, depth", [(2, 3), (3, 3), (2, 4), (3, 2)])
def test_dynamic_pool_is_what_the_drafter_drafts_before_its_rerank(tiny_models, top_k, depth):
    """With room for every drafted node (total_tokens above the pool) the kept tree is the whole pool."""
    seq = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    out = ModelEngine(tiny_models.target).prefill(seq[:-1], hidden=True)
    d = _drafter(tiny_models.target, Dynamic(total_tokens=1000, depth=depth, top_k=top_k))
    d.reset(seq)
    draft = d.propose(DraftContext(seq, out.hidden, torch.Generator(), 50))
    assert draft.tree.size - 1 == dynamic_pool(top_k, depth)
    # and the ladder's top_k keeps the static k-ary tree's budget: a pool of at least N
    n = sum(2**i for i in range(1, depth + 1))
    k = dynamic_top_k(n, depth)
    d = _drafter(tiny_models.target, Dynamic(total_tokens=n, depth=depth, top_k=k))
    d.reset(seq)
    assert d.propose(DraftContext(seq, out.hidden, torch.Generator(), 50)).tree.size - 1 == n


def test_verified_nodes_per_step_counts_the_trees_the_target_verified(tiny_models):
    engine = ModelEngine(tiny_models.target)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (15,), generator=g)
    d = _drafter(tiny_models.target, Tree.kary(2, 3))
    sizes = []
    real = d.propose

    def spy(ctx):
        draft = real(ctx)
        sizes.append(draft.tree.size)
        return draft

    d.propose = spy
    res = decode(engine, d, prompt, DecodeOptions(max_new_tokens=24), g)
    assert res.stats.nodes == sum(sizes)
    assert res.stats.verified_nodes == pytest.approx(sum(sizes) / len(sizes))
    assert max(sizes) == 15 and res.stats.verified_nodes <= 15  # the length limit cuts the last trees
    both = AcceptStats()
    both.merge(res.stats)
    both.merge(res.stats)
    assert both.verified_nodes == res.stats.verified_nodes and AcceptStats().verified_nodes == 0.0
