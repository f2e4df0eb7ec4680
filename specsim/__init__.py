"""specsim: an analytical simulator of speculative decoding (p = target, q = draft), pure NumPy/SciPy.

Public API (docs/architecture.md, "Contracts"): ``Tree``, ``chain_expected_tokens``, ``expected_tokens``, the
``sequoia`` submodule (``optimal_tree``, ``select``), acceptance models, cost models and ``simulate``.
"""

from specsim import sequoia
from specsim.acceptance import (
    AcceptanceModel,
    DepthVectorAcceptance,
    IIDAcceptance,
    PositionalAcceptance,
    PowerAcceptance,
    TableAcceptance,
    as_acceptance,
)
from specsim.acceptance import from_config as acceptance_from_config
from specsim.cost import CostModel, DraftCost, MeasuredCost, ModelShape, Roofline, TargetCost
from specsim.expected import (
    GammaChoice,
    accepted_length_law,
    chain_expected_tokens,
    expected_tokens,
    optimal_gamma,
    path_probs,
)
from specsim.montecarlo import empirical_law, simulate_tau
from specsim.predict import Prediction, simulate
from specsim.tree import Tree
from specsim.trees import acceptance_vector, build_tree

__all__ = [
    "AcceptanceModel", "CostModel", "DepthVectorAcceptance", "DraftCost", "GammaChoice", "IIDAcceptance",
    "MeasuredCost", "ModelShape", "PositionalAcceptance", "PowerAcceptance", "Prediction", "Roofline",
    "TableAcceptance", "TargetCost", "Tree",
    "acceptance_from_config", "acceptance_vector", "accepted_length_law", "as_acceptance", "build_tree",
    "chain_expected_tokens", "empirical_law", "expected_tokens", "optimal_gamma", "path_probs", "sequoia",
    "simulate", "simulate_tau",
]
