"""Configuration schemas of a specsim run: one dataclass per Hydra config group.

Pure dataclasses (no hydra import): ``run.py`` registers them in Hydra's ConfigStore so that yaml presets
extend them and a typo fails at compose time; ``validate()`` checks ranges and cross-field rules and raises
``ConfigError`` naming the key and what is allowed. Schemas are mutable on purpose (overrides, sweeps);
domain types (Tree, drafts, results) are the frozen ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any


class ConfigError(ValueError):
    """A config value is out of range or inconsistent; the message names the key."""


class Task(str, Enum):
    simulate = "simulate"
    measure = "measure"
    calibrate = "calibrate"

    def __str__(self) -> str:  # the value, not "Task.simulate": Hydra interpolates it into run dir names
        return self.value


class TreeKind(str, Enum):
    none = "none"  # autoregressive: no draft tokens
    chain = "chain"
    kary = "kary"
    medusa = "medusa"
    sequoia = "sequoia"
    dynamic = "dynamic"


class Verifier(str, Enum):
    greedy = "greedy"  # argmax match; lossless for greedy decoding
    chain = "chain"  # Leviathan Alg. 1 (chains only)
    specinfer = "specinfer"  # multi-step, children drawn with replacement
    sequoia = "sequoia"  # children drawn without replacement
    deterministic = "deterministic"  # recursive rejection for one-hot (deterministic) drafts
    typical = "typical"  # Medusa typical acceptance: LOSSY


LOSSY_VERIFIERS = frozenset({Verifier.typical})


class AcceptanceKind(str, Enum):
    iid = "iid"  # every draft token accepted with α
    power = "power"  # per-depth α_d = alpha * decay**(d-1)
    table = "table"  # per-depth measured α_d (``by_depth``)
    vector = "vector"  # Sequoia positional vector [0, p_1, …, p_W, p_none]
    depth_vector = "depth_vector"  # one positional vector per depth (``by_depth_vectors``)


@dataclass
class AcceptanceConfig:
    kind: AcceptanceKind = AcceptanceKind.iid
    alpha: float = 0.7
    decay: float = 1.0
    by_depth: list[float] = field(default_factory=list)
    vector: list[float] = field(default_factory=list)
    by_depth_vectors: list[list[float]] = field(default_factory=list)  # [d-1] = depth d's vector
    # where a measured vector may come from (task=calibrate writes it); empty = use the fields above
    calibrated: bool = False


@dataclass
class MethodConfig:
    name: str = "autoregressive"
    drafter: str = "autoregressive"  # key in methods.drafters.registry
    verifier: Verifier = Verifier.greedy
    lossless: bool = True
    # simulator: cost of one draft step relative to one target forward (ρ), plus a fixed drafter
    # cost per speculation step in target-forward units (e.g. Medusa heads: one pass for all depths)
    draft_cost_ratio: float = 0.0
    draft_fixed_ratio: float = 0.0
    # simulator: a further drafter cost per drafted node (below the root) per speculation step, in t(1) units
    # (calibrated: the drafter's loop timed on trees of several shapes, methods.measurement.profiles)
    draft_node_ratio: float = 0.0
    # simulator: self-speculation's shared cache (LayerSkip): the share ρ_v of the target's layers the draft
    # already ran for the nodes it fed, which the verify pass does not recompute (E / L; 0 = none)
    verify_reuse_ratio: float = 0.0
    # simulator, calibrated (set from a measured profile): the shared-cache verify's saving per speculation
    # step over the full verify forward, in t(1) units, timed on the device; > 0 replaces the ρ_v arithmetic
    verify_saving_ratio: float = 0.0
    draft_steps: str = "depth"  # "depth": one draft pass per tree level; "one": a single pass
    # simulator: "ratio" prices a draft step at draft_cost_ratio·t(1); "roofline" uses the draft model's
    # own roofline (model.draft_params, draft_n_layers, draft_hidden_size) on the same hardware
    draft_cost: str = "ratio"
    # simulator: draft tokens the draft model settles per forward along a tree's levels (Staged SD: the
    # second stage's tokens per draft forward, > 1); 1 = one draft forward per level
    draft_tokens_per_forward: float = 1.0
    # simulator: tokens the verify forward computes beyond the priced tree (Lookahead: its Jacobi branch and
    # the candidates beyond the one chain τ is priced on), so t(n) is charged for the whole forward
    verify_extra_tokens: int = 0
    # simulator: levels the drafter leaves undrafted below a step's room (the tokens the generation has left):
    # 1 where the room's last token is left to the target's bonus token (EAGLE, Medusa, MTP draft at most
    # ctx.max_new - 1 levels), 0 where the drafter drafts the room itself; prices the generation's cut last
    # steps (specsim.run_steps). tests/methods/test_greedy_equivalence.py checks each preset's against its
    # drafter's loop
    room_spare: int = 0
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    # drafter-specific knobs (gamma for vanilla, ngram sizes for lookup, heads for medusa, …)
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class TreeConfig:
    name: str = "chain"  # preset name (tree=...), reported in metrics.json; kind says how it is built
    kind: TreeKind = TreeKind.chain
    gamma: int = 4  # chain length
    k: int = 2  # kary branching
    depth: int = 3  # kary / dynamic: edges below the root (levels − 1)
    paths: list[list[int]] = field(default_factory=list)  # medusa
    budgets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128])  # sequoia
    max_levels: int = 10  # sequoia: levels including the root (the reference's unit; depth + 1)
    total_tokens: int = 60  # dynamic (EAGLE-2)
    top_k: int = 10  # dynamic


@dataclass
class HardwareConfig:
    name: str = "cpu"
    memory_bandwidth_gbs: float = 50.0  # GB/s achievable
    peak_tflops: float = 1.0  # dense bf16/fp16 TFLOP/s
    memory_gb: float = 24.0
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.6
    overhead_ms: float = 0.05  # fixed per-forward cost (kernel launches, framework)
    offload: bool = False  # weights streamed over PCIe each forward (Sequoia's offloading)
    pcie_gbs: float = 0.0
    measured: bool = False  # use this device's measured t(n) profile when one exists


@dataclass
class ModelConfig:
    name: str = "zoo"
    source: str = "zoo"  # zoo | random | hub | local
    # simulator view of the target and draft
    params: float = 13.8e6
    draft_params: float = 1.2e6
    bytes_per_param: float = 2.0
    n_layers: int = 6
    hidden_size: int = 384
    n_heads: int = 6
    n_kv_heads: int = 6
    intermediate_size: int = 1024
    vocab_size: int = 4096
    context_length: int = 1024
    # draft architecture (random/zoo) and checkpoint locations (hub/local)
    draft_n_layers: int = 1
    draft_hidden_size: int = 128
    path: str = ""
    draft_path: str = ""
    zoo: str = "default"  # zoo preset name (default | micro)
    # auto: bfloat16 where this device multiplies bf16 fast, else float32 (run.py resolves it for decoding)
    dtype: str = "auto"


@dataclass
class WorkloadConfig:
    name: str = "code"
    split: str = "test"  # train | calibration | test
    kind: str = "code"  # code | prose | grounded | mixed | stream (code requests in sequence, none repeated)
    num_prompts: int = 8  # with tau_se_target > 0: the most prompts decoded (the presets: 32)
    # task=measure: > 0 decodes prompts (each beside its baseline) until τ's relative standard error is at
    # most this (specsim.tau_error.precise_enough, at least MIN_PROMPTS) or num_prompts are decoded; 0 = all
    tau_se_target: float = 0.0
    prompt_tokens: int = 128
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    context_tokens: int = 512  # simulator: KV length seen by verification
    batch_size: int = 1  # sequences decoded at once (specsim: methods.core.batch_loop above 1; vLLM)
    continuous: bool = False  # batch > 1: requests join as rows finish (continuous batching), else per batch


@dataclass
class EngineConfig:
    """What decodes a task=measure run: specsim's own loop, or vLLM (an optional peer engine; methods.
    measurement.vllm_engine lists the methods it runs)."""

    name: str = "specsim"  # specsim | vllm
    kv_cache_gib: int = 1  # vLLM on CPU: KV cache space reserved (VLLM_CPU_KVCACHE_SPACE)
    memory_fraction: float = 0.15  # vLLM's gpu_memory_utilization (on CPU: the share of RAM it may reserve)
    enforce_eager: bool = False  # vLLM: skip torch.compile at start-up (faster start, slower steps)


@dataclass
class CalibrationConfig:
    """task=calibrate (methods.measurement.calibrate): how much to measure; star-tree positions =
    prompts × new_tokens."""

    width: int = 32  # W, children of the star tree verified at each position (Sequoia's vector has 32)
    # calibration-split prompts continued by the target itself: 24 x 32 = 768 star trees (8 prompts read
    # tau 3.45 for a draft measured at 2.90 on the test split, 24 prompts 3.25; ~2 s more per profile)
    prompts: int = 24
    new_tokens: int = 32  # tokens generated per prompt; a star tree is verified at each of them
    depth_prompts: int = 4  # prompts decoded with the drafter's chain/tree for acceptance_by_depth
    reps: int = 7  # interleaved timing rounds of the cost table (medians kept), after `warmup` untimed ones
    # ... then more rounds, up to max_reps, while the median of a ratio to t(1) has a relative standard error
    # above median_se (methods.measurement.cost_table.ratio_standard_error). Quiet, the zoo profiles' most
    # scattered ratio read a relative IQR of 6-11% (quartiles) over 7 rounds (zoo11): its 7-round median
    # moved 2-4% by chance. 3%: half of zoo11's 90 profiles would have timed 8-15 rounds, ~4 min more on the
    # full sweep (2.5%: two thirds, ~6 min); under load (1-min load 4 on 2 cores) nearly every profile
    # times 15 (its ratios' relative IQR 15-30%)
    max_reps: int = 15
    median_se: float = 0.03
    warmup: int = 2
    context_tokens: int = 0  # KV length for t(n); 0 = workload.context_tokens
    # tree sizes timed beside tree.budgets and the run's own tree: runs that share a profile (its key has no
    # tree) but select among fewer budgets — a sweep's Sequoia-8 and Sequoia-32 rows — then find every t(n)
    # and draft level they need in it, whichever of them calibrated first (without it, the Sequoia-32 row
    # found no t(32) in the Sequoia-8 row's profile and measured it again under the same key, zoo13cpu)
    sizes: list[int] = field(default_factory=list)
    # never calibrate: a run whose cached profile (or dynamic trees) is missing or would be measured again
    # fails instead (analysis.validation insample re-runs a row on the profile it was predicted with). A
    # stale mark does not count: it is about t(1) only, which every run re-anchors on its own baseline
    cached_only: bool = False


@dataclass
class RunConfig:
    task: Task = Task.simulate
    seed: int = 0
    device: str = "auto"
    # torch intra-op threads (0 = torch's default). On a shared 2-core machine one thread is often faster:
    # with the other core busy, 2 OpenMP threads stall each other (measured 5-20x slower decode steps).
    threads: int = 0
    # CPU forwards of 1-63 nodes as one torch.compile graph per model (methods.core.compiled_llama; a small
    # draft whose projections all run as float32 mm stays eager): tens of seconds to minutes per model to
    # compile once (inductor's disk cache shortens later runs), then ~5% faster target forwards (load)
    compile: bool = False
    warmup: int = 1
    method: MethodConfig = field(default_factory=MethodConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


# ---- validation ------------------------------------------------------------------------------------
MAX_TREE_NODES = 1024  # nodes of one verified tree, root included (Sequoia's largest offloading budgets: 512)
MAX_TREE_LEVELS = 64  # levels of a tree, root included; keeps Sequoia's DP table (budgets x levels) small
DERIVED_WIDTH = 32  # children per node that an α acceptance model is expanded to (specsim.trees)


@dataclass(frozen=True)
class Range:
    """An interval of allowed numbers; NaN and ±inf are never allowed."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v: object) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def __str__(self) -> str:
        if self.hi == math.inf:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"in {left}{_num(self.lo)}, {_num(self.hi)}{right}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE, NON_NEGATIVE, AT_LEAST_1 = Range(0, lo_open=True), Range(0), Range(1)
