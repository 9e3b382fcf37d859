"""Every finished evaluate run under outputs/ into a Markdown table and a score-vs-prune-ratio plot.

    .venv/bin/python scripts/make_tables.py [--root outputs] [--out docs/results]

Writes ``<out>/ruler_table.md`` (method x setting x task, with the measured prune ratio) and
``<out>/ruler_curve.png`` (mean score against mean prune ratio, one line per method, like the KVzap
paper's RULER figure). Reads run folders only.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf

METHOD_CONF = Path(__file__).resolve().parents[1] / "conf" / "method"
MAIN_KEYS = {"threshold", "keep_ratio", "press", "surrogate_path", "_target_", "name"}


def setting(m: dict) -> str:
    """The method's main knob, then any other option that differs from its config (e.g. an ablation)."""
    main = "-"
    for key, label in (("threshold", "tau"), ("keep_ratio", "keep"), ("press_compression_ratio", "prune")):
        if m.get(key) is not None:
            main = f"{label}={m[key]:g}"
            break
    return ", ".join([main, *m.get("changed", [])])


def changed_options(run_dir: Path) -> list[str]:
    """Options of the run's method that differ from conf/method/<name>.yaml (interpolations aside)."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        return []
    method = OmegaConf.to_container(OmegaConf.load(config)).get("method") or {}  # type: ignore[union-attr]
    defaults_file = METHOD_CONF / f"{method.get('name')}.yaml"
    if not defaults_file.is_file():
        return []
    defaults = OmegaConf.to_container(OmegaConf.load(defaults_file))
    return [
        f"{k}={v}"
        for k, v in method.items()
        if k not in MAIN_KEYS and k in defaults and defaults[k] != v and not str(defaults[k]).startswith("${")  # type: ignore[operator]
    ]


def load(root: Path) -> list[dict]:
    runs = []
    for done in sorted(root.glob("evaluate/*/DONE")):
        metrics = json.loads((done.parent / "metrics.json").read_text())
        metrics["run"] = done.parent.name
        metrics["changed"] = changed_options(done.parent)
        runs.append(metrics)
    return runs


def table(runs: list[dict]) -> str:
    tasks = sorted({t for r in runs for t in r["tasks"]})
    header = "| method | setting | prune ratio | " + " | ".join(tasks) + " | mean | agreement | NLL of full answer |"
    lines = [header, "|" + "---|" * (6 + len(tasks))]
    order = sorted(runs, key=lambda r: (r["method"] != "full", r["method"], r["overall"]["prune_ratio"] or 0))
    for r in order:
        o = r["overall"]
        cells = " | ".join(f"{r['tasks'][t]['score']:.1f}" if t in r["tasks"] else "" for t in tasks)
        agree = "" if o["agreement"] is None else f"{o['agreement']:.2f}"
        nll = "" if o["full_answer_nll"] is None else f"{o['full_answer_nll']:.3f}"
        lines.append(
            f"| {r['method']} | {setting(r)} | {o['prune_ratio']:.2f} | {cells} | {o['score']:.1f} | {agree} | {nll} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in runs:
        by_method[r["method"]].append((r["overall"]["prune_ratio"] or 0.0, r["overall"]["score"]))
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
    parser.add_argument("--root", default=os.environ.get("KVRESEARCH_OUTPUTS", "outputs"))
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
