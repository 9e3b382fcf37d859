"""Fixed-budget selection: which entries to keep, by any score, per head, per layer or globally.

``scores`` is a list over layers of (kv_heads, n) tensors (higher = more important; +inf = always keep).
The result is, per layer and head, the sorted indices of the kept entries. With ``keep_ratio`` r, the
budget is round(r x entries) over the chosen scope: each head keeps the same share (``head``), each layer
does while its heads compete (``layer``), or all layers and heads compete (``global``). Entries scored
+inf (a protected window, sinks) are kept even when the budget is smaller than they are.
"""

from __future__ import annotations

import torch

SCOPES = ("head", "layer", "global")


def protect_window(scores: list[torch.Tensor], window: int, sinks: int = 0) -> list[torch.Tensor]:
    """Copies of ``scores`` with the first ``sinks`` and the last ``window`` entries set to +inf."""
    out = []
    for s in scores:
        s = s.clone().float()
        if window > 0:
            s[:, -window:] = float("inf")
        if sinks > 0:
            s[:, :sinks] = float("inf")
        out.append(s)
    return out


def keep_topk(scores: list[torch.Tensor], keep_ratio: float, scope: str = "head") -> list[list[torch.Tensor]]:
    """Indices kept per layer and head under a ``keep_ratio`` budget over ``scope`` (see module docstring)."""
    if not 0.0 <= keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must lie in [0, 1], got {keep_ratio}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if scope == "head":
        masks = []
        for s in scores:
            k = round(keep_ratio * s.shape[1])
            mask = torch.zeros_like(s, dtype=torch.bool)
            mask.scatter_(1, s.topk(k, dim=1).indices, True)
            masks.append(mask)
    elif scope == "layer":
        masks = [_top_mask(s, round(keep_ratio * s.numel())) for s in scores]
    else:
        flat = torch.cat([s.flatten() for s in scores])
        kept = _top_mask(flat, round(keep_ratio * flat.numel()))
        masks, offset = [], 0
        for s in scores:
            masks.append(kept[offset : offset + s.numel()].view_as(s))
            offset += s.numel()
    masks = [mask | torch.isposinf(s) for mask, s in zip(masks, scores, strict=True)]
    return [[torch.nonzero(row).view(-1) for row in mask] for mask in masks]


def keep_threshold(scores: list[torch.Tensor], threshold: float) -> list[list[torch.Tensor]]:
    """Indices whose score is at least ``threshold``, per layer and head."""
    return [[torch.nonzero(row >= threshold).view(-1) for row in s] for s in scores]


def _top_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    mask = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    mask[values.flatten().topk(k).indices] = True
    return mask.view_as(values)
