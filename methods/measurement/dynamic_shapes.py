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
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.data.workloads import load_prompts
from methods.drafters.registry import backbone_of, build_drafter
from methods.measurement.profiles import profile_lock, profile_path
from methods.models import Models
from specsim.config import RunConfig, TreeKind
from specsim.io import atomic_write_json, read_json
from specsim.tree import Tree
from specsim.trees import RecordedTrees, kept_acceptance

SHAPES_FORMAT = 2  # 2: with the kept nodes' outcomes (``kept``: tried and accepted per depth × rank)


def shapes_path(pcfg: RunConfig, tree_cfg, cache: Path | None = None) -> Path:
    """Beside the profile of ``pcfg`` (the run's profile config): one file per (total_tokens, depth, top_k)
    and calibration size."""
    base = profile_path(pcfg, cache)
    cal = pcfg.calibration
    tag = f"dynamic-t{tree_cfg.total_tokens}-d{tree_cfg.depth}-k{tree_cfg.top_k}-p{cal.prompts}"
    return base.with_name(f"{base.stem}.{tag}.json")


def new_tokens(cfg: RunConfig) -> int:
    """Tokens per calibration prompt: as many as the workload generates (a tree's shape depends on how far
    into a generation it is), at least the calibration's own."""
    return max(cfg.calibration.new_tokens, cfg.workload.max_new_tokens)


@torch.inference_mode()
def record_shapes(cfg: RunConfig, models: Models, show_progress: bool = True) -> tuple[Counter[Tree], list]:
    """Decode the calibration prompts with ``cfg``'s dynamic-tree drafter: its kept trees → counts, and its
    kept nodes' [tried, accepted] counts per depth × rank."""
    assert TreeKind(cfg.tree.kind) == TreeKind.dynamic, "only dynamic trees are recorded"
    w, cal = cfg.workload, cfg.calibration
    sampling = SamplingParams(w.temperature, w.top_k, w.top_p)
    n = new_tokens(cfg)
    prompts = load_prompts(replace(w, split="calibration", num_prompts=cal.prompts, max_new_tokens=n),
                           models.tokenizer, cfg.seed)
    drafter = build_drafter(cfg.method, None, models, sampling, tree_cfg=cfg.tree)
    target = ModelEngine(backbone_of(drafter, models, cfg.model.name)[0])
    opts = DecodeOptions.for_method(cfg.method, sampling, n, models.tokenizer.eos_token_id)
    generator = torch.Generator(device=models.device).manual_seed(cfg.seed)
    for p in tqdm(prompts, desc=f"record {cfg.method.name} trees", disable=not show_progress):
        decode(target, drafter, torch.tensor(p.token_ids, dtype=torch.long), opts, generator)
    return Counter(drafter.shapes), drafter.kept.tolist()


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
    """A shapes file's trees with their kept nodes' acceptance."""
    tried, accepted = doc["kept"]
    return RecordedTrees(from_json(doc["shapes"]), kept_acceptance(tried, accepted))


def ensure_shapes(cfg: RunConfig, pcfg: RunConfig, models: Models, cache: Path | None = None,
                  show_progress: bool = True) -> tuple[RecordedTrees, Path]:
    """The cached calibration-split trees of ``cfg``'s dynamic tree (``pcfg``: its profile config, whose key
    names the drafter, its head and the workload) and their kept nodes' acceptance, recorded on first use."""
    path = shapes_path(pcfg, cfg.tree, cache)
    with profile_lock(path):
        if path.is_file():
            try:
                doc = read_json(path)
                if doc.get("format") == SHAPES_FORMAT and doc.get("new_tokens") == new_tokens(cfg):
                    return recorded(doc), path
            except (ValueError, TypeError, KeyError):  # unreadable: record again
                pass
        print(f"recording {cfg.method.name}'s dynamic trees on the calibration split (cached in {path})",
              file=sys.stderr, flush=True)
        shapes, kept = record_shapes(cfg, models, show_progress)
        doc = {"format": SHAPES_FORMAT, "new_tokens": new_tokens(cfg), "prompts": cfg.calibration.prompts,
               "steps": sum(shapes.values()), "nodes_per_depth": nodes_per_depth(shapes), "kept": kept,
               "shapes": to_json(shapes)}
        atomic_write_json(path, doc)
    return recorded(doc), path
