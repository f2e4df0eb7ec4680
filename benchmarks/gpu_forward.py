"""What an eager Hugging Face Llama forward costs on a GPU host, measured: the figures the published rows'
launch model (``conf/published/runtimes.yaml``) takes from a blog and from CPU-only profiling.

Two parts, each printed as one JSON line (``--json DIR`` also writes them as files):

``launch``: PyTorch's own per-kernel costs on this device, from a one-element in-place add issued back to back
(``reps`` times, median of ``rounds``): the host time per launch (Python + dispatcher + the CUDA launch, the
queue never full), the device time per kernel when a CUDA graph replays the same kernels back to back (the
kernel floor), the cost per kernel with a synchronisation after each, and the host time of one graph replay.

``forward``: a random-init Llama of a real shape (``--models``: the ``conf/model`` presets' dimensions, in
float16) decoding ``n`` new tokens over a ``--context``-token KV cache, for each ``n`` of ``--n``: the wall
time of a synchronised forward (t(n)); the host time the forward call takes when the device is idle at its
start (launching every kernel while the device works behind it); the device's busy time (the sum of its
kernels' times, from the profiler's trace); the kernels launched and the runtime calls that synchronise
(memcpy to the host, stream/device synchronise). ``host_us_per_kernel`` = host time / kernels. Runs on
whichever transformers is importable (``--transformers-path`` puts another first, as in ``published.py
--count-kernels``), with the attention implementation of ``--attention`` (the papers' Llama copies: eager).

On a machine without CUDA it runs on the CPU (tiny shapes: the smoke test): kernels are then the profiler's
top-level aten ops and the device figures are absent.

    python benchmarks/gpu_forward.py --part launch
    python benchmarks/gpu_forward.py --part forward --models llama2_7b llama2_13b --attention eager
    python benchmarks/gpu_forward.py --part forward --transformers-path DIR --attention eager --json out/
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SHAPE_KEYS = ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "intermediate_size", "vocab_size")


def preset(model: str) -> dict[str, Any]:
    """A ``conf/model`` preset's own keys over those of the presets its ``defaults`` list names (the schema's
    ``base_model`` holds no shape and is skipped)."""
    path = REPO / "conf" / "model" / f"{model}.yaml"
    if not path.exists():
        raise SystemExit(f"no conf/model/{model}.yaml")
    own = yaml.safe_load(path.read_text())
    merged: dict[str, Any] = {}
    for parent in own.pop("defaults", []):
        if isinstance(parent, str) and parent not in ("base_model", "_self_"):
            merged.update(preset(parent))
    return {**merged, **own}


def shape_of(model: str) -> dict[str, int]:
    """The dimensions of a ``conf/model`` preset, its parents' included."""
    cfg = preset(model)
    missing = [k for k in SHAPE_KEYS if k not in cfg]
    if missing:
        raise SystemExit(f"conf/model/{model}.yaml (with its defaults) lacks {missing}: not a real shape")
    return {k: int(cfg[k]) for k in SHAPE_KEYS}


def top_level_ops(prof: Any) -> list[Any]:
    """The profiled region's top-level aten ops (those no other aten op called): what the host dispatches,
    the count the published rows price per op (``published.py --count-kernels``)."""
    return [e for e in prof.events() if e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]


