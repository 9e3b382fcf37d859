"""Loading, the model adapter and attention hooks, on tiny random models of every family."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvresearch.errors import KVResearchError
from kvresearch.models import ModelAdapter
from kvresearch.models.hooks import after_attention, attention_calls, attention_inputs
from kvresearch.models.load import build_random
from tests.helpers import FAMILIES, model_config, tiny_family

pytestmark = pytest.mark.compat  # also run on the GPU image's versions (make compat)


def check_adapter_matches_attention(model: torch.nn.Module, ids: torch.Tensor) -> ModelAdapter:
    """q, k, v recomputed from each layer's input h equal what the model attends with."""
    adapter = ModelAdapter(model)
    seen: dict[int, tuple[torch.Tensor, ...]] = {}
    inputs: dict[int, torch.Tensor] = {}
    with attention_calls(adapter, lambda i, q, k, v: seen.__setitem__(i, (q, k, v))), attention_inputs(adapter, inputs):
        model(ids)
    positions = torch.arange(ids.shape[1])[None]
    assert sorted(seen) == list(range(adapter.num_layers))
    for layer in range(adapter.num_layers):
        q, k, v = adapter.qkv(layer, inputs[layer], positions)
        assert q.shape == (1, adapter.num_heads, ids.shape[1], adapter.head_dim)
        assert k.shape == v.shape == (1, adapter.num_kv_heads, ids.shape[1], adapter.head_dim)
        for mine, theirs in zip((q, k, v), seen[layer], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    return adapter


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_adapter_qkv_equal_the_models_own(family: str, attn: str) -> None:
    model = tiny_family(family, attn)
    ids = torch.randint(0, 97, (1, 21), generator=torch.Generator().manual_seed(1))
    adapter = check_adapter_matches_attention(model, ids)
    assert adapter.family == family and adapter.group_size == 2
    if family == "gemma3":
        assert [layer.sliding_window for layer in adapter.layers] == [8, 8, None]
        assert adapter.layers[0].scaling == pytest.approx(24**-0.5)
    else:
        assert all(layer.sliding_window is None for layer in adapter.layers)


def test_hooks_are_removed_after_the_block() -> None:
    model = tiny_family("llama")
    adapter = ModelAdapter(model)
    before = dict(ALL_ATTENTION_FUNCTIONS._global_mapping), dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    called: list[int] = []
    with (
        attention_calls(adapter, lambda *a: None),
        attention_inputs(adapter, {}),
        after_attention(adapter, called.append),
    ):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not before[0]["sdpa"]
        model(torch.tensor([[1, 2, 3]]))
    assert called == [0, 1, 2]
    assert (dict(ALL_ATTENTION_FUNCTIONS._global_mapping), dict(ALL_ATTENTION_FUNCTIONS._local_mapping)) == before
    assert all(not layer.attn._forward_pre_hooks and not layer.attn._forward_hooks for layer in adapter.layers)
    with pytest.raises(ZeroDivisionError), attention_inputs(adapter, {}), after_attention(adapter, called.append):
        raise ZeroDivisionError
    assert all(not layer.attn._forward_pre_hooks and not layer.attn._forward_hooks for layer in adapter.layers)


def test_output_weight_splits_o_proj_by_query_head() -> None:
    model = tiny_family("qwen3")
    adapter = ModelAdapter(model)
    heads = torch.randn(5, adapter.num_heads, adapter.head_dim, dtype=torch.float64)  # (tokens, Hq, d)
    full = adapter.layers[1].attn.o_proj(heads.reshape(5, -1))
    per_head = torch.einsum("thd,hdD->tD", heads, adapter.output_weight(1))
    torch.testing.assert_close(full, per_head)
    assert list(adapter.kv_group(1)) == [2, 3]


def test_unknown_family_is_a_clear_error() -> None:
    model = build_random({"config": dict(model_type="gpt2", vocab_size=97, n_embd=32, n_layer=1, n_head=2)})
    with pytest.raises(KVResearchError, match="family 'gpt2' is not supported"):
        ModelAdapter(model)


def test_tiny_random_is_seeded_gqa_llama(tiny) -> None:
    adapter = ModelAdapter(tiny.model)
    assert (adapter.family, adapter.num_heads, adapter.num_kv_heads, adapter.num_layers) == ("llama", 4, 2, 3)
    from kvresearch.models import load_model

    again = load_model(model_config("tiny_random"))
    for a, b in zip(tiny.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_smollm2_adapter_matches_attention(smol) -> None:
    ids = smol.tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    adapter = check_adapter_matches_attention(smol.model, ids)
    assert (adapter.num_layers, adapter.num_heads, adapter.num_kv_heads, adapter.head_dim) == (30, 9, 3, 64)
    assert adapter.hidden_size == 576
