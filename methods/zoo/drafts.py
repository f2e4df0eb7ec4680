"""More draft models q for a built zoo (p = target): boost-tuned drafts for SpecInfer, a prose-only draft for
Online speculative decoding. Cached beside the zoo and keyed like it.

``boost`` — SpecInfer's collective boost-tuning (Miao et al. 2024, section 3): draft k+1 is trained on the
training examples that drafts 1..k together predict worst, so the drafts cover each other's gaps. An example
is a window of the zoo's training stream; it is covered at a position when some earlier draft's greedy token
equals the target's; the least-covered ``keep_fraction`` of a pool of windows is the next draft's data.
As in SpecInfer, each new draft is the pre-trained small model (the zoo's draft) fine-tuned on the uncovered
examples — here ``boost_steps`` steps of the zoo draft's recipe (distillation from p), well within the
zoo's time budget per draft (its 800 steps).

``prose`` — the zoo draft's recipe on the prose documents only (a draft weak on code: Online SD's start).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from methods.core.bf16 import bf16_is_fast
from methods.zoo.build import ZooConfig, ZooPaths, _file_lock, _limit, _log, cache_root, ensure_zoo, zoo_key
from methods.zoo.train import Packed, new_model, pack, train_lm, windows_at

DRAFTS_FORMAT = 1  # bump when the recipe changes: cached drafts of older formats are not reused


@dataclass(frozen=True)
class ExtraDrafts:
    kind: str  # boost | prose
    count: int = 2  # boost: drafts trained after the zoo's own (which is draft 0); prose: 1
    pool_windows: int = 512  # boost: candidate examples (windows of the stream) scored per round
    boost_steps: int = 200  # boost: fine-tuning steps of each new draft (the zoo draft trains 800)
    # prose: training steps from scratch (the zoo draft's 800 took 40 min on the loaded machine of the first
    # build; 250 keep it a draft of prose, weak on code, in a quarter of that)
    prose_steps: int = 250
    window: int = 0  # boost: example length in tokens; 0 = the zoo's training window
    keep_fraction: float = 0.4  # boost: least-covered share of the pool kept for the next draft

    def __post_init__(self) -> None:
        assert self.kind in ("boost", "prose"), f"unknown extra drafts {self.kind!r}: boost | prose"

    def key_fields(self) -> dict:
        """What the build depends on: the other kind's knobs are left out."""
        out = dataclasses.asdict(self)
        del out["prose_steps" if self.kind == "boost" else "boost_steps"]
        return out


