"""Training and measuring Medusa heads (Cai et al., 2024), p = target, q = heads.

Medusa-1: the target is frozen; its last hidden states h_t are computed once (no grad) over windows of the
train split and cached, then head k is trained to predict x_{t+1+k} from h_t. Teacher (``teacher``):
``self`` = self-distillation on the target's own greedy tokens (label of head k at t = argmax p(·|x_≤t+k),
the token greedy decoding would emit, which is what acceptance needs; hard labels so features can be cached);
``data`` = the corpus's ground-truth tokens x_{t+1+k}. Loss Σ_k λ^k CE_k (λ = head_decay, Medusa-2's 0.8^k).
Medusa-2 (``joint``): after the Medusa-1 stage (the paper's warm-up), ``joint_steps`` steps train target and
heads together on L_LM + Σ_k λ^k CE_k with a smaller backbone learning rate; with ``teacher=self`` L_LM is the
KL from the original target (the paper's choice under self-distillation, keeping p close to the original).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from methods.heads import trainer
from methods.heads.medusa.heads import HeadsConfig, MedusaHeads
from methods.zoo.train import sample_batch

IGNORE = -100


@dataclass(frozen=True)
class TrainConfig:
    num_heads: int = 4
    num_layers: int = 1
    steps: int = 200  # Medusa-1 optimizer steps (on cached features)
    batch_tokens: int = 1024  # positions per Medusa-1 step
    train_windows: int = 128  # windows of seq_len tokens whose features are cached
    seq_len: int = 256
    lr: float = 2e-3
    teacher: str = "self"  # self | data
    head_decay: float = 0.8
    # False: keep each head's vocab projection frozen at the LM head (a departure from the paper, which
    # trains it) — only the ResBlocks learn; about half the step time, as no (V, H) weight gradient is formed
    train_projection: bool = True
    joint: bool = False  # Medusa-2
    joint_steps: int = 30
    joint_batch: int = 4  # windows per joint step
    backbone_lr: float = 5e-5
    lm_weight: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.teacher in ("self", "data"), f"teacher must be 'self' or 'data', got {self.teacher!r}"
        assert self.steps >= 0 and self.joint_steps >= 0 and self.seq_len > self.num_heads + 1

    def heads_config(self, target: PreTrainedModel) -> HeadsConfig:
        lm = target.get_output_embeddings().weight  # (V, H)
        return HeadsConfig(self.num_heads, self.num_layers, hidden_size=lm.shape[1], vocab_size=lm.shape[0])

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainResult:
    heads: MedusaHeads
    target: PreTrainedModel | None  # Medusa-2's jointly trained target; None for Medusa-1
    seconds: float
    losses: list[float] = field(default_factory=list)  # per step (Medusa-1 then joint)


def sample_windows(tokens: torch.Tensor, n: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """(n, seq_len) random windows of a 1-D token stream."""
    assert tokens.numel() > seq_len, f"corpus of {tokens.numel()} tokens is shorter than a window ({seq_len})"
    return sample_batch(tokens, n, seq_len, generator)


def head_labels(windows: torch.Tensor, greedy: torch.Tensor | None, num_heads: int) -> torch.Tensor:
    """(K, B, T) label of head k (row k-1) at position t: greedy[t+k] (self) or windows[t+1+k] (data);
    IGNORE where it falls outside the window. greedy[t] = argmax p(·|x_≤t)."""
    B, T = windows.shape
    out = torch.full((num_heads, B, T), IGNORE, dtype=torch.long)
    for k in range(1, num_heads + 1):
        if greedy is not None:
            out[k - 1, :, : T - k] = greedy[:, k:]
        else:
            out[k - 1, :, : T - 1 - k] = windows[:, 1 + k :]
    return out


def target_features(target: PreTrainedModel, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's last hidden states after the final norm (B, T, H) (float32, cpu), greedy tokens (B, T)."""
    f = trainer.target_features(target, windows, desc="medusa: target features")
    return f.hidden, f.greedy


def _heads_loss(heads: MedusaHeads, h: torch.Tensor, labels: torch.Tensor, decay: float) -> torch.Tensor:
    """Σ_k decay^k CE(head_k(h), labels[k-1]); h (..., H), labels (K, ...)."""
    loss = h.new_zeros((), dtype=torch.float32)
    for k in range(1, heads.num_heads + 1):
        logits = heads.head_logits(h, k).float()  # (..., V)
        y = labels[k - 1]
        if (y != IGNORE).any():
            loss = loss + decay**k * F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE
            )
    return loss


