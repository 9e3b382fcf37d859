"""``docs/results/README.md``: every committed table and the command that rebuilds it.

With its experiment, settings and size (``python -m kvresearch.experiment index``, after ``make table-<name>``).
"""

from __future__ import annotations

from pathlib import Path

from kvresearch.experiment.config import cells, load, names
from kvresearch.experiment.results import NOT_RUN, table

# Results that no experiment table holds: what each is and the command that rebuilds it.
STUDIES = {
    "surrogate_study.md": ("the surrogate study: leave-one-source-out, learning curve, mix, width, dtype",
                           "make study-surrogates"),
    "surrogate_recipe.md": ("the MLP's recipe, one change at a time, a source left out",
                            'make study-surrogates ARGS="--parts recipe --name surrogate_recipe"'),
    "surrogate_curve_all.md": ("the learning curve up to every packaged document",
                               "make experiment-surrogate_curve"),
    "surrogate_transfer.md": ("the default surrogates on news, science and fiction",
                              "make experiment-surrogate_transfer"),
    "surrogate_transfer_recipes.md": ("two more MLP recipes on the same three sources",
                                      "python -m kvresearch.studies.transfer --name surrogate_transfer_recipes ..."),
    "surrogate_probe_counts.json": ("the input probes (per-layer R^2 of every probe run)", "make study-probe"),
    "sizing.md": ("GPU-hours of every experiment's hub variant (estimates until the device check runs)", "make sizing"),
}  # fmt: skip


def size(name: str, root: Path, records: Path) -> str:
    """``finished of cells; answers per cell`` of an experiment's twin, read as its table reads them."""
    exp = load(name)
    _, rows, _ = table(exp, "twin", root, records)
    done = [r for r in rows if r[3] != NOT_RUN]
    answers = sorted({r[3] for r in done}, key=lambda n: int(n) if n.isdigit() else 0)
    per = f"; {'/'.join(answers)} {'rows' if exp.get('kind') == 'fit' else 'answers'} per cell" if answers else ""
    return f"{len(done)} of {len(rows)} cells{per}"


def render(out: Path, root: Path, records: Path) -> str:
    """The index of the results folder ``out`` in Markdown."""
    lines = [
        "# Results",
        "",
        "Every committed table, what it holds and the command that rebuilds it. Experiment tables are rebuilt",
        "from the committed run records (`runs/`) alone; a test rebuilds each and diffs it against this folder.",
        "Written by `python -m kvresearch.experiment index`.",
        "",
        "| table | experiment | twin settings | finished | rebuild |",
        "|---|---|---|---|---|",
    ]
    for name in names():
        path = out / "experiments" / f"{name}_twin.md"
        if not path.is_file() or not cells(load(name), "twin"):
            continue
        settings = " ".join(str(load(name).get("notes", "")).split()).removeprefix("Twin: ")
        lines.append(
            f"| [{path.name}](experiments/{path.name}) | `{name}`: {load(name).title} | {settings} | "
            f"{size(name, root, records)} | `make table-{name}` |"
        )
    lines += ["", "Study outputs (built from run folders by the study itself, not from run records):", ""]
    lines += ["| file | what | rebuild |", "|---|---|---|"]
    lines += [f"| [{f}]({f}) | {what} | `{cmd}` |" for f, (what, cmd) in STUDIES.items() if (out / f).is_file()]
    return "\n".join(lines) + "\n"


def write(out: Path, root: Path, records: Path) -> str:
    """Write the index to ``out/README.md``; its text."""
    text = render(out, root, records)
    (out / "README.md").write_text(text, encoding="utf-8")
    return text
