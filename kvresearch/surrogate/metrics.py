"""Fit metrics of a surrogate on held-out rows: R^2, Spearman, and the pruning view.

Arrays are (rows, layers, kv_heads) of log KVzip+ (truth) and predictions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import r2_score


def fit_metrics(y_true: np.ndarray, y_pred: np.ndarray, keep_share: float = 1 / 3) -> dict[str, Any]:
    """R^2 per (layer, head), per layer and overall; Spearman per layer; precision/recall of kept sets.

    Pruning view: the oracle threshold is the (1 - keep_share) quantile of the true scores (over all layers,
    heads and rows, like one global KVzap threshold), so the oracle keeps ``keep_share`` of the entries. The
    surrogate keeps the entries whose prediction clears the same threshold; precision and recall compare
    that set with the oracle's. ``matched_overlap`` compares top-``keep_share`` sets (same budget).
    """
    rows, layers, heads = y_true.shape
    r2 = np.array([[r2_score(y_true[:, i, j], y_pred[:, i, j]) for j in range(heads)] for i in range(layers)])
    r2_layer = [float(r2_score(y_true[:, i].ravel(), y_pred[:, i].ravel())) for i in range(layers)]
    spearman = [float(spearmanr(y_true[:, i].ravel(), y_pred[:, i].ravel()).statistic) for i in range(layers)]
    truth, pred = y_true.ravel(), y_pred.ravel()
    tau = float(np.quantile(truth, 1 - keep_share))
    kept_true, kept_pred = truth >= tau, pred >= tau
    both = np.logical_and(kept_true, kept_pred).sum()
    k = round(keep_share * truth.size)
    top_true = np.zeros(truth.size, bool)
    top_true[np.argsort(-truth)[:k]] = True
    top_pred = np.zeros(truth.size, bool)
    top_pred[np.argsort(-pred)[:k]] = True
    return {
        "rows": rows,
        "r2_mean": float(r2.mean()),
        "r2_pooled": float(r2_score(truth, pred)),
        "r2_per_layer": r2_layer,
        "r2_per_layer_head": r2.tolist(),
        "spearman_per_layer": spearman,
        "spearman_mean": float(np.mean(spearman)),
        "oracle_threshold": tau,
        "precision": float(both / max(kept_pred.sum(), 1)),
        "recall": float(both / max(kept_true.sum(), 1)),
        "kept_share_surrogate": float(kept_pred.mean()),
        "matched_overlap": float(np.logical_and(top_true, top_pred).sum() / max(k, 1)),
    }
