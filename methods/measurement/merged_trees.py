"""SpecInfer's merged trees counted on the calibration split, for the run's own member trees.

SpecInfer's verify forward carries the merge of its K drafts' member trees: a node of one member joins
another's where their drafts agree on its whole prefix. profiles.merged_size extrapolates how much they
merge from the calibration loop's union of K chains; on the zoo that missed the nodes the runs verified by
+30% (code), +27% (prose) and −16% (grounded): chains that part at depth 1 say little of how much the
members' top-k children overlap. Here the run's own drafter, on the run's own tree, decodes the
calibration prompts, and the nodes of the trees it proposed are counted (steps with room for the whole
tree: calibrate.SizeRecorder) — a measured input of the verify's size, cached beside the profile per tree.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from methods.core.engine import ModelEngine
from methods.core.loop import DecodeOptions, decode
from methods.core.sampling import SamplingParams
from methods.data.workloads import calibration_prompts
from methods.drafters.registry import build_drafter
from methods.measurement.calibrate import SizeRecorder
from methods.measurement.profiles import Profile, profile_lock, profile_path, refuse_unless_calibrating
from methods.models import Models
from specsim.config import RunConfig
from specsim.io import atomic_write_json, read_json
from specsim.tree import Tree

MERGED_FORMAT = 1


def merged_path(pcfg: RunConfig, tree: Tree, cache: Path | None = None) -> Path:
    """Beside the profile of ``pcfg``: one file per drafter tree (its parents' hash) and calibration size."""
    base = profile_path(pcfg, cache)
    digest = hashlib.sha256(json.dumps(list(tree.parents)).encode()).hexdigest()[:10]
    return base.with_name(f"{base.stem}.merged-n{tree.size}-{digest}-p{pcfg.calibration.prompts}.json")


def ensure_merged(cfg: RunConfig, pcfg: RunConfig, models: Models, tree: Tree, cache: Path | None = None,
                  show_progress: bool = True) -> dict[str, Any] | None:
    """The cached count of ``cfg``'s merged trees on the calibration split for its drafter built on ``tree``
    (the tree measure builds the drafter with), recorded on first use; None for drafters that merge
    nothing."""
    if cfg.method.drafter != "specinfer":
        return None
    path = merged_path(pcfg, tree, cache)
    n = cfg.calibration.new_tokens  # the calibration's own generations: a run of any length reads the count
    with profile_lock(path):
        if path.is_file():
            try:
                doc = read_json(path)
                if doc.get("format") == MERGED_FORMAT and doc.get("new_tokens") == n:
                    return doc
            except (ValueError, TypeError, KeyError):  # unreadable: count again
                pass
        refuse_unless_calibrating(cfg, "no merged trees counted for this run's tree", path)
        print(f"counting {cfg.method.name}'s merged trees on the calibration split (cached in {path})",
              file=sys.stderr, flush=True)
        doc = {"format": MERGED_FORMAT, "new_tokens": n, "prompts": cfg.calibration.prompts,
               **count_merged(cfg, models, tree, n, show_progress)}
        atomic_write_json(path, doc)
    return doc


@torch.inference_mode()
def count_merged(cfg: RunConfig, models: Models, tree: Tree, n_tokens: int, show_progress: bool = True
                 ) -> dict[str, Any]:
    """Decode the calibration prompts with ``cfg``'s drafter built on ``tree``: the size of the union it
    holds, and the mean nodes of the merged trees it proposed (root included) and per depth, over the steps
    with room for the whole tree."""
    w = cfg.workload
    sampling = SamplingParams(w.temperature, w.top_k, w.top_p)
    prompts = calibration_prompts(cfg, models.tokenizer, n_tokens)
    drafter = build_drafter(cfg.method, tree, models, sampling, tree_cfg=cfg.tree)
    recorder = SizeRecorder(drafter, drafter.tree.depth)
    target = ModelEngine(models.target)
    opts = DecodeOptions.for_method(cfg.method, sampling, n_tokens, models.tokenizer.eos_token_id)
    generator = torch.Generator(device=models.device).manual_seed(cfg.seed)
    for p in tqdm(prompts, desc=f"count {cfg.method.name} merged trees", disable=not show_progress):
        decode(target, recorder, torch.tensor(p.token_ids, dtype=torch.long), opts, generator)
    steps = sum(recorder.sizes.values())
    size = sum(k * c for k, c in recorder.sizes.items()) / steps if steps else float(tree.size)
    return {"union_size": drafter.tree.size, "steps": steps, "size": size,
            "level_sizes": recorder.level_means}


def with_merged(profile: Profile, doc: dict[str, Any] | None) -> Profile:
    """``profile`` with the counted merged trees in its extra (``merged_counted``: profiles.merged_size reads
    it for the union it was counted on)."""
    if not doc:
        return profile
    return replace(profile, extra={**profile.extra, "merged_counted": {"union_size": int(doc["union_size"]),
                                                                       "size": float(doc["size"]),
                                                                       "steps": int(doc["steps"])}})
