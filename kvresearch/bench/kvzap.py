"""Benchmark: KVzap (MLP, linear) against the full cache and kvpress's DMSPress(KVzapPress), side by side.

On the embedded model with needle samples of ``--tokens`` context tokens (the RULER essay haystack):

(a) surrogate time as a share of prefill time; (b) peak and final KV bytes against the kept share;
(c) decode tokens/s over ``--new-tokens`` greedy tokens (no early stop); (d) greedy answers against
the full cache's; (e) kvpress with the same surrogate and threshold: same evicted pairs, and the memory
it keeps. Thresholds are calibrated per surrogate on the first sample to keep about ``--keep`` of the
entries. Writes ``outputs/bench/kvzap.json``.

    python -m kvresearch.bench.kvzap [--tokens 4096] [--keep 0.33] [--samples 3] [paths.surrogate_mlp=<run>]

The surrogates are those of the train_surrogate runs named in ``conf/paths/`` (override them as above).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvresearch.benchmarks.needle import needle_sample
from kvresearch.methods.base import FullCache
from kvresearch.methods.baselines import kvzap_press
from kvresearch.methods.kvzap import ThresholdPruner
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.models.presses import masked_pairs
from kvresearch.models.ragged_attention import ragged_attention_enabled
from kvresearch.prompts import build_prompt
from kvresearch.runs import outputs_root
from kvresearch.surrogate import Surrogate, from_run


class Timed:
    """Wraps a method to time prefill and record the peak allocated KV bytes after every layer call."""

    def __init__(self, method, chunk: int):
        self.method, self.chunk, self.peak = method, chunk, 0

    def compress(self, session, prompt):
        """The cache after the prefill with pruning attached."""
        cache = session.new_cache()
        ids = prompt.context_ids
        pruner = self.method if isinstance(self.method, ThresholdPruner) else None
        start = time.perf_counter()
        with ragged_attention_enabled(session.model), torch.no_grad():
            ctx = pruner.attach(session.adapter, cache) if pruner else _null()
            with ctx as timer:
                for s in range(0, ids.shape[1], self.chunk):
                    session.model(input_ids=ids[:, s : s + self.chunk], past_key_values=cache, use_cache=True)
                    self.peak = max(self.peak, cache.kv_bytes()["allocated"])
            cache.compact()  # the full cache too: final bytes = what is kept
        self.prefill_s = time.perf_counter() - start
        self.scoring_s = timer.seconds if pruner else 0.0
        return cache


class _null:
    seconds = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def calibrate(session, surrogate: Surrogate, prompt, keep: float, window: int) -> float:
    """The threshold that keeps ``keep`` of the entries outside the window on this prompt."""
    inputs = session.dense_prefill(prompt.context_ids, record_inputs=True).inputs
    with torch.no_grad():
        scores = torch.cat([surrogate.forward_layer(i, inputs[i][0, :-window]).flatten() for i in inputs])
    n = prompt.context_ids.shape[1]
    share_outside = (keep * n - window) / (n - window)
    return float(scores.quantile(1 - share_outside))


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--keep", type=float, default=0.33)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. paths.surrogate_mlp=<run folder or id>")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from hydra import compose, initialize_config_dir

    from kvresearch.runs import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=["model=smollm2_135m", *args.overrides])
    loaded = load_model(cfg.model)
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    samples = [needle_sample(loaded.tokenizer, args.tokens, d, seed=i) for i, d in enumerate([0.25, 0.5, 0.75])]
    samples = samples[: args.samples]
    prompts = [build_prompt(loaded.tokenizer, s["context"], s["question"], s["answer_prefix"]) for s in samples]

    surrogates: dict[str, Surrogate] = {
        kind: from_run(cfg.paths[f"surrogate_{kind}"], kind, cfg.model.name, cfg.paths.root)
        for kind in ("mlp", "linear")
    }
    taus = {kind: calibrate(session, s, prompts[0], args.keep, args.window) for kind, s in surrogates.items()}
    pruners = {f"kvzap_{k}": ThresholdPruner(s, taus[k], args.window) for k, s in surrogates.items()}
    methods = {"full": FullCache(), **pruners}

    rows = []
    for name, method in methods.items():
        for i, (sample, prompt) in enumerate(zip(samples, prompts, strict=True)):
            timed = Timed(method, args.chunk)
            cache = timed.compress(session, prompt)
            stats = cache.stats()
            answer_ids = session.generate(cache, prompt.question_ids, sample["max_new_tokens"]).tokens
            # decode speed: a fixed number of tokens, no early stop
            timed_decode = session.generate(cache, prompt.question_ids, args.new_tokens, eos=False)
            decode_ids, decode_s = timed_decode.tokens, timed_decode.seconds
            text = loaded.tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
            entry = cache.ragged[0].entry_bytes()
            rows.append(
                {
                    "method": name,
                    "sample": i,
                    "context_tokens": prompt.context_ids.shape[1],
                    "threshold": taus.get(name.removeprefix("kvzap_")),
                    "prune_ratio": round(stats["prune_ratio"], 4),
                    "prefill_s": round(timed.prefill_s, 3),
                    "surrogate_s": round(timed.scoring_s, 4),
                    "surrogate_share_of_prefill": round(timed.scoring_s / timed.prefill_s, 5),
                    "peak_kv_bytes": timed.peak,
                    "final_kv_bytes": stats["kv_bytes"]["allocated"],
                    "kept_entries_bytes": stats["tokens_kept"] * entry,
                    "dense_kv_bytes": stats["kv_bytes"]["dense"],
                    "decode_tokens_per_s": round(len(decode_ids) / decode_s, 2),
                    "answer": text,
                    "expected": sample["answer"][0],
                    "correct": sample["answer"][0] in text,
                }
            )
            print(
                {
                    k: rows[-1][k]
                    for k in (
                        "method",
                        "sample",
                        "prune_ratio",
                        "surrogate_share_of_prefill",
                        "final_kv_bytes",
                        "decode_tokens_per_s",
                        "answer",
                        "correct",
                    )
                },
                flush=True,
            )
    full_answers = {r["sample"]: r["answer"] for r in rows if r["method"] == "full"}
    for r in rows:
        r["same_answer_as_full"] = r["answer"] == full_answers[r["sample"]]

    # (e) kvpress DMSPress(KVzapPress) with the same surrogate and threshold, on the first sample.
    comparison = []
    for kind in ("mlp", "linear"):
        cache = KVzapOnly(surrogates[kind], taus[kind], args.window).run(session, prompts[0])
        ours = {
            (i, h, p)
            for i, layer in enumerate(cache.ragged)
            for h in range(session.adapter.num_kv_heads)
            for p in set(range(layer.seen)) - set(layer.head_positions(h).tolist())
        }
        press = kvzap_press(surrogates[kind], taus[kind], args.window)
        theirs, kvpress_bytes = masked_pairs(session, prompts[0].context_ids, press)
        comparison.append(
            {
                "surrogate": kind,
                "ours_evicted": len(ours),
                "kvpress_evicted": len(theirs),
                "same_evictions": ours == theirs,
                "symmetric_difference": len(ours ^ theirs),
                "ours_kv_bytes": cache.kv_bytes()["allocated"],
                "kvpress_kv_bytes": kvpress_bytes,
            }
        )
        print(comparison[-1], flush=True)
    out = outputs_root() / "bench" / "kvzap.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised, fp32)",
        "threads": args.threads,
        "tokens": args.tokens,
        "keep_target": args.keep,
        "window": args.window,
        "prefill_chunk": args.chunk,
        "new_tokens": args.new_tokens,
        "thresholds": taus,
        "surrogates": {kind: s.source for kind, s in surrogates.items()},
    }
    out.write_text(json.dumps({"settings": settings, "rows": rows, "kvpress": comparison}, indent=2) + "\n")
    print(f"wrote {out}")


class KVzapOnly:
    """One-pass prefill with the pruner (the setting in which kvpress's DMSPress also runs)."""

    def __init__(self, surrogate, tau, window):
        self.pruner = ThresholdPruner(surrogate, tau, window)

    def run(self, session, prompt):
        """One pruned prefill; the cache."""
        cache = session.new_cache()
        with ragged_attention_enabled(session.model), torch.no_grad(), self.pruner.attach(session.adapter, cache):
            session.model(input_ids=prompt.context_ids, past_key_values=cache, use_cache=True)
        return cache


if __name__ == "__main__":
    main()
