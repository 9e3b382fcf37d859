"""Extraction: (attention input, log KVzip+ score) pairs for surrogate training, in resumable shards.

Per document: one forward pass over the repeat prompt (the model keeps its sdpa attention; scores are
computed from the captured q, k, v in row blocks), then ``samples_per_doc`` random context positions (None:
every position; the scores cost the same either way), the same for every layer, are stored as hidden states
per layer and log KVzip+ per layer and KV head.
Documents stream into shards of whole, consecutive documents (``data/shards.py``). A run resumes from
its finished shards; a shard found missing or damaged is redone from its documents and comes out the
same, so re-running a finished run repairs it. Documents that are empty or whose repeat prompt exceeds
the model's positions are skipped and counted (not chunked: chunking would change the target's softmax).

Across jobs (``extract.num_shards`` = n, ``extract.shard_index`` = k): job k extracts the k-th of n
contiguous blocks of the document list into its own run folder (documents keep their global index, so
positions and rows do not depend on the split); the merge (:func:`merge_parts`, ``shard_index`` null)
links the parts' shards into one run folder and writes one manifest. Shards are named by their first
document, so names never collide, and the merged rows are the single job's rows in the same order.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvresearch.capture import oracle_scores
from kvresearch.data.corpus import Document
from kvresearch.data.shards import ShardWriter, check_shard, finished_shards
from kvresearch.errors import KVResearchError
from kvresearch.models.adapter import ModelAdapter
from kvresearch.progress import Progress
from kvresearch.prompts import KVZIP_REPEAT, repeat_prompt, template_pieces
from kvresearch.runs import read_json, write_json

LOG_FLOOR = 1e-30  # scores that underflow to 0 are clamped here before the log (counted in metrics)
FORMAT = "kvresearch-extract-v2"
OTHER_JOB = "other_job"  # a part run's status for the documents another job extracts


def sample_positions(n_context: int, n_samples: int | None, seed: int, doc_index: int) -> torch.Tensor:
    """Sorted random context offsets, a pure function of (seed, document index) so resumes agree (None: all)."""
    if n_samples is None:
        return torch.arange(n_context)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + doc_index)
    return torch.randperm(n_context, generator=generator)[: min(n_samples, n_context)].sort().values


def prompt_overhead(tokenizer: Any) -> int:
    """Tokens of the repeat prompt besides the two copies of the document."""
    pieces = template_pieces(tokenizer)
    return len(pieces.head) + len(tokenizer(KVZIP_REPEAT, add_special_tokens=False).input_ids) + len(pieces.middle)


@dataclass
class Settings:
    """The ``extract`` config group."""

    samples_per_doc: int | None  # None: every context position
    hidden_dtype: str
    rows_per_shard: int
    block: int
    seed: int
    max_context: int

    @classmethod
    def from_config(cls, extract: Mapping[str, Any], seed: int, max_context: int) -> Settings:
        """From the ``extract`` group, the run's seed and the model's positions."""
        return cls(
            None if extract["samples_per_doc"] is None else int(extract["samples_per_doc"]),
            str(extract["hidden_dtype"]),
            int(extract["rows_per_shard"]),
            int(extract["block"]),
            int(seed),
            int(max_context),
        )


def extract(
    adapter: ModelAdapter, tokenizer: Any, docs: list[Document], out_dir: Path, s: Settings, part: range | None = None
) -> dict[str, Any]:
    """Extract every document (of ``part``, None: all) not yet in a finished shard; return the run's counts."""
    pieces = template_pieces(tokenizer)
    overhead = prompt_overhead(tokenizer)
    shard_root = out_dir / "shards"
    done_docs = {d for meta in finished_shards(shard_root, full=True, repair=True) for d in meta["documents"]}
    writer = ShardWriter(shard_root, s.hidden_dtype, s.rows_per_shard)
    part = range(len(docs)) if part is None else part
    status: dict[int, str] = dict.fromkeys(done_docs, "done")
    status |= {i: OTHER_JOB for i in range(len(docs)) if i not in part}
    tokens = clamped = extracted = 0
    start = time.perf_counter()
    bar = Progress(len(part), "extract", unit="doc")
    bar.update(len(done_docs))
    for index, doc in enumerate(docs):
        if index in done_docs or index not in part:
            writer.flush()  # a shard never spans a document that another shard (or job) holds
            continue
        ids = tokenizer(doc.text, add_special_tokens=False).input_ids
        if not ids:
            status[index] = "skipped_empty"
        elif 2 * len(ids) + overhead > s.max_context:
            status[index] = "skipped_long"
        else:
            positions = sample_positions(len(ids), s.samples_per_doc, s.seed, index)
            prompt = repeat_prompt(tokenizer, ids, pieces)
            layers = oracle_scores(adapter, prompt, keep_hidden=positions, block=s.block)
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
    return {"status": status, "extracted": extracted, "tokens": tokens, "clamped": clamped, "elapsed": elapsed}


