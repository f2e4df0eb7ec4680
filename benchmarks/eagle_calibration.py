"""Does the EAGLE head's cumulative draft probability predict acceptance? (EAGLE-2, Li et al. 2024b, §3-4:
the dynamic tree ranks nodes by the product of q along the path, assuming it tracks the acceptance rate.)

p = target, q = head. On the workload's prompts continued greedily by the target, every position t (root
x_{t-1}) is drafted twice by the SAME head, as in decoding (its own KV cache, the target's features of the
committed rows): the dynamic tree with every candidate kept (``top_k`` expanded per level, ``depth`` levels)
and the static k-ary tree. Under greedy verification a node is accepted iff its path equals the target's
greedy continuation, so τ = 1 + the accepted nodes a tree keeps. Printed:
- the reliability table per depth: bins of cumulative q, the nodes in each, mean q, the accepted fraction;
- nodes kept per depth and τ at ``budget`` draft tokens: the static tree, the drafter's rerank (cumulative q),
  a rerank by cross-fitted calibrated acceptance (per depth × q-bin rates fitted on the other half of the
  prompts, made non-increasing along paths) and the oracle (every accepted candidate kept: the candidates'
  ceiling);
- with ``--temperatures`` / ``--fit``: the drafter's own expansion and rerank with q = softmax(z / T)
  (method.params.confidence_temperature), T given or fitted on the calibration split (temperature scaling:
  the NLL of the target's greedy token under the head, depths 1..depth).

    python benchmarks/eagle_calibration.py method=eagle2 workload=code
    python benchmarks/eagle_calibration.py --temperatures 0.5 --fit method=eagle2 workload=code
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from methods.core.drafter import DraftContext  # noqa: E402
from methods.core.sampling import SamplingParams  # noqa: E402
from methods.data.workloads import load_prompts  # noqa: E402
from methods.drafters.eagle import Dynamic, EagleDrafter  # noqa: E402
from methods.drafters.registry import build_drafter  # noqa: E402
from methods.heads import trainer  # noqa: E402
from methods.models import load_models  # noqa: E402
from specsim.tree import Tree  # noqa: E402

BINS = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001])


@dataclass
class Position:
    """One root's candidates (dynamic, all kept) and the static tree's accepted count."""

    parents: np.ndarray  # (n,) parent index in this list, -1 = the root
    depth: np.ndarray
    logq: np.ndarray  # cumulative log q
    accepted: np.ndarray  # bool: the path equals the target's greedy continuation
    static_accepted: int
    prompt: int
    paths: list  # each node's child ranks from the root (its position in a rank-indexed tree)


def accepted_nodes(parents, tokens, depths, truth: torch.Tensor) -> np.ndarray:
    """Nodes (parents first) whose path equals ``truth`` (the greedy tokens after the root)."""
    ok = np.zeros(len(tokens), dtype=bool)
    for i, (p, tok, d) in enumerate(zip(parents, tokens, depths)):
        ok[i] = (p < 0 or ok[p]) and d <= len(truth) and tok == int(truth[d - 1])
    return ok


def collect(dyn: EagleDrafter, static: EagleDrafter, ids: torch.Tensor, P: int, src: torch.Tensor,
            depth: int, prompt: int) -> list[Position]:
    """Teacher-forced along the greedy continuation ``ids``: a draft at every root x_{t-1}, t = P..L-depth."""
    out, shown = [], 0
    gen = torch.Generator().manual_seed(0)
    for d in (dyn, static):
        d.cache.reset()
    for t in range(P, ids.numel() - depth + 1):
        rows = src[shown : t - 1]
        shown = t - 1
        ctx = DraftContext(ids[:t], rows, gen, max_new=depth + 1, features=rows)
        truth = ids[t : t + depth]
        with torch.inference_mode():
            dyn._catch_up(ctx)
            par, tok, rk, score = dyn._dynamic(int(ids[t - 1]), depth)
            dyn.cache.drop_pending()
            draft = static.propose(DraftContext(ids[:t], rows, gen, max_new=depth + 1, features=rows))
        dep = Tree.from_parents(par).depths[1:]
        paths = [()]
        for i in range(1, len(par)):
            paths.append(paths[par[i]] + (rk[i],))
        par, tok, score = np.array(par[1:]) - 1, tok[1:], np.array(score[1:])  # drop the root
        st = draft.tree
        ok_static = accepted_nodes(np.array(st.parents[1:]) - 1, draft.tokens[1:].tolist(), st.depths[1:],
                                   truth)
        ok = accepted_nodes(par, tok, dep, truth)
        out.append(Position(par, dep, score, ok, int(ok_static.sum()), prompt, paths[1:]))
    return out


def reliability(pos: list[Position], depth: int) -> list[str]:
    q = np.concatenate([np.exp(p.logq) for p in pos])
    d = np.concatenate([p.depth for p in pos])
    a = np.concatenate([p.accepted for p in pos])
    lines = [f"{'depth':>5} {'q bin':>11} {'nodes':>6} {'mean q':>7} {'accepted':>8}"]
    for k in range(1, depth + 1):
        b = np.digitize(q[d == k], BINS) - 1
        for j in range(len(BINS) - 1):
            m = b == j
            if m.sum():
                lines.append(f"{k:5d} {BINS[j]:5.2f}-{min(BINS[j + 1], 1):4.2f} {int(m.sum()):6d} "
                             f"{q[d == k][m].mean():7.3f} {a[d == k][m].mean():8.3f}")
        lines.append(f"{k:5d} {'all':>11} {int((d == k).sum()):6d} {q[d == k].mean():7.3f} "
                     f"{a[d == k].mean():8.3f}")
    return lines


def fit_rates(pos: list[Position], depth: int) -> np.ndarray:
    """(depth, bins) accepted fraction per depth × q-bin (the bin's mean q where a cell is empty)."""
    rates = np.tile((BINS[:-1] + np.minimum(BINS[1:], 1)) / 2, (depth, 1))
    q = np.concatenate([np.exp(p.logq) for p in pos])
    d = np.concatenate([p.depth for p in pos])
    a = np.concatenate([p.accepted for p in pos])
    b = np.digitize(q, BINS) - 1
    for k in range(1, depth + 1):
        for j in range(len(BINS) - 1):
            m = (d == k) & (b == j)
            if m.sum() >= 5:
                rates[k - 1, j] = a[m].mean()
    return rates


def fit_paths(pos: list[Position]) -> dict:
    """Accepted fraction per rank path (Sequoia's positional acceptance), paths seen at least 5 times."""
    seen: dict = {}
    for p in pos:
        for path, a in zip(p.paths, p.accepted):
            n, k = seen.get(path, (0, 0))
            seen[path] = (n + 1, k + int(a))
    return {path: k / n for path, (n, k) in seen.items() if n >= 5}


def kept(p: Position, value: np.ndarray, budget: int) -> np.ndarray:
    """The ``budget`` best nodes by ``value`` made non-increasing along paths (ancestors first on ties)."""
    v = value.copy()
    for i in range(len(v)):  # parents precede children
        if p.parents[i] >= 0:
            v[i] = min(v[i], v[p.parents[i]])
    order = sorted(range(len(v)), key=lambda i: (-v[i], p.depth[i], i))[:budget]
    return np.array(order, dtype=int)


def taus(pos: list[Position], depth: int, budget: int, k: int) -> dict[str, tuple[float, np.ndarray]]:
    """τ and mean nodes kept per depth: static, rerank by q, cross-fitted calibrated rerank, oracle."""
    halves = [[p for p in pos if p.prompt % 2 == h] for h in (0, 1)]
    rates = [fit_rates(halves[1 - h], depth) for h in (0, 1)]  # fitted on the other half
    by_path = [fit_paths(halves[1 - h]) for h in (0, 1)]
    res: dict[str, list] = {"static": [], "rerank q": [], "rerank calibrated": [], "rerank by rank path": [],
                            "oracle": []}
    per_depth: dict[str, np.ndarray] = {k: np.zeros(depth) for k in res}
    for p in pos:
        calib = rates[p.prompt % 2][p.depth - 1, np.digitize(np.exp(p.logq), BINS) - 1]
        path_rate = np.array([by_path[p.prompt % 2].get(path, 0.0) for path in p.paths])
        for name, idx in (("rerank q", kept(p, p.logq, budget)),
                          ("rerank calibrated", kept(p, calib, budget)),
                          ("rerank by rank path", kept(p, path_rate, budget))):
            res[name].append(1 + p.accepted[idx].sum())
            per_depth[name] += np.bincount(p.depth[idx] - 1, minlength=depth)
        res["static"].append(1 + p.static_accepted)
        res["oracle"].append(1 + p.accepted.sum())
        per_depth["oracle"] += np.bincount(p.depth - 1, minlength=depth)
    per_depth["static"] = np.array([k**d for d in range(1, depth + 1)], dtype=float) * len(pos)
    return {k: (float(np.mean(v)), per_depth[k] / len(pos)) for k, v in res.items()}


def greedy_ids(models, prompt, new: int) -> torch.Tensor:
    ids = torch.tensor([prompt.token_ids])
    return models.target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new, min_new_tokens=new, pad_token_id=0)[0]


