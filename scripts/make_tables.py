"""Every finished evaluate run under outputs/ into a Markdown table and a score-vs-prune-ratio plot.

    .venv/bin/python scripts/make_tables.py [--root outputs] [--out docs/results]

Writes ``<out>/ruler_table.md`` (method x setting x task, with the measured prune ratio) and
``<out>/ruler_curve.png`` (mean score against mean prune ratio, one line per method, like the KVzap
paper's RULER figure). Reads run folders only: each run's metrics.json records its method (``describe()``:
name, budget label, options) and the overrides it was run with.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from kvresearch.runs import outputs_root

BUDGET_KEYS = {"keep_ratio", "threshold"}  # shown by the budget label


def setting(m: dict) -> str:
    """The method's budget label, then the method options the run changed from its config (e.g. an ablation)."""
    changed = []
    for line in m["run"]["overrides"]:
        key, _, value = line.partition("=")
        if key.startswith("method.") and key.removeprefix("method.") not in BUDGET_KEYS:
            changed.append(f"{key.removeprefix('method.')}={value}")
    return ", ".join([m["method"]["budget"], *changed])


def load(root: Path) -> list[dict]:
    """metrics.json of every finished evaluate run under ``root``."""
    return [json.loads((done.parent / "metrics.json").read_text()) for done in sorted(root.glob("evaluate/*/DONE"))]


def table(runs: list[dict]) -> str:
    tasks = sorted({t for r in runs for t in r["tasks"]})
    header = "| method | setting | prune ratio | " + " | ".join(tasks) + " | mean | agreement | NLL of full answer |"
    lines = [header, "|" + "---|" * (6 + len(tasks))]
    name_of = lambda r: r["method"]["name"]
    order = sorted(runs, key=lambda r: (name_of(r) != "full", name_of(r), r["overall"]["prune_ratio"] or 0))
    for r in order:
        o, name = r["overall"], r["method"]["name"]
        cells = " | ".join(f"{r['tasks'][t]['score']:.1f}" if t in r["tasks"] else "" for t in tasks)
        agree = "" if o["agreement"] is None else f"{o['agreement']:.2f}"
        nll = "" if o["full_answer_nll"] is None else f"{o['full_answer_nll']:.3f}"
        lines.append(
            f"| {name} | {setting(r)} | {o['prune_ratio']:.2f} | {cells} | {o['score']:.1f} | {agree} | {nll} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in runs:
        by_method[r["method"]["name"]].append((r["overall"]["prune_ratio"] or 0.0, r["overall"]["score"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, points in sorted(by_method.items()):
        points.sort()
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=method, linestyle="-" if len(points) > 1 else "none")
    ax.set(xlabel="prune ratio (share of KV pairs evicted)", ylabel="RULER score", xlim=(-0.02, 1.0))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(outputs_root()))
    parser.add_argument("--out", default="docs/results")
    args = parser.parse_args()
    runs = load(Path(args.root))
    if not runs:
        raise SystemExit(f"no finished evaluate run under {args.root}/evaluate; run make evaluate first")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(runs)
    (out / "ruler_table.md").write_text(text)
    plot(runs, out / "ruler_curve.png")
    print(text)
    print(f"wrote {out / 'ruler_table.md'} and {out / 'ruler_curve.png'}")


if __name__ == "__main__":
    main()
