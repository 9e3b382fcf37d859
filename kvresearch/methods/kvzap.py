"""KVzap: surrogate scores for every new token, a sliding window, threshold eviction from the ragged cache.

After each attention call of layer l, the surrogate scores the call's new tokens from the layer's
attention input h; the most recent ``window`` tokens are always kept; a token that leaves the window
with a predicted log score below ``threshold`` is evicted from that KV head, physically (the layer is
compacted after every call of more than one token, and during decoding once enough entries are dead).
The rule is the one of kvpress's ``DMSPress(KVzapPress)``, which only masks evicted pairs.

Attach it around the context prefill; keep it attached while generating for ``decoding: true``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from kvresearch.cache import RaggedCache
from kvresearch.errors import KVResearchError
from kvresearch.methods.base import cache_from_scores, dense_prefill, ragged_prefill
from kvresearch.models.adapter import ModelAdapter
from kvresearch.models.hooks import attention_inputs
from kvresearch.surrogate.modules import Surrogate


@dataclass
class ScoringTime:
    seconds: float = 0.0  # time spent in the surrogate while attached


@dataclass
class KVzap:
    surrogate: Surrogate
    threshold: float  # log-space threshold tau
    window: int = 128
    decoding: bool = False
    compact_every: int = 64  # during decoding, compact a layer once this many entries are dead per head

    @contextmanager
    def attach(self, adapter: ModelAdapter, cache: RaggedCache) -> Iterator[ScoringTime]:
        timer = ScoringTime()
        inputs: dict[int, torch.Tensor] = {}
        # Tokens still inside the window, with their scores; kept on the cache so that re-attaching for
        # decoding continues where the prefill stopped.
        pending_pos, pending_scores = cache.method_state.setdefault("kvzap_pending", ({}, {}))
        surrogate = self.surrogate.eval()

        def after_attention(module: Any, _args: Any, _output: Any) -> None:
            index = int(module.layer_idx)
            layer = cache.ragged[index]
            start = time.perf_counter()
            with torch.no_grad():
                scores = surrogate.forward_layer(index, inputs.pop(index)[0]).T.float()  # (Hkv, T)
            timer.seconds += time.perf_counter() - start
            positions = layer.new_positions
            if index in pending_pos:
                positions = torch.cat([pending_pos[index], positions])
                scores = torch.cat([pending_scores[index], scores.to(pending_scores[index].device)], dim=1)
            leaving = positions < layer.seen - self.window
            pending_pos[index], pending_scores[index] = positions[~leaving], scores[:, ~leaving]
            if bool(leaving.any()):
                out_pos, out_scores = positions[leaving], scores[:, leaving]
                for h in range(out_scores.shape[0]):
                    layer.evict(h, out_pos[out_scores[h] < self.threshold])
            if layer.new_positions.numel() > 1 or int(layer.dead.max()) >= self.compact_every:
                layer.compact()

        handles = [spec.attn.register_forward_hook(after_attention) for spec in adapter.layers]
        try:
            with attention_inputs(adapter, inputs):
                yield timer
        finally:
            for handle in handles:
                handle.remove()
            cache.compact()


class KVzapMethod:
    """KVzap at inference, from a surrogate exported by train_surrogate.

    Threshold mode (``threshold``): chunked prefill into the ragged cache with the pruner attached.
    Fixed-budget mode (``keep_ratio`` and ``scope``): score every context token from a dense prefill,
    keep the top share per head, layer or globally (window protected), for comparisons at a matched ratio.
    """

    decoding: bool

    def __init__(
        self,
        surrogate_path: str,
        threshold: float | None = None,
        keep_ratio: float | None = None,
        scope: str = "head",
        window: int = 128,
        decoding: bool = False,
        chunk_size: int | None = None,
        name: str = "kvzap",
        expect_model: str | None = None,
    ):
        if (threshold is None) == (keep_ratio is None):
            raise ValueError("KVzap needs exactly one of threshold and keep_ratio")
        self.surrogate = Surrogate.load(surrogate_path, expect_model=expect_model)
        self.threshold, self.keep_ratio, self.scope = threshold, keep_ratio, scope
        self.window, self.decoding, self.chunk_size, self.name = window, decoding, chunk_size, name
        self.scoring_s = 0.0

    def _pruner(self) -> KVzap:
        return KVzap(
            self.surrogate, float(self.threshold if self.threshold is not None else 0.0), self.window, self.decoding
        )

    def compress(self, session: Any, prompt: Any) -> RaggedCache:
        if self.surrogate.config.layers != session.adapter.num_layers or (
            self.surrogate.config.hidden != session.adapter.hidden_size
        ):
            raise KVResearchError(
                f"The surrogate ({self.surrogate.config.layers} layers, hidden {self.surrogate.config.hidden}) does "
                f"not fit this model ({session.adapter.num_layers} layers, hidden {session.adapter.hidden_size}): "
                "train one for this model with `make train-surrogate ARGS='model=...'`."
            )
        if self.threshold is not None:
            cache = session.new_cache()
            with self._pruner().attach(session.adapter, cache) as timer:
                ragged_prefill(session, prompt.context_ids, cache, self.chunk_size)
            self.scoring_s = timer.seconds
            return cache
        inputs: dict[int, torch.Tensor] = {}
        dense = dense_prefill(session, prompt.context_ids, inputs)
        with torch.no_grad():
            scores = [self.surrogate.forward_layer(i, inputs[i][0]).T.float() for i in range(len(inputs))]
        return cache_from_scores(dense, scores, keep_ratio=self.keep_ratio, scope=self.scope, window=self.window)

    def decode_context(self, session: Any, cache: RaggedCache) -> Any:
        return (
            self._pruner().attach(session.adapter, cache)
            if self.decoding and self.threshold is not None
            else nullcontext()
        )
