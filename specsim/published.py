"""Published tables from published inputs: a paper's own setting (model shape, hardware, measured acceptance
vector or acceptance length τ, draft shape, framework) priced by the simulator and set beside the paper's
figure, with the relative error per row (issue 17, part 2). p = target, q = draft.

Sequoia (Chen et al. 2024, arXiv 2402.12374), Medusa (Cai et al. 2024, arXiv 2401.10774), EAGLE (Li et al.
2024a, arXiv 2401.15077) and EAGLE-2 (Li et al. 2024b, arXiv 2406.16858). The rows and their sources are in
conf/published/<paper>.yaml, the framework costs in conf/published/runtimes.yaml (specsim.overheads); a
composed RunConfig per row (``experiment=<paper's preset>`` plus the row's overrides) brings the model,
hardware, method and tree. Where a paper gives τ and not a vector, α is solved from τ on the method's own
tree (the input inverted, never a speedup fitted). Nothing here is tuned to a published speedup.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specsim.acceptance import AcceptanceModel, IIDAcceptance, PowerAcceptance, from_config
from specsim.config import AcceptanceKind, RunConfig
from specsim.cost import CostModel, DraftCost, ModelShape, Roofline
from specsim.expected import expected_tokens
from specsim.overheads import KernelCount, LaunchBound, Runtime, head_shape, step_overhead_s
from specsim.tree import Tree
from specsim.trees import build_tree

DRAFT_KINDS = ("model", "eagle_head", "medusa_heads")
MISS = 0.15  # |error| above which docs/published.md says what the simulator misses


@dataclass(frozen=True)
class Setting:
    """What a paper's framework adds to the composed config: runtimes, kernel counts and the draft's form."""

    target_runtime: Runtime
    draft_runtime: Runtime
    kernels: KernelCount  # of one target (or draft-model) forward
    step_fixed_kernels: int  # bookkeeping kernels of a speculation step beyond the KV gather
    draft: str = "model"  # model | eagle_head | medusa_heads
    head_kernels: int = 0  # kernels of one head pass beyond its decoder layers (eagle) / per head (medusa)
    medusa_heads: int = 0
    tau: float | None = None  # published acceptance length: α is solved from it
    # opt-in per paper, counted from its reference code (defaults: the generic model above)
    score_bytes: float = 0.0  # eager attention: bytes per score entry per head (overheads.eager_score_bytes)
    head_tokens: int = 0  # the draft heads run on this many tokens per step (Medusa: every tree position)
    gather_kernels: int | None = None  # kernels of the accepted path's KV gather (None: 2 per layer)
    step_syncs: int = 0  # host-device synchronisations per step outside the forwards

    def __post_init__(self) -> None:
        assert self.draft in DRAFT_KINDS, f"draft must be one of {DRAFT_KINDS}, got {self.draft!r}"
        assert self.draft != "medusa_heads" or self.medusa_heads >= 1, "medusa_heads needs >= 1 head"
        assert self.tau is None or self.tau >= 1, f"τ counts the bonus token: >= 1, got {self.tau}"
        assert self.score_bytes >= 0 and self.head_tokens >= 0 and self.step_syncs >= 0, \
            "score_bytes, head_tokens and step_syncs are >= 0"
        assert self.gather_kernels is None or self.gather_kernels >= 0, "gather_kernels >= 0"


@dataclass(frozen=True)
class Forecast:
    speedup: float
    tau: float
    t_ar_ms: float
    t_step_ms: float
    tree_size: int
    tree_depth: int
    alpha: float | None  # solved from the published τ, None when the acceptance was given
    roofline_speedup: float  # the same tree and τ priced by the plain roofline (CostModel.from_config)


def relative_error(predicted: float, published: float) -> float:
    """(predicted − published) / published; NaN where either is missing."""
    if published is None or predicted is None or not published or not math.isfinite(predicted):
        return math.nan
    return (predicted - published) / published


def _launch(hw: Any, shape: ModelShape, runtime: Runtime, kernels: int, context: int) -> LaunchBound:
    base = Roofline.from_config(replace(hw, overhead_ms=0.0), shape, context)  # overhead priced here instead
    return LaunchBound(base, kernels, runtime, base.bandwidth, context, mask_layers=shape.n_layers)


def cost_model(cfg: RunConfig, s: Setting) -> CostModel:
    """The target's roofline + launch model, the draft as the paper runs it, and the step's bookkeeping."""
    hw, m, ctx = cfg.hardware, cfg.model, cfg.workload.context_tokens
    target = _launch(hw, ModelShape.target(m), s.target_runtime, s.kernels.of(m.n_layers), ctx)
    if s.score_bytes:  # eager attention materialises every head's scores over the tree
        target = replace(target, score_heads=m.n_heads, score_bytes=s.score_bytes)
    resident = replace(hw, offload=False)  # drafts and heads stay in device memory
    if s.draft == "model":
        draft = _launch(resident, ModelShape.draft(m), s.draft_runtime, s.kernels.of(m.draft_n_layers), ctx)
        draft = replace(draft, mask_layers=0)  # the draft decodes a level as a batch of paths: no tree mask
    elif s.draft == "eagle_head":  # one decoder layer + the 2h → h fusion + the target's LM head, per level
        shape = head_shape(m.hidden_size, m.vocab_size, layers=1, intermediate=m.intermediate_size,
                           extra_params=2.0 * m.hidden_size**2, n_heads=m.n_heads)
        draft = _launch(resident, shape, s.draft_runtime, s.kernels.per_layer + s.head_kernels, ctx)
    else:  # Medusa-1: K heads, each a ResBlock (h²) and its own LM head, in one pass over the last state
        k = s.medusa_heads
        shape = head_shape(m.hidden_size, m.vocab_size, lm_heads=k, extra_params=k * m.hidden_size**2)
        draft = replace(_launch(resident, shape, s.draft_runtime, k * s.head_kernels, 0), mask_layers=0,
                        tokens=s.head_tokens)
    t1 = float(target.time(1))
    step = step_overhead_s(s.target_runtime, m.n_layers, s.step_fixed_kernels, s.gather_kernels, s.step_syncs)
    one_pass = s.draft == "medusa_heads"
    return CostModel(target, DraftCost(fixed_ratio=step / t1, one_pass=one_pass, model=draft))


def _alpha_model(cfg: RunConfig, alpha: float) -> AcceptanceModel:
    a = cfg.method.acceptance
    return PowerAcceptance(alpha, a.decay) if a.kind == AcceptanceKind.power else IIDAcceptance(alpha)


def solve_alpha(tau_of: Callable[[float], float], tau: float, lo: float = 0.0, hi: float = 0.999) -> float:
    """α with τ(α) = ``tau`` by bisection (τ grows with α); raises when τ is out of the tree's reach.
    Where the tree itself is rebuilt from α (EAGLE-2's budgeted tree) τ(α) steps a little: the match is
    that close."""
    t_lo, t_hi = tau_of(lo), tau_of(hi)
    if not t_lo <= tau <= t_hi:
        raise ValueError(f"τ = {tau} is outside [{t_lo:.3f}, {t_hi:.3f}], the reach of this tree")
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if tau_of(mid) < tau else (lo, mid)
    return 0.5 * (lo + hi)


def forecast(cfg: RunConfig, s: Setting) -> Forecast:
    """τ and speedup of the row: acceptance from the method (or α solved from the published τ on the tree the
    method builds), tree from the tree preset (Sequoia's choice and EAGLE-2's budget see this cost model)."""
    cost = cost_model(cfg, s)
    alpha = None
    if s.tau is None:
        model = from_config(cfg.method.acceptance)
    else:
        def tau_of(a: float) -> float:
            m = _alpha_model(cfg, a)
            return expected_tokens(build_tree(cfg.tree, m, cost), m)
        alpha = solve_alpha(tau_of, s.tau)
        model = _alpha_model(cfg, alpha)
    tree: Tree = build_tree(cfg.tree, model, cost)
    tau = expected_tokens(tree, model)
    step = cost.step_time(tree)
    plain = CostModel.from_config(cfg)  # what task=simulate prices without the launch model
    return Forecast(tau * cost.ar_time / step, tau, cost.ar_time * 1e3, step * 1e3, tree.size, tree.depth,
                    alpha, tau * plain.ar_time / plain.step_time(tree))


def setting_from(paper: Mapping[str, Any], runtimes: Mapping[str, Any], row: Mapping[str, Any]) -> Setting:
    """A row's Setting from the paper file's defaults, overridden by the row's own keys (conf/published)."""
    merged = {**paper.get("setting", {}), **row.get("setting", {})}
    rt = runtimes["runtimes"]
    k = runtimes["kernels"][merged.get("kernels", "hf_llama_eager")]
    tau = row.get("published", {}).get("tau") if merged.get("tau_from_published") else None
    return Setting(
        target_runtime=Runtime.from_mapping(merged["target_runtime"], rt[merged["target_runtime"]]),
        draft_runtime=Runtime.from_mapping(merged["draft_runtime"], rt[merged["draft_runtime"]]),
        kernels=KernelCount(int(k["per_layer"]), int(k["fixed"])),
        step_fixed_kernels=int(merged.get("step_fixed_kernels", runtimes["step_fixed_kernels"])),
        draft=merged.get("draft", "model"),
        head_kernels=int(merged.get("head_kernels", 0)),
        medusa_heads=int(merged.get("medusa_heads", 0)),
        tau=float(tau) if tau is not None else None,
        score_bytes=float(merged.get("score_bytes", 0.0)),
        head_tokens=int(merged.get("head_tokens", 0)),
        gather_kernels=int(merged["gather_kernels"]) if merged.get("gather_kernels") is not None else None,
        step_syncs=int(merged.get("step_syncs", 0)),
    )


COLUMNS = ("paper", "row", "published_speedup", "predicted_speedup", "speedup_error", "roofline_speedup",
           "published_tau", "predicted_tau", "tau_at_published", "published_ar_ms", "predicted_ar_ms",
           "ar_error", "published_step_ms", "predicted_step_ms", "step_error", "tree", "inputs", "source")


def table_row(paper: str, row: Mapping[str, Any], f: Forecast) -> dict[str, Any]:
    """One line of the published-vs-predicted table (published figures may be absent: NaN)."""
    pub = row.get("published", {})
    sp, ar, step = pub.get("speedup"), pub.get("baseline_ms"), pub.get("step_ms")
    return {
        "paper": paper, "row": row["id"],
        "published_speedup": sp, "predicted_speedup": f.speedup,
        "speedup_error": relative_error(f.speedup, sp),
        "roofline_speedup": f.roofline_speedup,
        "published_tau": pub.get("tau"), "predicted_tau": f.tau,
        # the τ this step cost would need to give the published speedup: a miss's share of acceptance vs cost
        "tau_at_published": sp * f.t_step_ms / f.t_ar_ms if sp else math.nan,
        "published_ar_ms": ar, "predicted_ar_ms": f.t_ar_ms, "ar_error": relative_error(f.t_ar_ms, ar),
        # a speculation step's own time where the paper's runs record it (Medusa's MT-bench answer files):
        # the cost side checked apart from τ
        "published_step_ms": step, "predicted_step_ms": f.t_step_ms,
        "step_error": relative_error(f.t_step_ms, step),
        "tree": f"{f.tree_size} nodes, depth {f.tree_depth}", "inputs": row.get("inputs", "published"),
        "source": row.get("source", ""),
    }


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The table as Markdown: errors as signed percentages, missing figures as an en dash."""
    def cell(key: str, v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "–"
        if key.endswith("error"):
            return f"{100 * v:+.0f}%"
        if isinstance(v, float):
            return f"{v:.2f}" if not key.endswith("_ms") else f"{v:.1f}"
        return str(v).replace("|", "/")
    cols = [c for c in COLUMNS if c != "source"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(c, r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def misses(rows: Sequence[Mapping[str, Any]], limit: float = MISS) -> list[Mapping[str, Any]]:
    """Rows whose speedup, t_AR or step-time error exceeds ``limit`` in magnitude."""
    def big(v: Any) -> bool:
        return isinstance(v, float) and math.isfinite(v) and abs(v) > limit
    return [r for r in rows if any(big(r.get(k)) for k in ("speedup_error", "ar_error", "step_error"))]
