"""Exact proof that the lossless verifiers preserve the target's law (issue 3), plus a negative control.

Every random choice — the test drafters' samples from q and the verifiers' acceptance coins and residual
draws — goes through `Randomness.first_success`. `exact_law` replays a script of outcomes and, at the first
unscripted call, forks on every outcome with its probability: depth-first re-execution of the *production*
verifier gives the exact law of what it emits. Target p and draft q are hypothesis-drawn models over a tiny
vocabulary (functions of the prefix); a verifier is lossless when the emitted tokens, completed by the target
up to a fixed length M, have exactly the target's law of length-M sequences.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from methods.core.drafter import Draft, Draws
from methods.core.sampling import SamplingParams, draw, probs
from methods.core.verify import VERIFIERS, chain_rejection
from specsim.config import LOSSY_VERIFIERS, Verifier
from specsim.tree import Tree

ROOT = 0  # token of the root node; the context every prefix starts with
TOL = 1e-9
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


# ---- enumeration of all random branches ---------------------------------------------------------------
class _Fork(Exception):
    def __init__(self, options: list) -> None:
        self.options = options


class _Script:
    """A Randomness that replays scripted outcomes, then forks on the first new call."""

    def __init__(self, outcomes: tuple) -> None:
        self.outcomes, self.pos = outcomes, 0

    def first_success(self, success, then, terminal):
        if self.pos < len(self.outcomes):
            self.pos += 1
            return self.outcomes[self.pos - 1]
        raise _Fork(_outcomes(success, then, terminal))


def _outcomes(success, then, terminal) -> list:
    """Every (i, token) that first_success can return, with its probability."""
    s = success.double().clamp(0, 1).tolist()
    rows = then.double().tolist()
    out, none_yet = [], 1.0
    for i in range(len(s) + 1):
        pr = none_yet * (s[i] if i < len(s) else 1.0)
        none_yet *= 1 - s[i] if i < len(s) else 0.0
        if pr <= 0:
            continue
        if not terminal[i]:
            out.append(((i, -1), pr))
            continue
        row = rows[i]
        total = sum(row)
        assert all(math.isfinite(w) and w >= 0 for w in row) and total > 0, f"bad row reached: {row}"
        out += [((i, v), pr * w / total) for v, w in enumerate(row) if w > 0]
    return out


def exact_law(run: Callable) -> dict[tuple[int, ...], float]:
    law: dict[tuple[int, ...], float] = defaultdict(float)
    stack = [((), 1.0)]
    while stack:
        script, pr = stack.pop()
        try:
            result = run(_Script(script))
        except _Fork as fork:
            stack.extend((script + (o,), pr * w) for o, w in fork.options)
            continue
        law[result] += pr
    return dict(law)


# ---- hypothesis-drawn target / draft models -----------------------------------------------------------
RELATIONS = ("independent", "same", "disjoint", "onehot_q", "processed")
PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([1.0, 0.5, 2.0, 0.0]),
    top_k=st.sampled_from([0, 2, 1]),
    top_p=st.sampled_from([1.0, 0.8, 0.5]),
)


STYLES = ("dense", "sparse", "mixed")


def _row(r: random.Random, V: int, style: str, support: list[bool]) -> torch.Tensor:
    """One weight row: dense (integer or float weights, full support), sparse (integers 0..3: exact ties and
    zeros), or a per-row mix of the two; restricted to `support`, normalised."""
    if style == "mixed":
        style = r.choice(("dense", "sparse"))
    if style == "sparse":
        w = [float(r.randint(0, 3)) for _ in range(V)]
    else:
        w = [float(r.randint(1, 5)) if r.random() < 0.5 else r.uniform(0.01, 1) for _ in range(V)]
    t = torch.tensor(w, dtype=torch.float64) * torch.tensor(support, dtype=torch.float64)
    if t.sum() <= 0:
        t[support.index(True)] = 1.0
    return t / t.sum()


def _logits(r: random.Random, V: int) -> torch.Tensor:
    return torch.tensor([float("-inf") if r.random() < 0.2 else r.uniform(-3, 3) for _ in range(V)],
                        dtype=torch.float64)


class World:
    """Target p and draft q as functions of the prefix over a vocabulary of V tokens. Hypothesis draws the
    structure (relation, style, sampling params, supports, seed); each row comes from a generator seeded by
    (seed, model, prefix) — drawing every row through hypothesis costs ~10x the whole test.
    relation: how q relates to p — independent, q = p, disjoint supports, one-hot q, or both from logits
    through the same `probs` with temperature/top-k/top-p (temperature 0: one-hot p and q)."""

    def __init__(self, data, V: int, greedy_target: bool = False, positional: bool = False) -> None:
        self.V, self.greedy_target, self.positional = V, greedy_target, positional
        self.relation = data.draw(st.sampled_from(RELATIONS), label="relation")
        self.style = data.draw(st.sampled_from(STYLES), label="style")
        self.params = data.draw(PARAMS, label="params") if self.relation == "processed" else None
        split = data.draw(st.lists(st.booleans(), min_size=V, max_size=V), label="split")
        self.split = split if 0 < sum(split) < V else [True] + [False] * (V - 1)
        self.seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
        self._p: dict = {}
        self._q: dict = {}

    def _rand(self, model: str, prefix: tuple) -> random.Random:
        return random.Random(f"{self.seed}/{model}/{len(prefix) if self.positional else prefix}")

    def _dist(self, model: str, prefix: tuple) -> torch.Tensor:
        r = self._rand(model, prefix)
        if self.relation == "processed":
            return probs(_logits(r, self.V), self.params)
        support = [True] * self.V
        if self.relation == "disjoint":
            support = self.split if model == "p" else [not s for s in self.split]
        return _row(r, self.V, self.style, support)

    def p(self, prefix: tuple) -> torch.Tensor:
        key = len(prefix) if self.positional else prefix
        if key not in self._p:
            row = self._dist("p", prefix)
            # temperature 0: one-hot argmax, through the same `probs` the engine uses
            self._p[key] = probs(row.log(), SamplingParams(0.0)) if self.greedy_target else row
        return self._p[key]

    def q(self, prefix: tuple) -> torch.Tensor:
        key = len(prefix) if self.positional else prefix
        if key not in self._q:
            if self.relation == "same":
                self._q[key] = self.p(prefix)
            elif self.relation == "onehot_q":
                x = self._rand("q", prefix).randrange(self.V)
                self._q[key] = torch.nn.functional.one_hot(torch.tensor(x), self.V).double()
            else:
                self._q[key] = self._dist("q", prefix)
        return self._q[key]

    def fixed(self, prefix: tuple, rank: int) -> int:
        """A deterministic drafter: the rank-th proposal after `prefix` (duplicates allowed)."""
        return self._rand("fixed", prefix + (rank,)).randrange(self.V)


# ---- test drafters ------------------------------------------------------------------------------------
def build_draft(world: World, template: Tree, mode: str, rng) -> tuple[Draft, list[tuple]]:
    """Realise `template`: children drawn i.i.d. from q ("iid"), without replacement ("without"; a node whose
    q support is used up gets fewer children) or deterministically ("fixed", q = None)."""
    parents, tokens, prefixes, index = [-1], [ROOT], [(ROOT,)], {0: 0}
    left: dict[int, torch.Tensor] = {}
    for t in range(1, template.size):
        if template.parents[t] not in index:
            continue  # parent dropped: drop the subtree
        u = index[template.parents[t]]
        if mode == "fixed":
            x = world.fixed(prefixes[u], template.ranks[t])
        else:
            row = world.q(prefixes[u])
            if mode == "without":
                row = left.setdefault(u, row.clone())  # what is left of q after the earlier siblings
            if row.sum() <= 0:
                continue
            x = draw(rng, row)
            if mode == "without":
                row[x] = 0.0
        index[t] = len(tokens)
        parents.append(u)
        tokens.append(x)
        prefixes.append(prefixes[u] + (x,))
    q = None if mode == "fixed" else torch.stack([world.q(pre) for pre in prefixes])
    return Draft(Tree.from_parents(parents), torch.tensor(tokens), q), prefixes


def tree_law(world: World, template: Tree, mode: str, verifier: Callable) -> dict:
    def run(rng):
        draft, prefixes = build_draft(world, template, mode, rng)
        p = torch.stack([world.p(pre) for pre in prefixes])  # (N, V)
        res = verifier(draft, p, rng)
        toks = draft.tokens.tolist()
        return tuple(toks[i] for i in res.accepted[1:]) + (res.next_token,)

    return exact_law(run)


def completion_gap(law: dict, world: World, M: int) -> float:
    """max |P(emitted, then target-completed to length M = y) − P_target(y)| over y in V^M."""
    def target(y: tuple) -> float:
        return math.prod(float(world.p((ROOT,) + y[:j])[y[j]]) for j in range(len(y)))

    completed: dict[tuple, float] = defaultdict(float)
    for e, pr in law.items():
        assert target(e) > 0 or pr < TOL, f"emitted {e} (probability {pr}) has target probability 0"
        for z in itertools.product(range(world.V), repeat=M - len(e)):
            if target(e) > 0:
                completed[e + z] += pr * target(e + z) / target(e)
    return max(abs(completed.get(y, 0.0) - target(y)) for y in itertools.product(range(world.V), repeat=M))


def check_lossless(law: dict, world: World, M: int) -> None:
    assert abs(sum(law.values()) - 1) < TOL
    first = torch.zeros(world.V, dtype=torch.float64)
    for e, pr in law.items():
        first[e[0]] += pr
    assert torch.allclose(first, world.p((ROOT,)), atol=TOL, rtol=0), (first, world.p((ROOT,)))
    assert completion_gap(law, world, M) < TOL


@st.composite
def templates(draw_, max_drafts: int, chain: bool = False, max_depth: int = 3, max_width: int = 3):
    """Small draft-tree shapes: a chain, breadth-first filled ("wide": siblings are where tree verifiers
    differ) or random parents."""
    shape = "chain" if chain else draw_(st.sampled_from(["wide", "random", "chain"]))
    parents, depth, kids = [-1], [0], [0]
    for i in range(1, draw_(st.sampled_from(range(max_drafts, -1, -1))) + 1):
        free = [v for v in range(i) if depth[v] < max_depth and kids[v] < max_width]
        u = i - 1 if shape == "chain" else free[0] if shape == "wide" else draw_(st.sampled_from(free))
        parents.append(u)
        depth.append(depth[u] + 1)
        kids.append(0)
        kids[u] += 1
    return Tree.from_parents(parents)


# sampled drafts cost V^drafts draft outcomes (times the verifier's branches): keep V^drafts <= 81
_BUDGET = {2: 6, 3: 4, 4: 3}


def _setup(data, mode: str, chain: bool = False, **world_kw) -> tuple[World, Tree]:
    V = data.draw(st.sampled_from([3, 4, 2]), label="V")
    world = World(data, V, **world_kw)
    max_drafts = 6 if mode == "fixed" else _BUDGET[V]
    return world, data.draw(templates(max_drafts, chain=chain), label="template")


# ---- the proofs ---------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def test_chain_rejection_contract_is_exact(data):
    """chain_rejection (docs/architecture.md): fixed rows p (γ+1, V), q (γ, V); x_i ~ q[i]; position i
    follows p[i]."""
    V = data.draw(st.integers(2, 4))
    world = World(data, V, positional=True)
    gamma = data.draw(st.integers(0, _BUDGET[V]))
    p = torch.stack([world.p((ROOT,) * (i + 1)) for i in range(gamma + 1)])
    q = torch.stack([world.q((ROOT,) * (i + 1)) for i in range(gamma)]) if gamma else p[:0]

    def run(rng):
        xs = [draw(rng, q[i]) for i in range(gamma)]
        n, tok = chain_rejection(p, q, torch.tensor(xs, dtype=torch.long), rng)
        return tuple(xs[:n]) + (tok,)

    check_lossless(exact_law(run), world, gamma + 1)


CASES = [  # (verifier, how the test drafter proposes)
    (Verifier.chain, "iid"),
    (Verifier.specinfer, "iid"),
    (Verifier.sequoia, "without"),
    (Verifier.deterministic, "fixed"),
    (Verifier.deterministic, "iid"),  # exact given any proposals chosen independently of the coins
]


@pytest.mark.parametrize("kind,mode", CASES, ids=[f"{k.value}-{m}" for k, m in CASES])
@SETTINGS
@given(data=st.data())
def test_tree_verifier_is_exact(kind, mode, data):
    world, template = _setup(data, mode, chain=kind == Verifier.chain)
    law = tree_law(world, template, mode, VERIFIERS[kind])
    event(f"V={world.V} drafts={template.size - 1} depth={template.depth} outcomes={len(law)}")
    check_lossless(law, world, template.depth + 1)


@pytest.mark.parametrize("kind", [Verifier.greedy, Verifier.typical])
@pytest.mark.parametrize("mode", ["iid", "fixed"])
@SETTINGS
@given(data=st.data())
def test_greedy_target_is_exact(kind, mode, data):
    """Temperature 0 (one-hot p): greedy — and typical acceptance, which reduces to greedy — emit exactly
    the target's greedy continuation, whatever the draft."""
    world, template = _setup(data, mode, greedy_target=True)
    check_lossless(tree_law(world, template, mode, VERIFIERS[kind]), world, template.depth + 1)


