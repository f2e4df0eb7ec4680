"""The one decode loop of every method: propose → verify forward → accept → commit (p = target, q = draft).

Contract of methods.core.drafter: the target's cache holds x_1..x_{t-1}; the draft's root is x_t. Each step
runs ONE target forward over the draft tree (tree attention), a config-chosen verifier (methods.core.verify)
picks the accepted path and the bonus/corrected token, the path's KV is committed and the bonus becomes the
next root. The autoregressive baseline is the drafter proposing the root alone: same loop, same timers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from methods.core.drafter import Draft, DraftContext, Drafter, StepFeedback
from methods.core.engine import ModelEngine
from methods.core.metrics import AcceptStats
from methods.core.sampling import SamplingParams, probs, sample
from methods.core.verify import argmax_rows, greedy_path, verifier_params, verify
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree, subtree


@dataclass(frozen=True)
class DecodeOptions:
    verifier: Verifier = Verifier.greedy
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    max_new_tokens: int = 64
    eos_token_id: int | None = None
    verify_params: dict = field(default_factory=dict)  # e.g. typical acceptance's epsilon / delta

    @classmethod
    def for_method(cls, method: MethodConfig, sampling: SamplingParams, max_new_tokens: int,
                   eos_token_id: int | None = None) -> DecodeOptions:
        """The method's verifier with its parameters from ``method.params`` (typical acceptance's
        posterior_threshold / posterior_alpha): what measure and calibration decode the method with."""
        v = Verifier(method.verifier)
        return cls(v, sampling, max_new_tokens, eos_token_id, verifier_params(v, method.params))


@dataclass
class DecodeResult:
    token_ids: list[int]  # generated tokens (prompt excluded), cut at EOS (included) / max_new_tokens
    accepted_lengths: list[int]  # per step: accepted drafts + 1, as verified (before EOS / length cuts)
    stats: AcceptStats
    n_target_forwards: int
    time_draft_s: float  # propose + feedback
    time_verify_s: float  # target forward + verification + commit
    time_total_s: float  # the whole decode, prefill included
    stop: str  # "eos" | "length"
    time_prefill_s: float = 0.0  # the prompt's prefill (target, and the drafter's reset: a draft model's own)
    time_offline_s: float = 0.0  # the drafter's work between requests (Drafter.offline_seconds), in no timer


@torch.inference_mode()
def decode(
    target: ModelEngine, drafter: Drafter, prompt: torch.Tensor, opts: DecodeOptions,
    generator: torch.Generator,
) -> DecodeResult:
    """Decode one prompt ((T,) long, T ≥ 1) with ``drafter`` and ``opts.verifier``."""
    t_start = time.perf_counter()
    prompt = prompt.detach().to("cpu", torch.long).view(-1)
    n_prompt, max_new = prompt.numel(), opts.max_new_tokens
    want_hidden = bool(getattr(drafter, "needs_hidden_states", False))
    layers = tuple(getattr(drafter, "feature_layers", ()))
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    offline = getattr(drafter, "offline_seconds", 0.0)
    tokens, hidden, features = _start(target, drafter, prompt, max_new, (want_hidden, layers))
    sync()
    # work between requests (in reset) is no decoding work: out of the prefill and total times
    offline = getattr(drafter, "offline_seconds", 0.0) - offline
    t_start += offline
    res = DecodeResult([], [], AcceptStats(), 0, 0.0, 0.0, 0.0, "length", time.perf_counter() - t_start,
                       offline)
    t, end = n_prompt, n_prompt + max_new
    while t < end:
        t0 = time.perf_counter()
        ctx = DraftContext(tokens[:t], hidden, generator, end - t, features)
        draft = _propose(drafter, ctx, target.device)
        sync()
        t1 = time.perf_counter()
        out = target.forward_tree(draft.tokens, draft.tree, hidden=want_hidden, layers=layers,
                                  resume=draft.resume)
        checked = verification_draft(draft)  # the nodes that may be accepted (all, for most drafters)
        path, next_token = verify_step(checked, out.logits[: checked.tree.size], opts, generator)
        target.commit(path)
        t2 = time.perf_counter()
        res.n_target_forwards += 1
        res.accepted_lengths.append(len(path))
        res.stats.record(checked.tree, path)
        drafted = draft.tokens.tolist()
        new = [drafted[i] for i in path[1:]] + [next_token]
        new, stop = cut_block(new, end - t, opts.eos_token_id)
        tokens[t : t + len(new)] = torch.tensor(new, dtype=torch.long)
        t += len(new)
        res.time_verify_s += t2 - t1
        if stop:
            res.stop = stop
            res.time_draft_s += t1 - t0
            break
        hidden = out.hidden[list(path)] if want_hidden else None
        features = out.features[list(path)] if layers else None
        drafter.feedback(StepFeedback(draft, path, next_token, out.logits))
        sync()
        res.time_draft_s += t1 - t0 + time.perf_counter() - t2
    res.token_ids = tokens[n_prompt:t].tolist()
    res.time_total_s = time.perf_counter() - t_start
    return res


def _start(
    target: ModelEngine, drafter: Drafter, prompt: torch.Tensor, max_new: int, wants: tuple[bool, tuple]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Reset both sides, prefill x_1..x_{t-1}; the committed-token buffer and the prefill's hidden states
    and features (``wants`` = (hidden wanted, feature layers))."""
    want_hidden, layers = wants
    n_prompt = prompt.numel()
    assert n_prompt >= 1, "the prompt needs at least one token (the first root)"
    target.reset()
    target.check_fits(n_prompt + max_new)
    tokens = torch.empty(n_prompt + max_new, dtype=torch.long)  # committed sequence, host side
    tokens[:n_prompt] = prompt
    pre = target.prefill(prompt[:-1], hidden=want_hidden, layers=layers)
    attach = getattr(drafter, "attach", None)  # self-drafting: the drafter runs part of the target's engine
    if attach is not None:
        attach(target)
    drafter.reset(prompt)
    hidden = pre.hidden if (want_hidden and pre is not None) else None
    return tokens, hidden, (pre.features if (layers and pre is not None) else None)


