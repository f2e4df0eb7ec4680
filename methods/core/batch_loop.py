"""The decode loop over a batch: B sequences per target forward (p = target, q = draft).

Per step, as methods.core.loop.decode does for one sequence: the batched drafter proposes one tree per
active row (BatchDraft, padded to the largest), ONE target forward of the BatchEngine runs every row's tree,
each row is verified by the configured verifier (methods.core.verify, the one-sequence loop's
``verify_step``; greedy at temperature 0 is vectorised over rows), each row commits its own accepted path
(ragged: rows advance by different amounts) and its bonus token becomes its next root. Rows leave at EOS or
length (the last row moves into the slot); the next requests join then with ``continuous`` (continuous
batching), else when the whole batch has finished (static batches). Every row's output is the output of
decoding its prompt alone. A drafter's ``needs_hidden_states`` and ``feature_layers`` are asked of the one
target forward for every row at once (as the one-sequence loop asks them of its forward): each row's context
carries its accepted tokens' hidden states / features. Each row's drafter context carries a generator of the
row's own (``row_generator``, seeded from the run's generator as the row joins): a row's draft depends on its
own context alone, as when its prompt is decoded alone, never on the draws of the rows beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from methods.core.batch_engine import BatchEngine
from methods.core.drafter import (
    BatchContext,
    BatchDraft,
    BatchDrafter,
    BatchFeedback,
    DraftContext,
    leave_slot,
)
from methods.core.loop import (
    DecodeOptions,
    DecodeResult,
    cut_block,
    limit_depth,
    verification_draft,
    verify_step,
)
from methods.core.metrics import AcceptStats
from methods.core.verify import argmax_host
from specsim.config import Verifier
from specsim.tree import Tree


@dataclass
class BatchResult:
    results: list[DecodeResult]  # per request, in input order (times: the batch's, over the row's life)
    n_steps: int = 0  # batched target forwards
    row_steps: int = 0  # Σ over steps of the active rows
    time_draft_s: float = 0.0  # propose + feedback
    time_forward_s: float = 0.0  # the target forward alone
    time_verify_s: float = 0.0  # target forward + verification + commit
    time_prefill_s: float = 0.0  # rows' prompt prefills (target and drafter)
    time_total_s: float = 0.0
    # the process's CPU time (time.process_time) of the decode steps, of the drafter's propose + feedback
    # alone (the wall time_draft_s also holds the loop's own work around them) and of the target forward:
    # what a loaded machine distorts less than the wall times above
    cpu_steps_s: float = 0.0
    cpu_draft_s: float = 0.0
    cpu_forward_s: float = 0.0
    stats: AcceptStats = field(default_factory=AcceptStats)

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.results)


@dataclass
class _Row:
    """Loop-side state of one active row (host)."""

    request: int
    seq: torch.Tensor  # (T + max_new,) committed tokens
    host: np.ndarray  # seq's memory as a numpy array: the loop writes and reads single tokens through it
    start: int  # the prompt's length T
    t: int  # committed length
    end: int
    hidden: torch.Tensor | None
    features: torch.Tensor | None  # the drafter's feature_layers of the same tokens as hidden (EAGLE-3)
    result: DecodeResult
    joined: float
    generator: torch.Generator  # the row's own, for its drafter's draws (row_generator)


@torch.inference_mode()
def decode_batch(target: BatchEngine, drafter: BatchDrafter, prompts: list[torch.Tensor], opts: DecodeOptions,
                 generator: torch.Generator, continuous: bool = False) -> BatchResult:
    """Decode every prompt ((T,) long, T ≥ 1), up to ``target.max_rows`` at once."""
    t_start = time.perf_counter()
    want = (bool(drafter.needs_hidden_states), tuple(getattr(drafter, "feature_layers", ())))
    out = BatchResult([None] * len(prompts))  # type: ignore[list-item]
    queue = list(range(len(prompts)))[::-1]  # next request last
    rows: list[_Row] = []
    target.reset()
    while queue or rows:
        if queue and (continuous or not rows):
            _join(target, drafter, prompts, queue, rows, opts, want, out, generator)
        _step(target, drafter, rows, opts, generator, want, out)
    out.time_total_s = time.perf_counter() - t_start
    return out


def _join(target: BatchEngine, drafter: BatchDrafter, prompts: list[torch.Tensor], queue: list[int],
          rows: list[_Row], opts: DecodeOptions, want: tuple[bool, tuple[int, ...]], out: BatchResult,
          generator: torch.Generator) -> None:
    """The next requests fill the free rows: one prefill forward for all of them, then the drafter's; each
    new row gets its own generator (in request order). ``want``: (hidden states wanted, feature layers)."""
    t0 = time.perf_counter()
    want_hidden, layers = want
    new = [queue.pop() for _ in range(min(target.max_rows - target.rows, len(queue)))]
    ids = [prompts[i].detach().to("cpu", torch.long).view(-1) for i in new]
    assert all(x.numel() >= 1 for x in ids), "every prompt needs at least one token (the first root)"
    for x in ids:
        target.check_fits(x.numel() + opts.max_new_tokens)
    first = target.add(len(new))
    pre = target.prefill([x[:-1] for x in ids], rows=slice(first, first + len(new)), hidden=want_hidden,
                         layers=layers)
    drafter.join(ids)
    now = time.perf_counter()
    for j, (i, x) in enumerate(zip(new, ids)):
        n = x.numel()
        seq = torch.empty(n + opts.max_new_tokens, dtype=torch.long)
        seq[:n] = x
        hidden = pre.hidden[j, : n - 1] if (want_hidden and pre is not None) else None
        features = pre.features[j, : n - 1] if (layers and pre is not None) else None
        res = DecodeResult([], [], AcceptStats(), 0, 0.0, 0.0, 0.0, "length", now - t0)
        rows.append(_Row(i, seq, seq.numpy(), n, n, n + opts.max_new_tokens, hidden, features, res, t0,
                         row_generator(generator)))
    out.time_prefill_s += now - t0


def _step(target: BatchEngine, drafter: BatchDrafter, rows: list[_Row], opts: DecodeOptions,
          generator: torch.Generator, want: tuple[bool, tuple[int, ...]], out: BatchResult) -> None:
    c0, t0 = time.process_time(), time.perf_counter()
    want_hidden, layers = want
    ctxs = [DraftContext(r.seq[: r.t], r.hidden, r.generator, r.end - r.t, r.features) for r in rows]
    roots = torch.tensor([r.host[r.t - 1] for r in rows], dtype=torch.long)
    ca = time.process_time()
    draft = _limit(drafter.propose_batch(BatchContext(ctxs, roots)), [c.max_new for c in ctxs])
    c1, t1 = time.process_time(), time.perf_counter()
    fwd = target.forward_trees(draft.tokens, draft.trees, hidden=want_hidden, layers=layers)
    c2, t2 = time.process_time(), time.perf_counter()
    paths, nexts = verify_batch(draft, fwd.logits, opts, generator)
    target.commit(paths)
    t3 = time.perf_counter()
    drafted = draft.tokens.tolist()
    done = []
    for b, (r, path, nxt) in enumerate(zip(rows, paths, nexts)):
        tree = draft.tree(b)
        r.result.n_target_forwards += 1
        r.result.accepted_lengths.append(len(path))
        r.result.stats.record(tree, path)
        new, stop = cut_block([drafted[b][i] for i in path[1:]] + [nxt], r.end - r.t, opts.eos_token_id)
        r.host[r.t : r.t + len(new)] = new
        r.t += len(new)
        if stop:
            r.result.stop = stop
            done.append(b)
        else:
            if want_hidden:
                r.hidden = fwd.hidden[b, list(path)]
            if layers:
                r.features = fwd.features[b, list(path)]
    cf = time.process_time()
    drafter.feedback_batch(BatchFeedback(draft, paths, nexts, fwd.logits))
    c4, t4 = time.process_time(), time.perf_counter()
    for b in reversed(done):  # descending: the row moved into a freed slot is never a finished one
        _leave(target, drafter, rows, b, t4, out)
    out.n_steps += 1
    out.row_steps += len(paths)
    out.time_draft_s += (t1 - t0) + (t4 - t3)
    out.time_forward_s += t2 - t1
    out.time_verify_s += t3 - t1
    out.cpu_steps_s += c4 - c0  # rows leaving (their KV moved) are left out, as in the wall times
    out.cpu_draft_s += (c1 - ca) + (c4 - cf)
    out.cpu_forward_s += c2 - c1
    for r in rows:
        r.result.time_draft_s += (t1 - t0) + (t4 - t3)
        r.result.time_verify_s += t3 - t1


def row_generator(generator: torch.Generator) -> torch.Generator:
    """A joining row's own generator (same device), seeded by one draw from the run's ``generator``: the run
    stays reproducible from its seed, and a row's drafter draws (Lookahead's initial window, sampled drafts
    of per-row drafters) the same whatever rows decode beside it — as decoding its prompt alone with this
    generator. Verification keeps the run's generator."""
    seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
    return torch.Generator(generator.device).manual_seed(seed)


