"""Model adapter: the only place that knows transformers' module paths and attention internals.

Supported families: llama, qwen2, qwen3 (q_norm/k_norm) and gemma3 (q_norm/k_norm, per-layer
sliding windows, a separate local rotary base, ``query_pre_attn_scalar`` scaling). Everything else
in the package talks to a model through :class:`ModelAdapter`.

Shapes: ``h`` is ``(batch, seq, hidden)``; queries ``(batch, q_heads, seq, head_dim)``; keys and values
``(batch, kv_heads, seq, head_dim)``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from kvresearch.errors import KVResearchError

FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "gemma3_text": "gemma3"}


@dataclass(frozen=True)
class AttentionLayer:
    """One decoder layer's attention, as the rest of the package sees it."""

    index: int
    attn: Any  # nn.Module: the self-attention module (q_proj, k_proj, v_proj, o_proj[, q_norm, k_norm])
    input_norm: Any  # nn.Module: the RMSNorm whose output is the attention input h
    sliding_window: int | None  # None for global layers
    layer_type: str  # "full_attention" or "sliding_attention"
    scaling: float  # softmax scale applied to q.k


class ModelAdapter:
    """Uniform access to a causal LM's attention layers."""

    def __init__(self, model: PreTrainedModel):
        config = model.config
        text_config = getattr(config, "text_config", None) or config
        model_type = getattr(config, "model_type", None)
        if model_type not in FAMILIES:
            raise KVResearchError(
                f"Model family '{model_type}' is not supported; supported: {sorted(set(FAMILIES.values()))}. "
                "Add it to kvresearch/models/adapter.py (module paths, norms, rotary) with a test."
            )
        self.model = model
        self.family = FAMILIES[model_type]
        self.config = text_config
        self.decoder = self._find_decoder(model)
        self.num_layers: int = text_config.num_hidden_layers
        self.num_heads: int = text_config.num_attention_heads
        self.num_kv_heads: int = text_config.num_key_value_heads
        self.group_size = self.num_heads // self.num_kv_heads
        self.hidden_size: int = text_config.hidden_size
        self.head_dim: int = getattr(text_config, "head_dim", None) or self.hidden_size // self.num_heads
        self.layers = [self._layer(i, block) for i, block in enumerate(self.decoder.layers)]

    @staticmethod
    def _find_decoder(model: nn.Module) -> Any:
        inner = getattr(model, "model", model)
        inner = getattr(inner, "language_model", inner)  # multimodal wrappers (Gemma 3 it)
        if not hasattr(inner, "layers"):
            raise KVResearchError(f"Cannot find decoder layers in {type(model).__name__}.")
        return inner

    def _layer(self, index: int, block: Any) -> AttentionLayer:
        attn = block.self_attn
        window = getattr(attn, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None)
        layer_type = layer_types[index] if layer_types else "full_attention"
        return AttentionLayer(index, attn, block.input_layernorm, window, layer_type, float(attn.scaling))

    # ---------------------------------------------------------------- projections and rotary
    def project(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of attention input ``h`` before rotary (after q_norm/k_norm where the model has them).

        Args:
            layer: decoder layer index.
            h: (batch, seq, hidden).

        Returns:
            q (batch, q_heads, seq, head_dim), k and v (batch, kv_heads, seq, head_dim).
        """
        attn = self.layers[layer].attn
        b, t, _ = h.shape
        q = attn.q_proj(h).view(b, t, -1, self.head_dim)
        k = attn.k_proj(h).view(b, t, -1, self.head_dim)
        v = attn.v_proj(h).view(b, t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def rotary(self, layer: int, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` (batch, seq) as the model computes them for ``layer``."""
        rotary = self.decoder.rotary_emb
        if self.family == "gemma3":
            return rotary(like, positions, self.layers[layer].layer_type)
        return rotary(like, positions)

    def apply_rotary(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (batch, q_heads, seq, d) and k (batch, kv_heads, seq, d) to ``positions`` (batch, seq)."""
        cos, sin = self.rotary(layer, positions, q)
        module = sys.modules[type(self.layers[layer].attn).__module__]
        return module.apply_rotary_pos_emb(q, k, cos, sin)

    def qkv(
        self, layer: int, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-rotary q, k and v exactly as the attention function receives them (keys as cached)."""
        q, k, v = self.project(layer, h)
        q, k = self.apply_rotary(layer, q, k, positions)
        return q, k, v

    def output_weight(self, layer: int) -> torch.Tensor:
        """W_O split per query head: (q_heads, head_dim, hidden); head g writes ``o_g @ W_O[g]``."""
        weight = self.layers[layer].attn.o_proj.weight  # (hidden, q_heads * head_dim)
        return weight.T.reshape(self.num_heads, self.head_dim, self.hidden_size)

    def kv_group(self, kv_head: int) -> range:
        """Query heads that read KV head ``kv_head`` (transformers' repeat_kv layout)."""
        return range(kv_head * self.group_size, (kv_head + 1) * self.group_size)

    @property
    def max_positions(self) -> int:
        """The model's position limit (0 if it does not say)."""
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)
