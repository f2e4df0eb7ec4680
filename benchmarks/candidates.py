"""specsim's contenders for "best" in benchmarks/vs_transformers.py, per registered drafter.

``FACTORIES`` maps a drafter of methods/drafters/registry.py to the function listing its candidates (a
method preset, a tree, params). A registered drafter without an entry still competes: every lossless
conf/method preset that names it runs with the preset's own tree (``preset_candidates``), so a new method
(EAGLE, self-speculative, lookahead, ...) enters the race by its registry line and preset alone; an entry
here adds its tuned trees. Drafters that train something on first use may say so with an entry that checks
their cache (Medusa's does).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from methods.core.loop import decode
from methods.core.metrics import AcceptStats
from methods.drafters.registry import build_drafter, names
from specsim.config import MethodConfig
from specsim.tree import Tree

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Candidate:
    name: str
    overrides: tuple[str, ...]  # method/tree presets (compose)
    tree: Tree | None  # None: the drafter's own (dynamic trees, Medusa's greedy tree); else this static tree
    params: dict = field(default_factory=dict)  # method.params overrides


@dataclass
class Context:
    """What a candidate factory may use: the run's arguments, models, base overrides, the engine and decode
    options (to measure acceptance on the calibration prompts), and ``compose`` (run.py's presets)."""

    args: object
    models: object
    base: tuple[str, ...]
    engine: object
    opts: object
    calib: list
    compose: Callable


def add_race_arguments(ap) -> None:
    """The command-line options of the race (an argparse parser's), shared by the benchmarks that run it."""
    ap.add_argument("--chain-gammas", type=int, nargs="*", default=[2, 3, 4, 6])
    # 3-6 beside 10 (Saxena's) and 16: on the zoo's code, compiled bf16, the lookup's τ grows slowly with the
    # length (1.63 at 3, 1.73 at 5, 1.82 at 10) while the verify forward grows with it; 4 and 5 were fastest
    ap.add_argument("--pld-gammas", type=int, nargs="*", default=[3, 4, 5, 6, 10, 16])
    ap.add_argument("--sequoia-budgets", type=int, nargs="*", default=[8, 16])
    ap.add_argument("--sequoia-depth", type=int, default=8, help="levels including the root")
    ap.add_argument("--staged-depths", type=int, nargs="*", default=[6, 8, 10],
                    help="staged spines of these depths D (top-2 branches, the second stage guessing up to D "
                    "tokens) beside the preset's own (D = the chain's γ)")
    ap.add_argument("--staged-order", type=int, default=4,
                    help="the deeper spines' second stage: n-gram keys of up to this many tokens (backs off)")
    ap.add_argument("--calibration-prompts", type=int, default=4)
    ap.add_argument("--medusa", choices=["auto", "train", "off"], default="auto",
                    help="auto: include Medusa only if heads for this target are cached")
    ap.add_argument("--medusa-budgets", type=int, nargs="*", default=[16],
                    help="Medusa's greedy trees (from the heads' measured accuracies) of these sizes")
    ap.add_argument("--drafters", nargs="*", default=None, help="registered drafters whose candidates race "
                    "for best (default: those that train nothing on first use; benchmarks/candidates.py)")
    ap.add_argument("--eagle", choices=["auto", "train", "off"], default="auto",
                    help="auto: include EAGLE-1/2 (EAGLE-3) only if their heads for this target are cached")


def method_config(ctx: Context, overrides: tuple[str, ...], params: dict) -> MethodConfig:
    method = ctx.compose(*ctx.base, *overrides).method
    method.params = {**method.params, **params}
    return method


def measured_rank_vector(ctx: Context, *, width: int) -> list[float]:
    """Sequoia's positional vector [0, p_1..p_W, p_none] of this draft, measured on calibration prompts with a
    star tree (the root's top-W draft children, greedy verification)."""
    drafter = build_drafter(method_config(ctx, ("method=vanilla",), {}), Tree.kary(width, 1), ctx.models,
                            ctx.opts.sampling)
    stats = AcceptStats()
    for ids in ctx.calib:
        stats.merge(decode(ctx.engine, drafter, ids, ctx.opts, torch.Generator().manual_seed(0)).stats)
    vec = stats.by_rank()
    return vec + [0.0] * (width + 2 - len(vec)) if vec else [0.0] * (width + 1) + [1.0]


def draft_model(ctx: Context) -> list[Candidate]:
    """Vanilla chains (``--chain-gammas``), a 2x3 k-ary tree, Sequoia trees DP-optimal for the draft's
    measured positional vector (``--sequoia-budgets``)."""
    from specsim import sequoia

    args = ctx.args
    if ctx.models.draft is None:
        return []
    vanilla = ("method=vanilla", "tree=chain")
    out = [Candidate(f"vanilla chain g={g}", vanilla, Tree.chain(g)) for g in args.chain_gammas
           if g != args.gamma]  # the fixed vanilla path already runs args.gamma
    out.append(Candidate("vanilla kary 2x3", ("method=vanilla", "tree=kary"), Tree.kary(2, 3)))
    if args.sequoia_budgets:
        vec = measured_rank_vector(ctx, width=8)
        print(f"measured positional vector (calibration split): {[round(v, 3) for v in vec]}",
              file=sys.stderr)
        for b in args.sequoia_budgets:
            t = sequoia.optimal_tree(vec, b, args.sequoia_depth).tree
            out.append(Candidate(f"vanilla sequoia n={t.size} d={t.depth}", vanilla, t))
    return out


def staged(ctx: Context) -> list[Candidate]:
    """The preset's own spine (D = γ of conf/tree/chain.yaml) and deeper ones (``--staged-depths``). Why
    deeper: the target's verify time barely grows with the tree's size at these sizes (t(9) ≈ 1.2 t(1) on
    the zoo target) and the second stage settles most spine levels without a draft forward, so τ gains
    outrun the extra draft forwards (code workload, zoo: τ 3.82 at D = 4, 4.74 at D = 6, 5.28 at D = 8,
    5.63 at D = 10; tokens/s by thread CPU time under load +10% at D = 6, +11% at D = 8, +15% at D = 10
    over D = 4). Their second stage keys on up to ``--staged-order`` tokens: it backs off to shorter keys,
    so a longer one only adds guesses (zoo, code, D = 6: 2.20 draft forwards per step at order 2, 1.88 at
    order 4, same drafts)."""
    if ctx.models.draft is None:
        return []
    out = preset_candidates(ctx, "staged")
    order = ctx.args.staged_order
    return out + [Candidate(f"staged D={d} k=2 order={order}", ("method=staged",), None,
                            {"depth": d, "top_k": 2, "stage2_gamma": d, "order": order})
                  for d in ctx.args.staged_depths]


def prompt_lookup(ctx: Context) -> list[Candidate]:
    """Other lookup lengths (``--pld-gammas``) with the run's n-gram size."""
    args = ctx.args
    lookup = ("method=prompt_lookup", "tree=chain")
    return [Candidate(f"prompt_lookup g={g} n<={args.ngram}", lookup, Tree.chain(g),
                      {"num_pred_tokens": g, "max_ngram_size": args.ngram})
            for g in args.pld_gammas if g != args.pld_tokens]


def medusa(ctx: Context) -> list[Candidate]:
    """Medusa's 63-node tree and its greedy trees of ``--medusa-budgets`` nodes, when heads are cached (or
    ``--medusa train``)."""
    if not medusa_cached(ctx):
        return []
    paths = ctx.compose(*ctx.base, "method=medusa").tree.paths  # the 63-node tree (conf/tree/medusa.yaml)
    out = [Candidate("medusa 63-node tree", ("method=medusa",), Tree.from_paths(paths))]
    return out + [Candidate(f"medusa greedy tree n={n}", ("method=medusa",), None, {"tree_budget": n})
                  for n in ctx.args.medusa_budgets]


def medusa_cached(ctx: Context) -> bool:
    """--medusa auto: only when heads for this target are already in the cache (training takes minutes)."""
    if ctx.args.medusa == "off":
        return False
    if ctx.args.medusa == "train":
        return True
    from methods.drafters.medusa import MedusaParams
    from methods.heads.medusa.store import EvalConfig, _cache_root, cache_key

    mp = MedusaParams.from_method(method_config(ctx, ("method=medusa",), {}))
    if mp.heads != "train":
        return True
    key = cache_key(ctx.models.target, ctx.models.tokenizer, mp.train_config(), EvalConfig())
    return (_cache_root() / "medusa" / key / "report.json").exists()


def eagle(ctx: Context) -> list[Candidate]:
    """EAGLE-1's static tree and EAGLE-2's dynamic tree, when the head is cached (or ``--eagle train``)."""
    if not heads_cached(ctx, "eagle"):
        return []
    paths = ctx.compose(*ctx.base, "method=eagle").tree.paths  # EAGLE-1's static tree (conf/tree/eagle.yaml)
    return [Candidate("eagle static tree", ("method=eagle",), Tree.from_paths(paths)),
            Candidate("eagle2 dynamic tree", ("method=eagle2",), None)]  # the tree=dynamic preset


def eagle3(ctx: Context) -> list[Candidate]:
    return [Candidate("eagle3 dynamic tree", ("method=eagle3",), None)] if heads_cached(ctx, "eagle3") else []


def heads_cached(ctx: Context, method: str) -> bool:
    """--eagle auto: only when the method's trained head for this target is in the cache (training takes
    minutes)."""
    if ctx.args.eagle != "auto":
        return ctx.args.eagle == "train"
    from methods.drafters.eagle import EagleParams
    from methods.heads.eagle.store import EagleEval, _cache_root, cache_key

    ep = EagleParams.from_method(method_config(ctx, (f"method={method}",), {}))
    if ep.head != "train":
        return True
    variant = "eagle3" if method == "eagle3" else "eagle1"
    key = cache_key(ctx.models.target, ctx.models.tokenizer, ep.train_config(variant), EagleEval())
    return (_cache_root() / "eagle" / key / "report.json").exists()


def none(ctx: Context) -> list[Candidate]:
    return []


# drafter (registry name) -> its candidates; a registered drafter missing here runs its presets' own trees
FACTORIES: dict[str, Callable[[Context], list[Candidate]]] = {
    "autoregressive": none,  # the baseline path, not a contender
    "draft_model": draft_model,
    "prompt_lookup": prompt_lookup,
    "staged": staged,
    "medusa": medusa,
    "eagle": eagle,
    "eagle3": eagle3,
}


def lossless_presets(drafter: str) -> list[str]:
    """conf/method presets naming ``drafter`` that are lossless (typical acceptance is not)."""
    import yaml

    out = []
    for path in sorted((REPO / "conf" / "method").glob("*.yaml")):
        preset = yaml.safe_load(path.read_text()) or {}
        if preset.get("drafter") == drafter and preset.get("lossless", True):
            out.append(path.stem)
    return out


def preset_candidates(ctx: Context, drafter: str) -> list[Candidate]:
    """A drafter without a factory: each of its lossless presets with the preset's own tree (None: the
    drafter builds it, as run.py's measure does for dynamic trees)."""
    from methods.measurement.measure import run_tree

    out = []
    for preset in lossless_presets(drafter):
        cfg = ctx.compose(*ctx.base, f"method={preset}")
        tree = run_tree(cfg)
        out.append(Candidate(f"{preset} {cfg.tree.name} tree", (f"method={preset}",),
                             tree if tree.size > 1 else None))
    return out


# drafters that train or search something on first use (minutes to an hour on 2 cores: boost-tuned drafts,
# a prose-only draft, the LayerSkip variant, MTP modules, the skip-set search): they race only when
# ``--drafters`` names them, and then their presets build what they need
TRAIN_ON_FIRST_USE = frozenset({"specinfer", "online", "layerskip", "mtp", "draft_verify"})


def candidates(ctx: Context) -> list[Candidate]:
    """Every registered drafter's candidates (``--drafters`` chooses the drafters; None: every one that
    needs no training on first use, see TRAIN_ON_FIRST_USE)."""
    chosen = [d for d in names() if d in ctx.args.drafters] if ctx.args.drafters is not None else [
        d for d in names() if d not in TRAIN_ON_FIRST_USE]
    out = []
    for drafter in chosen:
        factory = FACTORIES.get(drafter)
        out += factory(ctx) if factory is not None else preset_candidates(ctx, drafter)
    return out