def _leave(target: BatchEngine, drafter: BatchDrafter, rows: list[_Row], b: int, now: float,
           out: BatchResult) -> None:
    r = rows[b]
    r.result.token_ids = r.seq[r.start : r.t].tolist()
    r.result.time_total_s = now - r.joined
    out.results[r.request] = r.result
    out.stats.merge(r.result.stats)
    target.remove(b)
    drafter.leave(b)
    leave_slot(rows, b)


def _limit(draft: BatchDraft, room: list[int]) -> BatchDraft:
    """Rows whose tree is deeper than the tokens they may still emit get it cut (drafters should already
    respect ctx.max_new; this keeps positions inside the context whatever they do)."""
    if min(room) >= max(t.depth for t in draft.trees):
        return draft
    drafts = [limit_depth(draft.row(b), room[b]) for b in range(len(room))]
    return BatchDraft.from_drafts(drafts)


# ---- verification ----------------------------------------------------------------------------------------
def verify_batch(draft: BatchDraft, logits: torch.Tensor, opts: DecodeOptions, generator: torch.Generator
                 ) -> tuple[list[tuple[int, ...]], list[int]]:
    """Every row's accepted root-first path and next token. Greedy verification at temperature 0 runs on
    all rows at once (one host sync); every other verifier runs per row (``verify_step``: the one-sequence
    loop's, same laws)."""
    plain = draft.drafts is None or all(d.n_verifiable is None for d in draft.drafts)
    if opts.sampling.greedy and Verifier(opts.verifier) == Verifier.greedy and plain:
        return _greedy_rows(draft, logits)
    paths, nexts = [], []
    for b in range(logits.shape[0]):
        checked = verification_draft(draft.row(b))
        path, nxt = verify_step(checked, logits[b, : checked.tree.size], opts, generator)
        paths.append(path)
        nexts.append(nxt)
    return paths, nexts


