"""Evaluation: one method over a benchmark's samples, resumable, with fidelity to the full cache.

Protocol: each sample's context is compressed once (``method.compress``) and each of its questions is
answered greedily from its own copy of the compressed cache (query-agnostic, as KVzip and Attention
Matching evaluate); ``query_aware`` compresses context + question instead, once per question.

Every answer appends one line to the run's ``predictions.jsonl`` as it goes; a killed run resumes after
its last valid line, and a damaged line is named and redone (:class:`Predictions`).

Sampled answers (``evaluate.sampling``): ``n`` per question, the record's score is their mean (pass@1),
each kept under ``samples``; fidelity is measured on greedy answers only.

Fidelity: the full cache's greedy answer to the same question comes from a finished ``method=full``
evaluate run, found by path (the run with this run's overrides but the method, see
:func:`kvresearch.runs.resolve.full_cache_run`) and checked to match this run's model, benchmark and
prompts; answers it lacks are computed here. Per answer: exact agreement with the full-cache answer and the
mean negative log-likelihood of that answer under the compressed cache (the Attention Matching paper's metric).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvresearch.answering import Answer, Settings, check_lengths, prompts_of, respond
from kvresearch.benchmarks.metrics import METRICS
from kvresearch.benchmarks.sample import Question, Sample
from kvresearch.errors import KVResearchError
from kvresearch.methods.base import FullCache, Method
from kvresearch.models.cache import RaggedCache
from kvresearch.models.session import Session
from kvresearch.progress import Progress
from kvresearch.prompts import Prompt
from kvresearch.runs import is_done, outputs_root, read_json, repo_root, write_atomic
from kvresearch.runs import records as run_records
from kvresearch.tracking import Tracker

ANSWER_GROUPS = ("model", "benchmark", "evaluate")  # what a full-cache answer depends on
SHARD_KEYS = ("evaluate.shard_index", "evaluate.num_shards")  # how the samples were split: not what answers depend on
TABLE_COLUMNS = ("id", "task", "prediction", "answer", "score", "prune_ratio", "agrees_with_full", "full_answer_nll")
REQUIRED = ("id", "group", "task", "prediction", "score", "answer_ids", "prompt_sha1", "prune_ratio")


def mode(question: Question, settings: Settings) -> str:
    """How the question is answered: ``generate``, or ``loglikelihood`` for a scored choice question."""
    return settings.choices if question.choices else "generate"


def prompt_sha1(prompt: Prompt, max_new_tokens: int, how: str = "generate") -> str:
    """A hash of what a full-cache answer depends on: the ids, the generation length, the answer mode."""
    extra = [] if how == "generate" else [how]
    payload = json.dumps([prompt.context_ids.tolist(), prompt.question_ids.tolist(), max_new_tokens, *extra])
    return hashlib.sha1(payload.encode()).hexdigest()


class Predictions:
    """A run's ``predictions.jsonl``: appended as answers come, read back keeping every valid line."""

    def __init__(self, path: Path, required: tuple[str, ...] = REQUIRED):
        """Bind to ``path`` (created on the first append); a line lacking a ``required`` field is damaged."""
        self.path, self.required = path, required

    def load(self) -> dict[str, dict[str, Any]]:
        """Valid records by id.

        Damaged lines (a killed run's torn last line, planted junk) are named and dropped, and the file is
        rewritten without them, so their answers are redone.
        """
        if not self.path.is_file():
            return {}
        records: dict[str, dict[str, Any]] = {}
        bad = []
        for number, line in enumerate(self.path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or any(key not in record for key in self.required):
                    raise ValueError(f"not a record (needs {', '.join(self.required)})")
            except ValueError as error:
                bad.append(f"line {number} ({str(error)[:80]})")
                continue
            records.setdefault(str(record["id"]), record)
        if bad:
            print(
                f"[kvresearch] {self.path}: dropped {len(bad)} damaged line(s), whose answers are redone: "
                + "; ".join(bad[:5]),
                flush=True,
            )
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in records.values()))
        return records

    def append(self, record: dict[str, Any]) -> None:
        """Add one record and flush it to disk."""
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


