"""Benchmark: every kvpress press with real eviction against kvpress itself, item by item, with its memory.

For each press of the catalog (``models/press_catalog.py``; ``--presses`` to pick some by config name), on
``--samples`` RULER ``niah_single_2`` contexts of ``--length`` tokens and the embedded model (``--threads``
threads), both sides run the same press (``bench/press_check.py``):

* ``ours``: the method of the press's YAML: its prefill into the ragged cache (real eviction), then greedy
  generation (``--new-tokens``), compressing while decoding where the press does;
* ``kvpress``: kvpress's own prefill under the press on a ``DynamicCache`` (the pairs it keeps, its bytes), then
  its pipeline's answer (for presses whose layers differ in length, which kvpress decodes with flash attention
  only, its cache fed one token at a time instead).

Per sample: the (layer, KV head) holding the same pairs bit for bit, whether the answers are the same, the
prune ratio, the bytes each side holds after the prefill (ours: kept; kvpress: its cache, masked pairs
included) and the peak bytes while the press ran, and the seconds of each prefill. Presses that need a file
get seeded placeholders (their answers check the bridge, not the press). Writes ``outputs/bench/presses.json``;
the summary is in docs/presses.md.

Each press's row keeps the commit it ran at; ``--resume`` keeps the rows of a partial report made with the same
settings and ``--redo`` runs some of them again. ``complete`` is true once every press of the catalog has a row.

    python -m kvresearch.bench.presses [--presses snapkv kvpress_adakv] [--samples 3] [--length 2048]
    python -m kvresearch.bench.presses --resume [--redo FinchPress]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvresearch.answering import Settings, prompts_of
from kvresearch.bench.eval import config, surrogate
from kvresearch.bench.press_check import compare, placeholder_files
from kvresearch.benchmarks.loader import load_samples
from kvresearch.methods.baselines import KVPress, kvzap_press
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.models.press_catalog import CATALOG, NOT_BRIDGED, Entry
from kvresearch.progress import Progress
from kvresearch.runs import build, outputs_root, read_json, write_json
from kvresearch.runs.provenance import git_state
from kvresearch.speed import KVpressPipeline

BASE = ["benchmark=ruler", "benchmark.tasks=[niah_single_2]"]


def method_of(entry: Entry, files: dict[str, str], scorer: Any) -> Any:
    """The entry's method as its YAML builds it, placeholder files set; kvpress_kvzap scores with ``scorer``."""
    if entry.config == "kvpress_kvzap":
        return KVPress(name=entry.config, press=kvzap_press(scorer, -4.0))
    overrides = [f"method.press.{entry.needs}={files[entry.needs]}"] if entry.needs else []
    return build(config([*BASE, f"method={entry.config}", *overrides]).method)


def markdown(report: dict[str, Any]) -> str:
    """The table of docs/presses.md: per press, heads and answers matched, prune ratio, bytes against kvpress."""
    lines = [
        "| press | phase | heads with kvpress's pairs | same answer | prune ratio | kept bytes / kvpress's | "
        "peak bytes / kvpress's |",
        "|---|---|---|---|---|---|---|",
    ]
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    mean = lambda s, key: sum(r[key] for r in s) / len(s)
    for row in report["presses"]:
        s = row["samples"]
        peak = [r["ours_peak_bytes"] for r in s if r["ours_peak_bytes"] is not None]
        ours_peak = mib(sum(peak) / len(peak)) if peak else "-"
        lines.append(
            f"| {row['press']} | {row['phase']} | {sum(r['heads_same'] for r in s)} of {sum(r['heads'] for r in s)} "
            f"| {sum(r['same_answer'] for r in s)} of {len(s)} | {mean(s, 'prune_ratio'):.2f} "
            f"| {mib(mean(s, 'ours_kept_bytes'))} / {mib(mean(s, 'kvpress_kept_bytes'))} "
            f"| {ours_peak} / {mib(mean(s, 'kvpress_peak_bytes'))} |"
        )
    return "\n".join(lines)


def resumed(out: Path, head: dict[str, Any]) -> list[dict]:
    """The press rows of a partial report at ``out`` made with the same settings (none if there is none)."""
    if not out.exists():
        return []
    found = read_json(out, "Delete it or run without --resume.")
    same = all(found.get(k) == v for k, v in head.items() if k != "not_bridged")
    return list(found["presses"]) if same else []


@torch.no_grad()
def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presses", nargs="+", default=None, help="config names (default: the whole catalog)")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="default: <outputs>/bench/presses.json")
    parser.add_argument(
        "--resume", action="store_true", help="keep the presses of a partial report with these settings"
    )
    parser.add_argument("--redo", nargs="+", default=(), help="with --resume: run these presses (class names) again")
    parser.add_argument("--summarize", type=Path, default=None, help="print the Markdown table of a report and stop")
    args = parser.parse_args()
    if args.summarize:
        print(markdown(read_json(args.summarize, "Run `make bench-presses` to write it.")))
        return
    torch.set_num_threads(args.threads)
    entries = [e for e in CATALOG if args.presses is None or e.config in args.presses or e.cls in args.presses]
    cfg = config([*BASE, f"benchmark.samples_per_task={args.samples}", f"benchmark.lengths=[{args.length}]"])
    loaded = load_model(cfg.model)
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    settings = Settings(fidelity=False, max_new_tokens=args.new_tokens)
    samples = load_samples(cfg.benchmark, loaded.tokenizer)
    prompts = [prompts_of(loaded.tokenizer, s, settings)[0] for s in samples]
    new = settings.new_tokens(samples[0].questions[0].max_new_tokens)
    pipeline, (scorer, source) = KVpressPipeline(session), surrogate(cfg, session)
    out = args.out or outputs_root() / "bench" / "presses.json"
    head = {"model": str(cfg.model.name), "threads": args.threads, "length": args.length, "samples": args.samples,
            "new_tokens": new, "kvzap_surrogate": source, "not_bridged": NOT_BRIDGED}  # fmt: skip
    rows = [r for r in (resumed(out, head) if args.resume else []) if r["press"] not in args.redo]
    done, commit = {row["press"] for row in rows}, git_state()
    order = {e.cls: i for i, e in enumerate(CATALOG)}
    with tempfile.TemporaryDirectory() as folder:
        files = placeholder_files(loaded.model, Path(folder))
        bar = Progress(len(entries), "presses", unit="press")
        for entry in entries:
            if entry.cls not in done:
                make = lambda e=entry: method_of(e, files, scorer)
                runs = [compare(session, pipeline, make, entry.pipeline, p, new) for p in prompts]
                row = {"press": entry.cls, "config": entry.config, "phase": entry.phase, "samples": runs}
                rows = sorted([*rows, {**row, "commit": commit["commit"], "dirty": commit["dirty"]}],
                              key=lambda r: order.get(r["press"], len(order)))  # fmt: skip
                print(entry.cls, [(r["heads_same"], r["heads"], r["same_answer"]) for r in runs], flush=True)
                write_json(out, {**head, "presses": rows, "complete": False})  # a resumable partial report
            bar.update(press=entry.cls)
        bar.close()
    complete = {r["press"] for r in rows} >= set(order)  # every press of the catalog, not only those asked for
    write_json(out, {**head, "presses": rows, "complete": complete})
    print(markdown(read_json(out, "")))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
