"""The ``kvr_ragged`` attention implementation: attention over a :class:`RaggedCache`, plugged into transformers.

Transformers dispatches a layer's attention to it (the torch reference in ``ops/attention.py`` on CPU, the
Triton decode kernel on CUDA) once :func:`ragged_attention_enabled` has registered it (an explicit, idempotent
call; importing this module changes nothing) and switched the model to it; with an ordinary cache the same
implementation falls back to sdpa.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvresearch.models.cache import RaggedLayer
from kvresearch.ops.attention import ragged_attention

IMPLEMENTATION = "kvr_ragged"


def ragged_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function: ragged cache -> our attention; anything else -> sdpa."""
    if not isinstance(key, RaggedLayer):
        kwargs.update(dropout=dropout, scaling=scaling, sliding_window=sliding_window)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    layer = key
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    window = sliding_window if sliding_window is not None else layer.window
    args = (query[0], layer.new_positions, layer.k, layer.v, layer.bias, layer.pos, layer.starts, layer.lengths, scale)
    if layer.kernel == "triton" or (layer.kernel == "auto" and query.is_cuda and query.shape[2] <= 16):
        from kvresearch.ops.triton_decode import ragged_decode

        out = ragged_decode(*args, window=window)
    else:
        out = ragged_attention(*args, window=window, stride=layer.stride)
    return out.transpose(0, 1)[None], None  # (1, T, Hq, d)


def register_ragged_attention() -> None:
    """Make ``kvr_ragged`` known to transformers' attention and mask registries (idempotent)."""
    ALL_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, ragged_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)


@contextmanager
def ragged_attention_enabled(model: PreTrainedModel) -> Iterator[None]:
    """Switch the model to the ``kvr_ragged`` attention implementation inside the block."""
    register_ragged_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