UNIT = Range(0, 1, lo_open=True)  # (0, 1]
# Every numeric field of every group, by dotted key (the tree's depth fields are checked in _validate_tree).
# A new numeric field needs a line here: tests/test_config.py sets each one out of range and expects the key.
RANGES: dict[str, Range] = {
    "seed": Range(0, 2**32 - 1),  # numpy's legacy seeding takes 32 bits
    "threads": NON_NEGATIVE,  # 0 = torch's default
    "warmup": NON_NEGATIVE,
    "method.draft_cost_ratio": NON_NEGATIVE,
    "method.draft_fixed_ratio": NON_NEGATIVE,
    "method.draft_node_ratio": NON_NEGATIVE,
    "method.draft_tokens_per_forward": Range(1),
    "method.verify_extra_tokens": NON_NEGATIVE,
    "method.room_spare": Range(0, 1),
    "method.verify_reuse_ratio": Range(0, 1, hi_open=True),
    "method.verify_saving_ratio": Range(0, 1, hi_open=True),
    "method.acceptance.alpha": Range(0, 1, hi_open=True),  # α = 1 makes k̄ infinite
    "method.acceptance.decay": UNIT,
    "tree.gamma": Range(1, MAX_TREE_NODES - 1),
    "tree.k": Range(1, MAX_TREE_NODES - 1),
    "tree.total_tokens": Range(1, MAX_TREE_NODES - 1),
    "tree.top_k": Range(1, MAX_TREE_NODES - 1),
    "hardware.memory_bandwidth_gbs": POSITIVE,
    "hardware.peak_tflops": POSITIVE,
    "hardware.memory_gb": POSITIVE,
    "hardware.bandwidth_efficiency": UNIT,
    "hardware.flops_efficiency": UNIT,
    "hardware.overhead_ms": NON_NEGATIVE,
    "hardware.pcie_gbs": NON_NEGATIVE,  # > 0 when hardware.offload (checked below)
    "model.params": POSITIVE,
    "model.draft_params": NON_NEGATIVE,  # 0: no draft model
    "model.bytes_per_param": Range(0, 8, lo_open=True),  # float64 at most
    "model.n_layers": AT_LEAST_1,
    "model.hidden_size": AT_LEAST_1,
    "model.n_heads": AT_LEAST_1,
    "model.n_kv_heads": AT_LEAST_1,
    "model.intermediate_size": AT_LEAST_1,
    "model.vocab_size": Range(2),
    "model.context_length": Range(2),
    "model.draft_n_layers": NON_NEGATIVE,  # 0: no draft model
    "model.draft_hidden_size": AT_LEAST_1,
    "workload.num_prompts": AT_LEAST_1,
    "workload.tau_se_target": Range(0, 1),  # 0 = off
    "workload.prompt_tokens": AT_LEAST_1,
    "workload.max_new_tokens": AT_LEAST_1,
    "workload.temperature": NON_NEGATIVE,
    "workload.top_p": UNIT,
    "workload.top_k": NON_NEGATIVE,  # 0 = off
    "workload.context_tokens": NON_NEGATIVE,
    "workload.batch_size": Range(1, 1024),
    "engine.kv_cache_gib": AT_LEAST_1,
    "engine.memory_fraction": UNIT,
    "calibration.width": Range(1, MAX_TREE_NODES - 1),
    "calibration.prompts": AT_LEAST_1,
    "calibration.new_tokens": AT_LEAST_1,
    "calibration.depth_prompts": AT_LEAST_1,
    "calibration.reps": AT_LEAST_1,
    "calibration.max_reps": NON_NEGATIVE,  # at most reps: reps rounds, as before
    "calibration.median_se": NON_NEGATIVE,  # 0: max_reps rounds always
    "calibration.warmup": NON_NEGATIVE,
    "calibration.context_tokens": NON_NEGATIVE,  # 0 = workload.context_tokens
}


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _choice(value: str, key: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, key, f"got {value!r}; allowed: {', '.join(allowed)}")