def trace_counts(prof: Any) -> dict[str, float]:
    """Kernels, their summed device time (ms) and synchronising runtime calls of one profiled region, read
    from the profiler's exported trace (its format is stabler across torch releases than its objects)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    runtime = [(e.get("name", ""), float(e.get("dur", 0.0))) for e in events
               if e.get("cat") == "cuda_runtime"]
    waits = [d for n, d in runtime if "Synchronize" in n or "MemcpyDtoH" in n
             or (n.startswith("cudaMemcpy") and "Async" not in n)]
    return {"kernels": len(kernels), "device_ms": sum(float(e.get("dur", 0.0)) for e in kernels) / 1e3,
            "launches": sum(1 for n, _ in runtime if "LaunchKernel" in n or "cuLaunch" in n),
            "syncs": len(waits), "sync_ms": sum(waits) / 1e3}


def launch(reps: int = 2000, rounds: int = 5) -> dict[str, Any]:
    """Per-kernel costs of a one-element add on the CUDA device (see the module's docstring), in µs."""
    import torch

    x = torch.zeros(1, device="cuda")
    sync = torch.cuda.synchronize

    def timed(body: Any) -> float:
        out = []
        for _ in range(rounds):
            sync()
            t = time.perf_counter()
            body()
            out.append(time.perf_counter() - t)
        sync()
        return 1e6 * statistics.median(out) / reps

    def adds() -> None:
        for _ in range(reps):
            x.add_(1.0)

    def adds_synced() -> None:
        for _ in range(reps):
            x.add_(1.0)
            sync()

    adds()
    host = timed(adds)  # returns once launched: the queue (~1000 entries) is drained faster than it fills
    with_sync = timed(adds_synced)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        adds()  # warm-up on a side stream, as capture requires
    sync()
    with torch.cuda.graph(graph):
        adds()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    floors = []
    for _ in range(rounds):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        floors.append(start.elapsed_time(end) * 1e3 / reps)
    one = torch.cuda.CUDAGraph()
    with torch.cuda.graph(one):
        x.add_(1.0)
    replays = []
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        for _ in range(100):
            one.replay()
        replays.append((time.perf_counter() - t) / 100)
    sync()
    return {"part": "launch", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "host_us_per_launch": host, "us_per_kernel_synced": with_sync,
            "sync_us": with_sync - max(host, statistics.median(floors)),
            "kernel_floor_us": statistics.median(floors),
            "graph_replay_host_us": 1e6 * statistics.median(replays)}


def build(shape: dict[str, int], attention: str | None, device: Any, dtype: Any, cls: Any = None) -> Any:
    """A random-init LlamaForCausalLM of ``shape`` (or ``cls``, a copy of that class taking the same config),
    created on ``device`` in ``dtype`` (no float32 copy)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                      intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["n_layers"],
                      num_attention_heads=shape["n_heads"], num_key_value_heads=shape["n_kv_heads"],
                      max_position_embeddings=4096, tie_word_embeddings=False)
    if attention is not None:
        cfg._attn_implementation = attention
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = (cls or LlamaForCausalLM)(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def forward(model_name: str, ns: list[int], context: int, reps: int, attention: str | None,
            shape: dict[str, int] | None = None) -> dict[str, Any]:
    """t(n), host time, device busy time and kernel count of one eager forward (see the module docstring)."""
    import torch
    import transformers
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float16 if cuda else torch.float32
    shape = shape or shape_of(model_name)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = build(shape, attention, device, dtype)
    attn = type(model.model.layers[0].self_attn).__name__ + ":" + str(
        getattr(model.config, "_attn_implementation", "eager"))
    rows = []
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, shape["vocab_size"], (1, context), generator=gen).to(device)
        cache = model(prompt, use_cache=True).past_key_values
        legacy = isinstance(cache, tuple)  # transformers 4.x: a forward returns a new tuple, leaves this one

        def step(tokens: Any) -> None:
            model(tokens, past_key_values=cache, use_cache=True)
            if not legacy:
                cache.crop(-tokens.shape[1])  # back to the context (a negative crop removes tokens)

        for n in ns:
            tokens = torch.randint(0, shape["vocab_size"], (1, n), generator=gen).to(device)
            for _ in range(3):
                step(tokens)
            walls, hosts = [], []
            for _ in range(reps):
                sync()
                t = time.perf_counter()
                model(tokens, past_key_values=cache, use_cache=True)
                hosts.append(time.perf_counter() - t)
                sync()
                walls.append(time.perf_counter() - t)
                if not legacy:
                    cache.crop(-n)
            sync()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                step(tokens)
                sync()
            if cuda:
                counts = trace_counts(prof)
            else:
                top = len(top_level_ops(prof))
                counts = {"kernels": top, "device_ms": float("nan"), "launches": top, "syncs": 0}
            host_ms, wall_ms = 1e3 * statistics.median(hosts), 1e3 * statistics.median(walls)
            rows.append({"n": n, "wall_ms": wall_ms, "host_ms": host_ms, "wall_ms_min": 1e3 * min(walls),
                         "host_ms_min": 1e3 * min(hosts), **counts,
                         "host_us_per_kernel": 1e3 * host_ms / max(counts["kernels"], 1)})
    model = cache = None  # the GPU memory back before the next model
    if cuda:
        torch.cuda.empty_cache()
    return {"part": "forward", "model": model_name, "shape": shape, "context": context,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype),
            "transformers": transformers.__version__, "torch": torch.__version__, "attention": attn,
            "reps": reps, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("launch", "forward"), default="forward")
    ap.add_argument("--models", nargs="+", default=["llama2_7b"], help="conf/model presets with a real shape")
    ap.add_argument("--n", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128],
                    help="new tokens per forward")
    ap.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    ap.add_argument("--reps", type=int, default=10, help="timed forwards per n")
    ap.add_argument("--attention", help="attention implementation (eager, sdpa); unset: the default")
    ap.add_argument("--transformers-path", type=Path,
                    help="a folder holding another transformers (pip install --target), imported first")
    ap.add_argument("--json", type=Path, help="also write each part's JSON into this folder")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.n) or args.context < 1 or args.reps < 1:
        ap.error("--n, --context and --reps must be >= 1")
    if args.transformers_path is not None:
        assert "transformers" not in sys.modules, "transformers imported before --transformers-path"
        sys.path.insert(0, str(args.transformers_path))
    if args.part == "launch":
        import torch

        if not torch.cuda.is_available():
            ap.error("--part launch needs a CUDA device")
        results = [launch()]
    else:
        for m in args.models:
            shape_of(m)  # every preset checked before the first model is built
        results = (forward(m, args.n, args.context, args.reps, args.attention) for m in args.models)
    for r in results:  # each printed as soon as it is measured
        line = json.dumps(r)
        print(line, flush=True)
        if args.json is not None:
            args.json.mkdir(parents=True, exist_ok=True)
            tag = r["part"] if r["part"] == "launch" else "_".join(
                (r["model"], r["transformers"], r["attention"].split(":")[-1]))
            (args.json / f"{tag}.json").write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
