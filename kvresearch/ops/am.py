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
from typing import Any

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


def key_scores(b: Block, reduce: str = "rms", pool: int = 0) -> torch.Tensor:
    """(T,) each key's RMS (or max, mean) softmax weight over the queries; identical keys count once.

    The first of c identical keys scores c times one copy (the others -inf): the fitted beta then carries
    the multiplicity, so a context that repeats itself wastes no slots. ``pool`` > 1 smooths the scores
    with a 1-D max-pool of that width (neighbouring tokens).
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
    return score


def highest_attention_keys(b: Block, t: int, reduce: str = "rms", pool: int = 0) -> torch.Tensor:
    """The t keys with the largest ``key_scores``; sorted indices (fewer when fewer keys are distinct)."""
    score = key_scores(b, reduce, pool)
    return score.topk(min(t, int((b.copies > 0).sum()))).indices.sort().values


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


def omp_select(
    b: Block,
    t: int,
    keys_per_step: int = 1,
    refit_every: int = 1,
    drop_below: float | None = None,
    bounds: tuple[float, float] = OMP_BOUNDS,
    progressive: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OMP on the mass target as the method defines it; (indices (t,), beta (t,)) in selection order.

    Each step scores every unused candidate by its raw correlation ``E[:, j] . r`` with the residual
    r = y - M w of the mass target y = E 1 (no division by the column norm) and adds the top
    ``keys_per_step`` (``progressive`` > 0: ``max(keys_per_step, progressive * chosen)``). The weights are
    refit by bounded NNLS after steps 1, 1 + refit_every, 1 + 2 refit_every, ... (the fast variant's
    "refit after steps 1, 3, 5"); between refits the new keys sit at the lower bound, as in the reference.
    With ``drop_below``, once t keys are chosen the keys whose beta = log w falls below it are dropped
    for good and the budget refilled, repeated until no kept key is below it (or no candidate is left:
    then fewer than t keys come back).
    """
    columns = b.e.T.contiguous()  # (T, n): a candidate's column is a contiguous row
    n_keys = columns.shape[0]
    t = min(t, n_keys)
    y = b.mass
    solver = IncrementalNNLS(columns, y, *bounds)
    used = torch.zeros(n_keys, dtype=torch.bool)  # chosen now or dropped before
    residual = y.clone()
    step, force = 0, True
    while True:
        while len(solver.chosen) < t and not bool(used.all()):
            corr = columns @ residual.to(columns.dtype)  # every candidate scored at once: (T,)
            corr[used] = -torch.inf
            size = max(keys_per_step, int(progressive * len(solver.chosen)))
            take = corr.topk(min(size, t - len(solver.chosen), int((~used).sum()))).indices
            used[take] = True
            solver.add(take.tolist())
            if force or step % refit_every == 0:
                solver.solve()
                force = False
            residual = y - solver.fitted()
            step += 1
        w = solver.solve()
        if drop_below is None:
            break
        keep = torch.log(w.clamp_min(bounds[0])) >= drop_below
        if bool(keep.all()):
            break
        solver.keep(keep)  # the dropped keys stay in ``used``: never chosen again
        solver.solve()  # with no candidate left the refill is empty: fewer than t keys, none of them dead
        residual, force = y - solver.fitted(), True
    chosen = torch.tensor(solver.chosen, dtype=torch.long)
    return chosen, torch.log(solver.w.clamp_min(bounds[0]))


def omp_keys(b: Block, t: int, *args: Any, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``omp_select`` with the indices sorted (and beta along): (indices (t,), beta (t,))."""
    chosen, beta = omp_select(b, t, *args, **options)
    order = chosen.argsort()
    return chosen[order], beta[order]


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
    """Float64 held-out errors of a compacted block, in both conventions.

    Per query (the papers' definition, averaged over the n queries): ``output_rel_l2_query_mean`` =
    mean_i ||o_c,i - o_i|| / ||o_i|| and ``mass_rel`` = mean_i |Z_c,i / Z_i - 1|. Pooled over the queries:
    ``output_rel_l2`` = ||O_c - O||_F / ||O||_F and ``mass_rel_pooled`` = ||z_c - z|| / ||z|| with z_i = Z_i
    exp(-m_i) (each query's mass on its own max-shifted scale).
    """
    e, m = shifted_exp(q, k, scaling)
    out = (e / e.sum(dim=1, keepdim=True)) @ v.to(F64)
    mass = e.sum(dim=1)
    s_c = (q.to(F64) @ c.keys.to(F64).T) * scaling + c.beta.to(F64)[None, :] - m[:, None]
    e_c = torch.exp(s_c)
    mass_c = e_c.sum(dim=1)
    out_c = (e_c / mass_c[:, None].clamp_min(1e-300)) @ c.values.to(F64)
    tiny = 1e-300
    return {
        "output_rel_l2": float((out_c - out).norm() / out.norm().clamp_min(tiny)),
        "output_rel_l2_query_mean": float(((out_c - out).norm(dim=1) / out.norm(dim=1).clamp_min(tiny)).mean()),
        "mass_rel": float(((mass_c - mass).abs() / mass).mean()),
        "mass_rel_pooled": float((mass_c - mass).norm() / mass.norm().clamp_min(tiny)),
    }