_PADDED: dict[tuple[Tree, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _padded(tree: Tree, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parents (n,), ancestor-or-self (n, n), depths (n,)) of the tree padded to n nodes; padded nodes are
    children of the root that never match (parent -1)."""
    key = (tree, n)
    hit = _PADDED.get(key)
    if hit is None:
        if len(_PADDED) >= 256:
            _PADDED.clear()
        parents = np.full(n, -1, dtype=np.int64)
        parents[1 : tree.size] = tree.parents[1:]
        anc = np.eye(n, dtype=bool)
        anc[: tree.size, : tree.size] = tree.ancestor_mask
        depths = np.zeros(n, dtype=np.int64)
        depths[: tree.size] = tree.depths
        hit = _PADDED[key] = (parents, anc, depths)
    return hit


def _greedy_rows(draft: BatchDraft, logits: torch.Tensor) -> tuple[list[tuple[int, ...]], list[int]]:
    """verify_greedy on every row at once: a node is acceptable when its token is the argmax of its parent
    and so is every ancestor's; the deepest acceptable node (lowest index among equals) ends the path. In
    numpy on the host (the loop needs the paths there anyway): a (B, n, V) row argmax takes ~100 µs and more
    as a PyTorch CPU op, a few µs per row in numpy; both return the first maximum."""
    b, n = draft.tokens.shape
    am = argmax_host(logits)  # (B, n)
    if n == 1:  # the autoregressive step
        return [(0,)] * b, am[:, 0].tolist()
    trees = draft.trees if len(draft.trees) == b else draft.trees * b
    if len(draft.trees) == 1:  # one tree for every row: broadcast
        parents, anc, depths = (x[None] for x in _padded(trees[0], n))
    else:
        parts = [_padded(t, n) for t in trees]
        parents, anc, depths = (np.stack([p[i] for p in parts]) for i in range(3))
    # (B or 1, n), -1 for the root and padding; (B or 1, n, n); (B or 1, n)
    tokens = draft.tokens.cpu().numpy()
    match = (tokens == np.take_along_axis(am, np.broadcast_to(parents.clip(0), (b, n)), 1)) & (parents >= 0)
    match[:, 0] = True
    ok = ~(anc & ~match[:, None, :]).any(-1)  # (B, n): every node of the path matches
    best = np.where(ok, depths, -1).argmax(-1)  # (B,) first maximum: lowest index
    nxt = am[np.arange(b), best]
    return [t.path_to(i) for t, i in zip(trees, best.tolist())], nxt.tolist()