def _get(cfg: RunConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: RunConfig) -> RunConfig:
    """Range and consistency checks that a type system cannot express. Returns cfg for chaining."""
    for key, allowed in RANGES.items():
        v = _get(cfg, key)
        _check(v in allowed, key, f"must be {allowed}, got {v}")
    _validate_method(cfg.method)
    _validate_tree(cfg.tree)
    _validate_tree_size(cfg.tree)
    _check_node_counts(cfg.calibration.sizes, "calibration.sizes")
    _validate_hardware(cfg.hardware)
    _validate_model(cfg.model, cfg.method)
    w, m = cfg.workload, cfg.model
    _choice(w.split, "workload.split", ("train", "calibration", "test"))
    _choice(w.kind, "workload.kind", ("code", "prose", "grounded", "mixed", "stream"))
    _choice(cfg.engine.name, "engine.name", ("specsim", "vllm"))
    _check(w.context_tokens <= m.context_length, "workload.context_tokens",
           f"must be <= model.context_length={m.context_length} (the KV length verification sees), "
           f"got {w.context_tokens}")
    devices = ("auto", "cpu", "cuda", "cuda:<index>")
    indexed = cfg.device.startswith("cuda:") and cfg.device[5:].isdigit()
    _check(cfg.device in devices[:3] or indexed, "device",
           f"got {cfg.device!r}; allowed: {', '.join(devices)}")
    if cfg.tree.kind == TreeKind.sequoia:
        _validate_sequoia(cfg)
    if cfg.task != Task.simulate:
        _validate_decoding(cfg)
    return cfg


