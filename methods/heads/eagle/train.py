"""Training EAGLE heads on a frozen target (EAGLE-1: Li et al. 2024a; EAGLE-3: Li et al. 2025), p = target.

Data: windows of the train split; the frozen target's features (methods.heads.trainer.target_features) are
computed once and cached. Row i of a window reads (h_i, x_{i+1}) and is scored against the target at i+1:
its feature f_{i+1} and its law p(·|x_≤i+1) = softmax(lm_head(f_{i+1})) (recomputed per batch from f_{i+1},
so no (T, V) table is stored).
- EAGLE-1: L = SmoothL1(g, f_{i+1}) + w_ce · CE(p, q), with uniform noise U(-noise, noise) on the input
  features (the paper's augmentation against its own feature errors at draft time).
- EAGLE-3 "training-time test": ``ttt_steps`` further rollout steps in which row i reads the head's OWN
  previous-step output for row i-1 in place of the target's feature, attending as a depth-s draft node does
  (the target-fed rows up to i-s, its own ancestors on the diagonals); L = Σ_s decay^s CE(p, q_s), no
  feature loss. ``rollout`` is also how per-depth held-out accuracy is measured; its attention
  (``ttt_attention``) is a causal product plus one dot product per earlier step, not a masked SDPA.
- ``labels="greedy"``: CE against the target's greedy token instead of its law p (what greedy verification
  accepts), the labels computed once for the cached windows.
- EAGLE-3 draft vocabulary (``draft_vocab`` > 0): the head's LM head covers only the ``draft_vocab`` most
  frequent target tokens of the train stream (the published design's reduced vocabulary, d2t: target id =
  draft id + d2t), initialised from the target's rows; the loss is CE(p restricted to the draft vocabulary
  and renormalised, q over the draft vocabulary). At draft time q is a proper distribution over those ids
  (EagleHead.logits: -inf elsewhere); verification by the target keeps decoding lossless.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from methods.heads import trainer
from methods.heads.eagle.head import EagleConfig, EagleHead
from methods.zoo.train import sample_batch


@dataclass(frozen=True)
class EagleTrainConfig:
    variant: str = "eagle1"
    feature_layers: tuple[int, ...] = ()  # eagle3: three distinct target layers (0-based decoder outputs)
    # sized for the ~4-minute budget on the shared 2-core CPU: ~500 positions per step
    steps: int = 150
    lr: float = 3e-3
    batch_windows: int = 4
    train_windows: int = 96  # windows whose target features are cached
    seq_len: int = 128
    noise: float = 0.1  # EAGLE-1's U(-0.1, 0.1) feature noise; 0 for eagle3 (its TTT replaces it)
    ce_weight: float = 0.1  # EAGLE-1's weight of the token loss next to the feature regression
    ttt_steps: int = 0  # eagle3: extra rollout steps (the paper uses 6 more; fewer for our time budget)
    step_decay: float = 0.8  # eagle3: loss weight of rollout step s is decay^s
    # eagle3: train its own LM head (the paper does); off by default = kept at the target's, a departure that
    # saves the (V, H) weight gradient of every rollout step on this CPU
    train_lm_head: bool = False
    # eagle3: fc's initial weights. "top": the identity on the highest fused layer's slice, zeros elsewhere,
    # so training starts from h = the target's top feature (EAGLE-1's input) and learns what the lower layers
    # add; "random": nn.Linear's default, which mixes 3H inputs at random and loses the top feature
    fuse_init: str = "top"
    # weight of the feature regression SmoothL1(g, f_{i+1}) of rollout step 0; None = the variant's: EAGLE-1
    # 1.0, EAGLE-3 0.0 (the paper drops it)
    feature_weight: float | None = None
    # eagle3: LM-head rows = the most frequent target tokens of the train stream (EAGLE-3's reduced draft
    # vocabulary); 0 = the target's full vocabulary
    draft_vocab: int = 0
    # what q is trained towards: "soft" = the target's law p (the papers' distillation; right for sampled
    # verification); "greedy" = the target's greedy token (one-hot CE): what greedy verification accepts,
    # so q(x) estimates P(x is accepted) rather than p(x)
    labels: str = "soft"
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.variant in ("eagle1", "eagle3"), self.variant
        assert self.variant == "eagle1" or len(self.feature_layers) >= 1, "eagle3 needs feature_layers"
        assert self.fuse_init in ("top", "random"), f"unknown fuse_init {self.fuse_init!r}"
        if self.labels not in ("soft", "greedy"):
            raise ValueError(f"method.params.train.labels must be soft or greedy, got {self.labels!r}")
        if not (isinstance(self.draft_vocab, int) and self.draft_vocab >= 0):
            raise ValueError(f"method.params.train.draft_vocab must be an int >= 0 (0 = the target's "
                             f"vocabulary), got {self.draft_vocab!r}")
        if self.draft_vocab and self.variant != "eagle3":
            raise ValueError("method.params.train.draft_vocab: a draft vocabulary is EAGLE-3's (eagle3 only)")

    def head_config(self, target: PreTrainedModel) -> EagleConfig:
        layers = self.feature_layers if self.variant == "eagle3" else ()
        vocab = target.config.vocab_size
        if self.draft_vocab > vocab:
            raise ValueError(f"method.params.train.draft_vocab must be <= the target's vocabulary ({vocab}), "
                             f"got {self.draft_vocab}")
        return EagleConfig.for_target(target, self.variant, layers, self.draft_vocab or None)

    def to_dict(self) -> dict:
        """The recipe (cache keys): fields added later are left out where they do not apply or keep the
        earlier behaviour, so the heads built before them stay valid."""
        d = asdict(self)
        if self.variant == "eagle1" or d["fuse_init"] == "random":
            d.pop("fuse_init")
        if self.feature_weight is None or self.feature_weight == self.feature_loss_weight_default:
            d.pop("feature_weight")
        if not self.draft_vocab:
            d.pop("draft_vocab")
        if self.labels == "soft":
            d.pop("labels")
        return d

    @property
    def feature_loss_weight_default(self) -> float:
        return 1.0 if self.variant == "eagle1" else 0.0

    @property
    def feature_loss_weight(self) -> float:
        return self.feature_loss_weight_default if self.feature_weight is None else self.feature_weight


@dataclass
class EagleTrainResult:
    head: EagleHead
    seconds: float
    losses: list[float]


def new_head(target: PreTrainedModel, cfg: EagleConfig, seed: int = 0) -> EagleHead:
    """A freshly initialised head for ``target`` (its embedding and LM head, frozen, inside)."""
    torch.manual_seed(seed)  # nn.Linear's init; the run's generators are untouched
    embed = target.get_input_embeddings().weight.detach().float().cpu()
    lm = target.get_output_embeddings().weight.detach().float().cpu()
    return EagleHead(cfg, embed, lm)


def most_frequent(tokens: torch.Tensor, size: int, vocab: int) -> torch.Tensor:
    """(size,) ascending target ids of the ``size`` most frequent tokens of the stream (ties: lower id)."""
    counts = torch.bincount(tokens.reshape(-1).long(), minlength=vocab)[:vocab]
    order = torch.sort(-counts, stable=True).indices  # by count, ties by id
    return order[:size].sort().values


@torch.no_grad()
def set_draft_vocabulary(head: EagleHead, ids: torch.Tensor, target_lm: torch.Tensor) -> None:
    """EAGLE-3's draft vocabulary = target ids ``ids`` (ascending, Vd of them): d2t and the LM head's rows
    from the target's."""
    assert len(ids) == head.cfg.draft_vocab_size and bool((ids[1:] > ids[:-1]).all())
    head.d2t.copy_(ids - torch.arange(len(ids)))
    head.lm_head.copy_(target_lm[ids].to(head.lm_head.dtype))


