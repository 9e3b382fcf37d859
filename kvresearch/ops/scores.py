"""KVzip and KVzip+ importance scores of one layer (pure math: tensors in, tensors out).

For query rows ``j`` (the repeated copy of the context) and context keys ``i`` of KV head ``k``:

    KVzip   s_i  = max_{g in group(k)} max_j  a^g_{j,i}
    KVzip+  s+_i = max_{g in group(k)} max_j  a^g_{j,i} * ||v_i W_O^g|| / ||h_j||

``a^g_{j,i}`` is the causal softmax weight of query ``j`` (head ``g``) over every key the row may see
(``k_pos <= q_pos``, and within the sliding window when there is one). Rows are processed in blocks, so
memory is O(kv_heads x group x block x keys), never keys x keys for all heads at once; the softmax
denominator is exact because each block row sees all of its visible keys. With keys in position order (as
the oracle passes them) a block reads only the keys up to its last row and masks only those after its first:
in the repeat prompt, the repeated tokens; the context before them is visible to every row.

When the attention kernel already gives each row's log-normaliser (``lse_j``, see ``ops.attention``),
``kvzip_scores_lse`` forms only the scored columns' logits: ``a_{j,i} = exp(s q_j.k_i - lse_j)``.
"""

from __future__ import annotations

import torch


def value_output_norms(v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """||v_i W_O^g|| for every KV entry i and every query head g of its group.

    Args:
        v: (kv_heads, n, head_dim) values.
        w_o: (q_heads, head_dim, hidden) output projection split per query head.

    Returns:
        (kv_heads, group, n). Uses ||v W||^2 = v (W W^T) v^T, so memory is O(q_heads head_dim^2), not
        O(q_heads n hidden).
    """
    kv_heads, _, d = v.shape
    w = w_o.to(v.dtype).reshape(kv_heads, -1, d, w_o.shape[-1])  # (Hkv, G, d, D)
    gram = w @ w.transpose(-1, -2)  # (Hkv, G, d, d)
    sq = torch.einsum("knd,kgde,kne->kgn", v, gram, v)
    return sq.clamp_min(0).sqrt()


def kvzip_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v_cols: torch.Tensor,
    cols: torch.Tensor,
    h_norm: torch.Tensor,
    w_o: torch.Tensor,
    scaling: float,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None = None,
    block: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KVzip and KVzip+ scores of the key columns ``cols``, maximised over the rows of ``q``.

    Args:
        q: (q_heads, rows, head_dim) post-rotary queries of the scoring rows.
        k: (kv_heads, n_keys, head_dim) post-rotary keys in the softmax (visible ones by position).
        v_cols: (kv_heads, n_cols, head_dim) values of the scored columns.
        cols: (n_cols,) indices of the scored columns into ``k``.
        h_norm: (rows,) ||h_j|| of the attention input of each row.
        w_o: (q_heads, head_dim, hidden) per-head output projection.
        scaling: softmax scale of q.k (1/sqrt(head_dim) for most models).
        q_pos: (rows,) absolute positions of the rows, for the causal (and window) mask.
        k_pos: (n_keys,) absolute positions of the keys (any order; ascending is faster).
        window: sliding window (key visible iff 0 <= q_pos - k_pos < window), or None.
        block: rows per block.

    Returns:
        kvzip, kvzip_plus: (kv_heads, n_cols) each, in the dtype of ``q`` promoted to at least fp32.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v_cols, h_norm = q.to(dtype), k.to(dtype), v_cols.to(dtype), h_norm.to(dtype)
    kv_heads, _n_keys, d = k.shape
    group = q.shape[0] // kv_heads
    rows = q.shape[1]
    q = (q * scaling).reshape(kv_heads, group, rows, d)  # query head h reads KV head h // group
    k_t = k.transpose(1, 2)  # (Hkv, d, N)
    wov = value_output_norms(v_cols, w_o)  # (Hkv, G, C)
    h_norm = _row_norms(h_norm)
    best = torch.full((kv_heads, group, cols.numel()), float("-inf"), dtype=dtype, device=q.device)
    best_plus = best.clone()
    n_cols = cols.numel()
    contiguous = n_cols > 0 and int(cols[-1] - cols[0]) == n_cols - 1 and bool((cols.diff() == 1).all())
    take = slice(int(cols[0]), int(cols[0]) + n_cols) if contiguous else cols  # a view when contiguous
    ordered = bool((k_pos.diff() >= 0).all())
    min_end = int(cols.max()) + 1 if n_cols else 0  # every scored column stays in the block's keys
    for start in range(0, rows, block):
        stop = min(start + block, rows)
        seen, end = _mask_span(q_pos[start:stop], k_pos, window, min_end) if ordered else (0, k_pos.numel())
        qb = q[:, :, start:stop]
        logits = (qb.reshape(kv_heads, -1, d) @ k_t[..., :end]).view(*qb.shape[:3], -1)  # one bmm: (Hkv, G, B, end)
        delta = q_pos[start:stop, None] - k_pos[None, seen:end]  # (B, end - seen)
        hidden = delta < 0 if window is None else (delta < 0) | (delta >= window)
        logits[..., seen:].masked_fill_(hidden, float("-inf"))  # causal (+ window)
        top = logits.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).min)  # a row that sees nothing: 0s
        weights = logits.sub_(top).exp_()  # in place: softmax numerators
        attn = weights[..., take] / weights.sum(dim=-1, keepdim=True)  # exact denominator over all visible keys
        best = torch.maximum(best, attn.amax(dim=2))
        best_plus = torch.maximum(best_plus, attn.div_(h_norm[start:stop, None]).amax(dim=2))
    return best.amax(dim=1), (best_plus * wov).amax(dim=1)


