"""KVzip / KVzip+ scores against a float64 eager brute force, and their properties."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvresearch.capture import chunked_oracle_scores, fused_applies, oracle_scores
from kvresearch.models import ModelAdapter
from kvresearch.models.hooks import attention_inputs
from kvresearch.ops.attention import attention_with_lse, merged_attention
from kvresearch.ops.scores import kvzip_scores, kvzip_scores_lse, value_output_norms
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


def brute_lse(q, k, scaling, q_pos, k_pos):
    """(Hq, rows) float64 log-sum-exp of each row's causal scaled logits."""
    group = q.shape[0] // k.shape[0]
    logits = q.double() @ k.double().repeat_interleave(group, 0).transpose(1, 2) * scaling
    return logits.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf")).logsumexp(dim=-1)


@pytest.mark.parametrize("block", [1, 5, 64])
def test_scores_from_the_rows_log_normalisers_equal_brute_force(block) -> None:
    """Columns in every row's past: only their logits are formed, normalised by the given lse."""
    q, k, v, w_o, h_norm, q_pos, k_pos, cols = random_problem()
    h_norm[3] = 0.0  # a zero attention input adds nothing to KVzip+
    lse = brute_lse(q, k, 0.35, q_pos, k_pos)
    ours = kvzip_scores_lse(q, k[:, cols], v[:, cols], h_norm, w_o, 0.35, lse, block=block)
    keep = [i for i in range(len(h_norm)) if i != 3]
    ref = brute_force(q, k, v, h_norm.clamp_min(1e-300), w_o, 0.35, q_pos, k_pos, cols)
    ref_plus = brute_force(q[:, keep], k, v, h_norm[keep], w_o, 0.35, q_pos[keep], k_pos, cols)[1]
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-9, atol=0)
    torch.testing.assert_close(ours[1], ref_plus, rtol=1e-9, atol=0)


def test_merged_attention_equals_one_masked_attention_over_all_keys() -> None:
    """[head | chunk], [rest], [rows' own keys, causal]: the repeat pass's split, merged exactly (GQA, float64)."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, ctx, t, d = 6, 2, 30, 11, 8
    q = torch.randn(1, hq, t, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, hkv, ctx + t, d, generator=g, dtype=torch.float64) for _ in range(2))
    q_pos, k_pos = torch.arange(ctx, ctx + t), torch.arange(ctx + t)
    mask = (k_pos[None] <= q_pos[:, None])[None, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask, scale=0.4
    )
    first, rest, own = slice(0, 12), slice(12, ctx), slice(ctx, None)
    parts = [(k[:, :, s], v[:, :, s], s is own) for s in (first, rest, own)]
    out, lses = merged_attention(q, parts, 0.4)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    full = brute_lse(q[0], k[0], 0.4, q_pos, k_pos)
    sub = brute_lse(q[0], torch.cat([k[0, :, first], k[0, :, own]], 1), 0.4, q_pos,
                    torch.cat([k_pos[first], k_pos[own]]))  # fmt: skip
    torch.testing.assert_close(torch.logsumexp(torch.stack(lses), 0)[0], full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.logaddexp(lses[0], lses[2])[0], sub, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="square"):
        attention_with_lse(q, k, v, 0.4, causal=True)
    with pytest.raises(ValueError, match="rows and keys"):
        attention_with_lse(q, k[:, :, :0], v[:, :, :0], 0.4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("chunk_size", [12, 512])
def test_the_fused_chunked_oracle_equals_the_unfused_one(family, chunk_size, tiny) -> None:
    """One chunk and several; gemma3's sliding layers take the unfused path inside a fused pass."""
    model = tiny_family(family, "sdpa")
    adapter = ModelAdapter(model)
    assert fused_applies(adapter, torch.device("cpu"))
    ids = [int(i) for i in torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(6))]
    head = [1, 4, 5]

    class ClampTok:  # the tiny vocabulary: map every id into range
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            out = tiny.tokenizer(text, add_special_tokens=False)
            out["input_ids"] = [i % 97 for i in out["input_ids"]]
            return out

    def scores(fused):
        cache = DynamicCache()
        adapter.decoder(input_ids=torch.tensor([head + ids]), past_key_values=cache, use_cache=True)
        layers = chunked_oracle_scores(adapter, ClampTok(), cache, ids, len(head), chunk_size, 4, fused=fused)
        assert cache.get_seq_length() == len(head) + len(ids)  # cropped back, also after the early stop
        return layers

    for a, b in zip(scores(True), scores(False), strict=True):
        torch.testing.assert_close(a.kvzip, b.kvzip, rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(a.kvzip_plus, b.kvzip_plus, rtol=1e-10, atol=1e-14)
