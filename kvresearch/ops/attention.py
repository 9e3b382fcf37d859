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
    stride: int | None = None,
) -> torch.Tensor:
    """Attention output for queries q (q_heads, T, d) at positions q_pos (T,); returns (q_heads, T, d).

    Computed in fp32 (or the input dtype if wider) by ``scaled_dot_product_attention`` with an additive
    mask (bias, -inf where hidden); a query with no visible entry gets 0. When every KV head holds as many
    entries at the same stride (the full cache, uniform budgets: :func:`uniform_stride`), all heads go in
    one call over strided views of the packed buffers (no copy), without a mask when every entry is visible
    and unbiased (decoding from a full cache) and with the causal kernel for a fresh prefill; otherwise one
    call per KV head. ``stride``: the layout's, when the caller keeps it (else read from ``starts``/``lengths``).
    """
    stride = stride if stride is not None else uniform_stride(starts, lengths)
    if stride is not None:
        return _uniform_attention(q, q_pos, keys, values, bias, pos, int(starts[0]), stride, starts.numel(),
                                  int(lengths[0]), scaling, window)  # fmt: skip
    q_heads, n_q = q.shape[0], q.shape[1]
    group = q_heads // starts.numel()
    dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q_heads, n_q, values.shape[-1], dtype=dtype, device=q.device)
    for h, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        if n == 0:
            continue
        k = keys[start : start + n].to(dtype)  # (n, d)
        v = values[start : start + n].to(dtype)
        b, p = bias[start : start + n], pos[start : start + n]
        qh = q[h * group : (h + 1) * group].to(dtype)  # (G, T, d)
        cut = window is not None and int(q_pos[-1]) - int(p.min()) >= window
        if not cut and int(p.max()) <= int(q_pos[0]) and not bool(b.any()):
            # every entry visible to every query and unbiased (decoding): the group's rows share one key set
            o = F.scaled_dot_product_attention(qh.reshape(1, 1, -1, qh.shape[-1]), k[None, None], v[None, None],
                                               scale=scaling)  # fmt: skip
            out[h * group : (h + 1) * group] = o.view(group, n_q, -1)
            continue
        delta = q_pos[:, None] - p[None, :]  # (T, n)
        hidden = delta < 0 if window is None else (delta < 0) | (delta >= window)
        mask = b.to(dtype)[None, :].masked_fill(hidden, float("-inf"))  # (T, n)
        shape = (group, n, k.shape[-1])
        o = F.scaled_dot_product_attention(
            qh[None], k.expand(shape)[None], v.expand(shape)[None], attn_mask=mask, scale=scaling
        )[0]
        blind = (mask == float("-inf")).all(dim=-1)  # (T,): nothing visible (hidden or evicted)
        out[h * group : (h + 1) * group] = o.masked_fill(blind[None, :, None], 0.0)
    return out.to(q.dtype)


def uniform_stride(starts: torch.Tensor, lengths: torch.Tensor) -> int | None:
    """The row stride between KV heads when every head holds as many entries at ``starts[0] + h * stride``.

    Read from the (CPU) layout alone; None when the heads differ (a ragged cache after uneven eviction).
    """
    heads = starts.numel()
    if heads == 0 or int(lengths[0]) == 0 or bool((lengths != lengths[0]).any()):
        return None
    stride = int(starts[1] - starts[0]) if heads > 1 else int(lengths[0])
    if stride < int(lengths[0]) or bool((starts != starts[0] + stride * torch.arange(heads)).any()):
        return None
    return stride


def head_views(t: torch.Tensor, first: int, stride: int, heads: int) -> torch.Tensor:
    """(heads, stride, ...) view of packed rows ``t`` (rows, ...): head h's rows ``first + h * stride`` on, no copy."""
    return t.as_strided((heads, stride, *t.shape[1:]), (stride * t.stride(0), *t.stride()),
                        t.storage_offset() + first * t.stride(0))  # fmt: skip


