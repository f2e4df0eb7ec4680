"""The trees a dynamic (EAGLE-2, Li et al. 2024b) drafter keeps, recorded on the calibration split.

p = target, q = draft head. EAGLE-2 re-shapes its tree every step from q (the product of q along each path,
reranked to ``total_tokens``), so no static tree prices it: the simulator prices the mixture of the trees it
kept (specsim.trees.recorded_law) under the (depth, rank) acceptance of the nodes it kept. Those trees are
recorded here by decoding the calibration prompts with the drafter, as long as the workload's generations, and
cached beside the drafter's profile (one file per tree configuration): a run's prediction then uses no data
of the split it measures. The shapes come from q alone; the same decode counts, per (depth, rank), how often a
kept node under an accepted parent was accepted (specsim.trees.kept_acceptance): q keeps the nodes it is
confident in, which are accepted more often than the static calibration's average node at their (depth,
rank). The trees a run keeps on its own prompts are its diagnostic (methods.measurement.measure).

The same file holds the dynamic drafter's draft time per step over that of the chain the profile's loop
measured (``draft_scale``: the loop's draft time per step, decodes of the calibration prompts interleaved):
the dynamic draft is priced as the loop's chain draft times it. Its per-step work beyond the head's levels
(the rerank of every drafted node, the kept tree, the shape and kept-node counts) and its levels' host
bookkeeping are in no level the profile times: priced from the levels alone, EAGLE-2's draft read ~9%
cheap in validation (code T0 speedup +18%).
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.core.timing import interleaved
from methods.data.workloads import calibration_prompts
from methods.drafters.registry import backbone_of, build_drafter
from methods.measurement.profiles import profile_lock, profile_path, refuse_unless_calibrating
from methods.models import Models
from specsim.config import RunConfig, TreeKind
from specsim.io import atomic_write_json, read_json
from specsim.replay import lengths_law
from specsim.tree import Tree
from specsim.trees import RecordedTrees, kept_acceptance

# 2: with the kept nodes' outcomes (``kept``: tried and accepted per depth × rank); 3: with ``draft_scale``;
# 4: with the loop's accepted lengths per prompt and step (``loop_lengths``, its law of τ)
SHAPES_FORMAT = 4
# interleaved rounds (one decode of each drafter each) timing draft_scale; their median. 5 rounds scattered:
# EAGLE-2 on code (zoo, quiet, 2026-11-28) read 1.103 and 0.956 minutes apart, 25 rounds 1.122, the ratio of
# the mean draft per step over 24 prompts 1.102
SCALE_ROUNDS = 15


def shapes_path(pcfg: RunConfig, tree_cfg, cache: Path | None = None, chain_depth: int = 0) -> Path:
    """Beside the profile of ``pcfg`` (the run's profile config): one file per (total_tokens, depth, top_k),
    calibration size and the loop chain its draft scale is timed against (``-c``: none without)."""
    base = profile_path(pcfg, cache)
    cal = pcfg.calibration
    tag = f"dynamic-t{tree_cfg.total_tokens}-d{tree_cfg.depth}-k{tree_cfg.top_k}-p{cal.prompts}"
    tag += f"-c{chain_depth}" if chain_depth else ""
    return base.with_name(f"{base.stem}.{tag}.json")


def new_tokens(cfg: RunConfig) -> int:
    """Tokens per calibration prompt: as many as the workload generates (a tree's shape depends on how far
    into a generation it is), at least the calibration's own."""
    return max(cfg.calibration.new_tokens, cfg.workload.max_new_tokens)


@torch.inference_mode()
def record_shapes(cfg: RunConfig, models: Models, show_progress: bool = True, chain_depth: int = 0
                  ) -> tuple[Counter[Tree], list, float | None, list[list[int]]]:
    """Decode the calibration prompts with ``cfg``'s dynamic-tree drafter: its kept trees → counts, its kept
    nodes' [tried, accepted] counts per depth × rank, (``chain_depth`` > 0) its draft time per step over
    that of the same method on a chain of ``chain_depth`` (:func:`draft_scale`; else None), and each
    prompt's accepted lengths per step (the loop's own law, specsim.replay.lengths_law)."""
    assert TreeKind(cfg.tree.kind) == TreeKind.dynamic, "only dynamic trees are recorded"
    w = cfg.workload
    sampling = SamplingParams(w.temperature, w.top_k, w.top_p)
    n = new_tokens(cfg)
    prompts = calibration_prompts(cfg, models.tokenizer, n)
    drafter = build_drafter(cfg.method, None, models, sampling, tree_cfg=cfg.tree)
    target = ModelEngine(backbone_of(drafter, models, cfg.model.name)[0])
    opts = DecodeOptions.for_method(cfg.method, sampling, n, models.tokenizer.eos_token_id)
    generator = torch.Generator(device=models.device).manual_seed(cfg.seed)
    lengths = []
    for p in tqdm(prompts, desc=f"record {cfg.method.name} trees", disable=not show_progress):
        r = decode(target, drafter, torch.tensor(p.token_ids, dtype=torch.long), opts, generator)
        lengths.append([int(k) for k in r.accepted_lengths])
    shapes, kept = Counter(drafter.shapes), drafter.kept.tolist()
    if chain_depth < 1:
        return shapes, kept, None, lengths
    chain = build_drafter(cfg.method, Tree.chain(chain_depth), models, sampling)
    ids = [torch.tensor(p.token_ids, dtype=torch.long) for p in prompts]
    scale = draft_scale(target, {"dynamic": drafter, "chain": chain}, ids, opts, generator)
    return shapes, kept, scale, lengths


def draft_scale(target: ModelEngine, drafters: dict, prompts: list[torch.Tensor], opts: DecodeOptions,
                generator: torch.Generator, rounds: int = SCALE_ROUNDS) -> float:
    """The ``dynamic`` drafter's draft time per step over the ``chain`` drafter's, median over ``rounds``
    interleaved rounds (one untimed) that each decode the next prompt with both: the loop's draft time
    (the drafter's catch-up, its proposal and feedback) per speculation step, a ratio within each round
    (the machine's load cancels). In the loop as the profile's draft is: each draft follows the verify
    forward of its own tree (a wider tree's forward leaves less of the head's weights in cache)."""
    turn = {"i": 0}

    def timed(name: str):
        def go() -> dict:
            ids = prompts[(turn["i"] // 2) % len(prompts)]
            turn["i"] += 1
            r = decode(target, drafters[name], ids, opts, generator)
            return {name: r.time_draft_s / max(r.n_target_forwards, 1)}
        return go

    out = interleaved([timed("dynamic"), timed("chain")], rounds, warmup=1)
    return statistics.median(r["dynamic"] / r["chain"] for r in out)


def to_json(shapes: Counter[Tree] | dict[Tree, int]) -> list[dict]:
    return [{"parents": list(map(int, t.parents)), "ranks": list(map(int, t.ranks)), "count": int(c)}
            for t, c in sorted(shapes.items(), key=lambda kv: -kv[1])]


def from_json(rows: list[dict]) -> dict[Tree, int]:
    out: Counter[Tree] = Counter()
    for r in rows:
        out[Tree.from_parents(r["parents"], r["ranks"])] += int(r["count"])
    return dict(out)


def nodes_per_depth(shapes: dict[Tree, int]) -> list[float]:
    """Mean kept nodes at depth 1, 2, … over the trees (weighted by how often each was kept)."""
    n = sum(shapes.values())
    return [sum(c * int((t.depths == d).sum()) for t, c in shapes.items()) / n
            for d in range(1, max(t.depth for t in shapes) + 1)]


def recorded(doc: dict) -> RecordedTrees:
    """A shapes file's trees with their kept nodes' acceptance and the drafter's draft scale."""
    tried, accepted = doc["kept"]
    scale = doc.get("draft_scale")
    lengths = doc.get("loop_lengths")
    loop = (tuple(lengths_law(lengths, int(doc["new_tokens"]), int(doc["loop_depth"])))
            if lengths and doc.get("loop_depth") else None)
    return RecordedTrees(from_json(doc["shapes"]), kept_acceptance(tried, accepted),
                         None if scale is None else (float(scale), int(doc["draft_scale_depth"])), loop)


def ensure_shapes(cfg: RunConfig, pcfg: RunConfig, models: Models, cache: Path | None = None,
                  show_progress: bool = True, chain_depth: int = 0) -> tuple[RecordedTrees, Path]:
    """The cached calibration-split trees of ``cfg``'s dynamic tree (``pcfg``: its profile config, whose key
    names the drafter, its head and the workload), their kept nodes' acceptance and (``chain_depth``: the
    profile's loop chain) the draft scale over that chain, recorded on first use."""
    path = shapes_path(pcfg, cfg.tree, cache, chain_depth)
    with profile_lock(path):
        if path.is_file():
            try:
                doc = read_json(path)
                if (doc.get("format") == SHAPES_FORMAT and doc.get("new_tokens") == new_tokens(cfg)
                        and int(doc.get("draft_scale_depth") or 0) == chain_depth):
                    return recorded(doc), path
            except (ValueError, TypeError, KeyError):  # unreadable: record again
                pass
        refuse_unless_calibrating(cfg, "no dynamic trees recorded for this run's tokens and chain", path)
        print(f"recording {cfg.method.name}'s dynamic trees on the calibration split (cached in {path})",
              file=sys.stderr, flush=True)
        shapes, kept, scale, lengths = record_shapes(cfg, models, show_progress, chain_depth)
        doc = {"format": SHAPES_FORMAT, "new_tokens": new_tokens(cfg), "prompts": cfg.calibration.prompts,
               "steps": sum(shapes.values()), "nodes_per_depth": nodes_per_depth(shapes), "kept": kept,
               "draft_scale": scale, "draft_scale_depth": chain_depth if scale is not None else 0,
               "loop_depth": int(cfg.tree.depth), "loop_lengths": lengths,
               "shapes": to_json(shapes)}
        atomic_write_json(path, doc)
    return recorded(doc), path
