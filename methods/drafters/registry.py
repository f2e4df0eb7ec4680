"""``method.drafter`` name → drafter class. One line per method; classes are imported only when asked for,
so importing the registry is cheap. Every class has ``from_config(method, tree, models, sampling)`` and
implements methods.core.drafter.Drafter; tests iterate over ``names()`` (greedy equivalence, losslessness)."""

from __future__ import annotations

from importlib import import_module
from types import MappingProxyType

from specsim.config import MethodConfig
from specsim.tree import Tree

DRAFTERS = MappingProxyType({
    "autoregressive": "methods.drafters.autoregressive:Autoregressive",
    "draft_model": "methods.drafters.vanilla:DraftModelDrafter",  # vanilla, sequoia presets
    "prompt_lookup": "methods.drafters.prompt_lookup:PromptLookup",
    "medusa": "methods.drafters.medusa:MedusaDrafter",
    "lookahead": "methods.drafters.lookahead:Lookahead",
    "staged": "methods.drafters.staged:StagedDrafter",
    "specinfer": "methods.drafters.specinfer:SpecInferDrafter",  # several drafts, one merged tree
    "online": "methods.drafters.online:OnlineDrafter",  # the draft distilled on the target while serving
    "layerskip": "methods.drafters.layerskip:LayerSkipDrafter",  # self-speculative: early exit, shared KV
    "draft_verify": "methods.drafters.draft_verify:DraftVerifyDrafter",  # self-speculative: skipped sublayers
    "mtp": "methods.drafters.mtp:MTPDrafter",  # DeepSeek-V3 sequential MTP modules on the frozen target
    "eagle": "methods.drafters.eagle:EagleDrafter",  # EAGLE-1 / EAGLE-2 (tree=dynamic)
    "eagle3": "methods.drafters.eagle:Eagle3Drafter",
})
# Cheap declarations that run.py checks before any work (no drafter class is imported for them):
# drafters whose draft is a function of the context whatever the verifier (q one-hot, Draft.q = None); the
# verifiers that read q (chain, specinfer, sequoia) cannot verify them: greedy, deterministic or typical can.
DETERMINISTIC = frozenset({"prompt_lookup"})
# drafters that decode with the separate draft model q (model.draft_*, or model.draft_path for hub/local).
NEEDS_DRAFT_MODEL = frozenset({"draft_model"})
# how each drafter decodes a batch (workload.batch_size > 1, methods.core.batch_loop): "batched" (its own
# batched form: one draft computation for all rows), "per_row" (methods.core.batch_drafter.PerRow: one
# instance per row, correct but drafting row by row), or "no: <why>" (run.py rejects the config).
_SHARED_ENGINE = "no: it drafts with the target's own engine and KV cache (attach, shared cache), which " \
                 "holds one sequence"
BATCHABLE = MappingProxyType({
    "autoregressive": "batched",
    "draft_model": "batched",
    "prompt_lookup": "batched",
    "medusa": "batched",
    "lookahead": "per_row",
    "staged": "per_row",
    "specinfer": "per_row",
    "online": "no: it learns from the requests it serves, in order; one copy per row would train B "
              "separate drafts",
    "layerskip": _SHARED_ENGINE,
    "draft_verify": _SHARED_ENGINE,
    "mtp": "batched",
    "eagle": "batched",  # EAGLE-1's static and EAGLE-2's dynamic top-k trees; sampled candidates: per row
    "eagle3": "batched",  # the same, its head fed the feature_layers the batched target forward returns
})


def names() -> tuple[str, ...]:
    return tuple(DRAFTERS)


def drafter_class(name: str) -> type:
    if name not in DRAFTERS:
        raise KeyError(
            f"drafter {name!r} has no real-decoding implementation yet (registered: "
            f"{', '.join(sorted(DRAFTERS))}); its method preset still works with task=simulate"
        )
    module, attr = DRAFTERS[name].split(":")
    return getattr(import_module(module), attr)


def backbone_of(drafter, models, model_name: str) -> tuple[object, str]:
    """(target model, its name for metrics.json) that both the method and its same-run baseline decode: the
    drafter's own backbone (Medusa-2's tuned target), else the run's target ("<model> target")."""
    own = getattr(drafter, "backbone", None)
    return (own.model, own.name) if own is not None else (models.target, f"{model_name} target")


def build_drafter(method: MethodConfig, tree: Tree | None, models, sampling, tree_cfg=None):
    """The drafter ``method.drafter`` names, built for this run. ``tree_cfg`` (the tree preset) reaches only
    drafters declaring ``reads_tree_config`` (they shape their tree per context: EAGLE-2's dynamic tree)."""
    cls = drafter_class(method.drafter)
    if tree_cfg is not None and getattr(cls, "reads_tree_config", False):
        return cls.from_config(method, tree, models, sampling, tree_cfg=tree_cfg)
    return cls.from_config(method, tree, models, sampling)
