"""Why an EAGLE draft level costs what it does on this device: one level's pieces, each timed alone, against
the target's t(1), beside the bytes each streams and the time those bytes take at the bandwidth measured here
(benchmarks/physical_limit.bandwidth, the figure vs_transformers.py reports) (Li et al. 2024a; p = target,
q = head).

A level of ``HeadCache.feed`` + the LM head + the choice of children, replayed piece by piece on the head's
real cache (the prompt's committed rows): the embedding rows and concat, fc, qkv, the rotary embedding (and
the cast of K/V to the cache's dtype), the K/V write, the host mask (ancestors, numpy, one transfer), the
attention over the cache, o_proj, norm + gate_up, silu + down, the LM head, the top-k and its transfer to the
host; then the whole level as the drafter runs it (their sum, less Python's glue) and the committed rows'
append (once per step). Interleaved: every piece once per round, thread CPU time (``time.thread_time``:
robust to the other jobs of a shared machine), median over rounds, each sample the mean of ``--inner`` calls.

Floor: a level cannot take less than its bytes (weights + the K/V it reads) over the read bandwidth at the
level's working-set size (``bandwidth(level bytes)``; the target's t(1) against its own bytes at its size for
comparison). A piece far above its floor is overhead (dispatch, small ops), one near it is streaming.

    python benchmarks/eagle_cost.py                       # EAGLE-1 (method=eagle)
    python benchmarks/eagle_cost.py method=eagle3 --rows 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.physical_limit import bandwidth, weight_bytes  # noqa: E402
from methods.core.drafter import DraftContext  # noqa: E402
from methods.core.engine import ModelEngine  # noqa: E402
from methods.core.sampling import SamplingParams  # noqa: E402
from methods.data.workloads import load_prompts  # noqa: E402
from methods.drafters.eagle import EagleDrafter  # noqa: E402
from methods.drafters.registry import build_drafter  # noqa: E402
from methods.heads.eagle.state import HeadCache, _norm, grow_ancestors  # noqa: E402
from methods.models import load_models  # noqa: E402
from specsim.tree import Tree  # noqa: E402


def mean_cpu(fn, inner: int) -> float:
    """Thread CPU seconds of one fn() call, the mean of ``inner`` back-to-back calls."""
    t0 = time.thread_time()
    for _ in range(inner):
        fn()
    return (time.thread_time() - t0) / inner


class Level:
    """One draft level of ``n`` rows on ``cache`` (all children of the root: depth 1), split into the
    pieces ``HeadCache._rows`` runs, each a callable on tensors prepared once (the previous piece's
    output)."""

    def __init__(self, cache: HeadCache, n: int, children: int) -> None:
        self.cache, head = cache, cache.head
        self.head, c = head, head.cfg
        self.n, self.children = n, children
        p = head.qkv_proj.weight
        g = torch.Generator().manual_seed(0)
        self.h = cache.last.expand(n, -1).contiguous()
        self.tokens = torch.randint(c.vocab_size, (n,), generator=g)
        self.parents = np.full(n, -1)
        self.e = head.embed[self.tokens].to(p.dtype)
        self.x = self._x()
        self.res = self.h if c.variant == "eagle3" else head._lin("fc", self.x)
        self.qin = self.x if c.variant == "eagle3" else self.res  # the attention's input
        self.qkv = head._lin("qkv_proj", self.qin)
        self.rope = cache._rope[cache.length, None]
        self.qk = self._rope_cast()
        self.mask = self._mask()
        at = cache.length
        d = c.head_dim
        self.k_new = self.qk[None, :, cache._hq:]
        self.v_new = self.qkv[None, :, cache._k_end:].view(1, n, -1, d)
        cache._write(self.k_new, self.v_new)  # so that the attention reads at + n rows, as in a level
        self.keys = cache.k[:, : at + n].transpose(1, 2)
        self.values = cache.v[:, : at + n].transpose(1, 2)
        self.q = self.qk[:, : cache._hq].float().transpose(0, 1)[None]
        self.a = self._attend()
        self.xo = self.res + head._lin("o_proj", self.a[0].transpose(0, 1).reshape(n, -1).to(p.dtype))
        self.y = _norm(self.xo, head.post_norm, c.rms_eps)
        self.gu = head._lin("gate_up_proj", self.y)
        self.g = self.xo + self._down()
        self.z = head.logits(self.g)

    def _x(self):
        head, c = self.head, self.head.cfg
        if c.variant == "eagle1":
            return torch.cat([self.e, self.h], -1)
        e, h = _norm(self.e, head.embed_norm, c.rms_eps), _norm(self.h, head.hidden_norm, c.rms_eps)
        return torch.cat([e, h], -1)

    def _rope_cast(self):
        d = self.head.cfg.head_dim
        qk = self.qkv[:, : self.cache._k_end].view(self.n, -1, d)
        qk = qk * self.rope[:, 0] + qk.roll(d // 2, -1) * self.rope[:, 1]
        qk[:, : self.cache._hq].float()  # the queries in float32 (the attention's dtype)
        return qk

    def _mask(self):
        cache, n = self.cache, self.n
        grown = grow_ancestors(cache.anc, self.parents)
        if grown.all():  # every pending row visible (a chain's one row): no mask (HeadCache.feed)
            return None
        mask = np.zeros((n, cache.length + n), dtype=np.float32)
        mask[:, cache.length:][~grown] = -np.inf
        return torch.from_numpy(mask)

    def _attend(self):
        return self.cache._attention(self.q, self.keys, self.values, self.mask)

    def _down(self):
        gate, up = self.gu.chunk(2, -1)
        return self.head._lin("down_proj", F.silu(gate) * up)

    def _write(self):
        self.cache._write(self.k_new, self.v_new)

    def _topk(self):
        return self.z.float().topk(self.children).indices.cpu().numpy()

    def whole(self):
        """The level as the drafter runs it: feed, LM head, top-k (then its rows are dropped)."""
        g = self.cache.feed(self.h, self.tokens, 1, self.parents)
        self.head.logits(g).float().topk(self.children).indices.cpu().numpy()
        self.cache.drop_pending()

    def pieces(self) -> dict:
        head, c = self.head, self.head.cfg
        out = {"embed rows + concat (+norms)": self._x}
        if c.variant == "eagle1":
            out["fc (2H -> H)"] = lambda: head._lin("fc", self.x)
        out.update({
            "qkv_proj": lambda: head._lin("qkv_proj", self.qin),
            "rotary + q to float32": self._rope_cast,
            "K/V write": self._write,
            "mask on host (ancestors, numpy)": self._mask,
            "attention over the cache": self._attend,
            "o_proj + residual": lambda: self.res + head._lin(
                "o_proj", self.a[0].transpose(0, 1).reshape(self.n, -1).to(self.res.dtype)),
            "norm + gate_up": lambda: head._lin("gate_up_proj", _norm(self.xo, head.post_norm, c.rms_eps)),
            "silu + down + residual": lambda: self.xo + self._down(),
            "LM head": lambda: head.logits(self.g),
            "top-k + to host": self._topk,
        })
        return out

    def bytes(self) -> dict:
        """Bytes each piece streams (weights in the head's dtype, K/V as the attention reads them)."""
        head, c, n = self.head, self.head.cfg, self.n
        es = head.qkv_proj.weight.element_size()

        def w(name):
            return getattr(head, name).weight.numel() * es

        kv = 2 * self.keys.shape[2] * c.num_kv_heads * c.head_dim * self.cache.k.element_size()
        out = {"embed rows + concat (+norms)": n * c.hidden_size * es, "qkv_proj": w("qkv_proj"),
               "attention over the cache": kv, "o_proj + residual": w("o_proj"),
               "norm + gate_up": w("gate_up_proj"), "silu + down + residual": w("down_proj"),
               "LM head": head.lm_head.numel() * es, "K/V write": n * c.num_kv_heads * c.head_dim * 2 * 4}
        if c.variant == "eagle1":
            out["fc (2H -> H)"] = w("fc")
        return out


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--inner", type=int, default=20,
                    help="calls per sample (> 1: a piece's weights stay hot in L2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=1, help="rows fed at the level (a chain: 1; k-ary: k^d)")
    ap.add_argument("--children", type=int, default=2, help="top-k per row")
    ap.add_argument("--accepted", type=int, default=3, help="committed rows appended per step (catch-up)")
    ap.add_argument("--extra-context", type=int, default=0,
                    help="committed rows appended after the prompt's (random features): a longer context")
    ap.add_argument("--dram-mib", type=int, default=256, help="buffer of the main-memory bandwidth test")
    ap.add_argument("overrides", nargs="*", help="run.py overrides (method=eagle|eagle3, model.dtype=...)")
    args = ap.parse_args(argv)
    import run

    torch.set_num_threads(args.threads)
    cfg = run.compose_run_config("method=eagle", *args.overrides)
    models = load_models(cfg.model, "cpu", cfg.model.dtype)
    greedy = SamplingParams(temperature=0.0)
    drafter = build_drafter(cfg.method, Tree.chain(4), models, greedy, tree_cfg=None)
    head = drafter.head
    ids = torch.tensor(load_prompts(cfg.workload, models.tokenizer, cfg.seed)[0].token_ids)
    engine = ModelEngine(models.target)
    layers = tuple(drafter.feature_layers)
    out = engine.prefill(ids, hidden=True, layers=layers)
    src = out.features if layers else out.hidden
    gen = torch.Generator().manual_seed(0)
    drafter.propose(DraftContext(ids, src[:-1], gen, max_new=64, features=src[:-1]))  # the prompt's rows
    cache = drafter.cache
    # the same rows in a float32 K/V cache (PyTorch's SDPA): the A/B of the reduced-precision head cache
    f32 = HeadCache(head, mixed_ok=False)
    f32.append(head.fuse(src[:-1].to(head.fc.weight.dtype)), ids[1:])
    if args.extra_context:
        g = torch.Generator().manual_seed(1)
        more = torch.randn(args.extra_context, src.shape[-1], generator=g).to(head.fc.weight.dtype)
        more_tokens = torch.randint(head.cfg.vocab_size, (args.extra_context,), generator=g)
        for c in (cache, f32):
            c.append(head.fuse(more), more_tokens)
    level = Level(cache, args.rows, args.children)
    level32 = Level(f32, args.rows, args.children)
    ctx = DraftContext(ids, None, gen, max_new=64)
    p = head.fc.weight
    acc = src[-args.accepted:].to(p.dtype)
    acc_tokens = ids[-args.accepted:]

    def target_step():
        engine.forward_tree(ids[-1:], Tree.chain(0))
        engine.drop_pending()

    def catch_up():  # the accepted rows' append, undone: the cache keeps its length
        length, last = cache.length, cache.last
        cache.append(head.fuse(acc), acc_tokens)
        cache.length, cache.last = length, last

    general = EagleDrafter(head, Tree.chain(4), greedy)  # the same cache, the general static-tree path
    general.cache, general.fast_chain = cache, False
    tasks = {"t(1) target step": target_step, **level.pieces(), "level: feed + LM head + top-k": level.whole,
             "A/B: propose chain-4, general tree path": lambda: general.propose(ctx),
             "A/B: attention, float32 K/V (SDPA)": level32._attend,
             "A/B: level, float32 K/V (SDPA)": level32.whole,
             f"catch-up append, {args.accepted} rows": catch_up,
             "propose chain-4 (whole, 4 levels)": lambda: drafter.propose(ctx)}
    res = {k: [] for k in tasks}
    for fn in tasks.values():
        fn()
    for r in range(args.rounds):
        order = list(tasks)
        order = order[r % len(order):] + order[: r % len(order)]  # rotated per round
        for k in order:
            res[k].append(mean_cpu(tasks[k], args.inner))
    med = {k: statistics.median(v) for k, v in res.items()}
    t1 = med["t(1) target step"]
    nb = level.bytes()
    level_bytes = sum(nb.values())
    tb = weight_bytes(models.target)
    bw_level = bandwidth(level_bytes, 30)["cpu"]["read_GBps"] * 1e9
    bw_target = bandwidth(tb, 30)["cpu"]["read_GBps"] * 1e9
    bw_dram = bandwidth(args.dram_mib << 20, 5)["cpu"]["read_GBps"] * 1e9
    print(f"{cfg.method.name} ({head.cfg.variant}), target {cfg.model.dtype}, head {p.dtype}, K/V "
          f"{cache.kv_dtype}, {args.threads} thread(s), context {cache.length} committed rows, {args.rows} "
          f"row(s) fed, top-{args.children}; thread CPU time, median of {args.rounds} interleaved rounds x "
          f"{args.inner} calls")
    print(f"read bandwidth (physical_limit.bandwidth, CPU time): {bw_level / 1e9:.1f} GB/s at the level's "
          f"{level_bytes / 1e6:.2f} MB, {bw_target / 1e9:.1f} GB/s at the target's {tb / 1e6:.2f} MB, "
          f"{bw_dram / 1e9:.1f} GB/s at {args.dram_mib} MiB (main memory)")
    print(f"  {'piece':40} {'ms':>7} {'t(1)':>6} {'MB':>6} {'floor ms':>8} {'x floor':>7}")
    parts = 0.0
    for k, m in med.items():
        b = nb.get(k)
        if k in nb or k in level.pieces():
            parts += m
        fl = f"{b / 1e6:6.2f} {b / bw_level * 1e3:8.4f} {m / (b / bw_level):7.1f}" if b else ""
        print(f"  {k:40} {m * 1e3:7.4f} {m / t1:6.3f} {fl}")
    whole = med["level: feed + LM head + top-k"]
    floor = level_bytes / bw_level
    print(f"  sum of the level's pieces {parts * 1e3:.4f} ms = {parts / t1:.3f} t(1); the level whole "
          f"{whole * 1e3:.4f} ms = {whole / t1:.3f} t(1)")
    print(f"  floor of a level: {level_bytes / 1e6:.2f} MB / {bw_level / 1e9:.1f} GB/s = "
          f"{floor * 1e3:.4f} ms = {floor / t1:.3f} t(1); the level is {whole / floor:.1f}x its floor "
          f"(from main memory: {level_bytes / bw_dram * 1e3:.4f} ms, {whole / (level_bytes / bw_dram):.1f}x)")
    print(f"  the target: {tb / 1e6:.2f} MB / {bw_target / 1e9:.1f} GB/s = {tb / bw_target * 1e3:.4f} ms; "
          f"t(1) is {t1 / (tb / bw_target):.1f}x its floor (main memory: {tb / bw_dram * 1e3:.4f} ms, "
          f"{t1 / (tb / bw_dram):.1f}x); level/target bytes {level_bytes / tb:.3f}, time {whole / t1:.3f}")
    w32 = med["A/B: level, float32 K/V (SDPA)"]
    print(f"  A/B K/V cache: level {w32 * 1e3:.4f} ms float32 -> {whole * 1e3:.4f} ms {cache.kv_dtype} "
          f"(x{whole / w32:.3f}); attention {med['A/B: attention, float32 K/V (SDPA)'] * 1e3:.4f} -> "
          f"{med['attention over the cache'] * 1e3:.4f} ms")
    print(f"  propose chain-4: {med['propose chain-4 (whole, 4 levels)'] / t1:.3f} t(1) "
          f"= {med['propose chain-4 (whole, 4 levels)'] / 4 / t1:.3f} t(1) per level (the general tree path: "
          f"{med['A/B: propose chain-4, general tree path'] / t1:.3f} t(1))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
