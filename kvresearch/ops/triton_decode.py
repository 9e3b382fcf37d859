"""Triton decode attention over the ragged cache: the twin of ``ops.attention.ragged_attention``.

One program per (query head, query token): it walks its KV head's entries in blocks of ``BLOCK_N`` with an
online softmax (fp32 accumulators), adding the per-entry bias and masking by position (causal, and the
sliding window when given). Dead entries (bias = -inf) and invisible ones contribute nothing; a query
that sees nothing gets 0, like the torch reference. Meant for decoding (a few query tokens); prefill
uses the torch path. On CPU it runs under ``TRITON_INTERPRET=1`` (set before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG = -1.0e30


@triton.jit
def _ragged_decode_kernel(
    Q,
    K,
    V,
    B,
    P,
    STARTS,
    LENGTHS,
    QPOS,
    OUT,
    scale,
    window,
    stride_qh,
    stride_qt,
    stride_k,
    stride_v,
    stride_oh,
    stride_ot,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    head = tl.program_id(0)
    tok = tl.program_id(1)
    kv_head = head // GROUP
    start = tl.load(STARTS + kv_head)
    n = tl.load(LENGTHS + kv_head)
    q_pos = tl.load(QPOS + tok)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    q = tl.load(Q + head * stride_qh + tok * stride_qt + offs_d).to(tl.float32)
    m = tl.full((), NEG, tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((DV,), tl.float32)
    for block in range(0, n, BLOCK_N):
        idx = block + tl.arange(0, BLOCK_N)
        valid = idx < n
        rows = start + idx
        k = tl.load(K + rows[:, None] * stride_k + offs_d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        bias = tl.load(B + rows, mask=valid, other=NEG).to(tl.float32)
        pos = tl.load(P + rows, mask=valid, other=0)
        visible = valid & (pos <= q_pos) & (bias > NEG)
        if HAS_WINDOW:
            visible = visible & (q_pos - pos < window)
        s = tl.sum(k * q[None, :], axis=1) * scale + bias
        s = tl.where(visible, s, NEG)
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.where(visible, tl.exp(s - m_new), 0.0)
        v = tl.load(V + rows[:, None] * stride_v + offs_dv[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        total = total * alpha + tl.sum(p, axis=0)
        m = m_new
    out = tl.where(total > 0, acc / tl.maximum(total, 1e-30), 0.0)
    tl.store(OUT + head * stride_oh + tok * stride_ot + offs_dv, out.to(OUT.dtype.element_ty))


def ragged_decode(
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
    block_n: int = 64,
) -> torch.Tensor:
    """Same signature and result as ``ragged_attention``: q (q_heads, T, d) -> (q_heads, T, dv)."""
    q_heads, n_tok, d = q.shape
    dv = values.shape[-1]
    if d & (d - 1) or dv & (dv - 1):
        raise ValueError(f"head sizes must be powers of two for the Triton kernel (got {d}, {dv})")
    q = q.contiguous()
    keys, values = keys.contiguous(), values.contiguous()
    out = torch.empty(q_heads, n_tok, dv, dtype=q.dtype, device=q.device)
    device = q.device
    starts_d = starts.to(device=device, dtype=torch.int64)
    lengths_d = lengths.to(device=device, dtype=torch.int64)
    grid = (q_heads, n_tok)
    _ragged_decode_kernel[grid](
        q,
        keys,
        values,
        bias.contiguous(),
        pos.contiguous(),
        starts_d,
        lengths_d,
        q_pos.to(device).contiguous(),
        out,
        float(scaling),
        int(window or 0),
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        values.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=q_heads // starts.numel(),
        D=d,
        DV=dv,
        BLOCK_N=block_n,
        HAS_WINDOW=window is not None,
    )
    return out
