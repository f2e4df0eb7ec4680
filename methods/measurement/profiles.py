"""Measured profiles of speculative decoding on this device, after Sequoia (Chen et al. 2024).

A profile holds what task=calibrate measured for one (model, drafter, workload, device, dtype), p = target and
q = draft: Sequoia's positional acceptance vector [0, p_1, …, p_W, p_none], per-depth acceptance α_d, the
target's verify time t(n), the draft step time and t_AR. Cached as JSON in <cache root>/profiles/<key>.json
(cache root: $SPECSIM_CACHE, else ~/.cache/specsim); tree=sequoia and hardware=cpu validation read them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import hashlib
import json
import platform
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from methods.measurement.draft_shapes import DRAFT_SHAPES, LOOP_SHAPE, WIDE_SHAPE, wide_tree
from specsim.acceptance import PositionalAcceptance, from_config
from specsim.adaptive_exit import ConfidenceTable, ExitRule, RunPrediction, replay_path, threshold_path
from specsim.config import AcceptanceKind, RunConfig, TreeConfig, TreeKind, Verifier
from specsim.cost import CostModel, DraftCost, MeasuredCost
from specsim.expected import accepted_length_law, tokens_per_forward
from specsim.io import atomic_write_json, read_json
from specsim.learning import order_spread, served_law
from specsim.multidraft import Replay, accepted_law, member_and_union
from specsim.predict import Prediction, simulate
from specsim.replay import RankRuns, flips_integrated, hit_vectors, loop_law
from specsim.run_steps import RunShares, room_mean, run_shares
from specsim.tree import Tree, cut
from specsim.trees import build_tree, recorded_law

PROFILE_FORMAT = 10  # bump when what a profile means changes (8: 24 prompts; 9: costs as ratios of t(1) from
# interleaved rounds, their dispersion, the stale mark; 10: the one-sequence engine's bf16 KV cache under
# float32 attention, methods.core.mixed_attention, and the compiled forward in the key)


@dataclass(frozen=True)
class Profile:
    """What task=calibrate measured. Costs are kept as ratios of t(1) — the loop's autoregressive step
    ``t_ar_s`` — taken round by round in interleaved timing (methods.core.timing.interleaved): a machine
    busier in some rounds than in others moves t(1) but not the ratios. The absolute costs (``t_n``,
    ``draft_time_s``, ``verify_overhead_s``) are the ratios times ``t_ar_s``; :meth:`with_t1` re-anchors them
    on another run's own t(1)."""

    acceptance_vector: tuple[float, ...]  # [0, p_1, …, p_W, p_none], sums to 1
    acceptance_by_depth: tuple[float, ...]  # α_d of the drafter's chain/tree in the real loop, d = 1, 2, …
    t_ar_s: float  # t(1): one autoregressive step of the decode loop (forward + next token + commit), median
    t_n_ratios: dict[int, float]  # n tree tokens → one target verify forward / t(1) (median of round ratios)
    draft_ratio: float  # one draft step (a draft forward per level, or one single-pass drafter's pass) / t(1)
    model: str
    drafter: str
    workload: str
    device: str
    dtype: str
    width: int  # W
    n_positions: int  # star trees verified
    created: str
    key: str = ""
    max_draft_depth: int = 0  # levels the drafter can fill below the root (Medusa: its heads); 0 = unbounded
    extra: dict[str, Any] = field(default_factory=dict)  # counts, loop figures, timings of the calibration
    # one vector per depth for drafters whose depth-d children have their own law (Medusa: head d); else ()
    acceptance_vectors_by_depth: tuple[tuple[float, ...], ...] = ()
    # per speculation step, the loop's verification work beyond the verify forward t(n), / t(1): the target's
    # choices, the accept walk, the KV commit, the bookkeeping (loop verify time - t(n) of the loop's tree)
    verify_overhead_ratio: float = 0.0
    # relative IQR over the timing rounds of each series behind the costs (t1: absolute; others: ratios)
    timing_dispersion: dict[str, float] = field(default_factory=dict)
    stale: str = ""  # set by a later run whose own t(1) disagreed (why): ensure_profile measures again

    @property
    def t_n(self) -> dict[int, float]:
        """n → seconds of one target verify forward, at this profile's t(1)."""
        return {n: r * self.t_ar_s for n, r in self.t_n_ratios.items()}

    @property
    def draft_time_s(self) -> float:
        return self.draft_ratio * self.t_ar_s

    @property
    def verify_overhead_s(self) -> float:
        return self.verify_overhead_ratio * self.t_ar_s

    @property
    def worst_dispersion(self) -> float:
        return max(self.timing_dispersion.values(), default=0.0)

    def with_t1(self, t1_s: float) -> Profile:
        """The same ratios anchored on another t(1) (a run's own autoregressive step)."""
        return dataclasses.replace(self, t_ar_s=float(t1_s))

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["t_n_ratios"] = {str(n): t for n, t in sorted(self.t_n_ratios.items())}  # JSON keys are strings
        out["t_n_s"] = {str(n): t for n, t in sorted(self.t_n.items())}  # for the reader; not read back
        return {"format": PROFILE_FORMAT, **out}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Profile:
        doc = dict(doc)
        if doc.pop("format", None) != PROFILE_FORMAT:
            raise ValueError("profile format differs from this version's")
        doc.pop("t_n_s", None)
        doc["t_n_ratios"] = {int(n): float(t) for n, t in doc["t_n_ratios"].items()}
        doc["acceptance_vector"] = tuple(doc["acceptance_vector"])
        doc["acceptance_by_depth"] = tuple(doc["acceptance_by_depth"])
        by_depth = doc.get("acceptance_vectors_by_depth", ())
        doc["acceptance_vectors_by_depth"] = tuple(tuple(v) for v in by_depth)
        return cls(**doc)


# ---- where profiles live ------------------------------------------------------------------------------
def cache_root() -> Path:
    from methods.zoo.build import cache_root as zoo_cache_root  # one definition of $SPECSIM_CACHE

    return zoo_cache_root()


def device_name(device: str) -> str:
    """The device type and model, e.g. ``cpu:AMD EPYC 9R45`` or ``cuda:NVIDIA H100 80GB HBM3``: t(n) holds
    for this kind of device only."""
    import torch

    from methods.models import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return f"{dev.type}:{_cpu_model()}"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def model_identity(cfg: RunConfig) -> dict[str, Any]:
    """What determines the loaded weights: the zoo preset and its build key, a random model's dimensions,
    or checkpoint paths (not the simulator-only fields such as ``params``)."""
    m = cfg.model
    ident: dict[str, Any] = {"source": m.source, "dtype": m.dtype}
    if m.source == "zoo":
        from methods.zoo.build import preset, zoo_key

        ident.update(zoo=m.zoo, zoo_key=zoo_key(preset(m.zoo)), draft=m.draft_n_layers > 0)
    elif m.source == "random":
        keys = ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "intermediate_size", "vocab_size",
                "context_length", "draft_n_layers", "draft_hidden_size")
        ident.update({k: getattr(m, k) for k in keys})
    else:
        ident.update(path=_resolved(m.path), draft_path=_resolved(m.draft_path))
    return ident


def _resolved(path: str) -> str:
    return str(Path(path).resolve()) if path and Path(path).exists() else path


@dataclass(frozen=True)
class StarRule:
    """How a star tree's children are chosen and verified."""

    sample: bool  # W draws from q (draw_mode; else q's top-W, deterministic)
    verifier: Verifier

    @property
    def draw_mode(self) -> str:
        """methods.core.sampling.draw_candidates' mode of a sampled star: the run's drafters draw SpecInfer's
        children i.i.d. (with replacement), Sequoia's without."""
        return "with_replacement" if self.verifier == Verifier.specinfer else "without_replacement"

    @property
    def name(self) -> str:
        return f"{self.verifier.value}-{'sample' if self.sample else 'topk'}"


def star_rule(cfg: RunConfig) -> StarRule:
    """Temperature 0: top-W, greedy verification (the accepted rank is the rank of p's argmax, if there).
    Otherwise Sequoia's sampling without replacement and its verifier — unless the method verifies
    deterministic drafts (deterministic, or Medusa's lossy typical): then top-W with that verifier; or
    SpecInfer's, whose drafters draw children i.i.d. (with replacement: a later draw can repeat a rejected
    token, accepted with probability 0): then W i.i.d. draws and SpecInfer's rule. EAGLE's 26-node tree at
    T = 1 read τ +4.0% on 48 code prompts priced from Sequoia's stars (+3.9% exact)."""
    if cfg.workload.temperature == 0:
        return StarRule(False, Verifier.greedy)
    v = Verifier(cfg.method.verifier)
    if v in (Verifier.deterministic, Verifier.typical):
        return StarRule(False, v)
    return StarRule(True, Verifier.specinfer if v == Verifier.specinfer else Verifier.sequoia)


