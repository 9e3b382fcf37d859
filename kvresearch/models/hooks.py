"""Hooks on a model, always inside context managers that remove them.

``attention_calls`` wraps the attention function that transformers dispatches to (sdpa, eager,
flash, ...) so that a callback sees exactly the q, k, v the model attends with, without switching the
model to eager attention; a callback that returns the attention output replaces the call.
``before_attention`` calls back with each layer's attention input h
(``attention_inputs`` records it);
``after_attention`` calls back once each attention module has run (its cache is then up to date);
``model_calls`` calls back with the input ids before and after every forward pass of the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvresearch.models.adapter import ModelAdapter

# callback(layer_index, query (b, Hq, T, d), key (b, Hkv, S, d), value (b, Hkv, S, d)) -> None or output (b, Hq, T, d)
AttentionCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]


@contextmanager
def attention_calls(adapter: ModelAdapter, callback: AttentionCallback) -> Iterator[None]:
    """Call ``callback`` with the post-rotary q, k, v of every attention call inside the block.

    When the callback returns a tensor (b, Hq, T, d), that is the call's attention output and the model's own
    attention function does not run.
    """
    impl = adapter.config._attn_implementation or "eager"
    # Overrides go into the interface's local mapping, which wins over the class-wide one (kvpress patches there).
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    had_local, previous = impl in local, local.get(impl)
    original: Any = ALL_ATTENTION_FUNCTIONS.get(impl)
    if original is None:  # eager lives in each modeling file, not in the registry
        module = __import__(type(adapter.layers[0].attn).__module__, fromlist=["eager_attention_forward"])
        original = module.eager_attention_forward

    def recorder(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kw: Any):
        out = callback(int(module.layer_idx), query, key, value)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
        return original(module, query, key, value, *args, **kw)

    local[impl] = recorder
    try:
        yield
    finally:
        if had_local:
            local[impl] = previous
        else:
            del local[impl]


@contextmanager
def before_attention(adapter: ModelAdapter, callback: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Call ``callback(layer, h)`` with each attention module's input h (batch, seq, hidden) before it runs.

    The layer's cache holds only the earlier positions at that point, so the callback may rewrite it.
    """

    def hook(index: int) -> Callable[..., None]:
        def record(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            callback(index, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

        return record

    handles = [layer.attn.register_forward_pre_hook(hook(layer.index), with_kwargs=True) for layer in adapter.layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def attention_inputs(adapter: ModelAdapter, store: dict[int, torch.Tensor]) -> AbstractContextManager[None]:
    """Record ``store[layer] = h`` (batch, seq, hidden), the input of each layer's attention module."""
    return before_attention(adapter, store.__setitem__)


@contextmanager
def after_attention(adapter: ModelAdapter, callback: Callable[[int], None]) -> Iterator[None]:
    """Call ``callback(layer_index)`` after each attention module's forward inside the block."""
    handles = [
        layer.attn.register_forward_hook(lambda _m, _a, _o, index=layer.index: callback(index))
        for layer in adapter.layers
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def model_calls(
    model: nn.Module, before: Callable[[torch.Tensor], None], after: Callable[[torch.Tensor], None]
) -> Iterator[None]:
    """Call ``before(input_ids)`` and ``after(input_ids)`` (1, T) around every forward pass of ``model``."""

    def ids_of(args: tuple, kwargs: dict) -> torch.Tensor:
        return kwargs["input_ids"] if "input_ids" in kwargs else args[0]

    handles = [
        model.register_forward_pre_hook(lambda _m, args, kwargs: before(ids_of(args, kwargs)), with_kwargs=True),
        model.register_forward_hook(lambda _m, args, kwargs, _out: after(ids_of(args, kwargs)), with_kwargs=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
