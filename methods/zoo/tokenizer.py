"""The zoo's byte-level BPE tokenizer (GPT-2 style), trained with `tokenizers` on the corpus' train split.

Byte-level: every string round-trips, whatever it contains. One special token, ``<|endoftext|>``, serves as
eos, bos and pad (as in GPT-2); training packs documents separated by it. Wrapped as a transformers
``PreTrainedTokenizerFast`` so ``AutoTokenizer.from_pretrained(dir)`` loads it like any hub tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with ``vocab_size`` entries (256 byte symbols + merges + the special token)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """A raw `tokenizers.Tokenizer` as a transformers tokenizer with eos = bos = pad = <|endoftext|>."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    tokenizer.save_pretrained(str(out_dir))


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added (the packer adds the separators). Calls the Rust
    tokenizer's batch encoder directly: parallel, and no warning about texts longer than the model."""
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
