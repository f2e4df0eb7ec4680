"""How close the autoregressive loop is to the hardware: a decode step at batch 1 must read every weight of
the target p once (the memory-bound roofline of LLM decoding), so t(1) >= weight bytes / memory bandwidth.

Bandwidth is measured here, in torch, with the run's thread count (the decode loop's): a read (``sum`` of a
float32 tensor) and a copy (read + write: 2 x its bytes counted), median of ``reps``, at two sizes — the
target's own weight bytes (what a decode step streams) and ``dram_mib`` (main memory). t(1) is the engine's
verify forward of one token after a prompt, timed as methods.core.timing times it (each timed forward after
an untimed one). Both are timed twice: by this thread's CPU time — on a machine shared with other busy
processes, wall time also counts the slices the scheduler gives them (a memory-bound loop read 1.5 GB/s by
the wall clock at a load of 17 on 2 cores, 12 GB/s by CPU time) — and by the wall clock.
"""

from __future__ import annotations

import statistics
import time

import torch

from methods.core.engine import ModelEngine
from specsim.tree import Tree


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a one-token forward reads: every parameter except the input embedding table, of which it
    gathers one row (unless the table is tied to the LM head, which reads all of it)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p is emb and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def _median_seconds(fn, reps: int) -> dict[str, float]:
    """Median seconds of ``fn()`` by each clock, after one untimed call (page faults, cold caches)."""
    fn()
    times: dict[str, list[float]] = {k: [] for k in CLOCKS}
    for _ in range(reps):
        start = {k: clock() for k, clock in CLOCKS.items()}
        fn()
        for k, clock in CLOCKS.items():
            times[k].append(clock() - start[k])
    return {k: statistics.median(v) for k, v in times.items()}


def bandwidth(nbytes: int, reps: int) -> dict[str, dict[str, float]]:
    """GB/s (1e9 bytes) by each clock of a read (sum) and of a copy (2 x bytes: read + write) of ``nbytes``
    of float32."""
    n = max(nbytes // 4, 1024)
    src = torch.rand(n)
    dst = torch.empty_like(src)
    read = _median_seconds(lambda: src.sum(), reps)
    copy = _median_seconds(lambda: dst.copy_(src), reps)
    return {k: {"read_GBps": round(4 * n / read[k] / 1e9, 2), "copy_GBps": round(8 * n / copy[k] / 1e9, 2)}
            for k in CLOCKS}


def t1_seconds(model: torch.nn.Module, context: torch.Tensor, reps: int) -> dict[str, float]:
    """t(1) by each clock: the engine's one-token verify forward after ``context`` (T,), each timed forward
    following an untimed one as in the loop's back-to-back steps (methods.core.timing.forward_times)."""
    engine = ModelEngine(model)
    engine.prefill(context)
    token, tree = context[-1:].clone(), Tree.chain(0)

    def step():
        engine.forward_tree(token, tree)
        engine.drop_pending()

    for _ in range(3):
        step()
    return _median_seconds(step, reps)


def physical_limit(model: torch.nn.Module, context: torch.Tensor, *, dram_mib: int, reps: int = 15) -> dict:
    """Weight bytes; read/copy bandwidth at the weights' size and at ``dram_mib``; the time to stream the
    weights once at each read bandwidth; measured t(1) and its ratio to those times — by each clock."""
    wb = weight_bytes(model)
    at_weights, dram = bandwidth(wb, reps), bandwidth(dram_mib << 20, max(reps // 3, 3))
    t1 = t1_seconds(model, context, reps)
    out = {"weight_bytes": wb, "dram_test_bytes": dram_mib << 20}
    for k in CLOCKS:
        stream = {"weights_size": wb / (at_weights[k]["read_GBps"] * 1e9),
                  "dram": wb / (dram[k]["read_GBps"] * 1e9)}
        out[k] = {"bandwidth_at_weights_size_GBps": at_weights[k], "bandwidth_dram_GBps": dram[k],
                  "t_stream_ms": {s: round(v * 1e3, 4) for s, v in stream.items()},
                  "t1_ms": round(t1[k] * 1e3, 4),
                  "t1_over_stream": {s: round(t1[k] / v, 2) for s, v in stream.items()}}
    return out


def describe(limit: dict) -> str:
    """The report's lines, one per clock."""
    mb, mib = limit["weight_bytes"] / 1e6, limit["dram_test_bytes"] >> 20
    lines = [f"physical limit: the target's weights, {mb:.2f} MB, read once per token"]
    for k in CLOCKS:
        one = limit[k]
        bw, dram = one["bandwidth_at_weights_size_GBps"], one["bandwidth_dram_GBps"]
        ts, ratio = one["t_stream_ms"], one["t1_over_stream"]
        lines.append(
            f"  {k + ' time':9s}: read {bw['read_GBps']:.1f} GB/s at that size (copy {bw['copy_GBps']:.1f}), "
            f"{dram['read_GBps']:.1f} GB/s at {mib} MiB (copy {dram['copy_GBps']:.1f}) -> "
            f"{ts['weights_size']:.3f} / {ts['dram']:.3f} ms per token; "
            f"measured t(1) {one['t1_ms']:.3f} ms = {ratio['weights_size']:.2f}x / {ratio['dram']:.2f}x that")
    return "\n".join(lines)
