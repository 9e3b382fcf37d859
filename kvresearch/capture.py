"""Oracle capture (model glue): KVzip/KVzip+ scores from one forward pass over the repeat prompt.

Repeat prompt (the KVzap training template, ``prompts.repeat_prompt``): chat template with user =
context + instruction and assistant = context, built from ids of its pieces so that the spans are
exact and the chunked oracle below sees the same tokens.

Our choices where the reference implementations differ:

* queries: only the rows of the repeated context count (the KVzap training code), not the instruction
  and template tokens between the two copies (kvpress's KVzip press counts those too);
* softmax: over every key the row can see in the single pass; in the chunked oracle over
  ``[template head | current chunk | repeat tokens]``. The "sinks" are the whole template head (kvpress
  keeps 4 tokens), so that on a context of one chunk both give the same scores;
* scores are returned raw; the training target is ``log(kvzip_plus)``.

Speed (``fused``, on by default where it applies: sdpa on CPU, layers without a sliding window): the
chunked oracle's repeat pass attends by three calls of the flash kernel, over ``[template head | chunk]``,
the rest of the context and the repeat tokens (causal), merged by their log-sum-exps. That skips the
masked half of the repeat square, and the scores then need only the chunk's logits, normalised by the
log-sum-exp of the first and last parts. Outputs and scores agree with the unfused path to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvresearch.models.adapter import ModelAdapter
from kvresearch.models.hooks import attention_calls, attention_inputs
from kvresearch.ops.attention import merged_attention
from kvresearch.ops.scores import kvzip_scores, kvzip_scores_lse
from kvresearch.prompts import KVZIP_CONTINUE, KVZIP_REPEAT, RepeatPrompt, template_pieces


@dataclass
class LayerScores:
    """One layer's oracle scores for the context tokens."""

    kvzip: torch.Tensor  # (kv_heads, n_context) fp32
    kvzip_plus: torch.Tensor  # (kv_heads, n_context) fp32
    hidden: torch.Tensor | None  # (n_selected, hidden) attention inputs of the selected context positions


