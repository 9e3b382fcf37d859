"""KVzip / KVzip+ scores against a float64 eager brute force, and their properties."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvresearch.capture import chunked_oracle_scores, oracle_scores
from kvresearch.models import ModelAdapter
from kvresearch.models.hooks import attention_inputs
from kvresearch.ops.scores import kvzip_scores, value_output_norms
from kvresearch.prompts import repeat_prompt, template_pieces
from tests.helpers import tiny_family


def brute_force(q, k, v, h_norm, w_o, scaling, q_pos, k_pos, cols, window=None):
    """Full (rows x keys) attention per query head in float64, then the formula literally."""
    hq, _, _d = q.shape
    group = hq // k.shape[0]
    kvzip = torch.zeros(k.shape[0], len(cols), dtype=torch.float64)
    plus = torch.zeros_like(kvzip)
    for g in range(hq):
        kv = g // group
        logits = (q[g].double() @ k[kv].double().T) * scaling
        delta = q_pos[:, None] - k_pos[None, :]
        mask = (delta >= 0) if window is None else (delta >= 0) & (delta < window)
        attn = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)[:, cols]
        out_norm = (v[kv][cols].double() @ w_o[g].double()).norm(dim=-1)  # (C,)
        kvzip[kv] = torch.maximum(kvzip[kv], attn.max(dim=0).values)
        plus[kv] = torch.maximum(plus[kv], (attn / h_norm[:, None].double() * out_norm).max(dim=0).values)
    return kvzip, plus


def random_problem(seed=0, hq=6, hkv=2, rows=37, n=90, d=8, hidden=20):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, rows, d, generator=g, dtype=torch.float64)
    k = torch.randn(hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(hkv, n, d, generator=g, dtype=torch.float64)
    w_o = torch.randn(hq, d, hidden, generator=g, dtype=torch.float64)
    h_norm = torch.rand(rows, generator=g, dtype=torch.float64) + 0.5
    q_pos = torch.arange(n - rows, n)
    k_pos = torch.arange(n)
    cols = torch.arange(5, 40)
    return q, k, v, w_o, h_norm, q_pos, k_pos, cols


@pytest.mark.parametrize("window", [None, 30])
@pytest.mark.parametrize("block", [1, 7, 256])
def test_blocked_scores_equal_brute_force(window, block) -> None:
    q, k, v, w_o, h_norm, q_pos, k_pos, cols = random_problem()
    ours = kvzip_scores(q, k, v[:, cols], cols, h_norm, w_o, 0.35, q_pos, k_pos, window=window, block=block)
    ref = brute_force(q, k, v, h_norm, w_o, 0.35, q_pos, k_pos, cols, window)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("window", [None, 30])
def test_keys_in_any_order_and_columns_in_every_rows_future(window) -> None:
    """Rows in the middle of the keys: blocks skip their future keys (sorted) or mask them all (shuffled)."""
    q, k, v, w_o, h_norm, _, k_pos, _ = random_problem(seed=3)
    q_pos, cols = torch.arange(20, 57), torch.arange(5, 80)  # columns 57 on: in the future of every row
    ref = brute_force(q, k, v, h_norm, w_o, 0.35, q_pos, k_pos, cols, window)
    perm = torch.randperm(len(k_pos), generator=torch.Generator().manual_seed(1))
    where = torch.argsort(perm)  # where[i]: the shuffled index of key i
    for keys, values, positions, scored in [(k, v, k_pos, cols), (k[:, perm], v[:, perm], k_pos[perm], where[cols])]:
        ours = kvzip_scores(q, keys, values[:, scored], scored, h_norm, w_o, 0.35, q_pos, positions, window, block=7)
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        assert (ours[0][:, 57 - 5 :] == 0).all()


def test_value_output_norms_equal_direct_product() -> None:
    _, _, v, w_o, *_ = random_problem(seed=2)
    direct = torch.einsum("knd,kgdD->kgnD", v, w_o.view(2, 3, *w_o.shape[1:])).norm(dim=-1)
    torch.testing.assert_close(value_output_norms(v, w_o), direct, rtol=1e-10, atol=1e-12)


def test_kvzip_plus_is_kvzip_when_both_norms_are_one() -> None:
    q, k, v, _, h_norm, q_pos, k_pos, cols = random_problem(seed=3, d=8, hidden=8)
    v = v / v.norm(dim=-1, keepdim=True)  # ||v_i|| = 1
    w_o = torch.eye(8, dtype=torch.float64).expand(6, 8, 8)  # ||v W_O^g|| = ||v|| = 1
    kvzip, plus = kvzip_scores(q, k, v[:, cols], cols, torch.ones_like(h_norm), w_o, 0.3, q_pos, k_pos)
    torch.testing.assert_close(plus, kvzip, rtol=1e-12, atol=0)
    # Scaling every ||h_j|| by c divides KVzip+ by c and leaves KVzip alone.
    kvzip2, plus2 = kvzip_scores(q, k, v[:, cols], cols, torch.full_like(h_norm, 4.0), w_o, 0.3, q_pos, k_pos)
    torch.testing.assert_close(kvzip2, kvzip)
    torch.testing.assert_close(plus2, kvzip / 4.0)


def test_gqa_maximum_runs_over_the_right_heads() -> None:
    q, k, v, w_o, h_norm, q_pos, k_pos, cols = random_problem(seed=4)
    base = kvzip_scores(q, k, v[:, cols], cols, h_norm, w_o, 0.3, q_pos, k_pos)
    # Permuting query heads inside a group (with their W_O slices) changes nothing.
    perm = torch.tensor([2, 0, 1, 5, 3, 4])
    same = kvzip_scores(q[perm], k, v[:, cols], cols, h_norm, w_o[perm], 0.3, q_pos, k_pos)
    for a, b in zip(base, same, strict=True):
        torch.testing.assert_close(a, b)
    # Swapping the two KV heads together with their query groups swaps the output rows.
    swap = torch.tensor([3, 4, 5, 0, 1, 2])
    swapped = kvzip_scores(q[swap], k.flip(0), v.flip(0)[:, cols], cols, h_norm, w_o[swap], 0.3, q_pos, k_pos)
    for a, b in zip(base, swapped, strict=True):
        torch.testing.assert_close(a, b.flip(0))
    # Moving a query head to the other group changes the result.
    cross = torch.tensor([3, 1, 2, 0, 4, 5])
    moved = kvzip_scores(q[cross], k, v[:, cols], cols, h_norm, w_o[cross], 0.3, q_pos, k_pos)
    assert not torch.allclose(base[0], moved[0])


def eager_reference(model, prompt):
    """Scores from the model's own eager float64 attention weights (the KVzap training formula)."""
    adapter = ModelAdapter(model)
    inputs: dict[int, torch.Tensor] = {}
    with attention_inputs(adapter, inputs):
        out = adapter.decoder(input_ids=prompt.input_ids, output_attentions=True, use_cache=False)
    results = []
    for layer, attn in enumerate(out.attentions):  # (1, Hq, T, T)
        h = inputs[layer][0]
        _, _, v = adapter.project(layer, inputs[layer])
        w_o = adapter.output_weight(layer)
        a = attn[0][:, prompt.repeat, prompt.context]  # (Hq, R, C)
        out_norm = torch.stack(
            [v[0, g // adapter.group_size, prompt.context] @ w_o[g] for g in range(adapter.num_heads)]
        )
        plus = a / h[prompt.repeat].norm(dim=-1)[None, :, None] * out_norm.norm(dim=-1)[:, None, :]
        group = lambda x: x.amax(dim=1).view(adapter.num_kv_heads, adapter.group_size, -1).amax(dim=1)
        results.append((group(a), group(plus)))
    return results


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_capture_equals_eager_float64_brute_force(family, tiny) -> None:
    model = tiny_family(family, "sdpa")
    eager = tiny_family(family, "eager")
    ids = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = repeat_prompt(tiny.tokenizer, ids)
    prompt.input_ids.clamp_(max=96)  # the tiny vocabulary
    ours = oracle_scores(ModelAdapter(model), prompt, keep_hidden=torch.tensor([0, 5]))
    ref = eager_reference(eager, prompt)
    for layer, (kvzip, plus) in enumerate(ref):
        torch.testing.assert_close(ours[layer].kvzip.double(), kvzip, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(ours[layer].kvzip_plus.double(), plus, rtol=1e-6, atol=1e-9)
        assert ours[layer].hidden.shape == (2, 64)


def test_chunked_oracle_equals_single_pass_on_one_chunk(tiny) -> None:
    adapter = ModelAdapter(tiny.model)
    tok = tiny.tokenizer
    ids = tok("The tiny model reads a short context about apples and pears. " * 6, add_special_tokens=False).input_ids
    pieces = template_pieces(tok)
    single = oracle_scores(adapter, repeat_prompt(tok, ids, pieces))
    cache = DynamicCache()
    adapter.decoder(input_ids=torch.tensor([pieces.head + ids]), past_key_values=cache, use_cache=True)
    chunked = chunked_oracle_scores(adapter, tok, cache, ids, len(pieces.head), chunk_size=512)
    assert cache.get_seq_length() == len(pieces.head) + len(ids)  # cropped back
    for a, b in zip(single, chunked, strict=True):
        torch.testing.assert_close(a.kvzip, b.kvzip, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(a.kvzip_plus, b.kvzip_plus, rtol=1e-5, atol=1e-7)


def test_chunked_oracle_restricts_softmax_to_sinks_chunk_and_repeat(tiny) -> None:
    """Brute force: eager float64 attention over the full cache, renormalised over the allowed keys."""
    model = tiny_family("llama", "eager")
    adapter = ModelAdapter(model)
    tok = tiny.tokenizer
    ids = [int(i) for i in torch.randint(3, 97, (30,), generator=torch.Generator().manual_seed(5))]
    head = [1, 4, 5]
    chunk_size = 12

    def cached():
        cache = DynamicCache()
        adapter.decoder(input_ids=torch.tensor([head + ids]), past_key_values=cache, use_cache=True)
        return cache

    class ClampTok:  # the tiny vocabulary: map every id into range
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            out = tok(text, add_special_tokens=False)
            out["input_ids"] = [i % 97 for i in out["input_ids"]]
            return out

    ours = chunked_oracle_scores(adapter, ClampTok(), cached(), ids, len(head), chunk_size=chunk_size, hint_tokens=4)
    total = len(head) + len(ids)
    for start in range(0, len(ids), chunk_size):
        chunk = ids[start : start + chunk_size]
        prefix = ClampTok()(
            "\n\nRepeat the previous context exactly."
            if start == 0
            else "\n\nRepeat the part of the previous context exactly, starting with"
        ).input_ids
        if start:
            prefix = prefix + ids[start - 4 : start]
        new = prefix + ClampTok()("\n").input_ids + chunk
        cache = cached()
        inputs: dict[int, torch.Tensor] = {}
        with attention_inputs(adapter, inputs):
            out = adapter.decoder(
                input_ids=torch.tensor([new]),
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.arange(total, total + len(new))[None],
                output_attentions=True,
            )
        cols = list(range(len(head) + start, len(head) + start + len(chunk)))
        allowed = list(range(len(head))) + cols + list(range(total, total + len(new)))
        for layer, attn in enumerate(out.attentions):  # (1, Hq, new, total + new)
            a = attn[0][:, -len(chunk) :, allowed]
            a = a / a.sum(-1, keepdim=True)
            a = a[:, :, len(head) : len(head) + len(chunk)]  # (Hq, R, C)
            ref = a.amax(dim=1).view(adapter.num_kv_heads, adapter.group_size, -1).amax(dim=1)
            torch.testing.assert_close(
                ours[layer].kvzip[:, start : start + len(chunk)].double(), ref, rtol=1e-5, atol=1e-8
            )


def test_a_row_with_a_zero_attention_input_adds_nothing_to_kvzip_plus() -> None:
    q, k, v, w_o, h_norm, q_pos, k_pos, cols = random_problem()
    zero = h_norm.clone()
    zero[3] = 0.0  # e.g. a zero padding embedding at layer 0
    ours = kvzip_scores(q, k, v[:, cols], cols, zero, w_o, 0.35, q_pos, k_pos)[1]
    keep = [i for i in range(len(h_norm)) if i != 3]
    ref = brute_force(q[:, keep], k, v, h_norm[keep], w_o, 0.35, q_pos[keep], k_pos, cols)[1]
    assert torch.isfinite(ours).all() and torch.allclose(ours.double(), ref, rtol=1e-5, atol=1e-9)
