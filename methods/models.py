"""Loading the target p and the draft q (Hugging Face causal LMs) for real decoding.

Sources (``ModelConfig.source``): ``random`` (random-init Llama from the config's dimensions plus a byte-level
tokenizer that needs no training: built in about a second, for tests and smoke runs), ``zoo`` (the embedded
checkpoints of ``methods.zoo``), ``hub`` / ``local`` (``from_pretrained`` on a path or an already-downloaded
hub name; nothing is ever downloaded). Attention is SDPA; the engine passes float 4D additive masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from methods.core.bf16 import speed_dtype
from methods.core.engine import context_length  # noqa: F401  (re-exported)
from specsim.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BYTE_SPECIALS = ("<bos>", "<eos>", "<pad>")  # ids 256, 257, 258: byte b has id b


@dataclass
class Models:
    """The loaded pair. ``draft`` is None for methods without a separate draft model."""

    target: PreTrainedModel
    draft: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype


def resolve_device(device: str) -> torch.device:
    """``auto`` → cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype by name; ``auto`` is bfloat16 where this device's bf16 products are fast, else float32
    (``methods.core.bf16``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return _DTYPES[speed_dtype("bfloat16", device)]
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: allowed {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_models(model_cfg: ModelConfig, device: str = "auto", dtype: str = "float32") -> Models:
    """Load target (+ draft when the config names one) and tokenizer, in eval mode on ``device``."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if model_cfg.source == "random":
        target, draft, tok = _random_models(model_cfg)
    elif model_cfg.source == "zoo":
        from methods.zoo import ensure_zoo  # imported lazily: builds (trains) the zoo on first use

        paths = ensure_zoo(model_cfg.zoo)
        target, tok = _pretrained(str(paths.target_dir)), _tokenizer(str(paths.tokenizer_dir))
        draft = _pretrained(str(paths.draft_dir)) if model_cfg.draft_n_layers > 0 else None
    elif model_cfg.source in ("hub", "local"):
        if not model_cfg.path:
            raise ValueError(f"model.path is required for model.source={model_cfg.source}")
        target, tok = _pretrained(model_cfg.path), _tokenizer(model_cfg.path)
        draft = _pretrained(model_cfg.draft_path) if model_cfg.draft_path else None
    else:
        raise ValueError(f"model.source={model_cfg.source!r}: allowed zoo, random, hub, local")
    target = target.to(device=dev, dtype=dt).eval()
    draft = draft.to(device=dev, dtype=dt).eval() if draft is not None else None
    if draft is not None and draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft vocab {draft.config.vocab_size} != target vocab {target.config.vocab_size}: "
            "the draft must share the target's tokenizer"
        )
    return Models(target=target, draft=draft, tokenizer=tok, device=dev, dtype=dt)


def _pretrained(path: str) -> PreTrainedModel:
    try:
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation="sdpa")
    except OSError as err:
        where = "directory" if Path(path).exists() else "name (not a local directory, not in the HF cache)"
        raise OSError(
            f"cannot load model {path!r} from this {where}: specsim never downloads weights. Download it "
            f"beforehand (e.g. `huggingface-cli download {path}`) or point model.path at a local checkpoint."
        ) from err


def _tokenizer(path: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except OSError as err:
        raise OSError(f"cannot load the tokenizer of {path!r} locally (specsim never downloads)") from err


# ---- random models ------------------------------------------------------------------------------------
def byte_tokenizer(vocab_size: int = 259) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with no merges: byte b ↦ id b, then <bos>, <eos>, <pad>; ids up to ``vocab_size``
    are filler special tokens so that every id a random model emits decodes (to nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < 256 + len(BYTE_SPECIALS):
        raise ValueError(f"a byte tokenizer needs vocab_size >= {256 + len(BYTE_SPECIALS)}, got {vocab_size}")
    vocab = {ch: b for b, ch in enumerate(_bytes_to_unicode())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"})
    filler = [f"<extra_{i}>" for i in range(vocab_size - len(fast))]
    if filler:
        fast.add_tokens(filler, special_tokens=True)
    assert len(fast) == vocab_size and fast.eos_token_id == 257, (len(fast), fast.eos_token_id)
    return fast


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in character for each byte 0..255 (the ByteLevel pre-tokenizer's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def random_llama(cfg: ModelConfig, draft: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """A random-init Llama with the config's dimensions (``draft=True``: the draft's layers/width)."""
    hidden = cfg.draft_hidden_size if draft else cfg.hidden_size
    heads = _divisor_heads(hidden, cfg.n_heads) if draft else cfg.n_heads
    kv_heads = heads if draft else cfg.n_kv_heads
    llama_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=hidden,
        intermediate_size=(hidden * 8) // 3 if draft else cfg.intermediate_size,
        num_hidden_layers=cfg.draft_n_layers if draft else cfg.n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=cfg.context_length,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(llama_cfg)


def _divisor_heads(hidden: int, at_most: int) -> int:
    """Most heads ≤ at_most that split ``hidden`` into even head dims (rotary needs even)."""
    return next(h for h in range(min(at_most, hidden), 0, -1) if hidden % h == 0 and (hidden // h) % 2 == 0)


def _random_models(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedModel | None, PreTrainedTokenizerFast]:  # noqa: E501
    target = random_llama(cfg, draft=False, seed=0)
    draft = random_llama(cfg, draft=True, seed=1) if cfg.draft_n_layers > 0 else None
    return target, draft, byte_tokenizer(cfg.vocab_size)
