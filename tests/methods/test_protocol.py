"""Protocol extensions every method may use (methods.core.drafter): features of several decoder layers,
draft nodes that are computed but never verifiable, and the target's logits in the feedback. The loop pays
for none of them unless a drafter asks."""

from __future__ import annotations

import pytest
import torch

from methods.core.drafter import Draft, DraftContext, StepFeedback
from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode, kept_nodes, limit_depth, verification_draft
from methods.core.sampling import SamplingParams
from methods.drafters.autoregressive import Autoregressive
from specsim.tree import Tree, subtree

GREEDY = DecodeOptions(sampling=SamplingParams(temperature=0.0), max_new_tokens=20)


@pytest.mark.parametrize("fast", [True, False], ids=["lean", "hf"])
def test_features_are_hf_hidden_states_of_the_asked_layers(tiny_target, fast):
    ids = torch.tensor([3, 14, 15, 92, 65, 35, 89])
    with torch.inference_mode():
        ref = tiny_target(ids[None], output_hidden_states=True).hidden_states  # (embeddings, layer 0, ...)
    engine = ModelEngine(tiny_target, fast=fast)
    pre = engine.prefill(ids[:4], layers=(1, 0))
    tree = Tree.chain(2)
    out = engine.forward_tree(ids[4:], tree, layers=(0, 1))
    h = tiny_target.config.hidden_size
    torch.testing.assert_close(pre.features[:, :h], ref[2][0, :4], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pre.features[:, h:], ref[1][0, :4], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.features, torch.cat([ref[1][0, 4:], ref[2][0, 4:]], -1), atol=1e-5,
                               rtol=1e-4)
    engine.drop_pending()
    assert engine.forward_tree(ids[4:], tree).features is None  # not asked, not computed


class _Lookahead:
    """A drafter whose tree has a verifiable chain (the target's greedy guess, made from the last step's
    unverifiable node) and one unverifiable node; it records what the loop shows it."""

    needs_hidden_states = False
    feature_layers = (0,)

    def __init__(self):
        self.guess: int | None = None
        self.seen: list[StepFeedback] = []
        self.contexts: list[DraftContext] = []

    def reset(self, prompt):
        self.guess = None

    def propose(self, ctx):
        self.contexts.append(ctx)
        root = int(ctx.tokens[-1])
        guess = self.guess if self.guess is not None else root
        # node 1: a verifiable guess; node 2: unverifiable child of the root with a deliberately wrong token
        tokens = torch.tensor([root, guess, (guess + 1) % 256])
        return Draft(Tree.from_parents([-1, 0, 0]), tokens, None, n_verifiable=2)

    def feedback(self, fb):
        self.seen.append(fb)
        self.guess = int(fb.logits[fb.accepted[-1]].argmax())


def test_unverifiable_nodes_are_never_accepted_and_greedy_is_exact(tiny_target):
    prompt = torch.tensor([5, 17, 99, 4, 61])
    ref = decode(ModelEngine(tiny_target), Autoregressive(), prompt, GREEDY, torch.Generator())
    drafter = _Lookahead()
    got = decode(ModelEngine(tiny_target), drafter, prompt, GREEDY, torch.Generator())
    assert got.token_ids == ref.token_ids
    assert drafter.seen and all(2 not in fb.accepted for fb in drafter.seen)
    assert all(fb.logits.shape == (3, tiny_target.config.vocab_size) for fb in drafter.seen)
    assert max(got.accepted_lengths) == 2  # the verifiable guess is accepted at times


def test_features_reach_the_drafter_for_committed_tokens(tiny_target):
    prompt = torch.tensor([5, 17, 99, 4, 61])
    drafter = _Lookahead()
    decode(ModelEngine(tiny_target), drafter, prompt, GREEDY, torch.Generator())
    first, second = drafter.contexts[0], drafter.contexts[1]
    h = tiny_target.config.hidden_size
    assert first.features.shape == (4, h)  # the prefill: x_1..x_{t-1}
    accepted = len(drafter.seen[0].accepted)
    assert second.features.shape == (accepted, h) and second.hidden is None


def test_verification_draft_and_depth_limit_keep_the_verifiable_prefix():
    tree = Tree.from_parents([-1, 0, 1, 0, 3, 4])
    draft = Draft(tree, torch.arange(6), None, n_verifiable=3)
    checked = verification_draft(draft)
    assert checked.tree.parents == (-1, 0, 1) and checked.tokens.tolist() == [0, 1, 2]
    limited = limit_depth(draft, 1)  # keeps nodes 0, 1, 3: two of them verifiable
    assert limited.n_verifiable == 2 and limited.tokens.tolist() == [0, 1, 3]
    assert verification_draft(Draft(tree, torch.arange(6))).tree is tree
    with pytest.raises(AssertionError, match="n_verifiable"):
        Draft(tree, torch.arange(6), None, n_verifiable=0)


def test_kept_nodes_drop_whole_subtrees():
    """Hand-built tree: 0 → {1, 2}, 1 → {3, 4}, 2 → {5}, 3 → {6}. Dropping 1 drops 3, 4, 6; dropping 5 drops
    only 5; the root stays whatever ``ok`` says."""
    tree = Tree.from_parents([-1, 0, 0, 1, 1, 2, 3])
    assert kept_nodes(tree, [True] * 7) == list(range(7))
    assert kept_nodes(tree, [False, False, True, True, True, True, True]) == [0, 2, 5]
    assert kept_nodes(tree, [True, True, True, True, True, False, True]) == [0, 1, 2, 3, 4, 6]
    pruned = subtree(tree, kept_nodes(tree, [True, True, True, False, True, True, True]))
    assert pruned.parents == (-1, 0, 0, 1, 2)
