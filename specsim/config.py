"""Configuration schemas of a specsim run: one dataclass per Hydra config group.

Pure dataclasses (no hydra import): ``run.py`` registers them in Hydra's ConfigStore so that yaml presets
extend them and a typo fails at compose time; ``validate()`` checks ranges and cross-field rules and raises
``ConfigError`` naming the key and what is allowed. Schemas are mutable on purpose (overrides, sweeps);
domain types (Tree, drafts, results) are the frozen ones.
"""

from __future__ import annotations

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
    # simulator: self-speculation's shared cache (LayerSkip): the share ρ_v of the target's layers the draft
    # already ran for the nodes it fed, which the verify pass does not recompute (E / L; 0 = none)
    verify_reuse_ratio: float = 0.0
    draft_steps: str = "depth"  # "depth": one draft pass per tree level; "one": a single pass
    # simulator: "ratio" prices a draft step at draft_cost_ratio·t(1); "roofline" uses the draft model's
    # own roofline (model.draft_params, draft_n_layers, draft_hidden_size) on the same hardware
    draft_cost: str = "ratio"
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    # drafter-specific knobs (gamma for vanilla, ngram sizes for lookup, heads for medusa, …)
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class TreeConfig:
    name: str = "chain"  # preset name (tree=...), reported in metrics.json; kind says how it is built
    kind: TreeKind = TreeKind.chain
    gamma: int = 4  # chain length
    k: int = 2  # kary branching
    depth: int = 3  # kary depth / dynamic depth
    paths: list[list[int]] = field(default_factory=list)  # medusa
    budgets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128])  # sequoia
    max_depth: int = 10  # sequoia: levels including the root (reference's unit)
    depth_minus_one: bool = False  # sequoia: d-1 draft steps for depth d
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
    dtype: str = "bfloat16"


@dataclass
class WorkloadConfig:
    name: str = "code"
    split: str = "test"  # train | calibration | test
    kind: str = "code"  # code | prose | grounded | mixed
    num_prompts: int = 8
    prompt_tokens: int = 128
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    context_tokens: int = 512  # simulator: KV length seen by verification


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
    reps: int = 7  # timed forwards per t(n) size (the median is kept), after `warmup` untimed ones
    warmup: int = 2
    context_tokens: int = 0  # KV length for t(n); 0 = workload.context_tokens


@dataclass
class RunConfig:
    task: Task = Task.simulate
    seed: int = 0
    device: str = "auto"
    # torch intra-op threads (0 = torch's default). On a shared 2-core machine one thread is often faster:
    # with the other core busy, 2 OpenMP threads stall each other (measured 5-20x slower decode steps).
    threads: int = 0
    warmup: int = 1
    method: MethodConfig = field(default_factory=MethodConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)


# ---- validation ------------------------------------------------------------------------------------
_POSITIVE = {
    "hardware": ("memory_bandwidth_gbs", "peak_tflops", "memory_gb"),
    "model": ("params", "bytes_per_param", "n_layers", "hidden_size", "vocab_size", "context_length"),
    "workload": ("num_prompts", "prompt_tokens", "max_new_tokens"),
    "calibration": ("width", "prompts", "new_tokens", "depth_prompts", "reps"),
}
_UNIT_INTERVAL = {
    "hardware": ("bandwidth_efficiency", "flops_efficiency"),
    "workload": ("top_p",),
}


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _choice(value: str, key: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, key, f"got {value!r}; allowed: {', '.join(allowed)}")


def validate(cfg: RunConfig) -> RunConfig:
    """Range and consistency checks that a type system cannot express. Returns cfg for chaining."""
    for group, keys in _POSITIVE.items():
        for k in keys:
            v = getattr(getattr(cfg, group), k)
            _check(v > 0, f"{group}.{k}", f"must be > 0, got {v}")
    for group, keys in _UNIT_INTERVAL.items():
        for k in keys:
            v = getattr(getattr(cfg, group), k)
            _check(0 < v <= 1, f"{group}.{k}", f"must be in (0, 1], got {v}")
    _validate_method(cfg.method)
    _validate_tree(cfg.tree)
    w, m = cfg.workload, cfg.model
    _check(w.temperature >= 0, "workload.temperature", f"must be >= 0, got {w.temperature}")
    _check(w.top_k >= 0, "workload.top_k", f"must be >= 0 (0 = off), got {w.top_k}")
    _choice(w.split, "workload.split", ("train", "calibration", "test"))
    _choice(w.kind, "workload.kind", ("code", "prose", "grounded", "mixed"))
    _choice(m.source, "model.source", ("zoo", "random", "hub", "local"))
    _choice(cfg.model.dtype, "model.dtype", ("float32", "bfloat16", "float16"))
    _check(cfg.threads >= 0, "threads", f"must be >= 0 (0 = torch's default), got {cfg.threads}")
    _choice(cfg.device, "device", ("auto", "cpu", "cuda")) if not cfg.device.startswith("cuda:") else None
    _check(m.source not in ("hub", "local") or bool(m.path), "model.path", "required for hub/local models")
    if cfg.method.verifier == Verifier.greedy and w.temperature > 0 and cfg.task != Task.simulate:
        raise ConfigError(
            "method.verifier: greedy verification with workload.temperature > 0 is not lossless; "
            "use a sampling verifier (chain, specinfer, sequoia, deterministic) or temperature=0"
        )
    return cfg


def _validate_method(m: MethodConfig) -> None:
    _check(m.draft_cost_ratio >= 0, "method.draft_cost_ratio", f"must be >= 0, got {m.draft_cost_ratio}")
    _check(m.draft_fixed_ratio >= 0, "method.draft_fixed_ratio", f"must be >= 0, got {m.draft_fixed_ratio}")
    _check(0 <= m.verify_reuse_ratio < 1, "method.verify_reuse_ratio",
           f"must be in [0, 1), got {m.verify_reuse_ratio}")
    _choice(m.draft_steps, "method.draft_steps", ("depth", "one"))
    _choice(m.draft_cost, "method.draft_cost", ("ratio", "roofline"))
    _check(
        m.lossless == (m.verifier not in LOSSY_VERIFIERS),
        "method.lossless",
        f"verifier {m.verifier.value} is {'lossy' if m.verifier in LOSSY_VERIFIERS else 'lossless'}; "
        f"set method.lossless={m.verifier not in LOSSY_VERIFIERS}",
    )
    a = m.acceptance
    _check(0 <= a.alpha < 1, "method.acceptance.alpha", f"must be in [0, 1), got {a.alpha}")
    _check(0 < a.decay <= 1, "method.acceptance.decay", f"must be in (0, 1], got {a.decay}")
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
    _check(t.max_depth >= 2, "tree.max_depth", f"must be >= 2 (levels incl. the root), got {t.max_depth}")
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
