"""methods.core.verify unit tests: greedy, numerically nasty inputs, typical acceptance, shape errors,
devices.
(The exact losslessness proof is tests/methods/test_verify_exact.py.)"""

from __future__ import annotations

import pytest
import torch

from methods.core.drafter import Draft
from methods.core.sampling import SamplingParams, TorchRandomness, probs
from methods.core.verify import (
    VERIFIERS,
    VerifyError,
    VerifyResult,
    argmax_rows,
    chain_rejection,
    greedy_path,
    verify,
    verify_deterministic,
    verify_greedy,
    verify_typical,
)
from specsim.config import Verifier
from specsim.tree import Tree


class Spy:
    """Randomness that records what a verifier asks and answers with the first outcome forced by `pick`."""

    def __init__(self, pick: int | None = None, seed: int = 0) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pick, self.inner = pick, TorchRandomness(torch.Generator().manual_seed(seed))

    def first_success(self, success, then, terminal):
        self.calls.append((success.clone(), then.clone()))
        if self.pick is None:
            return self.inner.first_success(success, then, terminal)
        i = min(self.pick, len(success))
        return i, (int(then[i].argmax()) if terminal[i] else -1)


def onehot(idx: list[int], V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(idx), V).double()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- greedy -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_match", [0, 1, 2, 3])
def test_greedy_chain(n_match):
    am = [4, 1, 3, 2]  # argmax of p rows 0..3
    p = onehot(am, 6) * 0.5 + 0.05  # not one-hot: greedy only looks at the argmax
    drafts = [am[i] if i < n_match else (am[i] + 1) % 6 for i in range(3)]
    res = verify_greedy(Draft(Tree.chain(3), torch.tensor([9 % 6] + drafts)), p, None)
    assert res == VerifyResult(tuple(range(n_match + 1)), am[n_match])


def test_greedy_tree_takes_the_deepest_matching_path_and_lowest_tie():
    #        0
    #      1   2          tokens: 1->5, 2->3 (both children of the root)
    #     3    4 5        3 under 1; 4, 5 under 2
    tree = Tree.from_parents([-1, 0, 0, 1, 2, 2])
    p = torch.full((6, 8), 0.01, dtype=torch.float64)
    p[0, 3] = p[2, 7] = p[4, 6] = p[5, 2] = p[1, 1] = 1.0
    res = verify_greedy(Draft(tree, torch.tensor([0, 5, 3, 0, 7, 7])), p, None)
    assert res == VerifyResult((0, 2, 4), 6), "duplicate siblings 4 and 5 both match: the lower index wins"
    tie = torch.tensor([[0.4, 0.4, 0.2]] * 2, dtype=torch.float64)
    assert verify_greedy(Draft(Tree.chain(1), torch.tensor([2, 1])), tie, None) == VerifyResult((0,), 0)
    assert verify_greedy(Draft(Tree.chain(0), torch.tensor([2])), tie[:1], None) == VerifyResult((0,), 0)


def test_greedy_equals_deterministic_rule_on_one_hot_p():
    """At temperature 0 with distinct siblings (as top-k drafts are) both rules take the same path."""
    g = _gen(1)
    tree = Tree.kary(2, 2)
    for _ in range(20):
        p = probs(torch.randn(tree.size, 3, generator=g), SamplingParams(0.0))
        tokens = torch.zeros(tree.size, dtype=torch.long)
        for kids in tree.children:
            if kids:
                tokens[list(kids)] = torch.randperm(3, generator=g)[: len(kids)]
        draft = Draft(tree, tokens)
        assert verify_greedy(draft, p, None) == verify_deterministic(draft, p, g)


def test_greedy_path_on_the_host_equals_verify_greedy():
    """The one-sequence loop's host walk (argmax lists) takes verify_greedy's path and next token on random
    trees with duplicate siblings, ties in p and chains."""
    g = _gen(3)
    trees = [Tree.chain(4), Tree.chain(0), Tree.kary(2, 3), Tree.kary(3, 2),
             Tree.from_parents([-1, 0, 0, 1, 2, 2, 4, 3, 0])]
    for _ in range(60):
        for tree in trees:
            logits = torch.randint(0, 3, (tree.size, 4), generator=g).float()  # many ties
            tokens = torch.randint(0, 4, (tree.size,), generator=g)  # duplicate siblings
            want = verify_greedy(Draft(tree, tokens), probs(logits, SamplingParams(0.0)), None)
            got = greedy_path(tree, tokens.tolist(), logits.argmax(-1).tolist())
            assert got == (want.accepted, want.next_token)


