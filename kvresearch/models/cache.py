"""A compressed KV cache with real eviction: ragged per KV head, packed storage, additive logit bias.

Per layer, KV head ``h`` owns the rows ``starts[h] : starts[h] + lengths[h]`` of one packed buffer per
field: keys and values (cap, head_dim), bias (cap,) float32 and pos (cap,) int64, the rotary position of
each entry. New tokens are appended (a head that runs out grows by a quarter); evicted entries are first
masked (bias = -inf) and physically removed by :meth:`RaggedLayer.compact`, which reallocates the
buffers at the size of what is kept, so memory falls. The cache reports the original number of tokens
as its sequence length, so the rotary positions of new tokens continue from the original length.

A sliding-window layer (window ``W``) also drops the entries no later query can see: new tokens come at
positions ``>= seen``, and a query at ``p`` sees ``pos`` only if ``p - pos < W``, so an entry at
``pos <= seen - W`` is dead weight. They go at :meth:`RaggedLayer.compact` and whenever a head would
have to grow, so such a layer holds at most ``W - 1`` old entries plus the growth slack, whatever the
context length. The prune ratio counts what the next query can see, for every method and for the full
cache alike: a sliding layer stands for its last ``W - 1`` positions and keeps the live entries among them
(:meth:`RaggedLayer.visible_per_head`), so a method is not credited with entries the window hides anyway.

Attention over it runs through the ``kvr_ragged`` attention implementation (``ragged_attention.py``).
Batch size 1 only: a larger batch is refused with an error.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvresearch.errors import KVResearchError
from kvresearch.ops.attention import head_views

DEAD = float("-inf")


class RaggedLayer(CacheLayerMixin):
    """One layer's ragged storage (see the module docstring)."""

    is_sliding = False
    kernel = "auto"  # attention over this layer: auto (Triton for CUDA decode steps, else torch) | triton | torch

    def __init__(self, window: int | None = None):
        super().__init__()
        self.window = window  # sliding-window layers mask by position (and may evict beyond the window)

    # ------------------------------------------------------------------ transformers' cache protocol
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate empty buffers shaped after the first keys and values (batch size 1 only)."""
        if key_states.shape[0] != 1:
            raise KVResearchError(
                f"The compressed cache supports batch size 1 (got {key_states.shape[0]}): run samples one at a time."
            )
        _, kv_heads, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.k = key_states.new_empty(0, d)
        self.v = value_states.new_empty(0, value_states.shape[-1])
        self.bias = torch.empty(0, dtype=torch.float32, device=self.device)
        self.pos = torch.empty(0, dtype=torch.long, device=self.device)
        self.starts = torch.zeros(kv_heads, dtype=torch.long)
        self.lengths = torch.zeros(kv_heads, dtype=torch.long)
        self.caps = torch.zeros(kv_heads, dtype=torch.long)
        self.dead = torch.zeros(kv_heads, dtype=torch.long)
        self.hidden = torch.zeros(kv_heads, dtype=torch.long)  # kept entries dropped as out of the window
        self.seen = 0  # tokens ever appended: the sequence length the model sees
        self.stride: int | None = None  # rows between heads when all hold as many entries in equal capacities
        self.new_positions = torch.empty(0, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None
    ) -> tuple[Any, Any]:
        """Append (1, kv_heads, T, d) new keys/values; the attention function reads this layer directly."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[2]
        positions = (cache_kwargs or {}).get("cache_position")
        if positions is None:
            positions = torch.arange(self.seen, self.seen + n_new, device=self.device)
        self.append(key_states[0], value_states[0], positions.to(self.device))
        return self, self

    def get_mask_sizes(self, query: torch.Tensor | int) -> tuple[int, int]:
        """Sizes that let transformers build no mask: the ragged attention masks by entry positions.

        ``query``: the query positions (transformers < 5.17) or their number (5.17 and later).
        """
        return (query.shape[0] if isinstance(query, torch.Tensor) else int(query)), 0

    def get_seq_length(self) -> int:
        """Tokens ever appended: new tokens continue at this position."""
        return self.seen if self.is_initialized else 0

    def get_max_cache_shape(self) -> int:
        """No fixed size (transformers < 5.16)."""
        return -1

    def get_max_length(self) -> int:
        """No fixed size (transformers 5.16 and later)."""
        return -1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The dense shape this layer stands for, (1, kv_heads, seen, head_dim), for code that inspects keys."""
        return (1, len(self.caps), self.seen, self.k.shape[1])

    # ------------------------------------------------------------------ storage
    def append(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        """k, v: (kv_heads, T, d); positions (T,) or per head (kv_heads, T); bias (kv_heads, T) or None (zeros)."""
        n_new = k.shape[1]
        if self.stride is not None and int(self.lengths[0]) + n_new <= self.stride:  # the uniform layout, room left
            self._append_uniform(k, v, positions, bias)
            return
        need = self.lengths + n_new
        if bool((need > self.caps).any()):  # grow by a quarter (at least 64 rows): <= 25% slack
            keep = self._reachable(int(positions.min()))
            if keep is None:
                self._relayout(torch.maximum(self.caps + torch.clamp(self.caps // 4, min=64), need), None)
            else:  # first drop what the window hides from the new tokens, then size after what is left
                self._count_hidden(keep)
                left = torch.tensor([len(i) for i in keep])
                self._relayout(torch.maximum(left + torch.clamp(left // 4, min=64), left + n_new), keep)
        rows = (self.starts + self.lengths)[:, None] + torch.arange(n_new)  # (Hkv, T)
        rows = rows.reshape(-1).to(self.device)
        self.k[rows] = k.reshape(-1, k.shape[-1]).to(self.dtype)
        self.v[rows] = v.reshape(-1, v.shape[-1]).to(self.dtype)
        self.bias[rows] = 0.0 if bias is None else bias.reshape(-1).float().to(self.device)
        self.pos[rows] = positions.expand(k.shape[0], -1).reshape(-1)  # (T,) for all heads, or (Hkv, T)
        self.lengths += n_new
        self.seen = max(self.seen, int(positions.max()) + 1)
        self.new_positions = positions
        self.stride = self._uniform_stride() if n_new and self.stride is None else self.stride

    def _append_uniform(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        """``append`` when every head holds as many entries at ``stride``: strided writes, no row indices."""
        n_new, first, heads = k.shape[1], int(self.lengths[0]), len(self.caps)
        assert self.stride is not None
        view = lambda t: head_views(t, 0, self.stride, heads)[:, first : first + n_new]
        view(self.k).copy_(k)
        view(self.v).copy_(v)
        view(self.pos).copy_(positions.expand(heads, n_new))
        if bias is None:
            view(self.bias).fill_(0.0)
        else:
            view(self.bias).copy_(bias.float())
        self.lengths += n_new
        self.seen = max(self.seen, int(positions.max()) + 1)
        self.new_positions = positions

    def _uniform_stride(self) -> int | None:
        """``caps[0]`` when every head has that capacity and as many entries (the uniform layout), else None."""
        same = len(self.caps) and not bool((self.caps != self.caps[0]).any() or (self.lengths != self.lengths[0]).any())
        return (int(self.caps[0]) or None) if same else None

    def _relayout(self, caps: torch.Tensor, keep: Sequence[torch.Tensor] | None) -> None:
        """Reallocate with per-head capacities ``caps``, copying all entries or only ``keep[h]`` (indices)."""
        starts, total = torch.cumsum(caps, 0) - caps, int(caps.sum())
        k, v = self.k.new_empty(total, self.k.shape[1]), self.v.new_empty(total, self.v.shape[1])
        bias, pos, lengths = (
            self.bias.new_full((total,), DEAD),
            self.pos.new_zeros(total),
            torch.zeros_like(self.lengths),
        )
        for h in range(len(caps)):
            first, n = int(self.starts[h]), int(self.lengths[h])  # all entries by a slice: one copy, no gather
            src = slice(first, first + n) if keep is None else first + keep[h].to(self.device)
            dst = slice(int(starts[h]), int(starts[h]) + (n if keep is None else len(keep[h])))
            k[dst], v[dst], bias[dst], pos[dst] = self.k[src], self.v[src], self.bias[src], self.pos[src]
            lengths[h] = dst.stop - dst.start
        self.k, self.v, self.bias, self.pos = k, v, bias, pos
        self.starts, self.lengths, self.caps = starts, lengths, caps.clone()
        self.stride = self._uniform_stride()

    def copy(self, slack: int = 0) -> RaggedLayer:
        """A copy in new buffers with room for ``slack`` more entries per head (appending them needs no growth)."""
        out = copy.copy(self)
        if self.is_initialized:
            out.dead, out.hidden = self.dead.clone(), self.hidden.clone()
            out._relayout(self.lengths + slack, None)
        return out

    def head_rows(self, h: int) -> torch.Tensor:
        """Buffer rows of head h's entries."""
        start = int(self.starts[h])
        return torch.arange(start, start + int(self.lengths[h]), device=self.device)

    def head_positions(self, h: int) -> torch.Tensor:
        """Rotary positions of head h's entries."""
        return self.pos[self.head_rows(h)]

    def alive(self, h: int) -> torch.Tensor:
        """(lengths[h],) bool: entries of head h not evicted."""
        return self.bias[self.head_rows(h)] != DEAD

    def evict(self, h: int, positions: torch.Tensor) -> int:
        """Mask the entries of head h at these rotary positions; returns how many were alive."""
        rows = self.head_rows(h)
        hit = torch.isin(self.pos[rows], positions.to(self.device)) & (self.bias[rows] != DEAD)
        self.bias[rows[hit]] = DEAD
        n = int(hit.sum())
        self.dead[h] += n
        return n

    def compact(self, slack: int = 0) -> None:
        """Remove masked entries, and in a sliding layer those no later query sees: buffers shrink (+ ``slack``)."""
        reachable = self._reachable(self.seen)
        keep = [torch.nonzero(self.alive(h)).view(-1) for h in range(len(self.caps))]
        if reachable is not None:
            self._count_hidden(reachable)
            keep = [k[torch.isin(k, r)] for k, r in zip(keep, reachable, strict=True)]
        self._relayout(torch.tensor([len(k) + slack for k in keep]), keep)
        self.dead.zero_()

    def _reachable(self, first_query: int) -> list[torch.Tensor] | None:
        """Per head, indices of the entries a query at ``first_query`` or later can see (None: all of them)."""
        if self.window is None:
            return None
        visible = [self.head_positions(h) > first_query - self.window for h in range(len(self.caps))]
        if all(bool(v.all()) for v in visible):
            return None
        return [torch.nonzero(v).view(-1) for v in visible]

    def _count_hidden(self, reachable: Sequence[torch.Tensor]) -> None:
        """Before the entries outside ``reachable[h]`` go: count the live ones as hidden, the dead ones off."""
        for h, indices in enumerate(reachable):
            gone = torch.ones(int(self.lengths[h]), dtype=torch.bool, device=self.device)
            gone[indices.to(self.device)] = False
            alive = self.alive(h)
            self.hidden[h] += int((gone & alive).sum())
            self.dead[h] -= int((gone & ~alive).sum())
        self.dead.clamp_(min=0)

    def keep_only(self, keep: Sequence[torch.Tensor]) -> None:
        """Keep, per head, the entries at indices ``keep[h]`` (into the head's current entries)."""
        self._relayout(torch.tensor([len(k) for k in keep]), keep)
        self.dead.zero_()

    def set_bias(self, h: int, bias: torch.Tensor) -> None:
        """Set head h's additive logit biases (lengths[h],)."""
        self.bias[self.head_rows(h)] = bias.float().to(self.device)

    def set_values(self, h: int, values: torch.Tensor) -> None:
        """Replace head h's values (lengths[h], head_dim), e.g. by values fitted by Attention Matching."""
        self.v[self.head_rows(h)] = values.to(self.dtype).to(self.device)

    # ------------------------------------------------------------------ accounting
    def kept_per_head(self) -> torch.Tensor:
        """(kv_heads,) entries not evicted by a method: the stored ones and those the window hid."""
        return self.stored_per_head() + self.hidden

    def visible_per_head(self) -> torch.Tensor:
        """(kv_heads,) entries that count as kept: in a sliding layer, the live ones the next query still sees.

        The next query sits at position ``seen`` and sees positions above ``seen - window``; a global layer
        counts :meth:`kept_per_head`.
        """
        if self.window is None:
            return self.kept_per_head()
        first = self.seen - self.window
        return torch.tensor(
            [int((self.alive(h) & (self.head_positions(h) > first)).sum()) for h in range(len(self.caps))]
        )

    def span(self, seen: int) -> int:
        """Positions per head that ``seen`` tokens stand for: all, or in a sliding layer the ``W - 1`` it shows."""
        return seen if self.window is None else min(seen, self.window - 1)

    def stored_per_head(self) -> torch.Tensor:
        """(kv_heads,) entries held in memory and alive: what a memory budget counts."""
        return self.lengths - self.dead

    def entry_bytes(self) -> int:
        """Bytes of one entry: key, value, bias (fp32) and position (int64)."""
        return (self.k.shape[1] + self.v.shape[1]) * self.k.element_size() + 4 + 8

    def kv_bytes(self) -> dict[str, int]:
        """Dense-equivalent bytes (seen tokens, keys + values only), kept and allocated bytes."""
        per_kv = (self.k.shape[1] + self.v.shape[1]) * self.k.element_size()
        return {
            "dense": self.seen * len(self.caps) * per_kv,
            "kept": int(self.stored_per_head().sum()) * self.entry_bytes(),
            "allocated": int(self.caps.sum()) * self.entry_bytes(),
        }


