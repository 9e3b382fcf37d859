"""Benchmark: the evaluate stage against kvpress's own pipeline, per sample, on the same RULER samples.

For each ``--lengths`` (RULER ``niah_single_2``, ``--samples`` samples, the embedded model, ``--threads``
threads) and each method, the sides of ``kvresearch/speed.py`` take turns on every sample after an untimed
warm-up: ``ours`` (the evaluate stage, ``evaluate.fidelity=false``), ``kvpress`` (its pipeline on the same
token ids), ``floor`` (transformers alone; ``full`` and ``kvzip_plus``) and ``ours_fidelity`` (the stage with
``evaluate.fidelity=true`` and the full run's answers as reference; every method but ``full``).

Methods: ``full``; kvpress's SnapKV, TOVA and StreamingLLM at ``--keep`` (both sides drop the pairs);
KVzip+ against kvpress's ``KVzipPress(kvzip_plus_normalization=True)`` at ``--keep`` (their scoring choices
differ: ``capture.py``), with transformers' plain prefill as a third side for the compression's cost;
KVzap-MLP by threshold against kvpress's ``DMSPress(KVzapPress)`` (which only masks) with the same surrogate
and threshold (the surrogate of ``paths.surrogate_mlp`` when that run exists, else a seeded untrained one,
said in the JSON; the threshold keeps ``--keep`` of the first sample). Predictions are compared item by item.
Writes ``outputs/bench/eval.json``; the summary is in docs/benchmarks.md.

    python -m kvresearch.bench.eval [--lengths 2048 4096] [--samples 5] [--methods full snapkv ...] [--keep 0.5]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from kvresearch.answering import Settings, prompts_of
from kvresearch.benchmarks.loader import load_samples
from kvresearch.device_steps import random_surrogates
from kvresearch.errors import KVResearchError
from kvresearch.methods.baselines import kvzap_press
from kvresearch.methods.kvzap import KVzap
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.runs import CONF_DIR, build, outputs_root, read_json, write_json
from kvresearch.speed import KVpressPipeline, compare, turns
from kvresearch.surrogate import from_run
from kvresearch.surrogate.modules import Surrogate

PRESSES = ("snapkv", "tova", "streaming_llm")
KVPRESS_TWIN = {"kvzip_plus": "kvpress_kvzip"}  # our method -> the method config of kvpress's press
WITH_FLOOR = ("full", "kvzip_plus")


def config(overrides: list[str]) -> Any:
    """The evaluate config with ``overrides``."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides)


def surrogate(cfg: Any, session: Session) -> tuple[Surrogate, str]:
    """The MLP surrogate of ``paths.surrogate_mlp`` if that run exists, else a seeded untrained one; its source."""
    try:
        return from_run(str(cfg.paths.surrogate_mlp), "mlp", str(cfg.model.name), str(cfg.paths.root)), "trained"
    except KVResearchError:
        return random_surrogates(session)["mlp"], "untrained (seed 0): no train_surrogate run here"


def markdown(report: dict[str, Any]) -> str:
    """The summary table of a report (per-sample means in seconds), as docs/benchmarks.md shows it."""
    lines = [
        "| method | context | prune ratio | ours prefill + decode = wall | kvpress prefill + decode = wall | "
        "speed-up | identical answers | fidelity adds | prefill / plain prefill |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        side = lambda name, r=row: "{prefill_s:.2f} + {decode_s:.2f} = {wall_s:.2f}".format(**r[name])
        extra = f"{row['fidelity_extra_s']:+.2f} s" if "fidelity_extra_s" in row else ""
        floor = f"{row['prefill_vs_floor']:.2f}x" if "prefill_vs_floor" in row else ""
        lines.append(
            f"| {row['method']} | {row['tokens']:,} | {row['prune_ratio']:.3f} | {side('ours')} | {side('kvpress')} | "
            f"{row['speedup_vs_kvpress']:.2f}x | {row['identical_predictions']} of {row['samples']} | {extra} | "
            f"{floor} |"
        )
    return "\n".join(lines)


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--methods", nargs="+", default=["full", *PRESSES, "kvzap_mlp", "kvzip_plus"])
    parser.add_argument("--keep", type=float, default=0.5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    fidelity = "also time the stage with evaluate.fidelity=true (the full run's answers as its reference)"
    parser.add_argument("--fidelity", action=argparse.BooleanOptionalAction, default=True, help=fidelity)
    parser.add_argument("--out", type=Path, default=None, help="default: <outputs>/bench/eval.json")
    parser.add_argument("--summarize", type=Path, default=None, help="print the Markdown table of a report and stop")
    args = parser.parse_args()
    if args.summarize:
        print(markdown(read_json(args.summarize, "Run `make bench-eval` to write it.")))
        return
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
                twin = KVPRESS_TWIN.get(name, name)
                press = None if name == "full" else build(config([*base, f"method={twin}", *keep]).method).press
            checked = references if args.fidelity and name != "full" and references else None
            runs = turns(session, pipeline, method, press, samples, settings, name in WITH_FLOOR, checked)
            if name == "full":
                references = {r["record"]["id"]: r["record"] for r in runs["ours"]}
            rows.append(compare(name, length, runs, extra))
            shown = {k: v for k, v in rows[-1].items() if k not in runs}
            print({**shown, **{k: {m: round(t, 3) for m, t in rows[-1][k].items() if m != "predictions"}
                               for k in runs}}, flush=True)  # fmt: skip
    out = args.out or outputs_root() / "bench" / "eval.json"
    write_json(out, {"model": str(cfg.model.name), "threads": args.threads, "keep": args.keep,
                     "new_tokens": args.new_tokens, "rows": rows})  # fmt: skip
    print(markdown(read_json(out, "")))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
