"""Generation from a cache: greedy or sampled, n samples, stop strings, KV bytes over the generation.

Sampling applies transformers' warpers in their order: temperature, then top-k, then top-p (the
smallest set of most likely tokens whose probability reaches ``top_p``; the most likely one always
stays). Sample ``i`` of a prompt draws from its own generator seeded with ``(seed, i)``, so a sampled
generation is reproducible on the same device and does not depend on what ran before it.

Long generations cost no per-step copy: the cache grows in place (a ragged head grows by a quarter
when full, ``models/cache.py``) and stop strings are matched on the decoded tail only.

Shapes: ``input_ids`` (1, Q); logits (vocab,).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvresearch.errors import KVResearchError

STOP_REASONS = ("eos", "stop", "length")


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: ``temperature=0`` is greedy (top-k, top-p and the seed are then unused)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int = 0
    n: int = 1  # samples per prompt

    def __post_init__(self) -> None:
        """Valid ranges; n > 1 only when sampling (greedy samples would all be equal)."""
        problems = []
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        elif self.n > 1 and self.greedy:
            problems.append(f"n={self.n} greedy samples would all be the same: set a temperature > 0 or n=1")
        if problems:
            raise KVResearchError("generation: " + "; ".join(problems) + ".")

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature == 0

    def generator(self, sample: int, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The generator of sample ``sample`` (None when greedy)."""
        if self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + sample)


GREEDY = Sampling()


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(vocab,) logits -> float32 logits of the sampling distribution, -inf outside the top-k / top-p set."""
    scores = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        order = torch.argsort(scores, descending=False)
        cumulative = torch.softmax(scores[order], dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return scores


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from (vocab,) logits: the argmax, or a draw from the warped distribution."""
    if sampling.greedy:
        return int(logits.argmax())
    probs = torch.softmax(warp(logits, sampling), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class KVTrace:
    """KV bytes held over a generation: after the prompt, at the peak, at the end (kept and allocated)."""

    start: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    final: dict[str, int] = field(default_factory=dict)
    prune_ratio: float | None = None  # share of all positions seen (context and generated) evicted, at the end

    def observe(self, cache: Any) -> None:
        """Read the cache's bytes (a ragged cache reports them; other caches are skipped)."""
        if not hasattr(cache, "kv_bytes"):
            return
        now = cache.kv_bytes()
        if not self.start:
            self.start = dict(now)
        self.peak = {k: max(v, self.peak.get(k, 0)) for k, v in now.items()}
        self.final = dict(now)

    def finish(self, cache: Any) -> None:
        """Record the prune ratio at the end of the generation."""
        if hasattr(cache, "stats"):
            self.prune_ratio = float(cache.stats()["prune_ratio"])

    def as_record(self) -> dict[str, Any]:
        """Flat fields for a predictions record."""
        out: dict[str, Any] = {}
        for when in ("start", "peak", "final"):
            for key in ("kept", "allocated"):
                if key in getattr(self, when):
                    out[f"kv_bytes_{when}_{key}"] = getattr(self, when)[key]
        if self.prune_ratio is not None:
            out["decode_prune_ratio"] = self.prune_ratio
        return out


@dataclass
class Generated:
    """One generation: its tokens (the stop string's tokens included), why it stopped, seconds, KV bytes.

    ``logprobs``: the model's log-probability of each returned token where it was chosen (before any warping).
    """

    tokens: list[int]
    stop_reason: str
    seconds: float
    kv: KVTrace
    logprobs: list[float] = field(default_factory=list)


class StopStrings:
    """Match stop strings on the decoded tail of a generation (a few tokens more than the longest string)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]):
        """``stop``: strings that end a generation (empty: none)."""
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        if self.stop and tokenizer is None:
            raise KVResearchError("stop strings need a tokenizer to decode the generation.")
        self.tail = max((len(s) for s in self.stop), default=0) + 4

    def hit(self, tokens: list[int]) -> bool:
        """True when the decoded tail of ``tokens`` contains a stop string."""
        if not self.stop:
            return False
        text = self.tokenizer.decode(tokens[-self.tail :], skip_special_tokens=False)
        return any(s in text for s in self.stop)

    def cut(self, text: str) -> str:
        """``text`` up to the first stop string (excluded)."""
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return text[: min(found)] if found else text


@torch.no_grad()
def generate(
    model: Any,
    cache: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    sample: int = 0,
    eos: set[int] | None = None,
    stop: StopStrings | None = None,
) -> Generated:
    """Feed ``input_ids`` (1, Q) after ``cache`` (extended in place) and generate up to ``max_new_tokens``.

    Stops at an ``eos`` id (not returned) or once a stop string is complete (its tokens returned).
    """
    device = next(model.parameters()).device
    generator = sampling.generator(sample, device)
    tokens: list[int] = []
    logprobs: list[float] = []
    trace, reason = KVTrace(), "length"
    start = time.perf_counter()
    logits = model(input_ids=input_ids.to(device), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    trace.observe(cache)
    for _ in range(max_new_tokens):
        token = next_token(logits[0, -1], sampling, generator)
        if eos and token in eos:
            reason = "eos"
            break
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits[0, -1].double(), dim=-1)[token]))
        if stop is not None and stop.hit(tokens):
            reason = "stop"
            break
        if len(tokens) == max_new_tokens:
            break  # the last token needs no forward pass
        step = torch.tensor([[token]], device=device)
        logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits
        trace.observe(cache)
    trace.finish(cache)
    return Generated(tokens, reason, time.perf_counter() - start, trace, logprobs)


@torch.no_grad()
def forced_logprobs(model: Any, cache: Any, input_ids: torch.Tensor, targets: Sequence[int]) -> torch.Tensor:
    """Log-probabilities (len(targets),) of ``targets`` fed one token at a time after ``input_ids`` (1, Q).

    The cache is extended in place, one decoding step per target, so that compression while decoding acts
    exactly as it would while generating those tokens.
    """
    device = next(model.parameters()).device
    out = torch.empty(len(targets), dtype=torch.float64)
    logits = model(input_ids=input_ids.to(device), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    for i, token in enumerate(targets):
        out[i] = torch.log_softmax(logits[0, -1].double(), dim=-1)[token]
        if i + 1 < len(targets):
            step = torch.tensor([[token]], device=device)
            logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits
    return out
