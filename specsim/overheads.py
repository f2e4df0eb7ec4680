"""Per-forward and per-step costs a fast GPU charges beyond the roofline: kernel launches, the framework's
own dispatch, tree attention masks and the speculation step's bookkeeping (p = target, q = draft).

On an A100 a batch-1 forward of a 7B model streams 13.5 GB in ~8 ms, so the ~1,800 kernels it launches
(32 layers × ~55 ops in an eager Hugging Face Llama) cost as much as the weights: a roofline alone
over-predicts every speedup whose draft is small (Sequoia's 68M draft, EAGLE's one-layer head, Medusa's
heads), because each draft pass pays the same per-kernel price. The model here, from microbenchmarks and
datasheets, not from any paper's speedup:

    eager     t(n) = max(host, device)      host   = kernels · host_us   (the CPU issues while the GPU runs)
    graph     t(n) = launch + device        device = roofline(n) + kernels · kernel_floor_us + mask bytes / BW

``kernels`` counts one forward's kernels (``KernelCount``: per decoder layer and fixed), the tree attention
mask adds n · (context + n) half-precision entries read per layer, and a speculation step adds the accepted
path's KV gather (two copies per layer unless a framework's count is given) plus a fixed number of
bookkeeping kernels (candidates, tree mask, posterior), all issued at the runtime's per-kernel host price,
and its host-device synchronisations (``.item()``, a tensor used as an index). Opt-in per paper (Medusa's
reference code, read): eager attention that materialises the scores, ``score_bytes`` per score entry per
head over its passes (:func:`eager_score_bytes`), and draft heads run on every tree position (``tokens``).
Inputs: conf/published/runtimes.yaml and the paper's file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from specsim.cost import ModelShape, TargetCost


@dataclass(frozen=True)
class Runtime:
    """How a framework issues the kernels of a forward. ``graph``: one CUDA-graph launch per forward (the
    host cost is ``graph_launch_us``); else eager, each kernel costs the host ``host_us_per_kernel``."""

    name: str
    graph: bool
    host_us_per_kernel: float
    kernel_floor_us: float  # device time of a kernel with (almost) no work: launch gap + ramp
    graph_launch_us: float = 0.0
    sync_us: float = 0.0  # a host-device synchronisation beyond a launch (the host waits for the stream)

    def __post_init__(self) -> None:
        assert min(self.host_us_per_kernel, self.kernel_floor_us, self.graph_launch_us, self.sync_us) >= 0, \
            f"runtime {self.name}: per-kernel costs must be >= 0"

    @classmethod
    def from_mapping(cls, name: str, m: Mapping[str, Any]) -> Runtime:
        return cls(name, bool(m["graph"]), float(m["host_us_per_kernel"]), float(m["kernel_floor_us"]),
                   float(m.get("graph_launch_us", 0.0)), float(m.get("sync_us", 0.0)))


@dataclass(frozen=True)
class KernelCount:
    """Kernels of one forward: ``per_layer`` · layers + ``fixed`` (embedding, final norm, LM head, output)."""

    per_layer: int
    fixed: int

    def of(self, n_layers: int) -> int:
        return self.per_layer * n_layers + self.fixed


def eager_score_bytes(score_bytes: int = 2, softmax_bytes: int = 4) -> int:
    """Bytes moved per attention-score entry per head by an eager (unfused) attention that upcasts the mask
    and the softmax: QKᵀ written (s), scaled (read s, write s), the float32 mask added (read s, write
    softmax_bytes), softmax in float32 (read and write softmax_bytes), cast back (read softmax_bytes, write
    s), read by the PV product (s). Medusa's modeling_llama_kv.py: 2 + 4 + 6 + 8 + 6 + 2 = 28 bytes."""
    s, f = score_bytes, softmax_bytes
    return s + 2 * s + (s + f) + 2 * f + (f + s) + s


@dataclass(frozen=True)
class LaunchBound:
    """A TargetCost: ``base`` (a roofline without its own fixed overhead) plus the launch model above and the
    tree attention mask (``mask_layers`` layers each read an n × (context + n) mask of 2-byte entries).
    Opt-in: ``score_heads`` heads per mask layer materialise their n × (context + n) scores, ``score_bytes``
    each (eager attention, :func:`eager_score_bytes`); ``tokens`` > 0 prices every call at that many tokens
    (draft heads run on every tree position whatever the draft step asks)."""

    base: TargetCost
    kernels: int
    runtime: Runtime
    bandwidth: float  # bytes/s, for the mask
    context_tokens: int = 0
    mask_layers: int = 0
    source: str = "roofline+launch"
    score_heads: int = 0
    score_bytes: float = 0.0
    tokens: int = 0

    def device(self, n: int | np.ndarray) -> np.ndarray:
        n = np.asarray(n, dtype=float)
        if self.tokens > 0:
            n = np.full_like(n, float(self.tokens))
        entries = n * (self.context_tokens + n) * self.mask_layers * (n > 1)
        mask = (2.0 + self.score_bytes * self.score_heads) * entries / self.bandwidth
        return np.asarray(self.base.time(n)) + self.kernels * self.runtime.kernel_floor_us * 1e-6 + mask

    def time(self, n: int | np.ndarray) -> float | np.ndarray:
        device = self.device(n)
        r = self.runtime
        if r.graph:
            t = r.graph_launch_us * 1e-6 + device
        else:
            t = np.maximum(self.kernels * r.host_us_per_kernel * 1e-6, device)
        return float(t) if np.ndim(t) == 0 else t


def step_overhead_s(runtime: Runtime, n_layers: int, fixed_kernels: int, gather_kernels: int | None = None,
                    syncs: int = 0) -> float:
    """Host time of a speculation step outside the forwards: the accepted path's K and V gathered
    (``gather_kernels``; None = 2 · layers copies, Sequoia's gather_kv per layer) plus ``fixed_kernels``
    (draft candidates, the tree mask and positions, the posterior's argmax/compare/cumprod), and ``syncs``
    host-device synchronisations at the runtime's ``sync_us``. Issued eagerly by every framework in these
    papers; under a graph runtime only the launch of each kernel's floor remains."""
    kernels = (2 * n_layers if gather_kernels is None else gather_kernels) + fixed_kernels
    r = runtime
    per = r.kernel_floor_us if r.graph else max(r.host_us_per_kernel, r.kernel_floor_us)
    return (kernels * per + syncs * r.sync_us) * 1e-6


def head_shape(hidden: int, vocab: int, *, layers: int = 0, intermediate: int = 0, extra_params: float = 0.0,
               lm_heads: int = 1, n_heads: int = 1, bytes_per_param: float = 2.0) -> ModelShape:
    """A draft head as a ModelShape: ``layers`` Llama decoder layers (4·h² attention + 3·h·I MLP each),
    ``lm_heads`` h × V output matrices and ``extra_params`` (EAGLE's 2h → h fusion, Medusa's ResBlocks)."""
    decoder = layers * (4.0 * hidden**2 + 3.0 * hidden * intermediate)
    params = decoder + lm_heads * hidden * vocab + extra_params
    return ModelShape(params, bytes_per_param, max(layers, 1), hidden, n_heads, n_heads)
