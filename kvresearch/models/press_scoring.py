"""A scorer press's scores, reshaped before it selects: sinks always kept, one decision per position in a layer.

``ScoredPress`` wraps any kvpress ``ScorerPress``: it asks the inner press for its scores (b, Hkv, T), then

* ``token_layer``: gives every KV head the position's score reduced over the layer's heads (its best score, or
  ``ops.selection.position_scores``'s other reductions), so each head keeps the same positions (the eviction a
  paged engine can hold; docs/serving.md);
* ``sinks``: scores the first ``sinks`` positions above every other pair (kvpress's KVzip rule), so they stay.

kvpress then selects as it always does (its top-k per head, or a wrapper's own rule: AdaKV, Chunk, DMS, ...).
Positions evicted from every layer at once (``token_model``) need every layer's scores before the first layer
is cut, which a press cutting layer by layer cannot have: it is refused for presses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvpress import ScorerPress

from kvresearch.errors import KVResearchError
from kvresearch.ops.selection import position_scores

PRESS_SCOPES = ("head", "token_layer")


@dataclass
class ScoredPress(ScorerPress):
    """``press``'s scores with ``sinks`` kept and, with ``token_layer``, one decision per position in a layer."""

    press: Any = None
    sinks: int = 0
    token_layer: bool = False
    reduction: str = "max"  # with token_layer: ops.selection.REDUCTIONS

    def post_init_from_model(self, model: Any) -> None:
        """The inner press's own set-up."""
        self.press.post_init_from_model(model)

    def score(self, module: Any, hidden: Any, keys: Any, values: Any, attentions: Any, kwargs: dict) -> Any:
        """(b, Hkv, T) the inner scores, reshaped (see the module docstring)."""
        scores = self.press.score(module, hidden, keys, values, attentions, kwargs)
        if self.token_layer:
            shared = torch.stack([position_scores(s, self.reduction) for s in scores])  # (b, T)
            scores = shared[:, None].to(scores.dtype).expand_as(scores).contiguous()
        if self.sinks:
            scores[..., : self.sinks] = scores.amax() + 1.0
        return scores


def rescored(press: Any, sinks: int, scope: str, reduction: str = "max") -> Any:
    """``press`` with its scorer wrapped in :class:`ScoredPress` (a wrapper's inner scorer, if it is a wrapper).

    Raises:
        KVResearchError: an unknown scope, or a press without a scorer to wrap.
    """
    if scope not in PRESS_SCOPES:
        why = " (every layer's scores are needed before the first is cut)" if scope == "token_model" else ""
        raise KVResearchError(f"A kvpress press takes scope {' or '.join(PRESS_SCOPES)}, not {scope}{why}.")
    if sinks == 0 and scope == "head":
        return press
    if isinstance(press, ScorerPress):
        layer = scope == "token_layer"
        return ScoredPress(press.compression_ratio, press=press, sinks=sinks, token_layer=layer, reduction=reduction)
    for field in ("press", "base_press"):
        if isinstance(getattr(press, field, None), ScorerPress):
            setattr(press, field, rescored(getattr(press, field), sinks, scope, reduction))
            return press
    raise KVResearchError(
        f"{type(press).__name__} has no scorer press whose scores could keep sinks or decide per position (it "
        "prunes by its own rule): set method.sinks=0 and method.scope=head."
    )