# drafters whose acceptance is measured through the decode loop (methods.measurement.calibrate): Lookahead
# (its trie has no ranked star) and prompt lookup: its matches come in runs (a copied span matches at
# every position of it), so star trees at every position of the trajectory weigh a span by its length
# where the loop visits it once per accepted chain — the loop's τ on the calibration split read 1.30 / 1.38
# (code / prose) where the stars read 1.48 / 1.58, and every prompt lookup row of the quiet sweep was
# optimistic (τ +1.4…+14%). Draft & Verify's adaptive exit is priced by its own law instead
# (specsim.adaptive_exit, from the calibration's confidence table): counting its early stops as rejections
# here too would price the exit twice. Online SD's q changes between requests (it distils on p every few):
# stars of the drafter as loaded price its first requests only; its loop decodes the calibration prompts as
# a run serves its requests, and a run's τ mixes them by the updates its own requests had (specsim.learning,
# served_law_for)
LOOP_ACCEPTANCE = frozenset({"lookahead", "prompt_lookup", "online"})


def key_document(cfg: RunConfig) -> dict[str, Any]:
    """Everything a profile is keyed by: model, drafter and its params with the star-tree rule, workload
    (the vector depends on the text and on the sampling; t(n) on the context length), the generation length
    its positions are read over (acceptance rises along a greedy generation: a profile of 64 tokens prices a
    run of 48 above its own positions), device, width. The number of prompts is not in it: a larger sample
    estimates the same acceptance (:func:`methods.measurement.calibrate.smaller_split`)."""

    w = cfg.workload
    loop = {"acceptance_from": "loop"} if cfg.method.drafter in LOOP_ACCEPTANCE else {}
    return {
        **loop,
        "format": PROFILE_FORMAT,
        "model": model_identity(cfg),
        "drafter": cfg.method.drafter,
        "params": cfg.method.params,
        "star": star_rule(cfg).name,
        "workload": {"name": w.name, "kind": w.kind, "prompt_tokens": w.prompt_tokens,
                     "context_tokens": cfg.calibration.context_tokens or w.context_tokens,
                     "temperature": w.temperature, "top_k": w.top_k, "top_p": w.top_p},
        "device": device_name(cfg.device),
        "threads": _threads(cfg.device),  # t(n) on a CPU depends on torch's thread count
        "torch": _torch_version(),  # ... and on its kernels
        "compile": bool(getattr(cfg, "compile", False)),  # the compiled forward's t(n) is not the eager one's
        "width": cfg.calibration.width,
        "new_tokens": cfg.calibration.new_tokens,
    }


def _torch_version() -> str:
    import torch

    return torch.__version__


def _threads(device: str) -> int | None:
    import torch

    from methods.models import resolve_device

    return torch.get_num_threads() if resolve_device(device).type == "cpu" else None


def profile_key(cfg: RunConfig) -> str:
    """Readable slug + a short hash of :func:`key_document`."""
    doc = json.dumps(key_document(cfg), sort_keys=True, default=str)
    digest = hashlib.sha256(doc.encode()).hexdigest()[:12]
    dev = device_name(cfg.device).split(":")[0]
    parts = (cfg.model.name, cfg.method.drafter, cfg.workload.name, dev, cfg.model.dtype, digest)
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", str(p)) for p in parts)


