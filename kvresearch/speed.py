"""Per-sample evaluation time, side by side: the evaluate stage, kvpress's pipeline, transformers alone.

The harness of ``make bench-eval`` (``kvresearch/bench/eval.py``) and of the device check's ``eval`` step:
each side answers the same samples from the same token ids, taking turns on every sample after an untimed
warm-up, so that a slow spell of a shared machine falls on all of them; predictions are compared item by item.

* ``ours``: the evaluate stage's own loop (``evaluation.evaluate``) one sample at a time: its ``compress_s``
  (prefill and compression), ``decode_s`` (question and answer tokens) and the wall time of the whole call;
* ``kvpress``: kvpress's ``KVPressTextGenerationPipeline._forward`` on the same token ids (its prefill without
  the LM head, the press, its greedy loop): the wall time and the time in ``generate_answer``;
* ``floor``: transformers alone, a plain prefill (last logits only) into a ``DynamicCache``, then
  ``model.generate`` of the question and the answer from that cache;
* ``ours_fidelity``: the stage with ``evaluate.fidelity=true``, the full cache's records as its reference run.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvresearch.answering import Settings, prompts_of
from kvresearch.evaluation import evaluate
from kvresearch.models import Session
from kvresearch.models.presses import cache_positions


class KVpressPipeline:
    """kvpress's text-generation pipeline on token ids, with the time it spends in ``generate_answer``."""

    def __init__(self, session: Session):
        from kvpress import KVPressTextGenerationPipeline

        self.pipe = KVPressTextGenerationPipeline(model=session.model, tokenizer=session.tokenizer)
        self.adapter = session.adapter
        self.decode_s = 0.0
        generate = self.pipe.generate_answer

        def timed(*args: Any, **kwargs: Any) -> str:
            start = time.perf_counter()
            try:
                return str(generate(*args, **kwargs))
            finally:
                self.decode_s += time.perf_counter() - start

        self.pipe.generate_answer = timed

    def answer(self, context_ids: torch.Tensor, question_ids: torch.Tensor, press: Any, new_tokens: int) -> dict:
        """One sample: its answer, wall seconds and seconds in ``generate_answer``."""
        self.decode_s = 0.0
        start = time.perf_counter()
        with torch.no_grad(), cache_positions(self.adapter):  # kvpress 0.5.5 reads an argument gone in 5.17
            (text,) = self.pipe._forward(
                {"context_ids": context_ids, "questions_ids": [question_ids]}, max_new_tokens=new_tokens, press=press
            )
        wall = time.perf_counter() - start
        return {
            "prediction": text.strip(),
            "wall_s": wall,
            "decode_s": self.decode_s,
            "prefill_s": wall - self.decode_s,
        }


def floor(session: Session, context_ids: torch.Tensor, question_ids: torch.Tensor, new_tokens: int) -> dict:
    """Transformers alone: a plain prefill (last logits only), then ``generate`` from that cache."""
    model = session.model
    with torch.no_grad():
        start = time.perf_counter()
        cache = session.dense_prefill(context_ids).cache  # a DynamicCache, last logits only
        prefill = time.perf_counter() - start
        ids = torch.cat([context_ids, question_ids], dim=1)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=session.tokenizer.eos_token_id,
        )  # fmt: skip
        decode = time.perf_counter() - start - prefill
    text = session.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return {"prediction": text.strip(), "prefill_s": prefill, "decode_s": decode, "wall_s": prefill + decode}


def ours(session: Session, method: Any, sample: Any, settings: Settings, reference: dict | None = None) -> dict:
    """The evaluate stage's loop on one sample (a fresh predictions file): its timings, answer and record.

    ``reference``: the full-cache run's records by id, for ``evaluate.fidelity=true`` (as a reference run gives).
    """
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        (record,) = evaluate(session, method, [sample], Path(folder), settings, reference)
        wall = time.perf_counter() - start
    return {
        "prediction": str(record["prediction"]).strip(),
        "prefill_s": record["compress_s"],
        "decode_s": record["decode_s"],
        "wall_s": wall,
        "new_tokens": record["new_tokens"],
        "prune_ratio": record["prune_ratio"],
        "record": record,
    }


def turns(
    session: Session,
    pipeline: KVpressPipeline,
    method: Any,
    press: Any,
    samples: list[Any],
    settings: Settings,
    floor_too: bool = False,
    reference: dict | None = None,
) -> dict[str, list[dict]]:
    """Each side on every sample, taking turns (a slow spell of a shared machine falls on all), after a warm-up.

    ``floor_too``: transformers alone as a third side; ``reference`` (the full cache's records by id): the
    stage with ``evaluate.fidelity=true`` as a fourth (what the fidelity measures add).
    """
    prompts = [prompts_of(session.tokenizer, s, settings)[0] for s in samples]
    new_tokens = settings.new_tokens(samples[0].questions[0].max_new_tokens)
    sides = {
        "ours": lambda i: ours(session, method, samples[i], settings),
        "kvpress": lambda i: pipeline.answer(prompts[i].context_ids, prompts[i].question_ids, press, new_tokens),
    }
    if floor_too:
        sides["floor"] = lambda i: floor(session, prompts[i].context_ids, prompts[i].question_ids, new_tokens)
    if reference is not None:
        checked = dataclasses.replace(settings, fidelity=True)
        sides["ours_fidelity"] = lambda i: ours(session, method, samples[i], checked, reference)
    for answer in sides.values():
        answer(0)  # warm-up, untimed
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for i in range(len(samples)):
        for name, answer in sides.items():
            runs[name].append(answer(i))
    return runs


def mean(rows: list[dict], key: str) -> float:
    """The mean of ``key`` over ``rows``."""
    return statistics.fmean(float(r[key]) for r in rows)


def compare(name: str, length: int, runs: dict[str, list[dict]], extra: dict[str, Any]) -> dict[str, Any]:
    """One (method, length) row: per-sample means of each side, the speed-up and identical predictions."""
    row: dict[str, Any] = {"method": name, "tokens": length, **extra}
    for side, rows in runs.items():
        row[side] = {k: mean(rows, k) for k in ("prefill_s", "decode_s", "wall_s")}
        row[side]["predictions"] = [r["prediction"] for r in rows]
    mine, theirs = runs["ours"], runs["kvpress"]
    row["prune_ratio"] = mean(mine, "prune_ratio")
    row["new_tokens"] = mean(mine, "new_tokens")
    row["speedup_vs_kvpress"] = mean(theirs, "wall_s") / mean(mine, "wall_s")
    if "ours_fidelity" in runs:
        row["fidelity_extra_s"] = mean(runs["ours_fidelity"], "wall_s") - mean(mine, "wall_s")
    same = lambda other: sum(a["prediction"] == b["prediction"] for a, b in zip(mine, other, strict=True))
    row["identical_predictions"] = same(theirs)
    if "floor" in runs:
        row["identical_to_floor"] = same(runs["floor"])
        row["prefill_vs_floor"] = mean(mine, "prefill_s") / mean(runs["floor"], "prefill_s")
    row["samples"] = len(mine)
    return row
