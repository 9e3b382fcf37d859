"""Generation: transformers' warpers and sampling reproduced, seeds, stop strings, in-place growth, KV bytes."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvresearch.errors import KVResearchError
from kvresearch.generation import Sampling, StopStrings, next_token, warp
from kvresearch.models import ModelAdapter, Session
from kvresearch.models.cache import RaggedLayer
from kvresearch.prompts import build_prompt


def hf_warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    scores = TemperatureLogitsWarper(s.temperature)(None, logits[None].float())
    if s.top_k:
        scores = TopKLogitsWarper(s.top_k)(None, scores)
    if s.top_p < 1:
        scores = TopPLogitsWarper(s.top_p)(None, scores)
    return scores[0]


@pytest.mark.parametrize(
    "sampling",
    [Sampling(0.7), Sampling(1.3, top_k=7), Sampling(0.6, top_p=0.9), Sampling(1.0, top_k=20, top_p=0.5)],
    ids=str,
)
def test_warp_equals_the_transformers_warpers(sampling: Sampling) -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1)) * 3
    ours, theirs = warp(logits, sampling), hf_warp(logits, sampling)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.allclose(ours[~torch.isinf(ours)], theirs[~torch.isinf(theirs)])
    assert int(torch.isfinite(ours).sum()) >= 1


def test_draws_follow_the_warped_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    sampling = Sampling(0.8, top_k=4, seed=5)
    generator = sampling.generator(0)
    counts = torch.bincount(torch.tensor([next_token(logits, sampling, generator) for _ in range(20_000)]), minlength=6)
    expected = torch.softmax(warp(logits, sampling), dim=-1)
    assert counts[4:].sum() == 0  # outside the top 4
    assert torch.allclose(counts.float() / counts.sum(), expected, atol=0.01)


def test_bad_sampling_settings_are_refused_with_the_fix() -> None:
    with pytest.raises(KVResearchError, match="temperature > 0"):
        Sampling(0.0, n=4)
    with pytest.raises(KVResearchError, match="top_p must lie in"):
        Sampling(1.0, top_p=0.0)


def test_sampled_generation_equals_transformers_sampling_with_the_same_seed(tiny) -> None:
    session = Session(ModelAdapter(tiny.model), tiny.tokenizer)
    prompt = build_prompt(tiny.tokenizer, "alpha beta gamma " * 20, "What comes next?")
    cache = session.new_cache()
    session.ragged_prefill(prompt.context_ids, cache)
    sampling = Sampling(0.9, top_k=40, top_p=0.95, seed=3)
    ours = session.generate(cache, prompt.question_ids, 24, sampling, eos=False).tokens
    assert ours == session.generate(cache, prompt.question_ids, 24, sampling, eos=False).tokens  # reproducible
    other = session.generate(cache, prompt.question_ids, 24, sampling, sample=1, eos=False).tokens
    assert other != ours  # sample 1 has its own stream
    torch.manual_seed(sampling.seed * 1_000_003)  # the stream of sample 0, on the global generator
    ids = torch.cat([prompt.context_ids, prompt.question_ids], dim=1)
    ref = tiny.model.generate(
        ids, do_sample=True, temperature=0.9, top_k=40, top_p=0.95, max_new_tokens=24, min_new_tokens=24, pad_token_id=0
    )
    assert ours == ref[0, ids.shape[1] :].tolist()


def test_stop_string_ends_the_generation_where_it_completes(smol) -> None:
    session = Session(ModelAdapter(smol.model), smol.tokenizer)
    prompt = build_prompt(smol.tokenizer, "", "Count from one to twenty in words, separated by commas.")
    cache = session.new_cache()
    full = session.generate(cache, prompt.question_ids, 40, eos=False).tokens
    decode = smol.tokenizer.decode
    stop = decode(full[20:22]).strip()
    first = next(i for i in range(len(full)) if stop in decode(full[: i + 1]))  # brute force: the first completion
    out = session.generate(cache, prompt.question_ids, 40, stop=[stop, "never printed"], eos=False)
    assert out.stop_reason == "stop" and out.tokens == full[: first + 1]
    assert StopStrings(smol.tokenizer, [stop]).cut(decode(out.tokens)) == decode(full)[: decode(full).index(stop)]


def test_the_cache_grows_in_place_with_few_reallocations(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = RaggedLayer()
    k = torch.zeros(1, 2, 1, 8)
    layer.lazy_initialization(k, k)
    calls = []
    original = RaggedLayer._relayout
    counted = lambda self, caps, keep: calls.append(1) or original(self, caps, keep)
    monkeypatch.setattr(RaggedLayer, "_relayout", counted)
    for _ in range(4000):
        layer.update(k, k)
    assert layer.seen == 4000 and len(calls) <= 25  # geometric growth: O(log n) copies, not one per token
    assert int(layer.caps.max()) <= 4000 * 1.25 + 64


def test_kv_bytes_are_traced_over_the_generation(tiny) -> None:
    session = Session(ModelAdapter(tiny.model), tiny.tokenizer)
    prompt = build_prompt(tiny.tokenizer, "alpha beta gamma " * 10, "Go on.")
    cache = session.new_cache()
    session.ragged_prefill(prompt.context_ids, cache)
    cache.compact()
    out = session.generate(cache, prompt.question_ids, 30, eos=False)
    entry = cache.ragged[0].entry_bytes()
    layers, heads = len(cache.ragged), len(cache.ragged[0].caps)
    assert out.kv.start["kept"] == (prompt.n_tokens) * entry * layers * heads
    assert out.kv.final["kept"] == (prompt.n_tokens + 29) * entry * layers * heads  # the last token is not fed
    assert out.kv.peak["kept"] == out.kv.final["kept"] and out.kv.peak["allocated"] >= out.kv.peak["kept"]
    assert cache.kv_bytes()["kept"] == prompt.context_ids.shape[1] * entry * layers * heads  # the original is untouched


def test_chat_template_options_reach_every_template_call(tiny) -> None:
    from copy import deepcopy

    from kvresearch.models.load import with_template_options

    tok = deepcopy(tiny.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}"
    )
    turn = [{"role": "user", "content": "hi"}]
    assert "<no_think>" not in tok.apply_chat_template(turn, tokenize=False)
    tok = with_template_options(tok, {"enable_thinking": False})
    assert tok.apply_chat_template(turn, tokenize=False).endswith("<no_think>")
    assert "<no_think>" not in tok.apply_chat_template(turn, tokenize=False, enable_thinking=True)  # a call's own wins
    prompt = build_prompt(tok, "ctx", "question")
    assert tok.decode(prompt.question_ids[0]).endswith("<no_think>")  # the prompt layout goes through it
