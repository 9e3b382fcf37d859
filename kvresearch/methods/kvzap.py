"""KVzap: surrogate scores for every new token, a sliding window, threshold eviction from the ragged cache.

After each attention call of layer l, the surrogate scores the call's new tokens from the layer's
attention input h; the most recent ``window`` tokens are always kept; a token that leaves the window
with a predicted log score below ``threshold`` is evicted from that KV head, physically (the layer is
compacted after every call of more than one token, and during decoding once enough entries are dead).
The rule is the one of kvpress's ``DMSPress(KVzapPress)``, which only masks evicted pairs.

``sinks``: the first ``sinks`` tokens of the sequence are never evicted (scored +inf), as the attention sink
that some heads need (issue 52: KVzap evicted the first token in some heads and QuALITY's fidelity fell).
The configs keep 4 (``conf/method/kvzap_*.yaml``): on the LongBench twin at keep 0.5, the full answer's NLL
rises by 0.012 with them against 0.379 without (experiment ``kvzap_sinks``); the class keeps the paper's 0.

``max_entries`` adds a memory budget: after the threshold rule, a KV head that holds more than
``max_entries`` entries loses its lowest-scored entries outside the window until it fits. Scores never
change, so the survivors are at every step the top-scored of the tokens that have left the window.

``keep_ratio`` instead of ``threshold``: score every context token from a dense prefill and keep the top
share per head, layer or globally (``scope``), the window protected, for comparisons at a matched ratio.
With ``calibrate: true`` the keep ratio is reached on average instead, by one threshold calibrated on
held-out contexts (the paper's way: the threshold rule, in prefill and decoding, at a measured ratio).

``scope: token_layer`` with the threshold rule (or its calibrated threshold): a position that leaves the window is
evicted from every head of the layer when its score reduced over them (``reduction``: max or mean) is below the
threshold, the rule a paged engine can hold; each layer keeps what its scores say, not a fixed share.

A surrogate with ``context`` inputs (``surrogate=mlp_context``) also reads the token's value-output norms,
position, in-context count rates and the context's length (``kvresearch.surrogate.context``): the pruner
records the token ids of every forward pass, and the counts and length of a token are those of the context
seen up to the end of the call that brought it (all of it in a one-call prefill, as in training; a chunked
prefill or decoding sees less).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from kvresearch.errors import KVResearchError
from kvresearch.methods.base import Method, cache_from_scores, check_scope
from kvresearch.models.adapter import ModelAdapter
from kvresearch.models.cache import RaggedCache, RaggedLayer
from kvresearch.models.hooks import after_attention, attention_inputs, model_calls
from kvresearch.models.session import Prefill, Session
from kvresearch.ops.calibration import Calibration, calibrate_threshold
from kvresearch.ops.selection import position_scores
from kvresearch.prompts import Prompt
from kvresearch.surrogate.context import count_rates, with_context
from kvresearch.surrogate.modules import Surrogate


@contextmanager
def record_ids(adapter: ModelAdapter, cache: RaggedCache, rates: dict[str, torch.Tensor | None]) -> Iterator[None]:
    """Record every forward pass's ids on ``cache``; ``rates["call"]``: the count rates of the call's tokens."""
    seen: list[torch.Tensor] = cache.method_state.setdefault("kvzap_ids", [])

    def before(ids: torch.Tensor) -> None:
        seen.append(ids[0].detach().cpu())
        rates["call"] = count_rates(torch.cat(seen).numpy())[-ids.shape[1] :]

    with model_calls(adapter.model, before, lambda _ids: None):
        yield


@dataclass
class ScoringTime:
    """Seconds spent in the surrogate while a pruner was attached."""

    seconds: float = 0.0


@dataclass
class ThresholdPruner:
    """The KVzap rule, attached to a model and a ragged cache for the length of a ``with`` block."""

    surrogate: Surrogate
    threshold: float  # log-space threshold tau
    window: int = 128
    max_entries: int | None = None  # per KV head, at every step (None: no budget)
    sinks: int = 0  # the first positions, never evicted
    compact_every: int = 64  # during decoding, compact a layer once this many entries are dead per head
    token_layer: bool = False  # a position is evicted from every head of a layer at once, by its reduced score
    reduction: str = "max"  # with token_layer: ops.selection.position_scores (max or mean)

    @contextmanager
    def attach(self, adapter: ModelAdapter, cache: RaggedCache) -> Iterator[ScoringTime]:
        """Score and evict after every attention call inside the block; the cache is compacted on exit."""
        timer = ScoringTime()
        inputs: dict[int, torch.Tensor] = {}
        # Tokens still inside the window, with their scores; kept on the cache so that re-attaching for
        # decoding continues where the prefill stopped.
        pending_pos, pending_scores = cache.method_state.setdefault("kvzap_pending", ({}, {}))
        # With a budget: per layer and head, the positions and scores of the kept entries outside the window.
        kept: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = cache.method_state.setdefault("kvzap_kept", {})
        surrogate = self.surrogate.eval()
        rates: dict[str, torch.Tensor | None] = {"call": None}  # of the call's tokens, with ``counts``

        def on_layer(index: int) -> None:
            layer = cache.ragged[index]
            positions = layer.new_positions
            start = time.perf_counter()
            with torch.no_grad():
                hidden = inputs.pop(index)[0]
                x = with_context(surrogate.config.context, adapter, index, hidden, positions, rates["call"], layer.seen)
                scores = surrogate.forward_layer(index, x).T.float()  # (Hkv, T)
                scores[:, positions < self.sinks] = float("inf")
            timer.seconds += time.perf_counter() - start
            if index in pending_pos:
                positions = torch.cat([pending_pos[index], positions])
                scores = torch.cat([pending_scores[index], scores.to(pending_scores[index].device)], dim=1)
            leaving = positions < layer.seen - self.window
            pending_pos[index], pending_scores[index] = positions[~leaving], scores[:, ~leaving]
            if bool(leaving.any()):
                out_pos, out_scores = positions[leaving], scores[:, leaving]
                if self.token_layer:  # one decision per position, shared by the layer's heads
                    out_scores = position_scores(out_scores, self.reduction).expand_as(out_scores)
                for h in range(out_scores.shape[0]):
                    low = out_scores[h] < self.threshold
                    layer.evict(h, out_pos[low])
                    if self.max_entries is not None:
                        pos, sc = kept.setdefault(index, [(out_pos[:0], out_scores[h, :0])] * len(out_scores))[h]
                        kept[index][h] = (torch.cat([pos, out_pos[~low]]), torch.cat([sc, out_scores[h, ~low]]))
            if self.max_entries is not None and index in kept:
                self._fit_budget(layer, kept[index])
            if layer.new_positions.numel() > 1 or int(layer.dead.max()) >= self.compact_every:
                layer.compact()

        ids = record_ids(adapter, cache, rates) if "counts" in surrogate.config.context else nullcontext()
        try:
            with ids, attention_inputs(adapter, inputs), after_attention(adapter, on_layer):
                yield timer
        finally:
            cache.compact()

    def _fit_budget(self, layer: RaggedLayer, kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Evict each head's lowest-scored entries outside the window until it holds ``max_entries``."""
        assert self.max_entries is not None
        for h, excess in enumerate((layer.stored_per_head() - self.max_entries).tolist()):
            if excess > 0:
                pos, sc = kept[h]
                order = torch.argsort(sc, stable=True)
                layer.evict(h, pos[order[:excess]])
                kept[h] = (pos[order[excess:]], sc[order[excess:]])


