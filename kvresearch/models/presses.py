"""kvpress presses with real eviction (model glue: kvpress's cache and module conventions live here).

A press runs during a dense prefill exactly as in kvpress. Its result then moves into the ragged
cache, whatever the press (``models/press_catalog.py`` lists them all):

* presses that drop pairs (the ScorerPress family and its wrappers) leave fewer keys per head, whose
  positions we recover by matching them to the keys captured before the press ran, else to the values;
  presses that re-rotate the keys (KeyRerotationPress, FinchPress) keep theirs in position order at
  ``0 .. m-1``, which needs no position;
* presses that only mask pairs (DMSPress, KVzipPress, AdaKVPress, DuoAttentionPress, ...) leave
  ``module.masked_key_indices``, whose pairs we drop;
* presses that rewrite contents (MergingPress's values, ThinKPress's zeroed key channels, the re-rotated
  keys) hand over their tensors as they are: the ragged cache holds exactly what kvpress's cache holds.

Either way the memory kvpress keeps for masked pairs is freed. Re-rotated keys sit at positions
``0 .. m-1`` (kvpress's pipeline then continues the question at ``m``): the ragged layer says so.

While decoding, :func:`decoding_press` runs kvpress's ``DecodingPress`` on the ragged cache: its own
schedule (every ``compression_interval`` steps per layer), hidden-state buffer and ``compress`` (the base
press's scores, cut to ``target_size``), with the pairs it drops removed from the ragged layer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache

from kvresearch.errors import KVResearchError
from kvresearch.models.cache import RaggedCache
from kvresearch.models.hooks import attention_calls
from kvresearch.models.session import Session


@contextmanager
def cache_positions(adapter: Any) -> Iterator[None]:
    """Give every attention call a ``cache_position`` keyword argument where transformers passes none.

    kvpress 0.5.5's presses read ``kwargs["cache_position"]`` in their hooks; transformers 5.17 no longer passes it
    to the attention modules (5.2 does, and then nothing changes). The positions of the call's tokens follow what
    the layer's cache holds before the call.
    """

    def before(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs.get("cache_position") is not None:
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cache = kwargs.get("past_key_values")
        start = cache.get_seq_length(module.layer_idx) if cache is not None else 0
        kwargs["cache_position"] = torch.arange(start, start + hidden.shape[1], device=hidden.device)
        return args, kwargs

    with attention_hooks(adapter, before, pre=True):
        yield


def row_hashes(x: torch.Tensor) -> torch.Tensor:
    """(rows,) int64: a hash of each row's bytes (rows of ``x`` (rows, d) that are bitwise equal hash equal)."""
    raw = x.detach().contiguous().view(torch.uint8).reshape(x.shape[0], -1)
    pad = (-raw.shape[1]) % 8
    words = torch.nn.functional.pad(raw, (0, pad)).view(torch.int64)  # (rows, words)
    weights = torch.randint(1, 2**62, (words.shape[1],), generator=torch.Generator().manual_seed(0))
    return (words * weights.to(words.device) | 1).sum(dim=1)  # wraps around: a hash, not a number