def _score_call(
    adapter: ModelAdapter,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    h: torch.Tensor,
    rows: slice,
    cols: torch.Tensor,
    keys: torch.Tensor | None,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of one attention call. q (1, Hq, T, d) are the call's new tokens; k, v (1, Hkv, N, d) all keys.

    ``rows`` indexes the new tokens, ``keys`` the softmax keys into N (None: all of them, no copy),
    ``cols`` the scored keys into N.
    """
    n_keys, n_new = k.shape[2], q.shape[2]
    q_pos = torch.arange(n_keys - n_new, n_keys, device=q.device)[rows]
    if keys is None:
        keys = torch.arange(n_keys)
        softmax_keys = k[0]
    else:
        softmax_keys = k[0, :, keys]
    col_in_keys = torch.searchsorted(keys, cols).to(q.device)  # keys are sorted and contain cols
    spec = adapter.layers[layer]
    return kvzip_scores(
        q[0, :, rows],
        softmax_keys,
        v[0, :, cols],
        col_in_keys,
        h[0, rows].norm(dim=-1),
        adapter.output_weight(layer),
        spec.scaling,
        q_pos,
        keys.to(q.device),
        window=spec.sliding_window,
        block=block,
    )


class _PassDone(Exception):
    """Ends a repeat pass once the last layer is scored."""


def _fused_call(
    adapter: ModelAdapter,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    h: torch.Tensor,
    rows: slice,
    span: slice,
    head_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One repeat-pass attention call of the chunked oracle, split in parts (module docstring); its scores.

    q (1, Hq, T, d) are the pass's T new tokens; k, v (1, Hkv, total + T, d) the cache then those tokens;
    ``span`` the chunk's positions in the cache. Returns the attention output (1, Hq, T, d), kvzip, kvzip_plus.
    """
    total, scaling = k.shape[2] - q.shape[2], adapter.layers[layer].scaling
    pick = lambda spans: (
        (k[:, :, spans[0]], v[:, :, spans[0]])
        if len(spans) == 1
        else (torch.cat([k[:, :, s] for s in spans], dim=2), torch.cat([v[:, :, s] for s in spans], dim=2))
    )
    head_chunk = [slice(0, span.stop)] if span.start == head_len else [slice(0, head_len), span]
    rest = [s for s in (slice(head_len, span.start), slice(span.stop, total)) if s.stop > s.start]
    parts = [(*pick(head_chunk), False), *([(*pick(rest), False)] if rest else []), (*pick([slice(total, None)]), True)]
    out, lses = merged_attention(q, parts, scaling)
    lse = torch.logaddexp(lses[0], lses[-1])[0, :, rows]  # the softmax over [head | chunk | repeat tokens]
    kvzip, plus = kvzip_scores_lse(
        q[0, :, rows], k[0, :, span], v[0, :, span], h[0, rows].norm(dim=-1), adapter.output_weight(layer), scaling,
        lse,
    )  # fmt: skip
    return out, kvzip, plus


def fused_applies(adapter: ModelAdapter, device: torch.device) -> bool:
    """Whether the chunked oracle can split its repeat pass (sdpa on CPU, no attention logit soft-capping)."""
    softcap = getattr(adapter.config, "attn_logit_softcapping", None)
    return adapter.config._attn_implementation == "sdpa" and device.type == "cpu" and softcap is None


@torch.no_grad()
def oracle_scores(
    adapter: ModelAdapter, prompt: RepeatPrompt, keep_hidden: torch.Tensor | None = None, block: int = 128
) -> list[LayerScores]:
    """KVzip and KVzip+ scores of every context token in every layer from one forward pass.

    The model keeps its own attention implementation (sdpa, flash, ...); the scores are computed from
    the q, k, v it attends with, layer by layer, in row blocks.

    Args:
        adapter: the model.
        prompt: the repeat prompt (its two context spans marked).
        keep_hidden: (n_selected,) context offsets whose attention inputs h are returned (None: none).
        block: query rows per block of the score computation.
    """
    n = prompt.context.stop - prompt.context.start
    cols = torch.arange(prompt.context.start, prompt.context.stop)
    inputs: dict[int, torch.Tensor] = {}
    out: list[LayerScores | None] = [None] * adapter.num_layers

    def on_call(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        h = inputs[layer]
        kvzip, plus = _score_call(adapter, layer, q, k, v, h, prompt.repeat, cols, None, block)
        hidden = None if keep_hidden is None else h[0, prompt.context.start + keep_hidden].detach().clone()
        out[layer] = LayerScores(kvzip.float(), plus.float(), hidden)
        del inputs[layer]

    device = next(adapter.model.parameters()).device
    with attention_inputs(adapter, inputs), attention_calls(adapter, on_call):
        adapter.decoder(input_ids=prompt.input_ids.to(device), use_cache=False)
    assert all(s is not None for s in out) and n > 0
    return [s for s in out if s is not None]


@torch.no_grad()
def chunked_oracle_scores(
    adapter: ModelAdapter,
    tokenizer: Any,
    cache: Any,
    context_ids: list[int],
    head_len: int,
    chunk_size: int = 2048,
    hint_tokens: int = 8,
    block: int = 128,
    progress: Callable[[int], None] | None = None,
    fused: bool | None = None,
) -> list[LayerScores]:
    """The evaluation-time oracle over a prefilled cache of ``head | context`` (KVzip's chunked replay).

    For each chunk of about ``chunk_size`` context tokens, the model reads
    ``instruction [+ last hint_tokens tokens of the previous chunk] + middle + chunk`` after the cache
    (positions continue after the context); the softmax of the repeated rows runs over
    ``[template head | chunk | repeat tokens]``; then the cache is cropped back to the context.
    On a context of one chunk this equals :func:`oracle_scores` on the same ids.

    Args:
        adapter: the model.
        tokenizer: its tokenizer (for the instructions and the chat template).
        cache: a transformers cache holding exactly ``head_len + len(context_ids)`` positions.
        context_ids: the context's token ids (after the template head).
        head_len: number of template-head tokens before the context in the cache.
        chunk_size: context tokens per repeat pass.
        hint_tokens: tokens of the previous chunk that the next instruction quotes.
        block: query rows per block of the unfused score computation.
        progress: called with the number of context tokens done after each chunk.
        fused: split the repeat pass (module docstring) on layers without a sliding window; None: where
            :func:`fused_applies`.

    Returns:
        per layer: kvzip and kvzip_plus of shape (kv_heads, len(context_ids)); hidden is None.
    """
    pieces = template_pieces(tokenizer)
    total = head_len + len(context_ids)
    if cache.get_seq_length() != total:
        raise ValueError(f"cache holds {cache.get_seq_length()} positions, expected head + context = {total}")
    encode = lambda s: tokenizer(s, add_special_tokens=False).input_ids
    kvzip = [torch.zeros(adapter.num_kv_heads, len(context_ids)) for _ in range(adapter.num_layers)]
    plus = [torch.zeros(adapter.num_kv_heads, len(context_ids)) for _ in range(adapter.num_layers)]
    inputs: dict[int, torch.Tensor] = {}
    device = next(adapter.model.parameters()).device
    if fused is None:
        fused = fused_applies(adapter, device)
    for start in range(0, len(context_ids), chunk_size):
        chunk = context_ids[start : start + chunk_size]
        if start == 0:
            prefix = encode(KVZIP_REPEAT)
        else:
            prefix = encode(KVZIP_CONTINUE) + context_ids[max(0, start - hint_tokens) : start]
        ids = prefix + pieces.middle + chunk
        rows = slice(len(ids) - len(chunk), len(ids))
        cols = torch.arange(head_len + start, head_len + start + len(chunk))
        keys = torch.cat([torch.arange(head_len), cols, torch.arange(total, total + len(ids))])

        def on_call(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows=rows, cols=cols, keys=keys):
            out, span = None, slice(int(cols[0]), int(cols[-1]) + 1)
            if fused and adapter.layers[layer].sliding_window is None:
                out, a, b = _fused_call(adapter, layer, q, k, v, inputs.pop(layer), rows, span, head_len)
            else:
                a, b = _score_call(adapter, layer, q, k, v, inputs.pop(layer), rows, cols, keys, block)
            kvzip[layer][:, span.start - head_len : span.stop - head_len] = a.float().cpu()
            plus[layer][:, span.start - head_len : span.stop - head_len] = b.float().cpu()
            if layer == adapter.num_layers - 1:
                raise _PassDone  # the last layer's attention output and MLP only feed logits, which nothing reads
            return out

        positions = torch.arange(total, total + len(ids), device=device)[None]
        try:
            with attention_inputs(adapter, inputs), attention_calls(adapter, on_call):
                adapter.decoder(
                    input_ids=torch.tensor([ids], device=device),
                    past_key_values=cache,
                    position_ids=positions,
                    use_cache=True,
                )
        except _PassDone:
            pass
        cache.crop(total)
        if progress is not None:
            progress(len(chunk))
    return [LayerScores(a, b, None) for a, b in zip(kvzip, plus, strict=True)]