def _propose(drafter: Drafter, ctx: DraftContext, device: torch.device) -> Draft:
    draft = limit_depth(drafter.propose(ctx), ctx.max_new)
    if draft.tokens.device != device:  # host-side drafters (n-gram lookup): verify on the device
        draws = None if draft.draws is None else draft.draws.to(device)
        draft = Draft(draft.tree, draft.tokens.to(device), draft.q, draft.n_verifiable, draws, draft.resume)
    return draft


def verify_step(
    draft: Draft, logits: torch.Tensor, opts: DecodeOptions, generator: torch.Generator
) -> tuple[tuple[int, ...], int]:
    """Accepted root-first path and next token. The root alone needs no verifier: the next token is the
    target's own (argmax, or a draw from the processed p), whatever the configured verifier."""
    if draft.tree.size == 1:
        if opts.sampling.greedy:
            return (0,), argmax_rows(logits[:1])[0]
        return (0,), sample(probs(logits[0], opts.sampling), generator)
    if opts.verifier == Verifier.greedy and opts.sampling.greedy:  # verify_greedy's result, on the host
        return greedy_path(draft.tree, draft.tokens.tolist(), argmax_rows(logits))
    p = probs(logits, opts.sampling)  # (N, V)
    result = verify(opts.verifier, draft, p, generator, **opts.verify_params)
    return tuple(result.accepted), int(result.next_token)


def verification_draft(draft: Draft) -> Draft:
    """The draft's verification tree: nodes 0..n_verifiable-1 (closed under ancestors), or the draft
    itself."""
    n = draft.verifiable
    if n == draft.tree.size:
        return draft
    keep = list(range(n))
    return draft.select(subtree(draft.tree, keep), keep)


def cut_block(new: list[int], room: int, eos: int | None) -> tuple[list[int], str]:
    """Truncate a step's tokens at the first EOS (kept) and to the room left; say why decoding stops."""
    if eos is not None and eos in new[:room]:
        return new[: new.index(eos) + 1], "eos"
    if len(new) >= room:
        return new[:room], "length"
    return new, ""


def limit_depth(draft: Draft, max_depth: int) -> Draft:
    """The draft without nodes deeper than ``max_depth`` (drafters should already respect ctx.max_new; this
    keeps positions inside the context whatever they do)."""
    tree = draft.tree
    if tree.size <= max_depth + 1 or tree.depth <= max_depth:  # size first: Tree.depth is not memoised
        return draft
    assert draft.resume is None, "a resumed draft (shared cache) must respect ctx.max_new itself"
    keep = [i for i in range(tree.size) if tree.depths[i] <= max_depth]  # closed under ancestors
    n_ver = None if draft.n_verifiable is None else sum(1 for i in keep if i < draft.n_verifiable)
    return draft.select(subtree(tree, keep), keep, n_ver)


def kept_nodes(tree: Tree, ok: Sequence[bool]) -> list[int]:
    """The nodes left when every node with ``ok`` False is dropped with its whole subtree (the root is always
    kept): ascending and closed under ancestors, ready for :func:`subtree`."""
    alive = [True] * tree.size
    for i in range(1, tree.size):  # parents precede children
        alive[i] = bool(ok[i]) and alive[tree.parents[i]]
    return [i for i in range(tree.size) if alive[i]]