def drafts_dir(zoo: ZooConfig, spec: ExtraDrafts, cache: Path | None = None) -> Path:
    blob = json.dumps({"zoo": zoo_key(zoo), "spec": spec.key_fields(), "format": DRAFTS_FORMAT},
                      sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return (cache or cache_root()) / "zoo_drafts" / f"{zoo.name}-{spec.kind}-{key}"


def ensure_drafts(zoo: ZooConfig, spec: ExtraDrafts, cache: Path | None = None) -> list[Path]:
    """Checkpoint dirs of the extra drafts (boost: the new ones, without the zoo's draft), built on first use
    under a file lock, in a temp dir renamed into place when complete."""
    final = drafts_dir(zoo, spec, cache)
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(final.parent / f"{final.name}.lock"):
            if not final.is_dir():
                for stale in final.parent.glob(f"{final.name}.tmp-*"):  # a killed build's (we hold the lock)
                    shutil.rmtree(stale, ignore_errors=True)
                tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
                try:
                    with torch.inference_mode(False), torch.enable_grad():  # callers may be in inference
                        _build(zoo, spec, ensure_zoo(zoo, cache), tmp)
                    os.rename(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
    report = json.loads((final / "report.json").read_text())
    return [final / d for d in report["drafts"]]


def _build(zoo: ZooConfig, spec: ExtraDrafts, paths: ZooPaths, out: Path) -> None:
    from methods.models import _pretrained, _tokenizer

    t0 = time.perf_counter()
    tokenizer = _tokenizer(str(paths.tokenizer_dir))
    target = _pretrained(str(paths.target_dir)).eval()
    stream = training_stream(zoo, tokenizer, prose_only=spec.kind == "prose")
    report: dict = {"kind": spec.kind, "spec": dataclasses.asdict(spec), "zoo": zoo_key(zoo), "drafts": [],
                    "rounds": []}
    if spec.kind == "prose":
        model, info = _train_draft(zoo, stream, target, seed=zoo.seed + 101, label="prose draft",
                                   steps=spec.prose_steps)
        _save(model, tokenizer, out / "draft_prose", report, info)
    else:
        drafts = [_pretrained(str(paths.draft_dir)).eval()]
        pool = _pool(stream, spec, zoo)
        best = _greedy(target, pool)  # (P, T-1) the target's greedy next tokens
        for k in range(1, spec.count + 1):
            data, rnd = _hardest(pool, best, drafts, spec)
            model, info = _train_draft(zoo, data, target, seed=zoo.seed + 100 + k, label=f"boost draft {k}",
                                       start=(drafts[0], spec.boost_steps))
            drafts.append(model)
            _save(model, tokenizer, out / f"draft_boost{k}", report, {**info, **rnd})
        report["coverage_after"] = float(_covered(pool, best, drafts).float().mean())
    report["seconds"] = time.perf_counter() - t0
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")


def training_stream(zoo: ZooConfig, tokenizer, prose_only: bool = False) -> Packed:
    """The zoo's training stream rebuilt with its tokenizer (code and prose documents of the train split,
    as methods.zoo.build packs them), or its prose documents alone."""
    from methods.data.corpus import corpus
    from methods.zoo.tokenizer import encode_documents

    docs = _limit(corpus("train"), zoo.max_train_chars)
    modules = {d.module for d in docs}
    with_prose = zoo.train_prose or prose_only
    prose = [d.text for d in corpus("train", "prose") if d.module in modules] if with_prose else []
    texts = prose if prose_only else [d.text for d in docs] + prose
    flags = [True] * len(texts) if prose_only else [i >= len(docs) for i in range(len(texts))]
    return pack(encode_documents(tokenizer, texts), tokenizer.eos_token_id,
                torch.Generator().manual_seed(zoo.seed), flags)


def _pool(stream: Packed, spec: ExtraDrafts, zoo: ZooConfig) -> Packed:
    """``pool_windows`` windows of the stream (the examples), as a (P, window) Packed."""
    g = torch.Generator().manual_seed(zoo.seed + 7)
    n = spec.window or zoo.windows.seq_len
    starts = torch.randint(0, len(stream) - n, (spec.pool_windows,), generator=g).tolist()
    return Packed(windows_at(stream.tokens, starts, n), windows_at(stream.prose, starts, n))


@torch.inference_mode()
def _greedy(model, pool: Packed, batch: int = 16) -> torch.Tensor:
    """Greedy next token at every position of every window. (P, T-1)"""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_is_fast()):
        return torch.cat([model(input_ids=x).logits[:, :-1].argmax(-1) for x in pool.tokens.split(batch)])


def _covered(pool: Packed, best: torch.Tensor, drafts: list) -> torch.Tensor:
    """(P, T-1) bool: some draft's greedy token equals the target's."""
    hit = torch.zeros_like(best, dtype=torch.bool)
    for d in drafts:
        hit |= _greedy(d, pool) == best
    return hit


def _hardest(pool: Packed, best: torch.Tensor, drafts: list, spec: ExtraDrafts) -> tuple[Packed, dict]:
    """The least-covered windows (collective boost-tuning's uncovered examples) packed into a stream,
    each preceded by eos like a document; and the round's figures."""
    cover = _covered(pool, best, drafts).float().mean(1)  # (P,)
    n = max(1, round(spec.keep_fraction * len(cover)))
    keep = cover.argsort()[:n]
    sep = torch.full((n, 1), -1, dtype=torch.long)  # becomes eos in _train_draft
    tokens = torch.cat([sep, pool.tokens[keep]], 1)
    prose = torch.cat([torch.zeros(n, 1, dtype=torch.bool), pool.prose[keep]], 1)
    rnd = {"pool_coverage": float(cover.mean()), "kept_coverage": float(cover[keep].mean()), "kept": n}
    return Packed(tokens.flatten(), prose.flatten()), rnd


def _train_draft(zoo: ZooConfig, stream: Packed, teacher, seed: int, label: str,
                 start: tuple | None = None, steps: int = 0) -> tuple:
    """The zoo draft's recipe (architecture, steps, distillation from p) on ``stream``: from scratch, or
    ``start`` = (a model to fine-tune a copy of, steps); ``steps`` > 0 caps the recipe's steps."""
    eos = teacher.config.eos_token_id
    tokens = torch.where(stream.tokens < 0, eos, stream.tokens)  # separators of _hardest: eos
    stream = Packed(tokens, stream.prose)
    spec = zoo.draft if not steps else dataclasses.replace(zoo.draft, steps=min(steps, zoo.draft.steps),
                                                           warmup=min(zoo.draft.warmup, steps // 8))
    if start is None:
        model = new_model(spec, teacher.config.vocab_size, eos, zoo.max_positions, seed)
    else:
        model, steps = copy.deepcopy(start[0]).float().train(), start[1]
        spec = dataclasses.replace(spec, steps=steps, warmup=min(spec.warmup, steps // 10))
    res = train_lm(model, spec, stream, zoo.windows, seed, teacher=teacher, label=label)
    model.generation_config.pad_token_id = eos
    _log(f"zoo {zoo.name}: {label} trained in {res.seconds:.0f} s (loss {res.final_loss:.3f})")
    return model.eval(), {"seconds": res.seconds, "final_train_loss": res.final_loss,
                          "train_tokens": len(stream)}


def _save(model, tokenizer, where: Path, report: dict, info: dict) -> None:
    model.save_pretrained(str(where))
    tokenizer.save_pretrained(str(where))
    report["drafts"].append(where.name)
    report["rounds"].append({"draft": where.name, **info})


def zoo_of(model) -> ZooConfig | None:
    """The zoo preset a loaded model belongs to, from the checkpoint dir it was loaded from
    (``<cache>/zoo/<name>-<key>/<role>``), when that key is the preset's as this machine builds it (a
    float32-trained zoo where bf16 is slow: ``build.preset``); else None."""
    from methods.zoo.build import PRESETS, preset

    where = Path(getattr(model.config, "_name_or_path", "") or "")
    name, _, key = where.parent.name.rpartition("-")
    cfg = preset(name) if name in PRESETS else None
    return cfg if cfg is not None and zoo_key(cfg) == key else None
