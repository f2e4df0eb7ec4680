"""The one training loop for small modules on a frozen target (Medusa heads, EAGLE heads, MTP modules).

p = target (frozen), q = the trained module. A method supplies the pieces; the loop owns the rest:
- features: ``target_features`` runs the frozen target once (no grad) over windows of the train split and
  returns what a method caches: the last hidden state (after the final norm), chosen decoder-layer outputs,
  the target's greedy tokens and, on request, its log-probabilities;
- ``batch_fn(generator) -> batch``: the method's data pipeline (draw positions from the cached features,
  add noise, build labels ...), called once per step with the loop's seeded generator;
- ``loss_fn(batch) -> scalar``: the method's loss (run under bf16 autocast when ``LoopConfig.autocast``).
``fit`` then runs AdamW (optionally one-cycle), gradient clipping, a tqdm progress bar with the loss, and
returns the per-step losses and wall time. Training runs with autograd even if the caller is under
``torch.inference_mode`` (a drafter built inside a measurement run).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from methods.core.bf16 import bf16_is_fast


@dataclass(frozen=True)
class LoopConfig:
    """Optimizer and schedule of one training phase."""

    steps: int
    lr: float
    schedule: str = "onecycle"  # onecycle (5% warm-up, cosine decay) | constant
    weight_decay: float = 0.0
    clip: float | None = None  # max gradient norm over all trained parameters
    # bf16 autocast for the loss: ~2x faster matmuls on AVX512-BF16 CPUs and GPUs; off where this machine's
    # bf16 products are slow (methods.core.bf16)
    autocast: bool = True
    desc: str = "train"  # progress bar label

    def __post_init__(self) -> None:
        assert self.steps >= 0 and self.lr > 0, f"steps {self.steps} / lr {self.lr}"
        assert self.schedule in ("onecycle", "constant"), f"unknown schedule {self.schedule!r}"


@dataclass
class LoopResult:
    losses: list[float] = field(default_factory=list)  # per step
    seconds: float = 0.0


ParamGroups = Iterable[torch.nn.Parameter] | list[dict[str, Any]]


def fit(
    params: ParamGroups,
    batch_fn: Callable[[torch.Generator], Any],
    loss_fn: Callable[[Any], torch.Tensor],
    cfg: LoopConfig,
    generator: torch.Generator,
    *,
    clip_params: list[torch.nn.Parameter] | None = None,
) -> LoopResult:
    """``cfg.steps`` AdamW steps of ``loss_fn(batch_fn(generator))``. ``params``: trainable parameters, or
    AdamW parameter groups (dicts with their own ``lr``; one-cycle scales each group's peak to its lr).
    ``cfg.clip`` clips the gradient norm of ``clip_params`` (default: every trained parameter)."""
    start = time.perf_counter()
    groups = list(params)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    trained = clip_params if clip_params is not None else [p for g in opt.param_groups for p in g["params"]]
    sched = None
    if cfg.schedule == "onecycle":
        peaks = [g["lr"] for g in opt.param_groups]
        total = max(cfg.steps, 1)
        pct = 0.05 if total * 0.05 != 1 else 0.06  # torch divides by (pct · total - 1): 20 steps would fail
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, peaks, total_steps=total, pct_start=pct)
    out = LoopResult()
    bar = tqdm(range(cfg.steps), desc=cfg.desc, leave=False)
    autocast = cfg.autocast and bf16_is_fast()
    with torch.inference_mode(False), torch.enable_grad():
        for _ in bar:
            batch = batch_fn(generator)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.clip is not None:
                torch.nn.utils.clip_grad_norm_(trained, cfg.clip)
            opt.step()
            if sched is not None:
                sched.step()
            out.losses.append(loss.item())
            bar.set_postfix(loss=f"{out.losses[-1]:.3f}")
    out.seconds = time.perf_counter() - start
    return out


@dataclass(frozen=True)
class Features:
    """What the frozen target computed over (B, T) windows (float32, cpu).

    hidden:  (B, T, H) last hidden state after the final norm (lm_head(hidden) = the target's logits)
    layers:  (B, T, k H) outputs of the asked decoder layers, concatenated in order (HF hidden_states[i+1];
             the last layer's is taken after the final norm, as the engine's ``features``); None if none asked
    greedy:  (B, T) argmax p(·|x_≤t)
    logp:    (B, T, V) log p(·|x_≤t) when asked (soft targets), else None
    """

    hidden: torch.Tensor
    layers: torch.Tensor | None
    greedy: torch.Tensor
    logp: torch.Tensor | None = None


@torch.no_grad()
def target_features(
    target: PreTrainedModel,
    windows: torch.Tensor,
    layers: tuple[int, ...] = (),
    logp: bool = False,
    batch: int = 8,
    desc: str = "target features",
) -> Features:
    """The frozen target's features over ``windows`` (B, T), ``batch`` windows per forward."""
    hs, fs, gs, ls = [], [], [], []
    lm = target.get_output_embeddings()
    n_layers = target.config.num_hidden_layers
    for i in tqdm(range(0, len(windows), batch), desc=desc, leave=False):
        ids = windows[i : i + batch].to(target.device)
        out = target.base_model(input_ids=ids, output_hidden_states=bool(layers))
        h = out.last_hidden_state  # (b, T, H)
        logits = lm(h).float()
        gs.append(logits.argmax(-1).cpu())
        hs.append(h.float().cpu())
        if layers:
            taps = [h if j == n_layers - 1 else out.hidden_states[j + 1] for j in layers]
            fs.append(torch.cat(taps, dim=-1).float().cpu())
        if logp:
            ls.append(logits.log_softmax(-1).cpu())
    return Features(
        torch.cat(hs), torch.cat(fs) if layers else None, torch.cat(gs), torch.cat(ls) if logp else None
    )
