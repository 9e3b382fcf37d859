"""Stage ``extract``: (attention input, log KVzip+ score) pairs for surrogate training.

``python -m kvresearch.stages.extract [model=...] [corpus=offline_english|nemotron_sample]`` (``make extract``)

Per document: one forward pass over the repeat prompt (the model keeps its sdpa attention; scores are
computed from the captured q, k, v in row blocks), then ``samples_per_doc`` random context positions,
the same for every layer, are stored as hidden states per layer and log KVzip+ per layer and KV head.
Documents stream into shards (see ``kvresearch/data/shards.py``); a killed run resumes after its last
finished shard. Documents that are empty or whose repeat prompt exceeds ``model.max_context`` are
skipped and counted (not chunked: chunking would change the training target's softmax).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from kvresearch.capture import FIRST_INSTRUCTION, oracle_scores, repeat_prompt, template_pieces
from kvresearch.data.corpus import Document, nemotron_sample, offline_english, select
from kvresearch.data.shards import ShardWriter, finished_shards
from kvresearch.errors import KVResearchError
from kvresearch.models import ModelAdapter, load_model
from kvresearch.progress import Progress
from kvresearch.runs import RunContext, stage_main, write_json

LOG_FLOOR = 1e-30  # scores that underflow to 0 are clamped here before the log (counted in metrics)


def load_documents(cfg: DictConfig, tokenizer: Any) -> tuple[list[Document], dict[str, Any]]:
    c = cfg.corpus
    if c.name == "offline_english":
        docs, stats = offline_english(tokenizer, c.min_tokens, c.max_tokens, c.test_fraction, cfg.seed)
    elif c.name == "nemotron_sample":
        docs, stats = nemotron_sample(
            tokenizer, c.min_tokens, c.max_tokens, c.n_train_per_source, c.n_test_per_source, c.subsets, c.data_dir
        )
    else:
        raise KVResearchError(f"Unknown corpus.name '{c.name}': use corpus=offline_english or corpus=nemotron_sample.")
    chosen = select(docs, c.n_train_per_source, c.n_test_per_source, cfg.seed)
    summary = {
        "available": stats.kept,
        "skipped_empty": stats.skipped_empty,
        "skipped_short": stats.skipped_short,
        "skipped_long": stats.skipped_long,
    }
    return chosen, summary


def sample_positions(n_context: int, n_samples: int, seed: int, doc_index: int) -> torch.Tensor:
    """Sorted random context offsets, a pure function of (seed, document index) so resumes agree."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + doc_index)
    return torch.randperm(n_context, generator=generator)[: min(n_samples, n_context)].sort().values


def run(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    loaded = load_model(cfg.model)
    adapter, tokenizer = ModelAdapter(loaded.model), loaded.tokenizer
    pieces = template_pieces(tokenizer)
    overhead = len(pieces.head) + len(tokenizer(FIRST_INSTRUCTION, add_special_tokens=False).input_ids)
    overhead += len(pieces.middle)
    max_context = int(cfg.model.max_context)
    if 2 * cfg.corpus.min_tokens + overhead > max_context:
        need = 2 * cfg.corpus.min_tokens + overhead
        raise KVResearchError(
            f"The repeat prompt of a {cfg.corpus.min_tokens}-token document needs {need} positions but "
            f"model.max_context is {max_context}: lower corpus.min_tokens / corpus.max_tokens."
        )
    docs, corpus_stats = load_documents(cfg, tokenizer)
    shard_root = ctx.out_dir / "shards"
    finished = finished_shards(shard_root)
    done_docs = {d for meta in finished for d in meta["documents"]}
    writer = ShardWriter(
        shard_root,
        cfg.extract.hidden_dtype,
        cfg.extract.rows_per_shard,
        next_index=1 + max((m["index"] for m in finished), default=-1),
    )
    status: dict[int, str] = {i: "done" for i in done_docs}
    tokens = clamped = extracted = 0
    start = time.perf_counter()
    bar = Progress(len(docs), "extract", unit="doc")
    bar.update(len(done_docs))
    for index, doc in enumerate(docs):
        if index in done_docs:
            continue
        ids = tokenizer(doc.text, add_special_tokens=False).input_ids
        if not ids:
            status[index] = "skipped_empty"
        elif 2 * len(ids) + overhead > max_context:
            status[index] = "skipped_long"
        else:
            positions = sample_positions(len(ids), cfg.extract.samples_per_doc, cfg.seed, index)
            prompt = repeat_prompt(tokenizer, ids, pieces)
            layers = oracle_scores(adapter, prompt, keep_hidden=positions, block=cfg.extract.block)
            plus = torch.stack([layer.kvzip_plus[:, positions].T for layer in layers], dim=1)  # (n, L, Hkv)
            clamped += int((plus < LOG_FLOOR).sum())
            hidden = torch.stack([layer.hidden for layer in layers if layer.hidden is not None], dim=1)  # (n, L, D)
            writer.add(index, positions, hidden.cpu(), plus.clamp_min(LOG_FLOOR).log().cpu())
            status[index] = "done"
            tokens += prompt.input_ids.shape[1]
            extracted += 1
        bar.update(1, tok_per_s=f"{tokens / max(time.perf_counter() - start, 1e-9):.0f}")
    writer.flush()
    bar.close()
    elapsed = time.perf_counter() - start

    shards = finished_shards(shard_root)
    counts = Counter(status.values())
    if counts["done"] == 0:
        raise KVResearchError(f"No document was extracted ({dict(counts)}); check the corpus config.")
    documents = [
        {
            "index": i,
            "doc_id": d.doc_id,
            "source": d.source,
            "split": d.split,
            "n_tokens": d.n_tokens,
            "status": status.get(i, "missing"),
        }
        for i, d in enumerate(docs)
    ]
    rows = sum(m["rows"] for m in shards)
    manifest = {
        "format": "kvresearch-extract-v1",
        "model": loaded.name,
        "layout": {
            "layers": adapter.num_layers,
            "hidden": adapter.hidden_size,
            "kv_heads": adapter.num_kv_heads,
            "hidden_dtype": cfg.extract.hidden_dtype,
        },
        "target": "log(KVzip+), single-pass repeat prompt, rows = repeated copy, softmax over all visible keys",
        "corpus": {"name": cfg.corpus.name, **corpus_stats},
        "documents": documents,
        "shards": [{"name": f"shard-{m['index']:05d}", "rows": m["rows"], "documents": m["documents"]} for m in shards],
        "rows": rows,
    }
    write_json(ctx.out_dir / "manifest.json", manifest)
    splits = Counter(d["split"] for d in documents if d["status"] == "done")
    return {
        "documents_done": counts["done"],
        "documents_train": splits["train"],
        "documents_test": splits["test"],
        "skipped_empty": counts["skipped_empty"],
        "skipped_long": counts["skipped_long"],
        "extracted_this_run": extracted,
        "samples": rows,
        "shards": len(shards),
        "bytes": sum(f.stat().st_size for f in Path(shard_root).rglob("*.npy")),
        "tokens_this_run": tokens,
        "tokens_per_s": tokens / elapsed if extracted else math.nan,
        "clamped_scores": clamped,
    }


main = stage_main("extract", run)

if __name__ == "__main__":
    main()
