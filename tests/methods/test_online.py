"""Online speculative decoding (methods.drafters.online): the divergences, learning between requests (and
never inside one), the loop's offline time, and the stream workload."""

from __future__ import annotations

import math

import pytest
import torch

from methods.core.drafter import Draft, StepFeedback
from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.drafters.autoregressive import Autoregressive
from methods.drafters.online import divergence
from methods.drafters.registry import build_drafter
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd"])
def test_divergences_vanish_at_q_equal_p_and_match_their_definition(kind):
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(6, 11, generator=g), torch.randn(6, 11, generator=g) * 2
    assert float(divergence(p, p, kind)) == pytest.approx(0.0, abs=1e-6)
    P, Q = p.softmax(-1).double(), q.softmax(-1).double()
    kl = lambda a, b: (a * (a / b).log()).sum(-1).mean()  # noqa: E731
    M = (P + Q) / 2
    want = {"fkl": kl(P, Q), "rkl": kl(Q, P), "jsd": 0.5 * kl(P, M) + 0.5 * kl(Q, M)}[kind]
    assert float(divergence(p, q, kind)) == pytest.approx(float(want), rel=1e-4)
    if kind == "jsd":
        assert float(divergence(p, q, kind)) <= math.log(2) + 1e-6


def _drafter(models, **params):
    method = MethodConfig(name="online", drafter="online", verifier=Verifier.greedy,
                          params={"draft": "zoo", **params})
    return build_drafter(method, Tree.chain(3), models, GREEDY)


def _prompts(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (12,), generator=g) for _ in range(n)]


def test_the_draft_learns_between_requests_and_stays_lossless(tiny_models):
    """update_every=2: after requests 2 and 4 the draft is distilled (in reset, before the next request's
    first step); its weights change only then, the loss on the buffer falls, the output stays the target's
    greedy one, and the run's draft model is left untouched."""
    drafter = _drafter(tiny_models, update_every=2, steps=3, learning_rate=3e-4, mask="all")
    before = [p.detach().clone() for p in tiny_models.draft.parameters()]
    engine = ModelEngine(tiny_models.target)
    opts = DecodeOptions(Verifier.greedy, GREEDY, 24)
    g = torch.Generator().manual_seed(0)
    snapshots, offline = [], []
    for prompt in _prompts(5):
        ref = decode(engine, Autoregressive(), prompt, opts, g)
        res = decode(engine, drafter, prompt, opts, g)
        assert res.token_ids == ref.token_ids
        offline.append(res.time_offline_s)
        snapshots.append(next(drafter.model.parameters()).detach().clone())
    assert [u["after_request"] for u in drafter.updates] == [2, 4]
    assert all(u["loss_last"] < u["loss_first"] for u in drafter.updates)
    changed = [not torch.equal(a, b) for a, b in zip(snapshots, snapshots[1:])]
    assert changed == [False, True, False, True]  # requests 3 and 5 began with a new draft
    assert offline[0] == offline[1] == 0.0 and offline[2] > 0 and offline[4] > 0
    assert sum(offline) == pytest.approx(drafter.offline_seconds)
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_models.draft.parameters()))


def test_wrong_mask_keeps_the_last_accepted_node_with_children(tiny_models):
    drafter = _drafter(tiny_models, update_every=0)
    prompt = torch.tensor([3, 4, 5])
    drafter.reset(prompt)
    draft = Draft(Tree.chain(3), torch.tensor([5, 6, 7, 8]))
    drafter.inner.feedback = lambda fb: None  # no draft cache here: only the buffer is under test
    drafter._root_index = 2
    drafter._current.tokens = prompt
    logits = torch.randn(4, tiny_models.target.config.vocab_size)
    drafter.feedback(StepFeedback(draft, (0, 1), 9, logits))  # node 1 accepted, its child 2 rejected
    assert drafter._current.positions == [3]  # the position after node 1 (index 2 + 1)
    torch.testing.assert_close(drafter._current.logits[0], logits[1])
    assert drafter._current.tokens.tolist() == [3, 4, 5, 6]
    drafter.feedback(StepFeedback(draft, (0, 1, 2, 3), 9, logits))  # all accepted: a leaf, nothing wrong
    assert drafter._current.positions == [3]


def test_static_control_never_trains(tiny_models):
    drafter = _drafter(tiny_models, update_every=0)
    engine = ModelEngine(tiny_models.target)
    for prompt in _prompts(3):
        decode(engine, drafter, prompt, DecodeOptions(Verifier.greedy, GREEDY, 12), torch.Generator())
    assert drafter.updates == [] and drafter.offline_seconds == 0.0


def test_stream_workload_is_code_requests_none_repeated():
    from methods.data.corpus import corpus
    from methods.data.workloads import load_prompts
    from methods.zoo.tokenizer import train_tokenizer
    from specsim.config import WorkloadConfig

    tok = train_tokenizer([d.text for d in corpus("train")[:20]], vocab_size=400)
    w = WorkloadConfig(name="stream", kind="stream", num_prompts=24, prompt_tokens=48)
    prompts = load_prompts(w, tok, seed=0)
    assert len({p.prompt_id for p in prompts}) == 24 and {p.kind for p in prompts} == {"code"}
    assert [p.prompt_id for p in load_prompts(w, tok, seed=0)] == [p.prompt_id for p in prompts]


def test_a_drafter_built_under_inference_mode_still_learns(tiny_models):
    """A calibration builds the drafter (and may load its draft) under inference_mode: the drafter's own copy
    must still take in-place updates, and the decoding engine must see them."""
    import copy

    with torch.inference_mode():
        models = copy.copy(tiny_models)
        models.draft = copy.deepcopy(tiny_models.draft)  # inference tensors, as a model loaded here has
        assert next(models.draft.parameters()).is_inference()
        drafter = _drafter(models, update_every=1, steps=2, learning_rate=3e-4, mask="all")
    engine = ModelEngine(tiny_models.target)
    opts = DecodeOptions(Verifier.greedy, GREEDY, 16)
    g = torch.Generator().manual_seed(0)
    first, second = _prompts(2)
    decode(engine, drafter, first, opts, g)
    before = next(drafter.model.parameters()).detach().clone()
    decode(engine, drafter, second, opts, g)  # reset distils the first request's data
    assert len(drafter.updates) == 1
    assert not torch.equal(before, next(drafter.model.parameters()))