@dataclass(kw_only=True)
class KVzap(Method):
    """KVzap at inference with a surrogate handed in (built from a train_surrogate run by Hydra)."""

    name: str = "kvzap"
    surrogate: Surrogate
    threshold: float | None = -4.0  # log space; exactly one of threshold and keep_ratio
    scope: str = "head"  # for keep_ratio: ops.selection.SCOPES; for the threshold: head or token_layer
    reduction: str = "max"  # how the token scopes score a position over its heads: ops.selection.REDUCTIONS
    page_size: int = 1  # with a token scope: keep whole pages of this many positions (vLLM: 16)
    window: int = 128
    sinks: int = 0  # the first positions, never evicted
    max_entries: int | None = None  # memory budget per KV head, prefill and decoding (threshold mode)
    chunk_size: int | None = None  # prefill chunk; bounds peak memory by chunk + kept cache
    calibrate: bool = False  # keep_ratio reached on average by one threshold calibrated on held-out contexts
    decoding_fields = ()  # the threshold rule at every step: no schedule to set, only on (decoding: true) or off
    _scoring_s: float = field(default=0.0, init=False, repr=False)
    _calibration: Calibration | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        """Exactly one budget; a known scope; a non-negative window."""
        super().__post_init__()
        self.require_one("threshold")
        check_scope(
            self.name,
            self.scope,
            self.reduction,
            page_size=self.page_size,
            by_threshold=self.keep_ratio is None or self.calibrate,
        )
        if self.window < 0 or self.sinks < 0:
            raise KVResearchError(
                f"method {self.name}: window and sinks must be >= 0, got {self.window} and {self.sinks}."
            )
        if self.calibrate and (self.keep_ratio is None or not 0 < self.keep_ratio <= 1):
            raise KVResearchError(
                f"method {self.name}: calibrate=true sets the threshold that keeps keep_ratio of held-out contexts "
                f"on average; set method.keep_ratio in (0, 1] (got {self.keep_ratio})."
            )
        if (self.decoding or self.max_entries is not None) and self.threshold is None and not self.calibrate:
            raise KVResearchError(
                f"method {self.name}: decoding and max_entries prune by threshold; set method.threshold and "
                "method.keep_ratio=null, or reach a keep ratio by a threshold with method.calibrate=true."
            )
        if self.max_entries is not None and self.scope == "token_layer":
            raise KVResearchError(
                f"method {self.name}: max_entries evicts each head's lowest entries, which would split the positions "
                "scope=token_layer shares across a layer's heads; set method.max_entries=null or method.scope=head."
            )
        if self.max_entries is not None and self.max_entries <= self.window + self.sinks:
            raise KVResearchError(
                f"method {self.name}: max_entries={self.max_entries} must exceed the window ({self.window}) plus the "
                f"sinks ({self.sinks}), which are always kept: raise max_entries, or lower method.window or sinks."
            )

    def budget(self) -> str:
        """``tau=<threshold>`` in threshold mode, the keep ratio (with its calibrated threshold once set)."""
        if self.calibrate:
            tau = "not yet calibrated" if self.threshold is None else f"tau={self.threshold:.3f}"
            return f"keep={self.keep_ratio:g} ({tau}, calibrated)"
        return f"tau={self.threshold:g}" if self.threshold is not None else super().budget()

    def scores(self, session: Session, context_ids: torch.Tensor) -> tuple[Prefill, list[torch.Tensor]]:
        """A dense prefill of the context and the surrogate's scores per layer, each (Hkv, T)."""
        prefill = session.dense_prefill(context_ids, record_inputs=True)
        start = time.perf_counter()
        positions = torch.arange(context_ids.shape[1], device=session.device)
        rates = count_rates(context_ids[0].cpu().numpy()) if "counts" in self.surrogate.config.context else None
        with torch.no_grad():
            scores = []
            for i in range(prefill.num_layers):
                h = prefill.inputs[i][0]
                x = with_context(self.surrogate.config.context, session.adapter, i, h, positions, rates, len(positions))
                scores.append(self.surrogate.forward_layer(i, x).T.float())
        self._scoring_s = time.perf_counter() - start
        return prefill, scores

    def needs_held_out(self) -> bool:
        """Only a threshold calibrated to the keep ratio (``calibrate``) needs held-out contexts."""
        return self.calibrate

    def prepare(self, session: Session, held_out: list[Prompt]) -> dict[str, Any]:
        """Calibrate the threshold on ``held_out`` (:meth:`fit_threshold`); the calibration as the run records it."""
        return dataclasses.asdict(self.fit_threshold(session, held_out))

    def fit_threshold(self, session: Session, prompts: list[Prompt]) -> Calibration:
        """Set the threshold to the one that keeps ``keep_ratio`` of ``prompts``' contexts on average.

        In one prefill call every token is scored from the same hidden states as in a dense prefill, so the
        scores here are the ones the threshold will meet (a chunked prefill sees a pruned cache and may differ).
        """
        self._check_fits(session)
        if not self.calibrate:
            raise KVResearchError(f"method {self.name}: fit_threshold() needs method.calibrate=true.")
        eligible, entries = [], []
        weights = hashlib.sha1(
            b"".join(p.detach().float().cpu().numpy().tobytes() for p in self.surrogate.parameters())
        )
        for prompt in prompts:

            def held_out(ids: torch.Tensor = prompt.context_ids) -> dict[str, torch.Tensor]:
                _, scores = self.scores(session, ids)
                if self.scope == "token_layer":  # the score the rule meets: the position's, in every head
                    scores = [position_scores(s, self.reduction).expand_as(s) for s in scores]
                tokens = scores[0].shape[1]
                kept = torch.cat([s[:, self.sinks : max(tokens - self.window, 0)].reshape(-1) for s in scores])
                return {"eligible": kept, "entries": torch.tensor([sum(s.numel() for s in scores)])}

            # Each target prune ratio of a sweep calibrates on the same scores: computed once per surrogate.
            digest = hashlib.sha1(str(prompt.context_ids[0].tolist()).encode()).hexdigest()
            sinks = f"|sinks={self.sinks}" if self.sinks else ""
            shared = f"|token_layer={self.reduction}" if self.scope == "token_layer" else ""
            key = (
                f"kvzap-held-out|{weights.hexdigest()}|{self.surrogate.config}|window={self.window}{sinks}{shared}"
                f"|ids={digest}"
            )
            got = session.memo.get_or_compute(key, held_out) if session.memo is not None else held_out()
            eligible.append(got["eligible"])
            entries.append(int(got["entries"][0]))
        self._calibration = calibrate_threshold(eligible, entries, round(1.0 - float(self.keep_ratio or 0), 10))
        self.threshold = self._calibration.threshold
        return self._calibration

    def pruner(self) -> ThresholdPruner:
        """The threshold rule with this method's settings."""
        assert self.threshold is not None
        return ThresholdPruner(
            self.surrogate,
            float(self.threshold),
            self.window,
            self.max_entries,
            sinks=self.sinks,
            token_layer=self.scope == "token_layer",
            reduction=self.reduction,
        )

    def _check_fits(self, session: Session) -> None:
        config, adapter = self.surrogate.config, session.adapter
        heads = adapter.num_heads if "value_norms" in config.context else config.q_heads
        if config.layers != adapter.num_layers or config.hidden != adapter.hidden_size or config.q_heads != heads:
            raise KVResearchError(
                f"The surrogate ({config.layers} layers, hidden {config.hidden}) does not fit this model "
                f"({adapter.num_layers} layers, hidden {adapter.hidden_size}): train one for this model with "
                "`make train-surrogate ARGS='model=...'`."
            )

    def compress(self, session: Session, prompt: Prompt) -> RaggedCache:
        """Threshold mode: chunked prefill with the pruner attached; keep_ratio mode: scores of a dense prefill."""
        self._check_fits(session)
        if self.calibrate and self._calibration is None:
            raise KVResearchError(
                f"method {self.name}: calibrate=true needs held-out contexts, which only the evaluate stage gives; "
                "elsewhere set method.threshold (an evaluate run records its calibrated one)."
            )
        if self.threshold is not None:
            cache = session.new_cache()
            with self.pruner().attach(session.adapter, cache) as timer:
                session.ragged_prefill(prompt.context_ids, cache, self.chunk_size)
            self._scoring_s = timer.seconds
            return cache
        prefill, scores = self.scores(session, prompt.context_ids)
        return cache_from_scores(
            prefill,
            scores,
            keep_ratio=self.keep_ratio,
            scope=self.scope,
            window=self.window,
            sinks=self.sinks,
            reduction=self.reduction,
            page_size=self.page_size,
        )

    def decode_context(self, session: Session, cache: RaggedCache) -> AbstractContextManager[Any]:
        """With ``decoding`` on, the pruner stays attached while generating."""
        return self.pruner().attach(session.adapter, cache) if self.decoding else nullcontext()

    def inputs(self) -> tuple[str, ...]:
        """The train_surrogate run the surrogate was loaded from (none for one handed in directly)."""
        return () if self.surrogate.source is None else (self.surrogate.source,)

    def report(self) -> dict[str, Any]:
        """Seconds spent in the surrogate during the last compression."""
        return {"scoring_s": self._scoring_s}

    def describe(self) -> dict[str, Any]:
        """The base description, with the calibration (threshold, ratio reached, contexts) once done."""
        out = super().describe()
        if self._calibration is not None:
            out["calibration"] = dataclasses.asdict(self._calibration)
        return out
