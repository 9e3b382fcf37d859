"""Attention Matching solvers for one KV head (pure math).

Replace T cached entries (K, V) by t entries (C_k, beta, C_v) so that, for reference queries Q,

    softmax(Q K^T s) V          ~  softmax(Q C_k^T s + beta) C_v          (attention output)
    sum_j exp(Q K_j s)           ~  sum_i exp(Q C_k,i s + beta_i)          (attention mass)

with s the softmax scale. Keys are chosen among the original ones (highest attention, or OMP on the
mass), ``beta`` by a true bounded non-negative least squares on the partition function, values by least
squares with optional ridge. Shapes: Q (n, d), K (T, d), V (T, dv); indices (t,).

Precision policy: the n x T products (logits, ``E = exp(S - m)``, candidate scores) run in the *work
dtype*, float32 by default (they are the bulk of the time; E lies in [0, 1]); the per-query max, the
targets (mass and output) and every t x t system (Gram matrices, NNLS, value least squares) are float64.
``block(..., dtype=torch.float64)`` keeps everything in float64. Outputs are float64 and never NaN or
inf: an all-zero NNLS solution is clamped to the lower bound, singular systems get a jitter or an SVD
solver, results are nan_to_num'd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvresearch.ops.nnls import IncrementalNNLS, bounded_gram_nnls

F64 = torch.float64
OMP_BOUNDS = (1e-12, math.exp(7))  # the reference code's bounds on w = exp(beta) for OMP
HIGHEST_BOUNDS = (math.exp(-3), math.exp(3))  # ... and for highest-attention keys


@dataclass
class Block:
    """One KV head's block as its reference queries see it."""

    e: torch.Tensor  # (n, T) exp(S - m), work dtype
    m: torch.Tensor  # (n,) float64 per-query max of S = Q K^T s
    mass: torch.Tensor  # (n,) float64 row sums of e: the partition function to match (times exp(-m))
    out: torch.Tensor  # (n, dv) float64 attention output softmax(S) V
    copies: torch.Tensor  # (T,) int64: for the first of identical keys, how many there are; 0 for the others


def duplicate_counts(k: torch.Tensor) -> torch.Tensor:
    """(T,) int64: for the first occurrence of each distinct row of ``k`` (T, d), its number of copies; else 0."""
    _, inverse, counts = torch.unique(k, dim=0, return_inverse=True, return_counts=True)
    first = torch.full((len(counts),), k.shape[0], dtype=torch.long, device=k.device)
    first.scatter_reduce_(0, inverse, torch.arange(k.shape[0], device=k.device), reduce="amin")
    out = torch.zeros(k.shape[0], dtype=torch.long, device=k.device)
    out[first] = counts
    return out


def shifted_exp(
    q: torch.Tensor, k: torch.Tensor, scaling: float, dtype: torch.dtype = F64
) -> tuple[torch.Tensor, torch.Tensor]:
    """E = exp(S - m) with S = q k^T s and m the per-query max: E (n, T) in ``dtype``, m (n,) float64."""
    s = (q.to(dtype) @ k.to(dtype).T).mul_(scaling)
    m = s.max(dim=1).values
    return s.sub_(m[:, None]).exp_(), m.to(F64)


def block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, dtype: torch.dtype = torch.float32
) -> Block:
    """Everything the solvers share, computed once per head: E in ``dtype``, the float64 targets."""
    e, m = shifted_exp(q, k, scaling, dtype)
    mass = e.sum(dim=1, dtype=F64)
    out = (e @ v.to(dtype)).to(F64) / mass[:, None]
    return Block(e, m, mass, out, duplicate_counts(k))


