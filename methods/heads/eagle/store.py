"""Trained EAGLE heads, built on first use and cached next to the zoo (p = target, q = head).

Key = hash of (the target's identity, the tokenizer's vocabulary size, the EagleTrainConfig, the evaluation
settings). The entry ``<cache root>/eagle/<key>/`` holds ``head/`` (the published EAGLE / EAGLE-3 layout,
methods.heads.eagle.checkpoint) and ``report.json``: training time, loss curve, held-out top-1 accuracy per
draft depth on greedy continuations of test prompts, and the head's measured τ drafting a greedy chain of
``TAU_CHAIN`` tokens along them (``chain_tau``; added on first use to entries built before it). Built in a
temp directory under a file lock, then renamed, like Medusa's store (whose target fingerprint, corpus sampler
and lock it reuses).
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

from methods.heads import trainer
from methods.heads.eagle.checkpoint import load_eagle, save_eagle
from methods.heads.eagle.head import EagleHead
from methods.heads.eagle.state import HeadCache
from methods.heads.eagle.train import EagleTrainConfig, depth_accuracy, most_frequent, train
from methods.heads.medusa.store import _cache_root, build_once, corpus_tokens, head_key, target_identity
from methods.heads.medusa.train import greedy_continuations, sample_windows

VERSION = 1  # bump when training or evaluation changes meaningfully
TAU_CHAIN = 4  # the held-out τ's chain depth (the calibration profiles' chain)


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
    report = json.loads((entry / "report.json").read_text())
    if "held_out_tau" not in report:  # an entry built before the τ was measured: measure it now, once
        head, _ = load_eagle(entry / "head", target)
        report["held_out_tau"] = held_out(target, head, tokenizer, ev, cfg.seed)[1]
        _write_json(entry / "report.json", report)
        _note_next_to_zoo(target, entry, report)
    return BuiltEagle(entry, entry / "head", report)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def held_out(target, head, tokenizer, ev: EagleEval, seed: int = 0) -> tuple[list[float], dict]:
    """On greedy continuations of test-split prompts: top-1 accuracy per draft depth 1..ev.depths, and the
    chain τ (``chain_tau``, {"chain": TAU_CHAIN, "tau": τ})."""
    tokens = corpus_tokens(tokenizer, "test", ev.test_chars, seed)
    prompts = sample_windows(tokens, ev.prompts, ev.prompt_len, torch.Generator().manual_seed(seed + 12345))
    continued = greedy_continuations(target, prompts, ev.new_tokens)
    acc = depth_accuracy(head, target, continued, ev.depths, start=ev.prompt_len - 2)
    tau = chain_tau(head, target, continued, ev.prompt_len, TAU_CHAIN)
    return [round(float(a), 4) for a in acc], {"chain": TAU_CHAIN, "tau": round(tau, 4)}


def chain_tau(head: EagleHead, target, continued: torch.Tensor, start: int, depth: int) -> float:
    accepted = chain_accepts(head, target, continued, start, depth)
    return sum(accepted) / max(len(accepted), 1)


@torch.no_grad()
def chain_accepts(head: EagleHead, target, continued: torch.Tensor, start: int, depth: int) -> list[int]:
    """Per step, accepted drafts + 1 (the decode loop's ``accepted_lengths``) of greedy chain drafting
    along the target's greedy continuations ``continued`` (B, L), from root x_{start-1}: per step the head
    drafts ``depth`` tokens from its own KV cache as in decoding (HeadCache), the prefix that matches the
    continuation is accepted plus the target's bonus token, and the accepted rows' target features are
    appended. Greedy verification accepts exactly that: these are the decode loop's steps for a chain of
    ``depth`` (up to float rounding of the features), row after row."""
    layers = head.cfg.feature_layers if head.cfg.variant == "eagle3" else ()
    feats = trainer.target_features(target, continued, layers, desc="eagle: held-out tau")
    src = feats.layers if layers else feats.hidden
    dtype = head.fc.weight.dtype
    accepted = []
    for ids, f in zip(continued, src):
        cache, t = HeadCache(head), start  # committed: ids[:t], root ids[t-1]
        cache.append(head.fuse(f[: t - 1].to(dtype)), ids[1:t])
        while t + depth <= len(ids):
            g, drafted, parent = cache.last, [], torch.tensor([-1])
            for d in range(1, depth + 1):
                tok = head.logits(g).argmax(-1).reshape(1)
                drafted.append(int(tok))
                if d < depth:  # the depth-d node is fed for its child; it is pending row d-1
                    g, parent = cache.feed(g[None], tok, d, parent)[0], torch.tensor([d - 1])
            a = 0
            while a < depth and drafted[a] == int(ids[t + a]):
                a += 1
            accepted.append(a + 1)
            nxt = min(t + a + 1, len(ids))
            cache.append(head.fuse(f[t - 1 : nxt - 1].to(dtype)), ids[t:nxt])
            t = nxt
    return accepted


def _build(target, tokenizer, cfg: EagleTrainConfig, ev: EagleEval, entry: Path) -> None:
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    result = train(target, corpus_tokens(tokenizer, "train", ev.train_chars, cfg.seed), cfg)
    t0 = time.perf_counter()
    accuracy, tau = held_out(target, result.head, tokenizer, ev, cfg.seed)
    report = {
        "variant": cfg.variant,
        "top1_by_depth": accuracy,
        "held_out_tau": tau,
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
    keys = ("variant", "top1_by_depth", "held_out_tau", "train_seconds", "loadavg_1min", "config")
    note = {k: report[k] for k in keys if k in report}
    atomic = zoo / "heads" / f".{entry.name}.tmp{os.getpid()}"
    atomic.write_text(json.dumps({**note, "entry": str(entry)}, indent=1))
    os.replace(atomic, zoo / "heads" / f"{report['variant']}-{entry.name}.json")


_FREQUENT: dict[tuple, torch.Tensor] = {}  # (tokenizer, size) → ids: a drafter built per pass tokenizes once


def frequent_ids(tokenizer: PreTrainedTokenizerBase, size: int, vocab: int) -> torch.Tensor:
    """(size,) ascending target ids of the ``size`` most frequent tokens of the train split (the stream the
    heads train on: ``corpus_tokens`` with EagleEval's train_chars, seed 0), for an inference-time draft
    vocabulary (methods.drafters.eagle.EagleParams.draft_vocab)."""
    key = (getattr(tokenizer, "name_or_path", ""), len(tokenizer), size, vocab)
    if key not in _FREQUENT:
        tokens = corpus_tokens(tokenizer, "train", EagleEval().train_chars, 0)
        _FREQUENT[key] = most_frequent(tokens, size, vocab)
    return _FREQUENT[key].clone()