def reference_answers(folder: Path, expect: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Records of a finished full-cache run, after checking it was made under the same settings as ``expect``.

    From its run folder, else from its run record (:mod:`kvresearch.runs.records`).
    """
    fix = f"Re-run that method=full run with force=true, or set evaluate.reference_run to another run ({folder})."
    record = None if is_done(folder) else run_records.read(run_records.path_of(run_records.records_root(), folder))
    recorded = record["metrics"] if record is not None else read_json(folder / "metrics.json", fix)
    if (recorded.get("method") or {}).get("class") != "FullCache":
        raise KVResearchError(
            f"The reference run {folder} is not a full-cache run (method={recorded.get('method')}). {fix}"
        )
    if record is not None:  # a record's paths read <outputs>/... and <checkout>/...: compare ours the same way
        expect = run_records.portable(dict(expect), {"outputs": str(outputs_root()), "checkout": str(repo_root())})
    for key, value in expect.items():
        theirs = recorded.get(key) or {}
        differ = sorted(k for k in set(theirs) | set(value) if theirs.get(k) != value.get(k))
        if differ:
            shown = "; ".join(f"{key}.{k}: {theirs.get(k)!r} there, {value.get(k)!r} here" for k in differ[:4])
            raise KVResearchError(
                f"The reference run {folder} was made under other settings ({shown}): its answers are not this "
                f"run's full-cache answers. {fix}"
            )
    if record is not None:
        return {str(r["id"]): r for r in record["predictions"]}
    return Predictions(folder / "predictions.jsonl").load()


def prepare(session: Session, method: Method, held_out: list[Sample], settings: Settings) -> dict[str, Any]:
    """Let ``method`` prepare on ``held_out`` (the first question of each); what the run records.

    KVzap calibrates its threshold to its target prune ratio there.
    """
    prompts = [prompts_of(session.tokenizer, s, settings)[0] for s in held_out]
    result = method.prepare(session, prompts)
    if "threshold" in result:
        print(f"[kvresearch] {method.name}: threshold {result['threshold']:.4f} prunes {result['achieved']:.3f} of "
              f"{result['contexts']} held-out contexts (target {result['target']})", flush=True)  # fmt: skip
    return {"held_out": [s.key for s in held_out], **result}


def evaluate(
    session: Session,
    method: Method,
    samples: list[Sample],
    out_dir: Path,
    settings: Settings,
    reference: dict[str, dict[str, Any]] | None = None,
    tracker: Tracker | None = None,
) -> list[dict[str, Any]]:
    """Answer every question of ``samples`` with ``method``; return all records (resumed ones included)."""
    tokenizer = session.tokenizer
    prompts = [prompts_of(tokenizer, s, settings) for s in samples]
    check_lengths(samples, prompts, settings)
    predictions = Predictions(out_dir / "predictions.jsonl")
    done = predictions.load()
    bar = Progress(len(samples), f"evaluate {method.name}", unit="sample")
    n_answers, score_sum, prune_sum = 0, 0.0, 0.0  # over every answer so far: the running means on the bar
    for sample, sample_prompts in zip(samples, prompts, strict=True):
        todo = [i for i in range(len(sample.questions)) if sample.record_id(i) not in done]
        cache, compress_s = None, 0.0
        full: dict[str, RaggedCache] = {}  # the full cache, built once per context if the answers need it
        for i in todo:
            prompt, question = sample_prompts[i], sample.questions[i]
            if cache is None or settings.query_aware:
                start = time.perf_counter()
                cache = method.compress(session, prompt)
                cache.compact()  # as it is held: evicted entries gone, and out-of-window ones in sliding layers
                compress_s = time.perf_counter() - start
                full.clear()

            def full_cache(p: Prompt = prompt, built: dict[str, RaggedCache] = full) -> RaggedCache:
                if "cache" not in built:
                    built["cache"] = FullCache().compress(session, p)
                return built["cache"]

            decode = lambda c: method.decode_context(session, c)
            n = settings.sampling.n if mode(question, settings) == "generate" else 1
            answers = [respond(session, cache, prompt, question, settings, decode, j) for j in range(n)]
            answer, scores = answers[0], [score(sample, question, a) for a in answers]
            stats = cache.stats()
            record: dict[str, Any] = {
                "id": sample.record_id(i),
                "group": sample.group,
                "task": sample.task,
                "question": i,
                "prediction": answer.text,
                "answer": list(question.references),
                "score": sum(scores) / n,  # pass@1 over the n samples
                "answer_ids": answer.tokens,
                "prompt_sha1": prompt_sha1(
                    prompt, settings.new_tokens(question.max_new_tokens), mode(question, settings)
                ),
                "prompt_tokens": prompt.n_tokens,
                "compress_s": compress_s,
                "decode_s": answer.seconds,
                "new_tokens": len(answer.tokens),
                "prune_ratio": stats["prune_ratio"],
                "kv_bytes_dense": stats["kv_bytes"]["dense"],
                "kv_bytes_kept": stats["kv_bytes"]["kept"],
                "tags": question.tags,
                **answer.extra,
            }
            if n > 1:
                record["samples"] = [
                    {"prediction": a.text, "score": s, "new_tokens": len(a.tokens), **a.extra}
                    for a, s in zip(answers, scores, strict=True)
                ]
            if "acc_norm_choice" in answer.extra:
                record["acc_norm"] = float(answer.extra["acc_norm_choice"] in question.references)
            report = {k: v for k, v in method.report().items() if k != "per_layer_head"}
            if report:
                record["method_report"] = report
            if settings.fidelity and settings.sampling.greedy:  # fidelity compares greedy answers
                ref, source = _full_answer(session, method, full_cache, prompt, question, settings, record, reference)
                record["agrees_with_full"] = answer.tokens == ref
                record["full_answer_nll"] = full_answer_nll(session, method, cache, prompt, answer, ref)
                record["full_answer_from"] = source
            predictions.append(record)
            done[record["id"]] = record
            if tracker is not None:
                tracker.log({"score": record["score"], "prune_ratio": record["prune_ratio"]})
        answered = [done[sample.record_id(i)] for i in range(len(sample.questions))]
        n_answers += len(answered)
        score_sum += sum(float(r["score"]) for r in answered)
        prune_sum += sum(float(r["prune_ratio"]) for r in answered)
        bar.update(1, mean_score=f"{score_sum / n_answers:.3f}", mean_prune=f"{prune_sum / n_answers:.3f}")
    bar.close()
    wanted = {s.record_id(i) for s in samples for i in range(len(s.questions))}
    records = [r for rid, r in done.items() if rid in wanted]
    if tracker is not None:
        tracker.table("predictions", TABLE_COLUMNS, [[r.get(c) for c in TABLE_COLUMNS] for r in records])
    return records


def full_answer_nll(
    session: Session, method: Method, cache: RaggedCache, prompt: Prompt, answer: Answer, ref: list[int]
) -> float:
    """NLL per token of the full cache's answer ``ref`` under ``cache``.

    When the method's own answer is ``ref`` and the cache did not change while generating, that is the mean of
    the log-probabilities the generation already computed (the same quantity, one token at a time, so equal
    up to rounding); otherwise one teacher-forced pass over the question and ``ref``.
    """
    if answer.logprobs is not None and answer.tokens == ref and method.decoding is None:
        return -sum(answer.logprobs) / len(ref) if ref else float("nan")
    return session.answer_nll(cache, prompt.question_ids, ref)


def score(sample: Sample, question: Question, answer: Answer) -> float:
    """The answer's score: the benchmark's metric, or whether the chosen option is the right one."""
    if "option_logprobs" in answer.extra:
        return float(answer.text in question.references)
    options = {"options": len(question.choices)} if question.choices else {}
    return METRICS[sample.metric](answer.text, list(question.references), **sample.metric_options, **options)


def _full_answer(
    session: Session,
    method: Method,
    full_cache: Callable[[], RaggedCache],
    prompt: Prompt,
    question: Question,
    settings: Settings,
    record: dict[str, Any],
    reference: dict[str, dict[str, Any]] | None,
) -> tuple[list[int], str]:
    """The full-cache answer of this question and where it came from: this run, the reference run, or computed."""
    if method.lossless:
        return record["answer_ids"], "self"
    known = (reference or {}).get(record["id"])
    if known is not None:
        if known.get("prompt_sha1") != record["prompt_sha1"]:
            raise KVResearchError(
                f"The reference run's answer to {record['id']} was made from other prompt ids or another "
                "generation length than this run's: re-run the method=full run with force=true."
            )
        return list(known["answer_ids"]), "reference_run"
    return respond(session, full_cache(), prompt, question, settings).tokens, "computed"


def merge_predictions(out_dir: Path, parts: list[Path], expect: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict]:
    """The records of finished part runs in order, written to ``out_dir``'s predictions; the first part's metrics.

    Every part must have been made with the same method and the settings in ``expect`` (model, benchmark).
    """
    fix = "Re-run that part (the same command with its evaluate.shard_index), or merge parts of one sweep only."
    first = read_json(parts[0] / "metrics.json", fix)
    records: dict[str, dict[str, Any]] = {}
    for part in parts:
        metrics = read_json(part / "metrics.json", fix)
        for key, value in {**expect, "method": first["method"]}.items():
            if metrics.get(key) != value:
                raise KVResearchError(f"The evaluate part {part} was made with another {key} than this merge's. {fix}")
        for rid, record in Predictions(part / "predictions.jsonl").load().items():
            if rid in records:
                raise KVResearchError(f"Answer {rid} is in two evaluate parts (one is {part}): {fix}")
            records[rid] = record
    write_atomic(out_dir / "predictions.jsonl", "".join(json.dumps(r) + "\n" for r in records.values()))
    return list(records.values()), first


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Means overall, per group (``task@length``) and per tag value (difficulty, length bucket); scores x 100."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[r["group"]].append(r)

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
            "kv_bytes_peak_kept": mean(rows, "kv_bytes_peak_kept"),
            "decode_prune_ratio": mean(rows, "decode_prune_ratio"),
            "new_tokens": mean(rows, "new_tokens"),
            "compress_s": mean(rows, "compress_s"),
            "decode_s": mean(rows, "decode_s"),
            "prompt_tokens": mean(rows, "prompt_tokens"),
            **({"acc_norm": 100 * (mean(rows, "acc_norm") or 0.0)} if any("acc_norm" in r for r in rows) else {}),
        }

    sources: dict[str, int] = defaultdict(int)
    for r in records:
        sources[r.get("full_answer_from", "none")] += 1
    tagged: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for tag, value in (r.get("tags") or {}).items():
            tagged[tag][str(value)].append(r)
    return {
        "overall": block(records),
        "tasks": {group: block(rows) for group, rows in sorted(groups.items())},
        **(
            {"by_tag": {t: {v: block(rs) for v, rs in sorted(vs.items())} for t, vs in tagged.items()}}
            if tagged
            else {}
        ),
        "full_answers_from": dict(sources),
    }
