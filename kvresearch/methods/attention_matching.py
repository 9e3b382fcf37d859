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
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from kvresearch.errors import KVResearchError
from kvresearch.methods.base import Method
from kvresearch.methods.decoding import DecodingBudget, recompressing, remember_prompt
from kvresearch.models.cache import RaggedCache
from kvresearch.models.hooks import attention_calls
from kvresearch.models.session import Session
from kvresearch.ops import am
from kvresearch.prompts import AM_REPEAT, Prompt, repeat_prompt

# A query source returns, per layer, the queries (q_heads, n, d) it produced.
QuerySource = Callable[[Session, Prompt, int], list[torch.Tensor]]


def _capture_queries(session: Session, ids: torch.Tensor, rows: slice) -> list[torch.Tensor]:
    store: list[torch.Tensor | None] = [None] * session.adapter.num_layers

    def record(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        store[layer] = q[0, :, rows].detach().to(torch.float64).cpu()

    with torch.no_grad(), attention_calls(session.adapter, record):
        session.adapter.decoder(input_ids=ids.to(session.device), use_cache=False)
    return [s for s in store if s is not None]


def repeat_queries(session: Session, prompt: Prompt, seed: int) -> list[torch.Tensor]:
    """Queries of the teacher-forced repetition of the context."""
    context = prompt.context_ids[0, prompt.head_len :].tolist()
    rp = repeat_prompt(session.tokenizer, context, instruction_text=AM_REPEAT)
    return _capture_queries(session, rp.input_ids, rp.repeat)


def context_queries(session: Session, prompt: Prompt, seed: int) -> list[torch.Tensor]:
    """Queries of the context tokens themselves."""
    return _capture_queries(session, prompt.context_ids, slice(0, prompt.context_ids.shape[1]))


def random_queries(session: Session, prompt: Prompt, seed: int) -> list[torch.Tensor]:
    """Gaussian queries with the per-dimension scale of the context queries."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(q.shape, generator=g, dtype=torch.float64) * q.std(dim=(0, 1), keepdim=True)
        for q in context_queries(session, prompt, seed)
    ]


SOURCES: dict[str, QuerySource] = {"repeat": repeat_queries, "context": context_queries, "random": random_queries}
WORK_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def pooled(q: torch.Tensor, kv_head: int, group: int, cap: int, seed: int) -> torch.Tensor:
    """Queries of KV head ``kv_head``'s group pooled into (n, d), capped by a seeded subsample."""
    x = q[kv_head * group : (kv_head + 1) * group].reshape(-1, q.shape[-1])
    if x.shape[0] > cap:
        x = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:cap]]
    return x


