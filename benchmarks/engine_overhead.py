"""Per-step cost of specsim's engine against a bare Hugging Face forward of the same model at the same
cache length (issue 3's note; issue 5's performance targets). Interleaved repetitions, medians, in ms:

  hf_forward      model(token, past_key_values=DynamicCache, position_ids): one token, cache of --context
  engine_forward  ModelEngine.forward_tree(root) + commit: what one autoregressive step costs the loop
  engine_tree_N   one forward over an N-node tree (tree attention) + commit of a 1-node path
  hf_forward_N    bare HF forward of N tokens (causal) at the same cache length, for the tree cost
  loop_token      decode() with the autoregressive drafter, per generated token (loop, timers, sampling)
  hf_generate     model.generate(greedy), per generated token

    python benchmarks/engine_overhead.py --model random_tiny           # ModelConfig presets from conf/model
    python benchmarks/engine_overhead.py --model zoo --dtype bfloat16 --threads 1
    python benchmarks/engine_overhead.py --model zoo model.source=random     # zoo dimensions, random weights
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from methods.core.engine import ModelEngine  # noqa: E402
from methods.core.loop import DecodeOptions, decode  # noqa: E402
from methods.core.timing import median_seconds  # noqa: E402
from methods.drafters.autoregressive import Autoregressive  # noqa: E402
from methods.models import load_models  # noqa: E402
from specsim.tree import Tree  # noqa: E402


def _tree(n: int) -> Tree:
    """A binary-ish tree of n nodes (breadth-first), as Sequoia/SpecInfer trees are."""
    return Tree.from_parents([-1] + [(i - 1) // 2 for i in range(1, n)])


def bench(model, context: int, new_tokens: int, reps: int, tree_sizes: list[int]) -> dict[str, float]:
    vocab = model.config.vocab_size
    prompt = torch.randint(0, min(vocab, 256), (context,), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(prompt[None], past_key_values=cache, use_cache=True)

    def hf_forward(n: int = 1):
        with torch.inference_mode():
            ids, pos = prompt[:n][None], torch.arange(context, context + n)[None]
            int(model(ids, position_ids=pos, past_key_values=cache, use_cache=True).logits[0, -1].argmax())
            cache.crop(-n)

    engine = ModelEngine(model)
    engine.prefill(prompt)

    def engine_forward(tree: Tree = _tree(1)):  # noqa: B008 (a frozen Tree)
        out = engine.forward_tree(prompt[: tree.size], tree)
        int(out.logits[0].argmax())
        engine.commit((0,))
        engine.truncate(context)  # back to the same cache length

    loop_engine = ModelEngine(model)
    opts = DecodeOptions(max_new_tokens=new_tokens)

    def loop():
        decode(loop_engine, Autoregressive(), prompt, opts, torch.Generator())

    def generate():
        with torch.inference_mode():
            model.generate(prompt[None], attention_mask=torch.ones(1, context, dtype=torch.long),
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)

    cases = {"hf_forward": hf_forward, "engine_forward": engine_forward}
    for n in tree_sizes:
        cases[f"hf_forward_{n}"] = lambda n=n: hf_forward(n)
        cases[f"engine_tree_{n}"] = lambda n=n: engine_forward(_tree(n))
    slow = {"loop_token": loop, "hf_generate": generate}
    results: dict[str, list[float]] = {k: [] for k in [*cases, *slow]}
    for fn in [*cases.values(), *slow.values()]:
        fn()  # warm-up
    for _ in range(3):  # interleave: a shared machine's slow phases hit every case
        for k, fn in cases.items():
            results[k].append(median_seconds(fn, reps))
        for k, fn in slow.items():
            results[k].append(median_seconds(fn, 1) / new_tokens)
    return {k: statistics.median(v) * 1e3 for k, v in results.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random_tiny", help="a conf/model preset (random_* or zoo)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the preset's)")
    ap.add_argument("--context", type=int, default=128, help="tokens in the KV cache")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--tree-sizes", default="8,32")
    ap.add_argument("overrides", nargs="*", help="more config overrides, e.g. model.source=random")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import run  # the repository's entry point: composes conf/ presets (Hydra stays there)

    cfg = run.compose_run_config(f"model={args.model}", *args.overrides)
    dtype = args.dtype or cfg.model.dtype
    model = load_models(cfg.model, "auto", dtype).target
    ms = bench(model, args.context, args.new_tokens, args.reps, [int(x) for x in args.tree_sizes.split(",")])
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model={args.model} ({params:.1f}M params) dtype={dtype} device={model.device} "
          f"threads={torch.get_num_threads()} context={args.context}")
    for k, v in ms.items():
        ref = k.replace("engine_tree", "hf_forward") if k.startswith("engine_tree") else "hf_forward"
        print(f"  {k:16s} {v:8.3f} ms   x{v / ms[ref]:5.2f} vs {ref}")
    base = ms["hf_forward"]
    print(f"engine overhead per AR step: {ms['engine_forward'] - base:+.3f} ms "
          f"({ms['engine_forward'] / base:.2f}x a bare HF forward); loop per token {ms['loop_token']:.3f} ms "
          f"vs HF generate {ms['hf_generate']:.3f} ms ({ms['hf_generate'] / ms['loop_token']:.2f}x faster)")


if __name__ == "__main__":
    main()