TEMPERATURES = np.geomspace(0.05, 2.0, 40)


@torch.inference_mode()
def fit_temperature(dyn: EagleDrafter, models, prompts, new: int, depth: int) -> tuple[float, list[float]]:
    """The T minimising the NLL of the target's greedy token under softmax(z / T) of the head, at depths
    1..``depth`` along the target's own continuations of ``prompts`` (the head fed the true path, training-
    time-test rollout): temperature scaling (Guo et al. 2017) on held-out prompts. Returns (T pooled over
    depths, T per depth)."""
    from methods.heads.eagle.train import rollout

    head, layers = dyn.head, dyn.feature_layers
    nll = np.zeros((depth, len(TEMPERATURES)))
    temps = torch.tensor(TEMPERATURES, dtype=torch.float32)[:, None, None]
    for pr in prompts:
        ids = greedy_ids(models, pr, new)
        f = trainer.target_features(models.target, ids[None], tuple(layers), desc="features")
        src = (f.layers if layers else f.hidden)[:, :-1]
        w = head.fc.weight
        outs = rollout(head, head.fuse(src.to(w.device, w.dtype)), ids[None, 1:], depth - 1)
        rows = torch.arange(len(pr.token_ids) - 2, ids.numel() - 2)  # row i: q of the token at i + 2
        truth = ids[rows + 2]
        for s, g in enumerate(outs):
            z = head.logits(g[0, rows]).float()  # (n, V)
            logq = (z[None] / temps).log_softmax(-1)  # (T, n, V)
            nll[s] -= logq[:, torch.arange(rows.numel()), truth].sum(-1).numpy()
    return float(TEMPERATURES[nll.sum(0).argmin()]), [float(TEMPERATURES[j]) for j in nll.argmin(1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=14, help="draft tokens kept (the ladder's k=2, depth 3)")
    ap.add_argument("--k", type=int, default=2, help="the static k-ary tree's branching")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperatures", type=float, nargs="*", default=[],
                    help="also rerank with q = softmax(z / T) (method.params.confidence_temperature)")
    ap.add_argument("--fit", action="store_true", help="fit T on the calibration split (temperature scaling "
                    "of the head's q against the target's greedy token) and rerank with it too")
    ap.add_argument("overrides", nargs="*", help="run.py overrides (method=eagle2|eagle3, workload=...)")
    args = ap.parse_args(argv)
    import run

    torch.set_num_threads(args.threads)
    cfg = run.compose_run_config("method=eagle2", "tree=dynamic", *args.overrides)
    depth, top_k = cfg.tree.depth, cfg.tree.top_k
    models = load_models(cfg.model, "cpu", "float32")
    greedy = SamplingParams(temperature=0.0)
    dyn = build_drafter(cfg.method, None, models, greedy, tree_cfg=cfg.tree)
    static = EagleDrafter(dyn.head, Tree.kary(args.k, depth), greedy)
    layers = dyn.feature_layers
    temps = list(args.temperatures)
    if args.fit:
        cal = cfg.calibration
        calib = replace(cfg.workload, split="calibration", num_prompts=cal.prompts)
        pooled, per_depth = fit_temperature(dyn, models, load_prompts(calib, models.tokenizer, cfg.seed),
                                            cfg.workload.max_new_tokens, depth)
        print(f"temperature fitted on the calibration split ({cal.prompts} prompts): T = {pooled:.3f} "
              f"(per depth: {' '.join(f'{t:.3f}' for t in per_depth)})")
        temps.append(pooled)
    prompts = load_prompts(cfg.workload, models.tokenizer, cfg.seed)
    inputs, top_p = [], []
    for pr in prompts:
        ids = greedy_ids(models, pr, cfg.workload.max_new_tokens)
        f = trainer.target_features(models.target, ids[None], tuple(layers), desc="features")
        P = len(pr.token_ids)
        with torch.inference_mode():  # the target's own confidence at the roots x_{P-1} .. x_{L-depth-1}
            top_p += models.target.get_output_embeddings()(f.hidden[0, P - 1 : ids.numel() - depth]).float(
            ).softmax(-1).amax(-1).tolist()
        inputs.append((ids, P, (f.layers if layers else f.hidden)[0]))

    def positions(temperature: float) -> list[Position]:
        dyn.dynamic = Dynamic(10**6, depth, top_k, temperature)  # keep every candidate: reranked here
        return [p for n, (ids, P, src) in enumerate(inputs)
                for p in collect(dyn, static, ids, P, src, depth, n)]

    pos = positions(1.0)
    print(f"{cfg.method.name} ({dyn.head.cfg.variant}) on {cfg.workload.name}: {len(prompts)} prompts, "
          f"{len(pos)} roots, candidates: top_k {top_k} per level, depth {depth}")
    top_q = [np.exp(p.logq[p.depth == 1].max()) for p in pos]
    top_ok = [p.accepted[(p.depth == 1)][np.argmax(p.logq[p.depth == 1])] for p in pos]
    print(f"depth 1, top-1 child: target max p {np.mean(top_p):.3f}, head max q {np.mean(top_q):.3f}, "
          f"accepted {np.mean(top_ok):.3f}")
    print("\n".join(reliability(pos, depth)))
    print(f"\nbudget {args.budget} draft tokens, depth {depth} (static: {args.k}-ary)")
    print(f"{'tree':22} {'tau':>6}  nodes per depth")
    for name, (tau, nd) in taus(pos, depth, args.budget, args.k).items():
        print(f"{name:22} {tau:6.3f}  {' '.join(f'{x:5.2f}' for x in nd)}")
    for t in temps:  # the drafter's own expansion and rerank with q at temperature T
        tau, nd = taus(positions(t), depth, args.budget, args.k)["rerank q"]
        print(f"{f'rerank q, T={t:.3f}':22} {tau:6.3f}  {' '.join(f'{x:5.2f}' for x in nd)}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
