"""A press of the catalog against kvpress itself, item by item: the pairs each head keeps, and the answer.

kvpress's side is its own code on a dense ``DynamicCache``: its prefill under the press, the masks it leaves,
and its pipeline's greedy answer. Our side is the method of the catalog's YAML: the ragged cache with real
eviction, and the evaluate stage's generation. A head matches when it holds the same (key, value) pairs, bit
for bit, whatever their order (``row_hashes`` of each pair, sorted). Bytes: what each side holds after the
prefill (kvpress's masked pairs stay in its cache), and the peak held while the press ran.

Presses that need a file get seeded placeholder files (:func:`placeholder_files`): they check the bridge,
not the press (no Q-Filters, Fast KVzip gates or LU-KV curves exist for the models here).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from kvresearch.models.cache import RaggedCache
from kvresearch.models.presses import attention_hooks, cache_positions, clear_masks, row_hashes
from kvresearch.models.session import Session

HeadHashes = list[list[torch.Tensor]]  # [layer][KV head] -> sorted (kept,) int64 hashes of the kept pairs


def placeholder_files(model: Any, folder: Path) -> dict[str, str]:
    """Seeded files in kvpress's formats for the presses that need one: the press field -> path."""
    from kvpress.presses.fastkvzip_press import FastKVzipGate
    from kvpress.presses.qfilter_press import QFilters

    config = model.config
    layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    torch.manual_seed(0)
    QFilters(layers, heads, dim).save_pretrained(folder / "qfilters")
    group = config.num_attention_heads // heads
    gates = [FastKVzipGate(i, config.hidden_size, heads, group, torch.float32).state_dict() for i in range(layers)]
    torch.save({"module": gates}, folder / f"q{group}_dim16_sink16.pt")
    curves = np.tile(np.linspace(0.01, 0.99, 99)[:, None, None], (1, layers, heads))  # uniform over layers/heads
    np.save(folder / "lukv_curves.npy", curves)
    restore_adapter(model, folder / "restorekv")
    return {
        "adapter": str(folder / "restorekv"),
        "filters": str(folder / "qfilters"),
        "gates_file": str(folder / f"q{group}_dim16_sink16.pt"),
        "curves": str(folder / "lukv_curves.npy"),
    }


def restore_adapter(model: Any, folder: Path, tokens: int = 8) -> None:
    """A seeded RestoreKV adapter for ``model`` in ``folder``: a LoRA adapter (q, v; nonzero) and restore embeddings."""
    import copy

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(copy.deepcopy(model), lora).save_pretrained(str(folder))
    embeddings = 0.02 * torch.randn(tokens, model.config.hidden_size, dtype=model.dtype)
    save_file({"restore_embeddings": embeddings}, str(folder / "restore_embeddings.safetensors"))


def reference(press: Any, ids: torch.Tensor, vocab: int) -> tuple[Any, torch.Tensor]:
    """The press and input kvpress runs for ``press``: FinchPress gets a delimiter (an unused id) before the window."""
    from kvpress import FinchPress

    from kvresearch.models.press_files import WindowFinchPress

    if not isinstance(press, WindowFinchPress):
        return press, ids
    free = sorted(set(range(vocab)) - set(ids[0].tolist()))[-1]
    theirs = FinchPress(press.compression_ratio, press.chunk_length, press.normalize_scores, press.rerotate_keys)
    theirs.delimiter_token_id = free
    cut = ids.shape[1] - min(press.window, ids.shape[1] - 1)
    return theirs, torch.cat([ids[:, :cut], torch.tensor([[free]]), ids[:, cut:]], dim=1)


@torch.no_grad()
def kvpress_kept(
    session: Session, ids: torch.Tensor, press: Any, attn: str | None
) -> tuple[HeadHashes, dict, DynamicCache]:
    """Kvpress prefills ``ids`` (1, T) under ``press``: each head's kept pairs, its bytes (held, peak), its cache."""
    model, dense, peak = session.model, DynamicCache(), [0]
    clear_masks(session.adapter)  # a mask left by an earlier run (kvpress's pipeline answer) is not this one's

    def observe(*_: Any) -> None:
        peak[0] = max(peak[0], sum(_bytes(e) for e in dense.layers))

    previous = model.config._attn_implementation
    if attn:
        model.set_attn_implementation(attn)
    try:
        with (
            cache_positions(session.adapter),
            attention_hooks(session.adapter, observe),  # before the press's hook: the layer still whole
            press(model),
            attention_hooks(session.adapter, observe),
        ):
            model(input_ids=ids, past_key_values=dense, use_cache=True, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    observe()
    out: HeadHashes = []
    for index, spec in enumerate(session.adapter.layers):
        entry = dense.layers[index]
        assert entry.keys is not None and entry.values is not None
        keep = torch.ones(entry.keys.shape[1:3], dtype=torch.bool)  # (Hkv, T)
        if getattr(spec.attn, "masked_key_indices", None) is not None:
            _, heads, positions = spec.attn.masked_key_indices
            keep[heads.cpu(), positions.cpu()] = False
            spec.attn.masked_key_indices = None
        pairs = torch.cat([entry.keys[0], entry.values[0]], dim=-1)  # (Hkv, T, 2d)
        out.append([row_hashes(pairs[h][keep[h]]).sort().values for h in range(len(pairs))])
    return out, {"kept_bytes": sum(_bytes(e) for e in dense.layers), "peak_bytes": peak[0]}, dense


@torch.no_grad()
def dense_answer(session: Session, cache: DynamicCache, start: int, question: torch.Tensor, new_tokens: int) -> str:
    """Greedy answer from kvpress's ``cache`` fed one token at a time from position ``start`` (no mask needed).

    For presses whose layers keep different lengths, which kvpress's pipeline decodes with flash attention only:
    a query of one token sees its layer's whole cache, so no mask is built. Stops at an end token, as kvpress.
    """
    tokens: list[int] = []
    feed = question[0].tolist()
    eos = session.eos_ids()
    for step in range(question.shape[1] + new_tokens - 1):
        token = feed[step] if step < len(feed) else tokens[-1]
        position = torch.tensor([[start + step]])
        logits = session.model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=position).logits
        if step >= len(feed) - 1:
            tokens.append(int(logits[0, -1].argmax()))
            if tokens[-1] in eos:
                tokens.pop()
                break
    return str(session.tokenizer.decode(tokens, skip_special_tokens=True)).strip()