# ---- SpecInfer's merged tree of several drafts (per-draw laws) ----------------------------------------
def draft_law(world: World, k: int, prefix: tuple) -> torch.Tensor:
    """Draft k's law after `prefix`: the world's q for k = 0, another law of the same relation for k > 0."""
    if k == 0 or world.relation == "same":
        return world.q(prefix)
    if world.relation == "onehot_q":
        x = world._rand(f"q{k}", prefix).randrange(world.V)
        return torch.nn.functional.one_hot(torch.tensor(x), world.V).double()
    return world._dist(f"q{k}", prefix)


def merged_draft(world: World, templates_: list[Tree], rng) -> tuple[Draft, list[tuple]]:
    """Each draft k realises its template with children drawn i.i.d. from its own law; the trees are merged
    (a draw whose token a sibling already has joins that node), draws kept in draft order."""
    parents, tokens, prefixes = [-1], [ROOT], [(ROOT,)]
    draw_nodes, draw_q = [], []
    for k, template in enumerate(templates_):
        where = {0: 0}  # template node -> merged node
        for t in range(1, template.size):
            u = where[template.parents[t]]
            row = draft_law(world, k, prefixes[u])
            x = draw(rng, row)
            same = [n for n in range(1, len(tokens)) if parents[n] == u and tokens[n] == x]
            if same:
                where[t] = same[0]
            else:
                where[t] = len(tokens)
                parents.append(u)
                tokens.append(x)
                prefixes.append(prefixes[u] + (x,))
            draw_nodes.append(where[t])
            draw_q.append(row)
    draws = Draws(torch.tensor(draw_nodes, dtype=torch.long), torch.stack(draw_q)) if draw_q else None
    if draws is None:  # every template is the root alone
        draws = Draws(torch.zeros(0, dtype=torch.long), torch.zeros(0, world.V, dtype=torch.float64))
    return Draft(Tree.from_parents(parents), torch.tensor(tokens), None, draws=draws), prefixes


