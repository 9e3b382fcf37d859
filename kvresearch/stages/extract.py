"""Stage ``extract``: KVzip+ oracle targets for surrogate training (``kvresearch/extraction.py`` does the work).

``python -m kvresearch.stages.extract [model=...] [corpus=offline_english|nemotron_sample]`` (``make extract``).
Re-running a finished run checks its shards and redoes any that are missing or damaged.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from kvresearch.data.corpus import load_corpus
from kvresearch.errors import KVResearchError
from kvresearch.extraction import Settings, cap_documents, extract, prompt_overhead, verify, write_manifest
from kvresearch.models import ModelAdapter, load_model
from kvresearch.runs import RunContext, stage_main


def run(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """Load the model and corpus, extract what is not done yet, write the manifest."""
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
    counts = extract(adapter, tokenizer, docs, ctx.out_dir, settings)
    layout: dict[str, Any] = {"layers": adapter.num_layers, "hidden": adapter.hidden_size}
    layout |= {"kv_heads": adapter.num_kv_heads, "hidden_dtype": settings.hidden_dtype}
    return write_manifest(ctx.out_dir, docs, counts, loaded.name, layout, {"name": cfg.corpus.name, **corpus})


main = stage_main("extract", run, verify)

if __name__ == "__main__":
    main()