def _validate_decoding(cfg: RunConfig) -> None:
    """What real decoding (task=measure / calibrate) needs beyond what the simulator does."""
    w, m, t = cfg.workload, cfg.model, cfg.tree
    _check(w.prompt_tokens + w.max_new_tokens <= m.context_length, "workload.max_new_tokens",
           f"workload.prompt_tokens + workload.max_new_tokens = {w.prompt_tokens + w.max_new_tokens} must be "
           f"<= model.context_length={m.context_length}")
    _check(w.tau_se_target == 0 or (w.batch_size == 1 and cfg.engine.name == "specsim"),
           "workload.tau_se_target", f"the sequential rule decodes one prompt at a time in specsim's loop: "
           f"needs workload.batch_size=1 and engine=specsim, got {w.tau_se_target} with batch_size="
           f"{w.batch_size}, engine={cfg.engine.name}")
    if cfg.method.verifier == Verifier.greedy and w.temperature > 0:
        raise ConfigError(
            "method.verifier: greedy verification with workload.temperature > 0 is not lossless; "
            "use a sampling verifier (chain, specinfer, sequoia, deterministic) or temperature=0"
        )
    branches = {TreeKind.kary: t.k > 1, TreeKind.medusa: any(any(c > 0 for c in p) for p in t.paths),
                TreeKind.dynamic: t.top_k > 1}.get(t.kind, False)  # sequoia: measure picks its verifier
    if cfg.method.verifier == Verifier.chain and branches:
        raise ConfigError(f"method.verifier: chain (Leviathan Alg. 1) verifies chains only, and "
                          f"tree={t.name} (kind {t.kind.value}) branches; use specinfer, sequoia or "
                          "deterministic, or tree=chain")


