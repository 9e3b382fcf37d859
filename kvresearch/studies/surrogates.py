"""The surrogate study behind the KVzap paper's R^2 figure, on one extract run: which data and shape generalise.

    python -m kvresearch.studies.surrogates [--extract RUN] [--fp32-extract RUN]
        [--parts loso,curve,mix,width,dtype (and recipe)] [--out docs/results] [--name surrogate_study]
        [--set OVERRIDE ...] [--finished-only]

The study runs on its own extract (:data:`STUDY_EXTRACT`, extracted first when not finished; ``--extract`` names
another). Every point is a real ``train_surrogate`` run (Lightning for the MLP, ridge for the linear map) on a *view* of
the extract run: a folder ``outputs/extract/study-<extract id>-<tag>`` whose manifest marks which documents
train and which test (the others are left out), its shards linked to the original ones. Held-out R^2 is
measured on the test documents: pooled per layer (mean over layers of the R^2 of all heads' scores), per head
(mean), Spearman.

* ``loso``: leave one source out: train on every document of the other sources, test on all of that source;
* ``curve``: the learning curve with essays left out: train on the first N documents of the other sources, N
  doubling from 15 (:func:`curve_sizes`) up to all of them (that last point is the essays' ``loso`` point);
  on the extract of every document (``make experiment-surrogate_curve``) it runs up to all the packaged corpora give;
* ``mix``: the training mix at a fixed size (60 documents): essays, wiki, bible or a third of each, tested on
  the essays' test split (the essays' train split is in-domain only for the essays-only point);
* ``width``: MLP hidden width (hidden/16 .. hidden/2) with essays left out;
* ``recipe``: the MLP's optimisation with essays left out, each point the KVzap reference recipe with one
  change: more and fewer epochs (the reference's 15 epochs of 1.2M rows are 35k steps; 15 of our 68k rows
  are 2k), a lower learning rate, more weight decay, and a second seed (the noise of one point); the best
  change (weight decay 1, now the default) also with wiki and with bible left out;
* ``dtype``: stored hidden states in bf16 against fp32 (``--fp32-extract``: an extract run of the same corpus
  with ``extract.hidden_dtype=float32``), the same documents, essays left out.

Writes ``<out>/<name>.md`` (one row per point), ``<out>/<name>_curve.png`` (R^2 against training rows, when the
curve is among the parts) and ``outputs/<name>.json``. Finished runs are skipped on a re-run; ``--finished-only``
trains nothing and writes "not run" for the points not finished yet (a long curve stopped part-way).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from itertools import zip_longest
from pathlib import Path
from typing import Any

from kvresearch.runs import (
    outputs_root,
    read_json,
    repo_root,
    resolve_run,
    run_id,
    write_atomic,
    write_json,
)
from kvresearch.runs.changes import folder_changes
from kvresearch.runs.naming import run_folder

# The study's extract: 60 training and 8 test documents per source, 500 random positions each (what its tables
# were measured on). The default extract, which the study chose, takes every position of half the training
# documents: about the same rows (a position is worth about a document here) for half the extraction.
STUDY_EXTRACT = ("corpus.n_train_per_source=60", "extract.samples_per_doc=500")
CURVE_START = 15  # the learning curve's first point, in documents of the other sources
WIDTHS = (36, 144, 288)  # hidden/16, hidden/4, hidden/2 for SmolLM2 (576); hidden/8 = 72 is the default
MIX_SIZE = 60
REFERENCE = "surrogate.weight_decay=0.01"  # the KVzap reference recipe's weight decay; the default is this study's
RECIPES = (  # (label, override): the reference recipe (15 epochs, lr 5e-3, weight decay 0.01) with one change
    ("60 epochs", "surrogate.epochs=60"),
    ("5 epochs", "surrogate.epochs=5"),
    ("lr 1e-3", "surrogate.lr=1e-3"),
    ("weight decay 0.1", "surrogate.weight_decay=0.1"),
    ("weight decay 1", "surrogate.weight_decay=1.0"),
    ("weight decay 3", "surrogate.weight_decay=3.0"),
    ("weight decay 10", "surrogate.weight_decay=10.0"),
    ("seed 1", "seed=1"),  # the reference again on another seed: how far one seed moves a point
)
RECIPE_CHECKED = "weight decay 1"  # the best on essays: also run with wiki and with bible left out


def pinned(override: str) -> tuple[str, ...]:
    """``override`` on the reference recipe: the reference's weight decay unless the override sets its own."""
    return (override,) if override.startswith("surrogate.weight_decay=") else (REFERENCE, override)


