"""MTP drafter trees (methods/drafters/mtp.py): every expanded node's children are module d's top-k given
THAT node's own path (its token and its parent's module state), as calibration conditions module k on the
true tokens; checked against running the modules sequentially over the window with the path appended."""

from __future__ import annotations

import torch

from methods.core.drafter import DraftContext
from methods.core.sampling import SamplingParams
from methods.drafters.registry import build_drafter
from specsim.config import MethodConfig
from specsim.tree import Tree


def _path_children(heads, hidden: torch.Tensor, ext: list[int], k_children: int) -> list[int]:
    """Reference: modules 1..d over all n positions, module k reading the window shifted by k (the path's
    draft tokens standing in for the uncommitted ones); top-k of module d at the last position."""
    h, n = hidden, hidden.shape[0]
    d = len(ext) - n + 1  # ext: the n committed tokens then the path's d-1 draft tokens
    for k in range(1, d + 1):
        h = heads.step(k, h[None], torch.tensor(ext[k - 1 : k - 1 + n])[None])[0]
    return heads.logits(d, h[-1]).topk(k_children).indices.tolist()


def test_tree_children_follow_their_own_path(tiny_models):
    torch.manual_seed(0)
    tree = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 1, 0),
                            (1, 0, 0), (1, 0, 1)])
    params = {"modules": "random", "num_heads": 3, "window": 8}
    method = MethodConfig(name="mtp", drafter="mtp", params=params)
    drafter = build_drafter(method, tree, tiny_models, SamplingParams(0.0))
    prompt = torch.randint(0, tiny_models.target.config.vocab_size, (12,))
    hidden = torch.randn(11, tiny_models.target.config.hidden_size)  # positions 0..10: the last predicts x_11
    drafter.reset(prompt)
    with torch.inference_mode():
        draft = drafter.propose(DraftContext(prompt, hidden, torch.Generator(), max_new=16))
        h, ext = hidden[-8:], prompt[-8:].tolist()
        toks, checked = draft.tokens.tolist(), 0
        for v in range(tree.size):
            kids = tree.children[v]
            if not kids:
                continue
            path = [toks[u] for u in tree.path_to(v)[1:]]
            ref = _path_children(drafter.heads, h, ext + path, max(tree.ranks[c] for c in kids) + 1)
            assert [toks[c] for c in kids] == [ref[tree.ranks[c]] for c in kids], f"node {v}"
            checked += 1
    assert checked == 7  # the root, three depth-1 and three depth-2 nodes expanded
    # a non-top-1 depth-1 node's children differ from the spine's: the drafter does not reuse them
    assert [toks[c] for c in tree.children[2]] != [toks[c] for c in tree.children[1]]