def _validate_hardware(h: HardwareConfig) -> None:
    if h.offload:
        _check(h.pcie_gbs > 0, "hardware.pcie_gbs", "must be > 0 when hardware.offload=true (the weights "
               f"stream over PCIe every forward), got {h.pcie_gbs}")


def _validate_model(m: ModelConfig, method: MethodConfig) -> None:
    _choice(m.source, "model.source", ("zoo", "random", "hub", "local"))
    _choice(m.dtype, "model.dtype", ("auto", "float32", "bfloat16", "float16"))
    _check(m.source not in ("hub", "local") or bool(m.path), "model.path", "required for hub/local models")
    _check(m.hidden_size % m.n_heads == 0, "model.n_heads",
           f"must divide model.hidden_size={m.hidden_size} (head dim), got {m.n_heads}")
    _check(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
           f"must divide model.n_heads={m.n_heads} (grouped-query attention), got {m.n_kv_heads}")
    if method.draft_cost == "roofline":
        _check(m.draft_params > 0 and m.draft_n_layers >= 1, "model.draft_params",
               "method.draft_cost=roofline prices the draft model's own roofline: needs model.draft_params "
               f"> 0 and model.draft_n_layers >= 1, got {m.draft_params} and {m.draft_n_layers}")


def _tree_nodes(t: TreeConfig) -> int | None:
    """Nodes (root included) of a static tree preset; None where the simulator chooses the size."""
    if t.kind == TreeKind.chain:
        return t.gamma + 1
    if t.kind == TreeKind.kary:
        return sum(t.k ** d for d in range(t.depth + 1)) if t.depth <= MAX_TREE_LEVELS else None
    if t.kind == TreeKind.medusa:
        return len({tuple(p) for p in t.paths}) + 1
    if t.kind == TreeKind.none:
        return 1
    return None


