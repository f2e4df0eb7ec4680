"""τ's law for a drafter that learns between requests (Online SD, Liu et al. 2023), from its calibration loop.

p = target, q = draft. Online SD distils q on p every ``every`` served requests, so its acceptance is not one
law but a function of how many updates the drafter has had when it decodes a request. A calibration that
draws q's law once (star trees of the drafter as loaded) prices the drafter of the run's first requests only:
on the quiet zoo7 sweep Online grounded T = 0 read τ −12.9% (16 prompts): its first 7 measured requests
accepted 0.0–0.10 drafts per step, the 9 after the first update 0.35–0.6.

Here the calibration decodes its prompts through the real loop with one drafter, as a run serves its
requests (methods.measurement.calibrate: ``loop_accept_hist_by_prompt`` and ``loop_updates_by_prompt``), and
a run's law is the mixture over its own requests: the j-th measured request (after ``first`` earlier ones,
the warm-up's) has had ⌊(first + j) / every⌋ updates and contributes the mean histogram of the calibration
prompts decoded after as many updates (the most the calibration reached, where the run goes further).

What a drafter learns depends on the order it served its requests in: one pass of the calibration prompts is
one trajectory, and on the zoo (code, T = 0, 128 requests) three calibrations of one split predicted τ 1.495,
1.554 and 1.569 while three test runs read 1.708, 1.640 and 1.643. The calibration therefore decodes its
prompts in several orders, each with a fresh drafter (``loop_order_by_prompt``): the mixture pools them (the
curve expected over orders) and :func:`order_spread` is the spread of one trajectory's τ, a term of the
error of the prediction (the mean of the orders') and of the measurement (one trajectory).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def updates_at(request: int, every: int) -> int:
    """Updates a drafter distilling every ``every`` requests has had when it decodes request ``request``
    (0-based: the requests before it, ⌊request / every⌋)."""
    return request // every if every > 0 else 0


def served_law(hists: Sequence[Sequence[int]], updates: Sequence[int], every: int, first: int,
               n_requests: int) -> np.ndarray:
    """(D + 2,) pmf of τ (accepted drafts + the bonus; pmf[0] = 0) over the steps of ``n_requests``
    requests decoded after ``first`` others by a drafter updated every ``every`` requests. ``hists[i][k]``:
    steps of calibration prompt i that accepted k drafts; ``updates[i]``: the drafter's updates when it
    decoded prompt i. Each request adds the mean histogram (in steps) of the calibration prompts at its update
    count, so a request whose drafter accepts more (fewer steps) weighs as it does in a pooled τ."""
    assert hists and len(hists) == len(updates), "one update count per calibration prompt"
    assert n_requests > 0 and first >= 0
    width = max(len(h) for h in hists)
    table = np.zeros((len(hists), width))
    for i, h in enumerate(hists):
        table[i, : len(h)] = h
    counts = np.asarray(updates, dtype=int)
    recorded = sorted(set(counts.tolist()))
    total = np.zeros(width)
    for j in range(n_requests):
        want = updates_at(first + j, every)
        have = max([u for u in recorded if u <= want], default=recorded[0])
        total += table[counts == have].mean(axis=0)
    assert total.sum() > 0, "no step in the calibration's histograms"
    return np.concatenate([[0.0], total / total.sum()])


def order_spread(hists: Sequence[Sequence[int]], updates: Sequence[int], orders: Sequence[int], every: int,
                 first: int, n_requests: int) -> float | None:
    """Relative standard deviation (ddof 1) over the calibration's orders of the served τ each order alone
    predicts (:func:`served_law` on its prompts); ``orders[i]``: the order prompt i was decoded in. None
    with fewer than two orders."""
    assert len(orders) == len(hists) == len(updates), "one order per calibration prompt"
    taus = []
    for r in sorted(set(orders)):
        mine = [i for i, o in enumerate(orders) if o == r]
        law = served_law([hists[i] for i in mine], [updates[i] for i in mine], every, first, n_requests)
        taus.append(float(np.dot(np.arange(law.size), law)))
    if len(taus) < 2:
        return None
    return float(np.std(taus, ddof=1) / np.mean(taus))
