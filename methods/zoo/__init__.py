"""The embedded model zoo: a stdlib corpus, a byte-level BPE tokenizer, and Llama target (p) / draft (q)
models trained on it, cached on first use. ``ensure_zoo(name)`` returns the checkpoint directories.

The corpus lives in ``methods.data.corpus`` (not re-exported here: its ``corpus`` function would shadow the
submodule of the same name)."""

from methods.zoo.build import PRESETS, ZooConfig, ZooPaths, cache_root, ensure_zoo, preset, zoo_dir
from methods.zoo.train import ModelSpec, Windows

__all__ = ["PRESETS", "ModelSpec", "Windows", "ZooConfig", "ZooPaths", "cache_root", "ensure_zoo", "preset",
           "zoo_dir"]