def _check_node_counts(sizes: list[int], key: str) -> None:
    """Tree sizes (nodes incl. the root) that one forward can verify."""
    bad = [n for n in sizes if not 1 <= n <= MAX_TREE_NODES]
    _check(not bad, key, f"entries must be in [1, {MAX_TREE_NODES}] (nodes incl. the root), got {bad}")


def _validate_tree_size(t: TreeConfig) -> None:
    """Sizes a run can afford: larger trees would stall the run (Sequoia's DP, a k-ary tree's k^depth)."""
    _check(t.depth <= MAX_TREE_LEVELS, "tree.depth", f"must be in [1, {MAX_TREE_LEVELS}], got {t.depth}")
    _check(t.max_levels <= MAX_TREE_LEVELS, "tree.max_levels",
           f"must be in [2, {MAX_TREE_LEVELS}] (levels incl. the root), got {t.max_levels}")
    _check_node_counts(t.budgets, "tree.budgets")
    n = _tree_nodes(t)
    _check(n is None or n <= MAX_TREE_NODES, "tree", f"tree={t.name} (kind {t.kind.value}) has {n} nodes; "
           f"at most {MAX_TREE_NODES} are verified in one forward")
    if t.kind == TreeKind.medusa:
        _check(len(t.paths) == len({tuple(p) for p in t.paths}), "tree.paths", "contains a path twice")


def _sequoia_width(cfg: RunConfig) -> int:
    """Children a node of Sequoia's tree can have: the acceptance vector's ranks (measured: the calibration's
    star width, cut to the drafter's top_k)."""
    a = cfg.method.acceptance
    if cfg.task != Task.simulate or a.calibrated:
        top_k = cfg.method.params.get("top_k", 0)
        top_k = top_k if isinstance(top_k, int) and not isinstance(top_k, bool) else 0
        return min(cfg.calibration.width, top_k) if top_k > 0 else cfg.calibration.width
    if a.kind == AcceptanceKind.vector:
        return len(a.vector) - 2
    if a.kind == AcceptanceKind.depth_vector:
        return min(len(v) for v in a.by_depth_vectors) - 2
    return DERIVED_WIDTH


