"""Attention Matching compaction into the ragged cache (model glue around ``ops/am.py``).

Reference queries (post-rotary, after q_norm where the model has one, all query heads of a KV group
pooled, capped at ``max_queries`` per KV head with a seeded subsample):

* ``repeat``: teacher-forced repetition of the context (context, "Repeat the previous context verbatim.",
  then the context as the answer): the queries of the repeated copy;
* ``context``: the queries of the context tokens themselves, from the prefill;
* ``random``: Gaussian vectors with the per-dimension scale of the context queries.

Self-study and on-policy queries plug in as further ``QuerySource`` functions (same signature).

Each (layer, KV head) block is compacted to ``round(keep_ratio * T)`` entries: keys selected among the
originals (``highest`` attention, or ``omp``), beta by bounded NNLS, values by least squares; ablations
``fit_beta=false`` (beta = 0) and ``fit_values=false`` (original values). Sliding-window layers are left
alone. Compacted keys keep their rotary positions; new tokens continue at the original length.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from kvresearch.cache import RaggedCache
from kvresearch.capture import repeat_prompt
from kvresearch.methods.base import Session, dense_prefill
from kvresearch.models.hooks import attention_calls
from kvresearch.ops import am

REPEAT_INSTRUCTION = "\n\nRepeat the previous context verbatim."

# A query source returns, per layer, the queries (q_heads, n, d) it produced.
QuerySource = Callable[[Session, Any, int], list[torch.Tensor]]


def _capture_queries(session: Session, ids: torch.Tensor, rows: slice) -> list[torch.Tensor]:
    store: list[torch.Tensor | None] = [None] * session.adapter.num_layers

    def record(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        store[layer] = q[0, :, rows].detach().to(torch.float64).cpu()

    with torch.no_grad(), attention_calls(session.adapter, record):
        session.adapter.decoder(input_ids=ids.to(session.device), use_cache=False)
    return [s for s in store if s is not None]


def repeat_queries(session: Session, prompt: Any, seed: int) -> list[torch.Tensor]:
    context = prompt.context_ids[0, prompt.head_len :].tolist()
    rp = repeat_prompt(session.tokenizer, context, instruction_text=REPEAT_INSTRUCTION)
    return _capture_queries(session, rp.input_ids, rp.repeat)


def context_queries(session: Session, prompt: Any, seed: int) -> list[torch.Tensor]:
    return _capture_queries(session, prompt.context_ids, slice(0, prompt.context_ids.shape[1]))


def random_queries(session: Session, prompt: Any, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(q.shape, generator=g, dtype=torch.float64) * q.std(dim=(0, 1), keepdim=True)
        for q in context_queries(session, prompt, seed)
    ]


SOURCES: dict[str, QuerySource] = {"repeat": repeat_queries, "context": context_queries, "random": random_queries}


def pooled(q: torch.Tensor, kv_head: int, group: int, cap: int, seed: int) -> torch.Tensor:
    """Queries of KV head ``kv_head``'s group pooled into (n, d), capped by a seeded subsample."""
    x = q[kv_head * group : (kv_head + 1) * group].reshape(-1, q.shape[-1])
    if x.shape[0] > cap:
        x = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:cap]]
    return x


