"""Fixed-budget selection: which entries to keep, by any score, per head, per layer or globally.

``scores`` is a list over layers of (kv_heads, n) tensors (higher = more important; +inf = always keep).
The result is, per layer and head, the sorted indices of the kept entries. With ``keep_ratio`` r, the
budget is round(r x entries) over the chosen scope: each head keeps the same share (``head``), each layer
does while its heads compete (``layer``), or all layers and heads compete (``global``). Entries scored
+inf (a protected window, sinks) are kept even when the budget is smaller than they are.

``adakv`` is AdaKV's head-adaptive budget as kvpress's ``AdaKVPress`` computes it: each layer keeps
``heads x n_kept`` entries (``n_kept = max(1, int(n x (1 - compression_ratio)))``, kvpress's rounding), its heads
compete for them, and each head first keeps its top ``safeguard`` share of ``n_kept`` (0.2, at least one).

The token scopes are what serving engines can hold: a position is kept or evicted in every head of a layer at
once (``token_layer``: paged engines, whose pages span all heads) or in every layer (``token_model``:
llama.cpp). A position scores one value reduced over the heads that share the decision (:func:`position_scores`):
by default their maximum, so it stays when any of them needs it; or their mean; or its best quantile within a
head (``rank``), so that a head whose scores run higher than the others' does not decide every position. Under
``token_model`` the layers' reduced scores meet by their maximum. Each layer (or the model) keeps round(r x
positions) positions.

``token_layer_global`` decides per position of a layer, as ``token_layer``, but its budget spans the layers: the
(layer, position) pairs compete by their reduced scores for round(r x all positions), so a layer keeps what its
scores earn (KVzap's threshold rule at ``token_layer`` spends it so, at a ratio fixed per context).

``page_size`` P > 1 makes the token scopes keep whole pages, as a paged engine frees them (vLLM's blocks of 16):
page i holds positions [iP, (i + 1)P) (the last one may be shorter), scores the best of its positions, and the
best pages are kept until they hold at least round(r x positions) positions (so a kept page is never split).

A threshold (:func:`keep_threshold`) decides per head, or with ``token_layer`` per position of a layer.

On a model with sliding-window layers (Gemma-3), :func:`keep_topk_visible` budgets each sliding layer over the
entries its window still shows, so every method is compared at the memory it really holds.
"""

from __future__ import annotations

import torch

SCOPES = ("head", "layer", "global", "adakv", "token_layer", "token_layer_global", "token_model")
REDUCTIONS = ("max", "mean", "rank")  # over the heads that keep or evict a position together (the token scopes)
PAGED_SCOPES = ("token_layer", "token_model")  # the scopes that take a page_size above 1
ADAKV_SAFEGUARD = 0.2  # kvpress AdaKVPress.alpha_safeguard


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


