"""Batched greedy decoding of equal-length prompts with a KV cache, for the zoo's own uses: the loop-rate
report and the sequence-level unlikelihood's rollouts during training.

A plain loop over the model's forward (HF's ``generate`` adds ~30% per token at these sizes: 48 tokens of
8 rows cost 0.29 s here against 0.38-0.47 s with ``generate`` on 2 cores, for the same tokens).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


@torch.no_grad()
def greedy_extend(model: PreTrainedModel, prompts: torch.Tensor, new_tokens: int, *,
                  banned: int | None = None) -> torch.Tensor:
    """``prompts`` (B, P) followed by ``new_tokens`` greedy tokens each: (B, P + new_tokens). ``banned``: a
    token id never chosen (e.g. eos, for continuations of a fixed length). Runs under the caller's
    autocast; the model's mode (train/eval) is left as it is."""
    cache = DynamicCache(config=model.config)
    ids, step = [], prompts
    for _ in range(new_tokens):
        logits = model(input_ids=step, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        if banned is not None:
            logits[:, banned] = float("-inf")
        step = logits.argmax(-1, keepdim=True)  # (B, 1)
        ids.append(step)
    return torch.cat([prompts, *ids], dim=1)
