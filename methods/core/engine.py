"""KV-cached forwards of one causal LM over one sequence, with tree attention (SpecInfer/Medusa-style).

The cache holds the committed prefix (``length`` tokens) followed by *pending* tree nodes. A forward appends
nodes whose parents are pending nodes or the committed prefix; each node attends to the prefix, its pending
ancestors and itself through a 4D **float** additive mask (1, 1, n, L+P+n), at position = parent's + 1
(explicit position ids: without them the logits are wrong). ``commit(path)`` moves the kept nodes' KV right
after the prefix (gpt-fast style: preallocated buffers, rolling back is moving the write position) and drops
the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from methods.core.fast_llama import FastLlama, SubLayers
from methods.core.fast_llama import supports as supports_fast
from methods.core.mixed_attention import cache_dtype
from specsim.tree import Tree


def context_length(model: PreTrainedModel) -> int:
    """Positions the model was built for (Llama/NeoX: max_position_embeddings, GPT-2: n_positions)."""
    cfg = model.config
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(cfg, key, None)
        if value:
            return int(value)
    raise ValueError(f"{type(model).__name__}: cannot find the context length in its config")


def inference(method: Callable) -> Callable:
    """``torch.inference_mode()`` for a method, entered only when the caller is not inside it already: the
    decode loop runs under it, and re-entering the mode costs more than a small method's own Python (several
    engine calls per step)."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode():
            return method(*args, **kwargs)

    return run


# the one-sequence cache in the model's bf16 under float32 attention where batch engines store it so
# (mixed_attention.cache_dtype): the batched and the one-sequence engine then attend alike
MIXED_CACHE = True
COMPILE = False  # engines' default for ``compile`` (RunConfig.compile, set once per process by set_compile)


def set_compile(on: bool) -> None:
    """The process's default for ``ModelEngine(compile=None)``: every engine built after this call."""
    global COMPILE
    COMPILE = bool(on)


_MAX_TREE_CACHE = 64  # per-engine memo of tree masks; dynamic trees would otherwise grow it without bound


@dataclass(frozen=True)
class ForwardOut:
    logits: torch.Tensor  # (n, V) float32
    hidden: torch.Tensor | None  # (n, H) last-layer hidden states (after the final norm), when asked
    features: torch.Tensor | None = None  # (n, k H) outputs of the k asked decoder layers, concatenated
    residual: torch.Tensor | None = None  # (n, H) a partial forward's residual stream after its last layer


@dataclass(frozen=True)
class Resume:
    """Self-speculation's shared cache (LayerSkip, Elhoushi et al. 2024): the first m nodes of a tree already
    ran the target's layers [0, ``layer``) on this engine — their KV of those layers is pending in its cache
    — and ``hidden`` (m, H) is their residual stream entering layer ``layer``. The verify forward runs layers
    [0, layer) only for the other nodes and continues every node from there."""

    layer: int
    hidden: torch.Tensor  # (m, H)

    @property
    def nodes(self) -> int:
        return int(self.hidden.shape[0])


