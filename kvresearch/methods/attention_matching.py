"""Attention Matching compaction into the ragged cache (model glue around ``ops/am.py``).

The options come in four groups (``am_options.py``), so a variant's YAML reads as a recipe:

* ``queries``: one dense prefill of the context, then reference queries (``am_queries.py``: repeat,
  self-study, context, random; all query heads of a KV group pooled, capped at ``max_per_head`` per KV head
  by a seeded subsample, ``holdout`` of them kept aside for the reconstruction errors);
* ``keys``: each layer's KV heads compacted on the *article span* (the context's own tokens; the
  template tokens around it stay as they are, as in the papers): keys selected among the originals
  (``highest`` attention, ``omp``, or ``kvzip``: the KVzip+ oracle's top keys, our hybrid);
* ``fit``: beta by bounded NNLS, values by least squares (either can be switched off for ablations);
* ``budgets``: every head keeps ``int(keep_ratio * n)`` of the span's n entries (``heads: uniform``), or a
  budgets run gives per-head shares (``data/head_budgets.py``, the reference's JSON), or
  ``heads: global_layer|global_model`` spreads the same total by one threshold over the RMS attention scores
  of a layer's (or the model's) keys; ``span: all`` compacts the template tokens too. The ragged cache
  stores the uneven heads as they are, without padding.

A sliding-window layer (window W) is compacted on what its window still shows, the span's part among the
last W - 1 positions, at the same ratio and with the queries of the span's last chunk: every layer holds its
share of what the full cache holds, so AM is compared with eviction at the same memory. Compacted keys keep
their rotary positions; new tokens continue at the original length.

On-policy (``queries.on_policy``): the continuation suffix is pushed through the model once; before layer
l runs, its queries (whose hidden states already went through the compacted layers 0..l-1) are captured
and layer l is compacted in place, so the suffix attends to the compacted layer and layer l+1 sees its
on-policy input: L layer evaluations in all, where re-running the suffix per layer costs O(L^2).

Chunked (``budgets.chunk_tokens``): the span is cut into chunks; each chunk's block (its keys keep their
rotary positions) is compacted at the global ratio with its own repeat queries (the repeat of that chunk)
and the shared self-study / context queries; the chunks' entries are concatenated. One chunk is the
unchunked result.
"""

from __future__ import annotations

import copy
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from kvresearch.data import head_budgets
from kvresearch.errors import KVResearchError
from kvresearch.methods.am_cache import HeadEntries, apply, assemble, heldout_summary, kvzip_scores, layer_blocks
from kvresearch.methods.am_options import Budgets, Fit, KeySelection, Queries, part
from kvresearch.methods.am_queries import (
    fixed_queries,
    pooled,
    prefill_with_queries,
    push_suffix,
    repeat_continuation,
    self_study_continuations,
)
from kvresearch.methods.base import Method
from kvresearch.methods.decoding import recompressing, remember_prompt
from kvresearch.models.cache import RaggedCache
from kvresearch.models.session import Prefill, Session
from kvresearch.ops import am, budgets
from kvresearch.prompts import Prompt


