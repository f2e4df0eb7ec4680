"""KV-cached forwards of one causal LM over B sequences at once, with tree attention per row.

The batched counterpart of methods.core.engine.ModelEngine (same contract per row; p = target). Row b's cache
holds its committed prefix (``lengths[b]`` tokens) in preallocated (L, R, H_kv, cap, D) buffers; a forward
appends n pending nodes to EVERY active row at slots lengths[b] .. lengths[b] + n - 1 (rows whose tree is
smaller are padded with nodes that are never accepted) and attends through one 4D float additive mask
(B, 1, n, max(lengths) + n) built with tensor ops: row b's node i sees its own prefix, its pending ancestors
and itself, nothing of the other rows and nothing past its own prefix (the columns of longer rows). Position
ids are explicit per row: lengths[b] + depth. ``commit`` keeps a ragged accepted path per row (rows advance
by different amounts; the rest is rolled back by moving the write position), moving tree nodes' KV with one
gather/scatter over all layers and rows.

Active rows are slots 0..B-1. A row that leaves (``remove``) is replaced by the last active row (its KV moved
into the freed slot), so a forward is always over a contiguous block of rows; a new request joins at slot B
(``add``) and is prefilled alone (``prefill(..., rows=slice(B, B + 1))``) or with the others. The lean Llama
forward (methods.core.fast_llama) runs where the model supports it, HF's forward otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from methods.core.engine import context_length
from methods.core.fast_llama import FastLlama
from methods.core.fast_llama import supports as supports_fast
from methods.core.mixed_attention import cache_dtype
from specsim.tree import Tree


@dataclass(frozen=True)
class BatchOut:
    logits: torch.Tensor  # (B, n, V) float32 (prefill with last_only: (B, 1, V))
    hidden: torch.Tensor | None  # (B, n, H) last-layer hidden states after the final norm, when asked
    # (B, n, k H) outputs of the k asked decoder ``layers``, concatenated in their order (the last layer's
    # after the final norm, as methods.core.engine.ModelEngine's ``features``), when asked
    features: torch.Tensor | None = None


class _RowsLayer(DynamicLayer):
    """One layer's view of the engine's buffers for HF's ``Cache`` / the lean forward: ``update`` writes the
    forward's (b, H_kv, n, D) keys/values at each row's own slots and returns the rows' (b, H_kv, W, D)."""

    def __init__(self, engine: BatchEngine, index: int):
        super().__init__()
        self.engine, self.index = engine, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        e = self.engine
        k, v = e.k[self.index], e.v[self.index]  # (R, H_kv, cap, D)
        d = k.shape[-1]
        # one index_copy_ of (row, head, node) vectors into the flat (R H_kv cap, D) buffer: several times
        # cheaper than advanced-index assignment k[rows, :, cols] = ... (an index_put over two index tensors)
        k.view(-1, d).index_copy_(0, e._write_flat, key_states.to(k.dtype).reshape(-1, d))
        v.view(-1, d).index_copy_(0, e._write_flat, value_states.to(v.dtype).reshape(-1, d))
        rows = e._rows
        self.keys, self.values = k[rows, :, : e._width], v[rows, :, : e._width]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.engine._width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.engine._width, 0


def attention_dtype(model: PreTrainedModel) -> torch.dtype | None:
    """The batched engine's KV and attention dtype where it should not be the model's: float32 for a bf16 /
    fp16 model on a CPU without AMX tiles. There PyTorch's reduced-precision SDPA is slow with one query
    per row (a decode step, a draft level): AMD EPYC with AVX-512 bf16, torch 2.13, B = 16 x 6 heads x 192
    keys x 64, in cache: ~1.4 ms in bf16 against ~0.2 ms in float32, and bf16 is no faster with 2-8
    queries; a B = 16 zoo decode step took 1.45x less CPU time in float32. On the AMX machine of commit
    05da86a the bf16 cache was the faster (half the bytes; 1.36x at one query)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    reduced = model.dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if model.device.type == "cpu" and reduced and not amx else None


# A prefill of many rows runs in groups of rows of at most this many padded tokens per forward: B = 16 rows of
# 127 tokens (the zoo target, bf16, one thread) took ~7-9% less CPU time in groups of 4-8 rows than in one
# forward of 2032 tokens, whose activations (the MLP's 2032 x 2048) and attention scores outgrow the caches
# (one row alone per forward was ~10% slower again: small matmuls). Measured under load, interleaved.
PREFILL_TOKENS = 512


def prefill_groups(counts: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive [a, b) groups of rows whose padded size (b - a) x max(counts[a:b]) is at most ``budget``
    (a row longer than the budget alone); every row in exactly one group, in order."""
    groups, a, longest = [], 0, 0
    for b, c in enumerate(counts):
        longest = max(longest, c)
        if b > a and (b + 1 - a) * longest > budget:
            groups.append((a, b))
            a, longest = b, c
    groups.append((a, len(counts)))
    return groups


