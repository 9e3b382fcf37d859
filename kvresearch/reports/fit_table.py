"""Print the fit table of every finished train_surrogate run (Markdown).

python -m kvresearch.reports.fit_table [--root outputs] [--per-layer]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvresearch.runs import outputs_root


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(outputs_root()))
    parser.add_argument("--per-layer", action="store_true", help="add the per-layer R^2 table")
    args = parser.parse_args()
    runs = sorted(p.parent for p in Path(args.root, "train_surrogate").glob("*/DONE"))
    if not runs:
        raise SystemExit(f"no finished train_surrogate run under {args.root}/train_surrogate; run make train-surrogate")
    metrics = {run.name: json.loads((run / "metrics.json").read_text()) for run in runs}
    print(
        "| run | model | surrogate | fit | held-out R^2 (mean) | R^2 (pooled) | Spearman | precision | recall "
        "| test rows | train time (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, m in metrics.items():
        t = m["test"]
        print(
            f"| {name} | {m['model']} | {m['kind']} | {m['fit']} | {t['r2_mean']:.3f} | {t['r2_pooled']:.3f} | "
            f"{t['spearman_mean']:.3f} | {t['precision']:.3f} | {t['recall']:.3f} | {t['rows']} | {m['train_s']:.0f} |"
        )
    if args.per_layer:
        names = list(metrics)
        print("\n| layer | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for layer in range(len(next(iter(metrics.values()))["test"]["r2_per_layer"])):
            cells = " | ".join(f"{metrics[n]['test']['r2_per_layer'][layer]:.3f}" for n in names)
            print(f"| {layer} | {cells} |")


if __name__ == "__main__":
    main()
