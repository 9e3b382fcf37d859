"""Benchmark: the evaluate stage against kvpress's own pipeline, per sample, on the same RULER samples.

For each ``--lengths`` (RULER ``niah_single_2``, ``--samples`` samples, the embedded model, ``--threads``
threads) and each method, after an untimed warm-up of each side on the first sample, the sides take turns
on every sample (so that a slow spell of a shared machine falls on all of them):

* ``ours``: the evaluate stage's own loop (``evaluation.evaluate``, ``evaluate.fidelity=false``) one
  sample at a time: its ``compress_s`` (prefill and compression), ``decode_s`` (question and answer
  tokens) and the wall time of the whole call (prompts, copies, records and all);
* ``kvpress``: kvpress's ``KVPressTextGenerationPipeline._forward`` on the same token ids (its prefill
  without the LM head, the press, its greedy loop): the wall time and the time in ``generate_answer``;
* ``floor`` (``full`` only): transformers alone, ``model(context, logits_to_keep=1)`` into a
  ``DynamicCache``, then ``model.generate`` of the question and the answer from that cache;
* ``ours_fidelity`` (every method but ``full``): the stage with ``evaluate.fidelity=true``, the full run's
  answers as its reference run (agreement and the NLL of the full answer): what the fidelity measures add.

Methods: ``full``; kvpress's SnapKV, TOVA and StreamingLLM at ``--keep`` (ours evicts, kvpress masks);
KVzap-MLP by threshold against kvpress's ``DMSPress(KVzapPress)`` with the same surrogate and threshold
(the surrogate of ``paths.surrogate_mlp`` when that run exists, else a seeded untrained one, said in the
JSON; the threshold keeps ``--keep`` of the first sample). Predictions are compared item by item.
Writes ``outputs/bench/eval.json``; the summary is in docs/benchmarks.md.

    python -m kvresearch.bench.eval [--lengths 2048 4096] [--samples 5] [--methods full snapkv ...] [--keep 0.5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from transformers import DynamicCache

from kvresearch.answering import Settings, prompts_of
from kvresearch.benchmarks.loader import load_samples
from kvresearch.errors import KVResearchError
from kvresearch.evaluation import evaluate
from kvresearch.methods.baselines import kvzap_press
from kvresearch.methods.kvzap import KVzap
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.runs import CONF_DIR, build, outputs_root, write_json
from kvresearch.surrogate import from_run
from kvresearch.surrogate.modules import Surrogate, SurrogateConfig

PRESSES = ("snapkv", "tova", "streaming_llm")


def config(overrides: list[str]) -> Any:
    """The evaluate config with ``overrides``."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides)


def surrogate(cfg: Any, session: Session) -> tuple[Surrogate, str]:
    """The MLP surrogate of ``paths.surrogate_mlp`` if that run exists, else a seeded untrained one; its source."""
    try:
        return from_run(str(cfg.paths.surrogate_mlp), "mlp", str(cfg.model.name), str(cfg.paths.root)), "trained"
    except KVResearchError:
        a = session.adapter
        torch.manual_seed(0)
        shape = SurrogateConfig("mlp", a.num_layers, a.hidden_size, a.num_kv_heads, model=str(cfg.model.name))
        return Surrogate(shape), "untrained (seed 0): no train_surrogate run here"


class KVpressPipeline:
    """kvpress's text-generation pipeline on token ids, with the time it spends in ``generate_answer``."""

    def __init__(self, session: Session):
        from kvpress import KVPressTextGenerationPipeline

        self.pipe = KVPressTextGenerationPipeline(model=session.model, tokenizer=session.tokenizer)
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
        with torch.no_grad():
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
        cache = DynamicCache()
        model(input_ids=context_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
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
    for side in sides.values():
        side(0)  # warm-up, untimed
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for i in range(len(samples)):
        for side, answer in sides.items():
            runs[side].append(answer(i))
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
    row["samples"] = len(mine)
    return row


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--methods", nargs="+", default=["full", *PRESSES, "kvzap_mlp"])
    parser.add_argument("--keep", type=float, default=0.5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    fidelity = "also time the stage with evaluate.fidelity=true (the full run's answers as its reference)"
    parser.add_argument("--fidelity", action=argparse.BooleanOptionalAction, default=True, help=fidelity)
    parser.add_argument("--out", type=Path, default=None, help="default: <outputs>/bench/eval.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = ["benchmark=ruler", "benchmark.tasks=[niah_single_2]", f"benchmark.samples_per_task={args.samples}"]
    cfg = config(base)
    loaded = load_model(cfg.model)
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    settings = Settings(fidelity=False, max_new_tokens=args.new_tokens)
    pipeline = KVpressPipeline(session)
    scorer, source = surrogate(cfg, session)
    rows = []
    for length in args.lengths:
        samples = load_samples(config([*base, f"benchmark.lengths=[{length}]"]).benchmark, loaded.tokenizer)
        first = prompts_of(loaded.tokenizer, samples[0], settings)[:1]
        references: dict[str, dict] = {}
        for name in args.methods:
            extra: dict[str, Any] = {}
            if name == "kvzap_mlp":
                tuned = KVzap(surrogate=scorer, keep_ratio=args.keep, threshold=None, calibrate=True)
                tau = tuned.fit_threshold(session, first).threshold
                method, press = KVzap(surrogate=scorer, threshold=tau), kvzap_press(scorer, tau)
                extra = {"threshold": tau, "surrogate": source}
            else:
                keep = [] if name == "full" else [f"method.keep_ratio={args.keep}"]
                method = build(config([*base, f"method={name}", *keep]).method)
                press = None if name == "full" else build(config([*base, f"method={name}", *keep]).method).press
            checked = references if args.fidelity and name != "full" and references else None
            runs = turns(session, pipeline, method, press, samples, settings, name == "full", checked)
            if name == "full":
                references = {r["record"]["id"]: r["record"] for r in runs["ours"]}
            rows.append(compare(name, length, runs, extra))
            shown = {k: v for k, v in rows[-1].items() if k not in runs}
            print({**shown, **{k: {m: round(t, 3) for m, t in rows[-1][k].items() if m != "predictions"}
                               for k in runs}}, flush=True)  # fmt: skip
    out = args.out or outputs_root() / "bench" / "eval.json"
    write_json(out, {"model": str(cfg.model.name), "threads": args.threads, "keep": args.keep,
                     "new_tokens": args.new_tokens, "rows": rows})  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
