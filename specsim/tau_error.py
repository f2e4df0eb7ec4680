"""τ's sampling error from per-step accepted lengths (issue 17): shared by the measurement loop's sequential
stopping rule (methods.measurement.measure) and the validation report (analysis.validation_terms).

τ = tokens per target forward (bonus included) = Σ accepted lengths / Σ steps over the decoded prompts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_PROMPTS = 8  # the sequential rule never stops before this many prompts: a ratio s.e. from fewer is itself
# too noisy to stop on (prompt lookup prose T = 1 stopped at 4 prompts on a 0.6% s.e.; 16 prompts read 0.7%)


def steady_lengths(lengths, n_tokens: int, depth: int) -> list[int]:
    """One generation's accepted lengths per step (root included, in order) without the steps whose draft
    the generation's end cut: a step with r < ``depth`` tokens left drafts at most r deep (the loop's
    ``ctx.max_new``, methods.core.loop.limit_depth), so it accepts at most r drafts whatever the acceptance.
    Which steps are kept depends on the earlier steps only, so the kept ones are steady-state steps."""
    return [length for _, length in steady_steps(lengths, n_tokens, depth)]


def steady_steps(lengths, n_tokens: int, depth: int) -> list[tuple[int, int]]:
    """:func:`steady_lengths` with each kept step's position: (tokens generated before it, its length)."""
    kept, done = [], 0
    for length in lengths:
        room = n_tokens - done
        if room >= depth:
            kept.append((done, int(length)))
        done += min(int(length), room)
    return kept


def lengths_standard_error(lengths: np.ndarray) -> float:
    """Standard error of the mean of per-step accepted lengths (steps as independent draws)."""
    return float(np.std(lengths, ddof=1) / np.sqrt(lengths.size)) if lengths.size >= 2 else float("nan")


def tau_prompt_standard_error(per_prompt) -> float:
    """Standard error of the measured τ = Σ tokens / Σ steps with the prompts as the sampled units
    (``per_prompt``: each prompt's accepted lengths per step, root included): the ratio estimator's
    sqrt(Σ (tokens_i − τ·steps_i)² / (n (n − 1))) / mean steps. Where τ is a property of the prompt (prompt
    lookup copies some prompts much more than others) the steps of one prompt are not independent draws:
    the step-wise error read 5.5% where the prompts' read 10.3% (prose, 4 prompts)."""
    if not isinstance(per_prompt, (list, tuple)) or len(per_prompt) < 2:
        return float("nan")
    tokens = np.array([sum(a) for a in per_prompt], dtype=float)
    steps = np.array([len(a) for a in per_prompt], dtype=float)
    if steps.min() < 1:
        return float("nan")
    tau, n = tokens.sum() / steps.sum(), len(steps)
    return float(np.sqrt(((tokens - tau * steps) ** 2).sum() / (n * (n - 1))) / steps.mean())


def by_cluster(per_prompt: Sequence[Sequence[int]], clusters: Sequence[str]) -> list[list[int]]:
    """The prompts' accepted lengths merged per cluster (in first-seen order): the sampled units where the
    prompts of one cluster are alike. Clusters here are the prompts' source modules: a workload draws its
    prompts round-robin over its split's modules (methods.data.workloads), so past one prompt per module more
    prompts add functions of the same modules (prose: 24 modules; the module-wise error read up to 1.5x the
    prompt-wise one on 128 prompts, docs/validation.md)."""
    merged: dict[str, list[int]] = {}
    for lengths, cluster in zip(per_prompt, clusters, strict=True):
        merged.setdefault(cluster, []).extend(int(x) for x in lengths)
    return list(merged.values())


def tau_cluster_standard_error(per_prompt: Sequence[Sequence[int]], clusters: Sequence[str]) -> float:
    """τ's standard error with the clusters as the sampled units (:func:`tau_prompt_standard_error` of
    :func:`by_cluster`; prompts without a step left out); NaN below two clusters."""
    kept = [(lengths, c) for lengths, c in zip(per_prompt, clusters, strict=True) if len(lengths)]
    return tau_prompt_standard_error(by_cluster([lengths for lengths, _ in kept], [c for _, c in kept]))


def tau_relative_standard_error(per_prompt: Sequence[Sequence[int]],
                                clusters: Sequence[str] | None = None) -> float:
    """τ's standard error over τ: the largest of the step-wise, the prompt-wise (steps of one prompt are not
    independent where τ is a property of the prompt) and, given each prompt's ``clusters`` label, the
    cluster-wise error (:func:`tau_cluster_standard_error`; NaN, so left out, below two clusters); NaN below
    two prompts or two steps."""
    per_prompt = [list(p) for p in per_prompt]
    flat = np.concatenate([np.asarray(p, dtype=float) for p in per_prompt]) if per_prompt else np.zeros(0)
    if len(per_prompt) < 2 or flat.size < 2:
        return float("nan")
    tau = float(flat.mean())
    se = np.fmax(lengths_standard_error(flat), tau_prompt_standard_error(per_prompt))
    if clusters is not None:
        se = np.fmax(se, tau_cluster_standard_error(per_prompt, clusters))
    return float(se / tau) if tau > 0 else float("nan")


def precise_enough(per_prompt: Sequence[Sequence[int]], target: float,
                   min_prompts: int = MIN_PROMPTS, clusters: Sequence[str] | None = None) -> bool:
    """The sequential rule: stop decoding prompts once at least ``min_prompts`` are decoded and τ's relative
    standard error (:func:`tau_relative_standard_error`, module-wise where ``clusters`` are given) is at most
    ``target`` (a NaN error — every step alike over too few — never stops it before ``min_prompts``; at or
    past them a zero-variance τ stops it)."""
    if len(per_prompt) < max(min_prompts, 2):
        return False
    se = tau_relative_standard_error(per_prompt, clusters)
    return bool(np.isfinite(se) and se <= target)