def merged_law(world: World, templates_: list[Tree]) -> dict:
    def run(rng):
        draft, prefixes = merged_draft(world, templates_, rng)
        p = torch.stack([world.p(pre) for pre in prefixes])
        res = VERIFIERS[Verifier.specinfer](draft, p, rng)
        toks = draft.tokens.tolist()
        return tuple(toks[i] for i in res.accepted[1:]) + (res.next_token,)

    return exact_law(run)


@SETTINGS
@given(data=st.data())
def test_specinfer_merged_tree_of_several_drafts_is_exact(data):
    """Two or three drafts, each its own law, chains or small trees, merged where their prefixes agree:
    the per-draw laws make multi-step speculative sampling exact (duplicates and one-hot laws included)."""
    V = data.draw(st.sampled_from([2, 3]), label="V")
    world = World(data, V)
    k = data.draw(st.sampled_from([2, 3]), label="drafts")
    budget = _BUDGET[V]
    sizes = data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k).filter(
        lambda xs: sum(xs) <= budget), label="sizes")
    shapes = [data.draw(templates(n), label=f"template{i}") for i, n in enumerate(sizes)]
    law = merged_law(world, shapes)
    depth = max(t.depth for t in shapes)
    event(f"V={V} drafts={k} draws={sum(t.size - 1 for t in shapes)} outcomes={len(law)}")
    check_lossless(law, world, depth + 1)


