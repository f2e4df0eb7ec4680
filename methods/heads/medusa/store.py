"""Trained Medusa heads, built on first use and cached like the zoo (Cai et al., 2024; p = target, q = heads).

Key = hash of (the target's identity, the tokenizer's vocabulary size, the TrainConfig). The entry lives in
``<cache root>/medusa/<key>/``: ``heads/`` (our checkpoint layout, with the measured accuracy table in its
metadata), ``target/`` (Medusa-2 only: the jointly trained target) and ``report.json`` (training time,
per-head top-1/top-5 accuracies on the test split). Built in a temp directory under a file lock, then renamed:
concurrent runs wait for one build, and a crash never leaves a half entry.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from methods.heads.medusa.checkpoint import save_heads
from methods.heads.medusa.train import TrainConfig, greedy_continuations, head_accuracy, sample_windows, train
from methods.zoo.identity import doc_key, weights_fingerprint

VERSION = 1  # bump when training or evaluation changes meaningfully (invalidates cached heads)


@dataclass(frozen=True)
class BuiltMedusa:
    root: Path
    heads_dir: Path
    target_dir: Path | None  # Medusa-2's target
    accuracy: np.ndarray  # (K, R) per-rank accuracy on greedy continuations of test prompts (tree input)
    report: dict


@dataclass(frozen=True)
class EvalConfig:
    windows: int = 32  # test-split windows (teacher-forced accuracy)
    prompts: int = 16  # test prompts continued greedily (decoding-time accuracy, Medusa's way)
    prompt_len: int = 64
    new_tokens: int = 96
    ranks: int = 10
    train_chars: int = 1_500_000  # corpus subset tokenized for training (windows are drawn from it)
    test_chars: int = 500_000


def target_identity(model: PreTrainedModel) -> str:
    """Cheap fingerprint of a model's weights (methods.zoo.identity): the first/last 4096 values of each."""
    return weights_fingerprint(model, 4096, 24)


def head_key(version: int, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, train: dict,
             ev: dict | None = None) -> str:
    """Cache key of modules trained on ``target`` (Medusa, EAGLE, MTP): their format version, the target's
    identity and vocabulary, the training recipe and (where one is stored) the evaluation settings."""
    doc = {"v": version, "target": target_identity(target), "vocab": len(tokenizer), "train": train}
    if ev is not None:
        doc["eval"] = ev
    return doc_key(doc, 20)


def build_once(entry: Path, build: Callable[[Path], None]) -> None:
    """``build(entry)`` unless ``entry/report.json`` exists; under a file lock, so two processes build it
    once. Training needs autograd even when the caller runs under inference_mode (a calibration or a
    measure run building its drafter)."""
    if (entry / "report.json").exists():
        return
    entry.parent.mkdir(parents=True, exist_ok=True)
    with _lock(entry.with_suffix(".lock")):
        if not (entry / "report.json").exists():  # another process may have built it meanwhile
            with torch.inference_mode(False), torch.enable_grad():
                build(entry)


def cache_key(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: TrainConfig, ev: EvalConfig
) -> str:
    return head_key(VERSION, model, tokenizer, cfg.to_dict(), ev.__dict__)


def ensure_medusa(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: TrainConfig,
    ev: EvalConfig | None = None,
    cache_root: Path | None = None,
) -> BuiltMedusa:
    """Cached heads for this target (trained on the corpus's train split, measured on its test split)."""
    ev = ev or EvalConfig()
    root = Path(cache_root) if cache_root is not None else _cache_root()
    entry = root / "medusa" / cache_key(target, tokenizer, cfg, ev)
    build_once(entry, lambda path: _build(target, tokenizer, cfg, ev, path))
    report = json.loads((entry / "report.json").read_text())
    target_dir = entry / "target" if (entry / "target").exists() else None
    return BuiltMedusa(entry, entry / "heads", target_dir, np.asarray(report["accuracy_generated"]), report)


