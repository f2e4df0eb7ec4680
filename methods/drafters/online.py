"""Online speculative decoding (Liu et al. 2023, "Online Speculative Decoding"): the draft q keeps learning
from the target p while serving.

Decoding is the draft model's (methods.drafters.vanilla, any tree). At every verification the target's
logits at the accepted path's nodes (``StepFeedback.logits``) give p at each verified position; the positions
where the draft was wrong — its child of the last accepted node was rejected ("wrong", the paper's mask) — or
all verified ones ("all") go into a buffer with their prefix. Every ``update_every`` requests the draft is
distilled on the buffer: ``steps`` passes of a divergence between p and q at the buffered positions (forward
KL = soft cross-entropy up to p's entropy, reverse KL, or JSD), then the buffer is cleared. Training runs in
``reset`` — between requests, never inside a step — so every step's verification sees one fixed q and stays
lossless; its seconds are ``offline_seconds`` (the loop leaves them out of decode time).
Departure: the paper distils on a GPU in the serving system's idle time; ours is synchronous on CPU.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from methods.core.drafter import Draft, DraftContext, StepFeedback
from methods.core.sampling import SamplingParams
from methods.drafters.params import checked_params
from methods.drafters.vanilla import _MODES, DraftModelDrafter
from specsim.config import MethodConfig, Verifier
from specsim.tree import Tree

LOSSES = ("fkl", "rkl", "jsd")


@dataclass(frozen=True)
class OnlineConfig:
    update_every: int = 8  # requests between distillation updates (the paper's interval); 0 = never (static)
    learning_rate: float = 1e-3
    steps: int = 4  # passes over the buffer per update
    loss: str = "fkl"  # fkl | rkl | jsd
    mask: str = "wrong"  # wrong: positions where the draft's proposal was rejected; all: every verified one
    draft: str = "zoo"  # zoo: the zoo's draft; prose: a draft trained on prose only (weak on code)
    gamma: int = 4

    def __post_init__(self) -> None:
        assert self.loss in LOSSES, f"online loss {self.loss!r}: one of {LOSSES}"
        assert self.mask in ("wrong", "all"), f"online mask {self.mask!r}: wrong | all"
        assert self.draft in ("zoo", "prose"), f"online draft {self.draft!r}: zoo | prose"


@dataclass
class _Request:
    """One served request's distillation data: positions whose next-token law p the draft should match."""

    positions: list[int] = field(default_factory=list)  # index of the last input token of each position
    logits: list[torch.Tensor] = field(default_factory=list)  # (V,) target logits there
    tokens: torch.Tensor | None = None  # (T,) the committed sequence (inputs)