def profile_path(cfg: RunConfig, cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "profiles" / f"{profile_key(cfg)}.json"


# ---- load / save / ensure -----------------------------------------------------------------------------
def load_profile(cfg: RunConfig, cache: Path | None = None) -> Profile | None:
    """The cached profile of ``cfg``, or None (none yet, unreadable, or of an older format)."""
    path = profile_path(cfg, cache)
    if not path.is_file():
        return None
    try:
        return Profile.from_json(read_json(path))
    except (ValueError, TypeError, KeyError):  # corrupt or stale: recalibrate rather than fail
        return None


def save_profile(profile: Profile, path: Path) -> Path:
    return atomic_write_json(path, profile.to_json())


@contextlib.contextmanager
def profile_lock(path: Path) -> Iterator[None]:
    """Concurrent runs of a sweep wait for one calibration instead of each measuring."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class NotCalibrating(RuntimeError):
    """A run with ``calibration.cached_only`` found nothing cached that serves it."""


def refuse_unless_calibrating(cfg: RunConfig, why: str, path: Path) -> None:
    """Raise :class:`NotCalibrating` when ``cfg`` forbids measuring anew (``calibration.cached_only``)."""
    if cfg.calibration.cached_only:
        raise NotCalibrating(f"calibration.cached_only: the cache cannot serve this run ({why}; {path}); "
                             "refusing to calibrate anew")


def missing_budgets(profile: Profile, cfg: RunConfig) -> list[int]:
    return sorted(set(int(b) for b in cfg.tree.budgets) - set(profile.t_n))


# ---- the simulator's view -----------------------------------------------------------------------------
def to_measured_cost(profile: Profile, chain: bool = False) -> MeasuredCost:
    """This device's measured t(n), for specsim (``simulate(cfg, profile=...)``, ``CostModel.from_config``),
    priced as the decode loop pays it: t(1) — the simulator's t_AR — is the loop's own autoregressive step
    (``t_ar_s``: forward, next token, commit, bookkeeping, as the measured baseline); a tree of n > 1 nodes
    costs its verify forward in the loop plus the verifier's walk from its logits (``chain``: priced for
    chains, whose verification is cheaper). See :func:`loop_forward_excess`."""
    excess = loop_forward_excess(profile)
    table = {}
    for n, t in profile.t_n.items():
        if n <= 1:
            table[n] = t
        elif excess is None:  # profiles without the per-size walk: the loop's overhead, a constant
            table[n] = t + profile.verify_overhead_s + verify_growth_s(profile, n, chain)
        else:
            excess_s = forward_excess_ratio(profile, n) * profile.t_ar_s  # the loop's forward beyond t(n)
            table[n] = t + excess_s + verify_walk_s(profile, n, chain)
    if profile.t_ar_s > 0:
        table[1] = profile.t_ar_s  # the autoregressive step's own verification is in it already
    return MeasuredCost.from_mapping(table)


def loop_forward_excess(profile: Profile) -> float | None:
    """What the decode loop's verify forward costs beyond the timed one, in proportion: (the loop's verify
    time − t(f) − the verifier's walk v(0)) / t(f), f the loop's forward, all measured on the drafter's own
    tree. t(n) is timed back to back (warm: right after a forward of the same size); in the loop the
    drafter's work runs between two verify forwards and the forward pays for it (caches refilled) in
    proportion to its size: 0.12–0.39 t(f) on the zoo where the walk and the commit take 0.02–0.05.
    Priced as a constant, a 64-node Medusa tree's verification read 3–10% low on the quiet sweep and
    SpecInfer's 61 nodes 9–20% (docs/validation.md). None without the per-size walk timings (older
    profiles, vLLM's own engine): the constant overhead then. The excess at the loop's own tree; at other
    sizes :func:`forward_excess_ratio`."""
    steps = profile.extra.get("verify_step_ratios") or {}
    forward = profile.extra.get("loop_verify_forward_tokens")
    if profile.verify_overhead_ratio <= 0 or "0" not in steps or not forward:
        return None
    t_f = profile.t_n_ratios.get(int(forward))
    if not t_f:
        return None
    law, verify = _loop_forward_law(profile), profile.extra.get("verify_per_speculation_step_s")
    if law and verify and profile.t_ar_s > 0:  # the loop's forwards of several sizes: beside their mean t
        t_mean = loop_forward_ratio(profile)
        return max(0.0, (float(verify) / profile.t_ar_s - t_mean - float(steps["0"])) / t_mean)
    return max(0.0, (profile.verify_overhead_ratio - float(steps["0"])) / float(t_f))


def _loop_forward_law(profile: Profile) -> dict[int, float] | None:
    """The law of the forward sizes beside which the loop's verification is priced, where the drafter's
    drafts varied by step (``loop_verify_sizes``: :func:`varied_sizes`): the sizes the timed rounds' loop
    forwarded itself (``loop_verify_timed_sizes``, :func:`timed_forward_law`), or in a profile without them
    the depth run's when their mean is the forward its overhead was taken beside
    (``loop_verify_forward_tokens``, rounded); else None."""
    extra = profile.extra
    lengths = (extra.get("loop_new_tokens"), (extra.get("split_sizes") or {}).get("new_tokens"))
    timed = timed_forward_law(extra.get("loop_verify_sizes"), extra.get("loop_verify_timed_sizes"), lengths)
    if timed is not None:
        return timed
    law, forward = varied_sizes(extra.get("loop_verify_sizes")), extra.get("loop_verify_forward_tokens")
    if law is None or not forward:
        return None
    return law if round(sum(n * p for n, p in law.items())) == int(forward) else None


def varied_sizes(counts: Mapping | None) -> dict[int, float] | None:
    """The law of a loop's verify forward sizes from their counts (size → steps) where they varied: more
    than one size, each on at least SHORT_DRAFTS of the steps; None for a drafter of one size."""
    counts = {int(n): float(c) for n, c in (counts or {}).items()}
    total = sum(counts.values())
    if total <= 0 or sum(c >= SHORT_DRAFTS * total for c in counts.values()) < 2:
        return None
    return size_law(counts)


def size_law(counts: Mapping | None) -> dict[int, float] | None:
    """Counts (size → steps; keys str as stored, or int) as a law over the sizes; None where none."""
    counts = {int(n): float(c) for n, c in (counts or {}).items()}
    total = sum(counts.values())
    return {n: c / total for n, c in sorted(counts.items())} if total > 0 else None


def timed_forward_law(steady: Mapping | None, timed: Mapping | None,
                      lengths: tuple[int | None, int | None] = (None, None)) -> dict[int, float] | None:
    """Where a drafter's drafts vary by step (``steady``: the depth run's counts, :func:`varied_sizes`) and
    the depth run's generations had another length than the timed rounds' (``lengths``: their new tokens per
    prompt), the law of the forwards the calibration's timed loop ran (``timed``: the timing rounds' counts,
    cost_table.VSIZES), the ones its measured verification paid for; None otherwise (the depth run's law
    stands, :func:`_loop_forward_law`). A loop drafter's depth run decodes the workload's length (48 new
    tokens), the timed rounds calibration.new_tokens (32): beside the depth run's mean t(k), Lookahead's
    verification (its pool fuller over 48 new tokens: a mean forward of 32.9 tokens, 29.8 over 32) read
    below its own forwards, its excess clamped to 0 (zoo9, grounded and prose T = 0), and at T = 0 (a walk
    of ~0.003 t(1)) prompt lookup's loop verification beside t(round(mean)) could too (zoo9, grounded):
    every step priced at its back-to-back t(k), where the loop paid 7.5% above them (quiet, 16 prompts)."""
    if varied_sizes(steady) is None or None in lengths or lengths[0] == lengths[1]:
        return None
    return size_law(timed)


def mean_forward_ratio(t_n_ratios: Mapping[int, float], law: Mapping[int, float]) -> float:
    """E[t(k)] / t(1) over ``law`` (size → probability), t interpolated between the timed sizes."""
    table = MeasuredCost.from_mapping(t_n_ratios)
    return sum(p * float(table.time(n)) for n, p in law.items())


def loop_forward_ratio(profile: Profile) -> float:
    """The calibration loop's verify forward, / t(1): t(f) of its forward of f tokens, or where its drafts'
    sizes varied, their mean t(k) (prompt lookup's grounded T = 1 loop forwarded the root alone on 58% of
    its steps and 5 tokens on 40%: a mean t(k) 0.89 t(1) where t(round(2.65)) read 1.00; its overhead
    taken beside t(3) priced the loop's own verification 10% below what it measured)."""
    law = _loop_forward_law(profile)
    if law:
        return mean_forward_ratio(profile.t_n_ratios, law)
    return float(profile.t_n_ratios[int(profile.extra["loop_verify_forward_tokens"])])


def forward_excess_ratio(profile: Profile, n: int) -> float:
    """What the loop's verify forward of n nodes costs beyond the timed t(n), / t(1): E(f) = excess · t(f)
    at the loop's own forward of f tokens (:func:`loop_forward_excess`), and where the calibration timed
    the loop on a wide tree of N nodes (``loop_verify_wide``), E = its verification − the mean t(s) of its
    forwards' sizes s (``loop_verify_wide_sizes``: the generation's last steps draft fewer, a mean 27 of 32
    nodes for EAGLE's binary tree over 32 new tokens) − the walk of N nodes; between and beyond, E grows
    linearly in t(n) through the two (a slope ≥ 0, E ≥ 0). In
    proportion to t(n) (E(f) · t(n) / t(f)) where the wide tree was not timed. On the zoo, the bf16 cache
    read through its kernel made the excess nearly a constant per forward: in proportion, the quiet sweep's
    26–64-node trees read their verification +10% on average (30 rows; +0.6% with the float32 cache's
    SDPA, where the excess did grow with t(n))."""
    excess = loop_forward_excess(profile)
    if excess is None:
        return 0.0
    table = MeasuredCost.from_mapping(profile.t_n_ratios)
    t_n = float(table.time(n))
    wide = {int(k): float(v) for k, v in (profile.extra.get("loop_verify_wide") or {}).items()}
    t_f = loop_forward_ratio(profile)
    big = max(wide, default=0)
    if not t_f or big not in profile.t_n_ratios or profile.t_n_ratios[big] <= t_f:
        return excess * t_n
    sizes = {int(k): float(c) for k, c in (profile.extra.get("loop_verify_wide_sizes") or {big: 1}).items()}
    e_f = excess * t_f
    t_big = sum(c * float(table.time(k)) for k, c in sizes.items()) / sum(sizes.values())
    if t_big <= t_f:
        return excess * t_n
    e_big = max(0.0, wide[big] - t_big - verify_walk_s(profile, big) / profile.t_ar_s)
    slope = max(0.0, (e_big - e_f) / (t_big - t_f))
    return max(0.0, e_f + slope * (t_n - t_f))


def verify_walk_s(profile: Profile, n: int, chain: bool = False) -> float:
    """The verifier's walk from the logits of an n-node tree (``chain``: chain), timed per size in the
    calibration's rounds, plus :func:`cold_walk_ratio`; the loop's own tree's where n was not timed."""
    steps = profile.extra.get("verify_step_ratios") or {}
    shaped = (profile.extra.get("verify_chain_ratios") if chain else steps) or {}
    if str(n) not in shaped:
        return float(steps["0"]) * profile.t_ar_s
    return max(0.0, float(shaped[str(n)]) + cold_walk_ratio(profile)) * profile.t_ar_s


def cold_walk_ratio(profile: Profile) -> float:
    """What the first walk after a forward costs beyond the same walk timed warm, in t(1): v(0) − v_f,
    v(0) the loop tree's walk (timed first in a round, right after the round's forwards, as the loop walks
    right after its verify forward) and v_f the walk of the same shape and size timed later in the round
    (the chain series for a chain, else the tree series). The per-size walks are timed warm, one after
    another: at temperature 1 a 5-node chain's walk read 0.10-0.13 t(1) first and 0.06-0.08 later in the
    same round (sampling: the softmax over the vocabulary per node), so a walk priced from them missed
    ~0.04 t(1) per step of every loop at T = 1, its own chain included (verify +5..+9% on the quiet sweep).
    A constant per walk (the sizes' differences stay as timed). v(0) is bounded by the loop's whole
    measured verification beyond its forward (the walk is a part of it; prompt lookup's grounded T = 1
    profile timed v(0) 0.26 t(1) where the loop's overhead was 0.07): at the loop's own tree the price is
    then the loop's verification, whichever bound holds. 0 where the loop tree's size was not timed (older
    profiles) or no loop overhead is priced (vLLM's engine)."""
    extra = profile.extra
    steps = extra.get("verify_step_ratios") or {}
    size, depth = extra.get("loop_tree_size"), extra.get("loop_tree_depth")
    if "0" not in steps or not size or int(size) < 2 or profile.verify_overhead_ratio <= 0:
        return 0.0
    chains = extra.get("verify_chain_ratios") or {}
    same = chains.get(str(size)) if depth is not None and int(depth) == int(size) - 1 else None
    same = steps.get(str(size)) if same is None else same
    cold = min(float(steps["0"]), profile.verify_overhead_ratio)
    return 0.0 if same is None else cold - float(same)


def verify_growth_s(profile: Profile, n: int, chain: bool = False) -> float:
    """The loop's verification of an n-node tree (``chain``: an n-node chain) beyond that of the tree it was
    measured on (the drafter's chain): v(n) − v(loop tree), timed per size in the calibration's rounds
    (greedy verification tests every node's ancestors: a 64-node tree pays ~1 ms where a chain of 5 pays
    0.08). 0 for profiles measured before it was timed, or sizes it was not timed at."""
    steps = profile.extra.get("verify_step_ratios") or {}
    if profile.verify_overhead_ratio <= 0:  # no loop overhead priced (vLLM's engine verifies on its own)
        return 0.0
    shaped = profile.extra.get("verify_chain_ratios") if chain else steps
    if not shaped or str(n) not in shaped or "0" not in steps:
        return 0.0
    return (float(shaped[str(n)]) + cold_walk_ratio(profile) - float(steps["0"])) * profile.t_ar_s


def draft_levels(cfg: RunConfig, profile: Profile) -> MeasuredCost | None:
    """Seconds of one draft level by its width w (the nodes fed to the draft model), for drafters filling
    trees level by level with draft models: the level the loop measured on the drafter's chain (w = 1)
    scaled by the timed growth of the draft forward and the children's choice with w, r(w) / r(1) (every
    draft model runs each level: SpecInfer's members alike). In proportion, as the loop's verify forward
    (:func:`loop_forward_excess`): the loop's level costs more than the back-to-back timed one, 1.34× on the
    zoo's draft model, and a wider level pays that on its larger forward. A chain-measured level priced
    every level of a wide tree (Sequoia-32 at T = 1: 0.83 ms priced, 1.29 ms measured per level). None when
    the calibration did not time it."""
    ratios = profile.extra.get("draft_level_ratios") or {}
    if "1" not in ratios or cfg.method.draft_steps != "depth" or profile.draft_time_s <= 0:
        return None
    terms = draft_terms(profile)  # the loop's level beyond its constant and its nodes, where timed
    level = profile.draft_time_s if terms is None else terms[1] * profile.t_ar_s
    # a level fed w > 1 nodes, beyond its growth: e, and c per fed node beyond the first
    wide, fed = (0.0, 0.0) if terms is None else (terms[3] * profile.t_ar_s, terms[4] * profile.t_ar_s)
    base = float(ratios["1"])
    table = {int(w): level * float(r) / base + (wide + fed * (int(w) - 1) if int(w) > 1 else 0.0)
             for w, r in ratios.items()}
    return MeasuredCost.from_mapping(table)


def draft_terms(profile: Profile) -> tuple[float, float, float, float, float] | None:
    """The loop's draft per speculation step as F + a · Σ_levels g(w) + b · nodes + e · wide levels + c · Σ
    over the wide levels of (w − 1), in t(1): (F, a, b, e, c), the non-negative least squares over the shapes
    the calibration timed the drafter's loop on (its chain of D, a chain of 1, a star of 8, fans of 2 and
    of 4, and the 31-node wide tree its verification is timed on: six shapes, five terms; older profiles
    without the wide tree, five). The wide tree spans the trees priced (26-64 nodes, several levels fed
    3-8): fitted on the small shapes alone, the terms were extrapolated, and EAGLE-1's Sequoia-32 trees read
    their draft 22-57% high (calibrate.WIDE_SHAPE). g(w) is the timed level's growth with the nodes it is fed
    (``draft_level_ratios``, r(w) / r(1)), nodes are drafted below the root, and a wide level is one fed
    more than one node: its draft forward runs with a tree mask, which the back-to-back level timing does
    not show (the draft model's r(2) / r(1) read 0.94) and which cost the zoo's Sequoia trees 0.05-0.09 t(1)
    per such level. c is what each further fed node of it costs in the loop beyond the level's timed growth:
    SpecInfer's loop at T = 1 (3 draft models, sampled rows) paid 0.44 / 0.87 / 1.45 t(1) for a level fed
    2 / 4 / 8 nodes where its chain's level cost 0.49, while EAGLE-1's at T = 0 paid ~0.48 at each width
    (load, docs/validation.md). A term no timed shape tells apart is 0: without trees (a verifier of chains
    only) a carries the node; without the fans e and c are 0, and with the fan of 4 alone c is (an older
    calibration's). None where the shapes were not timed. Priced as the chain's draft / D per level,
    shallow trees read low (EAGLE-1's draft per step: 0.43 t(1) + 0.20 per level + 0.016 per node at T = 0
    on the quiet sweep's rows)."""
    shapes = profile.extra.get("draft_shape_ratios") or []
    if len({(int(s["levels"]), int(s["nodes"])) for s in shapes}) < 2:
        return None
    ratios = profile.extra.get("draft_level_ratios") or {}
    growth = MeasuredCost.from_mapping({int(w): float(r) / float(ratios["1"]) for w, r in ratios.items()}
                                       ) if "1" in ratios else MeasuredCost((1,), (1.0,))
    rows = []
    for s in shapes:
        fed = [int(w) for w in s.get("fed") or [1] * int(s["levels"])]
        tree = _shape_tree(s, fed)
        rows.append(_fit_row(fed, int(s["nodes"]), growth) if tree is None else
                    _loop_fit_row(profile, tree, growth))
    a = np.array(rows)
    told = [0, 1]
    for k in (2, 3, 4):  # each further term where the timed shapes tell it apart from those before
        if np.linalg.matrix_rank(a[:, [*told, k]]) == len(told) + 1:
            told.append(k)
    x = np.zeros(5)
    x[told] = nnls(a[:, told], np.array([float(s["ratio"]) for s in shapes]))[0]
    return float(x[0]), float(x[1]), float(x[2]), float(x[3]), float(x[4])


def _fit_row(fed: list[int], nodes: int, growth: MeasuredCost) -> list[float]:
    """The draft fit's regressors (draft_terms) of a step drafting levels fed ``fed``, ``nodes`` nodes."""
    if not fed:
        return [0.0] * 5  # nothing drafted: the step pays none of the draft's terms
    return [1.0, float(np.sum(growth.time(np.asarray(fed)))), float(nodes), float(sum(w > 1 for w in fed)),
            float(sum(w - 1 for w in fed if w > 1))]


def _shape_tree(shape: dict[str, Any], fed: list[int]) -> Tree | None:
    """The tree a timed shape's loop drafted (draft_shapes), or None where the record does not name one."""
    name, levels = shape.get("shape"), int(shape["levels"])
    tree = (Tree.from_parents(shape["parents"]) if shape.get("parents")  # recorded since the eleventh session
            else DRAFT_SHAPES.get(name) or (Tree.chain(levels) if name == LOOP_SHAPE else None)
            or (wide_tree(int(shape["nodes"]) + 1) if name == WIDE_SHAPE else None))
    widths = DraftCost(fed_width=True).widths(tree) if tree is not None else None
    return tree if widths == fed and tree.size - 1 == int(shape["nodes"]) else None


def _loop_fit_row(profile: Profile, tree: Tree, growth: MeasuredCost) -> list[float]:
    """The fit's regressors of the calibration's loop on ``tree`` as timed: the mean over its steps of a
    generation of the calibration's new_tokens, the cut last ones included (specsim.run_steps), rooms from
    the profile's vector on ``tree``. The loop's draft per step is such a mean: fitted as full steps, the
    terms read the cut steps' savings as a cheaper step (the 31-node wide tree: 15% of its calibration steps
    cut at 32 tokens), and a run's trees deeper than the calibration's chain were priced on them."""
    n_cal = int((profile.extra.get("split_sizes") or {}).get("new_tokens") or UNRECORDED_NEW_TOKENS)
    law = accepted_length_law(tree, PositionalAcceptance(tuple(profile.acceptance_vector)))
    drafts = DraftCost(fed_width=True)

    def row(d: int) -> list[float]:
        kept = cut(tree, d)
        return _fit_row(drafts.widths(kept), kept.size - 1, growth)

    return [float(x) for x in room_mean(law, n_cal, tree.depth, room_spare(profile), row)]


UNRECORDED_NEW_TOKENS = 32  # calibration.new_tokens of profiles that did not record their split (calibrate)


def room_spare(profile: Profile) -> int:
    """The calibrating preset's ``method.room_spare`` (specsim.run_steps), recorded by the calibration; 0 for
    profiles calibrated before it was (their loops' cut steps then read as drafting the room itself)."""
    return int(profile.extra.get("room_spare") or 0)


def measured_acceptance(cfg: RunConfig, profile: Profile, source: str = "vector") -> RunConfig:
    """A copy of ``cfg`` whose acceptance model is the measured one, by ``source``: the positional vector
    (``vector``; one per depth where the profile has them, e.g. Medusa's heads), the α_d of the drafter's
    chain/tree in the loop (``by_depth``), or the config's own model (``config``). Vectors are cut to the
    children a node can have (:func:`drafter_vector`)."""
    assert source in ("vector", "by_depth", "config"), f"unknown acceptance source {source!r}"
    out = copy.deepcopy(cfg)
    a = out.method.acceptance
    if source == "by_depth" and profile.acceptance_by_depth:
        a.kind, a.by_depth, a.calibrated = AcceptanceKind.table, list(profile.acceptance_by_depth), True
    elif source != "config":
        a.kind, a.calibrated = AcceptanceKind.vector, True
        a.vector = drafter_vector(cfg, profile.acceptance_vector)
        if profile.acceptance_vectors_by_depth:
            a.kind = AcceptanceKind.depth_vector
            a.by_depth_vectors = [drafter_vector(cfg, v) for v in profile.acceptance_vectors_by_depth]
    return out


def draft_pass_scale(profile: Profile, tree: Tree | None) -> float:
    """A one-pass drafter's pass on ``tree`` over its pass on the calibration loop's tree, from the
    proposals timed per tree in the calibration's rounds (``draft_pass_*_ratios``; 1 without them or
    without a tree). The pass of depth D and n nodes is priced as the timed chain of D drafts plus what a
    tree K deep grows by from D + 1 to n nodes (K the deepest chain timed; linear between the timed sizes,
    and past the largest at its last slope): Medusa runs one head per depth, and every node costs its
    token (and, sampled, its q row) whatever the depth. The loop's pass, timed on the calibration's chain,
    priced Medusa's 64-node tree's 10–22% low (quiet sweep): the same loop figure, scaled."""
    chains = {int(d): float(r) for d, r in (profile.extra.get("draft_pass_chain_ratios") or {}).items()}
    loop_depth = int(profile.extra.get("loop_tree_depth") or 0)
    if not chains or tree is None or tree.depth < 1 or loop_depth < 1:
        return 1.0
    k = max(chains)
    grown = {k + 1: 0.0, **{int(n): float(r) - chains[k]
                             for n, r in (profile.extra.get("draft_pass_tree_ratios") or {}).items()}}
    sizes = np.array(sorted(grown), dtype=float)
    extra = np.array([grown[int(n)] for n in sizes])

    def growth(n: int) -> float:  # a tree K deep of n nodes beyond the chain of K, 0 up to the chain's size
        if n <= sizes[0]:
            return 0.0
        if n <= sizes[-1] or sizes.size < 2:
            return float(np.interp(n, sizes, extra))
        slope = (extra[-1] - extra[-2]) / (sizes[-1] - sizes[-2])
        return float(extra[-1] + slope * (n - sizes[-1]))

    def one_pass(depth: int, size: int) -> float:
        depth = min(depth, k)
        return chains[depth] + max(0.0, growth(size) - growth(depth + 1))

    loop = one_pass(loop_depth, int(profile.extra.get("loop_tree_size") or loop_depth + 1))
    return one_pass(tree.depth, tree.size) / loop if loop > 0 else 1.0


def apply_profile(cfg: RunConfig, profile: Profile, acceptance: str = "vector", tree: Tree | None = None
                  ) -> RunConfig:
    """:func:`measured_acceptance`, priced with the measured draft time (a ratio of the measured t(1), the
    simulator's t_AR: per draft step for a drafter with one pass per level, else a fixed cost per
    speculation step; a one-pass drafter's pass on ``tree`` scaled from the loop's, :func:`draft_pass_scale`).
    Pair it with ``to_measured_cost(profile)``."""
    out = measured_acceptance(cfg, profile, acceptance)
    m = out.method
    ratio = profile.draft_time_s / float(to_measured_cost(profile).time(1))  # the simulator's t_AR units
    if m.draft_steps != "depth":
        ratio *= draft_pass_scale(profile, tree)
    m.draft_cost = "ratio"  # draft_time_s was measured per step of m.draft_steps (calibrate)
    m.draft_tokens_per_forward = 1.0  # ... with a second stage's savings in it (Staged SD)
    forward = profile.extra.get("loop_verify_forward_tokens")
    if forward and m.verify_extra_tokens:  # Lookahead: the forward the loop measured, not the full-pool bound
        m.verify_extra_tokens = max(0, int(forward) - int(profile.extra["loop_tree_size"]))
    terms = draft_terms(profile) if m.draft_steps == "depth" else None
    if terms is None:  # the loop's draft per step, timed over its generation's cut steps too: the full step's
        ratio /= calibration_cut_share(profile, one_pass=m.draft_steps != "depth")
    if terms is not None:  # the loop's constant per step and cost per node, and its level beyond them
        m.draft_fixed_ratio, m.draft_cost_ratio, m.draft_node_ratio = terms[:3]  # e, c: in draft_levels
    elif m.draft_steps == "depth":
        m.draft_cost_ratio, m.draft_fixed_ratio = ratio, 0.0
    else:
        m.draft_cost_ratio, m.draft_fixed_ratio = 0.0, ratio
    shared = profile.extra.get("shared_verify")
    if shared:  # self-speculation's shared cache: the timed saving replaces ρ_v = E / L
        m.verify_reuse_ratio, m.verify_saving_ratio = 0.0, min(0.99, max(0.0, float(shared["saving_ratio"])))
    return out


def calibration_cut_share(profile: Profile, one_pass: bool) -> float:
    """The calibration loop's draft per step (its draft seconds over its steps, per level: draft_time_s) over
    a full step's, for a drafter priced per level or per pass (no shapes timed, :func:`draft_terms` None):
    the loop decoded generations of the calibration's new_tokens, whose last steps drafted what their room let
    (specsim.run_steps), so its mean step is below the full step by their share (the loop's chain of 4 at
    32 tokens: ~12% of its steps cut). Rooms from the loop's own histogram of accepted drafts. 1.0 for a
    drafter whose draft forwards were counted (an adaptive exit: draft_time_s is per forward) or without a
    loop."""
    extra = profile.extra
    depth, hist = int(extra.get("loop_tree_depth") or 0), extra.get("loop_accept_hist") or []
    if depth < 1 or extra.get("exit_confidence") or sum(hist) <= 0:
        return 1.0
    law = np.concatenate([[0.0], np.asarray(hist, dtype=float) / float(sum(hist))])
    n_cal = int((extra.get("split_sizes") or {}).get("new_tokens") or UNRECORDED_NEW_TOKENS)
    cost = CostModel(MeasuredCost((1,), (1.0,)), DraftCost(ratio=1.0, one_pass=one_pass))
    return run_shares(cost, Tree.chain(depth), law, n_cal, room_spare(profile)).draft


def exit_prediction(cfg: RunConfig, profile: Profile, tree: Tree) -> RunPrediction | None:
    """A drafter with Draft & Verify's adaptive exit, calibrated: the rule's threshold and the law of its
    draft length over the run's tokens (specsim.adaptive_exit, warm-up decodes included as the run makes
    them), at most ``tree.depth`` drafts. None for other drafters or without the confidence table."""
    table = profile.extra.get("exit_confidence")
    if not table or cfg.method.drafter != "draft_verify" or tree.depth < 1:
        return None
    from methods.drafters.draft_verify import DraftVerifyParams

    dp = DraftVerifyParams.from_method(cfg.method)
    rule = ExitRule(dp.exit_threshold, dp.adaptive, dp.target_acceptance)
    w = cfg.workload
    tokens, skip = (cfg.warmup + w.num_prompts) * w.max_new_tokens, cfg.warmup * w.max_new_tokens
    runs = table.get("runs") or []
    if max((len(c) for confs, _ in runs for c in confs), default=0) >= tree.depth:
        # the rule replayed on the calibration's trajectories and the drafter's own chains (deep enough)
        return replay_path(runs, rule, tree.depth, tokens, skip, seed=cfg.seed)
    conf = ConfidenceTable(tuple(table["edges"]), tuple(table["mass"]), tuple(table["accept"]))
    return threshold_path(conf, rule, tree.depth, tokens, skip, generation=w.max_new_tokens)


def _exit_summary(base: dict[str, Any], run: RunPrediction, cost: CostModel, n_tokens: int
                  ) -> dict[str, Any]:
    step, draft = run.step_time(cost), run.draft_time(cost)  # the breakdown of the exit law's step, not the
    # full chain's (its t_draft_s read 8 draft forwards where the rule let 3.15 run); likewise the finite
    # run's cut: the chain's τ law (7.3 tokens per forward for a chain of 8) read a decode speedup 15% above
    # the steady one where the cut lowers the tokens per forward
    return {**base, "predicted_tau": run.tau, "predicted_speedup": run.speedup(cost), "t_step_s": step,
            "t_draft_s": draft, "t_verify_s": step - draft, "tau_law": tuple(run.tau_law),
            "tokens_per_forward": run.tokens_per_forward(n_tokens),
            "predicted_decode_speedup": run.decode_speedup(cost, n_tokens),
            "predicted_draft_forwards_per_step": run.forwards,
            "predicted_mean_draft_length": run.draft_length,
            "predicted_exit_threshold_final": run.thresholds[-1]}


# ---- tree=sequoia ---------------------------------------------------------------------------------------
def sequoia_config(cfg: RunConfig, profile: Profile) -> RunConfig:
    """A copy of ``cfg`` for a Sequoia run on the measured vector: a sequoia tree (cfg.tree if it is one, else
    the schema's default grid), depth and width capped by what the drafter can fill (Medusa: its heads and
    TOPK, see :func:`drafter_vector`), and Sequoia's verifier — sampling without replacement — at
    temperature > 0; greedy on the top-k tree at 0. Methods verifying deterministic drafts (deterministic,
    typical) keep their verifier."""
    out = copy.deepcopy(profile_config(cfg))
    if profile.max_draft_depth:
        out.tree.max_levels = max(2, min(out.tree.max_levels, profile.max_draft_depth + 1))
    a = out.method.acceptance
    a.kind, a.calibrated = AcceptanceKind.vector, True
    a.vector = drafter_vector(cfg, profile.acceptance_vector)
    if Verifier(out.method.verifier) not in (Verifier.deterministic, Verifier.typical):
        out.method.verifier = Verifier.sequoia if out.workload.temperature > 0 else Verifier.greedy
    return out


def drafter_vector(cfg: RunConfig, vector: tuple[float, ...]) -> list[float]:
    """A measured vector cut to the children a node can have: ``method.params.top_k`` where the drafter
    has one (Medusa's TOPK: candidates per head); the mass of the ranks cut off joins p_none."""
    top_k = int(cfg.method.params.get("top_k", 0) or 0)
    model = PositionalAcceptance(tuple(vector))
    return [float(x) for x in model.positional_vector(top_k if 0 < top_k < model.width else None)]


def _summary(p: Prediction) -> dict[str, Any]:
    keys = ("predicted_tau", "predicted_speedup", "tree_size", "tree_depth", "tree_width", "t_verify_s",
            "t_draft_s", "t_ar_s", "t_step_s", "cost_source", "tokens_per_forward",
            "predicted_decode_speedup", "t_draft_run_s", "t_verify_run_s", "tau_law")
    return {k: getattr(p, k) for k in keys}


def multi_draft_law(cfg: RunConfig, profile: Profile, tree: Tree) -> tuple[Tree, Tree, np.ndarray] | None:
    """SpecInfer's merged tree of K drafts, calibrated: (the member tree each draft fills, the merged budget
    its verify is priced at, the law of τ from the replay of the calibration trajectories,
    specsim.multidraft). ``tree`` is the drafter's union or the member tree. None for other drafters or
    without the replay."""
    doc = profile.extra.get("multi_draft")
    if not doc or cfg.method.drafter != "specinfer":
        return None
    member, union = member_and_union(tree, int(doc["members"]))
    return member, union, accepted_law(Replay.from_json(doc), member, seed=cfg.seed)


def merged_size(profile: Profile, member: Tree, k: int) -> float | None:
    """The expected size of SpecInfer's merged tree of k copies of ``member`` (root included): a depth-d
    node of a member joins a sibling's where the drafts agree on its whole prefix, so the union's depth-d
    nodes are kept in the share the calibration's loop kept at depth d: its merged drafts' mean nodes per
    depth L_d over the union of k chains' k (``loop_verify_level_sizes``). Below the loop's depth D the
    drafts still together, g_d = (k − L_d) / (k − 1), part at the loop's last rate g_D / g_(D−1) per depth
    (drafts that parted stay apart). On the zoo (code, T = 0, 4 test prompts, counted in the loop) 3 chains
    of 5 drafts kept 0.40, 0.47, 0.55, 0.63, 0.71 of the union's nodes at depths 1-5 and the 61-node tree
    0.38, 0.49, 0.53, 0.60, 0.68, 0.70, 0.76, 0.80 at depths 1-8 (40.3 nodes verified of 61). None without
    the per-depth counts (an older calibration) or where the loop's tree was not the union of k chains.
    Where the run's own merged trees were counted on the calibration split for this union
    (``merged_counted``, methods.measurement.merged_trees), that count instead: the chains' extrapolation
    missed the zoo runs' verified nodes by +30% (code), +27% (prose), −16% (grounded)."""
    counted = profile.extra.get("merged_counted")
    if counted and int(counted["union_size"]) == 1 + k * (member.size - 1) and int(counted["steps"]) > 0:
        return float(counted["size"])
    levels, extra = profile.extra.get("loop_verify_level_sizes"), profile.extra
    depth, size = int(extra.get("loop_tree_depth") or 0), int(extra.get("loop_tree_size") or 0)
    if not levels or len(levels) < 2 or depth < 1 or size != 1 + k * depth or k < 2:
        return None
    together = [min(1.0, max(0.0, (k - float(x)) / (k - 1))) for x in levels[1:]]  # g_d, d = 1..D
    rate = together[-1] / together[-2] if len(together) > 1 and together[-2] > 0 else 1.0
    rate = min(1.0, max(0.0, rate))

    def share(d: int) -> float:  # the union's depth-d nodes kept (d >= 1)
        g = together[d - 1] if d <= len(together) else together[-1] * rate ** (d - len(together))
        return (k - (k - 1) * g) / k

    return 1.0 + sum(int(m) * k * share(d) for d, m in enumerate(member.level_sizes()) if d > 0)


def member_draft_s(cfg: RunConfig, profile: Profile, member: Tree) -> float | None:
    """SpecInfer's draft per step: every draft model fills the member tree on its own KV cache, so a level
    feeds each model the member's nodes of that depth, not the union's K times as many. The profile's level
    (``draft_levels``) is the loop's, all K models' forwards of one level of the union of K chains: priced on
    the member tree's widths it is the loop's own draft on the loop's own tree. Priced on the union's widths
    (K·w fed per level), the merged 61-node tree's draft read 6-28% above the measured one on the quiet
    sweep (T = 0, and T = 1). Where the calibration timed the loop on member trees of several shapes
    (``draft_terms``), the member tree pays the loop's constant per step and its cost per member node as
    well, and its wide levels their cost beyond the timed level's growth (``draft_levels``): at T = 1 a
    member level fed w nodes cost the loop 0.44 / 0.87 / 1.45 t(1) at w = 2 / 4 / 8 where its chain's level
    cost 0.49 and the timed level barely grew, so the 61-node tree's 5 levels fed 3 read its draft 15-21% low
    on the quiet sweep at T = 1 (3-8% at T = 0). None where the levels were not timed (the configured ratio
    per level stands)."""
    levels = draft_levels(cfg, profile)
    if levels is None or member.depth < 1:
        return None
    terms = draft_terms(profile)
    fixed, node = (0.0, 0.0) if terms is None else (terms[0], terms[2])
    cost = DraftCost(fixed_ratio=fixed, node_ratio=node, model=levels, fed_width=True)
    return float(cost.time(member, profile.t_ar_s))


def replayed_law(cfg: RunConfig, profile: Profile, tree: Tree) -> np.ndarray | None:
    """The law of τ of ``tree`` from the loop replayed on the calibration's trajectories (specsim.replay),
    where the profile recorded each root's accepted rank per depth (``rank_runs``) and the run's verifier
    makes the loop that walk: greedy at temperature 0, or one-hot drafts (deterministic) at T > 0 along the
    trajectories sampled from p (calibrate.trajectory_ranks); None otherwise (the measured vectors' law
    stands). The tree's children must be the drafter's top-k under its law at the accepted prefix, as the
    stars were: every static or Sequoia tree of a law drafter. At T > 0 each root's rank is one draw, so
    the replay's level is that draw's: the verifier's coin flips are integrated out against the exact
    vectors of the same positions (specsim.replay.flips_integrated)."""
    runs = profile.extra.get("rank_runs")
    walks = cfg.workload.temperature == 0 or Verifier(cfg.method.verifier) == Verifier.deterministic
    if not runs or not walks or tree.size < 2:
        return None
    runs = RankRuns.from_json(runs)
    law = loop_law(runs, tree)
    if cfg.workload.temperature == 0:  # the replay's ranks are the vectors' own: no flips to integrate
        return law
    exact = measured_acceptance(cfg, profile).method.acceptance
    hits = copy.deepcopy(exact)
    vectors = [drafter_vector(cfg, v) for v in hit_vectors(runs, profile.width)]
    if exact.kind == AcceptanceKind.depth_vector:
        assert len(vectors) == len(exact.by_depth_vectors), "rank runs and vectors of other depths"
        hits.by_depth_vectors = vectors
    hits.vector = vectors[0]
    return flips_integrated(law, tree, from_config(hits), from_config(exact))


def served_law_for(cfg: RunConfig, profile: Profile, tree: Tree) -> np.ndarray | None:
    """The law of τ of a drafter that learns between requests (``learns_every``: Online SD) over the run's
    own requests (``cfg.warmup`` warm-ups, then ``workload.num_prompts``), mixed from the calibration loop's
    per-prompt histograms by the updates each request had (specsim.learning); None for other drafters or
    another tree than the loop's (the loop's vectors stand)."""
    extra = profile.extra
    every, hists = int(extra.get("learns_every") or 0), extra.get("loop_accept_hist_by_prompt")
    updates = extra.get("loop_updates_by_prompt")
    same = extra.get("loop_tree_size") == tree.size and extra.get("loop_tree_depth") == tree.depth
    if every < 1 or not hists or not updates or len(hists) != len(updates) or not same:
        return None
    law = served_law(hists, updates, every, int(cfg.warmup), int(cfg.workload.num_prompts))
    return np.pad(law, (0, max(0, tree.depth + 2 - law.size)))[: tree.depth + 2]


def served_spread_for(cfg: RunConfig, profile: Profile) -> dict[str, Any]:
    """A learning drafter's calibration orders and the relative spread of one order's served τ
    (specsim.learning.order_spread; metrics ``predicted_tau_orders``, ``predicted_tau_order_sd_rel``:
    analysis.validation_terms adds it to both sides' errors); {} without two orders recorded."""
    extra = profile.extra
    orders = extra.get("loop_order_by_prompt")
    if not orders or len(orders) != len(extra.get("loop_accept_hist_by_prompt") or ()):
        return {}
    sd = order_spread(extra["loop_accept_hist_by_prompt"], extra["loop_updates_by_prompt"], orders,
                      int(extra["learns_every"]), int(cfg.warmup), int(cfg.workload.num_prompts))
    return {} if sd is None else {"predicted_tau_orders": len(set(orders)), "predicted_tau_order_sd_rel": sd}


def _law_summary(base: dict[str, Any], law: np.ndarray, n_tokens: int) -> dict[str, Any]:
    """``base`` (priced on the merged budget) with τ and its finite-run cut taken from ``law``."""
    tau, step, ar = float(np.dot(np.arange(law.size), law)), base["t_step_s"], base["t_ar_s"]
    per_forward = tokens_per_forward(law, n_tokens)
    return {**base, "predicted_tau": tau, "predicted_speedup": tau * ar / step, "tau_law": tuple(law),
            "tokens_per_forward": per_forward, "predicted_decode_speedup": per_forward * ar / step}


def dynamic_draft_s(profile: Profile, shapes) -> float | None:
    """A dynamic drafter's draft per step: the loop's draft on the profile's chain (per level × its depth)
    times the ``draft_scale`` its recorded trees carry (methods.measurement.dynamic_shapes: the dynamic
    drafter's loop draft over that chain's, timed interleaved). None without a scale timed against this
    profile's loop chain: the levels' pricing stands."""
    scale = getattr(shapes, "draft_scale", None)
    depth = int(profile.extra.get("loop_tree_depth") or 0)
    if scale is None or depth < 1 or int(scale[1]) != depth or profile.draft_time_s <= 0:
        return None
    return profile.draft_time_s * depth * float(scale[0])


def _with_draft(base: dict[str, Any], draft_s: float) -> dict[str, Any]:
    """``base`` with its draft term replaced by ``draft_s`` (seconds per speculation step); the former one
    kept as ``predicted_t_draft_levels_s`` (a metrics.json key: the levels' pricing, for comparison)."""
    return {**_restep(base, draft_s, base["t_verify_s"]), "predicted_t_draft_levels_s": base["t_draft_s"]}


def _restep(base: dict[str, Any], draft_s: float, verify_s: float) -> dict[str, Any]:
    """``base`` with its step priced as ``draft_s`` + ``verify_s`` (τ and tokens per forward unchanged)."""
    step, ar = draft_s + verify_s, base["t_ar_s"]
    return {**base, "t_draft_s": draft_s, "t_verify_s": verify_s, "t_step_s": step,
            "predicted_speedup": base["predicted_tau"] * ar / step,
            "predicted_decode_speedup": base["tokens_per_forward"] * ar / step}


def verify_size_law(profile: Profile, tree: Tree) -> dict[int, float] | None:
    """The law of the verify forward's size (nodes, root included) when ``tree`` is the loop's own tree
    and the drafter's drafts fell short of it in the calibration's loop (``loop_verify_sizes``): prompt
    lookup proposes nothing where no n-gram matches, and a continuation shorter than γ where the match is
    short. None when every draft had the tree's size (most drafters), for another tree, or without the
    counts. The quiet sweep priced every prompt lookup step at the full chain's t(5) + the overhead taken
    beside it: its verify term read +16% (grounded, T = 0)."""
    counts = {int(n): float(c) for n, c in (profile.extra.get("loop_verify_sizes") or {}).items()}
    total = sum(counts.values())
    if total <= 0 or tree.size != profile.extra.get("loop_tree_size") or max(counts) > tree.size:
        return None  # not the loop's tree, or drafts beyond it (Lookahead's forward: its own figure)
    if counts.get(tree.size, 0.0) >= total * (1 - SHORT_DRAFTS):
        return None
    return {n: c / total for n, c in sorted(counts.items())}


SHORT_DRAFTS = 0.01  # drafts shorter than the tree, at least this share of the steps: priced by their law


def loop_verify_s(profile: Profile, n: int, chain: bool = False) -> float | None:
    """One verification of an n-node draft in the speculative loop, the root alone (n = 1) included:
    t(n) + its excess in the loop (:func:`forward_excess_ratio`) + the walk. A root-only step of the
    speculative loop pays the drafter's work between its forwards like any other, so it is not the
    autoregressive loop's t(1): priced so, prompt lookup's steps read 5% below the loop's own verification
    on the calibration split. None without the per-size walk timings."""
    if loop_forward_excess(profile) is None:
        return None
    forward = float(MeasuredCost.from_mapping(profile.t_n).time(n))
    return forward + forward_excess_ratio(profile, n) * profile.t_ar_s + verify_walk_s(profile, n, chain)


def _sized_summary(base: dict[str, Any], law: dict[int, float], verify_s: Callable[[int], float]
                   ) -> dict[str, Any]:
    """``base`` with its verify priced on the law of the draft's size, E[verify_s(n)], instead of the full
    tree's; τ is the tree's (a short draft is a rejection at its end, as the calibration counted it)."""
    verify = sum(p * float(verify_s(n)) for n, p in law.items())
    return {**_restep(base, base["t_draft_s"], verify),
            "predicted_mean_verify_tokens": sum(n * p for n, p in law.items())}


def tree_predictions(cfg: RunConfig, profile: Profile, tree: Tree, shapes: dict[Tree, int] | None = None
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The simulator's predictions for a given tree under the measured acceptance: with this device's
    measured t(n) and draft time (the validation figure), and on the hardware preset's roofline.
    ``shapes`` (a dynamic drafter's kept trees → counts): τ is their mixture's (specsim.trees.recorded_law)
    under the measured vectors, the step still priced on ``tree`` (same size and depth)."""
    multi = multi_draft_law(cfg, profile, tree)
    if multi is not None:
        tree = multi[1]
    here_cfg = apply_profile(cfg, profile, tree=tree)  # a one-pass drafter's pass priced on this tree
    measured = to_measured_cost(profile, chain=tree.width <= 1)
    here = _summary(simulate(here_cfg, profile=measured, tree=tree, draft_levels=draft_levels(cfg, profile)))
    preset_cfg = measured_acceptance(cfg, profile)
    preset = _summary(simulate(preset_cfg, tree=tree))
    n = cfg.workload.max_new_tokens
    exits = exit_prediction(cfg, profile, tree)
    if exits is not None:  # the adaptive exit drafts fewer than the chain: its law replaces the chain's τ
        exit_costs = CostModel.from_config(here_cfg, measured), CostModel.from_config(preset_cfg)
        here = _exit_summary(here, exits, exit_costs[0], n)
        preset = _exit_summary(preset, exits, exit_costs[1], n)
    if multi is not None:  # several drafts merged: τ from the replay, not from per-depth marginals
        draft = member_draft_s(cfg, profile, multi[0])
        if draft is not None:  # each draft model's levels on its own member tree
            here = _restep(here, draft, here["t_verify_s"])
        merged = merged_size(profile, multi[0], (multi[1].size - 1) // max(multi[0].size - 1, 1))
        if merged is not None:  # the verify forward of the merged tree, not of the union's budget
            here = _sized_summary(here, {merged: 1.0}, lambda k: float(measured.time(k)))
            preset = _sized_summary(preset, {merged: 1.0}, CostModel.from_config(preset_cfg).verify_time)
        here, preset = _law_summary(here, multi[2], n), _law_summary(preset, multi[2], n)
    if shapes:  # the trees a dynamic drafter kept, each under the measured (depth, rank) model
        draft = dynamic_draft_s(profile, shapes)
        if draft is not None:  # its draft as timed against the loop's chain, not from the levels alone
            here = _with_draft(here, draft)
        here = _law_summary(here, recorded_law(shapes, from_config(here_cfg.method.acceptance)), n)
        preset = _law_summary(preset, recorded_law(shapes, from_config(preset_cfg.method.acceptance)), n)
    one_law = exits is None and multi is None and not shapes  # the drafter's laws on this tree stand
    replayed = replayed_law(cfg, profile, tree) if one_law else None
    if replayed is not None:  # temperature 0: the loop replayed on the calibration's trajectories
        here, preset = _law_summary(here, replayed, n), _law_summary(preset, replayed, n)
        if cfg.workload.temperature > 0:  # for comparison: τ of the replay's own draw, flips not integrated
            drawn = loop_law(RankRuns.from_json(profile.extra["rank_runs"]), tree)
            here, preset = ({**d, "predicted_tau_replay_draw": float(np.dot(np.arange(drawn.size), drawn))}
                            for d in (here, preset))
    served = served_law_for(cfg, profile, tree) if one_law else None
    if served is not None:  # a drafter that learns between requests: the run's requests' mixture
        spread = served_spread_for(cfg, profile)  # ... and how much one trajectory's τ varies
        here, preset = ({**_law_summary(d, served, n), **spread} for d in (here, preset))
    sizes = verify_size_law(profile, tree) if one_law else None
    if sizes is not None:  # drafts shorter than the tree: each step's verify at its draft's size
        def loop(k: int) -> float:  # the loop's verification at k nodes (older profiles: the table's)
            at = loop_verify_s(profile, k, chain=tree.width <= 1)
            return float(measured.time(k)) if at is None else at

        here = _sized_summary(here, sizes, loop)
        preset = _sized_summary(preset, sizes, CostModel.from_config(preset_cfg).verify_time)
    kept = (profile.extra.get("star_exact") or {}).get("variance_ratio")
    flips_out = replayed is None or cfg.workload.temperature > 0  # a T > 0 replay's level is the vectors'
    if kept is not None and one_law and flips_out and served is None:
        # τ from the star vectors, read without the verifier's coin flips (calibrate.star_ranks): the share of
        # a flipped estimator's variance they keep scales the prediction's own standard error
        # (analysis.validation_terms.prediction_standard_error)
        here, preset = ({**d, "predicted_tau_star_variance_ratio": float(kept)} for d in (here, preset))
    # the draft priced on the shapes' per-step terms, which leave out what a generation's first step does
    # once (calibrate.FirstDraftTimer): priced per generation (a dynamic drafter priced on the loop's own
    # per-step draft, ``dynamic_draft_s``, has it in that figure)
    first = first_draft_s(profile) if cfg.method.draft_steps == "depth" and not (
        shapes and dynamic_draft_s(profile, shapes) is not None) else 0.0
    if exits is not None:  # an adaptive exit drafts fewer levels than its chain: the room cuts only the
        # drafts longer than it, which the chain's shares over-state; the replay walked the cut steps (the
        # mean field did not: its full exit step stands)
        return (_run_steps(here, exits.run_shares(exit_costs[0]), first, n),
                _run_steps(preset, exits.run_shares(exit_costs[1])))
    spare = cfg.method.room_spare
    here = _run_steps(here, run_shares(CostModel.from_config(here_cfg, measured, draft_levels(cfg, profile)),
                                       tree, np.asarray(here["tau_law"]), n, spare), first, n)
    preset = _run_steps(preset, run_shares(CostModel.from_config(preset_cfg), tree,
                                           np.asarray(preset["tau_law"]), n, spare))
    return here, preset


def first_draft_s(profile: Profile) -> float:
    """Seconds a generation's first draft step pays beyond a later one, once per generation, where the draft
    is priced on the shapes' per-step terms (:func:`draft_terms`, which leave it out): the mean over the timed
    shapes of the first proposal's excess (``draft_first_excess_ratios``, calibrate.FirstDraftTimer). EAGLE's
    head appends the prompt's rows to its cache in its first step: 3-4 t(1) on the 384-token grounded
    prompts. 0 for profiles without it (their shapes' ratios have it shared out per step)."""
    if draft_terms(profile) is None:
        return 0.0
    excess = [float(r) for r in (profile.extra.get("draft_first_excess_ratios") or {}).values()]
    return max(0.0, float(np.mean(excess))) * profile.t_ar_s if excess else 0.0


def _run_steps(base: dict[str, Any], shares: RunShares, first_s: float = 0.0,
               n_tokens: int = 0) -> dict[str, Any]:
    """``base`` with the decode of its generation priced on the mean of the run's steps (specsim.run_steps):
    the draft and verify of each step priced as the full step's (``t_draft_s``, ``t_verify_s``), scaled by
    the shares the generation's cut last steps leave; the decode speedup τ_N · t(1) over that mean step.
    EAGLE-1's Sequoia-32 trees at N = 48 paid 5-7% less draft per step than the full tree's. A draft's
    once-per-generation ``first_s`` (:func:`first_draft_s`) is shared over the generation's N / τ_N steps
    (``predicted_t_draft_first_s``: it, for comparison)."""
    draft, verify = base["t_draft_s"] * shares.draft, base["t_verify_s"] * shares.verify
    first = {}
    if first_s > 0 and n_tokens > 0:
        draft += first_s * base["tokens_per_forward"] / n_tokens
        first = {"predicted_t_draft_first_s": first_s}
    return {**base, **first, "t_draft_run_s": draft, "t_verify_run_s": verify,
            "predicted_decode_speedup": base["tokens_per_forward"] * base["t_ar_s"] / (draft + verify)}


def sequoia_tree_for(cfg: RunConfig, profile: Profile) -> tuple[Tree, dict[str, Any], dict[str, Any]]:
    """Sequoia's DP-optimal tree for the measured vector, sized (budget, depth) for ``cfg.hardware``: its
    roofline, or this device's measured t(n) and draft time when ``hardware.measured`` (hardware=cpu).
    Returns (tree, the simulator's prediction for it with this device's measured profile — the validation
    figure — and its prediction on the hardware preset's roofline). Decode with ``sequoia_config(cfg, …)``."""
    scfg = sequoia_config(cfg, profile)
    sizing = (CostModel.from_config(apply_profile(scfg, profile), to_measured_cost(profile),
                                    draft_levels(scfg, profile))
              if cfg.hardware.measured else CostModel.from_config(scfg))
    tree = build_tree(scfg.tree, PositionalAcceptance(tuple(scfg.method.acceptance.vector)), sizing)
    return (tree, *tree_predictions(scfg, profile, tree))


def dynamic_tree_for(cfg: RunConfig, profile: Profile) -> Tree:
    """The static tree a dynamic (EAGLE-2) tree is priced as: the DP-optimal tree of total_tokens + 1 nodes
    within depth + 1 levels and top_k children (specsim.trees.build_tree) under this drafter's measured
    vectors; its τ is then taken under the measured per-depth vectors and its step under the measured t(n)
    and draft time. Its τ is an upper bound on a context-free tree of that size, which the drafter's
    q-ranked trees need not reach: measure prices the trees the drafter keeps on the calibration split
    (methods.measurement.dynamic_shapes; ``tree_predictions(…, shapes=…)``) and this tree only sizes the
    step."""
    mcfg = apply_profile(cfg, profile)
    return build_tree(mcfg.tree, from_config(mcfg.method.acceptance),
                      CostModel.from_config(mcfg, to_measured_cost(profile), draft_levels(cfg, profile)))


def profile_config(cfg: RunConfig) -> RunConfig:
    """The config a run's profile is measured and keyed with: its tree made a sequoia one (same budgets), so
    that every tree of one drafter × workload shares one calibration (α_d from a chain of tree.gamma)."""
    if TreeKind(cfg.tree.kind) == TreeKind.sequoia:
        return cfg
    out = copy.deepcopy(cfg)
    out.tree = TreeConfig(name="sequoia", kind=TreeKind.sequoia, budgets=list(cfg.tree.budgets))
    return out


def prediction_metrics(cfg: RunConfig, this_device: dict[str, Any], preset: dict[str, Any]) -> dict[str, Any]:
    """Flat metrics.json keys for a measure run with a profile: ``predicted_*`` follow the run's hardware
    (this device's measured profile when ``hardware.measured``, else the preset's roofline), and both
    predictions are kept under ``*_this_device`` / ``*_hardware``."""
    main = this_device if cfg.hardware.measured else preset
    out = {"predicted_tau": main["predicted_tau"], "predicted_speedup": main["predicted_speedup"],
           "predicted_decode_speedup": main["predicted_decode_speedup"],  # for workload.max_new_tokens
           "predicted_tokens_per_forward": main["tokens_per_forward"]}
    out.update({k: v for k, v in main.items() if k.startswith("predicted_") and k not in out})  # exit law
    for suffix, pred in (("this_device", this_device), ("hardware", preset)):
        out.update({f"predicted_tau_{suffix}": pred["predicted_tau"],
                    f"predicted_speedup_{suffix}": pred["predicted_speedup"],
                    f"predicted_t_step_s_{suffix}": pred["t_step_s"],
                    f"predicted_decode_speedup_{suffix}": pred["predicted_decode_speedup"],
                    # the step's terms, for a term-by-term comparison with the measured times
                    # (analysis.validation): draft, verify (t(n) + the loop's verification), t(1)
                    f"predicted_t_draft_s_{suffix}": pred["t_draft_s"],
                    f"predicted_t_verify_s_{suffix}": pred["t_verify_s"],
                    # ... and the mean of the generation's steps, its cut last ones included (the decode's)
                    f"predicted_t_draft_run_s_{suffix}": pred["t_draft_run_s"],
                    f"predicted_t_verify_run_s_{suffix}": pred["t_verify_run_s"],
                    f"predicted_t_ar_s_{suffix}": pred["t_ar_s"]})
    return out