def kvzip_scores_lse(
    q: torch.Tensor,
    k_cols: torch.Tensor,
    v_cols: torch.Tensor,
    h_norm: torch.Tensor,
    w_o: torch.Tensor,
    scaling: float,
    lse: torch.Tensor,
    block: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KVzip and KVzip+ of key columns that every row sees, given each row's log-normaliser.

    Args:
        q: (q_heads, rows, head_dim) post-rotary queries of the scoring rows.
        k_cols: (kv_heads, n_cols, head_dim) post-rotary keys of the scored columns, all visible to every row.
        v_cols: (kv_heads, n_cols, head_dim) their values.
        h_norm: (rows,) ||h_j||.
        w_o: (q_heads, head_dim, hidden) per-head output projection.
        scaling: softmax scale of q.k.
        lse: (q_heads, rows) log-sum-exp of each row's scaled logits over its softmax keys.
        block: rows per block (64 is the fastest on a 2-core CPU at 2k columns: the blocks stay in cache).

    Returns:
        kvzip, kvzip_plus: (kv_heads, n_cols), as :func:`kvzip_scores` over the same softmax.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    kv_heads, n_cols, d = k_cols.shape
    group, rows = q.shape[0] // kv_heads, q.shape[1]
    q = (q.to(dtype) * scaling).reshape(kv_heads, group, rows, d)
    k_t = k_cols.to(dtype).transpose(1, 2)  # (Hkv, d, C)
    lse = lse.to(dtype).reshape(kv_heads, group, rows, 1)
    log_h = _row_norms(h_norm.to(dtype)).log()[:, None]  # (rows, 1)
    # In the log domain: max_j exp(x_j) = exp(max_j x_j), so no exp over the (rows x cols) blocks.
    best = torch.full((kv_heads, group, n_cols), float("-inf"), dtype=dtype, device=q.device)
    best_plus = best.clone()
    for start in range(0, rows, block):
        stop = min(start + block, rows)
        qb = q[:, :, start:stop].reshape(kv_heads, -1, d)
        log_attn = (qb @ k_t).view(kv_heads, group, stop - start, n_cols).sub_(lse[:, :, start:stop])
        best = torch.maximum(best, log_attn.amax(dim=2))
        best_plus = torch.maximum(best_plus, log_attn.sub_(log_h[start:stop]).amax(dim=2))
    return best.exp().amax(dim=1), (best_plus.exp() * value_output_norms(v_cols.to(dtype), w_o)).amax(dim=1)


def _row_norms(h_norm: torch.Tensor) -> torch.Tensor:
    """||h_j||, with inf for a row whose attention input is all zeros (a zero padding embedding): / inf = 0."""
    return torch.where(h_norm > 0, h_norm, torch.full_like(h_norm, float("inf")))


def _mask_span(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, min_end: int) -> tuple[int, int]:
    """For keys sorted by position, the span ``[seen, end)`` of keys that rows ``q_pos`` need masked.

    Keys from ``end`` on are in every row's future (left out of the block, unless a scored column, up to
    ``min_end``, is among them); without a window, keys before ``seen`` are visible to every row (no mask).
    """
    end = max(int(torch.searchsorted(k_pos, q_pos.max(), right=True)), min_end)
    seen = 0 if window is not None else min(int(torch.searchsorted(k_pos, q_pos.min(), right=True)), end)
    return seen, end
