"""The cost table of a profile from interleaved timing rounds: t(n)/t(1), t_draft/t(1) and the loop's
verification per speculation step / t(1), as medians of per-round ratios, and how much the rounds scattered.

t(1) is the decode loop's autoregressive step (what the simulator calls t_AR, and what a run's own baseline
pays per token). Every round (methods.core.timing.interleaved) times one autoregressive decode, one decode
with the drafter and one tree forward per size, so a ratio compares costs taken on the same machine state;
a busy phase that hits some rounds moves t(1) but not the ratios, and shows as dispersion. Speedup
predictions depend on the ratios only (S = k̄ · t(1) / t_step, every term of t_step a multiple of t(1)).

The calibration times ``calibration.reps`` rounds, then more (up to ``max_reps``) while
:func:`ratio_standard_error` says a ratio's median is less precise than ``median_se``.

A profile whose timings still scatter beyond :data:`MAX_TIMING_DISPERSION` after :data:`TIMING_ATTEMPTS`
timings is used by the run that measured it but never cached (methods.measurement.calibrate).
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from methods.core.timing import median_standard_error, ratios, relative_iqr, series

# Relative IQR (Q3 − Q1) / median over the timing rounds above which a series counts as scattered. On the
# shared 2-core development machine quiet calibrations of the zoo read 2–10%; a machine loaded for part of
# the rounds splits them into two groups and reads far above (one core busy for half the rounds: ~60%+).
MAX_TIMING_DISPERSION = 0.25
TIMING_ATTEMPTS = 2  # a scattered timing is measured again once before the profile is kept out of the cache

T_AR, DRAFT, VERIFY = "t_ar", "draft", "verify"  # a round's loop figures; its tree forwards are keyed by n
SHARED = "shared"  # self-speculation's verify forward of the loop's chain resumed on the draft's shared KV
# (VSTEP, n) / (VCHAIN, n): the loop's verification of an n-node tree / chain from its logits (0: its tree)
VSTEP, VCHAIN = "vstep", "vchain"
QLEVEL = "qlevel"  # (QLEVEL, w): one draft level fed w nodes (draft forward + choice of the children)
# a one-pass drafter's proposal (Medusa's heads) timed per tree: (QPASS_CHAIN, d) on a chain of d drafts,
# (QPASS, n) on a tree of n nodes as deep as the drafter drafts
QPASS_CHAIN, QPASS = "qpass_chain", "qpass"
# (QSHAPE, name): the drafter's draft per speculation step in the decode loop on the tree ``name``
# (methods.measurement.calibrate.DRAFT_SHAPES; "loop": the calibration's own chain)
QSHAPE = "qshape"
# (QFIRST, name): on that shape's decodes, the first step's proposal beyond a later step's: work a drafter
# does once per generation in its first step (EAGLE's head appends the prompt's rows to its cache there: 3-4
# t(1) on the 384-token grounded prompts, ~1 on the 128-token ones), which QSHAPE leaves out of its per-step
# figure
# (methods.measurement.calibrate.FirstDraftTimer; profiles.first_draft_s prices it per generation)
QFIRST = "qfirst"
# (VLOOP, n): the loop's verification per speculation step (verify forward and walk) with the drafter built
# on a wide tree of n nodes, beside VERIFY on its own tree: how the forward's excess over the timed t(n)
# grows with the tree (methods.measurement.profiles.forward_excess_ratio)
VLOOP = "vloop"
# (VSIZES, n): how many of the round's loop steps (the ``verify`` figure's decode) forwarded n tokens, root
# included: a drafter whose drafts vary by step pays its verification on these forwards, which need not be the
# depth run's (Lookahead's pool fills as a generation goes on: a mean 29.8 tokens over the timed rounds' 32
# new tokens, 32.9 over 48)
VSIZES = "vsizes"


@dataclass(frozen=True)
class CostTable:
    t1_s: float  # median over the rounds of the loop's autoregressive step
    t_n_ratios: dict[int, float]  # n → median of the rounds' t_forward(n) / t(1)
    draft_ratio: float  # median of the rounds' draft step / t(1)
    verify_ratio: float  # median of the rounds' loop verification per speculation step / t(1)
    dispersion: dict[str, float]  # relative IQR of each series: "t1" (seconds), the others as ratios
    rounds: int
    shared_ratio: float = 0.0  # median of the rounds' shared-cache verify forward / t(1); 0 = not timed
    # (shape, n) → median of the rounds' verification (logits → accepted path) of an n-node draft / t(1);
    # (VSTEP, 0) = the loop's own tree. Not in ``dispersion``: ~0.1 ms figures, no verdict on the rounds
    verify_step_ratios: dict[tuple[str, int], float] = field(default_factory=dict)
    # n → the loop's verify forwards of n tokens over the timed rounds (VSIZES; empty where not counted)
    verify_sizes: dict[int, float] = field(default_factory=dict)
    # the rounds' own figures (round_series: "t1" in seconds, the others as ratios), kept for inspection: how
    # a statistic or a number of rounds would have read them
    series: dict[str, list[float]] = field(default_factory=dict)

    @property
    def worst(self) -> tuple[str, float]:
        """The most scattered series and its relative IQR."""
        return max(self.dispersion.items(), key=lambda kv: kv[1], default=("", 0.0))

    def verify_overhead_ratio(self, tree_size: int, forward: float | None = None) -> float:
        """The loop's verification beyond the verify forward of its tree, / t(1) (0 without a tree): beyond
        the shared-cache forward where one was timed (the forward the loop runs), else beyond ``forward``
        where given (the mean t(k) / t(1) of the forwards the timed loop ran, when their sizes varied)."""
        forward = self.shared_ratio or forward or self.t_n_ratios[tree_size]
        return max(0.0, self.verify_ratio - forward) if tree_size > 1 else 0.0


def round_series(rounds: Sequence[Mapping[Hashable, float]]) -> dict[str, list[float]]:
    """The series a table's dispersion is read on, per round: "t1" (seconds) and the ratios to the round's
    t(1) of the loop's figures, the tree forwards and the drafter's timed passes and shapes (a one-pass
    drafter's passes price its draft on every other tree, 0.3–1 t(1) each, as the loop's drafts per tree
    shape price a level-by-level drafter's, unlike the ~0.1 ms verification walks: a busy phase that hits
    them makes no profile either)."""
    sizes = sorted(k for k in rounds[0] if isinstance(k, int))
    out = {"t1": series(rounds, T_AR)}
    out.update({f"{k}/t1": ratios(rounds, k, T_AR) for k in (DRAFT, VERIFY, SHARED) if k in rounds[0]})
    out.update({f"t({n})/t1": ratios(rounds, n, T_AR) for n in sizes})
    out.update({f"{k[0]}({k[1]})/t1": ratios(rounds, k, T_AR) for k in rounds[0]
                if isinstance(k, tuple) and k[0] in (QPASS_CHAIN, QPASS, QSHAPE, VLOOP)})
    return out


def ratio_standard_error(rounds: Sequence[Mapping[Hashable, float]]) -> float:
    """The largest relative standard error (timing.median_standard_error) of the medians of the rounds'
    ratios to t(1), the figures a prediction prices with (t(1) itself scatters with the machine's load,
    which the ratios cancel); inf before two rounds."""
    return max((median_standard_error(v) for k, v in round_series(rounds).items() if k != "t1"),
               default=float("inf"))


def cost_table(rounds: Sequence[Mapping[Hashable, float]]) -> CostTable:
    """Medians of per-round ratios to the round's own t(1) (key ``t_ar``); ``draft`` and ``verify`` keys and
    int keys (tree forwards of n tokens) are optional per table but must be in every round."""
    assert rounds, "no timing round"
    sizes = sorted(k for k in rounds[0] if isinstance(k, int))
    t1 = series(rounds, T_AR)
    per = {n: ratios(rounds, n, T_AR) for n in sizes}
    loop = {k: ratios(rounds, k, T_AR) for k in (DRAFT, VERIFY, SHARED) if k in rounds[0]}
    named = round_series(rounds)
    dispersion = {k: relative_iqr(v) for k, v in named.items()}
    med = {k: statistics.median(v) for k, v in loop.items()}
    kinds = (VSTEP, VCHAIN, QLEVEL, QPASS_CHAIN, QPASS, QSHAPE, QFIRST, VLOOP)
    steps = {k: statistics.median(ratios(rounds, k, T_AR)) for k in rounds[0]
             if isinstance(k, tuple) and k[0] in kinds}
    counted: dict[int, float] = {}  # counts, not times: summed over the rounds (a round may lack a size)
    for r in rounds:
        for k, c in r.items():
            if isinstance(k, tuple) and k[0] == VSIZES:
                counted[int(k[1])] = counted.get(int(k[1]), 0.0) + float(c)
    return CostTable(statistics.median(t1), {n: statistics.median(v) for n, v in per.items()},
                     med.get(DRAFT, 0.0), med.get(VERIFY, 0.0), dispersion, len(rounds), med.get(SHARED, 0.0),
                     steps, dict(sorted(counted.items())), named)


def scatter_reason(dispersion: Mapping[str, float], bound: float | None = None) -> str:
    """Why timings with this dispersion are not to be trusted ("" when they are); ``bound`` defaults to
    :data:`MAX_TIMING_DISPERSION`."""
    bound = MAX_TIMING_DISPERSION if bound is None else bound
    bad = {k: v for k, v in dispersion.items() if v > bound}
    if not bad:
        return ""
    shown = ", ".join(f"{k} {v:.0%}" for k, v in sorted(bad.items(), key=lambda kv: -kv[1]))
    return f"timings scattered over the rounds (relative IQR {shown} > {bound:.0%})"
