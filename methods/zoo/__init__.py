"""The embedded model zoo: a stdlib corpus, a byte-level BPE tokenizer, and Llama target (p) / draft (q)
models trained on it, cached on first use. ``ensure_zoo(name)`` returns the checkpoint directories."""

from methods.zoo.build import PRESETS, ZooConfig, ZooPaths, cache_root, ensure_zoo, preset, zoo_dir
from methods.zoo.corpus import Document, corpus
from methods.zoo.train import ModelSpec

__all__ = ["PRESETS", "Document", "ModelSpec", "ZooConfig", "ZooPaths", "cache_root", "corpus", "ensure_zoo",
           "preset", "zoo_dir"]
