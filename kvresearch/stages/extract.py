"""Stage ``extract``: KVzip+ oracle targets for surrogate training (``kvresearch/extraction.py`` does the work).

``python -m kvresearch.stages.extract [model=...] [corpus=offline_english|benchmark_prose|nemotron_sample]``
(``make stage-extract``).
Re-running a finished run checks its shards and redoes any that are missing or damaged.

Across jobs: ``-m extract.num_shards=N extract.shard_index=0,...,N-1`` (one run folder per part, e.g. a
SLURM array), then ``extract.num_shards=N`` alone merges the parts (named like this run plus
``extract.shard_index=k``, or listed in ``extract.parts``) into one run that training reads.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from kvresearch.data.corpus import cap_documents, load_corpus
from kvresearch.errors import KVResearchError
from kvresearch.extraction import (
    Settings,
    document_rows,
    extract,
    merge_parts,
    prompt_overhead,
    verify,
    write_manifest,
)
from kvresearch.models import ModelAdapter, load_model
from kvresearch.runs import RunContext, stage_main
from kvresearch.sharding import merging, part_range, part_runs


def run(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """Load the model and corpus, extract what is not done yet (of this job's part), write the manifest.

    With ``num_shards`` > 1 and no ``shard_index``: merge the finished parts instead (no model needed).
    """
    if merging(cfg.extract.num_shards, cfg.extract.shard_index):
        parts = part_runs(ctx.out_dir, "extract", cfg.extract.num_shards, cfg.extract.parts, ctx.inputs)
        return merge_parts(ctx.out_dir, parts)
    loaded = load_model(cfg.model)
    adapter, tokenizer = ModelAdapter(loaded.model), loaded.tokenizer
    settings = Settings.from_config(cfg.extract, cfg.seed, cfg.model.max_context)
    need = 2 * cfg.corpus.min_tokens + prompt_overhead(tokenizer)
    if need > settings.max_context:
        raise KVResearchError(
            f"The repeat prompt of a {cfg.corpus.min_tokens}-token document needs {need} positions but "
            f"model.max_context is {settings.max_context}: lower corpus.min_tokens / corpus.max_tokens."
        )
    docs, corpus = load_corpus(cfg.corpus, tokenizer, cfg.seed)
    docs = cap_documents(docs, cfg.extract.max_docs)
    part = part_range(len(docs), int(cfg.extract.num_shards), int(cfg.extract.shard_index or 0), "extract")
    counts = extract(adapter, tokenizer, docs, ctx.out_dir, settings, part)
    layout: dict[str, Any] = {"layers": adapter.num_layers, "hidden": adapter.hidden_size}
    layout |= {"kv_heads": adapter.num_kv_heads, "hidden_dtype": settings.hidden_dtype}
    documents = document_rows(docs, counts["status"])
    return write_manifest(ctx.out_dir, documents, counts, loaded.name, layout, {"name": cfg.corpus.name, **corpus})


main = stage_main("extract", run, verify)

if __name__ == "__main__":
    main()
