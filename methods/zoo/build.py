"""Zoo presets and the cached build: tokenizer + target p + draft q + quality report, built on first use.

A zoo is keyed by a hash of its preset (dims, steps, seed, …), the corpus version and the Python version
(the corpus is this interpreter's stdlib). It is built into a temp dir beside its final place and renamed
when complete (atomic), under a file lock so concurrent processes build it once. Cache root: $SPECSIM_CACHE,
else ~/.cache/specsim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from methods.zoo.train import ModelSpec, SequenceUnlikelihood, Windows
from specsim.io import cache_root as specsim_cache_root

# bump when the build changes so that old caches must not be reused (2: bf16 teacher copy; 3: eager attention
# and fused AdamW while training, greedy decoding of the report by methods.zoo.greedy)
ZOO_FORMAT = 3


@dataclass(frozen=True)
class ZooConfig:
    """A zoo preset: corpus/tokenizer, target p, draft q, and what the quality report measures."""

    name: str
    target: ModelSpec
    draft: ModelSpec
    vocab_size: int = 4096
    # training windows: 256 tokens, the last 20% of steps 512 — prompts + continuations (the grounded
    # workload: 384 + 64) must stay within trained positions; RoPE does not extrapolate reliably
    windows: Windows = Windows(seq_len=256, long_seq_len=512, long_fraction=0.2)
    max_positions: int = 1024
    seed: int = 0
    max_train_chars: int = 0  # 0 = the whole train split
    # also train on the split's prose documents (docstring/comment English as standalone text): the prose
    # workload's format; without it the target answered prose prompts with '#' comment-header loops
    train_prose: bool = True
    eval_tokens: int = 32768  # held-out tokens per text kind for perplexity and agreement
    loop_prompts: int = 48  # test prompts per workload kind for the loop rate
    # (kind, prompt_tokens) of the loop-rate workloads; grounded prompts must hold a whole function
    loop_workloads: tuple[tuple[str, int], ...] = (("code", 128), ("prose", 128), ("grounded", 384))
    loop_new_tokens: int = 64
    tn_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    tn_context: int = 256


PRESETS: dict[str, ZooConfig] = {
    # Sized per issue 4: a 6x384 target (13.8M params with untied embeddings, vocab 4096) is the largest
    # trainable to usefulness in minutes on 2 cores. In minutes of training every model is still in its
    # n-gram phase, where a 1x128 model trained on data keeps up with the 6x384 one (held-out code ppl 64 vs
    # 71 in a trial): the draft learns the target's distribution instead, as a draft should (greedy α 0.48 →
    # 0.69 on held-out code).
    # Repetition loops (greedy, 64 new tokens, 48 test prompts per kind: code / prose / grounded), same seed:
    # data only, 1650 / 900 steps: 5 / 21 / 1, held-out ppl code 69.2, prose 117.4 — and such counts flip
    # between builds (1400 / 1000 steps: code 7/16, prose 0/16; 1500 / 800: 8/16, 15/16). Token-level
    # unlikelihood on prose (negatives: the last 32 tokens, weight 2): 7 / 11 / 1, ppl 72.7 / 137.4; with the
    # whole window as negatives: 8 / 0 / 13 (it unlearnt copying). Sequence-level unlikelihood on its own
    # greedy text (Welleck et al. 2020): 40 fine-tuning steps of that last target on prose + code rollouts,
    # two seeds: 1 / 1 / 0 and 0 / 1 / 0, against 28 / 3 / 10 and 8 / 17 / 6 for the same fine-tuning
    # without the rollouts; in training, the last 60 of 1650 steps: 0 / 0 / 0, ppl 69.7 / 121.1 (built in
    # 642 s); the last 50, 1650 / 900: 1 / 0 / 1, ppl 70.6 / 121.0 (598 s); this preset, 1500 / 800:
    # 3 / 1 / 1, ppl 71.6 / 125.3, greedy α 0.683 (code), built in 514 s (target 388, draft 76, report 41;
    # 0.23-0.28 s per target step on this shared machine, depending on the hour).
    "default": ZooConfig(
        name="default",
        target=ModelSpec(n_layers=6, hidden_size=384, n_heads=6, intermediate_size=1024, steps=1500,
                         batch_size=4, lr=2e-3, warmup=100,
                         sequence_unlikelihood=SequenceUnlikelihood(weight=1.0, steps=50)),
        draft=ModelSpec(n_layers=1, hidden_size=128, n_heads=4, intermediate_size=256, steps=800,
                        batch_size=4, lr=3e-3, warmup=100, distill=1.0),
    ),
    # For tests: same code paths, tiny dims and a slice of the corpus; builds in seconds. Vocabulary and
    # positions as conf/model/micro.yaml (the simulator's view of it).
    "micro": ZooConfig(
        name="micro",
        target=ModelSpec(n_layers=2, hidden_size=64, n_heads=2, intermediate_size=128, steps=40,
                         batch_size=8, lr=3e-3, warmup=5, train_dtype="float32",
                         sequence_unlikelihood=SequenceUnlikelihood(weight=1.0, steps=4, batch=2, prefix=16,
                                                                    new_tokens=8)),
        draft=ModelSpec(n_layers=1, hidden_size=32, n_heads=2, intermediate_size=64, steps=30,
                        batch_size=8, lr=3e-3, warmup=5, train_dtype="float32", distill=0.5),
        vocab_size=4096,
        windows=Windows(seq_len=64),
        max_positions=512,
        max_train_chars=300_000,
        eval_tokens=1024,
        loop_prompts=2,
        loop_workloads=(("code", 32), ("prose", 32)),
        loop_new_tokens=40,
        tn_sizes=(1, 4),
        tn_context=32,
    ),
}


@dataclass(frozen=True)
class ZooPaths:
    root: Path
    target_dir: Path
    draft_dir: Path
    tokenizer_dir: Path
    report_path: Path

    @classmethod
    def under(cls, root: Path) -> ZooPaths:
        return cls(root, root / "target", root / "draft", root / "tokenizer", root / "report.json")


def preset(name: str) -> ZooConfig:
    """The preset as this machine builds it: a role's bf16 training autocast becomes float32 where bf16
    products are slow here (``methods.core.bf16``), and the key follows (a float32-trained zoo is another
    zoo)."""
    if name not in PRESETS:
        raise ValueError(f"unknown zoo {name!r}; presets: {', '.join(PRESETS)}")
    return for_this_machine(PRESETS[name])


def for_this_machine(cfg: ZooConfig) -> ZooConfig:
    """``cfg`` with each role's ``train_dtype`` passed through ``methods.core.bf16.speed_dtype``."""
    from methods.core.bf16 import speed_dtype

    roles = {role: dataclasses.replace(spec, train_dtype=speed_dtype(spec.train_dtype))
             for role, spec in (("target", cfg.target), ("draft", cfg.draft))}
    return dataclasses.replace(cfg, **roles)


