"""A LayerSkip variant of a zoo target (Elhoushi et al. 2024, "LayerSkip: Enabling Early Exit Inference and
Self-Speculative Decoding"): continued training with layer dropout and an early-exit loss, cached
like the zoo.

Notation as the paper's: L layers, l = 0..L-1. Layer dropout (continual-training form, S(t) = 1): layer l is
skipped per sequence with probability p_l = D(l)·p_max, D(l) = exp(ln 2 · l / (L-1)) - 1 (0 for the first
layer, 1 for the last: deeper layers dropped more). Early-exit loss: Σ_l ε(t, l)·CE(g(x_{l+1}), y), g = the
model's own final norm + LM head shared by every exit, ε(t, l) = C(t, l)·e(l) / Σ_i C(t, i)·e(i) with
e(l) = e_scale·Σ_{i<=l} i for l < L-1 and e(L-1) = L-1; C is the paper's *gradual* curriculum: exits are
enabled from the last layer downwards, one more every T / (2(L-1)) steps, all on for the second half.
The variant is a different model: its speedups are measured against its own autoregressive decoding.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel

from methods.core.bf16 import speed_dtype
from methods.zoo.identity import doc_key, weights_fingerprint

VERSION = 1  # bump when the recipe's code changes meaningfully (invalidates cached variants). Not computing
# the exits of zero weight left the loss and the random draws as they were: same key


@dataclass(frozen=True)
class LayerSkipRecipe:
    """Continued-training recipe. Budget: the zoo's time for one model — its target trained in 520 s of the
    zoo's 635 s quiet build (zoo report ``build_seconds``). 400 steps of 4 x 256 tokens x 0.64 s of thread CPU
    per step (1 thread; 40 steps of the curriculum timed at load ~20, ``cpu_seconds_per_step`` in the
    report) = 256 s, half of it (3324 s wall at load ~24, 8.3 s/step; 0.58 s/step quiet); held-out code:
    final-layer ppl 82.8 -> 82.6, exit after layer 2 (E=2) ppl 720 -> 154, greedy agreement with the last
    layer 0.25 -> 0.43. Only the exits the curriculum weights are computed (one LM head + cross-entropy over
    4096 tokens costs about a layer; exit 0 is never weighted): same loss, cheaper steps. Tried: 240 steps
    (574 s at load ~11, 2.4 s/step) lost quality — code final ppl 90.0, E=2 ppl 169, agreement 0.41; prose
    final 157.7 — the updates are what is scarce (methods.zoo.train); 400 steps of 4 x 128 tokens (0.30
    s/step quiet) did not finish training at load ~30-50."""

    steps: int = 400
    batch_size: int = 4
    seq_len: int = 256
    lr: float = 5e-4
    warmup: int = 20
    p_max: float = 0.2  # the paper uses 0.1-0.2 for continual pre-training
    e_scale: float = 0.2  # small: the last layer keeps about half of the loss (the target must stay good)
    train_chars: int = 3_000_000  # corpus subset tokenized for training windows
    eval_tokens: int = 16384  # held-out tokens per kind for the perplexity report
    train_dtype: str = "bfloat16"
    seed: int = 0


def drop_rates(n_layers: int, p_max: float) -> list[float]:
    """p_l = D(l)·p_max with D(l) = exp(ln 2 · l / (L-1)) - 1."""
    if n_layers == 1:
        return [0.0]
    return [(math.exp(math.log(2) * l / (n_layers - 1)) - 1) * p_max for l in range(n_layers)]


def exit_weights(n_layers: int, e_scale: float, step: int, steps: int) -> list[float]:
    """ε(t, l): the normalised early-exit loss scales under the gradual curriculum at step t."""
    last = n_layers - 1
    e = [e_scale * sum(range(l + 1)) for l in range(last)] + [float(last)]
    every = max(1, steps // (2 * max(1, last)))
    enabled_from = max(0, last - step // every)  # exits l >= enabled_from are on
    c = [float(l >= enabled_from) for l in range(n_layers)]
    total = sum(ci * ei for ci, ei in zip(c, e))
    return [ci * ei / total for ci, ei in zip(c, e)]


def exit_logits(model: PreTrainedModel, x: torch.Tensor, drop: list[float] | None = None,
                generator: torch.Generator | None = None, wanted: list[bool] | None = None
                ) -> list[torch.Tensor | None]:
    """(B, T) ids → per layer l, the logits (B, T, V) of the early exit after layer l (norm + LM head on its
    output). ``drop``: per-layer dropout rates (training): a dropped layer passes its input on. ``wanted``:
    the exits to compute (None for the others: training skips the exits its curriculum weights 0)."""
    base = model.model
    b, t = x.shape
    h = base.embed_tokens(x)
    pos = torch.arange(t, device=x.device)[None]
    emb = base.rotary_emb(h, pos)
    causal = torch.full((t, t), float("-inf"), device=x.device).triu(1)[None, None].to(h.dtype)
    outs = []
    for i, layer in enumerate(base.layers):
        out = layer(h, attention_mask=causal, position_embeddings=emb, position_ids=pos)
        if drop and drop[i] > 0:
            keep = torch.rand(b, generator=generator) >= drop[i]  # (B,) per sequence
            out = torch.where(keep.to(x.device)[:, None, None], out, h)
        h = out
        outs.append(model.lm_head(base.norm(h)) if wanted is None or wanted[i] else None)
    return outs


def fingerprint(model: PreTrainedModel) -> str:
    """Cheap identity of a model's weights (methods.zoo.identity): the first/last 2048 values of each."""
    return weights_fingerprint(model, 2048, 20)