class AttentionMatching:
    """AM-HighestAttnKeys(-fast) and AM-OMP(-fast) as a compression method."""

    decoding = False

    def __init__(
        self,
        keep_ratio: float,
        keys: str = "highest",
        queries: tuple[str, ...] | list[str] = ("repeat",),
        max_queries: int = 50_000,
        fit_beta: bool = True,
        fit_values: bool = True,
        ridge: float = 0.0,
        reduce: str = "rms",
        beta_bounds: tuple[float, float] | list[float] | None = None,
        omp_keys_per_step: int = 1,
        omp_refit_every: int = 1,
        omp_drop_below: float | None = None,
        omp_progressive: float = 0.0,
        work_dtype: str = "float32",
        holdout: float = 0.1,
        seed: int = 0,
        name: str = "am",
    ):
        if not 0 < keep_ratio <= 1:
            raise ValueError(f"keep_ratio must lie in (0, 1], got {keep_ratio}")
        if keys not in ("highest", "omp"):
            raise ValueError(f"keys must be 'highest' or 'omp', got {keys!r}")
        unknown = set(queries) - set(SOURCES)
        if unknown:
            raise ValueError(f"unknown query sources {sorted(unknown)}; available: {sorted(SOURCES)}")
        if work_dtype not in ("float32", "float64"):
            raise ValueError(f"work_dtype must be float32 or float64, got {work_dtype!r}")
        self.keep_ratio, self.keys, self.queries, self.max_queries = keep_ratio, keys, list(queries), max_queries
        self.fit_beta, self.fit_values, self.ridge, self.seed, self.name = fit_beta, fit_values, ridge, seed, name
        self.reduce, self.work_dtype = reduce, getattr(torch, work_dtype)
        default = am.OMP_BOUNDS if keys == "omp" else am.HIGHEST_BOUNDS  # the reference code's choices
        self.beta_bounds = (float(beta_bounds[0]), float(beta_bounds[1])) if beta_bounds else default
        self.omp: dict[str, Any] = {
            "keys_per_step": omp_keys_per_step,
            "refit_every": omp_refit_every,
            "drop_below": omp_drop_below,
            "progressive": omp_progressive,
        }
        self.holdout = holdout  # share of each head's reference queries kept out of the fit, for the errors
        self.timings: dict[str, float] = {}
        self.report: dict[str, Any] = {}

    def _timed(self, step: str, start: float) -> float:
        now = time.perf_counter()
        self.timings[step] = self.timings.get(step, 0.0) + now - start
        return now

    def compact_head(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> am.Compacted:
        """q (n, d) reference queries, k (T, d), v (T, dv) of one KV head -> round(keep_ratio * T) entries."""
        t = max(1, round(self.keep_ratio * k.shape[0]))
        start = time.perf_counter()
        b = am.block(q, k, v, scaling, self.work_dtype)  # E and the targets, shared by every step
        beta: torch.Tensor | None = None
        if self.keys == "omp":
            idx, beta = am.omp_keys(b, t, bounds=self.beta_bounds, **self.omp)
        else:
            idx = am.highest_attention_keys(b, t, self.reduce)
        start = self._timed("keys_s", start)
        if not self.fit_beta:
            beta = torch.zeros(len(idx), dtype=torch.float64)
        elif beta is None:
            beta = am.fit_beta(b, idx, self.beta_bounds)
        start = self._timed("beta_s", start)
        ck = k[idx]
        values = am.fit_values(b, q, ck, beta, scaling, self.ridge) if self.fit_values else v[idx].to(torch.float64)
        self._timed("values_s", start)
        return am.Compacted(idx, ck, beta, values)

    @torch.no_grad()
    def compress(self, session: Session, prompt: Any) -> RaggedCache:
        self.timings = {}
        start = time.perf_counter()
        per_source = [SOURCES[name](session, prompt, self.seed) for name in self.queries]
        queries = [torch.cat([src[layer] for src in per_source], dim=1) for layer in range(len(per_source[0]))]
        self.timings["queries_s"] = time.perf_counter() - start
        dense = dense_prefill(session, prompt.context_ids)
        cache = RaggedCache.from_dynamic(dense)
        group = session.adapter.group_size
        errors: dict[tuple[int, int], dict[str, float]] = {}
        for index, spec in enumerate(session.adapter.layers):
            if spec.sliding_window is not None:
                continue
            layer = cache.ragged[index]
            dense_layer = dense.layers[index]
            assert dense_layer.keys is not None and dense_layer.values is not None
            keys, values = dense_layer.keys[0], dense_layer.values[0]  # (Hkv, T, d)
            results = []
            for h in range(keys.shape[0]):
                q = pooled(queries[index], h, group, self.max_queries, self.seed + h)
                n_test = int(self.holdout * q.shape[0])
                k_h, v_h = keys[h].double().cpu(), values[h].double().cpu()
                results.append(self.compact_head(q[n_test:], k_h, v_h, spec.scaling))
                if n_test:
                    errors[(index, h)] = am.reconstruction_errors(q[:n_test], k_h, v_h, results[-1], spec.scaling)
            layer.keep_only([r.idx for r in results])
            for h, r in enumerate(results):
                layer.set_bias(h, r.beta)
                layer.set_values(h, r.values)
        if errors:  # float64 errors on held-out queries, per (layer, KV head) and averaged
            self.report = {
                "heldout_output_rel_l2": sum(e["output_rel_l2"] for e in errors.values()) / len(errors),
                "heldout_mass_rel": sum(e["mass_rel"] for e in errors.values()) / len(errors),
                "per_layer_head": {f"L{i}H{h}": e for (i, h), e in errors.items()},
                "timings_s": dict(self.timings),
            }
        return cache

    def decode_context(self, session: Session, cache: RaggedCache) -> Any:
        return nullcontext()