def cache_root() -> Path:
    return specsim_cache_root()


# ModelSpec fields added after zoos were cached: (field, whether a spec uses it); unused, they are left
# out of the hash so that older keys stay valid
_LATER_OPTIONS = (
    ("unlikelihood", lambda spec: spec["unlikelihood"]),
    ("unlikelihood_window", lambda spec: spec["unlikelihood"]),
    ("sequence_unlikelihood", lambda spec: spec["sequence_unlikelihood"]["weight"]),
)


def zoo_key(cfg: ZooConfig) -> str:
    """Hash of everything that determines the built zoo."""
    from methods.data.corpus import CORPUS_VERSION

    zoo = dataclasses.asdict(cfg)
    for role in ("target", "draft"):
        unused = [name for name, used in _LATER_OPTIONS if not used(zoo[role])]
        for name in unused:
            del zoo[role][name]
    blob = json.dumps(
        {"zoo": zoo, "corpus": CORPUS_VERSION, "format": ZOO_FORMAT,
         "python": sys.version.split()[0]},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def zoo_dir(cfg: ZooConfig, cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "zoo" / f"{cfg.name}-{zoo_key(cfg)}"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # blocks while another process builds the same zoo
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_zoo(name: str | ZooConfig = "default", cache: Path | None = None) -> ZooPaths:
    """Paths of a built zoo, building it first if no complete build is cached (the final dir exists only
    once complete: it is renamed into place)."""
    cfg = preset(name) if isinstance(name, str) else name
    final = zoo_dir(cfg, cache)
    if final.is_dir():
        return ZooPaths.under(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f"{final.name}.lock"):
        if final.is_dir():  # another process finished it while we waited
            return ZooPaths.under(final)
        for stale in final.parent.glob(f"{final.name}.tmp-*"):  # left by a killed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
        try:
            build_zoo(cfg, tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return ZooPaths.under(final)


def build_zoo(cfg: ZooConfig, out: Path) -> dict:
    """Build every artefact of ``cfg`` into ``out``; returns the report (also written to report.json)."""
    import torch

    from methods.zoo.quality import zoo_report

    paths = ZooPaths.under(out)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    tokenizer, stream, n_modules = _tokenize(cfg, paths)
    timings = {"tokenizer_and_encode": time.perf_counter() - t_start}
    models, train_info = {}, {}
    for i, (role, spec, where) in enumerate((("target", cfg.target, paths.target_dir),
                                             ("draft", cfg.draft, paths.draft_dir))):
        teacher = models["target"] if spec.distill else None  # the draft may learn from the target p
        models[role], train_info[role] = _train_one(cfg, (role, spec, cfg.seed + 1 + i), stream, tokenizer,
                                                    teacher)
        models[role].save_pretrained(str(where))
        tokenizer.save_pretrained(str(where))
        timings[role] = train_info[role]["seconds"]
    t = time.perf_counter()
    report = zoo_report(cfg, models["target"], models["draft"], tokenizer)
    timings["report"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t_start
    report.update(zoo=cfg.name, key=zoo_key(cfg), config=dataclasses.asdict(cfg), train=train_info,
                  build_seconds=timings, corpus={"train_modules": n_modules, "train_tokens": len(stream)},
                  machine={"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                           "loadavg_1min_start": load_start, "loadavg_1min_end": os.getloadavg()[0]})
    paths.report_path.write_text(json.dumps(report, indent=2) + "\n")
    (out / "zoo_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    _log(f"zoo {cfg.name}: built in {timings['total']:.0f} s")
    return report


def _tokenize(cfg: ZooConfig, paths: ZooPaths):
    """Train and save the tokenizer on the train split's code; pack the training stream (code, plus the
    split's prose documents when ``cfg.train_prose``). Returns (tokenizer, Packed stream, modules)."""
    import torch

    from methods.data.corpus import corpus
    from methods.zoo.tokenizer import encode_documents, save_tokenizer, train_tokenizer
    from methods.zoo.train import pack

    docs = _limit(corpus("train"), cfg.max_train_chars)
    texts = [d.text for d in docs]
    _log(f"zoo {cfg.name}: tokenizer on {len(docs)} train modules ({sum(map(len, texts)) / 1e6:.1f} MB)")
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    save_tokenizer(tokenizer, paths.tokenizer_dir)
    n_code = len(texts)
    if cfg.train_prose:
        modules = {d.module for d in docs}
        texts += [d.text for d in corpus("train", "prose") if d.module in modules]
    prose = [i >= n_code for i in range(len(texts))]
    stream = pack(encode_documents(tokenizer, texts), tokenizer.eos_token_id,
                  torch.Generator().manual_seed(cfg.seed), prose)
    return tokenizer, stream, len(docs)


def _train_one(cfg: ZooConfig, job: tuple, stream, tokenizer, teacher) -> tuple:
    """Train one model; job = (role, ModelSpec, seed). Returns (model, its training record)."""
    from methods.zoo.train import n_params, new_model, train_lm

    role, spec, seed = job
    eos = tokenizer.eos_token_id
    model = new_model(spec, len(tokenizer), eos, cfg.max_positions, seed)
    shapes = [cfg.windows.at(s, spec.steps, spec.batch_size) for s in range(spec.steps)]
    tokens = sum(b * t for b, t in shapes)
    how = f", distilled from the target (w={spec.distill})" if teacher else ""
    _log(f"zoo {cfg.name}: {role} {n_params(model) / 1e6:.2f}M params, {spec.steps} steps, "
         f"{tokens / 1e6:.2f}M tokens{how}")
    res = train_lm(model, spec, stream, cfg.windows, seed, teacher=teacher, label=role)
    model.generation_config.pad_token_id = eos
    info = {"params": n_params(model), "steps": spec.steps, "tokens": tokens, "distill": spec.distill,
            "final_train_loss": res.final_loss, "seconds": res.seconds, "tokens_per_s": tokens / res.seconds}
    if res.rollout_repeats:  # how loopy the model's own greedy text was when the phase began, and at its end
        r, k = res.rollout_repeats, max(1, len(res.rollout_repeats) // 5)
        info["rollout_repeats"] = {"first": sum(r[:k]) / k, "last": sum(r[-k:]) / k, "steps": len(r)}
    return model, info


def _limit(docs: list, max_chars: int) -> list:
    """The first documents (sorted by module) up to ``max_chars`` characters; all when max_chars == 0."""
    if not max_chars:
        return docs
    out, total = [], 0
    for d in docs:
        if total >= max_chars:
            break
        out.append(d)
        total += len(d.text)
    return out


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
