"""Bounded least squares on the normal equations, warm-startable (pure math, float64).

    min_w ||M w - y||^2  subject to  lower <= w <= upper

is solved from the Gram form ``G = M^T M`` (t, t), ``b = M^T y`` (t,) by an active-set method (the
Lawson-Hanson loop, with an upper bound as in BVLS): variables are free, at the lower or at the upper
bound; the free ones solve ``G_FF w_F = b_F - G_FB w_B`` by Cholesky; an infeasible step is cut at the
first bound it crosses; a bound variable whose gradient points inside is freed. Given a warm start (the
previous OMP step's weights) it usually ends in a few iterations, and each costs O(t^3) instead of the
O(n t^2) of a solve on M: this is what makes OMP fast (``IncrementalNNLS`` adds columns to G as keys
are chosen, reusing every inner product computed before).

The Gram form squares the condition number; near-singular free blocks get a relative jitter of
``1e-12 * mean(diag)`` (then a least-squares fallback), so outputs stay finite on duplicated columns.
"""

from __future__ import annotations

import torch

F64 = torch.float64


def _solve_free(g: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve the symmetric positive (semi)definite system g x = rhs; finite even when g is singular."""
    jitter = 1e-12 * float(g.diagonal().mean().clamp_min(1e-300))
    for scale in (0.0, 1.0, 1e3):
        a = g if scale == 0.0 else g + scale * jitter * torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
        chol, info = torch.linalg.cholesky_ex(a)
        if int(info) == 0:
            return torch.cholesky_solve(rhs[:, None], chol)[:, 0]
    return torch.linalg.lstsq(g, rhs[:, None], driver="gelsd").solution[:, 0]


def bounded_gram_nnls(
    gram: torch.Tensor,
    b: torch.Tensor,
    lower: float = 0.0,
    upper: float = float("inf"),
    w0: torch.Tensor | None = None,
    max_iter: int | None = None,
    tol: float = 1e-12,
) -> torch.Tensor:
    """argmin_w 1/2 w^T G w - b^T w with lower <= w <= upper; G (t, t), b (t,), warm start w0 (t,) or None.

    Without ``w0`` the start is the unconstrained solution clamped to the bounds (any feasible start is
    valid: optimality is decided by the KKT test). ``tol`` is relative to max|b| for that test.
    Returns w (t,), float64.
    """
    t = b.shape[0]
    gram, b = gram.to(F64), b.to(F64)
    if t == 0:
        return b.clone()
    if w0 is None:  # cold start from the clamped unconstrained solution: few active-set changes remain
        w0 = _solve_free(gram, b)
    w = w0.to(F64).clamp(lower, upper).clone()
    # 0 free, -1 at lower, +1 at upper
    state = torch.zeros(t, dtype=torch.int8)
    state[w <= lower] = -1
    state[w >= upper] = 1
    threshold = tol * float(b.abs().max().clamp_min(1e-300))
    max_iter = max_iter or 3 * t + 20
    for _ in range(max_iter):
        w = _inner(gram, b, w, state, lower, upper)  # returns w unchanged when nothing is free
        grad = gram @ w - b  # descent direction is -grad
        gain = torch.where(state == -1, -grad, torch.where(state == 1, grad, torch.zeros_like(grad)))
        j = int(gain.argmax())
        if float(gain[j]) <= threshold:
            break
        state[j] = 0  # the most violating bound variable becomes free
    return w


def _inner(
    gram: torch.Tensor, b: torch.Tensor, w: torch.Tensor, state: torch.Tensor, lower: float, upper: float
) -> torch.Tensor:
    """Minimise over the free set with the bound variables fixed, keeping w feasible (Lawson-Hanson inner loop)."""
    while True:
        free = (state == 0).nonzero()[:, 0]
        if free.numel() == 0:
            return w
        fixed = (state != 0).nonzero()[:, 0]
        rhs = b[free] - gram[free][:, fixed] @ w[fixed] if fixed.numel() else b[free]
        z = _solve_free(gram[free][:, free], rhs)
        low, high = z < lower, z > upper
        if not bool((low | high).any()):
            w = w.clone()
            w[free] = z
            return w
        # Step from w_F toward z, stop at the first bound crossed; the variables that reach it leave the free set.
        wf = w[free]
        alpha = torch.full_like(z, float("inf"))
        alpha[low] = (wf[low] - lower) / (wf[low] - z[low]).clamp_min(1e-300)
        alpha[high] = (upper - wf[high]) / (z[high] - wf[high]).clamp_min(1e-300)
        a = float(alpha.min().clamp(0.0, 1.0))
        w = w.clone()
        w[free] = (wf + a * (z - wf)).clamp(lower, upper)
        reached = alpha <= a * (1 + 1e-12) + 1e-300
        state[free[reached & low]] = -1
        state[free[reached & high]] = 1
        w[free[reached & low]] = lower
        w[free[reached & high]] = upper


class IncrementalNNLS:
    """Bounded NNLS over a growing set of columns of a fixed design: G and b grow, w warm-starts.

    The design is given transposed, ``columns`` (T, n): candidate j is the row ``columns[j]`` (a
    contiguous read). ``add(cols)`` copies the new columns into a float64 buffer and appends their
    inner products with the chosen ones and with y (O(n t) each); ``keep(mask)`` drops columns;
    ``solve()`` re-solves from the previous weights; ``fitted()`` is M w (n,).
    """

    def __init__(self, columns: torch.Tensor, y: torch.Tensor, lower: float = 0.0, upper: float = float("inf")):
        self.columns, self.y, self.lower, self.upper = columns, y.to(F64), lower, upper
        self.chosen: list[int] = []
        self.rows = torch.empty(0, columns.shape[1], dtype=F64)  # (t, n) chosen columns, float64
        self.gram = torch.zeros(0, 0, dtype=F64)
        self.b = torch.zeros(0, dtype=F64)
        self.w = torch.zeros(0, dtype=F64)

    def add(self, cols: list[int]) -> None:
        """Append candidate columns ``cols``: the Gram matrix grows by their inner products."""
        new = self.columns[cols].to(F64)  # (k, n)
        cross = self.rows @ new.T  # (t, k)
        corner = new @ new.T
        self.gram = torch.cat([torch.cat([self.gram, cross], 1), torch.cat([cross.T, corner], 1)], 0)
        self.b = torch.cat([self.b, new @ self.y])
        self.w = torch.cat([self.w, torch.full((len(cols),), max(self.lower, 0.0), dtype=F64)])
        self.rows = torch.cat([self.rows, new])
        self.chosen += cols

    def keep(self, mask: torch.Tensor) -> None:
        """Drop the chosen columns where ``mask`` (t,) is False."""
        index = mask.nonzero()[:, 0]
        self.gram, self.b, self.w, self.rows = (
            self.gram[index][:, index],
            self.b[index],
            self.w[index],
            self.rows[index],
        )
        self.chosen = [self.chosen[i] for i in index.tolist()]

    def solve(self) -> torch.Tensor:
        """Bounded NNLS of the chosen columns, warm-started from the previous weights."""
        self.w = bounded_gram_nnls(self.gram, self.b, self.lower, self.upper, w0=self.w)
        return self.w

    def fitted(self) -> torch.Tensor:
        """The fit M w (n,)."""
        return self.w @ self.rows
