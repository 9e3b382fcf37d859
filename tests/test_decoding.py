"""Compression while decoding: kvpress's DecodingPress on the ragged cache against kvpress itself, and
re-compression (KVzip+, Attention Matching) against compressing the same prefix once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.optimize import linear_sum_assignment
from transformers import DynamicCache

from kvresearch.methods.attention_matching import AttentionMatching
from kvresearch.methods.baselines import KVPress
from kvresearch.methods.kvzip import KVzip
from kvresearch.models import ModelAdapter, Session
from kvresearch.prompts import Prompt, build_prompt

INTERVAL, TARGET, STEPS = 4, 24, 19


@pytest.fixture
def setup(tiny):
    session = Session(ModelAdapter(tiny.model), tiny.tokenizer)
    text = " ".join(f"item{i} is {i * 7 % 13}." for i in range(12))
    return session, build_prompt(tiny.tokenizer, text, "Which item is 5?")


def kvpress_reference(session: Session, prompt: Prompt, press) -> tuple[list[int], DynamicCache]:
    """kvpress's own loop (its pipeline's generate_answer): a dense cache, explicit positions, the press attached."""
    model, n = session.model, prompt.context_ids.shape[1]
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=prompt.context_ids, past_key_values=cache, use_cache=True)
        with press(model):
            position_ids = torch.arange(n, n + prompt.question_ids.shape[1])[None]
            out = model(input_ids=prompt.question_ids, past_key_values=cache, position_ids=position_ids)
            position_ids = position_ids[:, -1:] + 1
            tokens = [int(out.logits[0, -1].argmax())]
            for i in range(STEPS - 1):
                step = torch.tensor([[tokens[-1]]])
                out = model(input_ids=step, past_key_values=cache, position_ids=position_ids + i)
                tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, cache


@pytest.mark.parametrize("scorer", ["KnormPress", "SnapKVPress", "StreamingLLMPress"])
def test_decoding_press_evicts_what_kvpress_evicts(setup, scorer: str) -> None:
    import kvpress

    session, prompt = setup
    options = {"SnapKVPress": {"window_size": 2}, "StreamingLLMPress": {"n_sink": 2}}.get(scorer, {})
    press = getattr(kvpress, scorer)(**options)
    method = KVPress(name=scorer, press=press, decoding={"interval": INTERVAL, "target_size": TARGET})
    cache = method.compress(session, prompt)  # no compression ratio: the whole context
    out = session.generate(
        cache,
        prompt.question_ids,
        STEPS,
        decode_context=lambda c: method.decode_context(session, c),
        eos=False,
        in_place=True,
    )
    tokens, reference = kvpress_reference(session, prompt, method._decoding_press())
    assert out.tokens == tokens
    for index, layer in enumerate(cache.ragged):
        theirs = reference.layers[index]
        for h in range(len(layer.caps)):
            ours = torch.cat([layer.k[layer.head_rows(h)], layer.v[layer.head_rows(h)]], dim=-1)
            pairs = torch.cat([theirs.keys[0, h], theirs.values[0, h]], dim=-1)
            assert ours.shape == pairs.shape
            distances = torch.cdist(pairs, ours, compute_mode="donot_use_mm_for_euclid_dist")
            matched = distances[linear_sum_assignment(distances.numpy())]  # the best one-to-one pairing
            assert float(matched.max()) < 1e-4  # the same (key, value) pairs, up to float noise
    assert all(TARGET <= int(layer.kept_per_head().max()) < TARGET + INTERVAL for layer in cache.ragged)
    assert out.kv.final["kept"] < out.kv.start["kept"] <= out.kv.peak["kept"]  # memory falls while generating


def test_kvpress_decoding_needs_a_scorer_press() -> None:
    from kvpress import DMSPress, KnormPress

    from kvresearch.errors import KVResearchError

    with pytest.raises(KVResearchError, match="needs a scorer press"):
        KVPress(name="dms", press=DMSPress(KnormPress()), decoding={"interval": 4, "target_size": 8})


@pytest.mark.parametrize("kind", ["am", "kvzip_plus"])
def test_recompression_while_decoding_equals_compressing_the_prefix_once(setup, kind: str) -> None:
    session, prompt = setup
    budget = {"interval": 8, "target_size": 40, "protect": 4}
    if kind == "am":
        method = AttentionMatching(keep_ratio=0.5, queries={"sources": ["context"], "holdout": 0.0}, decoding=budget)
    else:
        method = KVzip(keep_ratio=0.5, scope="head", decoding=budget)
    cache = method.compress(session, prompt)
    decode = lambda c: method.decode_context(session, c)
    out = session.generate(cache, prompt.question_ids, 12, decode_context=decode, eos=False, in_place=True)
    (event,) = cache.method_state["recompressions"]  # entries pass 40 per head after 8 steps, once in 12
    history = cache.method_state["history"]
    ids = prompt.context_ids[0].tolist() + prompt.question_ids[0].tolist() + out.tokens[:-1]
    assert history == ids  # every id fed is on record (the last token is never fed)
    cut = event["prefix"]
    assert event["position"] == cut + 4 == prompt.n_tokens + 8
    once = dataclasses.replace(method, keep_ratio=event["keep_ratio"], decoding=None).compress(
        session, Prompt(torch.tensor([ids[:cut]]), torch.zeros(1, 0, dtype=torch.long), prompt.head_len)
    )
    plain = dataclasses.replace(method, decoding=None).compress(session, prompt)  # no compression while decoding
    first = session.generate(plain, prompt.question_ids, 9, eos=False, in_place=True)
    assert first.tokens == out.tokens[:9]  # identical until the re-compression, after the 8th step
    for layer, expected, before in zip(cache.ragged, once.ragged, plain.ragged, strict=True):
        for h in range(len(layer.caps)):
            rows, ref = layer.head_rows(h), expected.head_rows(h)
            old = layer.pos[rows] < cut
            assert torch.equal(layer.pos[rows][old], expected.pos[ref])  # the prefix, compressed once
            assert torch.equal(layer.k[rows][old], expected.k[ref]) and torch.equal(layer.v[rows][old], expected.v[ref])
            assert torch.equal(layer.bias[rows][old], expected.bias[ref])
            tail = (layer.pos[rows] >= cut) & (layer.pos[rows] < cut + 4)
            kept_rows = before.head_rows(h)[(before.pos[before.head_rows(h)] >= cut)][:4]
            assert torch.equal(layer.k[rows][tail], before.k[kept_rows])  # the protected tokens, as they were
        assert int(layer.kept_per_head().max()) <= 40 + 4  # back to the budget, then 4 more steps
