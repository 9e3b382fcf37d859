"""Attention Matching's options in four typed parts, so a variant's YAML reads as a recipe.

``queries`` (where the reference queries come from), ``keys`` (how the kept keys are chosen), ``fit`` (what
is fitted on them) and ``budgets`` (how many entries each head keeps, on which span). Each part is built
from a mapping (a YAML group) by :func:`part`, which names an unknown option and lists the known ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvresearch.data.head_budgets import BudgetFile
from kvresearch.errors import KVResearchError
from kvresearch.methods.am_queries import CONTINUATIONS, SOURCES, SelfStudy

WORK_DTYPES = {"float32": torch.float32, "float64": torch.float64}
KEY_RULES = ("highest", "omp", "kvzip")
HEAD_BUDGETS = ("uniform", "global_layer", "global_model")  # or a budgets run's file
T = TypeVar("T")


@dataclass
class Queries:
    """The reference queries: sources, on- or off-policy capture, and how many per KV head."""

    sources: list[str] = field(default_factory=lambda: ["repeat"])  # repeat, self_study, context, random
    self_study: Any = None  # {prompts, max_new_tokens, temperature, top_p, top_k} (am_queries.SelfStudy)
    on_policy: bool = False  # each layer's queries pass through the already-compacted layers
    max_per_head: int = 50_000  # seeded subsample above
    holdout: float = 0.1  # share held out for the reconstruction errors
    seed: int = 0  # the subsample, the held-out split and self-study's sampling

    def __post_init__(self) -> None:
        """Known sources; a held-out share in [0, 1); self-study settings typed."""
        self.sources = list(self.sources)
        unknown = set(self.sources) - set(SOURCES)
        if unknown or not self.sources:
            raise KVResearchError(f"queries.sources: unknown {sorted(unknown)} or empty; available: {list(SOURCES)}")
        if self.on_policy and not set(self.sources) & set(CONTINUATIONS):
            raise KVResearchError(f"queries.on_policy needs a continuation source ({', '.join(CONTINUATIONS)})")
        if not 0 <= self.holdout < 1:
            raise KVResearchError(f"queries.holdout must lie in [0, 1), got {self.holdout}")
        if not isinstance(self.self_study, SelfStudy):
            self.self_study = part(SelfStudy, self.self_study, "queries.self_study")


@dataclass
class KeySelection:
    """Which original keys are kept: ``highest`` attention, ``omp`` (greedy), or ``kvzip`` (KVzip+ oracle)."""

    select: str = "highest"
    reduce: str = "rms"  # a key's score over the queries (highest, global budgets): rms, max or mean
    per_step: int = 1  # omp: keys added per step
    refit_every: int = 1  # omp: NNLS refit after every this many steps
    drop_below: float | None = None  # omp: keys whose beta falls below this are dropped and refilled
    progressive: float = 0.0  # omp: > 0 adds max(per_step, progressive x chosen) keys per step

    def __post_init__(self) -> None:
        """A known rule and reduction."""
        if self.select not in KEY_RULES:
            raise KVResearchError(f"keys.select must be one of {KEY_RULES}, got {self.select!r}")
        if self.reduce not in ("rms", "max", "mean"):
            raise KVResearchError(f"keys.reduce must be rms, max or mean, got {self.reduce!r}")

    @property
    def omp(self) -> dict[str, Any]:
        """Keyword arguments of ``am.omp_keys``."""
        return {
            "keys_per_step": self.per_step,
            "refit_every": self.refit_every,
            "drop_below": self.drop_below,
            "progressive": self.progressive,
        }


@dataclass
class Fit:
    """What is fitted on the kept keys: the bias beta (bounded NNLS) and the values (least squares)."""

    beta: bool = True
    values: bool = True
    ridge: float = 0.0  # on the values' least squares
    beta_bounds: list[float] | None = None  # [lower, upper] on w = exp(beta); None: the reference's per rule
    work_dtype: str = "float32"  # n x T products; targets and t x t solves are float64

    def __post_init__(self) -> None:
        """A known working dtype; bounds as two floats."""
        if self.work_dtype not in WORK_DTYPES:
            raise KVResearchError(f"fit.work_dtype must be float32 or float64, got {self.work_dtype!r}")
        if self.beta_bounds is not None:
            self.beta_bounds = [float(self.beta_bounds[0]), float(self.beta_bounds[1])]

    @property
    def dtype(self) -> torch.dtype:
        """The working dtype of the n x T products."""
        return WORK_DTYPES[self.work_dtype]


@dataclass
class Budgets:
    """How ``keep_ratio`` is spread: per head (``heads``), over which tokens (``span``), in chunks or at once."""

    heads: Any = "uniform"  # uniform | global_layer | global_model | a budgets run's file (BudgetFile) | a path
    span: str = "article"  # article: the template tokens around the context are kept as they are | all
    chunk_tokens: int | None = None  # compact the span in chunks of this many tokens

    def __post_init__(self) -> None:
        """A known span; a positive chunk."""
        if self.span not in ("article", "all"):
            raise KVResearchError(f"budgets.span must be 'article' or 'all', got {self.span!r}")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise KVResearchError(f"budgets.chunk_tokens must be >= 1 or null, got {self.chunk_tokens}")
        if self.heads is None:
            self.heads = "uniform"
        elif hasattr(self.heads, "items"):  # a budgets run's file, as Hydra hands a dataclass over inside a group
            self.heads = BudgetFile(**{str(k): v for k, v in self.heads.items()})

    @property
    def measured(self) -> bool:
        """Whether the heads' shares come from a file (a budgets run), not from a rule."""
        return not (isinstance(self.heads, str) and self.heads in HEAD_BUDGETS)


def part(cls: type[T], value: Any, where: str) -> T:
    """``cls`` built from a mapping (a YAML group; None: the defaults), or ``value`` if already one.

    Raises:
        KVResearchError: an option ``cls`` does not have (named, with the known ones).
    """
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if not isinstance(value, Mapping) and not hasattr(value, "items"):
        raise KVResearchError(f"{where} must be a group of options (a mapping), got {value!r}.")
    options = {str(k): v for k, v in value.items()}
    known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise KVResearchError(f"{where}: unknown option(s) {unknown}; known: {known}.")
    return cls(**options)