class BufferLayer(DynamicLayer):
    """One layer's KV in preallocated (1, H, capacity, D) buffers; ``update`` writes at ``length`` and returns
    views, so no per-step concatenation copies the whole cache."""

    def __init__(self, capacity: int, store: torch.dtype | None = None):
        """``store``: the buffers' dtype where it is not the written states' (a bf16 cache under float32
        attention, ``mixed_attention.cache_dtype``)."""
        super().__init__()
        self.capacity = capacity
        self.store = store
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.store or key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.kbuf = key_states.new_zeros(b, h, self.capacity, d, dtype=self.dtype)
        self.vbuf = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1], dtype=self.dtype)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        s, n = self.length, key_states.shape[-2]
        if s + n > self.capacity:
            self._grow(s + n)
        self.kbuf.narrow(2, s, n).copy_(key_states)  # narrow: one view op where [:, :, a:b] takes three
        self.vbuf.narrow(2, s, n).copy_(value_states)
        self.length = s + n
        self.keys, self.values = self.kbuf.narrow(2, 0, s + n), self.vbuf.narrow(2, 0, s + n)
        return self.keys, self.values

    def reserve(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For a forward that writes its ``n`` slots itself (methods.core.compiled_llama): the buffers,
        allocated like ``like`` (1, H, 0, D) and grown to fit, and the write position; the layer's length
        moves past the n slots."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        s = self.length
        if s + n > self.capacity:
            self._grow(s + n)
        self.length = s + n
        return self.kbuf, self.vbuf, s

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * self.capacity)
        for name in ("kbuf", "vbuf"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], cap, old.shape[-1])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.capacity = cap

    def keep(self, start: int, index: torch.Tensor | int | None, count: int) -> None:
        """Keep ``count`` slots after ``start``; ``index``: where the last of them comes from when it moves
        (an int), or the slots start + count - len(index) .. start + count - 1 (ascending) come from
        ``index``; the slots before them stay in place (None: all stay)."""
        if index is not None and self.is_initialized:
            if type(index) is int:  # one slot moves down (a tree path leaving the draft's first branch last)
                dst = start + count - 1
                self.kbuf.narrow(2, dst, 1).copy_(self.kbuf.narrow(2, index, 1))
                self.vbuf.narrow(2, dst, 1).copy_(self.vbuf.narrow(2, index, 1))
            else:  # advanced indexing on the right copies first, so overlapping source/destination is safe
                a = start + count - index.numel()
                self.kbuf[:, :, a : start + count] = self.kbuf[:, :, index]
                self.vbuf[:, :, a : start + count] = self.vbuf[:, :, index]
        self.length = start + count

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        assert tokens_to_remove <= 0, "transformers 5.x convention: a negative count"
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0


def _moved_slots(tail: list[int], start: int, device: torch.device) -> torch.Tensor | int | None:
    """``BufferLayer.keep``'s ``index`` for ``tail``, the kept pending nodes from the first one not at its
    final slot on (kept nodes are ascending: each final slot is at or below the node's own): None when all
    are in place, the slot itself when one node moves (a tree path that leaves the draft's first branch at
    its last node: two slice copies per layer instead of a gather of the whole path, ~0.5x the commit's time
    there), else the slots."""
    if not tail:
        return None
    if len(tail) == 1:
        return start + tail[0]
    return torch.tensor(tail, device=device) + start


