"""The method type: what every compression method shares.

A method is a small dataclass that Hydra builds from ``conf/method/<name>.yaml``, with its dependencies
handed in (a surrogate module, a kvpress press): it never reads a file and never touches transformers'
internals. Its entry point is ``compress(session, prompt) -> RaggedCache``; ``decode_context(session,
cache)`` wraps generation (a no-op unless the method also prunes while decoding); ``describe()`` is what
the run records about it; ``report()`` holds per-sample extras (timings, reconstruction errors).

The budget knob is the same for every method: ``keep_ratio``, the share of the context's KV entries
kept (None: the method's own rule, e.g. KVzap's threshold, or no compression); tables plot the measured
prune ratio (1 - the share kept). Methods with a second knob (KVzap's ``threshold``) take exactly one of
the two. Compression while generating is one option of one type for every method, ``decoding``
(:class:`DecodingBudget`: null, true or {interval, target_size, protect}); a method names the
fields it reads in ``decoding_fields`` (None: it cannot compress while decoding). Options are checked when
the method is built, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvresearch.errors import KVResearchError
from kvresearch.models.cache import RaggedCache
from kvresearch.models.session import Prefill, Session
from kvresearch.ops.selection import (
    PAGED_SCOPES,
    REDUCTIONS,
    SCOPES,
    keep_threshold,
    keep_topk_visible,
    protect_window,
)
from kvresearch.prompts import Prompt


def jsonable(value: Any) -> Any:
    """A JSON-friendly view of an option: modules and presses by what they describe, dtypes by name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if hasattr(value, "describe"):
        return value.describe()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {"class": type(value).__name__, **fields}
    return str(value) if isinstance(value, torch.dtype) else type(value).__name__


@dataclass(frozen=True)
class DecodingBudget:
    """How often and down to what a cache is compressed while generating: one type for every method.

    Every method's ``decoding`` option is this type, written the same way in every YAML: ``null`` (no
    compression while decoding), ``true`` (the defaults below) or a mapping of some of the fields. A method
    reads the fields it names in ``decoding_fields`` (the rest are None): KVzip+ and Attention Matching all
    three, the kvpress presses ``interval`` and ``target_size`` (kvpress's DecodingPress has no protected
    tail), KVzap none (its threshold rule runs at every step; ``max_entries`` is its size budget).
    """

    interval: int | None = 512  # decoding steps between compressions
    target_size: int | None = 2048  # entries per KV head after a compression
    protect: int | None = 20  # the most recent tokens, never compressed (re-compression; the AM code's default)

    @classmethod
    def of(cls, value: Any, method: str, fields: tuple[str, ...] | None) -> DecodingBudget | None:
        """The budget from a config value (None/false: none; true: defaults; a mapping) for a method reading ``fields``.

        Raises:
            KVResearchError: the method cannot compress while decoding (``fields`` is None), a field it does not
                read was given, a size is not positive, or ``protect`` leaves nothing to compress.
        """
        if value is None or value is False:
            return None
        if fields is None:
            raise KVResearchError(f"method {method} does not compress while decoding: set method.decoding=null.")
        if value is True:
            given: dict[str, Any] = {}
        elif isinstance(value, DecodingBudget):
            given = {f: getattr(value, f) for f in fields}
        elif hasattr(value, "items"):
            given = {str(k): v for k, v in value.items()}
        else:
            raise KVResearchError(
                f"method {method}: decoding must be null, true or a mapping of {list(FIELDS)}, got {value!r}."
            )
        unread = sorted(set(given) - set(fields))
        if unread:
            reads = ", ".join(fields) if fields else "none of them (decoding: true turns it on)"
            raise KVResearchError(
                f"method {method}: decoding.{unread[0]} is not read by this method; of {list(FIELDS)} it reads {reads}."
            )
        defaults = cls()
        budget = cls(**{f: given.get(f, getattr(defaults, f)) if f in fields else None for f in FIELDS})
        sizes = {"interval": 1, "target_size": 1, "protect": 0}
        low = [f"{f}={v}" for f, least in sizes.items() if (v := getattr(budget, f)) is not None and v < least]
        if low:
            raise KVResearchError(
                f"method {method}: decoding needs interval >= 1, target_size >= 1 and protect >= 0, got "
                f"{', '.join(low)}."
            )
        if budget.protect is not None and budget.target_size is not None and budget.protect >= budget.target_size:
            raise KVResearchError(
                f"method {method}: decoding.protect ({budget.protect}) must be below target_size "
                f"({budget.target_size}), or nothing but the protected tokens would be left after a re-compression."
            )
        return budget