def for_this_machine(recipe: LayerSkipRecipe) -> LayerSkipRecipe:
    """bf16 training autocast is a speed choice: float32 where bf16 products are slow here
    (``methods.core.bf16``); the variant's key follows."""
    return dataclasses.replace(recipe, train_dtype=speed_dtype(recipe.train_dtype))


def variant_dir(target: PreTrainedModel, recipe: LayerSkipRecipe, cache: Path | None = None) -> Path:
    from methods.zoo.build import cache_root

    recipe = for_this_machine(recipe)
    doc = {"v": VERSION, "target": fingerprint(target), "recipe": dataclasses.asdict(recipe)}
    key = doc_key(doc, 16)
    return (cache or cache_root()) / "layerskip" / key


def ensure_layerskip(target: PreTrainedModel, tokenizer, recipe: LayerSkipRecipe,
                     cache: Path | None = None) -> Path:
    """The cached variant's directory (``model/`` + ``report.json``), trained first when missing (under a
    file lock, into a temp dir renamed when complete: concurrent runs train it once)."""
    from methods.zoo.build import _file_lock, _log

    recipe = for_this_machine(recipe)
    final = variant_dir(target, recipe, cache)
    if final.is_dir():
        return _marked(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f"{final.name}.lock"):
        if final.is_dir():
            return _marked(final)
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
        try:
            _log(f"layerskip: continued training of the target ({recipe.steps} steps; cached in {final})")
            with torch.inference_mode(False), torch.enable_grad():  # e.g. a drafter built by a calibration
                report = build_variant(target, tokenizer, recipe, tmp)
            (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return _marked(final)


def _marked(final: Path) -> Path:
    """Leave the variant's marker (see ``is_variant``) if it is not there yet."""
    stamp = final / "fingerprint.txt"
    if not stamp.exists():
        fp = fingerprint(load_variant(final))
        marker = final.parent / "variants" / fp
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(final.name + "\n")
        stamp.write_text(fp + "\n")
    return final


def is_variant(model: PreTrainedModel, cache: Path | None = None) -> bool:
    """Whether ``model`` holds the weights of a cached variant (each build leaves a marker named by the
    variant's fingerprint)."""
    from methods.zoo.build import cache_root

    return (cache or cache_root()).joinpath("layerskip", "variants", fingerprint(model)).exists()


def load_variant(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(path / "model"), local_files_only=True,
                                                attn_implementation="sdpa")


def build_variant(target: PreTrainedModel, tokenizer, recipe: LayerSkipRecipe, out: Path) -> dict:
    """Train a copy of ``target`` (fp32 master weights), save it under out/model, return the report."""
    from methods.data.corpus import corpus
    from methods.zoo.build import _limit
    from methods.zoo.tokenizer import encode_documents
    from methods.zoo.train import ModelSpec, ThreadGovernor, lr_factor, optimizer, pack

    start = time.perf_counter()
    docs = _limit(corpus("train"), recipe.train_chars)
    gen = torch.Generator().manual_seed(recipe.seed)
    stream = pack(encode_documents(tokenizer, [d.text for d in docs]), tokenizer.eos_token_id, gen).tokens
    model = AutoModelForCausalLM.from_config(target.config, attn_implementation="sdpa")
    model.load_state_dict({k: v.float() for k, v in target.state_dict().items()})
    spec = ModelSpec(n_layers=0, hidden_size=0, n_heads=0, intermediate_size=0, steps=recipe.steps,
                     lr=recipe.lr, warmup=recipe.warmup)
    opt = optimizer(model, spec)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, recipe.warmup, recipe.steps))
    n_layers = model.config.num_hidden_layers
    drop = drop_rates(n_layers, recipe.p_max)
    losses = []
    model.train()
    data_s, train_start, cpu_start = time.perf_counter() - start, time.perf_counter(), time.thread_time()
    with ThreadGovernor().active() as governor:
        for step in range(recipe.steps):
            governor.update(step)
            starts = torch.randint(0, len(stream) - recipe.seq_len, (recipe.batch_size,), generator=gen)
            x = torch.stack([stream[s : s + recipe.seq_len] for s in starts.tolist()])  # (B, T)
            eps = exit_weights(n_layers, recipe.e_scale, step, recipe.steps)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.train_dtype == "bfloat16"):
                outs = exit_logits(model, x, drop, gen, wanted=[w > 0 for w in eps])
                ces = [F.cross_entropy(o[:, :-1].float().flatten(0, 1), x[:, 1:].flatten()) if w else None
                       for o, w in zip(outs, eps)]
                loss = sum(w * ce for w, ce in zip(eps, ces) if ce is not None)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses.append(ces[-1].item())
    model.eval()
    seconds, step_s = time.perf_counter() - start, (time.perf_counter() - train_start) / recipe.steps
    cpu_step_s = (time.thread_time() - cpu_start) / recipe.steps  # this thread's CPU: load-proof
    model.to(target.dtype).save_pretrained(str(out / "model"))
    tail = losses[-max(1, recipe.steps // 10) :]
    report = {"recipe": dataclasses.asdict(recipe), "train_seconds": seconds, "drop_rates": drop,
              "final_train_loss": sum(tail) / len(tail), "params_trained": sum(p.numel() for p in
                                                                                model.parameters()),
              "loadavg_1min": os.getloadavg()[0], "data_seconds": data_s, "seconds_per_step": step_s,
              "cpu_seconds_per_step": cpu_step_s, "threads": torch.get_num_threads()}
    report["heldout"] = exit_report(target, model, tokenizer, recipe.eval_tokens)
    return report


@torch.inference_mode()
def exit_report(plain: PreTrainedModel, variant: PreTrainedModel, tokenizer, n_tokens: int) -> dict:
    """Held-out perplexity of every early exit of both models, and each exit's greedy agreement with its own
    model's last layer (the acceptance rate of greedy early-exit drafts, position by position)."""
    from methods.zoo.quality import eval_windows, heldout_stream

    out = {}
    for kind in ("code", "prose"):
        windows = eval_windows(heldout_stream(tokenizer, kind), 256, n_tokens)
        out[kind] = {name: _exits(copy.deepcopy(m).float(), windows)
                     for name, m in (("plain", plain), ("layerskip", variant))}
    return out


def _exits(model: PreTrainedModel, windows: torch.Tensor) -> dict:
    nll, agree, count = None, None, 0
    device = next(model.parameters()).device  # the held-out windows are built on the host
    for chunk in windows.to(device).split(8):
        outs = exit_logits(model, chunk)
        y = chunk[:, 1:, None]
        lps = [o[:, :-1].float().log_softmax(-1) for o in outs]
        last = lps[-1].argmax(-1)
        batch_nll = [float(-lp.gather(-1, y).sum()) for lp in lps]
        batch_agree = [float((lp.argmax(-1) == last).sum()) for lp in lps]
        nll = batch_nll if nll is None else [a + b for a, b in zip(nll, batch_nll)]
        agree = batch_agree if agree is None else [a + b for a, b in zip(agree, batch_agree)]
        count += y.numel()
    return {"ppl_by_exit": [math.exp(v / count) for v in nll],
            "greedy_agreement_by_exit": [v / count for v in agree], "tokens": count}


def choose_exit(agreement: list[float], t_n: dict[int, float], max_gamma: int = 8,
                draft_cost: dict[int, float] | None = None, gamma: int = 0,
                tau: dict[int, float] | None = None) -> list[dict]:
    """Rank exit layers E = 1..L-1 by predicted speedup on this device: α_E = the exit's greedy agreement
    with the last layer (held out, position by position), the draft step ρ_E·t(1) with ρ_E timed on this
    device (``draft_cost``: :func:`exit_costs`; E / L when not given), the verify t(γ+1) less the shared
    cache's layers [0, E) of the drafted nodes (ρ_v = E / L, specsim.cost), τ = (1 - α^{γ+1}) / (1 - α);
    best γ per E, or ``gamma`` when > 0 (the configured draft length; ``tau``: τ_E measured at that γ replaces
    the iid formula, whose independent positions miss that agreement comes in runs)."""
    import numpy as np

    n_layers = len(agreement)
    sizes = sorted(t_n)
    t = lambda n: float(np.interp(n, sizes, [t_n[s] for s in sizes]))  # noqa: E731
    rows = []
    for e in range(1, n_layers):
        alpha, share = min(agreement[e - 1], 0.999), e / n_layers
        rho = draft_cost[e] if draft_cost else share
        gammas = [gamma] if gamma > 0 else range(1, max_gamma + 1)
        step = {g: g * rho * t(1) + (1 - share) * t(g + 1) + share * t(1) for g in gammas}
        taus = {g: tau[e] if tau and gamma > 0 else (1 - alpha ** (g + 1)) / (1 - alpha) for g in gammas}
        best = max((taus[g] * t(1) / s, g) for g, s in step.items())
        rows.append({"exit_layer": e, "alpha": agreement[e - 1], "rho": rho, "speedup": best[0],
                     "gamma": best[1], "tau": taus[best[1]]})
    return sorted(rows, key=lambda r: -r["speedup"])


@torch.inference_mode()
def exit_costs(model: PreTrainedModel, context: torch.Tensor, reps: int = 15) -> dict[int, float]:
    """ρ_E for E = 1..L-1, timed on this device (:func:`exit_timings`)."""
    return exit_timings(model, context, reps)[0]


@torch.inference_mode()
def exit_timings(model: PreTrainedModel, context: torch.Tensor, reps: int = 15, verify_tokens: int = 0,
                 clock=time.perf_counter) -> tuple[dict[int, float], float]:
    """(ρ_E for E = 1..L-1, t(n)/t(1) for n = ``verify_tokens``; 1.0 when 0), timed on this device: the
    early-exit draft step (layers [0, E), the final norm and the LM head over one token after ``context``, as
    the drafter runs it) and a full chain forward of n tokens, each over the full single-token step; medians
    of ``reps`` interleaved rounds after a warm one. The per-forward overhead that E / L leaves out is in it.
    ``clock``: time.thread_time with one torch thread measures the CPU work alone (a loaded machine's
    preemptions drop out of the ratios)."""
    import statistics

    from methods.core.engine import ModelEngine
    from methods.core.fast_llama import SubLayers

    engine = ModelEngine(model)
    engine.prefill(context[:-1])
    n_layers = model.config.num_hidden_layers
    steps: dict = {e: (SubLayers(stop=e), 1) for e in range(1, n_layers)} | {n_layers: (None, 1)}
    if verify_tokens > 1:
        steps["verify"] = (None, verify_tokens)
    ratios: dict = {k: [] for k in steps if k != n_layers}
    for r in range(reps + 1):
        times = {}
        for k, (sub, n) in steps.items():
            t0 = clock()
            engine.extend(context[-n:], list(range(-1, n - 1)), last_only=n == 1, sub=sub)
            times[k] = clock() - t0
            engine.drop_pending()
        if r:  # the first round warms up
            for k in ratios:
                ratios[k].append(times[k] / max(times[n_layers], 1e-9))
    verify = statistics.median(ratios.pop("verify")) if "verify" in ratios else 1.0
    return {e: statistics.median(v) for e, v in ratios.items()}, verify


def heldout_context(tokenizer, tokens: int = 256) -> torch.Tensor:
    """Held-out code tokens: the KV cache the timed draft steps attend to."""
    from methods.zoo.quality import heldout_stream

    return torch.as_tensor(heldout_stream(tokenizer, "code")[:tokens], dtype=torch.long)


def main() -> int:
    """Print the cached variant's report (per-exit perplexity and agreement, plain vs variant) and the exit
    layers ranked for this device (t(n) of the zoo report)."""
    import sys

    from methods.models import load_models
    from methods.zoo.build import ensure_zoo
    from specsim.config import ModelConfig

    models = load_models(ModelConfig(), "cpu", "auto")
    path = ensure_layerskip(models.target, models.tokenizer, LayerSkipRecipe())
    report = json.loads((path / "report.json").read_text())
    per_step = report.get("seconds_per_step")
    print(f"LayerSkip variant: {report['train_seconds']:.0f} s of continued training "
          f"({report['recipe']['steps']} steps"
          + (f", {per_step:.2f} s/step, data {report['data_seconds']:.0f} s" if per_step else "")
          + f", load {report['loadavg_1min']:.1f}), drop rates "
          f"{[round(p, 3) for p in report['drop_rates']]}")
    for kind, both in report["heldout"].items():
        for name, r in both.items():
            print(f"  {kind:5s} {name:9s} ppl by exit {[round(x, 1) for x in r['ppl_by_exit']]}  greedy "
                  f"agreement with its last layer {[round(x, 3) for x in r['greedy_agreement_by_exit']]}")
    zoo = json.loads(ensure_zoo("default").report_path.read_text())
    t_n = {int(k): v for k, v in zoo["t_n"]["target_ms"].items()}
    torch.set_num_threads(1)  # as the measured runs (threads=1)
    context = heldout_context(models.tokenizer)
    for name, model in (("layerskip", load_variant(path)), ("plain", models.target)):
        costs = exit_costs(model.to(models.dtype), context)
        print(f"  {name}: draft step rho_E timed on this device (threads=1, load {os.getloadavg()[0]:.1f}): "
              + " ".join(f"E={e}:{c:.3f} (E/L {e / (len(costs) + 1):.3f})"
                         for e, c in costs.items()))
        for kind in ("code", "prose"):
            ranked = choose_exit(report["heldout"][kind][name]["greedy_agreement_by_exit"], t_n,
                                 draft_cost=costs)
            print(f"    exit layers for the {name} model ({kind}), best first: " + "; ".join(
                f"E={r['exit_layer']} α={r['alpha']:.3f} ρ={r['rho']:.2f} γ={r['gamma']} S={r['speedup']:.2f}"
                for r in ranked))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
