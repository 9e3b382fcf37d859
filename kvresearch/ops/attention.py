"""Attention over a ragged KV cache (torch reference; the Triton kernel in ``triton_decode.py`` is its twin).

Storage of one layer, packed: KV head ``h`` owns rows ``starts[h] : starts[h] + lengths[h]`` of
``keys``/``values`` (cap, head_dim), ``bias`` (cap,) and ``pos`` (cap,), the rotary position of each
entry. A query at position ``p`` sees an entry iff ``pos <= p`` (and ``p - pos < window`` on sliding
layers); its logit is ``q.k * scaling + bias``. GQA: query head ``g`` reads KV head ``g // group``.
"""

from __future__ import annotations

import torch


def ragged_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    pos: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention output for queries q (q_heads, T, d) at positions q_pos (T,); returns (q_heads, T, d).

    Computed per KV head in fp32 (or the input dtype if wider); a query with no visible entry gets 0.
    """
    q_heads = q.shape[0]
    kv_heads = starts.numel()
    group = q_heads // kv_heads
    dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q_heads, q.shape[1], values.shape[-1], dtype=dtype, device=q.device)
    for h, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        if n == 0:
            continue
        k = keys[start : start + n].to(dtype)  # (n, d)
        v = values[start : start + n].to(dtype)
        delta = q_pos[:, None] - pos[start : start + n][None, :]  # (T, n)
        hidden = delta < 0 if window is None else (delta < 0) | (delta >= window)
        mask = bias[start : start + n].to(dtype)[None, :].masked_fill(hidden, float("-inf"))  # (T, n)
        logits = (q[h * group : (h + 1) * group].to(dtype) @ k.T) * scaling + mask  # (G, T, n)
        weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
        out[h * group : (h + 1) * group] = weights @ v
    return out.to(q.dtype)


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, visible: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Brute force in float64: q (Hq, T, d), k/v (Hkv, n, d), bias (Hkv, n), visible (Hkv, T, n) bool."""
    group = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    logits = q.double() @ k.transpose(1, 2) * scaling + bias.double().repeat_interleave(group, 0)[:, None, :]
    logits = logits.masked_fill(~visible.repeat_interleave(group, 0), float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0) @ v
