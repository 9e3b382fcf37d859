"""Attention over a ragged KV cache (torch reference; the Triton kernel in ``triton_decode.py`` is its twin).

Storage of one layer, packed: KV head ``h`` owns rows ``starts[h] : starts[h] + lengths[h]`` of
``keys``/``values`` (cap, head_dim), ``bias`` (cap,) and ``pos`` (cap,), the rotary position of each
entry. A query at position ``p`` sees an entry iff ``pos <= p`` (and ``p - pos < window`` on sliding
layers); its logit is ``q.k * scaling + bias``. GQA: query head ``g`` reads KV head ``g // group``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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

    Computed per KV head in fp32 (or the input dtype if wider) by ``scaled_dot_product_attention`` with an
    additive mask (bias, -inf where hidden); a query with no visible entry gets 0. A fresh prefill (every
    head holds exactly the queries' own positions, no bias, no window cut) takes the causal kernel.
    """
    q_heads, n_q = q.shape[0], q.shape[1]
    kv_heads = starts.numel()
    group = q_heads // kv_heads
    dtype = torch.promote_types(q.dtype, torch.float32)
    rows = _fresh_prefill_rows(q_pos, bias, pos, starts, lengths, window)
    if rows is not None:
        k = keys[rows].view(kv_heads, n_q, -1).to(dtype).repeat_interleave(group, 0)
        v = values[rows].view(kv_heads, n_q, -1).to(dtype).repeat_interleave(group, 0)
        out = F.scaled_dot_product_attention(
            q.to(dtype)[None], k[None], v[None], is_causal=True, scale=scaling
        )  # 4-D: flash
        return out[0].to(q.dtype)
    out = torch.zeros(q_heads, n_q, values.shape[-1], dtype=dtype, device=q.device)
    for h, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        if n == 0:
            continue
        k = keys[start : start + n].to(dtype)  # (n, d)
        v = values[start : start + n].to(dtype)
        delta = q_pos[:, None] - pos[start : start + n][None, :]  # (T, n)
        hidden = delta < 0 if window is None else (delta < 0) | (delta >= window)
        mask = bias[start : start + n].to(dtype)[None, :].masked_fill(hidden, float("-inf"))  # (T, n)
        qh = q[h * group : (h + 1) * group].to(dtype)  # (G, T, d)
        shape = (group, n, k.shape[-1])
        o = F.scaled_dot_product_attention(
            qh[None], k.expand(shape)[None], v.expand(shape)[None], attn_mask=mask, scale=scaling
        )[0]
        blind = (mask == float("-inf")).all(dim=-1)  # (T,): nothing visible (hidden or evicted)
        out[h * group : (h + 1) * group] = o.masked_fill(blind[None, :, None], 0.0)
    return out.to(q.dtype)


def _fresh_prefill_rows(
    q_pos: torch.Tensor,
    bias: torch.Tensor,
    pos: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None,
) -> torch.Tensor | None:
    """The packed rows (Hkv * T,) of a plain causal prefill, else None.

    A plain prefill: each head holds exactly positions ``q_pos`` (sorted, contiguous), zero bias, no window cut.
    """
    n_q = q_pos.numel()
    if bool((lengths != n_q).any()) or (window is not None and window < n_q):
        return None
    if n_q == 0 or int(q_pos[-1] - q_pos[0]) != n_q - 1 or bool((q_pos.diff() != 1).any()):
        return None
    rows = (starts[:, None] + torch.arange(n_q, device=starts.device)).reshape(-1)
    fresh = bool((pos[rows].view(-1, n_q) == q_pos).all()) and not bool(bias[rows].any())
    return rows if fresh else None


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, visible: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Brute force in float64: q (Hq, T, d), k/v (Hkv, n, d), bias (Hkv, n), visible (Hkv, T, n) bool."""
    group = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    logits = q.double() @ k.transpose(1, 2) * scaling + bias.double().repeat_interleave(group, 0)[:, None, :]
    logits = logits.masked_fill(~visible.repeat_interleave(group, 0), float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0) @ v
