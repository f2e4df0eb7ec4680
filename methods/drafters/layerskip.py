"""LayerSkip self-speculative decoding (Elhoushi et al. 2024): the draft q is the target p's first E layers
followed by p's own final norm and LM head (early exit); the verify pass runs the remaining layers.

The draft runs on the target's own engine (``attach``), so its KV of layers [0, E) IS the target's KV for
those layers: the draft leaves root..d_{γ-1} pending in the target's cache and returns their residual
stream at layer E (``Draft.resume``); the verify forward runs layers [0, E) only for the last draft token
and layers [E, L) for all, then the loop's commit keeps the accepted path in every layer (the paper's
shared KV cache; its exit-query cache is the same saving). Chains only, as in the paper.

Greedy / deterministic verifiers: q = argmax of the early exit (q = None). chain / specinfer: drafts are drawn
from the processed early-exit law with the run's generator and its rows returned (speculative sampling).
``variant``: "train" loads the LayerSkip-trained variant of the target (methods.zoo.layerskip) INTO
``models.target`` in place — a different model, whose own autoregressive decoding is the baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from methods.core.drafter import Draft, DraftContext, StepFeedback, root_only
from methods.core.engine import ModelEngine, Resume
from methods.core.fast_llama import SubLayers
from methods.core.sampling import SamplingParams, probs
from methods.drafters.params import checked_params
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree

_SAMPLED = {Verifier.chain, Verifier.specinfer}


@dataclass(frozen=True)
class LayerSkipParams:
    """``method.params`` of the layerskip drafter."""

    exit_layer: int | str = "auto"  # E: the draft is layers [0, E); "auto": chosen on this device
    # (methods.drafters.exit_choice: the best predicted speedup from the calibrated α_E, ρ_E and t(γ+1))
    gamma: int = 0  # draft length; 0 = the configured chain's
    variant: str = "none"  # "none": the target as it is; "train": its LayerSkip-trained variant (cached)
    train: dict = field(default_factory=dict)  # LayerSkipRecipe fields (steps, p_max, e_scale, ...)

    @classmethod
    def from_method(cls, method: MethodConfig) -> LayerSkipParams:
        return cls(**checked_params(cls, method.params, "layerskip"))


class LayerSkipDrafter:
    needs_hidden_states = False

    def __init__(self, exit_layer: int, gamma: int, sampling: SamplingParams, sample: bool = False) -> None:
        assert exit_layer >= 1 and gamma >= 1, f"exit layer {exit_layer}, draft length {gamma}: need >= 1"
        self.exit_layer, self.gamma, self.sampling, self.sample = exit_layer, gamma, sampling, sample
        self.sub = SubLayers(stop=exit_layer)
        self.tree = Tree.chain(gamma)
        self.engine: ModelEngine | None = None
        self._chains: dict[int, Tree] = {}
        self.decoded_model = ""  # set when the target was replaced by the LayerSkip variant
        self.exit_choice: dict | None = None  # the calibrated exit table when exit_layer was "auto"

    @classmethod
    def from_config(cls, method: MethodConfig, tree: Tree | None, models, sampling: SamplingParams
                    ) -> LayerSkipDrafter:
        lp = LayerSkipParams.from_method(method)
        verifier = Verifier(method.verifier)
        if tree is not None and tree.width > 1:
            raise ValueError(f"layerskip drafts chains, got {tree}")
        gamma = lp.gamma or (tree.depth if tree is not None else 4)
        n_layers = models.target.config.num_hidden_layers
        auto = lp.exit_layer == "auto"
        if not auto and (isinstance(lp.exit_layer, str) or not 1 <= lp.exit_layer < n_layers):
            raise ValueError(f"layerskip: exit_layer {lp.exit_layer!r} must be auto or in 1..{n_layers - 1}")
        if n_layers < 2:
            raise ValueError(f"layerskip: a {n_layers}-layer target has no early exit")
        if lp.variant == "train":
            load_variant_into(models, lp.train)
        elif lp.variant != "none":
            raise ValueError(f"layerskip: variant {lp.variant!r}: allowed none, train")
        choice = None
        if auto:  # on the decoded model (the variant, once loaded)
            from methods.drafters.exit_choice import ensure_exit_choice

            choice = ensure_exit_choice(models.target, models.tokenizer, gamma)
        exit_layer = choice["chosen"] if choice else lp.exit_layer
        out = cls(exit_layer, gamma, sampling, sample=not sampling.greedy and verifier in _SAMPLED)
        out.exit_choice = choice
        if lp.variant == "train":  # metrics.json says what was decoded, and against which baseline
            out.decoded_model = ("the LayerSkip variant of the target (continued training, methods.zoo."
                                 "layerskip): tau and speedup are against the variant's own autoregressive "
                                 "decoding, not the zoo target's")
        return out

    def run_stats(self) -> dict:
        """metrics.json: the exit layer decoded with, and how it was chosen (auto: the calibrated table)."""
        out: dict = {"exit_layer": self.exit_layer,
                     "exit_layer_source": "config" if self.exit_choice is None else "auto (calibrated)"}
        if self.exit_choice is not None:
            ranked = sorted(self.exit_choice["ranked"], key=lambda r: r["exit_layer"])
            out.update(exit_alpha_by_layer=[r["alpha"] for r in ranked],
                       exit_rho_by_layer=[r["rho"] for r in ranked],
                       exit_predicted_speedup_by_layer=[r["speedup"] for r in ranked],
                       exit_choice_clock=self.exit_choice["clock"])
        return out

    # ---- protocol -----------------------------------------------------------------------------------
    def attach(self, target: ModelEngine) -> None:
        assert target.fast is not None, "layerskip drafts with the lean Llama forward of the target's engine"
        assert self.exit_layer < target.n_layers, f"exit layer {self.exit_layer} >= {target.n_layers} layers"
        self.engine = target

    def reset(self, prompt: torch.Tensor) -> None:
        assert self.engine is not None, "layerskip: the loop attaches the target's engine before reset"

    def feedback(self, fb: StepFeedback) -> None:
        """Nothing to do: the target's commit kept the accepted nodes' layers [0, E) KV with the rest."""

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft:
        eng = self.engine
        root = int(ctx.tokens[-1])
        gamma = min(self.gamma, ctx.max_new)
        if gamma < 1:
            return root_only(root, ctx.tokens.device)
        dev = eng.device
        tokens = torch.empty(gamma + 1, dtype=torch.long, device=dev)
        tokens[0] = root
        q = None
        residuals = []
        for d in range(gamma):  # early exit of node d gives node d + 1
            out = eng.extend(tokens[d : d + 1], [d - 1], last_only=True, sub=self.sub)
            residuals.append(out.residual)
            if self.sample:
                row = probs(out.logits, self.sampling)[0]  # (V,)
                q = torch.zeros(gamma + 1, row.numel(), device=dev) if q is None else q
                q[d] = row
                tokens[d + 1] = torch.multinomial(row, 1, generator=ctx.generator)[0]
            else:
                tokens[d + 1] = out.logits[0].argmax()
        return Draft(self._chain(gamma), tokens, q, resume=Resume(self.exit_layer, torch.cat(residuals)))

    def _chain(self, gamma: int) -> Tree:
        if gamma not in self._chains:  # one Tree object per length: the engine memoises masks by tree
            self._chains[gamma] = Tree.chain(gamma)
        return self._chains[gamma]


def load_variant_into(models, train: dict) -> None:
    """Train (cached) or load the LayerSkip variant of ``models.target`` and load its weights in place. A
    target that already is a cached variant (a second drafter built on the same models) is left as is."""
    from methods.zoo.layerskip import LayerSkipRecipe, ensure_layerskip, is_variant, load_variant

    target = models.target
    if is_variant(target):
        return
    path = ensure_layerskip(target, models.tokenizer, LayerSkipRecipe(**train))
    with torch.no_grad():
        target.load_state_dict(load_variant(path).state_dict())
