"""Quality figures of a zoo (p = target, q = draft): held-out perplexity, draft/target agreement, loop rate,
and the verification cost curve t(n) on this device.

Agreement at T=1 is E_x[Σ_v min(p(v|x), q(v|x))] — the per-token acceptance rate of Leviathan et al.'s
speculative sampling (their α); the greedy agreement is P(argmax p = argmax q), the acceptance rate of
greedy verification. Both are averaged over positions of held-out test-split text.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from methods.core.bf16 import speed_dtype
from methods.data.corpus import corpus
from methods.data.workloads import load_prompts
from methods.zoo.greedy import greedy_extend
from methods.zoo.tokenizer import encode_documents
from methods.zoo.train import ThreadGovernor
from specsim.config import WorkloadConfig


@dataclass(frozen=True)
class HeldOut:
    target_ppl: float
    draft_ppl: float
    greedy_alpha: float  # P(argmax q == argmax p)
    sum_min_pq: float  # E[Σ_v min(p, q)] at temperature 1
    tokens: int
    # the same perplexities over the window's positions >= split_at only (None without a split): shows
    # whether late positions (long prompts) are modelled as well as early ones
    target_ppl_late: float | None = None
    draft_ppl_late: float | None = None
    split_at: int = 0


def eval_windows(stream: torch.Tensor, seq_len: int, n_tokens: int) -> torch.Tensor:
    """Non-overlapping windows spread evenly over a packed token stream. (n_windows, seq_len)"""
    n = max(1, min(n_tokens // seq_len, len(stream) // seq_len))
    starts = torch.linspace(0, len(stream) - seq_len, n).long()
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


@torch.inference_mode()
def held_out(
    target: PreTrainedModel, draft: PreTrainedModel, windows: torch.Tensor, split_at: int = 0, batch: int = 8
) -> HeldOut:
    """Perplexities of p and q on ``windows`` and their agreement on the same positions (fp32)."""
    nll_p, nll_q = [], []
    greedy = summin = 0.0
    for chunk in windows.split(batch):
        logp = target(input_ids=chunk).logits[:, :-1].float().log_softmax(-1)  # (B, T-1, V)
        logq = draft(input_ids=chunk).logits[:, :-1].float().log_softmax(-1)
        y = chunk[:, 1:, None]  # (B, T-1, 1)
        nll_p.append(-logp.gather(-1, y)[..., 0])  # (B, T-1)
        nll_q.append(-logq.gather(-1, y)[..., 0])
        greedy += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
        summin += torch.minimum(logp.exp(), logq.exp()).sum().item()
    p, q = torch.cat(nll_p), torch.cat(nll_q)  # (N, T-1): column j predicts token j+1

    def ppl(nll: torch.Tensor) -> float | None:
        return float(nll.mean().exp()) if nll.numel() else None

    late = slice(max(0, split_at - 1), None) if split_at else slice(0, 0)
    return HeldOut(
        target_ppl=ppl(p),
        draft_ppl=ppl(q),
        greedy_alpha=greedy / p.numel(),
        sum_min_pq=summin / p.numel(),
        tokens=p.numel(),
        target_ppl_late=ppl(p[:, late]),
        draft_ppl_late=ppl(q[:, late]),
        split_at=split_at,
    )


# ---- repetition loops ----------------------------------------------------------------------------------
LOOP_WINDOW = 32
LOOP_MAX_PERIOD = 16
LOOP_DEFINITION = (
    f"a greedy continuation loops when its last {LOOP_WINDOW} generated tokens repeat with some period "
    f"P <= {LOOP_MAX_PERIOD}: x[t] == x[t-P] for every t in the last {LOOP_WINDOW} positions (so the final "
    f"{LOOP_WINDOW}+P tokens are one P-token cycle, repeated >= 3 times); continuations shorter than "
    f"{LOOP_WINDOW}+P tokens (e.g. ended by <|endoftext|>) do not loop with period P"
)


def is_looping(tokens: list[int], window: int = LOOP_WINDOW, max_period: int = LOOP_MAX_PERIOD) -> bool:
    """Whether ``tokens`` end in a repeating cycle (see LOOP_DEFINITION)."""
    n = len(tokens)
    for period in range(1, max_period + 1):
        if n >= window + period and all(tokens[t] == tokens[t - period] for t in range(n - window, n)):
            return True
    return False


@torch.inference_mode()
def greedy_continuations(model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, eos_id: int
                         ) -> list[list[int]]:
    """Greedy continuations of equal-length prompts in one batch, each cut at its first eos."""
    ids = torch.tensor(prompts, dtype=torch.long)  # (B, P) — equal lengths, so no padding needed
    out = greedy_extend(model, ids, max_new_tokens)[:, ids.shape[1] :]
    conts = []
    for row in out.tolist():
        conts.append(row[: row.index(eos_id)] if eos_id in row else row)
    return conts


# ---- verification cost t(n) ---------------------------------------------------------------------------
def forward_times(model: PreTrainedModel, sizes: list[int], context: int, reps: int = 7) -> dict[int, float]:
    """Median wall time (ms) of the decode loop's verify forward over n tree tokens after a ``context``-token
    cache, for n in ``sizes``, on a copy of ``model`` in the zoo's decode dtype (bf16, or float32 where
    bf16 is slow here: ``methods.core.bf16``): ``methods.core.timing.verify_times``, the same timer as
    ``task=calibrate`` (two untimed rounds over all sizes, then ``reps`` rounds, sizes interleaved)."""
    from methods.core.engine import ModelEngine
    from methods.core.timing import verify_times

    m = copy.deepcopy(model).to(getattr(torch, speed_dtype("bfloat16"))).eval()
    ids = torch.randint(0, m.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    times = verify_times(ModelEngine(m, capacity=context + max(sizes)), ids, sizes, reps, warmup=2)
    return {n: 1e3 * t for n, t in times.items()}


# ---- the zoo's report ---------------------------------------------------------------------------------
def heldout_stream(tokenizer, kind: str) -> torch.Tensor:
    """The test split's documents of one kind, in module order, each preceded by eos. (T,) long"""
    docs = corpus("test", kind)
    out: list[int] = []
    for ids in encode_documents(tokenizer, [d.text for d in docs]):
        out += [tokenizer.eos_token_id, *ids]
    return torch.tensor(out, dtype=torch.long)