def _positions_of(kept: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Indices into ``original`` (T, d) of the rows of ``kept`` (n, d), which are copies of distinct rows of it.

    A press gathers the rows it keeps, so each is a bitwise copy: they are looked up by a hash of their bytes
    (sorted and searched, O(T log T) in tensor operations), and the rows found are checked bit for bit. Where
    that is not enough (a row not found, two original rows alike), :func:`_nearest_positions` decides, in O(n T d).
    """
    rows = _exact_positions(kept, original)
    return _nearest_positions(kept, original) if rows is None else rows


def _exact_positions(kept: torch.Tensor, original: torch.Tensor) -> torch.Tensor | None:
    """:func:`_positions_of` where every row of ``kept`` is a bitwise copy of a distinct row; else None."""
    if kept.dtype == original.dtype and kept.shape[0] <= original.shape[0]:
        rows = _hashed_positions(kept, row_hashes(original))
        if rows is not None and torch.equal(original[rows], kept):
            return rows
    return None


def _nearest_positions(kept: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """:func:`_positions_of` by distance: the nearest rows, each used once.

    Two identical rows of ``original`` are told apart by order of certainty.
    """
    exact = "donot_use_mm_for_euclid_dist"  # the matmul shortcut loses the digits that tell near rows apart
    distances = torch.cdist(kept.float(), original.float(), compute_mode=exact)  # (n, T)
    rows = distances.argmin(dim=1)
    if len(set(rows.tolist())) == len(rows):
        return rows
    taken = torch.zeros(original.shape[0], dtype=torch.bool, device=distances.device)
    for i in distances.min(dim=1).values.argsort().tolist():
        rows[i] = distances[i].masked_fill(taken, float("inf")).argmin()
        taken[rows[i]] = True
    return rows


@torch.no_grad()
def press_prefill(
    session: Session, ids: torch.Tensor, press: Any, attn_implementation: str | None = None
) -> RaggedCache:
    """Prefill ``ids`` (1, T) with ``press`` applied (kvpress's own code) and return what it kept, ragged.

    Where the press compresses inside each layer's forward (kvpress's ``BasePress`` context manager), a layer
    moves into the ragged cache as soon as the press has run on it, and its dense pairs are freed: at most one
    layer is held densely besides what is kept. Presses that evict after the prefill (KVzip, KVgrad, Fast KVzip,
    KVCompose) move at the end; until then they hold a hash of each captured key and value row (16 bytes a pair)
    instead of a copy, and find the kept pairs by hash. A press that re-rotates the keys (FinchPress,
    KeyRerotationPress) holds nothing: it keeps its pairs in the order of their positions, at ``0 .. m-1``, so
    they move as kvpress left them. The peak of the bytes held (dense cache, pairs or hashes captured before the
    press, ragged cache) is in ``cache.method_state["peak_kv_bytes"]``.

    Args:
        session: the model.
        ids: (1, T) the context.
        press: a kvpress press.
        attn_implementation: run the prefill with this attention (e.g. "eager" for presses that read the
            attention weights); the model's own is restored afterwards.
    """
    from kvpress.presses.base_press import BasePress

    model = session.model
    ids = ids.to(session.device)
    originals: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    dense = DynamicCache()
    out = RaggedCache(len(session.adapter.layers), session.windows)
    peak = 0

    clear_masks(session.adapter)
    late = type(press).__call__ is not BasePress.__call__  # its layers move after the prefill, not as it runs
    rerotated = rerotates(press)  # its pairs need no position: nothing is held before it
    hashed = late and not rerotated  # hold row hashes (Hkv, T) of every layer, not copies of its pairs

    def record(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Note the context's pairs before the press: copies (Hkv, T, d), hashes (Hkv, T), or none (re-rotation)."""
        if layer not in originals:
            k, v = k[0].detach(), v[0].detach()
            if rerotated:
                originals[layer] = (None, None)
            else:
                originals[layer] = (_head_hashes(k), _head_hashes(v)) if hashed else (k.clone(), v.clone())

    def observe() -> None:
        nonlocal peak
        held = sum(_nbytes(e.keys, e.values) for e in dense.layers) + sum(_nbytes(*t) for t in originals.values())
        peak = max(peak, held + out.kv_bytes()["allocated"])

    def settle(module: Any, _args: tuple, _kwargs: dict, _output: Any) -> None:
        observe()
        if not late and int(module.layer_idx) in originals:
            _move(session, press, dense, originals, out, int(module.layer_idx), ids.shape[1])

    previous = model.config._attn_implementation
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    try:
        with (
            attention_calls(session.adapter, record),
            cache_positions(session.adapter),
            attention_hooks(session.adapter, lambda *_: observe()),  # before the press: its layer still whole
            press(model),
            attention_hooks(session.adapter, settle),  # registered after the press's hooks: runs after them
        ):
            model(input_ids=ids, past_key_values=dense, use_cache=True, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    observe()
    for index in sorted(originals):
        _move(session, press, dense, originals, out, index, ids.shape[1])
    out.method_state["peak_kv_bytes"] = peak
    return out


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@contextmanager
def attention_hooks(adapter: Any, hook: Any, pre: bool = False) -> Iterator[None]:
    """``hook`` on every attention module inside the block.

    ``hook(module, args, kwargs, output)`` runs after the module's forward and after hooks registered before it;
    with ``pre``, ``hook(module, args, kwargs)`` runs before the forward.
    """
    register = "register_forward_pre_hook" if pre else "register_forward_hook"
    handles = [getattr(layer.attn, register)(hook, with_kwargs=True) for layer in adapter.layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _move(
    session: Session, press: Any, dense: DynamicCache, originals: dict, out: RaggedCache, index: int, n: int
) -> None:
    """Move layer ``index`` of ``dense`` (after the press) into ``out``; free its dense pairs and captured pairs."""
    spec, layer, entry = session.adapter.layers[index], out.ragged[index], dense.layers[index]
    assert entry.keys is not None and entry.values is not None
    keys, values = entry.keys[0], entry.values[0]  # (Hkv, n or n_kept, d)
    before = originals.pop(index)
    if keys.shape[1] > n and not appends(press):
        raise KVResearchError(
            f"{type(press).__name__} left {keys.shape[1]} pairs in layer {index} for a context of {n} tokens (pairs "
            "of its own extra passes that kvpress keeps too); it cannot be bridged. For KVComposePress, set "
            "structured=true."
        )
    if keys.shape[1] >= n:  # pairs masked (or none touched): keep the unmasked ones
        if keys.shape[1] > n:  # the press appended pairs of its own (RestoreKV's restore tokens) after the context
            out.stands_for, n = n, keys.shape[1]
        mask = torch.ones(keys.shape[0], n, dtype=torch.bool)
        masked = getattr(spec.attn, "masked_key_indices", None)
        if masked is not None:
            _, heads, positions = masked
            mask[heads.cpu(), positions.cpu()] = False
            spec.attn.masked_key_indices = None
        layer.update(keys[None], values[None], {"cache_position": torch.arange(n, device=keys.device)})
        layer.keep_only([torch.nonzero(row).view(-1) for row in mask])
        layer.compact()
    elif rerotates(press):  # pairs dropped, keys re-rotated to 0 .. m-1 in kvpress's order (sorted positions)
        layer.update(keys[None], values[None], {"cache_position": torch.arange(keys.shape[1], device=keys.device)})
        out.stands_for = n
    else:  # pairs dropped: each kept pair at its position (found among the pairs before the press), in order
        assert before[0] is not None and before[1] is not None
        rows = torch.stack([kept_positions(keys[h], values[h], before[0][h], before[1][h]) for h in range(len(keys))])
        order = rows.argsort(dim=1)[..., None]  # (Hkv, m, 1)
        k, v = (t.gather(1, order.expand(-1, -1, t.shape[-1])) for t in (keys, values))
        layer.update(k[None], v[None], {"cache_position": rows.gather(1, order[..., 0])})
        layer.seen = n  # the context's length, whether or not its last pair was kept
    empty = (1, keys.shape[0], 0, keys.shape[-1])  # new tensors: an empty view would keep the storage alive
    entry.keys, entry.values = keys.new_empty(empty), values.new_empty(empty)  # kvpress's later passes see none


def appends(press: Any) -> bool:
    """Whether ``press`` appends pairs after the context (RestoreKV's restore tokens; its pipeline continues after)."""
    from kvpress import RestoreKVPress

    return isinstance(press, RestoreKVPress)


def rerotates(press: Any) -> bool:
    """Whether ``press`` re-rotates the kept keys to positions ``0 .. m-1`` (kvpress's pipeline then continues at m)."""
    from kvpress import FinchPress, KeyRerotationPress

    return isinstance(press, KeyRerotationPress) or (isinstance(press, FinchPress) and press.rerotate_keys)


def _head_hashes(x: torch.Tensor) -> torch.Tensor:
    """(Hkv, T) int64: :func:`row_hashes` of each head's rows of ``x`` (Hkv, T, d)."""
    return row_hashes(x.reshape(-1, x.shape[-1])).view(x.shape[0], x.shape[1])


def _hashed_positions(kept: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor | None:
    """Indices into the rows hashed by ``hashes`` (T,) of the rows of ``kept`` (n, d).

    None where a row is not found, or two hashed rows hash alike (then they cannot be told apart without their bytes).
    """
    order = hashes.argsort()
    ranked = hashes[order]
    wanted = row_hashes(kept)
    found = torch.searchsorted(ranked, wanted).clamp(max=len(ranked) - 1)
    rows = order[found]
    unique = bool((ranked[1:] != ranked[:-1]).all())
    if unique and torch.equal(hashes[rows], wanted) and rows.unique().numel() == rows.numel():
        return rows
    return None


def kept_positions(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Positions (m,) of kept pairs ``k``, ``v`` (m, d) among the pairs before the press, ``keys``, ``values`` (T, d).

    By the keys where the press copied them (bit for bit), else by the values (a press that re-rotated the keys
    copies the values), else by the nearest pairs (keys and values together). Where only the rows' hashes were
    held (``keys`` and ``values`` (T,) int64), by the hashes of the keys, else of the values.
    """
    if keys.dim() == 1:
        for kept, hashes in ((k, keys), (v, values)):
            rows = _hashed_positions(kept, hashes)
            if rows is not None:
                return rows
        raise KVResearchError(
            "The press rewrote both the keys and the values it kept, so they cannot be found by hash among the "
            "pairs before it; a press that evicts after the prefill must copy its keys or its values."
        )
    for kept, original in ((k, keys), (v, values)):
        rows = _exact_positions(kept, original)
        if rows is not None:
            return rows
    return _nearest_positions(torch.cat([k, v], dim=-1), torch.cat([keys, values], dim=-1))


def clear_masks(adapter: Any) -> None:
    """Forget the masks (``masked_key_indices``) that a press left on the attention modules of ``adapter``.

    A fresh prefill starts without them, or the pairs an earlier run masked would be dropped again.
    """
    for spec in adapter.layers:
        spec.attn.masked_key_indices = None


@torch.no_grad()
def kvpress_prefill(session: Session, ids: torch.Tensor, press: Any) -> tuple[DynamicCache, int]:
    """A plain kvpress prefill of ``ids`` (1, T) under ``press``: its cache and the bytes of the keys and values."""
    dense = DynamicCache()
    clear_masks(session.adapter)
    with cache_positions(session.adapter), press(session.model):
        session.model(input_ids=ids.to(session.device), past_key_values=dense, use_cache=True, logits_to_keep=1)
    kept_bytes = sum(e.keys.numel() * e.keys.element_size() * 2 for e in dense.layers if e.keys is not None)
    return dense, kept_bytes


@torch.no_grad()
def masked_pairs(session: Session, ids: torch.Tensor, press: Any) -> tuple[set[tuple[int, int, int]], int]:
    """(layer, KV head, position) pairs a masking press evicts in a plain kvpress prefill, and the bytes kvpress keeps.

    For side-by-side comparisons with kvpress itself (its ``DMSPress`` keeps every pair in memory).
    """
    _, kept_bytes = kvpress_prefill(session, ids, press)
    evicted: set[tuple[int, int, int]] = set()
    for index, spec in enumerate(session.adapter.layers):
        if getattr(spec.attn, "masked_key_indices", None) is not None:
            _, heads, positions = (t.tolist() for t in spec.attn.masked_key_indices)
            evicted |= {(index, h, p) for h, p in zip(heads, positions, strict=True)}
            spec.attn.masked_key_indices = None
    return evicted, kept_bytes


def _dense_view(cache: RaggedCache, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of a ragged layer whose heads hold as many entries each: (1, Hkv, n, d)."""
    layer = cache.ragged[index]
    layer.compact()
    if len(set(layer.lengths.tolist())) != 1:
        raise KVResearchError(
            "A kvpress decoding press needs as many entries in every KV head (kvpress's dense layout); this cache "
            f"has {layer.lengths.tolist()} in layer {index}. Compress the context with a press that keeps as many "
            "per head (the ScorerPress family), or none."
        )
    rows = torch.stack([layer.head_rows(h) for h in range(len(layer.caps))])  # (Hkv, n)
    return layer.k[rows][None], layer.v[rows][None]


@contextmanager
def decoding_press(session: Session, cache: RaggedCache, press: Any) -> Iterator[None]:
    """Run kvpress's ``DecodingPress`` ``press`` on ``cache`` while decoding, evicting for real."""
    buffers: dict[int, list[torch.Tensor]] = defaultdict(list)
    steps: dict[int, int] = defaultdict(int)
    press.post_init_from_model(session.model)

    from kvpress.presses.base_press import is_prefilling

    def hook(module: Any, _args: tuple, kwargs: dict, output: Any) -> None:
        hidden = kwargs["hidden_states"]
        if is_prefilling(kwargs["cache_position"], hidden.shape[1]):  # kvpress's rule: the question counts as a step
            return
        index = int(module.layer_idx)
        buffers[index].append(hidden.detach().clone())
        steps[index] += 1
        if steps[index] >= press.compression_interval or hidden.shape[1] >= press._resolve_target_size(kwargs):
            keys, values = _dense_view(cache, index)
            kept_k, kept_v = press.compress(module, torch.cat(buffers[index], dim=1), keys, values, None, kwargs)
            pairs, kept = torch.cat([keys, values], dim=-1)[0], torch.cat([kept_k, kept_v], dim=-1)[0]
            # kvpress's order is kept (the scorer's, not the positions'): window scorers such as SnapKV read the
            # last entries as the most recent and pool neighbours, so the order changes what the next cut keeps.
            cache.ragged[index].keep_only([_positions_of(kept[h], pairs[h]) for h in range(len(pairs))])
            steps[index], buffers[index] = 0, []
        size = press.hidden_states_buffer_size
        buffers[index] = buffers[index][-size:] if size > 0 else []

    with attention_hooks(session.adapter, hook), cache_positions(session.adapter):
        yield