class OnlineDrafter:
    needs_hidden_states = False

    def __init__(self, model, tree: Tree, sampling: SamplingParams, mode: str, cfg: OnlineConfig) -> None:
        self.cfg = cfg
        # trained here: the run's draft stays as loaded. Copied outside inference mode: a drafter built under
        # it (a calibration) would otherwise get inference tensors, which cannot be updated in place later
        with torch.inference_mode(False):
            self.model = copy.deepcopy(model).eval()
        self.inner = DraftModelDrafter(self.model, tree, sampling, mode)
        self.tree = self.inner.tree
        self.offline_seconds = 0.0  # cumulative training seconds (between requests)
        self.updates: list[dict] = []  # one record per distillation update
        self.requests = 0
        self._buffer: list[_Request] = []
        self._current: _Request | None = None
        self._root_index = 0
        self._opt: torch.optim.Optimizer | None = None
        self._master = None  # fp32 copy of the draft that training updates

    @property
    def learns_every(self) -> int:
        """Requests between distillation updates (0: never): its acceptance depends on how many it served,
        so a calibration reads it through the loop over as many requests (specsim.learning)."""
        return self.cfg.update_every

    @classmethod
    def from_config(cls, method: MethodConfig, tree: Tree | None, models, sampling: SamplingParams
                    ) -> OnlineDrafter:
        cfg = OnlineConfig(**checked_params(OnlineConfig, method.params, "online", dicts=()))
        if models.draft is None:
            raise ValueError("online needs a draft model (model.draft_n_layers > 0)")
        if tree is None or tree.size == 1:
            tree = Tree.chain(cfg.gamma)
        verifier = Verifier(method.verifier)
        if verifier == Verifier.chain and tree.width > 1:
            raise ValueError(f"verifier chain needs a chain tree, got {tree}")
        draft = models.draft if cfg.draft == "zoo" else prose_draft(models)
        return cls(draft, tree, sampling, _MODES[verifier], cfg)

    # ---- between requests -----------------------------------------------------------------------------
    def reset(self, prompt: torch.Tensor) -> None:
        """A new request: file the last one's data, distil when an update is due, then start afresh."""
        self._close()
        if self.cfg.update_every and self.requests and self.requests % self.cfg.update_every == 0:
            self._update()
        self.requests += 1
        self._current = _Request()
        self.inner.reset(prompt)

    def _close(self) -> None:
        if self._current is not None and self._current.positions:
            self._buffer.append(self._current)
        self._current = None

    def _update(self) -> None:
        if not self._buffer:
            return
        t0 = time.perf_counter()
        with torch.inference_mode(False), torch.enable_grad():
            if self._master is None:  # fp32 weights to train (a bf16 model would lose small updates)
                self._master = copy.deepcopy(self.model).float()
            losses = distill(self._master, self._buffer, self.cfg, self._optimizer())
            with torch.no_grad():  # in place: the draft engine sees the new weights (version counters)
                for mine, master in zip(self.model.parameters(), self._master.parameters()):
                    mine.copy_(master)
        seconds = time.perf_counter() - t0
        self.offline_seconds += seconds
        self.updates.append({"after_request": self.requests, "positions": sum(len(r.positions)
                             for r in self._buffer), "loss_first": losses[0], "loss_last": losses[-1],
                             "seconds": seconds})
        self._buffer = []

    def _optimizer(self) -> torch.optim.Optimizer:
        if self._opt is None:  # kept across updates: the draft keeps learning as one run
            with torch.inference_mode(False):
                self._opt = torch.optim.AdamW(self._master.parameters(), lr=self.cfg.learning_rate,
                                              weight_decay=0.0)
        return self._opt

    # ---- decoding -------------------------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> Draft:
        self._root_index = ctx.tokens.numel() - 1
        if self._current is not None:
            self._current.tokens = ctx.tokens  # the committed sequence so far (covers earlier feedback)
        return self.inner.propose(ctx)

    def feedback(self, fb: StepFeedback) -> None:
        self.inner.feedback(fb)
        if self._current is None or fb.logits is None:
            return
        tree, path = fb.draft.tree, fb.accepted
        # position j of the path predicts the token after node path[j]; the draft had proposed children there
        # and was right for j < last, wrong at the last one (if it had children)
        picks = range(len(path)) if self.cfg.mask == "all" else [len(path) - 1]
        for j in picks:
            if tree.children[path[j]]:
                self._current.positions.append(self._root_index + j)
                self._current.logits.append(fb.logits[path[j]].detach().float().cpu())
        if len(path) > 1:  # the path's tokens are inputs of the later positions: keep them with the sequence
            drafted = fb.draft.tokens[list(path[1:])].cpu()
            self._current.tokens = torch.cat([self._current.tokens.cpu(), drafted])


def distill(model, buffer: list[_Request], cfg: OnlineConfig, opt: torch.optim.Optimizer) -> list[float]:
    """``cfg.steps`` passes over the buffer, one optimiser step per request; the mean loss of each pass."""
    model.train()
    data = [(r.tokens.clone(), torch.tensor(r.positions), torch.stack(r.logits).clone()) for r in buffer]
    out = []
    for _ in range(cfg.steps):
        total = 0.0
        for ids, pos, p_logits in data:
            n = int(pos.max()) + 1
            q_logits = model(input_ids=ids[None, :n].to(model.device)).logits[0, pos]  # (P, V)
            loss = divergence(p_logits.to(q_logits.device), q_logits, cfg.loss)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            total += float(loss.detach())
        out.append(total / len(data))
    model.eval()
    return out


def divergence(p_logits: torch.Tensor, q_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean over positions of D(p, q) for logits (P, V): forward KL Σ p log(p/q) (soft cross-entropy minus
    p's entropy: the same gradient), reverse KL Σ q log(q/p), or JSD ½KL(p‖m) + ½KL(q‖m), m = (p+q)/2."""
    logp, logq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    if kind == "fkl":
        return F.kl_div(logq, logp, log_target=True, reduction="batchmean")
    if kind == "rkl":
        return F.kl_div(logp, logq, log_target=True, reduction="batchmean")
    logm = torch.logaddexp(logp, logq) - torch.log(torch.tensor(2.0))
    return 0.5 * (F.kl_div(logm, logp, log_target=True, reduction="batchmean")
                  + F.kl_div(logm, logq, log_target=True, reduction="batchmean"))


def prose_draft(models):
    """The zoo's draft recipe trained on prose only (methods.zoo.drafts, cached), on the run's device."""
    from methods.models import _pretrained
    from methods.zoo.drafts import ExtraDrafts, ensure_drafts, zoo_of

    zoo = zoo_of(models.target)
    if zoo is None:
        raise ValueError("online draft=prose needs a zoo target (model=zoo or model=micro)")
    (path,) = ensure_drafts(zoo, ExtraDrafts("prose", count=1))
    return _pretrained(str(path)).to(models.device, models.dtype).eval()