def highest_attention_keys(b: Block, t: int, reduce: str = "rms", pool: int = 0) -> torch.Tensor:
    """The t keys with the largest RMS (or max, mean) softmax weight over the queries; sorted indices.

    Identical keys count once, with the weight of all their copies (the first copy stands for them; the
    fitted beta then carries the multiplicity), so a context that repeats itself wastes no slots; fewer
    than t keys come back when there are fewer distinct ones. ``pool`` > 0 smooths the per-key score with
    a 1-D max-pool of that width first (neighbouring tokens).
    """
    inv = 1.0 / b.mass.to(b.e.dtype)  # softmax weights are e / mass, row by row
    n = b.e.shape[0]
    if reduce == "rms":
        score = (b.e.square().T @ inv.square() / n).sqrt()
    elif reduce == "max":
        score = (b.e * inv[:, None]).max(dim=0).values
    elif reduce == "mean":
        score = b.e.T @ inv / n
    else:
        raise ValueError(f"reduce must be rms, max or mean, got {reduce!r}")
    n_keys = b.e.shape[1]
    if pool > 1:
        score = torch.nn.functional.max_pool1d(score[None, None], pool, stride=1, padding=pool // 2)[0, 0, :n_keys]
    distinct = b.copies > 0
    if not bool(distinct.all()):  # each statistic of c identical columns' summed weight is c times one copy's
        score = torch.where(distinct, score * b.copies.to(score.dtype), -torch.inf)
    return score.topk(min(t, int(distinct.sum()))).indices.sort().values


def nnls(m: torch.Tensor, y: torch.Tensor, lower: float = 0.0, upper: float = np.inf) -> torch.Tensor:
    """argmin_w ||M w - y|| subject to lower <= w <= upper (exact active set on the Gram form).

    M (n, t), y (n,); float64. With lower = 0 this is the classical NNLS.
    """
    m64, y64 = m.to(F64), y.to(F64)
    w = bounded_gram_nnls(m64.T @ m64, m64.T @ y64, lower, upper)
    return torch.nan_to_num(w, nan=lower, posinf=upper, neginf=lower)


def clamped_least_squares(m: torch.Tensor, y: torch.Tensor, lower: float = 0.0, upper: float = np.inf) -> torch.Tensor:
    """The reference code's shortcut: unconstrained least squares, then clamp (for comparison)."""
    w = torch.linalg.lstsq(m.to(F64).cpu(), y.to(F64).cpu()[:, None], driver="gelsd").solution[:, 0]
    return w.clamp(lower, upper).to(m.device)


def fit_beta(b: Block, idx: torch.Tensor, bounds: tuple[float, float] = OMP_BOUNDS) -> torch.Tensor:
    """Beta (t,) = log w, w from bounded NNLS of the mass target: E[:, idx] w ~ E 1."""
    w = nnls(b.e[:, idx], b.mass, *bounds)
    return torch.log(w.clamp_min(bounds[0]))


def compact_attention(q: torch.Tensor, ck: torch.Tensor, beta: torch.Tensor, scaling: float) -> torch.Tensor:
    """softmax(q C_k^T s + beta): (n, t), float64."""
    return torch.softmax((q.to(F64) @ ck.to(F64).T) * scaling + beta.to(F64)[None, :], dim=1)


def fit_values(
    b: Block, q: torch.Tensor, ck: torch.Tensor, beta: torch.Tensor, scaling: float, ridge: float = 0.0
) -> torch.Tensor:
    """C_v (t, dv) = argmin ||X C_v - Y||^2 + ridge ||C_v||^2, X the compact attention (n, t), Y = b.out.

    Solved through the float64 normal equations by Cholesky (ridge is relative to mean(diag X^T X));
    a singular system falls back to an SVD least squares.
    """
    x = compact_attention(q, ck, beta, scaling)  # (n, t)
    gram, rhs = x.T @ x, x.T @ b.out
    if ridge > 0:
        gram = gram + ridge * float(gram.diagonal().mean()) * torch.eye(x.shape[1], dtype=F64, device=x.device)
    chol, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        cv = torch.cholesky_solve(rhs, chol)
    else:
        cv = torch.linalg.lstsq(x.cpu(), b.out.cpu(), driver="gelsd").solution.to(x.device)
    return torch.nan_to_num(cv)


def omp_keys(
    b: Block,
    t: int,
    keys_per_step: int = 1,
    refit_every: int = 1,
    drop_below: float | None = None,
    bounds: tuple[float, float] = OMP_BOUNDS,
    progressive: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy selection on the mass residual; returns (sorted indices (t,), beta (t,)).

    Add the key(s) most correlated with r = y - M w, refit w by bounded NNLS every ``refit_every`` steps
    (incrementally: the Gram matrix grows by the new columns and the solve starts from the previous
    weights), optionally drop keys whose log w falls below ``drop_below`` and refill (one round).
    ``progressive`` > 0 adds ``max(keys_per_step, progressive * chosen)`` keys per step (geometric growth:
    O(log t) steps for large budgets).
    """
    columns = b.e.T.contiguous()  # (T, n): a candidate's column is a contiguous row
    n_keys = columns.shape[0]
    t = min(t, n_keys)
    y = b.mass
    norms = columns.norm(dim=1).clamp_min(1e-30)
    solver = IncrementalNNLS(columns, y, *bounds)
    taken = torch.zeros(n_keys, dtype=torch.bool)
    residual = y.clone()
    step = 0
    while len(solver.chosen) < t:
        corr = (columns @ residual.to(columns.dtype)) / norms  # every candidate scored at once: (T,)
        corr[taken] = -torch.inf
        size = max(keys_per_step, int(progressive * len(solver.chosen)))
        take = corr.topk(min(size, t - len(solver.chosen))).indices
        taken[take] = True
        solver.add(take.tolist())
        step += 1
        if step % refit_every == 0 or len(solver.chosen) >= t:
            w = solver.solve()
            if drop_below is not None and len(solver.chosen) >= t:
                keep = torch.log(w.clamp_min(bounds[0])) >= drop_below
                if not bool(keep.all()) and int(keep.sum()) > 0:
                    solver.keep(keep)  # dropped keys stay excluded from the refill
                    solver.solve()
                    drop_below = None  # one drop-and-refill round
            residual = y - solver.fitted()
    chosen = torch.tensor(solver.chosen)
    order = chosen.argsort()
    return chosen[order], torch.log(solver.w[order].clamp_min(bounds[0]))


@dataclass
class Compacted:
    """One KV head's compacted block."""

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