def _host(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.cpu().numpy()


class BatchEngine:
    """The KV caches of up to ``max_rows`` sequences on one model. All methods run under inference mode.

    API (stable; what decode_batch and the batched drafters call):
      ``add(k) -> slot``: k new empty rows at the end (slots B..B+k-1); ``remove(slot)``: the row leaves, the
      last row moves into ``slot``; ``rows``: B active rows; ``lengths``: committed tokens per row (host);
      ``prefill(ids, rows=None) -> BatchOut``: committed prompts (list of (T_b,) tensors, ragged) appended to
      the rows ``rows`` (a slice; default all); ``forward(tokens, anc, depths, hidden=False, layers=())``:
      ONE forward of n pending nodes on every active row (tokens (B, n), ancestor-or-self masks (B or 1, n,
      n) bool, depths (B or 1, n); ``layers``: decoder layers whose outputs come back as ``features``, as
      ModelEngine's); ``forward_trees(tokens, trees)``: the same from per-row ``Tree``s padded to the
      largest; ``extend(tokens, anc (B or 1, n, P + n), depths)``: n more pending nodes after the P
      pending ones (a draft tree level by level); ``commit(paths)``: keep each row's accepted pending nodes
      (ascending, root first), drop the rest; ``commit_counts(counts)``: the first counts[b] pending nodes
      of each row (chains).

    ``attn_dtype``: the attention's dtype (None: ``default_attn_dtype``, None = ``attention_dtype(model)``,
    None = the model's) and the KV cache's, except where ``cache_dtype`` stores it in the model's reduced
    dtype under float32 attention (``mixed_cache``). At B rows a decode forward reads B caches, which
    outweigh the weights past a few rows (zoo target, B = 16, 256 cached tokens: 38 MB of bf16 KV against
    24 MB of weights per forward): a bf16 cache halves the bytes (1.2-1.4x at B = 16 on an AMX CPU); where
    PyTorch's bf16 attention is slow (``attention_dtype``) the attention runs in float32, over the bf16
    cache with the mixed-precision kernel where it is built, else over a float32 cache as the one-sequence
    engine's."""

    default_attn_dtype: torch.dtype | None = None  # benchmarks set another dtype to compare engines
    mixed_cache: bool = True  # a reduced-precision cache under float32 attention where it can (cache_dtype)
    prefill_tokens: int = PREFILL_TOKENS  # padded tokens per prefill forward (benchmarks compare others)

    def __init__(self, model: PreTrainedModel, max_rows: int, capacity: int | None = None, fast: bool = True,
                 pack: bool | None = None, attn_dtype: torch.dtype | None = None):
        self.model = model
        attn_dtype = attn_dtype or self.default_attn_dtype or attention_dtype(model)
        self.fast = FastLlama(model, attn_dtype, pack) if fast and supports_fast(model) else None
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        self.context = context_length(model)
        self.device, self.dtype = model.device, model.dtype
        cfg = model.config.get_text_config()
        self.n_layers = cfg.num_hidden_layers
        heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.mask_dtype = self.fast.attn_dtype if self.fast is not None else self.dtype  # the attention's
        self.kv_dtype = cache_dtype(model, self.mask_dtype, self.fast is not None, self.mixed_cache)
        self.max_rows = max_rows
        self.capacity = min(capacity or self.context, self.context)
        shape = (self.n_layers, max_rows, self.n_kv, self.capacity, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.cache = Cache(layers=[_RowsLayer(self, i) for i in range(self.n_layers)])
        self._neg = torch.finfo(self.mask_dtype).min
        self._arange = self._indices(self.capacity)
        self._host_arange = self._arange.cpu().numpy()
        self._tree_memo: dict[Tree, tuple[np.ndarray, np.ndarray]] = {}
        self.reset()

    # ---- rows ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """No rows (buffers are kept)."""
        self.rows = 0
        self.lengths: list[int] = []
        self.pending = 0

    def add(self, k: int = 1) -> int:
        """k new empty rows at slots B..B+k-1; returns B (the first new slot)."""
        assert self.pending == 0, "commit pending nodes before rows join"
        assert self.rows + k <= self.max_rows, f"{self.rows} + {k} rows exceed max_rows {self.max_rows}"
        first = self.rows
        self.rows += k
        self.lengths += [0] * k
        return first

    def remove(self, slot: int) -> None:
        """Row ``slot`` leaves; the last row moves into its slot (KV copied, O(its length))."""
        assert self.pending == 0 and 0 <= slot < self.rows
        last = self.rows - 1
        if slot != last:
            n = self.lengths[last]
            self.k[:, slot, :, :n] = self.k[:, last, :, :n]
            self.v[:, slot, :, :n] = self.v[:, last, :, :n]
            self.lengths[slot] = n
        self.lengths.pop()
        self.rows = last

    def check_fits(self, n_tokens: int) -> None:
        if n_tokens > self.context:
            raise ValueError(
                f"sequence of {n_tokens} tokens exceeds the model's context of {self.context} positions "
                f"({type(self.model).__name__}); shorten the prompt or lower max_new_tokens")

    def _ensure(self, needed: int) -> None:
        """Grow every row's capacity to ``needed`` slots (amortised doubling, at most the context)."""
        if needed <= self.capacity:
            return
        self.check_fits(needed)
        cap = min(max(needed, 2 * self.capacity), self.context)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:3], cap, old.shape[-1])
            new[:, :, :, : self.capacity] = old
            setattr(self, name, new)
        self.capacity = cap
        self._arange = self._indices(cap)
        self._host_arange = self._arange.cpu().numpy()

    def _indices(self, cap: int) -> torch.Tensor:
        """0..N: slots, rows and heads are all sliced from it."""
        return torch.arange(max(cap, self.max_rows, self.n_kv) + 1, device=self.device)

    # ---- forwards --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: Sequence[torch.Tensor], rows: slice | None = None, hidden: bool = False,
                layers: tuple[int, ...] = ()) -> BatchOut | None:
        """Append committed tokens (one (T_b,) tensor per row of ``rows``, ragged; T_b may be 0) causally;
        logits at each row's last token ((b, 1, V); rows with T_b = 0: garbage), and the hidden states of all
        (b, max T, H) if asked, the features of ``layers`` (b, max T, k H) if any. None when every row's ids
        are empty. The rows run in consecutive groups of at most ``prefill_tokens`` padded tokens per forward
        (``prefill_groups``): rows do not see each other, so each row's result is the same whichever group
        it is in."""
        assert self.pending == 0, "commit pending nodes before a prefill"
        rows = rows or slice(0, self.rows)
        counts = [int(x.numel()) for x in ids]
        assert len(counts) == rows.stop - rows.start, "one ids tensor per row"
        n = max(counts, default=0)
        if n == 0:
            return None
        groups = prefill_groups(counts, self.prefill_tokens)
        outs = {(a, b): self._prefill(ids[a:b], counts[a:b], slice(rows.start + a, rows.start + b), hidden,
                                      layers)
                for a, b in groups if max(counts[a:b]) > 0}
        one = next(iter(outs.values()))
        for a, b in groups:  # a group of empty rows only (no forward): zeros, garbage as for such rows
            if (a, b) not in outs:
                h, f = (None if x is None else x.new_zeros(b - a, 0, x.shape[2])
                        for x in (one.hidden, one.features))
                outs[a, b] = BatchOut(one.logits.new_zeros(b - a, *one.logits.shape[1:]), h, f)
        parts = [outs[g] for g in groups]
        if len(parts) == 1:
            return one

        def rows_of(xs: list[torch.Tensor | None]) -> torch.Tensor | None:  # padded to the longest group
            return None if xs[0] is None else torch.cat(
                [torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[1])) for x in xs])

        return BatchOut(torch.cat([o.logits for o in parts]), rows_of([o.hidden for o in parts]),
                        rows_of([o.features for o in parts]))

    def _prefill(self, ids: Sequence[torch.Tensor], counts: list[int], rows: slice, hidden: bool,
                 layers: tuple[int, ...]) -> BatchOut:
        """One causal forward of the rows ``rows`` (ids padded to the longest; pads see all before them and
        are never committed)."""
        n = max(counts)
        tokens = torch.zeros(len(counts), n, dtype=torch.long)
        for b, x in enumerate(ids):
            tokens[b, : counts[b]] = x.view(-1).cpu()
        self._ensure(max(self.lengths[rows], default=0) + n)  # before slicing the depths from _arange
        causal = np.tri(n, dtype=bool)[None]  # pads see all before
        depths = self._host_arange[:n][None]
        out = self._run(tokens.to(self.device), causal, depths, rows, hidden,
                        last=torch.tensor([max(c - 1, 0) for c in counts], device=self.device), layers=layers)
        self._commit_counts(counts, rows)
        return out

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, anc: torch.Tensor | np.ndarray, depths: torch.Tensor | np.ndarray,
                hidden: bool = False, layers: tuple[int, ...] = ()) -> BatchOut:
        """ONE forward of n pending nodes on each of the B active rows: tokens (B, n) (node 0 = the row's
        root, whose parent is the committed prefix), anc (B or 1, n, n) bool ancestor-or-self, depths (B or
        1, n) long. Rows with fewer nodes pad with nodes that see only the prefix and themselves. ``layers``:
        decoder layers whose outputs come back as ``features`` (EAGLE-3's feature_layers)."""
        assert self.pending == 0, "commit the previous forward's nodes first"
        return self.extend(tokens, anc, depths, hidden, layers=layers)

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, anc: torch.Tensor | np.ndarray, depths: torch.Tensor | np.ndarray,
               hidden: bool = False, last: torch.Tensor | None = None, layers: tuple[int, ...] = ()
               ) -> BatchOut:
        """Append n more pending nodes to each active row, after its P pending ones (a draft tree grown
        level by level): anc (B or 1, n, P + n) bool, over the row's pending nodes then these; depths (B or 1,
        n): positions are lengths[b] + depth (the committed root is at depth -1). ``last`` (B,): the logits
        of node last[b] of each row only ((B, 1, V); the LM head skips the others)."""
        return self._run(tokens.to(self.device), anc, depths, slice(0, self.rows), hidden, last, layers)

    def forward_trees(self, tokens: torch.Tensor, trees: Sequence[Tree], hidden: bool = False,
                      layers: tuple[int, ...] = ()) -> BatchOut:
        """``forward`` from one Tree per row (or one shared: a 1-element list); tokens (B, n), n ≥ the
        largest tree (columns past a row's tree are padding)."""
        n = tokens.shape[1]
        if len(trees) == 1 or all(t is trees[0] for t in trees):
            anc, depths = self._padded(trees[0], n)
            return self.forward(tokens, anc[None], depths[None], hidden, layers)
        anc = np.zeros((len(trees), n, n), dtype=bool)
        depths = np.zeros((len(trees), n), dtype=np.int64)
        for b, tree in enumerate(trees):
            anc[b], depths[b] = self._padded(tree, n)
        return self.forward(tokens, anc, depths, hidden, layers)

    def _padded(self, tree: Tree, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The tree's (n, n) ancestor-or-self mask and (n,) depths, padded to n nodes (padding: itself only,
        depth 0)."""
        key = (tree, n)
        hit = self._tree_memo.get(key)
        if hit is None:
            size = tree.size
            assert size <= n, f"tree of {size} nodes in a forward of {n}"
            anc = np.eye(n, dtype=bool)
            anc[:size, :size] = tree.ancestor_mask
            depths = np.zeros(n, dtype=np.int64)
            depths[:size] = tree.depths
            if len(self._tree_memo) >= 256:
                self._tree_memo.clear()
            hit = self._tree_memo[key] = (anc, depths)
        return hit

    def _run(self, tokens: torch.Tensor, anc: torch.Tensor | np.ndarray, depths: torch.Tensor | np.ndarray,
             rows: slice, hidden: bool, last: torch.Tensor | None = None, layers: tuple[int, ...] = ()
             ) -> BatchOut:
        b, n = tokens.shape
        p0 = self.pending
        lens = np.asarray(self.lengths[rows], dtype=np.int64)  # (b,) host: indices and mask built in numpy
        width = int(lens.max(initial=0)) + p0 + n
        self._ensure(width)
        self.check_fits(width)
        self._rows, self._width = rows, width
        cols = lens[:, None] + (p0 + self._host_arange[:n])  # (b, n) each row's slots
        heads = self._host_arange[rows.start : rows.stop, None] * self.n_kv + self._host_arange[: self.n_kv]
        self._write_flat = torch.from_numpy((heads[:, :, None] * self.capacity + cols[:, None]).reshape(-1)
                                            ).to(self.device)  # (b H_kv n,)
        mask = self._mask(lens, _host(anc), p0 + n, width)  # (b, 1, n, W)
        position = torch.from_numpy(lens[:, None] + _host(depths)).to(self.device)  # (b, n)
        taps = dict.fromkeys(layers) if layers else None
        if self.fast is not None:
            x = self.fast.embed_tokens(tokens.reshape(-1))
            x = self.fast.layers_forward(x, position.reshape(-1), mask, self.cache.layers, taps=taps, rows=b)
            h = self.fast.final_norm(x).view(b, n, -1)
            if taps is not None:  # (b n, H) each; HF's last hidden state is after the final norm
                taps = {i: h if i == self.n_layers - 1 else x.view(b, n, -1) for i, x in taps.items()}
        else:
            out = self.base(input_ids=tokens, attention_mask=mask.to(self.dtype), position_ids=position,
                            past_key_values=self.cache, use_cache=True, output_hidden_states=bool(layers))
            h = out.last_hidden_state  # (b, n, H)
            if taps is not None:
                taps = {i: out.hidden_states[i + 1] for i in layers}
        features = torch.cat([taps[i] for i in layers], dim=-1) if taps is not None else None  # (b, n, k H)
        self.pending = p0 + n
        h_out = h if last is None else h[torch.arange(b, device=h.device), last][:, None]
        flat = h_out.reshape(-1, h_out.shape[-1])
        logits = self.fast.logits(flat) if self.fast is not None else self.head(flat)
        return BatchOut(logits.float().view(b, h_out.shape[1], -1), h if hidden else None, features)

    def _mask(self, lens: np.ndarray, anc: np.ndarray, p: int, width: int) -> torch.Tensor:
        """(b, 1, n, W) additive mask for n new nodes: column c of row b is its prefix (c < lens[b]: 0), its
        pending node j = c - lens[b] < p (0 where anc[b, i, j], else -inf), or past them (-inf). Built on the
        host in numpy, filling only the columns past the shortest prefix, and moved in one copy: at B = 16
        ~17-23 µs against ~45-68 µs for the same mask from a dozen torch ops (the small draft model's
        forward, ~1 ms at B = 16, builds one per level)."""
        b, n = lens.shape[0], anc.shape[1]
        ar = self._host_arange
        lo = int(lens.min()) if b else 0  # columns < lo are every row's prefix: 0; only [lo, W) is computed
        mask = np.zeros((b, n, width), dtype=np.float32)  # exact in float32 for bf16/fp16/fp32
        neg = np.float32(self._neg)
        mask[:, :, lo:] = np.where(ar[lo:width][None] - lens[:, None] >= p, neg, np.float32(0))[:, None]
        cols = lens[:, None] + ar[:p]  # (b, p) the pending nodes' columns: their ancestor mask
        mask[ar[:b, None, None], ar[None, :n, None], cols[:, None, :]] = np.where(anc, np.float32(0), neg)
        return torch.from_numpy(mask[:, None]).to(self.device, self.mask_dtype)

    # ---- commit ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def commit_counts(self, counts: Sequence[int]) -> None:
        """Keep the first counts[b] pending nodes of each active row (a chain's accepted prefix)."""
        self._commit_counts(counts, slice(0, self.rows))

    def _commit_counts(self, counts: Sequence[int], rows: slice) -> None:
        assert self.pending > 0 or not any(counts)
        assert all(0 <= c <= self.pending for c in counts), f"counts {counts} > pending {self.pending}"
        for b, c in zip(range(rows.start, rows.stop), counts):
            self.lengths[b] += c
        self.pending = 0

    @torch.inference_mode()
    def commit(self, paths: Sequence[Sequence[int]]) -> None:
        """Keep each active row's pending nodes ``paths[b]`` (ascending pending indices, e.g. the accepted
        root-first path) as committed tokens; drop the others (and the padding)."""
        assert len(paths) == self.rows, f"{len(paths)} paths for {self.rows} rows"
        counts = [len(p) for p in paths]
        moved = [b for b, p in enumerate(paths) if list(p) != list(range(len(p)))]
        if moved:
            k = max(counts[b] for b in moved)
            src = np.empty((len(moved), k), dtype=np.int64)
            for i, b in enumerate(moved):
                p = list(paths[b])
                assert all(0 <= x < self.pending for x in p) and all(x < y for x, y in zip(p, p[1:])), p
                src[i] = p + list(range(len(p), k))  # past the path: moved onto itself
            base = torch.tensor([self.lengths[b] for b in moved], device=self.device)[:, None]
            rows = torch.tensor(moved, device=self.device)[:, None]
            dst = base + self._arange[:k]
            src_t = base + torch.from_numpy(src).to(self.device)
            self.k[:, rows, :, dst] = self.k[:, rows, :, src_t]  # (m, k, L, H_kv, D): copied before written
            self.v[:, rows, :, dst] = self.v[:, rows, :, src_t]
        self._commit_counts(counts, slice(0, self.rows))

    def drop_pending(self) -> None:
        self.commit([()] * self.rows)
