"""Attention Matching solvers: planted compact solutions, NNLS against clamp-after-least-squares."""

from __future__ import annotations

import numpy as np
import torch

from kvresearch.ops.am import (
    Compacted,
    clamped_least_squares,
    fit_beta,
    fit_values,
    highest_attention_keys,
    nnls,
    omp_keys,
    reconstruction_errors,
)

D, SCALE = 8, 8**-0.5


def planted_with_junk(seed: int = 0, t: int = 6, junk: int = 58, n: int = 200):
    """t real keys carry all the mass; the junk keys point away from every query (weight < 1e-20)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, D, generator=g, dtype=torch.float64) + 3.0  # queries in one half-space
    real = torch.randn(t, D, generator=g, dtype=torch.float64)
    junk_keys = -20.0 * torch.ones(junk, D, dtype=torch.float64) + torch.randn(
        junk, D, generator=g, dtype=torch.float64
    )
    k = torch.cat([real, junk_keys])
    v = torch.randn(t + junk, D, generator=g, dtype=torch.float64)
    return q, k, v, torch.arange(t)


def test_highest_attention_keys_beta_and_values_recover_a_planted_block() -> None:
    q, k, v, truth = planted_with_junk()
    idx = highest_attention_keys(q, k, len(truth), SCALE)
    assert idx.tolist() == truth.tolist()
    beta = fit_beta(q, k, idx, SCALE)
    values = fit_values(q, k, v, idx, beta, SCALE)
    held_out = torch.randn(100, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64) + 3.0
    errors = reconstruction_errors(held_out, k, v, Compacted(idx, k[idx], beta, values), SCALE)
    assert errors["output_rel_l2"] < 1e-5 and errors["mass_rel"] < 1e-5
    assert torch.allclose(beta, torch.zeros_like(beta), atol=1e-6)


def test_omp_recovers_duplicated_keys_with_their_multiplicity() -> None:
    g = torch.Generator().manual_seed(1)
    unique_k = torch.randn(5, D, generator=g, dtype=torch.float64)
    unique_v = torch.randn(5, D, generator=g, dtype=torch.float64)
    copies = torch.tensor([1, 3, 2, 4, 1])
    k, v = unique_k.repeat_interleave(copies, 0), unique_v.repeat_interleave(copies, 0)
    q = torch.randn(300, D, generator=g, dtype=torch.float64)
    idx, beta = omp_keys(q, k, 5, SCALE)
    assert len({tuple(row) for row in k[idx].tolist()}) == 5  # one copy of each distinct key
    assert sorted(torch.exp(beta).round().int().tolist()) == sorted(copies.tolist())
    values = fit_values(q, k, v, idx, beta, SCALE)
    errors = reconstruction_errors(
        torch.randn(50, D, generator=g, dtype=torch.float64), k, v, Compacted(idx, k[idx], beta, values), SCALE
    )
    assert errors["output_rel_l2"] < 1e-5 and errors["mass_rel"] < 1e-5


def test_nnls_is_nonnegative_and_never_worse_than_clamped_least_squares() -> None:
    rng = np.random.default_rng(0)
    worse = 0
    for trial in range(30):
        m = torch.from_numpy(np.exp(rng.normal(size=(40, 12)) * 2))
        y = torch.from_numpy(rng.normal(size=40) + (trial % 3))
        w = nnls(m, y)
        assert (w >= 0).all() and torch.isfinite(w).all()
        clamped = clamped_least_squares(m, y)
        ours, theirs = float((m @ w - y).norm()), float((m @ clamped - y).norm())
        assert ours <= theirs + 1e-9
        worse += ours < theirs - 1e-9
    assert worse > 0  # on some problems clamping after the fact is strictly worse


def test_ill_conditioned_inputs_give_finite_outputs() -> None:
    q = torch.zeros(10, D, dtype=torch.float64)
    k = torch.ones(20, D, dtype=torch.float64)  # identical keys: rank one
    v = torch.randn(20, D, dtype=torch.float64)
    idx = highest_attention_keys(q, k, 4, SCALE)
    beta = fit_beta(q, k, idx, SCALE)
    values = fit_values(q, k, v, idx, beta, SCALE, ridge=1e-6)
    assert torch.isfinite(beta).all() and torch.isfinite(values).all()
    errors = reconstruction_errors(q, k, v, Compacted(idx, k[idx], beta, values), SCALE)
    assert all(np.isfinite(list(errors.values())))
