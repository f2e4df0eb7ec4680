"""Trained EAGLE heads, built on first use and cached next to the zoo (p = target, q = head).

Key = hash of (the target's identity, the tokenizer's vocabulary size, the EagleTrainConfig, the evaluation
settings). The entry ``<cache root>/eagle/<key>/`` holds ``head/`` (the published EAGLE / EAGLE-3 layout,
methods.heads.eagle.checkpoint) and ``report.json`` (training time, loss curve, held-out top-1 accuracy per
draft depth on greedy continuations of test prompts). Built in a temp directory under a file lock, then
renamed, like Medusa's store (whose target fingerprint, corpus sampler and lock it reuses).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from methods.heads.eagle.checkpoint import save_eagle
from methods.heads.eagle.train import EagleTrainConfig, depth_accuracy, train
from methods.heads.medusa.store import _cache_root, build_once, corpus_tokens, head_key, target_identity
from methods.heads.medusa.train import greedy_continuations, sample_windows

VERSION = 1  # bump when training or evaluation changes meaningfully


@dataclass(frozen=True)
class EagleEval:
    prompts: int = 16  # test prompts continued greedily by the target
    prompt_len: int = 64
    new_tokens: int = 96
    depths: int = 6  # draft depths whose top-1 accuracy is reported
    train_chars: int = 1_500_000
    test_chars: int = 300_000


@dataclass(frozen=True)
class BuiltEagle:
    root: Path
    head_dir: Path
    report: dict


def cache_key(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: EagleTrainConfig,
              ev: EagleEval) -> str:
    return head_key(VERSION, target, tokenizer, cfg.to_dict(), ev.__dict__)


def ensure_eagle(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: EagleTrainConfig,
                 ev: EagleEval | None = None, cache_root: Path | None = None) -> BuiltEagle:
    """The cached head for this target and config, trained (with progress bars) on first use."""
    ev = ev or EagleEval()
    root = Path(cache_root) if cache_root is not None else _cache_root()
    entry = root / "eagle" / cache_key(target, tokenizer, cfg, ev)
    build_once(entry, lambda path: _build(target, tokenizer, cfg, ev, path))
    return BuiltEagle(entry, entry / "head", json.loads((entry / "report.json").read_text()))


def held_out_accuracy(target, head, tokenizer, ev: EagleEval, seed: int = 0) -> list[float]:
    """Top-1 accuracy per draft depth 1..ev.depths on greedy continuations of test-split prompts."""
    tokens = corpus_tokens(tokenizer, "test", ev.test_chars, seed)
    prompts = sample_windows(tokens, ev.prompts, ev.prompt_len, torch.Generator().manual_seed(seed + 12345))
    continued = greedy_continuations(target, prompts, ev.new_tokens)
    acc = depth_accuracy(head, target, continued, ev.depths, start=ev.prompt_len - 2)
    return [round(float(a), 4) for a in acc]


def _build(target, tokenizer, cfg: EagleTrainConfig, ev: EagleEval, entry: Path) -> None:
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    result = train(target, corpus_tokens(tokenizer, "train", ev.train_chars, cfg.seed), cfg)
    t0 = time.perf_counter()
    accuracy = held_out_accuracy(target, result.head, tokenizer, ev, cfg.seed)
    report = {
        "variant": cfg.variant,
        "top1_by_depth": accuracy,
        "train_seconds": round(result.seconds, 2),
        "eval_seconds": round(time.perf_counter() - t0, 2),
        "config": cfg.to_dict(),
        "loss_first": result.losses[0] if result.losses else None,
        "loss_last": result.losses[-1] if result.losses else None,
        "loss_curve": [round(x, 4) for x in result.losses[::10]],
        "target": target_identity(target),
        "loadavg_1min": os.getloadavg()[0],  # the machine is shared: times depend on it
    }
    save_eagle(result.head, tmp / "head", meta={"top1_by_depth": accuracy, "train": cfg.to_dict()})
    (tmp / "report.json").write_text(json.dumps(report, indent=1))
    os.replace(tmp, entry)
    _note_next_to_zoo(target, entry, report)


def _note_next_to_zoo(target: PreTrainedModel, entry: Path, report: dict) -> None:
    """A copy of the report in ``<zoo dir>/heads/`` when the target was loaded from a zoo build, so that
    ``python -m methods.zoo report`` lists the heads trained on it (the zoo floor cannot import this one)."""
    zoo = Path(str(getattr(target, "name_or_path", "") or "")).parent
    if not (zoo / "zoo_config.json").exists():
        return
    (zoo / "heads").mkdir(exist_ok=True)
    note = {k: report[k] for k in ("variant", "top1_by_depth", "train_seconds", "loadavg_1min", "config")}
    atomic = zoo / "heads" / f".{entry.name}.tmp{os.getpid()}"
    atomic.write_text(json.dumps({**note, "entry": str(entry)}, indent=1))
    os.replace(atomic, zoo / "heads" / f"{report['variant']}-{entry.name}.json")
