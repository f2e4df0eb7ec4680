"""The tree shapes calibration times a drafter's loop on (methods.measurement.calibrate), read back by the
draft's fit (methods.measurement.profiles.draft_terms): the shapes beside the calibration's own chain, and the
wide tree the loop's verification is timed on."""

from __future__ import annotations

from specsim.tree import Tree

# the trees besides the calibration's chain of D on which a level-by-level drafter's loop is timed: with the
# chain they separate its draft per step into a constant, a cost per level, a cost per node and a cost per
# level fed several nodes (the fans' second levels, fed 2 and 4 nodes: a tree-masked draft forward, and a cost
# per further fed node): draft_terms. Priced as the chain's draft / D per level, EAGLE-1's 2-level Sequoia-8
# tree read its draft 0.62 t(1) where the loop drafted 0.99 (quiet sweep); with the star alone, the draft
# model's Sequoia trees read 13-18% low, 0.05-0.09 t(1) per level fed more than one node; with the fan of 4
# alone, SpecInfer's member tree at T = 1 (levels fed 3) read its draft +10-26% high (docs/validation.md)
DRAFT_SHAPES = {"chain1": Tree.chain(1), "star8": Tree.kary(8, 1),
                "fan4": Tree.from_paths([[0], [1], [2], [3], [0, 0], [1, 0], [2, 0], [3, 0]]),
                "fan2": Tree.from_paths([[0], [1], [0, 0], [1, 0]])}
LOOP_SHAPE = "loop"
# the drafter's loop on the wide tree (:func:`wide_tree`, levels fed 1, 2, 4, 8, 1: 31 nodes), decoded in
# every round for the loop's verification (:func:`wide_drafter`), is a shape of the draft's fit too: the trees
# priced are 26-64 nodes with up to 5 levels fed 3-8, and the shapes above span 1-8 nodes and one level fed
# 2 or 4, so the terms were extrapolated from them. Where the tree path costs the loop a constant beyond its
# chain (EAGLE's chains take a faster path), the star and the fans read it as a cost per node (0.008 t(1)) and
# per fed node, which 31 nodes multiplied: EAGLE-1's Sequoia-32 trees read their draft 22-57% high, 2.5-3.8
# t(1) priced where the loop drafted 2.0-2.4 (T = 0, quiet sweep zoo8); with the wide tree in the fit, 5-6%
WIDE_SHAPE = "wide"


# the loop's verification is also timed on a tree this wide (its drafter's loop, once per round), beside its
# own chain: what the verify forward costs in the loop beyond the timed t(n) (the drafter's work between
# two forwards leaves the target's caches cold) is measured at two sizes, not taken in proportion to t(n)
# from the chain alone. In proportion, the zoo's 26-64-node trees read their verification 10% dear on
# average with the bf16 cache's kernel (quiet sweep, 30 rows; about right with the float32 cache's SDPA)
WIDE_NODES = 32


def wide_tree(n: int = WIDE_NODES) -> Tree:
    """The binary tree of n nodes (node i's parent (i − 1) // 2): the shape the walk is timed on per size."""
    return Tree.from_parents([-1] + [(i - 1) // 2 for i in range(1, n)])


# SpecInfer's verified tree is the merge of K member trees (one per draft model, shared prefixes once): on the
# zoo 3 drafts each fill the preset's 21-node member tree (8 levels: <1, 1, 3, 1, 1, 1, 1, 1>), a 61-node
# union. Its wide loop is the drafter on member trees of that shape (:func:`wide_member_tree`): its
# verification's excess and its draft are timed at the size and depth it runs. Scaled in proportion to t(n)
# from the union of 3 chains of 4 (13 nodes, 5-13 verified), the six zoo10 rows read their verify
# 1-5% of the step low; a binary member tree of 21 nodes (4 levels, a 64-node union) read the T = 1 draft of
# the 8-level member tree 29% low (code, load): at T = 1 the member's draft per level grows with the depth
# (the binary tree's 4 levels cost the loop what the chain of 4 did), which no shape 4 deep tells
WIDE_MEMBER_DEPTH = 8
WIDE_MEMBER_SPINE = 2  # levels of one node before the member tree branches
WIDE_MEMBER_BRANCHES = 3


def wide_member_tree(depth: int = WIDE_MEMBER_DEPTH, spine: int = WIDE_MEMBER_SPINE,
                     branches: int = WIDE_MEMBER_BRANCHES) -> Tree:
    """A chain of ``spine`` drafts, then ``branches`` chains from its end to ``depth`` (the SpecInfer
    preset's member tree: 2 + 3 x 6 = 20 drafts)."""
    head = [0] * spine
    return Tree.from_paths([head[:d] for d in range(1, spine + 1)]
                           + [head + [b] + [0] * j for b in range(branches) for j in range(depth - spine)])