def loop_report(target: PreTrainedModel, tokenizer, kind: str, prompt_tokens: int, cfg) -> dict:
    """Loop rate of the target's greedy continuations of test prompts of one workload kind."""
    w = WorkloadConfig(name=kind, kind=kind, split="test", num_prompts=cfg.loop_prompts,
                       prompt_tokens=prompt_tokens, max_new_tokens=cfg.loop_new_tokens)
    prompts = load_prompts(w, tokenizer, seed=cfg.seed)
    eos = tokenizer.eos_token_id
    conts = greedy_continuations(target, [p.token_ids for p in prompts], w.max_new_tokens, eos)
    flags = [is_looping(c) for c in conts]
    return {
        "rate": sum(flags) / len(flags),
        "looping": sum(flags),
        "prompts": len(flags),
        "prompt_tokens": prompt_tokens,
        "new_tokens": w.max_new_tokens,
        "mean_continuation_tokens": sum(map(len, conts)) / len(conts),
        "looping_ids": [p.prompt_id for p, f in zip(prompts, flags) if f],
        "example": {"prompt_id": prompts[0].prompt_id, "prompt_tail": prompts[0].text[-300:],
                    "continuation": tokenizer.decode(conts[0])},
    }


def zoo_report(cfg, target: PreTrainedModel, draft: PreTrainedModel, tokenizer) -> dict:
    """Held-out perplexities and p/q agreement per text kind, loop rates per workload kind, t(n) curves."""
    heldout = {}
    with ThreadGovernor().active() as governor:  # quality figures do not depend on speed: avoid contention
        governor.update(0)
        for kind in ("code", "prose"):
            w = cfg.windows  # evaluate on the longest trained windows; report late positions apart
            stream = heldout_stream(tokenizer, kind)
            windows = eval_windows(stream, w.long_seq_len or w.seq_len, cfg.eval_tokens)
            split = w.seq_len if w.long_seq_len else 0
            heldout[kind] = dataclasses.asdict(held_out(target, draft, windows, split_at=split))
        loops = {kind: loop_report(target, tokenizer, kind, n, cfg) for kind, n in cfg.loop_workloads}
    # all threads: t(n) as the decode loop will see it (re-measure with `python -m methods.zoo retime`)
    t_n = {
        "loadavg_1min": os.getloadavg()[0],
        "dtype": speed_dtype("bfloat16"),
        "context": cfg.tn_context,
        "target_ms": forward_times(target, list(cfg.tn_sizes), cfg.tn_context),
        "draft_ms": forward_times(draft, list(cfg.tn_sizes), cfg.tn_context),
    }
    return {"heldout": heldout, "loop_rate": loops, "loop_definition": LOOP_DEFINITION, "t_n": t_n}
