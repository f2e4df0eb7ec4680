"""EAGLE head checkpoints in the published layouts (SafeAILab/EAGLE), which are also our cache's format.

A directory with ``config.json`` (Llama-style fields of the head) and ``model.safetensors`` (or
``pytorch_model.bin``). Weight names:
- EAGLE-1 (EAGLE / EAGLE-2 heads): ``fc.{weight,bias}`` (H, 2H: embedding first, then the feature), and one
  decoder layer ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.post_attention_layernorm.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight`` (no ``input_layernorm``: EAGLE-1 drops it); a bundled
  ``embed_tokens.weight`` is ignored (the target's embedding is used), except in vLLM's layout without
  ``fc.bias``, where it carries the folded bias (methods.heads.eagle.vllm_export).
- EAGLE-3: ``fc.weight`` (H, 3H), ``midlayer.input_layernorm.weight`` (the embedding's norm),
  ``midlayer.hidden_norm.weight``, ``midlayer.self_attn.*`` (q/k/v read 2H), ``midlayer.post_attention_
  layernorm.weight``, ``midlayer.mlp.*``, ``norm.weight``, ``lm_head.weight`` (Vd, H) and the vocabulary maps
  ``d2t`` (Vd,) (target id = draft id + d2t) and ``t2d`` (V,) bool (which target ids the draft covers).
  config.json: ``draft_vocab_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids`` (fused layers).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from methods.heads.eagle.head import EagleConfig, EagleHead

_LAYER = {  # our parameter → published name(s) (without the layer prefix); fused ones are split row-wise
    "qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj.weight": ("self_attn.o_proj.weight",),
    "post_norm": ("post_attention_layernorm.weight",),
    "gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj.weight": ("mlp.down_proj.weight",),
}
_EAGLE3 = {"embed_norm": ("midlayer.input_layernorm.weight",),
           "hidden_norm": ("midlayer.hidden_norm.weight",),
           "norm": ("norm.weight",), "lm_head": ("lm_head.weight",), "d2t": ("d2t",)}


def names(variant: str) -> dict[str, tuple[str, ...]]:
    """Our state-dict key → the published key(s) it is made of."""
    prefix = "layers.0." if variant == "eagle1" else "midlayer."
    out = {"fc.weight": ("fc.weight",), **{k: tuple(prefix + x for x in v) for k, v in _LAYER.items()}}
    if variant == "eagle1":
        out["fc.bias"] = ("fc.bias",)
    else:
        out.update(_EAGLE3)
    return out


def _split(ours: str, t: torch.Tensor, cfg: EagleConfig) -> list[torch.Tensor]:
    if ours == "qkv_proj.weight":
        n, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return list(t.split([n, kv, kv]))
    if ours == "gate_up_proj.weight":
        return list(t.chunk(2))
    return [t]


def published_tensors(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's weights under their published names (fused projections split row-wise, EAGLE-3's maps)."""
    c, state = head.cfg, head.state_dict()
    tensors = {}
    for ours, pubs in names(c.variant).items():
        t = state[ours].detach().cpu()
        for pub, part in zip(pubs, _split(ours, t, c)):
            tensors[pub] = (part if ours == "d2t" else part.float()).contiguous()
    if c.variant == "eagle3":
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[torch.arange(c.draft_vocab_size) + head.d2t.cpu()] = True
        tensors["t2d"] = t2d
    return tensors


def save_eagle(head: EagleHead, path: Path | str, meta: dict | None = None) -> Path:
    """Write ``head`` in its published layout (EAGLE-1 or EAGLE-3) plus our ``meta`` in config.json."""
    return write_checkpoint(path, published_tensors(head), _config(head.cfg, meta))


def write_checkpoint(path: Path | str, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _config(c: EagleConfig, meta: dict | None) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3" if c.variant == "eagle3" else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "hidden_act": "silu",
        "bias": c.variant == "eagle1",
        "specsim": meta or {},
    }
    if c.variant == "eagle3":
        config["draft_vocab_size"] = c.draft_vocab_size
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers)}
    return config


def _weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").exists():
        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path}: neither model.safetensors nor pytorch_model.bin")


def bias_from_embedding(w: dict[str, torch.Tensor], embed: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's fc bias of a head without one (vLLM's fc has none): b = W_e u where the bundled embedding
    is the target's shifted by u (the export folds the bias so), else zero (a head trained without bias)."""
    weight = w["fc.weight"].float()
    bundled = w.get("embed_tokens.weight")
    if bundled is None or bundled.shape != embed.shape:
        return torch.zeros(weight.shape[0])
    u = (bundled.double() - embed.double()).mean(0)  # every row carries the same shift
    return (weight[:, : embed.shape[1]].double() @ u).float()


def load_eagle(path: Path | str, target: PreTrainedModel) -> tuple[EagleHead, dict]:
    """A head from a published-layout directory, on ``target`` (its embedding, and EAGLE-1's LM head);
    returns (head, our meta from config.json or {}). The layout (EAGLE-1 or EAGLE-3) is read from the
    weights: ``midlayer.*`` means EAGLE-3."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    w = _weights(path)
    variant = "eagle3" if any(k.startswith("midlayer.") for k in w) else "eagle1"
    layers = tuple((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids", ()))
    if (config.get("specsim") or {}).get("aux_layer_ids") == "vllm":  # vLLM counts from the embeddings
        layers = tuple(i - 1 for i in layers)
    if variant == "eagle3" and not layers:
        raise ValueError(f"{path}: an EAGLE-3 head needs eagle_config.eagle_aux_hidden_state_layer_ids")
    draft_vocab = int(config.get("draft_vocab_size") or config["vocab_size"])
    cfg = EagleConfig.for_target(target, variant, layers, draft_vocab if variant == "eagle3" else None)
    if config["hidden_size"] != cfg.hidden_size or config["vocab_size"] != cfg.vocab_size:
        got = (config["hidden_size"], config["vocab_size"])
        raise ValueError(f"{path}: head for (hidden, vocab) = {got}, the target has "
                         f"({cfg.hidden_size}, {cfg.vocab_size})")
    embed = target.get_input_embeddings().weight.detach().float().cpu()
    lm = target.get_output_embeddings().weight.detach().float().cpu()
    head = EagleHead(cfg, embed, lm)
    if variant == "eagle3" and "d2t" not in w and draft_vocab == cfg.vocab_size:  # vLLM's layout: identity
        w["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    if variant == "eagle1" and "fc.bias" not in w and "fc.weight" in w:
        w["fc.bias"] = bias_from_embedding(w, embed)  # vLLM's layout (methods.heads.eagle.vllm_export)
    missing = {p for pubs in names(variant).values() for p in pubs} - set(w)
    if missing:
        raise ValueError(f"{path}: missing weights {sorted(missing)}")
    state = {ours: torch.cat([w[p] for p in pubs]) for ours, pubs in names(variant).items()}
    if variant == "eagle3":
        state["d2t"] = state["d2t"].long()
    head.load_state_dict(state)  # strict: every persistent tensor comes from the file
    return head.eval(), config.get("specsim", {})