def init_fusion(head: EagleHead) -> None:
    """EAGLE-3's fc = [0 … 0 I 0 …]: the identity on the slice of the highest fused layer, zeros elsewhere
    (our choice, not the paper's: on a few-minute budget a random 3H → H mix loses the top feature, which
    alone already gives EAGLE-1's accuracy; zeros on the other slices still get gradients)."""
    c = head.cfg
    top = c.feature_layers.index(max(c.feature_layers))
    H = c.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, top * H : (top + 1) * H] = torch.eye(H)


def committed_input(head: EagleHead, feats: trainer.Features) -> torch.Tensor:
    """h of the committed rows (B, T, H): the last hidden state (eagle1) or the fused layers (eagle3)."""
    return head.fuse(feats.layers) if head.cfg.variant == "eagle3" else feats.hidden


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """(T, (step+1) T) additive mask of rollout step ``step``: row i sees target-fed rows c <= i - step and,
    in each later step j = 1..step, the row i - step + j (its depth-j ancestor; j = step is itself)."""
    i = torch.arange(T, device=device)[:, None]
    c = torch.arange(T, device=device)[None, :]
    blocks = [c <= i - step] + [c == i - step + j for j in range(1, step + 1)]
    ok = torch.cat(blocks, dim=1)
    return torch.zeros(ok.shape, device=device).masked_fill(~ok, float("-inf"))


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """Rollout step s = len(ks) - 1's attention under ``ttt_mask`` without its (T, (s+1) T) score matrix:
    q (B, T, n, d); ks[j], vs[j] (B, T, kv, d) of step j. Row i reads the target-fed rows c <= i - s (a
    causal product) and one key per later step j (row i - s + j: a dot product per row), one softmax over
    both. The same values as SDPA under the mask; ~10x less time forward + backward on CPU at T = 127
    (a masked SDPA's backward visits every masked block)."""
    s, (_, T, n, d) = len(ks) - 1, q.shape
    rep = n // ks[0].shape[2]

    def heads(x: torch.Tensor, shift: int) -> torch.Tensor:  # (B, n, T, d): row i holds x's row i - shift
        x = x.transpose(1, 2).to(q.dtype)
        x = x.repeat_interleave(rep, 1) if rep > 1 else x
        return F.pad(x, (0, 0, shift, 0))[:, :, :T] if shift else x

    qt = q.transpose(1, 2)
    scale = d**-0.5
    i = torch.arange(T, device=q.device)
    causal = (qt @ heads(ks[0], 0).transpose(-1, -2)).float() * scale  # (B, n, T, T)
    causal = causal.masked_fill(i[None, :] > i[:, None] - s, float("-inf"))
    diag = [((qt * heads(k, s - j)).sum(-1).float() * scale).masked_fill(i < s - j, float("-inf"))
            for j, k in enumerate(ks[1:], 1)]  # (B, n, T) each
    p = torch.cat([causal, torch.stack(diag, -1)], -1).softmax(-1).to(q.dtype)
    out = p[..., :T] @ heads(vs[0], 0)
    for j, v in enumerate(vs[1:], 1):
        out = out + p[..., T + j - 1, None] * heads(v, s - j)
    return out.transpose(1, 2)  # (B, T, n, d)