def train_medusa1(target: PreTrainedModel, tokens: torch.Tensor, cfg: TrainConfig) -> TrainResult:
    """Medusa-1 on a frozen target over a 1-D train-token stream."""
    start = time.perf_counter()
    g = torch.Generator().manual_seed(cfg.seed)
    lm = target.get_output_embeddings().weight.detach().float().cpu()
    heads = MedusaHeads.from_lm_head(cfg.heads_config(target), lm).train()
    for head in heads.heads:
        head[-1].weight.requires_grad_(cfg.train_projection)
    windows = sample_windows(tokens, cfg.train_windows, cfg.seq_len, g)
    h, greedy = target_features(target, windows)
    labels = head_labels(windows, greedy if cfg.teacher == "self" else None, cfg.num_heads)
    h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(cfg.num_heads, -1)  # (N, H), (K, N)

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, h.shape[0], (cfg.batch_tokens,), generator=gen)
        return h[idx], labels[:, idx]

    loop = trainer.LoopConfig(cfg.steps, cfg.lr, desc="medusa-1: heads")
    trainable = [p for p in heads.parameters() if p.requires_grad]
    fitted = trainer.fit(trainable, batch, lambda b: _heads_loss(heads, *b, cfg.head_decay), loop, g)
    losses = fitted.losses
    heads.eval()
    return TrainResult(heads, None, time.perf_counter() - start, losses)


def train_medusa2(target: PreTrainedModel, tokens: torch.Tensor, cfg: TrainConfig) -> TrainResult:
    """Medusa-2: the Medusa-1 stage, then joint training of a copy of the target with the heads."""
    first = train_medusa1(target, tokens, cfg)
    start = time.perf_counter()
    g = torch.Generator().manual_seed(cfg.seed + 1)
    student = copy.deepcopy(target).float().cpu().train()
    original = target.eval()
    heads = first.heads.train()
    groups = [
        {"params": list(student.parameters()), "lr": cfg.backbone_lr},
        {"params": [p for p in heads.parameters() if p.requires_grad], "lr": cfg.lr / 4},
    ]

    def loss(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p_orig = original(input_ids=ids.to(original.device)).logits.float().cpu()  # (B, T, V)
        h = student.base_model(input_ids=ids).last_hidden_state  # (B, T, H)
        logits = student.get_output_embeddings()(h).float()
        if cfg.teacher == "self":  # KL(p_orig || p) up to a constant: soft cross-entropy
            lm_loss = -(p_orig.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
            labels = head_labels(ids, p_orig.argmax(-1), cfg.num_heads)
        else:
            lm_loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            labels = head_labels(ids, None, cfg.num_heads)
        return cfg.lm_weight * lm_loss + _heads_loss(heads, h, labels, cfg.head_decay)

    # full precision, constant rates, the backbone's gradient clipped at norm 1 (the heads' is not)
    loop = trainer.LoopConfig(
        cfg.joint_steps, cfg.lr, "constant", clip=1.0, autocast=False, desc="medusa-2: joint"
    )
    windows = lambda gen: sample_windows(tokens, cfg.joint_batch, cfg.seq_len, gen)  # noqa: E731
    fitted = trainer.fit(groups, windows, loss, loop, g, clip_params=groups[0]["params"])
    losses = list(first.losses) + fitted.losses
    student.eval()
    return TrainResult(heads.eval(), student, first.seconds + time.perf_counter() - start, losses)


def train(target: PreTrainedModel, tokens: torch.Tensor, cfg: TrainConfig) -> TrainResult:
    """Medusa-2 when ``cfg.joint``, else Medusa-1."""
    return train_medusa2(target, tokens, cfg) if cfg.joint else train_medusa1(target, tokens, cfg)


@torch.no_grad()
def head_accuracy(
    target: PreTrainedModel, heads: MedusaHeads, windows: torch.Tensor, start: int = 0, ranks: int = 10
) -> np.ndarray:
    """(K, ranks) accuracy table: entry [k-1, r] = fraction of positions t >= start where the rank-r
    candidate of head k equals the target's greedy token argmax p(·|x_≤t+k) — the token greedy decoding
    emits k+1 after t, i.e. what the heads must match to be accepted. On a greedy continuation (start = the
    prompt length) this is Medusa's heads_accuracy.py measurement. Cumulative sums are top-k accuracies."""
    hits = np.zeros((heads.num_heads, ranks))
    counts = np.zeros(heads.num_heads)
    dev = next(heads.parameters()).device
    for i in range(0, len(windows), 8):
        h, greedy = target_features(target, windows[i : i + 8])
        T = h.shape[1]
        for k in range(1, heads.num_heads + 1):
            if T - k <= start:
                continue
            logits = heads.head_logits(h[:, start : T - k].to(dev, next(heads.parameters()).dtype), k)
            top = logits.topk(ranks, dim=-1).indices.cpu()  # (b, T', R)
            hit = top == greedy[:, start + k :, None]  # (b, T', R)
            hits[k - 1] += hit.reshape(-1, ranks).sum(0).numpy()
            counts[k - 1] += hit.shape[0] * hit.shape[1]
    return hits / np.maximum(counts, 1)[:, None]


@torch.no_grad()
def greedy_continuations(target: PreTrainedModel, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """(B, P + new_tokens): each prompt (B, P) continued greedily by the target (HF generate, KV-cached)."""
    out = target.generate(
        input_ids=prompts.to(target.device),
        attention_mask=torch.ones_like(prompts, device=target.device),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=target.config.pad_token_id or 0,
    )
    return out.cpu()
