"""A loaded model as methods and evaluation see it: prefills into dense or ragged caches, generation.

Prefills keep only the last position's logits (nothing reads the others; a 2k prefill would otherwise
materialise 2k x vocabulary of them).

This module and ``cache.py`` hold the transformers cache objects; methods get keys and values as
tensors from a :class:`Prefill` and hand back a ragged cache, so they never touch cache internals.

Shapes: ids ``(1, T)``; keys and values per layer ``(kv_heads, T, head_dim)``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from kvresearch.generation import GREEDY, Generated, Sampling, StopStrings, forced_logprobs, generate
from kvresearch.models.adapter import ModelAdapter
from kvresearch.models.cache import RaggedCache
from kvresearch.models.hooks import attention_inputs
from kvresearch.models.ragged_attention import ragged_attention_enabled
from kvresearch.prompts import Prompt


@dataclass
class Prefill:
    """A dense prefill: the transformers cache and, if asked for, each layer's attention input h."""

    cache: Any  # transformers DynamicCache holding the prefilled positions
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> h (1, T, hidden)
    windows: list[int | None] | None = None

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``layer``: (kv_heads, T, head_dim) each."""
        entry = self.cache.layers[layer]
        assert entry.keys is not None and entry.values is not None, f"layer {layer} was not prefilled"
        return entry.keys[0], entry.values[0]

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return len(self.cache.layers)

    def ragged(self, keep: list[list[torch.Tensor]] | None = None) -> RaggedCache:
        """A ragged copy, keeping per layer and KV head only the indices ``keep[layer][head]`` (None: all)."""
        return RaggedCache.from_layers([self.kv(i) for i in range(self.num_layers)], keep, self.windows)


@dataclass
class Session:
    """A model with its adapter and tokenizer."""

    adapter: ModelAdapter
    tokenizer: Any
    memo: Any = None  # data.memo.TensorMemo: what a method computes once per context whatever its budget

    @property
    def model(self) -> Any:
        """The transformers model."""
        return self.adapter.model

    @property
    def device(self) -> torch.device:
        """Where the model's weights are."""
        return next(self.model.parameters()).device

    @property
    def windows(self) -> list[int | None]:
        """Sliding window of each layer (None for global layers)."""
        return [layer.sliding_window for layer in self.adapter.layers]

    def new_cache(self) -> RaggedCache:
        """An empty ragged cache for this model."""
        return RaggedCache(self.adapter.num_layers, self.windows)

    @torch.no_grad()
    def dense_prefill(self, ids: torch.Tensor, record_inputs: bool = False) -> Prefill:
        """Prefill ``ids`` (1, T) into a dense cache; optionally record each layer's attention input h."""
        prefill = Prefill(DynamicCache(), windows=self.windows)
        with attention_inputs(self.adapter, prefill.inputs) if record_inputs else nullcontext():
            self.model(input_ids=ids.to(self.device), past_key_values=prefill.cache, use_cache=True, logits_to_keep=1)
        return prefill

    @torch.no_grad()
    def ragged_prefill(self, ids: torch.Tensor, cache: RaggedCache, chunk_size: int | None = None) -> None:
        """Prefill ``ids`` (1, T) into a ragged cache, in chunks of ``chunk_size`` tokens (None: one pass)."""
        step = chunk_size or ids.shape[1]
        with ragged_attention_enabled(self.model):
            for start in range(0, ids.shape[1], step):
                chunk = ids[:, start : start + step].to(self.device)
                self.model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def eos_ids(self) -> set[int]:
        """Token ids that end a generation."""
        ids = self.model.generation_config.eos_token_id
        found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            found.add(int(self.tokenizer.eos_token_id))
        return found

    def generate(
        self,
        cache: Any,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        sample: int = 0,
        decode_context: Callable[[Any], AbstractContextManager[Any]] | None = None,
        stop: Sequence[str] = (),
        eos: bool = True,
        in_place: bool = False,
    ) -> Generated:
        """Feed ``input_ids`` (1, Q) after ``cache`` and generate (see ``generation.py``).

        ``cache`` is left untouched (a copy is extended) unless ``in_place``; ``eos=False`` ignores the end
        tokens; ``decode_context(cache)`` wraps decoding, for a method that also compresses while generating.
        """
        working = cache if in_place else _working_copy(cache, input_ids.shape[1] + max_new_tokens)
        with self._decoding(working, decode_context):
            return generate(
                self.model,
                working,
                input_ids,
                max_new_tokens,
                sampling,
                sample,
                self.eos_ids() if eos else set(),
                StopStrings(self.tokenizer, stop) if stop else None,
            )

    def forced_logprobs(
        self,
        cache: Any,
        input_ids: torch.Tensor,
        targets: Sequence[int],
        decode_context: Callable[[Any], AbstractContextManager[Any]] | None = None,
    ) -> torch.Tensor:
        """Log-probabilities of ``targets`` teacher-forced one step at a time after ``cache`` (left untouched)."""
        working = _working_copy(cache, input_ids.shape[1] + len(targets))
        with self._decoding(working, decode_context):
            return forced_logprobs(self.model, working, input_ids, targets)

    @contextmanager
    def _decoding(
        self, cache: Any, decode_context: Callable[[Any], AbstractContextManager[Any]] | None = None
    ) -> Iterator[None]:
        """Ragged attention for a ragged cache, and the method's ``decode_context(cache)`` if any, around a run."""
        with (
            ragged_attention_enabled(self.model) if isinstance(cache, RaggedCache) else nullcontext(),
            decode_context(cache) if decode_context else nullcontext(),
        ):
            yield

    @torch.no_grad()
    def target_logits(self, cache: Any, input_ids: torch.Tensor, targets: Sequence[int]) -> torch.Tensor:
        """Logits (len(targets), vocab) predicting ``targets`` teacher-forced after ``input_ids`` (1, Q).

        One forward pass of ``input_ids`` and ``targets`` over a copy of ``cache`` (left untouched).
        """
        ids = torch.cat([input_ids, torch.tensor([list(targets)])], dim=1).to(self.device)
        working = _working_copy(cache, ids.shape[1])
        with self._decoding(working):
            logits = self.model(input_ids=ids, past_key_values=working, use_cache=True).logits[0]
        return logits[input_ids.shape[1] - 1 : -1]

    @torch.no_grad()
    def answer_nll(self, cache: RaggedCache, question_ids: torch.Tensor, answer_ids: list[int]) -> float:
        """Mean negative log-likelihood per token of ``answer_ids`` after the question, under ``cache``."""
        if not answer_ids:
            return float("nan")
        logprobs = torch.log_softmax(self.target_logits(cache, question_ids, answer_ids).float(), dim=-1)
        target = torch.tensor(answer_ids, device=logprobs.device)
        return float(-logprobs.gather(1, target[:, None]).mean())


def _working_copy(cache: Any, slack: int) -> Any:
    """A copy of ``cache`` to extend by ``slack`` tokens: a ragged one copied once, with that room; others deep."""
    return cache.copy(slack) if isinstance(cache, RaggedCache) else copy.deepcopy(cache)


@dataclass
class Generation:
    """A full-cache answer with its timings."""

    token_ids: list[int]
    prefill_s: float
    decode_s: float
    context_len: int

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decoding."""
        return len(self.token_ids) / self.decode_s if self.decode_s > 0 else float("nan")


def dense_answer(session: Session, prompt: Prompt, max_new_tokens: int) -> Generation:
    """Full-cache greedy answer in an ordinary dense cache, with prefill and decode timed separately."""
    start = time.perf_counter()
    cache = session.dense_prefill(prompt.context_ids).cache
    prefill_s = time.perf_counter() - start
    out = session.generate(cache, prompt.question_ids, max_new_tokens, in_place=True)
    return Generation(out.tokens, prefill_s, out.seconds, prompt.context_ids.shape[1])
