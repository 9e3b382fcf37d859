"""kvpress presses behind the method type, with real eviction (the bridge is ``models/presses.py``).

``keep_ratio`` is the share kept; kvpress's ``compression_ratio`` is the share removed, set here as
``1 - keep_ratio`` (rounded to 10 decimals, so that keep 0.33 gives exactly kvpress's 0.67).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from kvresearch.errors import KVResearchError
from kvresearch.methods.base import Method, check_scope
from kvresearch.models.cache import RaggedCache
from kvresearch.models.presses import decoding_press, press_prefill
from kvresearch.models.session import Session
from kvresearch.prompts import Prompt
from kvresearch.surrogate.modules import Surrogate


@dataclass(kw_only=True)
class KVPress(Method):
    """Any kvpress press (built by Hydra from its config) as a method.

    ``sinks``: keep the first ``sinks`` positions of the context in every head, whatever the press's scores;
    ``scope=token_layer``: evict a position from every head of a layer or from none (``models/press_scoring.py``),
    ranked by its score ``reduction`` over the layer's heads.
    ``sinks=0`` and ``scope=head`` leave the press as kvpress wrote it.
    """

    name: str = "kvpress"
    press: Any
    attn_implementation: str | None = None  # e.g. "eager" for presses that read attention weights
    sinks: int = 0
    scope: str = "head"
    reduction: str = "max"  # with scope=token_layer: ops.selection.REDUCTIONS
    decoding_fields = ("interval", "target_size")  # kvpress's DecodingPress around the press while generating

    def __post_init__(self) -> None:
        """Hand the keep ratio to the press as kvpress's compression ratio; check the decoding budget."""
        super().__post_init__()
        if self.sinks < 0:
            raise KVResearchError(f"method {self.name}: sinks must be 0 or more, got {self.sinks}.")
        from kvresearch.models.press_scoring import PRESS_SCOPES, rescored

        self.press = rescored(self.press, self.sinks, self.scope, self.reduction)  # refuses a scope it cannot keep
        check_scope(self.name, self.scope, self.reduction, PRESS_SCOPES)
        if self.decoding is not None:
            self._decoding_press()  # refused now, not after the prefill, if the press cannot decode
        if self.keep_ratio is None:
            return
        settable = (
            is_dataclass(self.press) and any(f.name == "compression_ratio" for f in fields(self.press))
        ) or isinstance(getattr(type(self.press), "compression_ratio", None), property)
        try:
            if not settable:
                raise AttributeError("compression_ratio")
            self.press.compression_ratio = round(1.0 - float(self.keep_ratio), 10)
        except AttributeError as error:
            raise KVResearchError(
                f"method {self.name}: {type(self.press).__name__} takes no compression ratio (it prunes by its own "
                "rule, e.g. a threshold): set method.keep_ratio=null, or compare at a budget with a method that "
                "takes one (kvzap_mlp method.threshold=null method.keep_ratio=...)."
            ) from error

    def compress(self, session: Session, prompt: Prompt) -> RaggedCache:
        """A dense prefill with the press applied, its result moved into the ragged cache.

        A decoding press (kvpress's ``DecodingPress`` family) leaves the prefill alone, as kvpress's pipeline does;
        ``PrefillDecodingPress`` prefills with its ``prefilling_press``.
        """
        prefill, _ = self._phases()
        if prefill is None:
            cache = session.new_cache()
            session.ragged_prefill(prompt.context_ids, cache)
            cache.compact()
            self._report = {}
            return cache
        cache = press_prefill(session, prompt.context_ids, prefill, self.attn_implementation)
        self._report = {"peak_kv_bytes": cache.method_state.pop("peak_kv_bytes")}
        return cache

    def report(self) -> dict[str, Any]:
        """The peak of the KV bytes held while the press ran (dense layers, captured pairs, ragged cache)."""
        return dict(getattr(self, "_report", {}))

    def _phases(self) -> tuple[Any, Any]:
        """The press that runs at the prefill (or None) and the decoding press given as the method's press (or None)."""
        from kvpress import DecodingPress, PrefillDecodingPress

        if isinstance(self.press, PrefillDecodingPress):
            return self.press.prefilling_press, self.press.decoding_press
        if isinstance(self.press, DecodingPress):
            return None, self.press
        return self.press, None

    def _decoding_press(self) -> Any:
        from kvpress import AdaKVPress, DecodingPress, ScorerPress

        if self._phases()[1] is not None:
            raise KVResearchError(
                f"method {self.name}: {type(self.press).__name__} compresses while decoding already; set "
                "method.decoding=null (its own compression_interval and target_size apply)."
            )
        if not isinstance(self.press, (ScorerPress, AdaKVPress)):
            raise KVResearchError(
                f"method {self.name}: kvpress's DecodingPress needs a scorer press, not {type(self.press).__name__}; "
                "set method.decoding=null."
            )
        assert self.decoding is not None
        return DecodingPress(
            base_press=self.press,
            compression_interval=self.decoding.interval,
            target_size=self.decoding.target_size,
        )

    def decode_context(self, session: Session, cache: RaggedCache) -> AbstractContextManager[Any]:
        """With ``decoding`` set (or a decoding press as the press), kvpress's DecodingPress runs while generating."""
        given = self._phases()[1]
        if given is not None:
            return decoding_press(session, cache, given)
        return decoding_press(session, cache, self._decoding_press()) if self.decoding else nullcontext()


def kvzap_press(surrogate: Surrogate, threshold: float, window: int = 128, decoding: bool = False) -> Any:
    """Kvpress's own ``DMSPress(KVzapPress)`` scoring with ``surrogate`` (kvpress would fetch nvidia/KVzap-*)."""
    from kvpress import DMSPress, KVzapPress

    from kvresearch.surrogate.export import kvpress_model

    @dataclass
    class HandedKVzapPress(KVzapPress):
        def post_init_from_model(self, model: Any) -> None:
            """The surrogate is handed in; nothing to download."""

    scorer = HandedKVzapPress(model_type=surrogate.config.kind)
    scorer.kvzap_model = kvpress_model(surrogate)
    return DMSPress(scorer, threshold=threshold, sliding_window_size=window, decoding=decoding)
