"""The simulator's prediction for one composed run: τ (k̄, bonus included) and speedup S = k̄·t_AR / t_step.

Acceptance from ``method.acceptance`` (specsim.acceptance), t(n) from the hardware × model roofline or a
measured profile, draft time from the method (specsim.cost), the tree from the ``tree`` preset
(specsim.trees) or the exact tree a real run used. Notation: p = target, q = draft.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specsim.acceptance import from_config
from specsim.config import RunConfig, TreeKind, flat
from specsim.cost import CostModel, TargetCost
from specsim.expected import accepted_length_law, expected_tokens, tokens_per_forward
from specsim.run_steps import run_shares
from specsim.tree import Tree
from specsim.trees import acceptance_vector, build_tree

NO_DRAFTER = "autoregressive"  # the method.drafter that proposes nothing (methods.drafters.registry)


@dataclass(frozen=True)
class Prediction:
    predicted_tau: float
    predicted_speedup: float
    tree_size: int  # nodes including the root (= tokens verified per step)
    tree_depth: int  # largest node depth, root at 0 (a chain of γ: γ)
    tree_levels: int  # Sequoia's unit: levels including the root
    tree_width: int
    t_verify_s: float  # t(tree_size + method.verify_extra_tokens)
    t_draft_s: float
    t_ar_s: float  # t(1): one autoregressive step
    t_step_s: float
    acceptance_kind: str
    cost_source: str  # roofline | measured
    tau_law: tuple[float, ...]  # P(τ = k), k = 0 … depth + 1
    # a generation of workload.max_new_tokens: tokens per forward after the last step's cut, and the speedup
    # of the decode (prefill left out) that a measure run's decode_speedup is (specsim.expected)
    tokens_per_forward: float
    predicted_decode_speedup: float
    # ... whose step is the mean of its steps', the generation's cut last ones included (specsim.run_steps)
    t_draft_run_s: float
    t_verify_run_s: float
    acceptance_vector: tuple[float, ...]  # the Sequoia vector the tree was optimised for, () if none
    tree_parents: tuple[int, ...]
    tree_ranks: tuple[int, ...]
    inputs: dict[str, Any] = field(default_factory=dict)  # flat config (dotted keys) + run identity

    def to_dict(self) -> dict[str, Any]:
        """One flat JSON-able object: inputs first, then the prediction (lists for tuples)."""
        out = dict(self.inputs)
        for key, value in asdict(self).items():
            if key != "inputs":
                out[key] = list(value) if isinstance(value, tuple) else value
        return out


def _inputs(cfg: RunConfig) -> dict[str, Any]:
    """flat(cfg) (task, seed, dotted keys) plus the contract's short names of each group's preset."""
    tree_name = getattr(cfg.tree, "name", "") or TreeKind(cfg.tree.kind).value
    ident = {"method": cfg.method.name, "tree": tree_name, "hardware": cfg.hardware.name,
             "workload": cfg.workload.name, "model": cfg.model.name}
    return {**flat(cfg), **ident}


def simulate(cfg: RunConfig, profile: TargetCost | None = None, tree: Tree | None = None,
             draft_levels: TargetCost | None = None) -> Prediction:
    """Predict τ and speedup for ``cfg``. ``profile`` (a measured t(n), e.g. specsim.cost.MeasuredCost)
    replaces the roofline; ``tree`` is the exact tree a real run used (else built from ``cfg.tree``).
    A method without a drafter (plain decoding) predicts the root alone: k̄ = 1, speedup 1.
    Sequoia and dynamic trees need a positional vector: without a measured one it is derived from the
    α model (specsim.trees.acceptance_vector); τ itself is always computed under the method's model.
    ``draft_levels`` (a measured draft level's seconds per width) prices the draft level by level."""
    model = from_config(cfg.method.acceptance)
    cost = CostModel.from_config(cfg, profile, draft_levels)
    kind = TreeKind(cfg.tree.kind)
    if tree is None:  # a method without a drafter proposes nothing, whatever the tree preset says
        tree = Tree.chain(0) if cfg.method.drafter == NO_DRAFTER else build_tree(cfg.tree, model, cost)
    vector = ()
    if kind in (TreeKind.sequoia, TreeKind.dynamic):  # the vector the tree was optimised for
        width = cfg.tree.top_k if kind == TreeKind.dynamic else None
        vector = tuple(float(x) for x in acceptance_vector(model, width))
    tau = expected_tokens(tree, model)
    law = accepted_length_law(tree, model)
    per_forward = tokens_per_forward(law, cfg.workload.max_new_tokens)
    t_verify, t_draft = cost.tree_verify_time(tree), cost.draft_time(tree)
    shares = run_shares(cost, tree, law, cfg.workload.max_new_tokens, cfg.method.room_spare)
    run_draft, run_verify = t_draft * shares.draft, t_verify * shares.verify
    return Prediction(
        predicted_tau=tau,
        predicted_speedup=tau * cost.ar_time / (t_verify + t_draft),
        tree_size=tree.size,
        tree_depth=tree.depth,
        tree_levels=tree.depth + 1,
        tree_width=tree.width,
        t_verify_s=t_verify,
        t_draft_s=t_draft,
        t_ar_s=cost.ar_time,
        t_step_s=t_verify + t_draft,
        acceptance_kind=model.kind,
        cost_source=cost.target.source,
        tau_law=tuple(float(x) for x in law),
        tokens_per_forward=per_forward,
        predicted_decode_speedup=per_forward * cost.ar_time / (run_verify + run_draft),
        t_draft_run_s=run_draft,
        t_verify_run_s=run_verify,
        acceptance_vector=vector,
        tree_parents=tree.parents,
        tree_ranks=tree.ranks,
        inputs=_inputs(cfg),
    )
