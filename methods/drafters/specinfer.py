"""SpecInfer with several draft models (Miao et al. 2024): one token tree merged from K drafts' proposals.

Each draft model q_k fills the run's tree (a chain, or any tree; top-k children at temperature 0, i.i.d.
draws from q_k with the SpecInfer verifier) through its own methods.drafters.vanilla drafter and KV cache;
the K trees are merged (a node whose token a sibling already has joins it: shared prefixes are verified
once). Greedy verification needs nothing more; multi-step speculative sampling needs each child's own law,
given as ``Draft.draws`` (one draw per proposer, in draft order), which keeps it exact. The drafts are the
zoo's draft and the boost-tuned ones of methods.zoo.drafts (collective boost-tuning).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from methods.core.drafter import Draft, DraftContext, Draws, StepFeedback
from methods.core.sampling import SamplingParams
from methods.drafters.vanilla import DraftModelDrafter
from specsim.config import MethodConfig, Verifier
from specsim.multidraft import union_tree
from specsim.tree import Tree

_MODES = {Verifier.greedy: "topk", Verifier.deterministic: "topk", Verifier.typical: "topk",
          Verifier.specinfer: "with_replacement"}
_PARAMS = {"gamma", "drafts", "source", "pool_windows"}


@dataclass(frozen=True)
class _Merged:
    draft: Draft
    parts: tuple[Draft, ...]  # each member's own draft
    where: tuple[tuple[int, ...], ...]  # where[k][t]: merged node of member k's node t


class SpecInferDrafter:
    needs_hidden_states = False
    # Drafter protocol hook: K draft models each fill ``member_tree`` level by level and the drafts are merged
    # (calibration times the loop on member trees of several shapes; profiles price the member tree)
    fills_member_trees = True

    def __init__(self, drafts: list, tree: Tree, sampling: SamplingParams, mode: str = "topk") -> None:
        assert drafts, "SpecInfer needs at least one draft model"
        self.members = [DraftModelDrafter(m, tree, sampling, mode) for m in drafts]
        self.sampled = mode != "topk"
        self.member_tree = tree  # the tree every draft model fills
        self.tree = union_tree(tree, len(drafts))  # the budget the simulator prices (no prefix shared)
        self._last: _Merged | None = None

    @classmethod
    def from_config(cls, method: MethodConfig, tree: Tree | None, models, sampling: SamplingParams
                    ) -> SpecInferDrafter:
        unknown = set(method.params) - _PARAMS
        if unknown:
            raise ValueError(f"method.params: unknown specinfer keys {sorted(unknown)}; allowed: "
                             f"{sorted(_PARAMS)}")
        verifier = Verifier(method.verifier)
        if verifier not in _MODES:
            raise ValueError(f"specinfer merges several drafts into one tree: verifier {verifier.value} does "
                             f"not apply; use one of {[v.value for v in _MODES]}")
        if models.draft is None:
            raise ValueError("specinfer needs the zoo's draft model (model.draft_n_layers > 0)")
        if tree is None or tree.size == 1:
            tree = Tree.chain(int(method.params.get("gamma") or 4))
        k = int(method.params.get("drafts", 3))
        drafts = load_drafts(models, k, str(method.params.get("source", "boost")),
                             method.params.get("pool_windows"))
        return cls(drafts, tree, sampling, _MODES[verifier])

    def reset(self, prompt: torch.Tensor) -> None:
        for m in self.members:
            m.reset(prompt)
        self._last = None

    def propose(self, ctx: DraftContext) -> Draft:
        self._last = merge([m.propose(ctx) for m in self.members], self.sampled)
        return self._last.draft

    def feedback(self, fb: StepFeedback) -> None:
        """Each member keeps the KV of its own nodes on the accepted path (a prefix of it)."""
        merged = self._last
        for member, part, where in zip(self.members, merged.parts, merged.where):
            path, node = [0], 0
            for m in fb.accepted[1:]:
                kids = [c for c in part.tree.children[node] if where[c] == m]
                if not kids:
                    break
                node = kids[0]
                path.append(node)
            member.feedback(StepFeedback(part, tuple(path), fb.next_token, None))


def merge(parts: list[Draft], sampled: bool) -> _Merged:
    """One tree from the members' drafts: member by member, node by node, a node joins its merged parent's
    child of the same token or becomes a new child (rank = order of arrival). With ``sampled``, every
    member node is one draw from the law its parent's q row holds."""
    parents, ranks, tokens = [-1], [0], [int(parts[0].tokens[0])]
    kids: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    n_kids = [0]
    draw_node: list[int] = []
    draw_q: list[torch.Tensor] = []
    where_all = []
    for part in parts:
        toks, where = part.tokens.tolist(), [0]
        for t in range(1, part.tree.size):
            u = where[part.tree.parents[t]]
            node = kids.get((u, toks[t]))
            if node is None:
                node = kids[(u, toks[t])] = len(tokens)
                parents.append(u)
                ranks.append(n_kids[u])
                n_kids[u] += 1
                n_kids.append(0)
                tokens.append(toks[t])
            where.append(node)
            if sampled:
                draw_node.append(node)
                draw_q.append(part.q[part.tree.parents[t]])
        where_all.append(tuple(where))
    dev = parts[0].tokens.device
    draws = None
    if sampled and draw_q:
        draws = Draws(torch.tensor(draw_node, dtype=torch.long, device=dev), torch.stack(draw_q))
    draft = Draft(Tree.from_parents(parents, ranks), torch.tensor(tokens, dtype=torch.long, device=dev),
                  None, draws=draws)
    return _Merged(draft, tuple(parts), tuple(where_all))


def load_drafts(models, k: int, source: str, pool_windows: int | None = None) -> list:
    """The zoo's draft and k-1 boost-tuned ones (``source=boost``, built and cached on first use), or, for
    random / test models, the draft and k-1 perturbed copies of it (``source=copies``)."""
    if source == "copies":
        return [models.draft] + [_perturbed(models.draft, 0.05, seed=i) for i in range(1, k)]
    if source != "boost":
        raise ValueError(f"method.params.source={source!r}: boost | copies")
    if k == 1:
        return [models.draft]
    from methods.models import _pretrained
    from methods.zoo.drafts import ExtraDrafts, ensure_drafts, zoo_of

    zoo = zoo_of(models.target)
    if zoo is None:
        raise ValueError("specinfer source=boost needs a zoo target (model=zoo or model=micro); for other "
                         "models use method.params.source=copies")
    spec = ExtraDrafts("boost", count=k - 1)  # the cached recipe, unless the run asks for another pool
    if pool_windows is not None:
        spec = ExtraDrafts("boost", count=k - 1, pool_windows=int(pool_windows))
    paths = ensure_drafts(zoo, spec)
    extra = [_pretrained(str(p)).to(models.device, models.dtype).eval() for p in paths]
    return [models.draft, *extra]


def _perturbed(model, scale: float, seed: int):
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * scale * p.float().std())
    return out.eval()
