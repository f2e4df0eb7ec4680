"""The Hugging Face transformers side of benchmarks/vs_transformers.py: ``generate`` as a user would set it up
to be fast, one configuration per path (p = target, q = draft; greedy throughout).

- plain: ``generate(do_sample=False)`` (dynamic KV cache, eager forward) — the reference output.
- static cache: ``cache_implementation="static"`` (preallocated KV, fixed shapes).
- torch.compile: transformers' own compiled decode step (static cache + ``compile_config``; on CPU its
  ``_compile_all_devices`` flag, which transformers keeps for exactly this), and the user-level recipe of its
  docs, ``model.forward = torch.compile(model.forward)`` (with the dynamic cache and with the static one).
- assisted generation (Leviathan et al. 2023) with q: transformers' defaults (the "heuristic" schedule:
  start at 20 draft tokens, +2 after a fully accepted step, -1 otherwise, the count persisting across calls;
  drafting stops below a draft confidence of 0.4), and a constant γ with no confidence stop (specsim's chain).
- prompt lookup (Saxena 2023): ``prompt_lookup_num_tokens=k``, ``max_matching_ngram_size=m``.

A configuration that raises on its first call (an unsupported combination, a compiler missing) is dropped and
reported with its error; the rest of the benchmark goes on.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.harness import BenchPath, Output

HF_GREEDY, HF_ASSISTED, HF_PLD = "hf greedy", "hf assisted", "hf prompt_lookup"
ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


@dataclass
class HFConfig:
    """One way of calling ``generate``: its keyword arguments, how the forward is compiled, and (assisted
    generation) the assistant's settings, which transformers reads from q's own generation_config."""

    name: str
    kwargs: dict = field(default_factory=dict)
    compile: str | None = None  # None | "hf" (transformers' compiled decode step) | "forward" (model.forward)
    assistant: dict | None = None  # ASSISTANT_KEYS -> value (None: transformers' default) when q drafts


def configurations(args, has_draft: bool) -> list[HFConfig]:
    """The HF paths of the benchmark, plain greedy first (the reference). ``args.hf_compile`` picks the
    compiled ones (``off`` skips them: each compiles for tens of seconds on first use)."""
    static = {"cache_implementation": "static"}
    out = [HFConfig(HF_GREEDY), HFConfig(f"{HF_GREEDY} static", static)]
    if args.hf_compile in ("hf", "all"):
        out.append(HFConfig(f"{HF_GREEDY} static+compile", static, compile="hf"))
    if args.hf_compile in ("forward", "all"):
        out.append(HFConfig(f"{HF_GREEDY} compiled forward", compile="forward"))
        out.append(HFConfig(f"{HF_GREEDY} static+compiled forward", static, compile="forward"))
    if has_draft:
        constant = {"num_assistant_tokens": args.gamma, "num_assistant_tokens_schedule": "constant",
                    "assistant_confidence_threshold": 0.0}
        out.append(HFConfig(f"{HF_ASSISTED} chain g={args.gamma}", assistant=constant))
        out.append(HFConfig(f"{HF_ASSISTED} default (heuristic)", assistant=dict.fromkeys(ASSISTANT_KEYS)))
        # what a user would try next; transformers 5 refuses it (reported under the table, not timed)
        out.append(HFConfig(f"{HF_ASSISTED} chain g={args.gamma} static", static, assistant=constant))
    out.append(HFConfig(f"{HF_PLD} g={args.pld_tokens} n<={args.ngram}", {
        "prompt_lookup_num_tokens": args.pld_tokens, "max_matching_ngram_size": args.ngram}))
    return out


def hf_path(config: HFConfig, models, max_new: int) -> BenchPath:
    """HF ``generate``: greedy, the tokenizer's EOS, no minimum length — it stops only where specsim does."""
    tok = models.tokenizer
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    kwargs = dict(max_new_tokens=max_new, min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=eos,
                  pad_token_id=pad, temperature=None, top_p=None, top_k=None, **config.kwargs)
    target, draft = models.target, models.draft
    if config.assistant is not None:
        kwargs["assistant_model"] = draft
    if config.compile == "hf" and target.device.type == "cpu":  # elsewhere transformers compiles by itself
        kwargs["compile_config"] = _cpu_compile_config()
    forward = torch.compile(target.forward) if config.compile == "forward" else None
    state = dict(config.assistant or {})  # this path's assistant settings, persisted γ included

    @torch.inference_mode()
    def run(ids: torch.Tensor) -> Output:
        ids = ids.to(models.device)[None]  # (1, T)
        with _swapped(draft, state), _forward(target, forward):
            out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return Output(out[0, ids.shape[1]:].tolist(), 0)

    return BenchPath(config.name, run, hf=True)


def _cpu_compile_config():
    """transformers compiles its decode step on CUDA-like devices only, unless the CompileConfig carries its
    ``_compile_all_devices`` flag. Mode "default": "reduce-overhead" means CUDA graphs, absent on CPU."""
    from transformers import CompileConfig

    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    return config


class _swapped:
    """q's generation_config holds the assistant settings of the path that runs now; on exit the settings
    transformers changed (the heuristic schedule persists its γ on q) go back into that path's state, so that
    each assisted path sees only its own history, as a user running that one configuration would."""

    def __init__(self, draft, state: dict):
        self.draft, self.state = draft, state

    def __enter__(self):
        if self.state:
            gc = self.draft.generation_config
            self.saved = {k: getattr(gc, k) for k in ASSISTANT_KEYS}
            for k, v in self.state.items():
                setattr(gc, k, v)

    def __exit__(self, *exc):
        if self.state:
            gc = self.draft.generation_config
            self.state.update({k: getattr(gc, k) for k in ASSISTANT_KEYS})
            for k, v in self.saved.items():
                setattr(gc, k, v)


class _forward:
    """``model.forward = compiled`` for the duration of one call (the recipe of transformers' docs), without
    leaving the compiled forward in place for the other paths."""

    def __init__(self, model: torch.nn.Module, compiled: Callable | None):
        self.model, self.compiled = model, compiled

    def __enter__(self):
        if self.compiled is not None:
            self.model.forward = self.compiled

    def __exit__(self, *exc):
        if self.compiled is not None:
            del self.model.forward  # the instance attribute: the class's forward shows through again


def working_paths(configs: list[HFConfig], models, max_new: int, probe: torch.Tensor
                  ) -> tuple[list[BenchPath], dict[str, str]]:
    """The paths of the configurations whose first call (on ``probe``) succeeds, and for the others the error
    (type, message and the innermost frame), so the report can say which failed and why."""
    paths, failed = [], {}
    for config in configs:
        path = hf_path(config, models, max_new)
        try:
            path.run(probe)
        except Exception as e:  # noqa: BLE001 — any failure of a configuration is a result to report
            frame = traceback.extract_tb(e.__traceback__)[-1]
            where = f"{frame.filename}:{frame.lineno}"
            failed[config.name] = f"{type(e).__name__}: {str(e).strip()[:400]} ({where})"
            continue
        paths.append(path)
    if not paths or paths[0].name != HF_GREEDY:
        raise RuntimeError(f"plain HF greedy failed: {failed.get(HF_GREEDY)}")
    return paths, failed
