"""Saving and loading Medusa heads (Cai et al., 2024) in two layouts.

Ours: a directory with ``heads.safetensors`` (MedusaHeads state dict) and ``medusa.json`` (format tag, the
HeadsConfig, and free-form metadata: target identity, training settings, measured per-head accuracies).
Published (FasterDecoding/Medusa): a directory with ``config.json`` (medusa_num_heads, medusa_num_layers,
base_model_name_or_path) and ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``, a state dict of an
``nn.ModuleList`` of heads: ``{k}.{j}.linear.weight/bias`` for the j-th ResBlock, ``{k}.{L}.weight`` for the
projection. Head shapes are read from the tensors: Medusa's own loader notes uploaded configs that name
more heads than the file holds, so config.json is metadata here, not the source of truth.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from methods.heads.medusa.heads import HeadsConfig, MedusaHeads

FORMAT = "specsim-medusa-heads"
OURS_WEIGHTS, OURS_META = "heads.safetensors", "medusa.json"
PUBLISHED_CONFIG = "config.json"
PUBLISHED_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


@dataclass
class LoadedHeads:
    heads: MedusaHeads
    layout: str  # "ours" | "published"
    meta: dict[str, Any] = field(default_factory=dict)


def save_heads(heads: MedusaHeads, directory: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write our layout into ``directory`` (created). Files are written to temp names and renamed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    _atomic(directory / OURS_WEIGHTS, lambda p: save_file(state, str(p)))
    doc = {"format": FORMAT, "version": 1, "heads": heads.cfg.to_dict(), "meta": meta or {}}
    _atomic(directory / OURS_META, lambda p: p.write_text(json.dumps(doc, indent=1)))
    return directory


def save_published(heads: MedusaHeads, directory: str | Path, base_model: str = "") -> Path:
    """Write the published layout (heads-only safetensors + config.json), e.g. to share with Medusa's code."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        k.removeprefix("heads."): v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()
    }
    _atomic(directory / PUBLISHED_WEIGHTS[0], lambda p: save_file(state, str(p)))
    config = {
        "medusa_num_heads": heads.cfg.num_heads,
        "medusa_num_layers": heads.cfg.num_layers,
        "base_model_name_or_path": base_model,
    }
    _atomic(directory / PUBLISHED_CONFIG, lambda p: p.write_text(json.dumps(config, indent=1)))
    return directory


def load_heads(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> LoadedHeads:
    """Load either layout (ours is recognised by ``medusa.json``)."""
    directory = Path(directory)
    if (directory / OURS_META).exists():
        doc = json.loads((directory / OURS_META).read_text())
        assert doc.get("format") == FORMAT, f"{directory / OURS_META}: not a {FORMAT} file"
        heads = MedusaHeads(HeadsConfig(**doc["heads"]))
        heads.load_state_dict(load_file(str(directory / OURS_WEIGHTS)))
        return LoadedHeads(_place(heads, device, dtype), "ours", doc.get("meta", {}))
    return _load_published(directory, device, dtype)


def _load_published(directory: Path, device: str | torch.device, dtype: torch.dtype | None) -> LoadedHeads:
    files = [directory / name for name in PUBLISHED_WEIGHTS if (directory / name).exists()]
    if not files:
        raise FileNotFoundError(
            f"{directory}: no {OURS_META} (our layout) nor {' / '.join(PUBLISHED_WEIGHTS)} (published layout)"
        )
    path = files[0]
    if path.suffix == ".safetensors":
        state = load_file(str(path))
    else:  # weights_only: a .pt state dict must not run code on load
        state = torch.load(path, map_location="cpu", weights_only=True)
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}  # full-model dumps carry a prefix
    cfg = _infer_config(state, path)
    heads = MedusaHeads(cfg)
    heads.load_state_dict({f"heads.{k}": v for k, v in state.items() if _KEY.match(k)})
    config_path = directory / PUBLISHED_CONFIG
    meta: dict[str, Any] = {"source": str(path)}
    if config_path.exists():
        meta["config"] = json.loads(config_path.read_text())
    return LoadedHeads(_place(heads, device, dtype), "published", meta)


def _infer_config(state: dict[str, torch.Tensor], path: Path) -> HeadsConfig:
    """Number of heads/layers and (V, H) from the keys and the projection's shape."""
    parsed = [m.groups() for m in map(_KEY.match, state) if m]
    assert parsed, f"{path}: no keys of the form '{{k}}.{{j}}.linear.weight' / '{{k}}.{{L}}.weight'"
    heads = sorted({int(k) for k, _, _ in parsed})
    assert heads == list(range(len(heads))), f"{path}: head indices {heads} are not 0..K-1"
    proj = {int(k): int(j) for k, j, kind in parsed if kind == "weight"}
    assert set(proj) == set(heads), f"{path}: heads {sorted(set(heads) - set(proj))} have no projection"
    layers = set(proj.values())
    assert len(layers) == 1, f"{path}: heads have different numbers of ResBlocks {sorted(layers)}"
    vocab, hidden = state[f"0.{proj[0]}.weight"].shape
    return HeadsConfig(
        num_heads=len(heads), num_layers=layers.pop(), hidden_size=int(hidden), vocab_size=int(vocab)
    )


def _place(heads: MedusaHeads, device: str | torch.device, dtype: torch.dtype | None) -> MedusaHeads:
    return heads.to(device=device, dtype=dtype).eval()


def _atomic(path: Path, write) -> None:
    """Write through a temp file in the same directory, then rename (readers never see half a file)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
