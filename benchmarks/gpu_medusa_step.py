"""Medusa-1's reference step beside its own autoregressive token, timed on one host: the split the published
Medusa rows lack (docs/published.md, "Medusa-1, every row still high": the answer files time the whole step,
and pricing it needs one profiled Medusa step and one baseline token on a GPU host, with the host time and
kernel count of each).

The step is Medusa's own code, not ours: ``--medusa-path`` names a checkout of FasterDecoding/Medusa (the
published MT-bench answers were made at 10a2697) that the user supplies; nothing is downloaded, and the
checkout is never part of this repository. The loops below call its inference functions in the order of its
``llm_judge/gen_model_answer_medusa.py`` (candidates, tree decoding, posterior, update, the end-of-sequence
check on the host) and of its ``gen_model_answer_baseline.py`` (one token per forward of the same KV model,
the same check): the two loops the published speedups divide. The model is a random-init Llama of a real shape
(``--models``: ``conf/model`` presets, float16 on CUDA) with Medusa's 4 heads of one ResBlock each and its
``mc_sim_7b_63`` tree; random heads accept few tokens, so the figures are per step and per token, not a τ.

Per model, one JSON line: the wall time per step and per baseline token (a whole generation timed as the
answer files time it, divided by its steps), their ratio (the published rows imply 1.25-1.37x), the wall time
of each part of a step (synchronised after each part, in a separate pass), and from one profiled step and one
profiled token the kernels launched and the device's busy time. On a machine without CUDA it runs tiny shapes
on the CPU (kernels are then the top-level aten ops): the smoke test.

    python benchmarks/gpu_medusa_step.py --medusa-path MEDUSA --transformers-path HF434 --models llama2_7b
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_forward import build, shape_of, top_level_ops, trace_counts  # noqa: E402

PARTS = ("candidates", "tree_forward", "posterior", "update", "eos_check")


def medusa_api(path: Path) -> dict[str, Any]:
    """The functions and classes of a Medusa checkout (its ``medusa`` package), the hub left untouched: the
    heads' constructor loads a tokenizer by name, which the loops never use."""
    if not (path / "medusa" / "model" / "utils.py").exists():
        raise SystemExit(f"{path} holds no medusa/model/utils.py: not a FasterDecoding/Medusa checkout")
    sys.path.insert(0, str(path))
    import medusa.model.medusa_model as mm
    from medusa.model import kv_cache, utils
    from medusa.model.medusa_choices import mc_sim_7b_63

    mm.AutoTokenizer.from_pretrained = staticmethod(lambda *a, **k: None)
    return {"Model": mm.MedusaModel, "Llama": mm.KVLlamaForCausalLM, "u": utils,
            "kv": kv_cache.initialize_past_key_values, "tree": mc_sim_7b_63}


class Clock:
    """Wall time of named parts, synchronising the device after each part when ``split`` (else untouched)."""

    def __init__(self, sync: Any, split: bool):
        self.sync, self.split, self.parts = sync, split, {p: [] for p in PARTS}
        self.t = 0.0

    def start(self) -> None:
        if self.split:
            self.sync()
            self.t = time.perf_counter()

    def lap(self, part: str) -> None:
        if self.split:
            self.sync()
            now = time.perf_counter()
            self.parts[part].append(now - self.t)
            self.t = now


def medusa_start(api: dict[str, Any], model: Any, prompt: Any) -> dict[str, Any]:
    """A Medusa generation's start (its cache emptied, the prompt prefilled): the state its steps carry."""
    u, buffers = api["u"], model.medusa_buffers
    model.current_length_data.zero_()
    u.reset_medusa_mode(model)
    medusa_logits, logits = u.initialize_medusa(prompt, model, buffers["medusa_attn_mask"],
                                                model.past_key_values)
    return {"medusa_logits": medusa_logits, "logits": logits, "input_ids": prompt.clone(), "new_token": 0,
            "start": prompt.shape[1]}