def test_argmax_rows_is_torch_argmax_ties_and_nan_included():
    g = _gen(4)
    x = torch.randint(0, 3, (6, 50), generator=g).float()  # ties in every row
    x[2, 7] = float("nan")
    x[3] = float("-inf")
    for scores in (x, x.double(), x[:, ::2], x.bfloat16()):
        assert argmax_rows(scores) == scores.argmax(-1).tolist()
    with torch.inference_mode():
        y = x.clone()
    assert argmax_rows(y) == x.argmax(-1).tolist()


# ---- numerically nasty inputs ------------------------------------------------------------------------
def test_p_equal_q_always_accepts():
    g = _gen(2)
    p = probs(torch.randn(5, 1000, generator=g), SamplingParams(0.8, top_p=0.9))
    tokens = torch.stack([torch.multinomial(p[i], 1, generator=g)[0] for i in range(4)])
    for seed in range(10):
        assert chain_rejection(p, p[:4], tokens, _gen(seed))[0] == 4


def test_q_zero_where_p_positive_and_both_zero():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1 / 3] * 3], dtype=torch.float64)
    q = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.5, 0.5]], dtype=torch.float64)
    spy = Spy()
    chain_rejection(p, q, torch.tensor([2, 0]), spy)  # both drafted tokens have q(x) = 0
    reject = spy.calls[0][0]
    assert reject.tolist() == [1.0, 0.0], "p(x)=q(x)=0: reject surely; q(x)=0<p(x): accept surely"
    assert torch.isfinite(spy.calls[0][1]).all()


def test_residual_of_nearly_equal_rows_falls_back_to_p():
    p = torch.tensor([[0.3, 0.7], [0.5, 0.5]], dtype=torch.float64)
    q = p[:1] + torch.tensor([[1e-17, -1e-17]], dtype=torch.float64)  # p ≈ q to rounding
    spy = Spy(pick=0)  # force the (probability ~0) rejection branch
    chain_rejection(p, q, torch.tensor([0]), spy)
    residual = spy.calls[0][1][0]
    assert torch.equal(residual, p[0]), "no NaN, no amplified rounding noise: the residual is p itself"
    # and in float32 with a big vocabulary
    x = torch.randn(2, 50_000, generator=_gen(3))
    p32, q32 = probs(x, SamplingParams()), probs(x + 1e-6, SamplingParams())[:1]
    spy = Spy(pick=0)
    chain_rejection(p32, q32, torch.tensor([7]), spy)
    residual = spy.calls[0][1][0]
    assert torch.isfinite(residual).all() and abs(residual.sum().item() - 1) < 1e-4


def test_one_hot_target_and_disjoint_supports():
    p = onehot([2, 0], 4)  # temperature 0 target
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    for seed in range(10):
        n, tok = chain_rejection(p, q, torch.tensor([1]), _gen(seed))  # p(1) = 0: always rejected
        assert (n, tok) == (0, 2), "the residual of a one-hot p is that one-hot"
    p = torch.tensor([[0.5, 0.5, 0, 0], [0.25] * 4], dtype=torch.float64)
    q = torch.tensor([[0, 0, 0.5, 0.5]], dtype=torch.float64)
    for seed in range(10):
        n, tok = chain_rejection(p, q, torch.tensor([3]), _gen(seed))
        assert n == 0 and tok in (0, 1), "disjoint supports: reject, then sample p itself"


@pytest.mark.parametrize("kind", [Verifier.specinfer, Verifier.sequoia, Verifier.deterministic])
def test_tree_verifiers_on_a_big_float32_vocabulary(kind):
    g = _gen(4)
    tree = Tree.kary(3, 2)
    params = SamplingParams(0.7, top_k=50)
    p = probs(torch.randn(tree.size, 32_000, generator=g) * 5, params)
    q = probs(torch.randn(tree.size, 32_000, generator=g) * 5, params)
    tokens = torch.randint(0, 32_000, (tree.size,), generator=g)
    for seed in range(5):
        res = verify(kind, Draft(tree, tokens, q), p, _gen(seed))
        assert res.accepted[0] == 0 and list(res.accepted) == list(tree.path_to(res.accepted[-1]))
        assert p[res.accepted[-1], res.next_token] > 0 or len(tree.children[res.accepted[-1]]) > 0