def curve_sizes(n: int, start: int = CURVE_START) -> list[int]:
    """Training-document counts of the learning curve: ``start`` doubling while 1.5x stays within ``n``, then ``n``.

    >>> curve_sizes(129), curve_sizes(1980)
    ([15, 30, 60, 129], [15, 30, 60, 120, 240, 480, 960, 1980])
    """
    sizes = []
    while start * 1.5 <= n:
        sizes.append(start)
        start *= 2
    return [*sizes, n]


def study_extract() -> str:
    """The study extract's run (``extract/<name>``), extracted first; the stage skips a finished run."""
    cmd = [sys.executable, "-m", "kvresearch.stages.extract", *STUDY_EXTRACT]
    if subprocess.run(cmd, cwd=repo_root()).returncode != 0:  # the stage's own message is printed above
        raise SystemExit("The study's extract failed; --extract RUN runs the study on another extract run.")
    return f"extract/{run_folder(outputs_root(), 'extract', STUDY_EXTRACT).name}"


def view(source: Path, tag: str, train: set[str], test: set[str]) -> str:
    """A finished extract run folder holding ``source``'s shards with ``train``/``test`` documents; its run id.

    The folder is named by the source run's id and the tag, so views of two extracts never share a folder (and
    a train_surrogate run on one is never taken for a run on the other). Its ``DONE`` names the source's
    ``DONE`` and the documents chosen, so a train_surrogate run on it sees a redone source or another choice
    as an input redone since (kvresearch/runs/changes.py).
    """
    folder = outputs_root() / "extract" / f"study-{run_id(source)}-{tag}"
    manifest = read_json(source / "manifest.json", "Re-run that extract.")
    for doc in manifest["documents"]:
        done = doc["status"] == "done" and doc["doc_id"] in train | test
        doc["split"] = "test" if doc["doc_id"] in test else "train"
        doc["status"] = "done" if done else "left_out_by_study"
    manifest["study"] = {"source": str(source), "tag": tag, "train": len(train), "test": len(test)}
    if folder.exists() and not (folder / "DONE").is_file():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "shards").exists():
        (folder / "shards").symlink_to(source / "shards", target_is_directory=True)
    write_json(folder / "manifest.json", manifest)
    chosen = hashlib.sha1(json.dumps([sorted(train), sorted(test)]).encode()).hexdigest()[:12]
    source_done = (source / "DONE").read_text(encoding="utf-8").strip()
    write_atomic(folder / "DONE", f"study view of {source.name} (finished {source_done}), documents {chosen}\n")
    return run_id(folder)


def _run(extract_id: str, kind: str, extra: tuple[str, ...]) -> tuple[Path, list[str]]:
    """The train_surrogate run folder of a point, and its overrides."""
    overrides = [f"paths.extract={extract_id}", f"surrogate={kind}", *extra]
    return run_folder(outputs_root(), "train_surrogate", overrides), overrides


def finished(extract_id: str, kind: str, extra: tuple[str, ...] = ()) -> bool:
    """Whether the point's train_surrogate run is finished with today's config (a re-run would skip it)."""
    folder, overrides = _run(extract_id, kind, extra)
    return (folder / "DONE").is_file() and not folder_changes(folder, "train_surrogate", overrides)