def medusa_step(api: dict[str, Any], model: Any, state: dict[str, Any], eos: int, clock: Clock) -> None:
    """One step of Medusa's greedy loop, in its answer script's order of calls (``state`` advanced)."""
    u, buffers = api["u"], model.medusa_buffers
    clock.start()
    candidates, tree_candidates = u.generate_candidates(
        state["medusa_logits"], state["logits"], buffers["tree_indices"], buffers["retrieve_indices"])
    clock.lap("candidates")
    medusa_logits, logits, outputs = u.tree_decoding(
        model, tree_candidates, model.past_key_values, buffers["medusa_position_ids"], state["input_ids"],
        buffers["retrieve_indices"])
    clock.lap("tree_forward")
    best, accept = u.evaluate_posterior(logits, candidates, 0.0, 0.09, 0.3)
    clock.lap("posterior")
    updated = u.update_inference_inputs(
        state["input_ids"], candidates, best, accept, buffers["retrieve_indices"], outputs, logits,
        medusa_logits, state["new_token"], model.past_key_values_data, model.current_length_data)
    state["input_ids"], state["logits"], state["medusa_logits"], state["new_token"] = updated
    clock.lap("update")
    _ = eos in state["input_ids"][0, state["start"]:].tolist()  # the answer script's stop test: a sync
    clock.lap("eos_check")


def medusa_generation(api: dict[str, Any], model: Any, prompt: Any, steps: int, eos: int,
                      clock: Clock) -> tuple[int, int]:
    """Medusa's greedy loop for ``steps`` steps: (steps, tokens)."""
    state = medusa_start(api, model, prompt)
    for _ in range(steps):
        medusa_step(api, model, state, eos, clock)
    return steps, int(state["input_ids"].shape[1] - state["start"])


def baseline_start(api: dict[str, Any], model: Any, prompt: Any) -> dict[str, Any]:
    """The baseline's start on the same KV model (its cache emptied, the prompt prefilled)."""
    model.current_length_data.zero_()
    api["u"].reset_medusa_mode(model)
    out = model.base_model(prompt, past_key_values=model.past_key_values, use_cache=True)
    return {"out": out, "input_ids": prompt.clone(), "start": prompt.shape[1]}


def baseline_token(model: Any, state: dict[str, Any], eos: int) -> None:
    """One token of the baseline answer script's loop: one greedy token per forward, the same stop test."""
    import torch

    token = state["out"].logits[:, -1:].argmax(dim=-1)
    state["out"] = model.base_model(token, use_cache=True, past_key_values=model.past_key_values)
    state["input_ids"] = torch.cat([state["input_ids"], token], dim=-1)
    _ = eos in state["input_ids"][0, state["start"]:].tolist()


def baseline_generation(api: dict[str, Any], model: Any, prompt: Any, steps: int,
                        eos: int) -> tuple[int, int]:
    """The baseline answer script's loop for ``steps`` tokens: (steps, tokens)."""
    state = baseline_start(api, model, prompt)
    for _ in range(steps):
        baseline_token(model, state, eos)
    return steps, steps