FIELDS = tuple(f.name for f in dataclasses.fields(DecodingBudget))


@dataclass(kw_only=True)
class Method:
    """Base of every compression method (see the module docstring)."""

    name: str
    keep_ratio: float | None = None
    decoding: Any = None  # DecodingBudget: null | true | {interval, target_size, protect} (those the method reads)
    lossless: ClassVar[bool] = False  # True only for the full cache, whose answers are their own reference
    decoding_fields: ClassVar[tuple[str, ...] | None] = None  # the DecodingBudget fields read; None: no decoding

    def __post_init__(self) -> None:
        """Check the options; subclasses extend this and call it."""
        self.decoding = DecodingBudget.of(self.decoding, self.name, self.decoding_fields)
        if self.keep_ratio is not None and not 0.0 <= float(self.keep_ratio) <= 1.0:
            raise KVResearchError(
                f"method {self.name}: keep_ratio must lie in [0, 1] (the share of KV entries kept), got "
                f"{self.keep_ratio}."
            )

    def require_one(self, other: str) -> None:
        """Exactly one of ``keep_ratio`` and the option ``other`` (e.g. threshold) must be set."""
        value = getattr(self, other)
        if (value is None) == (self.keep_ratio is None):
            raise KVResearchError(
                f"method {self.name} needs exactly one of {other} and keep_ratio (got {other}={value}, "
                f"keep_ratio={self.keep_ratio}): to prune to a budget set method.{other}=null "
                f"method.keep_ratio=<share kept>; to use the {other}, set method.keep_ratio=null."
            )

    def compress(self, session: Session, prompt: Prompt) -> RaggedCache:
        """The compressed cache of ``prompt.context_ids``."""
        raise NotImplementedError

    def decode_context(self, session: Session, cache: RaggedCache) -> AbstractContextManager[Any]:
        """A context manager around generation from ``cache`` (pruning while decoding); a no-op by default."""
        return nullcontext()

    def report(self) -> dict[str, Any]:
        """Per-sample extras of the last ``compress`` (timings, errors); empty by default."""
        return {}

    def needs_held_out(self) -> bool:
        """Whether :meth:`prepare` wants held-out contexts before the evaluation (KVzap's calibration)."""
        return False

    def prepare(self, session: Session, held_out: list[Prompt]) -> dict[str, Any]:
        """Set what the budget needs from held-out prompts (none of them evaluated); what the run records."""
        return {}

    def inputs(self) -> tuple[str, ...]:
        """The finished runs this method was built from (a surrogate's train_surrogate run); none by default."""
        return ()

    def budget(self) -> str:
        """The budget in one label, for tables: ``keep=0.33``, ``tau=-4`` or ``-``."""
        return "-" if self.keep_ratio is None else f"keep={self.keep_ratio:g}"

    def describe(self) -> dict[str, Any]:
        """What a run records: name, class, budget label and every option."""
        options = {f.name: jsonable(getattr(self, f.name)) for f in dataclasses.fields(self) if f.init}
        return {"class": type(self).__name__, "budget": self.budget(), **options}