@dataclass(kw_only=True)
class AttentionMatching(Method):
    """AM-HighestAttnKeys(-fast), AM-OMP(-fast) and the KVzip-keys hybrid as a compression method."""

    name: str = "am"
    keep_ratio: float | None = 0.1
    queries: Any = None  # am_options.Queries: sources, self_study, on_policy, max_per_head, holdout, seed
    keys: Any = None  # am_options.KeySelection: select (highest | omp | kvzip), reduce, OMP's schedule
    fit: Any = None  # am_options.Fit: beta, values, ridge, beta_bounds, work_dtype
    budgets: Any = None  # am_options.Budgets: heads (uniform | global_* | a budgets run), span, chunk_tokens
    decoding_fields = ("interval", "target_size", "protect")  # re-compression while generating (methods/decoding.py)
    timings: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    head_timings: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _report: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _errors: dict[tuple[int, int], list[dict[str, float]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        """Type the four option groups and check them together (ratio in (0, 1], combinations that cannot run)."""
        super().__post_init__()
        try:
            self.queries = part(Queries, self.queries, "queries")
            self.keys = part(KeySelection, self.keys, "keys")
            self.fit = part(Fit, self.fit, "fit")
            self.budgets = part(Budgets, self.budgets, "budgets")
        except KVResearchError as error:
            raise KVResearchError(f"method {self.name}: {error}") from error
        if self.keep_ratio is None or not 0 < self.keep_ratio <= 1:
            raise KVResearchError(f"method {self.name}: keep_ratio must lie in (0, 1], got {self.keep_ratio}.")
        if self.queries.on_policy and (self.budgets.chunk_tokens or self.budgets.heads == "global_model"):
            raise KVResearchError(
                f"method {self.name}: queries.on_policy compacts layer by layer: it cannot be combined with "
                "budgets.chunk_tokens or budgets.heads=global_model."
            )
        heads = self.budgets.heads
        self.budgets_run = heads.run if isinstance(heads, head_budgets.BudgetFile) else None
        self.shares = None
        if self.budgets.measured:
            path = heads.path if isinstance(heads, head_budgets.BudgetFile) else str(heads)
            self.shares = head_budgets.load_shares(path)

    @property
    def keeps_template(self) -> bool:
        """Whether the template tokens around the context stay as they are (``budgets.span: article``)."""
        return bool(self.budgets.span == "article")

    @property
    def bounds(self) -> tuple[float, float]:
        """Bounds on w = exp(beta): the configured ones, or the reference code's for the key selection."""
        if self.fit.beta_bounds:
            return (self.fit.beta_bounds[0], self.fit.beta_bounds[1])
        return am.OMP_BOUNDS if self.keys.select == "omp" else am.HIGHEST_BOUNDS

    def size(self, n: int) -> int:
        """Uniform budget of a block of n entries: ``int(keep_ratio * n)``, at least 1 (the reference's floor)."""
        return max(1, int(float(self.keep_ratio or 0.0) * n))

    def compact_head(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scaling: float,
        t: int | None = None,
        key_scores: torch.Tensor | None = None,
    ) -> am.Compacted:
        """Q (n, d) reference queries, k (T, d), v (T, dv) of one block -> t entries (default ``size(T)``).

        ``key_scores`` (T,) pick the keys when ``keys=kvzip``. ``head_timings`` holds this call's steps.
        """
        t = self.size(k.shape[0]) if t is None else t
        self.head_timings = {}
        start = time.perf_counter()
        b = am.block(q, k, v, scaling, self.fit.dtype)  # E and the targets, shared by every step
        start = self._timed("block_s", start)
        beta: torch.Tensor | None = None
        if self.keys.select == "omp":
            idx, beta = am.omp_keys(b, t, bounds=self.bounds, **self.keys.omp)
        elif self.keys.select == "kvzip":
            if key_scores is None:
                raise KVResearchError(f"method {self.name}: keys=kvzip needs the KVzip+ scores of the block.")
            idx = key_scores.topk(min(t, len(key_scores))).indices.sort().values
        else:
            idx = am.highest_attention_keys(b, t, self.keys.reduce)
        start = self._timed("keys_s", start)
        if not self.fit.beta:
            beta = torch.zeros(len(idx), dtype=torch.float64)
        elif beta is None:
            beta = am.fit_beta(b, idx, self.bounds)
        start = self._timed("beta_s", start)
        ck = k[idx]
        values = am.fit_values(b, q, ck, beta, scaling, self.fit.ridge) if self.fit.values else v[idx].to(torch.float64)
        self._timed("values_s", start)
        return am.Compacted(idx, ck, beta, values)

    def _timed(self, step: str, start: float) -> float:
        now = time.perf_counter()
        self.head_timings[step] = now - start
        self.timings[step] = self.timings.get(step, 0.0) + now - start
        return now

    # ------------------------------------------------------------------ the whole cache
    @torch.no_grad()
    def compress(self, session: Session, prompt: Prompt) -> RaggedCache:
        """Queries, one dense prefill, every layer's heads compacted on its block (see the module docstring)."""
        self.timings, self._report, self._errors = {}, {}, {}
        start = time.perf_counter()
        want_context = "context" in self.queries.sources or "random" in self.queries.sources
        prefill, context_q = prefill_with_queries(session, prompt.context_ids, want_context)
        fixed = fixed_queries(context_q, self.queries.sources, self.queries.seed)
        n = prompt.context_ids.shape[1]
        span = prompt.article if self.budgets.span == "article" else slice(0, n)
        if span.stop - span.start < 1:
            raise KVResearchError(f"method {self.name}: the prompt has no context tokens to compact.")
        step = self.budgets.chunk_tokens or (span.stop - span.start)
        chunks = [slice(s, min(s + step, span.stop)) for s in range(span.start, span.stop, step)]
        study = (
            self_study_continuations(session, prompt, prefill.cache, self.queries.self_study, self.queries.seed)
            if "self_study" in self.queries.sources
            else []
        )
        self.timings["queries_s"] = time.perf_counter() - start
        kvzip = self._kvzip(session, prompt, prefill) if self.keys.select == "kvzip" else None
        blocks = layer_blocks(session.windows, span, n)  # layer -> its block: the span, or its visible part
        globals_ = [i for i, w in enumerate(session.windows) if w is None]
        out = prefill.ragged()
        if self.queries.on_policy:
            entries = self._on_policy(session, prompt, prefill, span, fixed, study, blocks, kvzip)
        else:
            pieces: dict[int, list[list[tuple[slice, am.Compacted]]]] = {
                i: [[] for _ in range(prefill.kv(i)[0].shape[0])] for i in globals_
            }
            for chunk in chunks:
                queries = self._suffix_queries(session, prompt, prefill, chunk, study, fixed)
                sizes = None
                if self.budgets.heads == "global_model":
                    sizes = self._global_model_sizes(prefill, queries, chunk, globals_, session)
                for i in globals_:
                    for h, piece in enumerate(
                        self._compact_layer(session, prefill, i, queries[i], chunk, kvzip, sizes)
                    ):
                        pieces[i][h].append(piece)
            entries = {
                i: [assemble(prefill, i, h, p, span) for h, p in enumerate(by_head)] for i, by_head in pieces.items()
            }
            for i in set(blocks) - set(globals_):  # sliding layers: their visible block, the last chunk's queries
                compacted = self._compact_layer(session, prefill, i, queries[i], blocks[i], kvzip, None)
                entries[i] = [assemble(prefill, i, h, [c], blocks[i]) for h, c in enumerate(compacted)]
        for i, by_head in entries.items():
            apply(out.ragged[i], by_head)
        self._report = {**heldout_summary(self._errors), "timings_s": dict(self.timings)}
        remember_prompt(out, prompt)
        return out

    def _suffix(self, session: Session, prompt: Prompt, chunk: slice, study: list[torch.Tensor]) -> torch.Tensor | None:
        pieces = ([repeat_continuation(session, prompt, chunk)] if "repeat" in self.queries.sources else []) + study
        return torch.cat(pieces, dim=1) if pieces else None

    def _suffix_queries(
        self,
        session: Session,
        prompt: Prompt,
        prefill: Prefill,
        chunk: slice,
        study: list[torch.Tensor],
        fixed: list[torch.Tensor] | None,
    ) -> list[torch.Tensor]:
        """Per layer (q_heads, n, d): the continuation suffix's queries over the full context, then the fixed ones."""
        start = time.perf_counter()
        store: dict[int, torch.Tensor] = {}
        suffix = self._suffix(session, prompt, chunk, study)
        if suffix is not None:
            push_suffix(session, copy.deepcopy(prefill.cache), suffix, store.__setitem__)
        layers = range(prefill.num_layers)
        parts = [[store[i] for i in layers]] if store else []
        if fixed is not None:
            parts.append(fixed)
        self.timings["queries_s"] = self.timings.get("queries_s", 0.0) + time.perf_counter() - start
        return [torch.cat([p[i] for p in parts], dim=1) for i in layers]

    def _on_policy(
        self,
        session: Session,
        prompt: Prompt,
        prefill: Prefill,
        span: slice,
        fixed: list[torch.Tensor] | None,
        study: list[torch.Tensor],
        blocks: dict[int, slice],
        kvzip: list[torch.Tensor] | None,
    ) -> dict[int, list[HeadEntries]]:
        """One pass of the suffix; each layer's block compacted in place just before the suffix attends to it."""
        work = prefill.ragged()
        entries: dict[int, list[HeadEntries]] = {}
        suffix = self._suffix(session, prompt, span, study)
        assert suffix is not None  # checked in __post_init__

        inside = 0.0

        def compact_here(index: int, q: torch.Tensor) -> None:
            nonlocal inside
            if index not in blocks:
                return
            begin = time.perf_counter()
            if fixed is not None:
                q = torch.cat([q, fixed[index]], dim=1)
            pieces = self._compact_layer(session, prefill, index, q, blocks[index], kvzip, None)
            entries[index] = [assemble(prefill, index, h, [p], blocks[index]) for h, p in enumerate(pieces)]
            apply(work.ragged[index], entries[index])
            inside += time.perf_counter() - begin

        start = time.perf_counter()
        push_suffix(session, work, suffix, compact_here)
        self.timings["queries_s"] = self.timings.get("queries_s", 0.0) + time.perf_counter() - start - inside
        return entries

    def _block(self, prefill: Prefill, index: int, chunk: slice) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = prefill.kv(index)  # (Hkv, T, d)
        return keys[:, chunk].double().cpu(), values[:, chunk].double().cpu()

    def _sizes(self, index: int, heads: int, n: int, blocks: list[am.Block] | None, layers: int) -> list[int]:
        """Entries per head of layer ``index`` for a block of n tokens."""
        if self.shares is not None and (index, 0) in self.shares:  # a budgets run covers the global layers
            keys = [(index, h) for h in range(heads)]
            all_heads = [(i, h) for i in range(layers) for h in range(heads) if (i, h) in self.shares]
            sizes = budgets.sizes_from_shares(self.shares, all_heads, float(self.keep_ratio or 0), n)
            return [sizes[k] for k in keys]
        if self.budgets.heads == "global_layer" and blocks is not None:
            scores = {(index, h): am.key_scores(b, self.keys.reduce) for h, b in enumerate(blocks)}
            sizes = budgets.sizes_from_scores(scores, float(self.keep_ratio or 0))
            return [sizes[(index, h)] for h in range(heads)]
        return [self.size(n)] * heads

    def _compact_layer(
        self,
        session: Session,
        prefill: Prefill,
        index: int,
        layer_q: torch.Tensor,
        chunk: slice,
        kvzip: list[torch.Tensor] | None,
        sizes: dict[tuple[int, int], int] | None,
    ) -> list[tuple[slice, am.Compacted]]:
        """Compact every KV head of layer ``index`` on ``chunk``; (chunk, result) per head, held-out errors noted."""
        spec = session.adapter.layers[index]
        keys, values = self._block(prefill, index, chunk)
        heads, group = keys.shape[0], session.adapter.group_size
        qs = [pooled(layer_q, h, group, self.queries.max_per_head, self.queries.seed + h) for h in range(heads)]
        n_test = [int(self.queries.holdout * q.shape[0]) for q in qs]
        blocks = (
            [
                am.block(q[nt:], keys[h], values[h], spec.scaling, self.fit.dtype)
                for h, (q, nt) in enumerate(zip(qs, n_test, strict=True))
            ]
            if self.budgets.heads == "global_layer"
            else None
        )
        n_global = sum(1 for s in session.adapter.layers if s.sliding_window is None)
        per_head = (
            [sizes[(index, h)] for h in range(heads)]
            if sizes is not None
            else self._sizes(index, heads, chunk.stop - chunk.start, blocks, n_global)
        )
        out = []
        for h in range(heads):
            score = kvzip[index][h, chunk] if kvzip is not None else None
            c = self.compact_head(qs[h][n_test[h] :], keys[h], values[h], spec.scaling, per_head[h], score)
            if n_test[h]:
                err = am.reconstruction_errors(qs[h][: n_test[h]], keys[h], values[h], c, spec.scaling)
                self._errors.setdefault((index, h), []).append(err)
            out.append((chunk, c))
        return out

    def _global_model_sizes(
        self, prefill: Prefill, queries: list[torch.Tensor], chunk: slice, layers: list[int], session: Session
    ) -> dict[tuple[int, int], int]:
        """One threshold over the RMS attention scores of every compacted head's keys (a first pass)."""
        group = session.adapter.group_size
        scores = {}
        for i in layers:
            keys, values = self._block(prefill, i, chunk)
            for h in range(keys.shape[0]):
                q = pooled(queries[i], h, group, self.queries.max_per_head, self.queries.seed + h)
                q = q[int(self.queries.holdout * q.shape[0]) :]
                b = am.block(q, keys[h], values[h], session.adapter.layers[i].scaling, self.fit.dtype)
                scores[(i, h)] = am.key_scores(b, self.keys.reduce)
        return budgets.sizes_from_scores(scores, float(self.keep_ratio or 0))

    def _kvzip(self, session: Session, prompt: Prompt, prefill: Prefill) -> list[torch.Tensor]:
        start = time.perf_counter()
        scores = kvzip_scores(session, prompt, prefill)
        self.timings["kvzip_scores_s"] = time.perf_counter() - start
        return scores

    def decode_context(self, session: Session, cache: RaggedCache) -> AbstractContextManager[Any]:
        """With ``decoding`` set, the cache is re-compressed on its schedule while generating."""
        return recompressing(self, session, cache, self.decoding) if self.decoding else nullcontext()

    def inputs(self) -> tuple[str, ...]:
        """The budgets run whose per-head budgets this method reads (none for uniform, global or hand-given)."""
        return (self.budgets_run,) if self.budgets_run else ()

    def report(self) -> dict[str, Any]:
        """Held-out reconstruction errors (mean and per layer and KV head) and step timings of the last compression."""
        return self._report
