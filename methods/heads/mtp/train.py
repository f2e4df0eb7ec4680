"""Training and caching the MTP modules (methods.heads.mtp.module) on a frozen target with the shared trainer
(methods.heads.trainer: target features once, then ``fit``). p = target, q_k = module k.

Data: windows of the train split; the target's last hidden states h^0 and greedy tokens g_i = argmax p(·|x_≤i)
are computed once. A batch takes ``window``-long slices at random offsets; module k at position i reads
h^{k-1}_i and x_{i+k} and is scored by cross-entropy against g_{i+k} — the target's own next token after
x_≤i+k, which is what greedy verification accepts (DeepSeek-V3 trains on the data token; we distil the
target's greedy choice instead, as Medusa's self-distillation). Loss: the mean over depths.
Cached in ``<cache root>/mtp/<key>/`` (key: the target's identity, vocabulary, config), like Medusa's store.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from methods.heads import trainer
from methods.heads.medusa.store import _cache_root, build_once, corpus_tokens, head_key, target_identity
from methods.heads.medusa.train import sample_windows
from methods.heads.mtp.module import MTPConfig, MTPModules

VERSION = 1


@dataclass(frozen=True)
class MTPTrainConfig:
    depths: int = 3
    window: int = 32
    steps: int = 400
    lr: float = 1e-3
    batch_windows: int = 16
    train_windows: int = 256  # target windows whose features are cached
    seq_len: int = 128
    train_chars: int = 1_500_000
    eval_windows: int = 32
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def new_modules(target, cfg: MTPTrainConfig) -> MTPModules:
    mc = MTPConfig.for_target(target, cfg.depths, cfg.window)
    lm = target.get_output_embeddings().weight.detach().float()
    emb = target.get_input_embeddings().weight.detach().float()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return MTPModules(mc, emb, lm)


def _slices(feats: trainer.Features, windows: torch.Tensor, idx: torch.Tensor, offset: int,
            cfg: MTPTrainConfig):
    """h^0 (B, W, H), tokens (B, W + D) from the offset, greedy labels (B, W + D)."""
    w, d = cfg.window, cfg.depths
    return (feats.hidden[idx, offset : offset + w], windows[idx, offset : offset + w + d],
            feats.greedy[idx, offset : offset + w + d])


def mtp_loss(mods: MTPModules, h0: torch.Tensor, tokens: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    w, total, h = h0.shape[1], 0.0, h0
    for k in range(1, mods.cfg.depths + 1):
        h = mods.step(k, h, tokens[:, k : k + w])
        logits = mods.logits(k, h).float()  # (B, W, V) predicts x_{i+k+1}
        total = total + F.cross_entropy(logits.flatten(0, 1), greedy[:, k : k + w].flatten())
    return total / mods.cfg.depths


def train(target, tokens: torch.Tensor, cfg: MTPTrainConfig) -> tuple[MTPModules, float, list[float]]:
    start = time.perf_counter()
    g = torch.Generator().manual_seed(cfg.seed)
    mods = new_modules(target, cfg).train()
    windows = sample_windows(tokens, cfg.train_windows, cfg.seq_len, g)  # (N, T)
    feats = trainer.target_features(target, windows, desc="mtp: target features")
    span = cfg.seq_len - cfg.window - cfg.depths

    def batch(gen: torch.Generator):
        idx = torch.randint(0, len(windows), (cfg.batch_windows,), generator=gen)
        return _slices(feats, windows, idx, int(torch.randint(0, span, (1,), generator=gen)), cfg)

    loop = trainer.LoopConfig(cfg.steps, cfg.lr, clip=1.0, desc="mtp: modules")
    fitted = trainer.fit(mods.trainable(), batch, lambda b: mtp_loss(mods, *b), loop, g)
    return mods.eval(), time.perf_counter() - start, fitted.losses


@torch.no_grad()
def depth_accuracy(target, mods: MTPModules, windows: torch.Tensor) -> list[float]:
    """Top-1 agreement of module k with the target's greedy token, teacher-forced, per depth."""
    feats = trainer.target_features(target, windows, desc="mtp: held-out features")
    cfg = mods.cfg
    hits, count = [0.0] * cfg.depths, 0
    for off in range(0, windows.shape[1] - cfg.window - cfg.depths, cfg.window):
        h0, toks, greedy = feats.hidden[:, off : off + cfg.window], windows[:, off:], feats.greedy[:, off:]
        h = h0
        for k in range(1, cfg.depths + 1):
            h = mods.step(k, h, toks[:, k : k + cfg.window])
            hits[k - 1] += float((mods.logits(k, h).argmax(-1) == greedy[:, k : k + cfg.window]).sum())
        count += h0.shape[0] * cfg.window
    return [round(x / max(count, 1), 4) for x in hits]


def ensure_mtp(target, tokenizer, cfg: MTPTrainConfig) -> tuple[MTPModules, dict]:
    """The cached modules for this target and config (trained first when missing) and their report."""
    entry = _cache_root() / "mtp" / head_key(VERSION, target, tokenizer, cfg.to_dict())
    build_once(entry, lambda path: _build(target, tokenizer, cfg, path))
    mods = new_modules(target, cfg)
    mods.load_state_dict(torch.load(entry / "modules.pt", weights_only=True))
    return mods.eval(), json.loads((entry / "report.json").read_text())


def _build(target, tokenizer, cfg: MTPTrainConfig, entry: Path) -> None:
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mods, seconds, losses = train(target, corpus_tokens(tokenizer, "train", cfg.train_chars, cfg.seed), cfg)
    test = sample_windows(corpus_tokens(tokenizer, "test", 300_000, cfg.seed), cfg.eval_windows, cfg.seq_len,
                          torch.Generator().manual_seed(cfg.seed + 1))
    report = {"train_seconds": round(seconds, 2), "params_trained": mods.n_params(),
              "top1_by_depth_teacher_forced": depth_accuracy(target, mods, test), "config": cfg.to_dict(),
              "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
              "target": target_identity(target), "loadavg_1min": os.getloadavg()[0]}
    torch.save(mods.state_dict(), tmp / "modules.pt")
    (tmp / "report.json").write_text(json.dumps(report, indent=1))
    os.replace(tmp, entry)