def position_scores(scores: torch.Tensor, reduction: str = "max") -> torch.Tensor:
    """One score per position (n,) of a layer's ``scores`` (kv_heads, n), reduced over the heads.

    ``max``: the best score; ``mean``: the mean score; ``rank``: the best quantile within a head (each head's
    scores replaced by rank / (n - 1)). A position protected in any head (+inf: the window, the sinks) stays +inf.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    inf = torch.isposinf(scores)
    if reduction == "max":
        one = scores.amax(dim=0)
    elif reduction == "mean":
        one = scores.masked_fill(inf, 0.0).mean(dim=0)
    else:
        ranks = scores.argsort(dim=1).argsort(dim=1).to(scores.dtype)
        one = (ranks / max(1, scores.shape[1] - 1)).amax(dim=0)
    return one.masked_fill(inf.any(dim=0), float("inf"))


def keep_topk(
    scores: list[torch.Tensor],
    keep_ratio: float,
    scope: str = "head",
    safeguard: float = ADAKV_SAFEGUARD,
    reduction: str = "max",
    page_size: int = 1,
) -> list[list[torch.Tensor]]:
    """Indices kept per layer and head under a ``keep_ratio`` budget over ``scope`` (see module docstring).

    ``reduction`` (:data:`REDUCTIONS`) is how the token scopes score a position; the other scopes take ``max``.
    ``page_size`` (token scopes only) keeps whole pages of that many positions.
    """
    if not 0.0 <= keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must lie in [0, 1], got {keep_ratio}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if reduction not in REDUCTIONS or (reduction != "max" and not scope.startswith("token_")):
        raise ValueError(f"reduction {reduction!r} needs a token scope and one of {REDUCTIONS} (scope {scope!r})")
    if page_size < 1 or (page_size > 1 and scope not in PAGED_SCOPES):
        raise ValueError(f"page_size {page_size} must be 1, or above 1 with a scope in {PAGED_SCOPES} ({scope!r})")
    if scope == "head":
        masks = []
        for s in scores:
            k = round(keep_ratio * s.shape[1])
            mask = torch.zeros_like(s, dtype=torch.bool)
            mask.scatter_(1, s.topk(k, dim=1).indices, True)
            masks.append(mask)
    elif scope == "layer":
        masks = [_top_mask(s, round(keep_ratio * s.numel())) for s in scores]
    elif scope == "adakv":
        masks = [_adakv_mask(s, keep_ratio, safeguard) for s in scores]
    elif scope == "token_layer":
        masks = [
            _top_pages(position_scores(s, reduction), round(keep_ratio * s.shape[1]), page_size).expand_as(s)
            for s in scores
        ]
    elif scope == "token_layer_global":
        shared = _top_over([position_scores(s, reduction) for s in scores], keep_ratio)
        masks = [one.expand_as(s) for one, s in zip(shared, scores, strict=True)]
    elif scope == "token_model":
        if len({s.shape[1] for s in scores}) > 1:
            raise ValueError(
                f"scope token_model needs as many positions in every layer, got {[s.shape[1] for s in scores]}"
            )
        best = torch.stack([position_scores(s, reduction) for s in scores]).amax(dim=0)  # (n,)
        kept_positions = _top_pages(best, round(keep_ratio * best.numel()), page_size)
        masks = [kept_positions.expand_as(s) for s in scores]
    else:
        masks = _top_over(scores, keep_ratio)
    protected = [torch.isposinf(s) for s in scores]
    if scope.startswith("token_layer"):  # a position protected in one head is kept in every head sharing the decision
        protected = [p.any(dim=0).expand_as(p) for p in protected]
    elif scope == "token_model":
        anywhere = torch.stack([p.any(dim=0) for p in protected]).any(dim=0)
        protected = [anywhere.expand_as(p) for p in protected]
    masks = [mask | p for mask, p in zip(masks, protected, strict=True)]
    return [[torch.nonzero(row).view(-1) for row in mask] for mask in masks]


def keep_topk_visible(
    scores: list[torch.Tensor],
    keep_ratio: float,
    scope: str,
    windows: list[int | None],
    reduction: str = "max",
    page_size: int = 1,
) -> list[list[torch.Tensor]]:
    """:func:`keep_topk` over what the next query can see: a sliding layer (window W) keeps a share of its last W - 1.

    The entries before them are out of the window (no later query attends to them), so they are neither kept
    nor part of the budget: the budget of a sliding layer is round(r x min(n, W - 1)), spent on that layer's
    visible entries. Global layers (window None) are as in :func:`keep_topk`. With pages, a sliding layer also
    holds the page its window starts in (from the page's first position, as a paged engine does).
    """
    starts = [max(0, s.shape[1] - (w - 1)) if w else 0 for s, w in zip(scores, windows, strict=True)]
    starts = [a - a % page_size for a in starts]
    if scope == "token_model" and any(starts):
        raise ValueError(
            "scope token_model keeps the same positions in every layer, but the sliding-window layers of this model "
            "show fewer positions than its global layers: use token_layer (or head) on it."
        )
    visible = [s[:, a:] for s, a in zip(scores, starts, strict=True)]
    kept = keep_topk(visible, keep_ratio, scope, reduction=reduction, page_size=page_size)
    return [[rows + a for rows in layer] for layer, a in zip(kept, starts, strict=True)]


def keep_threshold(
    scores: list[torch.Tensor], threshold: float, scope: str = "head", reduction: str = "max"
) -> list[list[torch.Tensor]]:
    """Indices whose score is at least ``threshold``, per layer and head.

    With ``scope="token_layer"`` a position is kept in every head of a layer when its score reduced over them
    (:func:`position_scores`) is; every other scope decides per head. The budget per layer follows the scores.
    """
    if scope == "token_layer":
        return [[torch.nonzero(position_scores(s, reduction) >= threshold).view(-1)] * s.shape[0] for s in scores]
    return [[torch.nonzero(row >= threshold).view(-1) for row in s] for s in scores]


def _adakv_mask(scores: torch.Tensor, keep_ratio: float, safeguard: float) -> torch.Tensor:
    """One layer's AdaKV selection (module docstring): scores (kv_heads, n) -> kept mask (kv_heads, n)."""
    heads, n = scores.shape
    ratio = 1.0 - round(1.0 - keep_ratio, 10)  # through kvpress's compression ratio, so that int() rounds alike
    n_kept = 0 if keep_ratio == 0 else max(1, int(n * ratio))
    n_safe = int(n_kept * safeguard)
    if safeguard > 0:
        n_safe = max(1, n_safe) if n_kept > 0 else 0
    safe = scores.clone()
    safe.scatter_(1, scores.topk(n_safe, dim=1).indices, torch.finfo(safe.dtype).max)
    return _top_mask(safe, heads * n_kept)


def _top_pages(values: torch.Tensor, k: int, page_size: int) -> torch.Tensor:
    """Kept mask (n,) of the best pages of positions ``values`` (n,) until they hold at least ``k`` positions.

    A page scores its best position; ties go to the earlier page. ``page_size`` 1 is :func:`_top_mask`.
    """
    if page_size == 1:
        return _top_mask(values, k)
    n = values.numel()
    pages = -(-n // page_size)
    padded = values.new_full((pages * page_size,), float("-inf"))
    padded[:n] = values
    best = padded.view(pages, page_size).amax(dim=1)  # (pages,)
    order = best.argsort(descending=True, stable=True)
    sizes = torch.full((pages,), page_size, device=values.device)
    sizes[-1] = n - (pages - 1) * page_size
    held = sizes[order].cumsum(0)
    taken = int((held < k).sum()) + (1 if k > 0 else 0)  # the pages before the one that reaches k, and that one
    kept = torch.zeros(pages, dtype=torch.bool, device=values.device)
    kept[order[:taken]] = True
    return kept.repeat_interleave(page_size)[:n]


def _top_over(values: list[torch.Tensor], keep_ratio: float) -> list[torch.Tensor]:
    """Kept masks shaped as each of ``values``: the top round(r x all entries) of them taken together."""
    flat = torch.cat([v.flatten() for v in values])
    kept = _top_mask(flat, round(keep_ratio * flat.numel()))
    return [part.view_as(v) for part, v in zip(kept.split([v.numel() for v in values]), values, strict=True)]


def _top_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    mask = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    mask[values.flatten().topk(k).indices] = True
    return mask.view_as(values)
