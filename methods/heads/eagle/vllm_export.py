"""EAGLE heads written in the layout vLLM loads (its llama_eagle / llama_eagle3 models), p = target, q = head.

Our published layout (methods.heads.eagle.checkpoint) differs from what vLLM's loaders accept in two ways:
- EAGLE-1: vLLM's ``fc`` has no bias. fc(e ++ h) + b = W_e (e + u) + W_h h where W_e u = b (W_e: the
  embedding's H × H block of fc), so the bias is folded into a bundled embedding table E + u; vLLM keeps a
  draft's own ``embed_tokens`` when it differs from the target's. Exact where W_e is invertible (the solve's
  relative residual is returned); our loader recovers b = W_e u.
- EAGLE-3: a full draft vocabulary is written without the d2t / t2d maps (vLLM refuses them then).
  vLLM's ``eagle_aux_hidden_state_layer_ids`` count the residual stream entering decoder layer k
  (k = 0: the embeddings), i.e. the output of our (0-based) layer k - 1: the ids written are ours + 1, and
  ``specsim.aux_layer_ids: vllm`` tells our loader so. Our top layer is the target's last hidden state after
  the final norm (HF's convention); vLLM taps it before the norm, so a head fusing the top layer exports
  inexactly (``exact`` False): train one on lower layers (e.g. feature_layers [0, 2, 4] on 6 layers).
vLLM drafts EAGLE as a chain of ``num_speculative_tokens`` on its CPU build.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from methods.heads.eagle.checkpoint import _config, published_tensors, write_checkpoint
from methods.heads.eagle.head import EagleHead


@dataclass(frozen=True)
class Exported:
    path: Path
    exact: bool  # vLLM computes what our head computes (up to its dtype)
    fold_residual: float  # EAGLE-1: |W_e u - b| / |b| of the bias fold (0 for EAGLE-3)
    aux_layer_ids: tuple[int, ...]  # EAGLE-3: the ids vLLM reads (ours + 1)


def fold_bias(fc_weight: torch.Tensor, bias: torch.Tensor, hidden: int) -> tuple[torch.Tensor, float]:
    """u with W_e u = b (least squares, float64) and the relative residual of the solve."""
    w_e, b = fc_weight[:, :hidden].double(), bias.double()
    u = torch.linalg.lstsq(w_e, b[:, None]).solution[:, 0]
    residual = float((w_e @ u - b).norm() / b.norm().clamp_min(1e-30))
    return u, residual


def vllm_tensors(head: EagleHead) -> tuple[dict[str, torch.Tensor], float]:
    """The head's weights as vLLM loads them, and the EAGLE-1 bias fold's residual."""
    tensors = published_tensors(head)
    if head.cfg.variant != "eagle1":
        if head.cfg.draft_vocab_size == head.cfg.vocab_size and not head.d2t.any():
            del tensors["d2t"], tensors["t2d"]  # vLLM has no vocabulary map for a full draft vocabulary
        return tensors, 0.0
    bias = tensors.pop("fc.bias")
    u, residual = fold_bias(tensors["fc.weight"], bias, head.cfg.hidden_size)
    tensors["embed_tokens.weight"] = (head.embed.detach().cpu().double() + u).float().contiguous()
    return tensors, residual


def export_for_vllm(head: EagleHead, path: Path | str, n_target_layers: int, meta: dict | None = None
                    ) -> Exported:
    """Write ``head`` for vLLM's ``speculative_config={"method": "eagle"|"eagle3", "model": path}``."""
    c = head.cfg
    tensors, residual = vllm_tensors(head)
    ids = tuple(i + 1 for i in c.feature_layers) if c.variant == "eagle3" else ()
    exact = residual < 1e-4 and (n_target_layers - 1) not in c.feature_layers
    config = _config(c, {**(meta or {}), "aux_layer_ids": "vllm", "vllm_exact": exact})
    config["bias"] = False
    if c.variant == "eagle3":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
    write_checkpoint(path, tensors, config)
    return Exported(Path(path), exact, residual, ids)


def export_once(head: EagleHead, path: Path, n_target_layers: int, meta: dict | None = None) -> Path:
    """The export at ``path``, written once (to a temporary directory, then renamed: concurrent runs)."""
    if (path / "config.json").exists():
        return path
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    export_for_vllm(head, tmp, n_target_layers, meta)
    try:
        os.replace(tmp, path)
    except OSError:  # another run renamed its copy first
        shutil.rmtree(tmp, ignore_errors=True)
    return path