@dataclass(kw_only=True)
class AttentionMatching(Method):
    """AM-HighestAttnKeys(-fast) and AM-OMP(-fast) as a compression method."""

    name: str = "am"
    keep_ratio: float | None = 0.1
    keys: str = "highest"  # key selection: highest | omp
    queries: list[str] = field(default_factory=lambda: ["repeat"])  # reference query sources
    max_queries: int = 50_000  # per KV head, seeded subsample above
    fit_beta: bool = True
    fit_values: bool = True
    ridge: float = 0.0
    reduce: str = "rms"  # key score over queries (highest): rms, max or mean
    beta_bounds: list[float] | None = None  # [lower, upper] on w = exp(beta); None: the reference's
    omp_keys_per_step: int = 1
    omp_refit_every: int = 1
    omp_drop_below: float | None = None
    omp_progressive: float = 0.0  # > 0: add max(keys_per_step, progressive x chosen) keys per step
    work_dtype: str = "float32"  # n x T products; targets and t x t solves are float64
    holdout: float = 0.1  # share of reference queries held out for the reconstruction errors
    seed: int = 0
    decoding: Any = None  # {interval, target_size, protect}: re-compression while generating (methods/decoding.py)
    timings: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _report: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        """Check the options (ratio in (0, 1], known keys, query sources and dtype)."""
        super().__post_init__()
        problems = []
        if self.keep_ratio is None or not 0 < self.keep_ratio <= 1:
            problems.append(f"keep_ratio must lie in (0, 1], got {self.keep_ratio}")
        if self.keys not in ("highest", "omp"):
            problems.append(f"keys must be 'highest' or 'omp', got {self.keys!r}")
        self.queries = list(self.queries)
        unknown = set(self.queries) - set(SOURCES)
        if unknown or not self.queries:
            problems.append(f"unknown query sources {sorted(unknown)}; available: {sorted(SOURCES)}")
        if self.work_dtype not in WORK_DTYPES:
            problems.append(f"work_dtype must be float32 or float64, got {self.work_dtype!r}")
        if self.reduce not in ("rms", "max", "mean"):
            problems.append(f"reduce must be rms, max or mean, got {self.reduce!r}")
        if not 0 <= self.holdout < 1:
            problems.append(f"holdout must lie in [0, 1), got {self.holdout}")
        if problems:
            raise KVResearchError(f"method {self.name}: " + "; ".join(problems) + ".")
        if self.beta_bounds is not None:
            self.beta_bounds = [float(self.beta_bounds[0]), float(self.beta_bounds[1])]
        self.decoding = DecodingBudget.of(self.decoding, recompress=True)

    @property
    def bounds(self) -> tuple[float, float]:
        """Bounds on w = exp(beta): the configured ones, or the reference code's for the key selection."""
        if self.beta_bounds:
            return (self.beta_bounds[0], self.beta_bounds[1])
        return am.OMP_BOUNDS if self.keys == "omp" else am.HIGHEST_BOUNDS

    @property
    def work(self) -> torch.dtype:
        """The work dtype of the n x T products."""
        return WORK_DTYPES[self.work_dtype]

    @property
    def omp(self) -> dict[str, Any]:
        """Keyword arguments of ``am.omp_keys``."""
        return {
            "keys_per_step": self.omp_keys_per_step,
            "refit_every": self.omp_refit_every,
            "drop_below": self.omp_drop_below,
            "progressive": self.omp_progressive,
        }

    def _timed(self, step: str, start: float) -> float:
        now = time.perf_counter()
        self.timings[step] = self.timings.get(step, 0.0) + now - start
        return now

    def compact_head(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> am.Compacted:
        """Q (n, d) reference queries, k (T, d), v (T, dv) of one KV head -> round(keep_ratio * T) entries."""
        t = max(1, round(float(self.keep_ratio or 0.0) * k.shape[0]))
        start = time.perf_counter()
        b = am.block(q, k, v, scaling, self.work)  # E and the targets, shared by every step
        beta: torch.Tensor | None = None
        if self.keys == "omp":
            idx, beta = am.omp_keys(b, t, bounds=self.bounds, **self.omp)
        else:
            idx = am.highest_attention_keys(b, t, self.reduce)
        start = self._timed("keys_s", start)
        if not self.fit_beta:
            beta = torch.zeros(len(idx), dtype=torch.float64)
        elif beta is None:
            beta = am.fit_beta(b, idx, self.bounds)
        start = self._timed("beta_s", start)
        ck = k[idx]
        values = am.fit_values(b, q, ck, beta, scaling, self.ridge) if self.fit_values else v[idx].to(torch.float64)
        self._timed("values_s", start)
        return am.Compacted(idx, ck, beta, values)

    @torch.no_grad()
    def compress(self, session: Session, prompt: Prompt) -> RaggedCache:
        """Reference queries, a dense prefill, then every global layer's heads compacted in the ragged cache."""
        self.timings, self._report = {}, {}
        start = time.perf_counter()
        per_source = [SOURCES[name](session, prompt, self.seed) for name in self.queries]
        queries = [torch.cat([src[layer] for src in per_source], dim=1) for layer in range(len(per_source[0]))]
        self.timings["queries_s"] = time.perf_counter() - start
        prefill = session.dense_prefill(prompt.context_ids)
        cache = prefill.ragged()
        group = session.adapter.group_size
        errors: dict[tuple[int, int], dict[str, float]] = {}
        for index, spec in enumerate(session.adapter.layers):
            if spec.sliding_window is not None:
                continue
            layer = cache.ragged[index]
            keys, values = prefill.kv(index)  # (Hkv, T, d)
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
            self._report = {
                "heldout_output_rel_l2": sum(e["output_rel_l2"] for e in errors.values()) / len(errors),
                "heldout_mass_rel": sum(e["mass_rel"] for e in errors.values()) / len(errors),
                "per_layer_head": {f"L{i}H{h}": e for (i, h), e in errors.items()},
            }
        self._report["timings_s"] = dict(self.timings)
        remember_prompt(cache, prompt)
        return cache

    def decode_context(self, session: Session, cache: RaggedCache) -> AbstractContextManager[Any]:
        """With ``decoding`` set, the cache is re-compressed on its schedule while generating."""
        return recompressing(self, session, cache, self.decoding) if self.decoding else nullcontext()

    def report(self) -> dict[str, Any]:
        """Held-out reconstruction errors (mean and per layer and KV head) and step timings of the last compression."""
        return self._report