def train(extract_id: str, kind: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One train_surrogate run on a view (skipped when finished); its metrics."""
    folder, overrides = _run(extract_id, kind, extra)
    if not finished(extract_id, kind, extra):
        cmd = [sys.executable, "-m", "kvresearch.stages.train_surrogate", *overrides]
        if subprocess.run(cmd, cwd=repo_root()).returncode != 0:  # the stage's own message is printed above
            raise SystemExit(f"train_surrogate failed for {folder.name}; --set force=true or on_config_change=keep "
                             "passes a stage's way on to every run of the study.")  # fmt: skip
    return json.loads((folder / "metrics.json").read_text())


def interleaved(docs: list[dict[str, Any]]) -> list[str]:
    """Document ids taking the sources in turn (so a prefix of any length is a balanced mix)."""
    by_source: dict[str, list[str]] = {}
    for d in docs:
        by_source.setdefault(d["source"], []).append(d["doc_id"])
    return [i for group in zip_longest(*by_source.values()) for i in group if i is not None]


def points(
    source: Path, parts: list[str], fp32: Path | None, common: tuple[str, ...] = (), finished_only: bool = False
) -> list[dict[str, Any]]:
    """Every study point asked for: its setting and its fit (``common``: overrides for every run).

    ``finished_only``: train nothing; a point whose run is not finished gets ``None`` for its numbers ("not run").
    """
    docs = [d for d in read_json(source / "manifest.json", "")["documents"] if d["status"] == "done"]
    of = lambda src, split=None: {d["doc_id"] for d in docs if d["source"] == src and split in (None, d["split"])}
    sources = sorted({d["source"] for d in docs})
    others = lambda left: interleaved([d for d in docs if d["source"] != left])
    out: list[dict[str, Any]] = []

    def point(part: str, tag: str, train_ids: set[str], test_ids: set[str], kinds=("linear", "mlp"), extra=(),
              run: Path = source, **setting: Any) -> None:  # fmt: skip
        extract_id = view(run, tag, train_ids, test_ids)
        for kind in kinds:
            if any(r["tag"] == tag and r["kind"] == kind for r in out):  # the loso point is also the curve's end
                continue
            if finished_only and not finished(extract_id, kind, (*common, *extra)):
                out.append({"part": part, "tag": tag, "kind": kind, **setting,
                            "train_docs": f"{len(train_ids)} given",  # validation included: the run splits it off
                            "r2_pooled_per_layer": None})  # fmt: skip
                print(f"[study] {tag} {kind}: not run", flush=True)
                continue
            m = train(extract_id, kind, (*common, *extra))
            t = m["test"]
            r2_layer = sum(t["r2_per_layer"]) / len(t["r2_per_layer"])
            out.append({"part": part, "tag": tag, "kind": kind, **setting, "train_docs": m["documents"]["train"],
                        "train_rows": m["rows"]["train"] + m["rows"]["val"], "test_rows": t["rows"],
                        "r2_pooled_per_layer": r2_layer, "r2_per_head": t["r2_mean"], "spearman": t["spearman_mean"],
                        "train_s": m["train_s"]})  # fmt: skip
            print(f"[study] {tag} {kind}: R^2 per layer {r2_layer:.3f}", flush=True)

    if "loso" in parts:
        for left in sources:
            point("loso", f"loso-{left}", set(others(left)), of(left), left_out=left, train_mix="others")
    if "curve" in parts:
        pool = others("essays")
        for n in curve_sizes(len(pool)):
            tag = "loso-essays" if n == len(pool) else f"curve-{n}"  # all of them: the loso point, trained once
            point("curve" if n < len(pool) else "loso", tag, set(pool[:n]), of("essays"), left_out="essays",
                  train_mix="others")  # fmt: skip
    if "mix" in parts:
        for mix in [*sources, "mixed"]:
            pool = interleaved([d for d in docs if d["split"] == "train" and (mix == "mixed" or d["source"] == mix)])
            point(
                "mix", f"mix-{mix}", set(pool[:MIX_SIZE]), of("essays", "test"), train_mix=mix, tested_on="essays/test"
            )
    if "width" in parts:
        for width in WIDTHS:
            point("width", f"loso-essays-w{width}", set(others("essays")), of("essays"), kinds=("mlp",),
                  extra=(f"surrogate.mlp_hidden={width}",), left_out="essays", mlp_hidden=width)  # fmt: skip
    if "recipe" in parts:
        for left in sources:
            recipes = [r for r in RECIPES if left == "essays" or r[0] == RECIPE_CHECKED]  # does the best carry over?
            for label, override in (("reference", REFERENCE), *recipes):
                point("recipe", f"loso-{left}-{label.replace(' ', '')}", set(others(left)), of(left), kinds=("mlp",),
                      extra=pinned(override), left_out=left, recipe=label)  # fmt: skip
    if "dtype" in parts and fp32 is not None:
        fp32_docs = {d["doc_id"] for d in read_json(fp32 / "manifest.json", "")["documents"] if d["status"] == "done"}
        train_ids = set(others("essays")) & fp32_docs
        for dtype, run in (("bfloat16", source), ("float32", fp32)):
            point("dtype", f"dtype-{dtype}", train_ids, of("essays") & fp32_docs, run=run, left_out="essays",
                  hidden_dtype=dtype)  # fmt: skip
    return out


def write(results: list[dict[str, Any]], out: Path, name: str) -> None:
    """The Markdown table, and the learning-curve plot when the curve was run."""
    keys = ["part", "kind", "left_out", "train_mix", "mlp_hidden", "recipe", "hidden_dtype", "train_docs", "train_rows"]
    lines = ["| " + " | ".join([*keys, "R^2 pooled per layer", "R^2 per head", "Spearman", "train s"]) + " |",
             "|" + "---|" * (len(keys) + 4)]  # fmt: skip
    for r in results:
        cells = [str(r.get(k, "")) for k in keys]
        if r["r2_pooled_per_layer"] is None:  # --finished-only: a point whose run is not finished
            cells += ["not run"] * 4
        else:
            cells += [f"{r['r2_pooled_per_layer']:.3f}", f"{r['r2_per_head']:.3f}", f"{r['spearman']:.3f}"]
            cells.append(f"{r['train_s']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    write_atomic(
        out / f"{name}.md",
        f"# Surrogate study: {name} (python -m kvresearch.studies.surrogates)\n\n" + "\n".join(lines) + "\n",
    )
    if not any(r["part"] == "curve" for r in results):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    on_curve = [r for r in results if r["part"] == "curve" or r["tag"] == "loso-essays"]
    for kind in ("linear", "mlp"):
        curve = sorted((r["train_rows"], r["r2_pooled_per_layer"]) for r in on_curve
                       if r["kind"] == kind and r["r2_pooled_per_layer"] is not None)  # fmt: skip
        if curve:
            ax.plot(*zip(*curve, strict=True), marker="o", label=kind)
    ax.axhline(0.75, color="grey", linestyle="--", linewidth=1, label="target 0.75")
    ax.set(xlabel="training rows (essays left out)", ylabel="held-out R^2 on essays (pooled per layer)", xscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{name}_curve.png", dpi=120)
    plt.close(fig)


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extract", default=None, help="an extract run; default: the study's (STUDY_EXTRACT)")
    parser.add_argument("--fp32-extract", default=None, help="an extract run with extract.hidden_dtype=float32")
    parser.add_argument("--parts", default="loso,curve,mix,width,dtype",
                        help="also: recipe (with --name surrogate_recipe)")  # fmt: skip
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="surrogate_study", help="file names: <out>/<name>.md, <name>_curve.png")
    parser.add_argument("--set", nargs="*", default=[], help="overrides for every run: surrogate.weight_decay=0.01")
    parser.add_argument("--finished-only", action="store_true", help="train nothing: tabulate the finished points, "
                        "'not run' for the others (a long curve stopped part-way)")  # fmt: skip
    args = parser.parse_args()
    source = resolve_run(args.extract or study_extract(), "extract")
    fp32 = resolve_run(args.fp32_extract, "extract") if args.fp32_extract else None
    results = points(source, args.parts.split(","), fp32, tuple(args.set), args.finished_only)
    write_json(outputs_root() / f"{args.name}.json", results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write(results, out, args.name)
    print((out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
