"""Stage ``evaluate``: one model x one method (with its threshold or ratio) x one benchmark.

``python -m kvresearch.stages.evaluate method=kvzap_mlp method.threshold=-4``; sweep with ``-m``.

Each context is compressed once and its question answered greedily from a copy of the cache (the
question is not compressed unless ``evaluate.query_aware``). Per sample: the prediction, the score, the
prune ratio, KV bytes and times go to ``predictions.jsonl`` (appended as it goes, so a killed run
resumes after its last complete line); fidelity to the full cache is measured against the full-cache
answer of the same sample (computed once per model and sample, kept under
``<out_root>/evaluate/_reference/``): exact agreement and the mean negative log-likelihood of that
answer under the compressed cache.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from kvresearch.benchmarks.loader import load_samples
from kvresearch.benchmarks.metrics import METRICS
from kvresearch.evaluation import answer, answer_logprob, compress
from kvresearch.generation import Prompt, build_prompt
from kvresearch.methods.base import FullCache, Session
from kvresearch.models import ModelAdapter, load_model
from kvresearch.progress import Progress
from kvresearch.runs import RunContext, stage_main, write_json


def make_prompt(tokenizer: Any, sample: dict[str, Any], query_aware: bool) -> Prompt:
    if not query_aware:
        return build_prompt(tokenizer, sample["context"], sample["question"], sample.get("answer_prefix", ""))
    # Query-aware: the question is part of what gets compressed; only the answer prefix follows.
    prompt = build_prompt(tokenizer, sample["context"] + "\n" + sample["question"], "", sample.get("answer_prefix", ""))
    return prompt


def read_done(path: Path) -> dict[str, dict[str, Any]]:
    """Complete lines of a predictions file; a torn last line (killed run) is dropped and rewritten."""
    if not path.is_file():
        return {}
    done, good = {}, []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        done[record["id"]] = record
        good.append(line)
    path.write_text("".join(g + "\n" for g in good))
    return done


def reference_answer(
    session: Session, prompt: Prompt, max_new_tokens: int, folder: Path, known: list[int] | None = None
) -> list[int]:
    """The full-cache greedy answer of this prompt, computed once (or ``known``) and kept on disk."""
    key = hashlib.sha1(
        json.dumps([prompt.context_ids.tolist(), prompt.question_ids.tolist(), max_new_tokens]).encode()
    ).hexdigest()
    path = folder / f"{key}.json"
    if path.is_file():
        return json.loads(path.read_text())["tokens"]
    if known is None:
        full = FullCache()
        cache, _ = compress(full, session, prompt)
        known, _ = answer(full, session, cache, prompt.question_ids, max_new_tokens)
    write_json(path, {"tokens": known})
    return known


def run(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    loaded = load_model(cfg.model)
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    method = instantiate(cfg.method)
    samples = load_samples(cfg.benchmark, loaded.tokenizer)
    if cfg.evaluate.max_samples:
        samples = samples[: int(cfg.evaluate.max_samples)]
    predictions = ctx.out_dir / "predictions.jsonl"
    done = read_done(predictions)
    reference_dir = Path(cfg.out_root) / "evaluate" / "_reference" / str(cfg.model.name)
    bar = Progress(len(samples), f"evaluate {getattr(method, 'name', 'method')}", unit="sample")
    bar.update(len(done))
    with predictions.open("a") as out:
        for sample in samples:
            if sample["id"] in done:
                continue
            prompt = make_prompt(loaded.tokenizer, sample, bool(cfg.evaluate.query_aware))
            max_new = int(sample.get("max_new_tokens", 32))
            if cfg.evaluate.max_new_tokens:
                max_new = min(max_new, int(cfg.evaluate.max_new_tokens))
            cache, compress_s = compress(method, session, prompt)
            tokens, decode_s = answer(method, session, cache, prompt.question_ids, max_new)
            text = loaded.tokenizer.decode(tokens, skip_special_tokens=True)
            record: dict[str, Any] = {
                "id": sample["id"],
                "task": sample["task"],
                "prediction": text,
                "answer": sample["answer"],
                "score": METRICS[sample["metric"]](text, sample["answer"]),
                "compress_s": compress_s,
                "decode_s": decode_s,
                "new_tokens": len(tokens),
                **_cache_numbers(cache.stats()),
            }
            report = getattr(method, "report", None)  # e.g. Attention Matching's held-out errors and timings
            if report:
                record["method_report"] = {k: v for k, v in report.items() if k != "per_layer_head"}
            if cfg.evaluate.fidelity:
                own = tokens if isinstance(method, FullCache) else None  # the full cache is its own reference
                ref = reference_answer(session, prompt, max_new, reference_dir, known=own)
                record["agrees_with_full"] = tokens == ref
                record["full_answer_nll"] = answer_logprob(session, cache, prompt.question_ids, ref)
            out.write(json.dumps(record) + "\n")
            out.flush()
            done[sample["id"]] = record
            ctx.tracker.log({"score": record["score"], "prune_ratio": record["prune_ratio"]})
            bar.update(1, score=f"{record['score']:.2f}")
    bar.close()
    return summarize(list(done.values()), getattr(method, "name", type(method).__name__), cfg)


def _cache_numbers(stats: dict[str, Any]) -> dict[str, Any]:
    return {
        "prune_ratio": stats["prune_ratio"],
        "kv_bytes_dense": stats["kv_bytes"]["dense"],
        "kv_bytes_kept": stats["kv_bytes"]["kept"],
    }


def summarize(records: list[dict[str, Any]], method: str, cfg: DictConfig) -> dict[str, Any]:
    """Per task (task@length) and overall means; scores x 100 like RULER."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[r["id"].split("#")[0]].append(r)

    def mean(rows: list[dict[str, Any]], key: str) -> float | None:
        values = [float(r[key]) for r in rows if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    def block(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "samples": len(rows),
            "score": 100 * (mean(rows, "score") or 0.0),
            "prune_ratio": mean(rows, "prune_ratio"),
            "agreement": mean(rows, "agrees_with_full"),
            "full_answer_nll": mean(rows, "full_answer_nll"),
            "kv_bytes_kept": mean(rows, "kv_bytes_kept"),
            "kv_bytes_dense": mean(rows, "kv_bytes_dense"),
            "compress_s": mean(rows, "compress_s"),
            "decode_s": mean(rows, "decode_s"),
        }

    method_cfg = cfg.method
    return {
        "model": str(cfg.model.name),
        "method": method,
        "benchmark": str(cfg.benchmark.name),
        "threshold": method_cfg.get("threshold"),
        "keep_ratio": method_cfg.get("keep_ratio"),
        "press_compression_ratio": (method_cfg.get("press") or {}).get("compression_ratio"),
        "query_aware": bool(cfg.evaluate.query_aware),
        "overall": block(records),
        "tasks": {task: block(rows) for task, rows in sorted(groups.items())},
    }


main = stage_main("evaluate", run)

if __name__ == "__main__":
    main()
