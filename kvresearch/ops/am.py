"""Attention Matching solvers for one KV head (pure math, float64 throughout).

Replace T cached entries (K, V) by t entries (C_k, beta, C_v) so that, for reference queries Q,

    softmax(Q K^T s) V          ~  softmax(Q C_k^T s + beta) C_v          (attention output)
    sum_j exp(Q K_j s)           ~  sum_i exp(Q C_k,i s + beta_i)          (attention mass)

with s the softmax scale. Keys are chosen among the original ones (highest attention, or OMP on the
mass), ``beta`` by a true non-negative least squares on the partition function (bounded, BVLS), values
by least squares with optional ridge. Shapes: Q (n, d), K (T, d), V (T, dv); indices (t,).

Precision policy: everything is computed in float64 (the exp of shifted logits spans many orders of
magnitude); results are returned in float64 and cast by the caller. Fallbacks never return NaN or inf:
an all-zero NNLS solution gives beta = 0, lstsq uses an SVD-based solver, and outputs are nan_to_num'd.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import lsq_linear

F64 = torch.float64


def shifted_exp(q: torch.Tensor, k: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """E = exp(S - m) with S = q k^T s and m the per-query max: E (n, T), m (n,)."""
    s = (q.to(F64) @ k.to(F64).T) * scaling
    m = s.max(dim=1).values
    return torch.exp(s - m[:, None]), m


def highest_attention_keys(
    q: torch.Tensor, k: torch.Tensor, t: int, scaling: float, reduce: str = "rms", pool: int = 0
) -> torch.Tensor:
    """The t keys with the largest RMS (or max, mean) softmax weight over the queries; sorted indices.

    ``pool`` > 0 smooths the per-key score with a 1-D max-pool of that width first (neighbouring tokens).
    """
    e, _ = shifted_exp(q, k, scaling)
    a = e / e.sum(dim=1, keepdim=True)  # (n, T)
    if reduce == "rms":
        score = a.pow(2).mean(dim=0).sqrt()
    elif reduce == "max":
        score = a.max(dim=0).values
    elif reduce == "mean":
        score = a.mean(dim=0)
    else:
        raise ValueError(f"reduce must be rms, max or mean, got {reduce!r}")
    if pool > 1:
        score = torch.nn.functional.max_pool1d(score[None, None], pool, stride=1, padding=pool // 2)[0, 0, : k.shape[0]]
    return score.topk(min(t, k.shape[0])).indices.sort().values


def nnls(m: torch.Tensor, y: torch.Tensor, lower: float = 0.0, upper: float = np.inf) -> torch.Tensor:
    """argmin_w ||M w - y|| subject to lower <= w <= upper (bounded-variable least squares, exact).

    M (n, t), y (n,); float64. With lower = 0 this is the classical NNLS.
    """
    m64, y64 = m.to(F64).cpu().numpy(), y.to(F64).cpu().numpy()
    result = lsq_linear(m64, y64, bounds=(lower, upper), method="bvls")
    return torch.from_numpy(np.nan_to_num(result.x, nan=0.0, posinf=upper, neginf=lower)).to(m.device)


def clamped_least_squares(m: torch.Tensor, y: torch.Tensor, lower: float = 0.0, upper: float = np.inf) -> torch.Tensor:
    """The reference code's shortcut: unconstrained least squares, then clamp (for comparison)."""
    w = torch.linalg.lstsq(m.to(F64).cpu(), y.to(F64).cpu()[:, None], driver="gelsd").solution[:, 0]
    return w.clamp(lower, upper).to(m.device)


def fit_beta(
    q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, scaling: float, bounds: tuple[float, float] = (1e-12, np.e**7)
) -> torch.Tensor:
    """beta (t,) = log w, w from bounded NNLS of the mass target: E[:, idx] w ~ E 1."""
    e, _ = shifted_exp(q, k, scaling)
    w = nnls(e[:, idx], e.sum(dim=1), *bounds)
    return torch.log(w.clamp_min(bounds[0]))


