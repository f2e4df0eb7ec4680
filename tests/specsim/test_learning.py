"""τ's law for a drafter that learns between requests (specsim.learning): each of the run's requests takes
the calibration loop's histogram at its own update count."""

from __future__ import annotations

import numpy as np
import pytest

from specsim.learning import order_spread, served_law, updates_at


def _tau(law: np.ndarray) -> float:
    return float(np.dot(np.arange(law.size), law))


def test_updates_at_counts_the_requests_before():
    assert [updates_at(r, 2) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert updates_at(9, 0) == 0  # never distils


def test_the_runs_requests_take_the_calibration_prompts_of_their_update_count():
    """Calibration prompts 0-1 decoded before any update accept nothing (10 steps each), prompts 2-3 after
    one accept both drafts of a chain of 2 (5 steps each). A run of 3 requests after one warm-up, updated
    every 2: its requests had 0, 1, 1 updates -> 10 steps at τ 1 and 10 at τ 3 (τ 2). The pooled calibration
    (what one law of the drafter as loaded, or of all prompts alike, reads) says 1 + 2·10/30 = 1.67."""
    hists = [[10, 0, 0], [10, 0, 0], [0, 0, 5], [0, 0, 5]]
    law = served_law(hists, [0, 0, 1, 1], every=2, first=1, n_requests=3)
    assert law.tolist() == pytest.approx([0.0, 0.5, 0.0, 0.5]) and _tau(law) == pytest.approx(2.0)
    pooled = np.sum(hists, axis=0)
    assert 1 + np.dot(np.arange(3), pooled) / pooled.sum() == pytest.approx(5 / 3)
    # a longer run than the calibration saw: its later requests keep the last recorded drafter
    longer = served_law(hists, [0, 0, 1, 1], every=2, first=1, n_requests=21)
    assert _tau(longer) == pytest.approx(1 + 2 * (20 * 5) / (10 + 20 * 5))
    # a drafter that never learns: every prompt alike, the pooled law
    flat = served_law(hists, [0, 0, 0, 0], every=0, first=1, n_requests=3)
    assert _tau(flat) == pytest.approx(5 / 3)


def test_the_spread_over_orders_is_that_of_each_orders_served_tau():
    """Two orders of the same two prompts, updated every request: order 0 learnt on the slow prompt first
    (τ 1 then 3 at one update), order 1 on the fast one (τ 3 then 2). A run of one request after one
    warm-up takes each order's second prompt: τ 3 and 2, spread sd/mean = 0.7071/2.5. One order: None."""
    hists = [[10, 0, 0], [0, 0, 5], [0, 0, 5], [0, 5, 0]]
    updates, orders = [0, 1, 0, 1], [0, 0, 1, 1]
    assert _tau(served_law(hists[:2], updates[:2], 1, 1, 1)) == pytest.approx(3.0)
    assert _tau(served_law(hists[2:], updates[2:], 1, 1, 1)) == pytest.approx(2.0)
    assert order_spread(hists, updates, orders, 1, 1, 1) == pytest.approx(np.std([3, 2], ddof=1) / 2.5)
    assert order_spread(hists, updates, [0, 0, 0, 0], 1, 1, 1) is None
    # the pooled mixture is the mean curve: its request takes both orders' one-update prompts
    assert _tau(served_law(hists, updates, 1, 1, 1)) == pytest.approx(1 + (2 * 5 + 1 * 5) / 10)