def counted(fn: Any, cuda: bool, sync: Any) -> dict[str, float]:
    """Kernels and device busy time of one call of ``fn`` (CPU: top-level aten ops, no device time)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        sync()
    if cuda:
        return trace_counts(prof)
    top = len(top_level_ops(prof))
    return {"kernels": top, "device_ms": float("nan"), "launches": top, "syncs": 0}


def measure(api: dict[str, Any], model_name: str, shape: dict[str, int], prompt_tokens: int, steps: int,
            reps: int, eos: int) -> dict[str, Any]:
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    base = build(shape, None, device, dtype, cls=api["Llama"])
    model = api["Model"](base, 4, 1, "unused")
    model.medusa_buffers = api["u"].generate_medusa_buffers(api["tree"], device=device)
    model.past_key_values, model.past_key_values_data, model.current_length_data = api["kv"](base)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, shape["vocab_size"], (1, prompt_tokens), generator=gen).to(device)
    off = Clock(sync, split=False)
    with torch.inference_mode():
        medusa_generation(api, model, prompt, 4, eos, off)  # warm-up
        baseline_generation(api, model, prompt, 4, eos)

        def timed(run: Any) -> tuple[float, int, int]:
            sync()
            t = time.perf_counter()
            n, tokens = run()
            sync()
            return (time.perf_counter() - t) / n, n, tokens

        med, base_t, tokens = [], [], []
        for _ in range(reps):  # interleaved, as the two answer files were not
            per, _, tok = timed(lambda: medusa_generation(api, model, prompt, steps, eos, off))
            med.append(per)
            tokens.append(tok)
            base_t.append(timed(lambda: baseline_generation(api, model, prompt, steps, eos))[0])
        # (the prefill is inside each generation: both loops pay one, <1% of either at the default sizes)
        clock = Clock(sync, split=True)
        medusa_generation(api, model, prompt, steps, eos, clock)
        split = {p: 1e3 * statistics.median(v) for p, v in clock.parts.items()}
        # one profiled step and one profiled token over the prompt's context (the kernels do not depend on it)
        state = medusa_start(api, model, prompt)
        step_counts = counted(lambda: medusa_step(api, model, state, eos, off), cuda, sync)
        state = baseline_start(api, model, prompt)
        token_counts = counted(lambda: baseline_token(model, state, eos), cuda, sync)
    step_ms, token_ms = 1e3 * statistics.median(med), 1e3 * statistics.median(base_t)
    out = {"part": "medusa_step", "model": model_name, "shape": shape, "prompt_tokens": prompt_tokens,
           "steps": steps, "reps": reps, "tree_nodes": len(api["tree"]) + 1,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype),
           "transformers": transformers.__version__, "torch": torch.__version__,
           "step_ms": step_ms, "token_ms": token_ms, "step_over_token": step_ms / token_ms,
           "step_ms_all": [1e3 * x for x in med], "token_ms_all": [1e3 * x for x in base_t],
           "tokens_per_step": statistics.mean(tokens) / steps, "split_ms": split,
           "step_counts": step_counts, "token_counts": token_counts,
           "step_us_per_kernel": 1e3 * step_ms / max(step_counts["kernels"], 1),
           "token_us_per_kernel": 1e3 * token_ms / max(token_counts["kernels"], 1)}
    model = base = None
    if cuda:
        torch.cuda.empty_cache()
    return out


MAX_POSITIONS = 4096  # gpu_forward.build's max_position_embeddings: the size of Medusa's KV buffer
TINY = {"n_layers": 2, "hidden_size": 64, "n_heads": 4, "n_kv_heads": 4, "intermediate_size": 128,
        "vocab_size": 512}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--medusa-path", type=Path, required=True,
                    help="a FasterDecoding/Medusa checkout (the answers': 10a2697), user-supplied")
    ap.add_argument("--transformers-path", type=Path,
                    help="a folder holding Medusa's transformers (pip install --target), imported first")
    ap.add_argument("--models", nargs="+", default=["llama2_7b"], help="conf/model presets with a real shape")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide model instead (the smoke test)")
    ap.add_argument("--prompt", type=int, default=384, help="prompt tokens (MT-bench: ~500 in context)")
    ap.add_argument("--steps", type=int, default=256, help="steps (and baseline tokens) per timed generation")
    ap.add_argument("--reps", type=int, default=3, help="timed generations of each loop, interleaved")
    ap.add_argument("--eos", type=int, default=2, help="the id the stop test looks for (Llama's </s>)")
    ap.add_argument("--json", type=Path, help="also write each model's JSON into this folder")
    args = ap.parse_args(argv)
    if args.prompt < 1 or args.steps < 2 or args.reps < 1:
        ap.error("--prompt and --reps must be >= 1, --steps >= 2")
    if args.prompt + 5 * args.steps + 64 > MAX_POSITIONS:
        ap.error(f"--prompt + 5 x --steps + 64 must fit the {MAX_POSITIONS}-token KV buffer")
    if args.transformers_path is not None:
        assert "transformers" not in sys.modules, "transformers imported before --transformers-path"
        sys.path.insert(0, str(args.transformers_path))
    shapes = {"tiny": TINY} if args.tiny else {m: shape_of(m) for m in args.models}
    api = medusa_api(args.medusa_path)
    for name, shape in shapes.items():
        r = measure(api, name, shape, args.prompt, args.steps, args.reps, args.eos)
        line = json.dumps(r)
        print(line, flush=True)
        if args.json is not None:
            args.json.mkdir(parents=True, exist_ok=True)
            (args.json / f"medusa_step_{name}_{r['transformers']}.json").write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