def _validate_sequoia(cfg: RunConfig) -> None:
    """Sequoia's selection needs at least one budget that a tree of max_levels levels and the vector's width
    can hold: 1 + W + … + W^(L−1) nodes."""
    t, width = cfg.tree, _sequoia_width(cfg)
    capacity = sum(width ** d for d in range(t.max_levels))
    _check(min(t.budgets) <= capacity, "tree.budgets",
           f"no budget of {list(t.budgets)} fits a tree of tree.max_levels={t.max_levels} levels and width "
           f"{width} (at most {capacity} nodes): lower a budget or raise tree.max_levels")


def _validate_method(m: MethodConfig) -> None:
    _choice(m.draft_steps, "method.draft_steps", ("depth", "one"))
    _choice(m.draft_cost, "method.draft_cost", ("ratio", "roofline"))
    _check(
        m.lossless == (m.verifier not in LOSSY_VERIFIERS),
        "method.lossless",
        f"verifier {m.verifier.value} is {'lossy' if m.verifier in LOSSY_VERIFIERS else 'lossless'}; "
        f"set method.lossless={m.verifier not in LOSSY_VERIFIERS}",
    )
    a = m.acceptance
    _check(all(0 <= x <= 1 for x in a.by_depth), "method.acceptance.by_depth", "entries must be in [0, 1]")
    if a.kind == AcceptanceKind.table:
        _check(bool(a.by_depth), "method.acceptance.by_depth", "required when kind=table")
    if a.kind == AcceptanceKind.vector or a.vector:
        _check_vector(a.vector, "method.acceptance.vector")
    if a.kind == AcceptanceKind.depth_vector:
        key = "method.acceptance.by_depth_vectors"
        _check(bool(a.by_depth_vectors), key, "required when kind=depth_vector")
    for d, v in enumerate(a.by_depth_vectors):
        _check_vector(v, f"method.acceptance.by_depth_vectors[{d}]")


def _check_vector(v: list[float], key: str) -> None:
    """Sequoia's layout [0, p_1, …, p_W, p_none]: entries >= 0, p_1..p_none summing to 1."""
    _check(len(v) >= 3, key, "layout is [0, p_1, …, p_W, p_none]")
    _check(all(x >= 0 for x in v), key, "entries must be >= 0")
    _check(abs(sum(v[1:]) - 1) < 1e-3, key, f"p_1..p_none must sum to 1, got {sum(v[1:]):.4f}")


def _validate_tree(t: TreeConfig) -> None:
    _check(t.gamma >= 1, "tree.gamma", f"must be >= 1, got {t.gamma}")
    _check(t.k >= 1, "tree.k", f"must be >= 1, got {t.k}")
    _check(t.depth >= 1, "tree.depth", f"must be >= 1, got {t.depth}")
    _check(t.max_levels >= 2, "tree.max_levels", f"must be >= 2 (levels incl. the root), got {t.max_levels}")
    _check(bool(t.budgets) and all(b >= 1 for b in t.budgets), "tree.budgets", "need budgets >= 1")
    _check(t.total_tokens >= 1, "tree.total_tokens", f"must be >= 1, got {t.total_tokens}")
    _check(t.top_k >= 1, "tree.top_k", f"must be >= 1, got {t.top_k}")
    if t.kind == TreeKind.medusa:
        _check(bool(t.paths), "tree.paths", "a medusa tree needs a non-empty list of paths")
        _check(all(p and all(c >= 0 for c in p) for p in t.paths), "tree.paths",
               "paths are non-empty lists of choice indices >= 0")


def flat(cfg: RunConfig) -> dict[str, Any]:
    """Scalar inputs of a run, dotted keys (for metrics.json and tidy tables)."""
    out: dict[str, Any] = {}

    def walk(obj: Any, prefix: str) -> None:
        for f in fields(obj):
            v = getattr(obj, f.name)
            key = f"{prefix}{f.name}"
            if hasattr(v, "__dataclass_fields__"):
                walk(v, key + ".")
            elif isinstance(v, Enum):
                out[key] = v.value
            elif isinstance(v, (int, float, str, bool)):
                out[key] = v
    walk(cfg, "")
    return out