# ---- typical acceptance (lossy) ---------------------------------------------------------------------
def test_typical_threshold_tie_break_and_next_token():
    tree = Tree.from_parents([-1, 0, 0, 0])
    p = torch.tensor([[0.6, 0.3, 0.05, 0.05], [0.97, 0.01, 0.01, 0.01], [0.0, 0.0, 0.5, 0.5],
                      [0.25] * 4], dtype=torch.float64)
    # H(p0) ≈ 0.98 -> threshold min(0.09, 0.3·e^-0.98 ≈ 0.11) = 0.09: tokens 0, 1 pass, 2 does not
    for seed in range(10):
        res = verify_typical(Draft(tree, torch.tensor([0, 2, 1, 0])), p, _gen(seed))
        assert res.accepted == (0, 3), "nodes 2 and 3 pass; 3 has the larger likelihood (0.6 > 0.3)"
        assert res.next_token in (0, 1, 2, 3)
    for seed in range(10):
        res = verify_typical(Draft(tree, torch.tensor([0, 0, 3, 2])), p, _gen(seed))
        assert res == VerifyResult((0, 1), 0), "only the argmax is typical after node 1"
    assert "LOSSY" in verify_typical.__doc__


# ---- contract and errors -----------------------------------------------------------------------------
def test_registry_and_errors():
    assert set(VERIFIERS) == set(Verifier)
    chain = Draft(Tree.chain(2), torch.tensor([0, 1, 2]), torch.full((3, 4), 0.25))
    p = torch.full((3, 4), 0.25)
    assert verify("chain", chain, p, _gen()).accepted[0] == 0
    tree = Draft(Tree.kary(2, 1), torch.tensor([0, 1, 2]), torch.full((3, 4), 0.25))
    with pytest.raises(VerifyError, match="chain draft"):
        verify(Verifier.chain, tree, p, _gen())
    with pytest.raises(VerifyError, match="needs the draft probabilities"):
        verify(Verifier.specinfer, Draft(tree.tree, tree.tokens), p, _gen())
    with pytest.raises(VerifyError, match="tree size"):
        verify(Verifier.greedy, tree, p[:2], _gen())
    with pytest.raises(VerifyError, match="must match p"):
        verify(Verifier.sequoia, Draft(tree.tree, tree.tokens, torch.full((3, 5), 0.2)), p, _gen())
    with pytest.raises(VerifyError, match="chain_rejection"):
        chain_rejection(p, p, torch.tensor([0, 1]), _gen())
    with pytest.raises(TypeError):
        verify(Verifier.typical, tree, p, _gen(), epsilonn=0.1)
    root = Draft(Tree.chain(0), torch.tensor([3]))  # the autoregressive step needs no q for any verifier
    for kind in Verifier:
        assert verify(kind, root, p[:1], _gen()).accepted == (0,)


def test_same_seed_same_result():
    g = _gen(5)
    for tree in (Tree.kary(2, 2), Tree.chain(3)):
        p, q = (probs(torch.randn(tree.size, 10, generator=g), SamplingParams()) for _ in range(2))
        draft = Draft(tree, torch.randint(0, 10, (tree.size,), generator=g), q)
        for kind in set(Verifier) - ({Verifier.chain} if tree.width > 1 else set()):
            assert verify(kind, draft, p, _gen(9)) == verify(kind, draft, p, _gen(9))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_probabilities_with_a_cpu_generator_match_cpu():
    g = _gen(6)
    tree = Tree.kary(2, 2)
    p, q = (probs(torch.randn(tree.size, 100, generator=g, dtype=torch.float64), SamplingParams())
            for _ in range(2))
    draft = Draft(tree, torch.randint(0, 100, (tree.size,), generator=g), q)
    cuda = Draft(tree, draft.tokens.cuda(), q.cuda())
    for kind in set(Verifier) - {Verifier.chain}:
        for seed in range(5):
            assert verify(kind, draft, p, _gen(seed)) == verify(kind, cuda, p.cuda(), _gen(seed))
    assert chain_rejection(p[:3], q[:2], draft.tokens[1:3], _gen(0)) == chain_rejection(
        p[:3].cuda(), q[:2].cuda(), draft.tokens[1:3].cuda(), _gen(0))