def document_rows(docs: list[Document], status: dict[int, str]) -> list[dict[str, Any]]:
    """The manifest's documents: index, id, source, split, tokens and what became of each."""
    return [
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


def write_manifest(
    out_dir: Path,
    documents: list[dict[str, Any]],
    counts: dict[str, Any],
    model: str,
    layout: dict[str, Any],
    corpus: dict[str, Any],
) -> dict[str, Any]:
    """Write the run's manifest.json (model, layout, corpus, documents, shards); return the run's metrics."""
    shards = finished_shards(out_dir / "shards")
    tally = Counter(d["status"] for d in documents)
    if tally["done"] == 0:
        why = {
            "skipped_long": "too long to fit model.max_context once repeated (raise model.max_context, or cut "
            "the documents shorter with corpus.max_tokens)",
            "skipped_empty": "empty after tokenization (check the corpus's text field)",
            "missing": "not reached (the run stopped, or another part holds them)",
            OTHER_JOB: "extracted by another part (extract.shard_index)",
        }
        reasons = "; ".join(f"{n} {why.get(k, k)}" for k, n in sorted(tally.items()))
        raise KVResearchError(f"No document was extracted. Of {len(documents)} documents: {reasons}.")
    rows = sum(m["rows"] for m in shards)
    manifest = {
        "format": FORMAT,
        "model": model,
        "layout": layout,
        "target": "log(KVzip+), single-pass repeat prompt, rows = repeated copy, softmax over all visible keys",
        "corpus": corpus,
        "documents": documents,
        "shards": [{"name": m["name"], "rows": m["rows"], "documents": m["documents"]} for m in shards],
        "rows": rows,
    }
    write_json(out_dir / "manifest.json", manifest)
    splits = Counter(d["split"] for d in documents if d["status"] == "done")
    return {
        "documents_done": tally["done"],
        "documents_train": splits["train"],
        "documents_test": splits["test"],
        "skipped_empty": tally["skipped_empty"],
        "skipped_long": tally["skipped_long"],
        "extracted_this_run": counts["extracted"],
        "samples": rows,
        "shards": len(shards),
        "bytes": sum(f.stat().st_size for f in (out_dir / "shards").rglob("*.npy")),
        "tokens_this_run": counts["tokens"],
        # null, not NaN (which strict JSON readers reject), when this run extracted nothing (a merge, a re-run)
        "tokens_per_s": counts["tokens"] / counts["elapsed"] if counts["extracted"] else None,
        "clamped_scores": counts["clamped"],
    }


def _link_shard(source: Path, target: Path) -> None:
    """``target`` as a copy of the finished shard ``source``: hard links (a copy across file systems), renamed in."""
    if target.is_dir():
        try:
            check_shard(target)
            return
        except KVResearchError:
            shutil.rmtree(target)
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in source.iterdir():
        try:
            os.link(file, tmp / file.name)
        except OSError:
            shutil.copy2(file, tmp / file.name)
    os.replace(tmp, target)


def merge_parts(out_dir: Path, parts: list[Path]) -> dict[str, Any]:
    """One run from finished part runs: their shards linked into ``out_dir/shards``, one manifest; the metrics."""
    fix = "Re-run that part (the same command with its extract.shard_index): it repairs itself."
    manifests = [read_json(p / "manifest.json", fix) for p in parts]
    first = manifests[0]
    status: dict[int, str] = {}
    for part, manifest in zip(parts, manifests, strict=True):
        for key in ("model", "layout", "corpus"):
            if manifest[key] != first[key]:
                raise KVResearchError(
                    f"The extract parts differ in {key}: {part} has {manifest[key]}, {parts[0]} has {first[key]}. "
                    "Merge parts of one sweep only (the same overrides but extract.shard_index)."
                )
        if [d["doc_id"] for d in manifest["documents"]] != [d["doc_id"] for d in first["documents"]]:
            raise KVResearchError(f"{part} lists other documents than {parts[0]}: not parts of one extract run.")
        for d in manifest["documents"]:
            if d["status"] != OTHER_JOB:
                if d["index"] in status:
                    raise KVResearchError(f"Document {d['index']} was extracted by two parts (one is {part}).")
                status[d["index"]] = d["status"]
        for shard in manifest["shards"]:
            _link_shard(part / "shards" / shard["name"], out_dir / "shards" / shard["name"])
    documents = [{**d, "status": status.get(d["index"], "missing")} for d in first["documents"]]
    clamped = sum(int(read_json(p / "metrics.json", fix).get("clamped_scores", 0)) for p in parts)
    counts = {"extracted": 0, "tokens": 0, "clamped": clamped, "elapsed": 0.0}
    metrics = write_manifest(out_dir, documents, counts, first["model"], first["layout"], first["corpus"])
    return {**metrics, "merged_parts": [str(p) for p in parts]}


def verify(out_dir: Path) -> None:
    """Raise naming what is wrong if a finished extract run lacks a shard or holds a damaged one."""
    manifest = read_json(out_dir / "manifest.json", "Re-run extract: it rebuilds the manifest from its shards.")
    shards = {m["name"]: m for m in finished_shards(out_dir / "shards", full=True)}
    for entry in manifest.get("shards", []):
        if entry["name"] not in shards:
            raise KVResearchError(f"Shard {out_dir / 'shards' / entry['name']} is missing.")