def compact_attention(q: torch.Tensor, ck: torch.Tensor, beta: torch.Tensor, scaling: float) -> torch.Tensor:
    """softmax(q C_k^T s + beta): (n, t), float64."""
    return torch.softmax((q.to(F64) @ ck.to(F64).T) * scaling + beta.to(F64)[None, :], dim=1)


def fit_values(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    beta: torch.Tensor,
    scaling: float,
    ridge: float = 0.0,
) -> torch.Tensor:
    """C_v (t, dv) = argmin ||X C_v - Y||^2 + ridge ||C_v||^2 with X the compact attention, Y the true output."""
    e, _ = shifted_exp(q, k, scaling)
    y = (e / e.sum(dim=1, keepdim=True)) @ v.to(F64)  # (n, dv)
    x = compact_attention(q, k[idx], beta, scaling)  # (n, t)
    if ridge > 0:
        gram = x.T @ x + ridge * torch.eye(x.shape[1], dtype=F64, device=x.device)
        cv = torch.linalg.solve(gram, x.T @ y)
    else:
        cv = torch.linalg.lstsq(x.cpu(), y.cpu(), driver="gelsd").solution.to(x.device)
    return torch.nan_to_num(cv)


def omp_keys(
    q: torch.Tensor,
    k: torch.Tensor,
    t: int,
    scaling: float,
    keys_per_step: int = 1,
    refit_every: int = 1,
    drop_below: float | None = None,
    bounds: tuple[float, float] = (1e-12, np.e**7),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy selection on the mass residual: add the key(s) most correlated with r = y - M w, refit w by
    bounded NNLS every ``refit_every`` steps, optionally drop keys whose log w falls below ``drop_below``
    and refill. Returns (sorted indices (t,), beta (t,)).
    """
    e, _ = shifted_exp(q, k, scaling)
    y = e.sum(dim=1)
    norms = e.norm(dim=0).clamp_min(1e-300)
    chosen: list[int] = []
    w = torch.zeros(0, dtype=F64, device=e.device)
    residual = y.clone()
    step = 0
    while len(chosen) < min(t, k.shape[0]):
        corr = (e.T @ residual) / norms  # batched scoring of every candidate
        if chosen:
            corr[torch.tensor(chosen, device=e.device)] = -torch.inf
        take = corr.topk(min(keys_per_step, t - len(chosen))).indices.tolist()
        chosen += take
        step += 1
        if step % refit_every == 0 or len(chosen) >= t:
            w = nnls(e[:, chosen], y, *bounds)
            if drop_below is not None and len(chosen) >= t:
                keep = torch.log(w.clamp_min(bounds[0])) >= drop_below
                if not bool(keep.all()) and int(keep.sum()) > 0:
                    chosen = [c for c, kept in zip(chosen, keep.tolist(), strict=True) if kept]
                    w = nnls(e[:, chosen], y, *bounds)
                    drop_below = None  # one drop-and-refill round
            residual = y - e[:, chosen] @ w
    order = torch.tensor(chosen, device=e.device).argsort()
    idx = torch.tensor(chosen, device=e.device)[order]
    return idx, torch.log(w[order].clamp_min(bounds[0]))


@dataclass
class Compacted:
    idx: torch.Tensor  # (t,) indices of the kept keys
    keys: torch.Tensor  # (t, d) C_k (original keys, original rotary positions)
    beta: torch.Tensor  # (t,) float64
    values: torch.Tensor  # (t, dv) float64


def reconstruction_errors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: Compacted, scaling: float
) -> dict[str, float]:
    """Float64 relative L2 error of the attention output and relative error of the attention mass."""
    e, m = shifted_exp(q, k, scaling)
    out = (e / e.sum(dim=1, keepdim=True)) @ v.to(F64)
    mass = e.sum(dim=1)
    s_c = (q.to(F64) @ c.keys.to(F64).T) * scaling + c.beta.to(F64)[None, :] - m[:, None]
    e_c = torch.exp(s_c)
    out_c = (e_c / e_c.sum(dim=1, keepdim=True).clamp_min(1e-300)) @ c.values.to(F64)
    return {
        "output_rel_l2": float((out_c - out).norm() / out.norm().clamp_min(1e-300)),
        "mass_rel": float(((e_c.sum(dim=1) - mass).abs() / mass).mean()),
    }