def rollout(head: EagleHead, h0: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """g of rollout steps 0..steps over rows (B, T): h0 (B, T, H) target-fed, tokens (B, T) = x_{i+1}.
    Step s row i stands for a depth-(s+1) draft node whose committed context ends at row i - s (it attends
    as ``ttt_mask`` says, computed by ``ttt_attention``)."""
    B, T, _ = h0.shape
    pos = torch.arange(T, device=h0.device)
    res, q, k, v = head.project(h0, tokens, pos)
    g = head.attend(res, q, k, v, None)
    outs, ks, vs = [g], [k], [v]
    for _ in range(steps):
        h = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # row i reads the last step's row i-1
        res, q, k, v = head.project(h, tokens, pos)
        ks.append(k)
        vs.append(v)
        g = head.block(res, ttt_attention(q, ks, vs))
        outs.append(g)
    return outs


def _soft_ce(logits: torch.Tensor, p_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of q (logits) against the target's law p (logits), per row."""
    return -(p_logits.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1)


def _greedy_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of q (logits) against p's argmax ``labels`` (one-hot), per row."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").reshape(
        labels.shape)


@dataclass
class Batch:
    """b windows' rows i = 0..T-2: target-fed input h (b, T-1, H or k H), tokens x_{i+1}, and the target at
    i+1: feature f_{i+1} and either its logits lm_head(f_{i+1}) (soft labels) or their argmax (greedy)."""

    h: torch.Tensor
    tokens: torch.Tensor
    f_next: torch.Tensor
    p_logits: torch.Tensor | None
    noise: torch.Tensor | None = None  # (b, T-1, H) EAGLE-1's uniform noise
    greedy: torch.Tensor | None = None  # (b, T-1) argmax of p_logits, given instead of them (labels=greedy)

    def labels(self) -> torch.Tensor:
        return self.greedy if self.greedy is not None else self.p_logits.argmax(-1)


def make_batch(feats: trainer.Features, windows: torch.Tensor, idx: torch.Tensor, lm: torch.Tensor,
               greedy: torch.Tensor | None = None) -> Batch:
    """``lm`` (rows, H): the target's LM-head rows of the vocabulary the head is scored on (EAGLE-3: its
    draft vocabulary, so that p is the target's law restricted to it and renormalised). ``greedy``: every
    window's ``greedy_labels``, which replace the per-batch logits (a (rows, H) × (H, V) product a step)."""
    src = feats.layers if feats.layers is not None else feats.hidden
    f_next = feats.hidden[idx, 1:]
    if greedy is not None:
        return Batch(src[idx, :-1], windows[idx, 1:], f_next, None, greedy=greedy[idx])
    return Batch(src[idx, :-1], windows[idx, 1:], f_next, f_next @ lm.T)


@torch.no_grad()
def greedy_labels(feats: trainer.Features, lm: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """(N, T-1) argmax of the target's logits over ``lm``'s rows at i+1 (the labels of labels=greedy),
    computed once for the cached windows, ``chunk`` windows at a time."""
    f = feats.hidden[:, 1:]
    return torch.cat([(f[i : i + chunk] @ lm.T).argmax(-1) for i in range(0, len(f), chunk)])


def loss(head: EagleHead, b: Batch, cfg: EagleTrainConfig) -> torch.Tensor:
    """EAGLE-1: SmoothL1(g, f_{i+1}) + ce_weight · CE(p, q); EAGLE-3: Σ_s decay^s CE(p, q_s), rows of step s
    whose input came from a padded row (i < s) excluded (plus feature_weight · SmoothL1 when asked)."""
    h0 = head.fuse(b.h)
    if b.noise is not None:
        h0 = h0 + b.noise.to(h0.dtype)
    outs = rollout(head, h0, b.tokens, cfg.ttt_steps)
    weight = cfg.ce_weight if cfg.variant == "eagle1" else 1.0
    total = h0.new_zeros((), dtype=torch.float32)
    scores = head.logits if cfg.variant == "eagle1" else head.draft_logits  # over p's vocabulary
    greedy = cfg.labels == "greedy"
    target = b.labels() if greedy else b.p_logits
    for s, g in enumerate(outs):
        ce = _greedy_ce(scores(g), target) if greedy else _soft_ce(scores(g), target)
        total = total + weight * cfg.step_decay**s * ce[:, s:].mean()
    if cfg.feature_loss_weight:
        total = total + cfg.feature_loss_weight * F.smooth_l1_loss(outs[0].float(), b.f_next.float())
    return total


def train(target: PreTrainedModel, tokens: torch.Tensor, cfg: EagleTrainConfig) -> EagleTrainResult:
    """A head for the frozen ``target`` trained on the 1-D train-token stream ``tokens``."""
    start = time.perf_counter()
    g = torch.Generator().manual_seed(cfg.seed)
    head = new_head(target, cfg.head_config(target), cfg.seed).train()
    if cfg.variant == "eagle3":
        head.lm_head.requires_grad_(cfg.train_lm_head)
        if cfg.fuse_init == "top":
            init_fusion(head)
    target_lm = target.get_output_embeddings().weight.detach().float()
    if cfg.draft_vocab:
        set_draft_vocabulary(head, most_frequent(tokens, cfg.draft_vocab, head.cfg.vocab_size), target_lm)
    windows = sample_batch(tokens, cfg.train_windows, cfg.seq_len, g)  # (N, T)
    layers = head.cfg.feature_layers if cfg.variant == "eagle3" else ()
    feats = trainer.target_features(target, windows, layers, desc=f"{cfg.variant}: target features")
    lm = head.lm_head if cfg.variant == "eagle1" else target_lm[head.draft_ids()]
    labels = greedy_labels(feats, lm) if cfg.labels == "greedy" else None

    def batch(gen: torch.Generator) -> Batch:
        idx = torch.randint(0, len(windows), (cfg.batch_windows,), generator=gen)
        b = make_batch(feats, windows, idx, lm, labels)
        if cfg.noise > 0:  # noise on the features the head reads (EAGLE-1 adds it to the target's f)
            b.noise = (torch.rand(b.f_next.shape, generator=gen) * 2 - 1) * cfg.noise
        return b

    loop = trainer.LoopConfig(cfg.steps, cfg.lr, clip=0.5, desc=f"{cfg.variant}: head")
    fitted = trainer.fit(head.trainable(), batch, lambda b: loss(head, b, cfg), loop, g)
    return EagleTrainResult(head.eval(), time.perf_counter() - start, fitted.losses)


@torch.no_grad()
def depth_accuracy(head: EagleHead, target: PreTrainedModel, windows: torch.Tensor, depths: int,
                   start: int = 0) -> np.ndarray:
    """(depths,) top-1 accuracy of the head at draft depth d = 1..depths: the fraction of rows i >= start
    where rollout step d-1 (fed the true tokens, its own features beyond the committed context) names the
    target's greedy token after x_≤i+1 — the conditional acceptance of a depth-d chain node under greedy
    verification. On greedy continuations (start = prompt length - 2: the first root is the last prompt
    token) this is what decoding sees."""
    layers = head.cfg.feature_layers if head.cfg.variant == "eagle3" else ()
    hits, counts = np.zeros(depths), np.zeros(depths)
    for i in range(0, len(windows), 8):
        w = windows[i : i + 8]
        feats = trainer.target_features(target, w, layers, desc="eagle: held-out features")
        b = make_batch(feats, w, torch.arange(len(w)), head.lm_head if head.cfg.variant == "eagle1"
                       else target.get_output_embeddings().weight.detach().float())
        outs = rollout(head, head.fuse(b.h), b.tokens, depths - 1)
        greedy = feats.greedy[:, 1:]  # (b, T-1) the target's greedy token after x_≤i+1
        for s, g in enumerate(outs):
            lo = s + start  # rows whose committed context (up to row i - s) reaches the start
            hit = head.logits(g[:, lo:]).argmax(-1) == greedy[:, lo:]
            hits[s] += float(hit.sum())
            counts[s] += hit.numel()
    return hits / np.maximum(counts, 1)
