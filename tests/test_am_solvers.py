"""Attention Matching solvers: planted compact solutions, NNLS against BVLS and clamp-after-least-squares."""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import lsq_linear

from kvresearch.ops.am import (
    Compacted,
    block,
    clamped_least_squares,
    fit_beta,
    fit_values,
    highest_attention_keys,
    nnls,
    omp_keys,
    omp_select,
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
    b = block(q, k, v, SCALE, torch.float64)
    idx = highest_attention_keys(b, len(truth))
    assert idx.tolist() == truth.tolist()
    beta = fit_beta(b, idx)
    values = fit_values(b, q, k[idx], beta, SCALE)
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
    b = block(q, k, v, SCALE, torch.float64)
    idx, beta = omp_keys(b, 5)
    assert len({tuple(row) for row in k[idx].tolist()}) == 5  # one copy of each distinct key
    assert sorted(torch.exp(beta).round().int().tolist()) == sorted(copies.tolist())
    values = fit_values(b, q, k[idx], beta, SCALE)
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
    b = block(q, k, v, SCALE)
    idx = highest_attention_keys(b, 4)
    beta = fit_beta(b, idx)
    values = fit_values(b, q, k[idx], beta, SCALE, ridge=1e-6)
    assert torch.isfinite(beta).all() and torch.isfinite(values).all()
    errors = reconstruction_errors(q, k, v, Compacted(idx, k[idx], beta, values), SCALE)
    assert all(np.isfinite(list(errors.values())))


def test_bounded_nnls_equals_scipy_bvls() -> None:
    """Our active set on the Gram form reaches BVLS's optimum (scipy, an independent implementation)."""
    g = torch.Generator().manual_seed(3)
    for trial in range(30):
        n, t = 30 + 9 * trial, 2 + trial
        m = torch.rand(n, t, generator=g, dtype=torch.float64) ** 3
        if trial % 3 == 0:
            m[:, 1] = m[:, 0]  # duplicated column: singular Gram matrix
        y = torch.rand(n, generator=g, dtype=torch.float64) * t / 3
        lower, upper = (0.0, np.inf) if trial % 2 else (1e-12, 2.0)
        w = nnls(m, y, lower, upper)
        ref = torch.from_numpy(lsq_linear(m.numpy(), y.numpy(), bounds=(lower, upper), method="bvls").x)
        assert bool(((w >= lower) & (w <= upper)).all())
        ours, theirs = float((m @ w - y).square().sum()), float((m @ ref - y).square().sum())
        assert ours <= theirs * (1 + 1e-9) + 1e-12


def random_block(seed: int, n: int = 400, keys: int = 120, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, D, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(keys, D, generator=g, dtype=torch.float64) * 1.5
    v = torch.randn(keys, D, generator=g, dtype=torch.float64)
    return q, k, v, block(q, k, v, SCALE, dtype)


def test_incremental_omp_weights_are_the_nnls_of_its_final_keys() -> None:
    """Warm-started, incrementally grown solves end where a from-scratch NNLS on the chosen keys ends."""
    for keys_per_step, refit_every, progressive in [(1, 1, 0.0), (4, 2, 0.0), (1, 1, 0.25)]:
        _, _, _, b = random_block(4)
        idx, beta = omp_keys(b, 30, keys_per_step, refit_every, drop_below=-7.0, progressive=progressive)
        assert len(idx) == 30 and len(set(idx.tolist())) == 30
        scratch = torch.log(nnls(b.e[:, idx], b.mass, 1e-12, np.exp(7)).clamp_min(1e-12))
        torch.testing.assert_close(beta, scratch, rtol=1e-6, atol=1e-6)


def test_omp_beats_highest_attention_on_the_mass_and_float32_work_matches_float64() -> None:
    q, k, v, b64 = random_block(5)
    _, _, _, b32 = random_block(5, dtype=torch.float32)
    errors = {}
    for name, b in [("f64", b64), ("f32", b32)]:
        idx, beta = omp_keys(b, 12)
        errors[name] = reconstruction_errors(
            q, k, v, Compacted(idx, k[idx], beta, fit_values(b, q, k[idx], beta, SCALE)), SCALE
        )
    idx = highest_attention_keys(b64, 12)
    beta = fit_beta(b64, idx)
    highest = reconstruction_errors(
        q, k, v, Compacted(idx, k[idx], beta, fit_values(b64, q, k[idx], beta, SCALE)), SCALE
    )
    assert errors["f64"]["mass_rel"] < highest["mass_rel"]
    for metric in ("mass_rel", "output_rel_l2"):
        assert abs(errors["f32"][metric] - errors["f64"][metric]) < 1e-3 * max(errors["f64"][metric], 1e-3)


def test_highest_attention_counts_identical_keys_once_and_beta_carries_the_copies() -> None:
    g = torch.Generator().manual_seed(1)
    unique_k = torch.randn(5, D, generator=g, dtype=torch.float64)
    unique_v = torch.randn(5, D, generator=g, dtype=torch.float64)
    copies = torch.tensor([1, 3, 2, 4, 1])
    k, v = unique_k.repeat_interleave(copies, 0), unique_v.repeat_interleave(copies, 0)  # a context that repeats
    q = torch.randn(300, D, generator=g, dtype=torch.float64)
    b = block(q, k, v, SCALE, torch.float64)
    assert b.copies.tolist() == [1, 3, 0, 0, 2, 0, 4, 0, 0, 0, 1]
    idx = highest_attention_keys(b, 5)
    assert len({tuple(row) for row in k[idx].tolist()}) == 5  # one slot per distinct key, none wasted
    assert len(highest_attention_keys(b, 8)) == 5  # never more than the distinct keys
    beta = fit_beta(b, idx)
    assert torch.exp(beta).round().int().tolist() == copies.tolist()
    values = fit_values(b, q, k[idx], beta, SCALE)
    held_out = torch.randn(50, D, generator=g, dtype=torch.float64)
    errors = reconstruction_errors(held_out, k, v, Compacted(idx, k[idx], beta, values), SCALE)
    assert errors["output_rel_l2"] < 1e-5 and errors["mass_rel"] < 1e-5


def direct_omp(e: np.ndarray, t: int, per_step: int, refit_every: int, lower: float, upper: float):
    """OMP straight from its definition, float64 and BVLS: raw correlation with the mass residual,
    ``per_step`` keys per step, bounded NNLS after steps 1, 1 + refit_every, ..., new keys at the bound."""
    y, chosen, w = e.sum(axis=1), [], np.zeros(0)
    step = 0
    while len(chosen) < t:
        corr = e.T @ (y - e[:, chosen] @ w)
        corr[chosen] = -np.inf
        new = [int(j) for j in np.argsort(-corr, kind="stable")[: min(per_step, t - len(chosen))]]
        chosen, w = chosen + new, np.concatenate([w, np.full(len(new), lower)])
        if step % refit_every == 0:
            w = lsq_linear(e[:, chosen], y, bounds=(lower, upper), method="bvls").x
        step += 1
    w = lsq_linear(e[:, chosen], y, bounds=(lower, upper), method="bvls").x
    return chosen, np.log(np.maximum(w, lower))


def test_omp_selects_the_keys_of_its_definition_in_the_same_order() -> None:
    """Raw correlation (not divided by the column norm), the fast schedule's refits after steps 1, 3, 5..."""
    lower, upper = 1e-12, float(np.exp(7))
    for seed in range(3):
        _, _, _, b = random_block(seed, n=300, keys=90)
        for per_step, refit_every in [(1, 1), (4, 2), (2, 3)]:
            chosen, beta = omp_select(b, 24, per_step, refit_every)
            ref, ref_beta = direct_omp(b.e.numpy(), 24, per_step, refit_every, lower, upper)
            assert chosen.tolist() == ref
            np.testing.assert_allclose(beta.numpy(), ref_beta, rtol=1e-6, atol=1e-6)


def test_omp_drop_and_refill_leaves_no_key_at_the_lower_bound() -> None:
    """Fewer queries than keys to choose: NNLS parks some keys at the bound; refill rounds repeat until none."""
    for seed in range(3):
        _, _, _, b = random_block(seed, n=12, keys=60)
        _, beta = omp_select(b, 20, 4, 2)
        assert int((beta < -7).sum()) > 0  # the problem does produce dead keys
        chosen, beta = omp_select(b, 20, 4, 2, drop_below=-7.0)
        assert bool((beta >= -7).all()) and 0 < len(chosen) <= 20
        assert len(set(chosen.tolist())) == len(chosen)


def test_heldout_errors_per_query_and_pooled_match_a_direct_computation() -> None:
    q, k, v, b = random_block(7, n=200, keys=60)
    idx, beta = omp_keys(b, 10)
    c = Compacted(idx, k[idx], beta, fit_values(b, q, k[idx], beta, SCALE))
    got = reconstruction_errors(q, k, v, c, SCALE)
    logits = (q @ k.T) * SCALE
    out = torch.softmax(logits, dim=1) @ v
    logits_c = (q @ k[idx].T) * SCALE + beta
    out_c = torch.softmax(logits_c, dim=1) @ c.values
    z, z_c = torch.logsumexp(logits, dim=1), torch.logsumexp(logits_c, dim=1)
    per_query = [float((out_c[i] - out[i]).norm() / out[i].norm()) for i in range(len(q))]
    assert abs(got["output_rel_l2_query_mean"] - float(np.mean(per_query))) < 1e-10
    assert abs(got["output_rel_l2"] - float((out_c - out).norm() / out.norm())) < 1e-10
    assert abs(got["mass_rel"] - float((z_c - z).exp().sub(1).abs().mean())) < 1e-10
