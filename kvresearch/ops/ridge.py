"""Closed-form ridge regression per layer from streamed sufficient statistics (float64).

Matches scikit-learn's ``Ridge(alpha, fit_intercept=True)``: X and y are centred, the intercept is not
penalised, and ``W = (Xc^T Xc + alpha I)^-1 Xc^T yc``, ``b = mean(y) - mean(x) W``. Statistics are
accumulated batch by batch, so the data never needs to fit in memory.
"""

from __future__ import annotations

import torch


class RidgeAccumulator:
    """Sums of x, y, x x^T and x y^T per layer; x (rows, layers, d), y (rows, layers, out)."""

    def __init__(self, layers: int, d: int, out: int):
        f64 = torch.float64
        self.n = 0
        self.sx = torch.zeros(layers, d, dtype=f64)
        self.sy = torch.zeros(layers, out, dtype=f64)
        self.sxx = torch.zeros(layers, d, d, dtype=f64)
        self.sxy = torch.zeros(layers, d, out, dtype=f64)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add rows: x (rows, layers, d), y (rows, layers, out)."""
        x = x.to(torch.float64).transpose(0, 1)  # (L, rows, d)
        y = y.to(torch.float64).transpose(0, 1)  # (L, rows, out)
        self.n += x.shape[1]
        self.sx += x.sum(1)
        self.sy += y.sum(1)
        self.sxx += x.transpose(1, 2) @ x
        self.sxy += x.transpose(1, 2) @ y

    def solve(self, alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights (layers, d, out) and intercepts (layers, out), float64."""
        if self.n == 0:
            raise ValueError("no rows were accumulated")
        mx, my = self.sx / self.n, self.sy / self.n
        gram = self.sxx - self.n * mx[:, :, None] * mx[:, None, :]
        cross = self.sxy - self.n * mx[:, :, None] * my[:, None, :]
        eye = torch.eye(gram.shape[-1], dtype=torch.float64)
        weights = torch.linalg.solve(gram + alpha * eye, cross)
        bias = my - (mx[:, None, :] @ weights)[:, 0]
        return weights, bias
