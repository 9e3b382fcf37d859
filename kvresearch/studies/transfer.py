"""Held-out fit of trained surrogates on sources they never saw: news, science papers and fiction.

    python -m kvresearch.studies.transfer [--extract corpus=benchmark_prose]
        [--surrogate NAME=RUN ...] [--out docs/results] [--name surrogate_transfer]

``make train-surrogate`` trains on the packaged prose (essays, Wikipedia summaries, the Bible) and tests on the
held-out documents of those same three sources. This script scores the finished train_surrogate runs on an
extract of other sources (``corpus=benchmark_prose``: the contexts of the vendored benchmark data, which no
surrogate trains on) and reports, per source and over all of them, the fit metrics of ``train_surrogate``:
R^2 pooled per layer (the surrogate study's measure), mean per (layer, head), Spearman. A surrogate whose extract
trained on one of the tested sources is refused.

Writes ``<out>/<name>.md`` and ``outputs/<name>.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from kvresearch.errors import KVResearchError
from kvresearch.runs import outputs_root, read_json, resolve_run, write_atomic, write_json
from kvresearch.surrogate.data import ExtractRun, predict
from kvresearch.surrogate.metrics import fit_metrics
from kvresearch.surrogate.modules import from_run


def source_rows(run: ExtractRun) -> dict[str, np.ndarray]:
    """Global row indices of every source's finished documents, and of all of them (``all``)."""
    done = [d for d in run.manifest["documents"] if d["status"] == "done"]
    by_source: dict[str, set[int]] = {}
    for d in done:
        by_source.setdefault(d["source"], set()).add(d["index"])
    rows = {source: run.rows_of(docs) for source, docs in sorted(by_source.items())}
    rows["all"] = run.rows_of({d["index"] for d in done})
    return rows


def training_sources(recorded: dict[str, Any]) -> set[str]:
    """Sources of the training documents of a train_surrogate run's extract (none known: empty)."""
    extract = recorded.get("extract_run")
    if not extract:
        return set()
    manifest = read_json(Path(extract) / "manifest.json", "Point --surrogate at a run whose extract still exists.")
    return {d["source"] for d in manifest["documents"] if d.get("split") == "train"}


def summary(metrics: dict[str, Any]) -> dict[str, float]:
    """The study's three numbers from :func:`fit_metrics`."""
    return {
        "r2_pooled_per_layer": float(np.mean(metrics["r2_per_layer"])),
        "r2_mean": metrics["r2_mean"],
        "spearman_mean": metrics["spearman_mean"],
        "rows": metrics["rows"],
    }


def table(results: dict[str, dict[str, dict[str, float]]], extract: str, trained_on: dict[str, str]) -> str:
    """Markdown: one row per source, one column group per surrogate."""
    names = list(results)
    sources = list(next(iter(results.values())))
    head = "| test source (rows) | " + " | ".join(f"{n}: R^2 pooled per layer / per head / Spearman" for n in names)
    lines = [
        f"Surrogates tested on sources they never saw (extract `{extract}`); trained on: "
        + "; ".join(f"{n} `{run}`" for n, run in trained_on.items())
        + ".",
        "",
        head + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for source in sources:
        cells = [
            f"{r[source]['r2_pooled_per_layer']:.3f} / {r[source]['r2_mean']:.3f} / {r[source]['spearman_mean']:.3f}"
            for r in results.values()
        ]
        rows = next(iter(results.values()))[source]["rows"]
        lines.append(f"| {source} ({rows:,}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """The command line (see the module docstring)."""
    try:
        run_transfer()
    except KVResearchError as error:
        raise SystemExit(str(error)) from error


def run_transfer() -> None:
    """Parse the command line, score every surrogate on every source, write the table and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extract", default="corpus=benchmark_prose", help="an extract run (folder or id)")
    parser.add_argument(
        "--surrogate",
        action="append",
        metavar="NAME=RUN",
        help="a column: its name and a train_surrogate run (folder or id); repeat for more "
        "(default: linear=surrogate=linear and mlp=surrogate=mlp)",
    )
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="surrogate_transfer")
    args = parser.parse_args()

    columns = [entry.partition("=") for entry in args.surrogate or ["linear=surrogate=linear", "mlp=surrogate=mlp"]]
    for name, sep, ref in columns:
        if not sep or not ref:
            raise KVResearchError(f"--surrogate {name + sep + ref!r}: expected NAME=RUN, e.g. mlp=surrogate=mlp")
    extract_folder = resolve_run(args.extract, "extract")
    run = ExtractRun(extract_folder)
    rows = source_rows(run)
    results: dict[str, dict[str, dict[str, float]]] = {}
    trained_on: dict[str, str] = {}
    for name, _, ref in columns:
        folder = resolve_run(ref, "train_surrogate")
        recorded = read_json(folder / "metrics.json", "Re-run that train_surrogate run with force=true.")
        seen = training_sources(recorded) & set(rows)
        if seen:
            raise KVResearchError(
                f"The train_surrogate run {folder} trained on {', '.join(sorted(seen))}, which this extract tests on: "
                "transfer needs sources the surrogate never saw. Test it on another extract (--extract)."
            )
        surrogate = from_run(str(folder), recorded["kind"], model=run.model)
        n_train = recorded.get("rows", {}).get("train")
        of = f", {n_train:,} rows of {Path(recorded['extract_run']).name}" if n_train else ""
        trained_on[name] = folder.name + of
        results[name] = {}
        for source, r in rows.items():
            truth, pred = predict(surrogate, run, r)
            results[name][source] = summary(fit_metrics(truth, pred))
            print(f"{name} {source}: {results[name][source]}", flush=True)
    write_json(outputs_root() / f"{args.name}.json", {"extract": str(extract_folder), "results": results})
    out = Path(args.out) / f"{args.name}.md"
    write_atomic(out, table(results, extract_folder.name, trained_on))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