def test_merged_tree_needs_every_draw_law():
    """Negative control: keeping only the first proposer's law of a merged node (dropping the duplicate
    draws) changes the law; the per-draw verifier on the same drafts is exact."""

    class Fixed(World):
        def __init__(self) -> None:
            self.V, self.greedy_target, self.positional, self.relation = 3, False, False, "independent"
            self._p, self._q = {}, {}
            for pre in [(ROOT,)] + [(ROOT, x) for x in range(3)]:
                self._p[pre] = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
                self._q[pre] = torch.tensor([0.6, 0.2, 0.2], dtype=torch.float64)

        def _dist(self, model: str, prefix: tuple) -> torch.Tensor:
            return torch.tensor([0.1, 0.1, 0.8], dtype=torch.float64)

    world, shapes = Fixed(), [Tree.chain(1), Tree.chain(1)]
    check_lossless(merged_law(world, shapes), world, 2)

    def first_only(rng):
        draft, prefixes = merged_draft(world, shapes, rng)
        nodes, seen = draft.draws.node.tolist(), set()
        keep = [j for j, n in enumerate(nodes) if not (n in seen or seen.add(n))]
        first = Draws(draft.draws.node[keep], draft.draws.q[keep])
        draft = Draft(draft.tree, draft.tokens, None, draws=first)
        res = VERIFIERS[Verifier.specinfer](draft, torch.stack([world.p(pre) for pre in prefixes]), rng)
        return tuple(draft.tokens[i].item() for i in res.accepted[1:]) + (res.next_token,)

    assert completion_gap(exact_law(first_only), world, 2) > 1e-3


def test_every_lossless_verifier_is_proved():
    proved = {k for k, _ in CASES} | {Verifier.greedy}
    assert proved == set(Verifier) - LOSSY_VERIFIERS


def test_typical_acceptance_is_lossy():
    """Negative control: the same harness catches a verifier that changes the law."""

    class Fixed(World):
        def __init__(self) -> None:
            self.V, self.greedy_target, self.positional = 3, False, False
            self._p = {(ROOT,): torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)}
            for x in range(3):
                self._p[(ROOT, x)] = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)

        def fixed(self, prefix: tuple, rank: int) -> int:
            return 1

    world = Fixed()
    template = Tree.chain(1)
    law = tree_law(world, template, "fixed", VERIFIERS[Verifier.typical])
    assert completion_gap(law, world, 2) > 1e-3
    # the lossless rule on the very same draft passes
    exact = tree_law(world, template, "fixed", VERIFIERS[Verifier.deterministic])
    assert completion_gap(exact, world, 2) < TOL