def _build(target, tokenizer, cfg: TrainConfig, ev: EvalConfig, entry: Path) -> None:
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    train_tokens = corpus_tokens(tokenizer, "train", ev.train_chars, cfg.seed)
    result = train(target, train_tokens, cfg)
    tuned = result.target if result.target is not None else target
    test_tokens = corpus_tokens(tokenizer, "test", ev.test_chars, cfg.seed)
    t0 = time.perf_counter()
    report = evaluate(tuned, result.heads, test_tokens, ev, cfg.seed)
    report.update(
        train_seconds=round(result.seconds, 2),
        eval_seconds=round(time.perf_counter() - t0, 2),
        medusa=2 if cfg.joint else 1,
        config=cfg.to_dict(),
        train_tokens=int(train_tokens.numel()),
        loss_first=result.losses[0] if result.losses else None,
        loss_last=result.losses[-1] if result.losses else None,
        loss_curve=[round(x, 4) for x in result.losses[::10]],
        target=target_identity(target),
        loadavg_1min=os.getloadavg()[0],  # the machine is shared: times depend on it
    )
    if result.target is not None:
        report["target_drift"] = target_drift(target, result.target, test_tokens, ev, cfg.seed)
    save_heads(
        result.heads, tmp / "heads", meta={"accuracy": report["accuracy_generated"], "train": cfg.to_dict()}
    )
    if result.target is not None:
        result.target.save_pretrained(tmp / "target")
    (tmp / "report.json").write_text(json.dumps(report, indent=1))
    os.replace(tmp, entry)
    if result.target is not None:
        # Medusa-2's drafter loads the tuned weights into the run's target; a later lookup keyed by that
        # (tuned) target must find this entry rather than train Medusa-2 again on top of it
        alias = entry.parent / cache_key(result.target, tokenizer, cfg, ev)
        if not alias.exists():
            os.symlink(entry.name, alias)


def evaluate(target: PreTrainedModel, heads, tokens: torch.Tensor, ev: EvalConfig, seed: int = 0) -> dict:
    """Per-rank accuracy tables on the test stream: teacher-forced windows, and greedy continuations of
    test prompts (what decoding sees; the tree is built from this one). Top-k = cumulative sums."""
    g = torch.Generator().manual_seed(seed + 12345)
    heads = heads.to(target.device)
    windows = sample_windows(tokens, ev.windows, min(256, tokens.numel() - 1), g)
    forced = head_accuracy(target, heads, windows, 0, ev.ranks)
    prompts = sample_windows(tokens, ev.prompts, ev.prompt_len, g)
    continued = greedy_continuations(target, prompts, ev.new_tokens)
    generated = head_accuracy(target, heads, continued, ev.prompt_len, ev.ranks)

    def topk(acc: np.ndarray, k: int) -> list[float]:
        return [round(float(x), 4) for x in acc[:, :k].sum(1)]

    return {
        "accuracy_forced": forced.round(5).tolist(),
        "accuracy_generated": generated.round(5).tolist(),
        "top1_forced": topk(forced, 1),
        "top5_forced": topk(forced, 5),
        "top1_generated": topk(generated, 1),
        "top5_generated": topk(generated, 5),
    }


@torch.no_grad()
def target_drift(
    original: PreTrainedModel, tuned: PreTrainedModel, tokens: torch.Tensor, ev: EvalConfig, seed: int = 0
) -> dict:
    """What Medusa-2 did to the target: held-out perplexity before/after and greedy-token agreement."""
    windows = sample_windows(
        tokens, ev.windows, min(256, tokens.numel() - 1), torch.Generator().manual_seed(seed)
    )
    out = {}
    for name, model in (("original", original), ("tuned", tuned)):
        logits = model(input_ids=windows.to(model.device)).logits.float().cpu()  # (B, T, V)
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
        out[f"ppl_{name}"] = round(float(ce.exp()), 3)
        out[f"_argmax_{name}"] = logits.argmax(-1)
    agree = (out.pop("_argmax_original") == out.pop("_argmax_tuned")).float().mean()
    return {**out, "greedy_agreement": round(float(agree), 4)}


# ---- the zoo's corpus and cache root -------------------------------------------------------------------
def corpus_tokens(
    tokenizer: PreTrainedTokenizerBase, split: str, max_chars: int, seed: int = 0
) -> torch.Tensor:
    """A seeded random subset of the embedded corpus split (stdlib modules: source with its docstrings and
    comments) of about ``max_chars`` characters, as one 1-D stream packed like the zoo's training data:
    each document preceded by EOS."""
    from methods.data.corpus import corpus

    docs = corpus(split, "code")
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    texts, total = [], 0
    for i in order:
        if total >= max_chars:
            break
        texts.append(docs[i].text)
        total += len(docs[i].text)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = [eos + row for row in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return torch.tensor([t for row in ids for t in row], dtype=torch.long)


def _cache_root() -> Path:
    from methods.zoo import cache_root

    return Path(cache_root())


@contextmanager
def _lock(path: Path):
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
