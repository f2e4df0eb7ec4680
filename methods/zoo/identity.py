"""Cache keys of things built from a model on first use (zoo variants, heads, searches): a cheap fingerprint
of the model's weights, and a short hash of a JSON key document."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from transformers import PreTrainedModel


def weights_fingerprint(model: PreTrainedModel, sample: int, length: int) -> str:
    """Names, shapes and the first/last ``sample`` values of every tensor, rounded to bf16 so a checkpoint
    loaded in fp32 or bf16 has one identity; the digest's first ``length`` hex characters."""
    digest = hashlib.sha256()
    for name, w in model.state_dict().items():
        flat = w.detach().reshape(-1)
        values = torch.cat([flat[:sample], flat[-sample:]]).to("cpu", torch.bfloat16).view(torch.int16)
        digest.update(f"{name}{tuple(w.shape)}".encode())
        digest.update(values.numpy().tobytes())
    return digest.hexdigest()[:length]


def doc_key(doc: dict[str, Any], length: int) -> str:
    """The first ``length`` hex characters of the SHA-256 of ``doc`` as sorted JSON."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:length]