class ModelEngine:
    """Owns the KV cache of one sequence on one model. All methods run under ``torch.inference_mode``."""

    def __init__(self, model: PreTrainedModel, capacity: int | None = None, fast: bool = True,
                 pack: bool | None = None, compile: bool | None = None):
        """``fast``: the lean Llama forward where the model supports it; ``pack``: its oneDNN-prepacked CPU
        projections (None = where they work, see ``methods.core.fast_llama``); ``compile``: its short
        forwards as one inductor graph (methods.core.compiled_llama; None = ``COMPILE``, the process's
        default, set by ``set_compile``)."""
        self.model = model
        cpu_fp32_attention = torch.float32 if model.device.type == "cpu" else None
        compile = COMPILE if compile is None else compile
        self.fast = (FastLlama(model, cpu_fp32_attention, pack, compile) if fast and supports_fast(model)
                     else None)
        self.base = model.base_model  # the decoder stack (LlamaModel, GPT2Model, GPTNeoXModel, ...)
        self.head = model.get_output_embeddings()
        self.context = context_length(model)
        self.device, self.dtype = model.device, model.dtype
        self.n_layers = n_layers = model.config.get_text_config().num_hidden_layers
        cap = min(capacity or self.context, self.context)
        self.mask_dtype = self.fast.attn_dtype if self.fast is not None else self.dtype  # = the attention's
        store = (cache_dtype(model, self.mask_dtype, self.fast is not None and not self.fast.compiled)
                 if MIXED_CACHE else None)
        self.cache = Cache(layers=[BufferLayer(cap, store) for _ in range(n_layers)])
        self._neg = torch.finfo(self.mask_dtype).min
        self._mask = torch.zeros(1, 1, 0, 0, dtype=self.mask_dtype, device=self.device)
        self._tree_memo: dict[Tree, tuple[torch.Tensor | None, torch.Tensor, np.ndarray, int]] = {}
        self.reset()

    # ---- state ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the sequence (buffers are kept for the next one)."""
        self.length = 0  # committed tokens in the cache
        self._pos: list[int] = []  # position of each pending node
        self._anc = np.zeros((0, 0), dtype=bool)  # (P, P) pending ancestor-or-self relation
        for layer in self.cache.layers:
            layer.reset()

    @property
    def pending(self) -> int:
        return len(self._pos)

    def check_fits(self, n_tokens: int) -> None:
        """Clear error (instead of an index error deep in attention) when positions would pass the context."""
        if n_tokens > self.context:
            raise ValueError(
                f"sequence of {n_tokens} tokens exceeds the model's context of {self.context} positions "
                f"({type(self.model).__name__}); shorten the prompt or lower max_new_tokens"
            )

    # ---- forwards -------------------------------------------------------------------------------------
    @inference
    def prefill(self, ids: torch.Tensor, hidden: bool = False, layers: tuple[int, ...] = ()
                ) -> ForwardOut | None:
        """Append committed tokens ids (T,) causally; logits of the last one (and hidden of all, and the
        outputs of decoder ``layers`` of all, if asked). Returns None for an empty ``ids``."""
        assert self.pending == 0, "commit or drop pending nodes before a prefill"
        n = int(ids.numel())
        if n == 0:
            return None
        self.check_fits(self.length + n)
        out = self.extend(ids, list(range(-1, n - 1)), hidden=hidden, last_only=True, layers=layers)
        self.commit(range(n))
        return out

    @inference
    def forward_tree(self, tokens: torch.Tensor, tree: Tree, hidden: bool = False,
                     layers: tuple[int, ...] = (), resume: Resume | None = None) -> ForwardOut:
        """ONE forward over all tree nodes (tokens (N,), node 0 = root) after the committed prefix;
        ``layers``: decoder layers whose outputs come back as ``features``. ``resume``: the first m nodes are
        pending already, through layers [0, resume.layer) (self-speculation's shared cache: ``Resume``)."""
        bias, depths, anc, depth = self._tree_consts(tree)
        self.check_fits(self.length + depth + 1)
        if resume is not None:
            return self._resume(tokens, tree, (bias, depths, anc), hidden, resume)
        assert self.pending == 0, "forward_tree starts from a fully committed cache"
        self._anc, self._pos = anc, (tree.depths + self.length).tolist()
        return self._forward(tokens, bias, depths + self.length, hidden, 0, layers=layers)

    def _resume(self, tokens: torch.Tensor, tree: Tree, consts: tuple, hidden: bool, resume: Resume
                ) -> ForwardOut:
        """Layers [0, E) for nodes m..N-1 (mask rows m..N-1: they see the pending nodes 0..m-1 through the
        KV the draft wrote), then layers [E, L) for all N nodes from the joined residuals."""
        assert self.fast is not None, "resume needs the lean Llama forward (methods.core.fast_llama)"
        bias, depths, anc = consts
        m, n, e = resume.nodes, tree.size, resume.layer
        pos = (tree.depths + self.length).tolist()
        assert self.pending == m <= n, f"resume of {m} nodes with {self.pending} pending, tree of {n}"
        assert self._pos == pos[:m] and (self._anc == anc[:m, :m]).all(), "pending nodes are not the tree's"
        self._check_kv(range(e), self.length + m)
        self._check_kv(range(e, self.n_layers), self.length)
        self._anc, self._pos = anc, pos
        mask = None if bias is None else self._mask_view(n, self.length, bias)  # (1, 1, N, L + N)
        position = depths + self.length
        x = resume.hidden.to(self.dtype)
        if m < n:
            new = self.fast.embed_tokens(tokens[m:].reshape(n - m).to(self.device))
            rows = None if mask is None else mask[:, :, m:]
            new = self.fast.layers_forward(new, position[m:], rows, self.cache.layers, SubLayers(stop=e))
            x = torch.cat([x, new])  # (N, H)
        x = self.fast.layers_forward(x, position, mask, self.cache.layers, SubLayers(start=e))
        if bias is not None:
            mask[0, 0, :, self.length :].zero_()
        h = self.fast.final_norm(x)
        return ForwardOut(self.fast.logits(h).float(), h if hidden else None)

    @inference
    def extend(
        self, tokens: torch.Tensor, parents: Sequence[int], hidden: bool = False, last_only: bool = False,
        layers: tuple[int, ...] = (), sub: SubLayers | None = None, logits_from: int = 0,
    ) -> ForwardOut:
        """Append pending nodes; parents[i] is a pending index (earlier, or one of these: P + j, j < i) or -1
        for the committed prefix. Returns logits of the new nodes from index ``logits_from`` on (or the last
        one's only: ``last_only``); the LM head runs on those rows alone (a catch-up over a whole prompt needs
        one or a few). ``sub``: a partial forward (self-drafting, lean Llama only) through those sub-layers,
        logits from the target's own final norm and LM head on its last residual (early exit), KV written
        only into the layers whose attention ran; ``residual`` comes back. Every pending node must have run
        the same sub-layers; drop them (``drop_pending``) or continue them with ``forward_tree(...,
        resume=...)`` before a full forward."""
        p0, n = self.pending, len(parents)
        first = n - 1 if last_only else logits_from
        assert 0 <= first < n, f"logits from row {first} of {n} new nodes"
        anc = np.zeros((p0 + n, p0 + n), dtype=bool)
        anc[:p0, :p0] = self._anc
        pos = self._pos + [0] * n
        for i, par in enumerate(parents):
            row = p0 + i
            if par >= 0:
                assert par < row, f"parent {par} of new node {row} is not earlier"
                anc[row] = anc[par]
            anc[row, row] = True
            pos[row] = pos[par] + 1 if par >= 0 else self.length
        self.check_fits(max(pos[p0:]) + 1)
        self._anc, self._pos = anc, pos
        rows = anc[p0:]
        bias = None if rows.all() else self._bias(rows)
        position = torch.tensor(pos[p0:], dtype=torch.long, device=self.device)
        if sub is not None and not sub.is_full:
            return self._partial(tokens, bias, position, first, sub)
        return self._forward(tokens, bias, position, hidden, first, layers)

    def _partial(self, tokens: torch.Tensor, bias: torch.Tensor | None, position: torch.Tensor,
                 logits_from: int, sub: SubLayers) -> ForwardOut:
        assert self.fast is not None, "partial forwards need the lean Llama forward (methods.core.fast_llama)"
        n = int(tokens.numel())
        start = self.length + self.pending - n
        self._check_kv(sub.writes_kv(self.n_layers), start)
        mask = None if bias is None else self._mask_view(n, start, bias)
        x = self.fast.embed_tokens(tokens.reshape(n).to(self.device))
        x = self.fast.layers_forward(x, position, mask, self.cache.layers, sub)  # (n, H) residual
        if bias is not None:
            mask[0, 0, :, self.length :].zero_()
        h = self.fast.final_norm(x[logits_from:])
        return ForwardOut(self.fast.logits(h).float(), None, residual=x)

    def _check_kv(self, layers: Sequence[int], start: int) -> None:
        """The layers about to append must hold exactly the cache slots before the new nodes."""
        bad = [i for i in layers if self.cache.layers[i].length != start]
        assert not bad, (f"layers {bad} hold {[self.cache.layers[i].length for i in bad]} slots, expected "
                         f"{start}: pending nodes ran other sub-layers (drop them or resume them)")

    def _forward(
        self, tokens: torch.Tensor, bias: torch.Tensor | None, position: torch.Tensor, hidden: bool,
        logits_from: int, layers: tuple[int, ...] = (),
    ) -> ForwardOut:
        n = int(tokens.numel())
        start = self.length + self.pending - n  # cache slots before these nodes
        ids = tokens.reshape(n).to(self.device)
        taps = dict.fromkeys(layers) if layers else None
        if self.fast is not None:  # no mask = attend to everything (one node whose ancestors are all pending)
            mask = None if bias is None else self._mask_view(n, start, bias)
            h = self.fast.forward(ids, position, mask, self.cache.layers, taps)  # (n, H)
            if taps is not None and self.n_layers - 1 in taps:  # HF's last hidden state is after the norm
                taps[self.n_layers - 1] = h
        else:
            mask = self._mask_view(n, start, bias)
            out = self.base(
                input_ids=ids.view(1, n),
                attention_mask=mask,
                position_ids=position.view(1, n),
                past_key_values=self.cache,
                use_cache=True,
                output_hidden_states=bool(layers),
            )
            h = out.last_hidden_state[0]  # (n, H)
            if taps is not None:
                taps = {i: out.hidden_states[i + 1][0] for i in layers}
        if bias is not None:  # the tree block of the mask becomes prefix columns later: restore zeros
            mask[0, 0, :, self.length :].zero_()
        h_out = h[logits_from:]  # (n - logits_from, H)
        logits = (self.fast.logits(h_out) if self.fast is not None else self.head(h_out)).float()
        features = torch.cat([taps[i] for i in layers], dim=-1) if taps is not None else None  # (n, k H)
        return ForwardOut(logits, h if hidden else None, features)

    def _mask_view(self, n: int, start: int, bias: torch.Tensor | None) -> torch.Tensor:
        """(1, 1, n, start + n) additive mask: 0 on the prefix, ``bias`` over the pending columns."""
        width = start + n
        if self._mask.shape[2] < n or self._mask.shape[3] < width:
            old_rows, old_cols = self._mask.shape[2:]
            rows = max(n, old_rows)
            cols = old_cols if width <= old_cols else max(width, 2 * old_cols, 64)  # amortised growth
            self._mask = torch.zeros(1, 1, rows, cols, dtype=self.mask_dtype, device=self.device)
        mask = self._mask[:, :, :n, :width]
        if bias is not None:
            mask[0, 0, :, self.length :] = bias
        return mask

    def _bias(self, rows: np.ndarray) -> torch.Tensor:
        """(n, P) bool attend-matrix → additive float bias on the device."""
        if self.device.type == "cpu" and self.mask_dtype == torch.float32:  # one numpy op, no torch ops
            return torch.from_numpy(np.where(rows, np.float32(0.0), np.float32(self._neg)))
        allowed = torch.from_numpy(rows).to(self.device, non_blocking=True)
        kw = {"dtype": self.mask_dtype, "device": self.device}
        return torch.where(allowed, torch.zeros((), **kw), torch.full((), self._neg, **kw))

    def _tree_consts(self, tree: Tree) -> tuple[torch.Tensor | None, torch.Tensor, np.ndarray, int]:
        hit = self._tree_memo.get(tree)
        if hit is None:
            anc = tree.ancestor_mask
            bias = None if anc.all() else self._bias(anc)
            depths = torch.as_tensor(tree.depths, dtype=torch.long, device=self.device)
            if len(self._tree_memo) >= _MAX_TREE_CACHE:
                self._tree_memo.clear()
            hit = self._tree_memo[tree] = (bias, depths, anc, tree.depth)
        return hit

    # ---- commit ---------------------------------------------------------------------------------------
    @inference
    def commit(self, keep: Sequence[int]) -> None:
        """Keep the pending nodes ``keep`` (ascending pending indices, e.g. the accepted root-first path) as
        committed tokens; drop the other pending nodes."""
        keep = list(keep)
        count = len(keep)
        assert all(0 <= k < self.pending for k in keep), f"keep {keep} outside pending {self.pending}"
        assert all(a < b for a, b in zip(keep, keep[1:])), "keep must be ascending"
        moved = next((i for i, k in enumerate(keep) if k != i), count)  # keep[:moved] are in place already
        index = _moved_slots(keep[moved:], self.length, self.device)
        for layer in self.cache.layers:
            layer.keep(self.length, index, count)
        self.length += count
        self._pos, self._anc = [], np.zeros((0, 0), dtype=bool)

    def drop_pending(self) -> None:
        self.commit(())

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` committed tokens (and no pending node)."""
        assert 0 <= length <= self.length, f"cannot truncate {self.length} tokens to {length}"
        self.drop_pending()
        for layer in self.cache.layers:
            layer.length = length
        self.length = length