def cache_from_scores(
    prefill: Prefill,
    scores: list[torch.Tensor],
    threshold: float | None = None,
    keep_ratio: float | None = None,
    scope: str = "head",
    window: int = 0,
    sinks: int = 0,
    reduction: str = "max",
    page_size: int = 1,
) -> RaggedCache:
    """Keep entries by threshold or by a keep_ratio budget; the last ``window`` and first ``sinks`` always stay.

    Args:
        prefill: the dense prefill whose entries are kept or dropped.
        scores: per layer (kv_heads, T), higher is more important.
        threshold: keep scores at or above it (exactly one of threshold and keep_ratio).
        keep_ratio: keep this share of the entries, within ``scope`` (head, layer or global); in a sliding-window
            layer, this share of the entries its window still shows (``ops.selection.keep_topk_visible``).
        scope: where the keep_ratio budget applies.
        window: most recent entries always kept.
        sinks: first entries always kept.
        reduction: how the token scopes score a position over its heads (``ops.selection.REDUCTIONS``).
        page_size: with a token scope, keep whole pages of this many positions (a paged engine's blocks).
    """
    if (threshold is None) == (keep_ratio is None):
        raise ValueError("give exactly one of threshold and keep_ratio")
    check_scope("cache_from_scores", scope, reduction, page_size=page_size, by_threshold=threshold is not None)
    protected = protect_window(scores, window, sinks)
    if threshold is not None:
        keep = keep_threshold(protected, threshold, scope, reduction)
    else:
        windows = prefill.windows or [None] * len(scores)  # a sliding layer's budget is its window's share
        keep = keep_topk_visible(protected, float(keep_ratio), scope, windows, reduction, page_size)  # type: ignore[arg-type]
    return prefill.ragged(keep)


def check_scope(
    name: str,
    scope: str,
    reduction: str = "max",
    scopes: tuple[str, ...] = SCOPES,
    page_size: int = 1,
    by_threshold: bool = False,
) -> None:
    """Refuse an unknown scope or reduction, and a reduction, pages or a token scope where they would not apply.

    A reduction other than ``max`` and pages need a token scope. A threshold (``by_threshold``) decides per head,
    or per position of a layer with ``token_layer`` (reduction ``max`` or ``mean``); ``token_model``, pages and
    the within-head quantile need a keep_ratio budget.

    Raises:
        KVResearchError: what is wrong, with the values that are allowed.
    """
    if scope not in scopes:
        raise KVResearchError(f"method {name}: scope must be one of {scopes}, got {scope!r}.")
    if reduction not in REDUCTIONS:
        raise KVResearchError(f"method {name}: reduction must be one of {REDUCTIONS}, got {reduction!r}.")
    if reduction != "max" and not scope.startswith("token_"):
        raise KVResearchError(
            f"method {name}: reduction={reduction} scores a position shared by several heads, so it needs a token "
            f"scope (token_layer or token_model), not scope={scope}; set method.reduction=max or a token scope."
        )
    if not isinstance(page_size, int) or page_size < 1:
        raise KVResearchError(f"method {name}: page_size must be a whole number >= 1, got {page_size!r}.")
    if page_size > 1 and scope not in PAGED_SCOPES:
        raise KVResearchError(
            f"method {name}: page_size={page_size} keeps whole pages of positions shared by several heads, so it "
            f"needs scope token_layer or token_model, not scope={scope}; set method.page_size=1 or a token scope."
        )
    if by_threshold and (scope in ("token_model", "token_layer_global") or page_size > 1 or reduction == "rank"):
        raise KVResearchError(
            f"method {name}: scope={scope} page_size={page_size} reduction={reduction} needs a keep_ratio budget, "
            "but this method keeps entries by a threshold, which decides per head, or per position of a layer "
            "with scope=token_layer (reduction max or mean); set method.keep_ratio (calibrate=false), or those."
        )


@dataclass(kw_only=True)
class FullCache(Method):
    """No compression: the whole context in the ragged cache (the reference every method is compared to)."""

    name: str = "full"
    chunk_size: int | None = None  # prefill chunk
    lossless: ClassVar[bool] = True

    def __post_init__(self) -> None:
        """A full cache keeps everything: a keep_ratio below 1 is a mistake."""
        super().__post_init__()
        if self.keep_ratio not in (None, 1.0):
            raise KVResearchError(
                f"method=full keeps every entry, so keep_ratio={self.keep_ratio} means nothing for it: leave "
                "method.keep_ratio unset for the full cache (sweep it only over compression methods)."
            )

    def compress(self, session: Session, prompt: Prompt) -> RaggedCache:
        """Prefill the context into a ragged cache and shrink its buffers to it."""
        cache = session.new_cache()
        session.ragged_prefill(prompt.context_ids, cache, self.chunk_size)
        cache.compact()
        return cache
