"""Draft & Verify (Zhang et al. 2023, "Draft & Verify: Lossless Large Language Model Acceleration via
Self-Speculative Decoding"): the draft q is the target p itself with a subset of its attention and MLP
sub-layers skipped; the full target verifies. No training.

The draft runs on the target's own engine (``attach``): it reads the target's exact KV of the committed
prefix, writes its own (approximate) KV of the draft nodes into the layers whose attention it runs, and drops
them before returning (the verify pass recomputes every node). Adaptive draft-exiting (the paper's Algorithm
2, its constants as we read them): drafting stops at the first token whose draft confidence (top-1
probability) is below a threshold γ_th, and after each verification, with AR the step's acceptance rate,
    AR~ <- β1·AR~ + (1-β1)·AR;   γ~ = γ_th + ε if AR~ < α_target else γ_th - ε;   γ_th <- β2·γ_th + (1-β2)·γ~
(clipped to [0, 1]): low acceptance raises the threshold (shorter drafts), high acceptance lowers it. The
rule and its pricing (the law of the draft length under it) are specsim.adaptive_exit's.
The skip set comes from config, or ``skip: search``: the cached greedy search of
methods.drafters.skip_search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from methods.core.drafter import Draft, DraftContext, StepFeedback, root_only
from methods.core.engine import ModelEngine
from methods.core.fast_llama import SubLayers
from methods.core.sampling import SamplingParams, probs
from methods.drafters.params import checked_params
from specsim.adaptive_exit import ExitRule, next_state
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree

_SAMPLED = {Verifier.chain, Verifier.specinfer}


AdaptiveExit = ExitRule  # the rule's constants, shared with its pricing (specsim.adaptive_exit)


@dataclass(frozen=True)
class DraftVerifyParams:
    """``method.params`` of the draft_verify drafter."""

    skip: str = "search"  # "search" (cached greedy search) | "config" (skip_attn / skip_mlp below)
    skip_attn: tuple[int, ...] = ()
    skip_mlp: tuple[int, ...] = ()
    gamma: int = 0  # the longest draft; 0 = the search's best (skip=search) or the configured chain's
    exit_threshold: float = 0.6
    adaptive: bool = True
    target_acceptance: float = 0.8

    @classmethod
    def from_method(cls, method: MethodConfig) -> DraftVerifyParams:
        return cls(**checked_params(cls, method.params, "draft_verify", int_tuples=("skip_attn", "skip_mlp")))


class DraftVerifyDrafter:
    needs_hidden_states = False

    def __init__(self, sub: SubLayers, gamma: int, sampling: SamplingParams, exit_rule: AdaptiveExit,
                 sample: bool = False) -> None:
        assert gamma >= 1, f"draft length {gamma} must be >= 1"
        self.sub, self.gamma, self.sampling, self.rule, self.sample = sub, gamma, sampling, exit_rule, sample
        self.tree = Tree.chain(gamma)
        self.engine: ModelEngine | None = None
        self.threshold, self._ar = exit_rule.threshold, exit_rule.target_acceptance
        self._chains: dict[int, Tree] = {}
        self.draft_forwards, self.draft_steps, self.drafted = 0, 0, 0  # counters (run_stats, calibration)

    @classmethod
    def from_config(cls, method: MethodConfig, tree: Tree | None, models, sampling: SamplingParams
                    ) -> DraftVerifyDrafter:
        dp = DraftVerifyParams.from_method(method)
        if tree is not None and tree.width > 1:
            raise ValueError(f"draft_verify drafts chains, got {tree}")
        gamma = dp.gamma or (tree.depth if tree is not None else 4)
        if dp.skip == "search":
            from methods.drafters.skip_search import ensure_skip_set

            found = ensure_skip_set(models.target, models.tokenizer)
            # gamma 0: the search's best chain length (none when no set predicts a speedup: the chain's)
            sub, gamma = found.sub, dp.gamma or found.gamma or gamma
        elif dp.skip == "config":
            sub = SubLayers(skip_attn=frozenset(dp.skip_attn), skip_mlp=frozenset(dp.skip_mlp))
        else:
            raise ValueError(f"draft_verify: skip {dp.skip!r}: allowed search, config")
        n_layers = models.target.config.num_hidden_layers
        if any(not 0 <= i < n_layers for i in (*sub.skip_attn, *sub.skip_mlp)):
            raise ValueError(f"draft_verify: skipped layers {sub} outside 0..{n_layers - 1}")
        rule = AdaptiveExit(dp.exit_threshold, dp.adaptive, dp.target_acceptance)
        sample = not sampling.greedy and Verifier(method.verifier) in _SAMPLED
        return cls(sub, gamma, sampling, rule, sample)

    # ---- protocol -----------------------------------------------------------------------------------
    def attach(self, target: ModelEngine) -> None:
        assert target.fast is not None, "draft_verify drafts with the target engine's lean Llama forward"
        self.engine = target

    def reset(self, prompt: torch.Tensor) -> None:
        assert self.engine is not None, "draft_verify: the loop attaches the target's engine before reset"

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft:
        eng, root = self.engine, int(ctx.tokens[-1])
        gamma = min(self.gamma, ctx.max_new)
        if gamma < 1:
            return root_only(root, ctx.tokens.device)
        tokens, rows = [root], []
        self.draft_steps += 1
        for d in range(gamma):
            self.draft_forwards += 1
            out = eng.extend(torch.tensor(tokens[d : d + 1], device=eng.device), [d - 1], last_only=True,
                             sub=self.sub)
            q = probs(out.logits, self.sampling)[0] if self.sample else out.logits[0].softmax(-1)  # (V,)
            tok = int(torch.multinomial(q, 1, generator=ctx.generator)) if self.sample else int(q.argmax())
            if d > 0 and float(q[tok] if self.sample else q.max()) < self.threshold:
                break  # draft-exit: not confident enough (the first draft token is always kept)
            tokens.append(tok)
            rows.append(q)
        eng.drop_pending()  # the draft's KV of its own nodes is approximate: the verify recomputes them
        k = len(tokens) - 1
        self.drafted += k
        q_rows = None
        if self.sample:
            q_rows = torch.zeros(k + 1, rows[0].numel(), device=eng.device)
            q_rows[:k] = torch.stack(rows[:k])
        return Draft(self._chain(k), torch.tensor(tokens, device=eng.device), q_rows)

    def feedback(self, fb: StepFeedback) -> None:
        """The adaptive draft-exit update (module docstring)."""
        drafted = fb.draft.tree.depth
        if not self.rule.adaptive or drafted == 0:
            return
        self.threshold, self._ar = next_state(self.rule, self.threshold, self._ar,
                                              (len(fb.accepted) - 1) / drafted)

    def clear_records(self) -> None:
        """Forget the counters of the decodes so far (measure calls it after the warm-up, whose steps are not
        the run's); the exit rule's state carries on, as it does in the loop."""
        self.draft_forwards, self.draft_steps, self.drafted = 0, 0, 0

    def run_stats(self) -> dict[str, float]:
        """Draft forwards and tokens per drafting step so far (a forward that fell below the threshold was
        paid for: the calibration prices a draft step per forward, not per level)."""
        steps = max(self.draft_steps, 1)
        return {"draft_forwards": self.draft_forwards, "draft_steps": self.draft_steps,
                "draft_forwards_per_step": self.draft_forwards / steps,
                "mean_draft_length": self.drafted / steps,
                "exit_threshold_final": self.threshold}

    def _chain(self, k: int) -> Tree:
        if k not in self._chains:
            self._chains[k] = Tree.chain(k)
        return self._chains[k]
