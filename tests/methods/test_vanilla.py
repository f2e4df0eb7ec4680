"""The draft-model drafter (methods.drafters.vanilla): where its prompt prefill happens.

The loop times ``drafter.reset`` as prefill and ``propose`` / ``feedback`` as draft time, so the draft model's
pass over the prompt must happen in reset — else it is billed as drafting (decode_speedup, calibrated draft
cost). What each phase feeds the draft model is counted, not timed."""

from __future__ import annotations

import torch

from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.drafters.registry import build_drafter
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree


def _recording(drafter) -> list[tuple[str, int]]:
    """Wrap the drafter's phases and its engine's extend: (phase, tokens fed) per extend."""
    fed: list[tuple[str, int]] = []
    phase = ["outside"]
    extend = drafter.engine.extend

    def counted(ids, *args, **kwargs):
        fed.append((phase[0], int(ids.numel())))
        return extend(ids, *args, **kwargs)

    drafter.engine.extend = counted
    for name in ("reset", "propose", "feedback"):
        method = getattr(drafter, name)

        def wrapped(*args, _m=method, _n=name, **kwargs):
            phase[0] = _n
            try:
                return _m(*args, **kwargs)
            finally:
                phase[0] = "outside"

        setattr(drafter, name, wrapped)
    return fed


def test_draft_model_prefills_the_prompt_in_reset(tiny_models):
    sampling = SamplingParams(temperature=0.0)
    method = MethodConfig(name="vanilla", drafter="draft_model", verifier=Verifier.greedy)
    drafter = build_drafter(method, Tree.chain(3), tiny_models, sampling)
    fed = _recording(drafter)
    prompt = torch.arange(5, 17)  # 12 tokens
    engine = ModelEngine(tiny_models.target)
    for _ in range(2):  # a second prompt after the first: reset starts over
        out = decode(engine, drafter, prompt, DecodeOptions(Verifier.greedy, sampling, 9),
                     torch.Generator().manual_seed(0))
        assert len(out.token_ids) == 9
        assert fed[0] == ("reset", prompt.numel() - 1)  # x_1..x_{t-1}; the root comes with the first draft
        # a proposal feeds the committed tokens the draft has not read (at most the last accepted leaf and
        # the bonus) and then one token per level: never the prompt
        assert all(n <= 2 for phase, n in fed[1:]) and {phase for phase, _ in fed[1:]} == {"propose"}
        fed.clear()