def _uniform_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    pos: torch.Tensor,
    first: int,
    stride: int,
    kv_heads: int,
    n: int,
    scaling: float,
    window: int | None,
) -> torch.Tensor:
    """:func:`ragged_attention` when every head holds ``n`` entries, head h at rows ``first + h * stride``."""
    q_heads, n_q = q.shape[0], q.shape[1]
    group = q_heads // kv_heads
    dtype = torch.promote_types(q.dtype, torch.float32)
    view = lambda t: head_views(t, first, stride, kv_heads)[:, :n]
    k, v, b, p = view(keys).to(dtype), view(values).to(dtype), view(bias), view(pos)  # (Hkv, n, d), (Hkv, n)
    k4, v4 = (t[:, None].expand(kv_heads, group, n, t.shape[-1]) for t in (k, v))  # (Hkv, G, n, d), no copy
    q4 = q.to(dtype).reshape(kv_heads, group, n_q, -1)
    cut = window is not None and int(q_pos[-1]) - int(p.min()) >= window
    unbiased = not bool(b.any())
    if unbiased and not cut and n_q == n and bool((p == q_pos).all()):  # a fresh prefill: each query sees its past
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scaling)
    elif unbiased and not cut and int(p.max()) <= int(q_pos[0]):  # everything visible: decoding from a full cache
        out = F.scaled_dot_product_attention(q4, k4, v4, scale=scaling)
    else:
        delta = q_pos[None, :, None] - p[:, None, :]  # (Hkv, T, n)
        hidden = delta < 0 if window is None else (delta < 0) | (delta >= window)
        mask = b.to(dtype)[:, None, :].masked_fill(hidden, float("-inf"))  # (Hkv, T, n)
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask[:, None], scale=scaling)
        blind = (mask == float("-inf")).all(dim=-1)  # (Hkv, T): nothing visible (hidden or evicted)
        out = out.masked_fill(blind[:, None, :, None], 0.0)
    return out.reshape(q_heads, n_q, -1).to(q.dtype)


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, visible: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Brute force in float64: q (Hq, T, d), k/v (Hkv, n, d), bias (Hkv, n), visible (Hkv, T, n) bool."""
    group = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    logits = q.double() @ k.transpose(1, 2) * scaling + bias.double().repeat_interleave(group, 0)[:, None, :]
    logits = logits.masked_fill(~visible.repeat_interleave(group, 0), float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0) @ v


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and each row's log-sum-exp of its scaled logits, from torch's CPU flash kernel.

    q (b, Hq, T, d), k, v (b, Hkv, S, d) with Hq a multiple of Hkv (GQA is native), T, S > 0; ``causal``
    needs S == T. Returns out (b, Hq, T, d) in q's dtype and lse (b, Hq, T) in fp32 (fp64 for fp64 inputs).
    The kernel is the one ``scaled_dot_product_attention`` runs on CPU, so the output is its output bit for bit.
    """
    if q.device.type != "cpu" or q.shape[2] == 0 or k.shape[2] == 0:  # the kernel aborts the process on 0 rows
        raise ValueError(f"attention_with_lse runs on CPU with rows and keys, got {q.device} {tuple(q.shape)} "
                         f"{tuple(k.shape)}")  # fmt: skip
    if causal and k.shape[2] != q.shape[2]:
        raise ValueError(f"a causal part is square: {q.shape[2]} rows, {k.shape[2]} keys")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scaling)
    return out, lse


def merged_attention(
    q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, bool]], scaling: float
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Attention over keys split into parts, merged exactly: ``out = sum_i exp(lse_i - lse) out_i``.

    The parts partition what the rows see; each is ``(k, v, causal)`` as in :func:`attention_with_lse`: a part
    that every row sees whole, or the rows' own keys (causal, square). Splitting the repeat pass this way skips
    the masked half of its square and gives the log-normaliser of any union of parts (``logaddexp`` of theirs).
    Returns out (b, Hq, T, d) in q's dtype and each part's lse (b, Hq, T).
    """
    outs, lses = zip(*(attention_with_lse(q, k, v, scaling, causal) for k, v, causal in parts), strict=True)
    total = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(o.to(total.dtype) * (lse - total).exp()[..., None] for o, lse in zip(outs, lses, strict=True))
    return torch.as_tensor(out).to(q.dtype), list(lses)