def _bytes(entry: Any) -> int:
    return sum(t.numel() * t.element_size() for t in (entry.keys, entry.values) if t is not None)


def ours_kept(cache: RaggedCache) -> HeadHashes:
    """Each head's kept pairs in the ragged cache, as :func:`kvpress_kept` gives them."""
    out = []
    for layer in cache.ragged:
        rows = [layer.head_rows(h) for h in range(len(layer.caps))]
        out.append([row_hashes(torch.cat([layer.k[r], layer.v[r]], dim=-1)).sort().values for r in rows])
    return out


def same_heads(ours: HeadHashes, theirs: HeadHashes) -> tuple[int, int]:
    """(heads holding the same pairs on both sides, heads)."""
    pairs = [(a, b) for la, lb in zip(ours, theirs, strict=True) for a, b in zip(la, lb, strict=True)]
    return sum(torch.equal(a, b) for a, b in pairs), len(pairs)


def compare(session: Session, pipeline: Any, make: Any, by_pipeline: bool, prompt: Any, new: int) -> dict[str, Any]:
    """Both sides of one press on one prompt: heads with the same pairs, the answers, bytes, seconds.

    Args:
        session: the model.
        pipeline: kvpress's pipeline (``speed.KVpressPipeline``).
        make: builds a fresh method of the press (presses keep state).
        by_pipeline: kvpress's pipeline answers (False: its cache fed one token at a time, :func:`dense_answer`).
        prompt: the context and question.
        new: new tokens at most.
    """
    import kvpress

    ours = make()
    torch.manual_seed(0)  # the sketching presses draw at random: the same draws on both sides
    start = time.perf_counter()
    cache = ours.compress(session, prompt)
    ours_s = time.perf_counter() - start
    decode = lambda c: ours.decode_context(session, c)
    tokens = session.generate(cache, prompt.question_ids, new, decode_context=decode).tokens
    answer = str(session.tokenizer.decode(tokens, skip_special_tokens=True)).strip()

    press, ids = reference(make().press, prompt.context_ids, session.model.config.vocab_size)
    prefill = press.prefilling_press if isinstance(press, kvpress.PrefillDecodingPress) else press
    if isinstance(press, kvpress.DecodingPress):
        prefill = kvpress.StreamingLLMPress(compression_ratio=0.0)  # kvpress's pipeline: no press at the prefill
    torch.manual_seed(0)
    start = time.perf_counter()
    kept, held, dense = kvpress_kept(session, ids, prefill, ours.attn_implementation)
    kvpress_s = time.perf_counter() - start
    if by_pipeline:
        press, ids = reference(make().press, prompt.context_ids, session.model.config.vocab_size)
        previous = session.model.config._attn_implementation
        if ours.attn_implementation:
            session.model.set_attn_implementation(ours.attn_implementation)
        try:
            torch.manual_seed(0)
            theirs = pipeline.answer(ids, prompt.question_ids, press, new)["prediction"]
        finally:
            session.model.set_attn_implementation(previous)
    else:
        theirs = dense_answer(session, dense, prompt.context_ids.shape[1], prompt.question_ids, new)
    same, heads = same_heads(ours_kept(cache), kept)
    return {
        "heads_same": same, "heads": heads, "same_answer": answer == theirs, "answer": answer, "kvpress_answer": theirs,
        "prune_ratio": cache.stats()["prune_ratio"], "ours_kept_bytes": cache.kv_bytes()["kept"],
        "ours_peak_bytes": ours.report().get("peak_kv_bytes"), "kvpress_kept_bytes": held["kept_bytes"],
        "kvpress_peak_bytes": held["peak_bytes"], "ours_s": ours_s, "kvpress_s": kvpress_s,
    }  # fmt: skip