class RaggedCache(Cache):
    """One :class:`RaggedLayer` per decoder layer; plugs into transformers as ``past_key_values``."""

    def __init__(self, num_layers: int, windows: Sequence[int | None] | None = None):
        windows = list(windows) if windows is not None else [None] * num_layers
        super().__init__(layers=[RaggedLayer(w) for w in windows])
        self.method_state: dict[str, Any] = {}  # a method's per-cache state (e.g. KVzap's pending window)
        self.stands_for: int | None = None  # tokens of the original context, when the cache holds a rewrite of it

    @property
    def ragged(self) -> list[RaggedLayer]:
        """The layers."""
        return [layer for layer in self.layers if isinstance(layer, RaggedLayer)]

    def kv_bytes(self) -> dict[str, int]:
        """Dense-equivalent, kept and allocated bytes over all layers."""
        totals = {"dense": 0, "kept": 0, "allocated": 0}
        for layer in self.ragged:
            if layer.is_initialized:
                for key, value in layer.kv_bytes().items():
                    totals[key] += value
        return totals

    def use_kernel(self, kernel: str) -> RaggedCache:
        """Attend with ``kernel`` in every layer: auto, triton (the decode kernel) or torch (``ops/attention.py``)."""
        if kernel not in ("auto", "triton", "torch"):
            raise KVResearchError(f"Unknown attention kernel '{kernel}'; use auto, triton or torch.")
        for layer in self.ragged:
            layer.kernel = kernel
        return self

    def copy(self, slack: int = 0) -> RaggedCache:
        """A copy in new buffers, each head with room for ``slack`` more entries: generating from it copies once."""
        out = copy.copy(self)
        out.layers = [
            layer.copy(slack) if isinstance(layer, RaggedLayer) else copy.deepcopy(layer) for layer in self.layers
        ]
        out.method_state = copy.deepcopy(self.method_state)
        return out

    def compact(self, slack: int = 0) -> None:
        """Physically remove evicted entries in every layer."""
        for layer in self.ragged:
            if layer.is_initialized:
                layer.compact(slack)

    def splice(self, prefix: RaggedCache, start: int) -> None:
        """Take ``prefix``'s layers, followed by this cache's entries at positions >= ``start``.

        Every KV head must hold the same positions from ``start`` on (they are appended as one block).
        """
        for index, (old, new) in enumerate(zip(self.ragged, prefix.ragged, strict=True)):
            if not old.is_initialized:
                continue
            tail = [old.head_rows(h)[old.pos[old.head_rows(h)] >= start] for h in range(len(old.caps))]
            if len({len(t) for t in tail}) != 1:
                raise KVResearchError(f"splice: the KV heads of layer {index} keep different entries from {start} on.")
            rows = torch.stack(tail)  # (Hkv, entries from start on)
            new.append(old.k[rows], old.v[rows], old.pos[rows[0]], old.bias[rows])
            self.layers[index] = new

    def stats(self) -> dict[str, Any]:
        """Tokens seen and kept per layer and KV head, prune ratios, KV bytes (dense-equivalent, kept, allocated).

        Sliding layers count the positions their window shows (:meth:`RaggedLayer.span`, ``visible_per_head``).
        """
        layers = [layer for layer in self.ragged if layer.is_initialized]
        kept = [layer.visible_per_head().tolist() for layer in layers]
        seen = [layer.span(self.stands_for or layer.seen) * len(k) for layer, k in zip(layers, kept, strict=True)]
        total_seen, total_kept = sum(seen), sum(sum(k) for k in kept)
        return {
            "tokens_seen": total_seen,
            "tokens_kept": total_kept,
            "prune_ratio": 1 - total_kept / total_seen if total_seen else 0.0,
            "prune_ratio_per_layer": [1 - sum(k) / s if s else 0.0 for s, k in zip(seen, kept, strict=True)],
            "kept_per_layer_head": kept,
            "kv_bytes": self.kv_bytes(),
        }

    @classmethod
    def from_layers(
        cls,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        keep: Sequence[Sequence[torch.Tensor]] | None = None,
        windows: Sequence[int | None] | None = None,
    ) -> RaggedCache:
        """A ragged cache of dense keys and values (positions 0..T-1), optionally keeping only ``keep[layer][head]``.

        Args:
            layers: per layer, keys and values of shape (kv_heads, T, head_dim).
            keep: per layer and KV head, indices of the entries to keep (None: all).
            windows: sliding window of each layer (None: all global).
        """
        out = cls(len(layers), windows)
        for i, ((keys, values), dst) in enumerate(zip(layers, out.ragged, strict=True)):
            dst.update(keys[None], values[None], {"cache_position": torch.arange(keys.shape[1], device=keys.device)})
            if keep is not None:
                dst.keep_only(keep[i])
        return out
