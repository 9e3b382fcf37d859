"""Every finished evaluate run under outputs/ into one Markdown table and one plot per benchmark.

    python -m kvresearch.reports.tables [--root outputs] [--out docs/results]

Writes ``<out>/<benchmark>_table.md`` (method x setting x task: answers, measured prune ratio, score with
its bootstrap 95% interval, agreement with the full cache, NLL of the full-cache answer) and
``<out>/<benchmark>_curve.png`` (score against prune ratio, one line per method, like the KVzap paper's
figures); from the fidelity runs, ``<out>/fidelity_table.md`` and ``<out>/fidelity_curve.png`` (token
agreement and log-perplexity of the full-cache generation against the prune ratio).
Reads run folders only: each run's metrics.json records its method (``describe()``: name, budget
label, options), its benchmark settings and its overrides; predictions.jsonl the per-answer scores.
A benchmark run on the vendored offline files is labelled a subset.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from kvresearch.runs import outputs_root
from kvresearch.stats import bootstrap_mean

BUDGET_KEYS = {"keep_ratio", "threshold"}  # shown by the budget label


def setting(m: dict) -> str:
    """The method's budget label, then the method options the run changed from its config (e.g. an ablation)."""
    changed = []
    for line in m["run"]["overrides"]:
        key, _, value = line.partition("=")
        key = key.lstrip("+~")
        if key.startswith("method.") and key.removeprefix("method.") not in BUDGET_KEYS:
            changed.append(f"{key.removeprefix('method.')}={value}")
    return ", ".join([m["method"]["budget"], *changed])


def load(root: Path) -> list[dict]:
    """metrics.json of every finished evaluate run under ``root``, with its per-answer scores."""
    runs = []
    for done in sorted(root.glob("evaluate/*/DONE")):
        metrics = json.loads((done.parent / "metrics.json").read_text())
        lines = (done.parent / "predictions.jsonl").read_text().splitlines()
        metrics["scores"] = [float(json.loads(line)["score"]) for line in lines if line.strip()]
        runs.append(metrics)
    return runs


def subset_note(run: dict) -> str:
    """A line saying the table is on a vendored subset, when it is."""
    bench = run["benchmark"]
    folder = str((bench.get("files") or {}).get("folder") or "")
    if bench.get("source") == "files" and "/benchmarks/data/" in folder:
        return (
            f"{bench['name']} on the vendored offline files (a subset, see {folder.split('kvresearch/')[-1]}/"
            "PROVENANCE.md): not comparable with published numbers.\n\n"
        )
    return ""


def table(runs: list[dict]) -> str:
    """The Markdown table of one benchmark's runs."""
    tasks = sorted({t for r in runs for t in r["tasks"]})
    header = (
        "| method | setting | answers | prune ratio | " + " | ".join(tasks)
        + " | mean | 95% CI | agreement | NLL of full answer |"
    )  # fmt: skip
    lines = [header, "|" + "---|" * (8 + len(tasks))]
    name_of = lambda r: r["method"]["name"]
    order = sorted(runs, key=lambda r: (name_of(r) != "full", name_of(r), r["overall"]["prune_ratio"] or 0))
    for r in order:
        o, name = r["overall"], r["method"]["name"]
        cells = " | ".join(f"{r['tasks'][t]['score']:.1f}" if t in r["tasks"] else "" for t in tasks)
        ci = bootstrap_mean(r["scores"]).scaled(100)
        interval = "" if ci.n < 2 else f"[{ci.low:.1f}, {ci.high:.1f}]"
        agree = "" if o["agreement"] is None else f"{o['agreement']:.2f}"
        nll = "" if o["full_answer_nll"] is None else f"{o['full_answer_nll']:.3f}"
        prune = f"{o['prune_ratio']:.2f}" + (f" (decoding {d:.2f})" if (d := o.get("decode_prune_ratio")) else "")
        lines.append(
            f"| {name} | {setting(r)} | {o['samples']} | {prune} | {cells} | {o['score']:.1f} | "
            f"{interval} | {agree} | {nll} |"
        )
    return subset_note(runs[0]) + "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path, benchmark: str) -> None:
    """Score against measured prune ratio, one line per method."""
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
    ax.set(xlabel="prune ratio (share of KV pairs evicted)", ylabel=f"{benchmark} score", xlim=(-0.02, 1.0))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fidelity(root: Path, out: Path) -> None:
    """The fidelity runs: one table row per run, agreement and log-perplexity against prune ratio."""
    runs = [json.loads((d.parent / "metrics.json").read_text()) for d in sorted(root.glob("fidelity/*/DONE"))]
    if not runs:
        return
    lines = [
        "| method | setting | prompts x tokens | prune ratio | token agreement | first divergence | "
        "log-ppl of full generation | peak KV MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    name_of = lambda r: r["method"]["name"]
    for r in sorted(runs, key=lambda r: (name_of(r) != "full", name_of(r), r["overall"]["prune_ratio"])):
        o = r["overall"]
        lines.append(
            f"| {r['method']['name']} | {setting(r)} | {o['prompts']} x {r['fidelity']['new_tokens']} | "
            f"{o['prune_ratio']:.2f} | {o['token_agreement']:.2f} | {o['first_divergence']:.0f} | "
            f"{o['full_logppl']:.3f} | {o['kv_bytes_peak_kept'] / 2**20:.1f} |"
        )
    (out / "fidelity_table.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in sorted({r["method"]["name"] for r in runs}):
        points = sorted((r["overall"]["prune_ratio"], r["overall"]) for r in runs if r["method"]["name"] == name)
        xs = [x for x, _ in points]
        for ax, key in zip(axes, ("token_agreement", "full_logppl"), strict=True):
            ax.plot(xs, [o[key] for _, o in points], marker="o", label=name)
    axes[0].set(xlabel="prune ratio at the end", ylabel="token agreement with the full cache")
    axes[1].set(xlabel="prune ratio at the end", ylabel="log-perplexity of the full-cache generation")
    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "fidelity_curve.png", dpi=120)
    plt.close(fig)
    print("\n".join(lines))
    print(f"wrote {out / 'fidelity_table.md'} and {out / 'fidelity_curve.png'}")


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(outputs_root()))
    parser.add_argument("--out", default="docs/results")
    args = parser.parse_args()
    runs = load(Path(args.root))
    if not runs and not list(Path(args.root).glob("fidelity/*/DONE")):
        raise SystemExit(f"no finished evaluate or fidelity run under {args.root}; run make stage-evaluate first")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fidelity(Path(args.root), out)
    by_benchmark: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        by_benchmark[run["benchmark"]["name"]].append(run)
    for name, group in sorted(by_benchmark.items()):
        text = table(group)
        (out / f"{name}_table.md").write_text(text)
        plot(group, out / f"{name}_curve.png", name)
        print(text)
        print(f"wrote {out / f'{name}_table.md'} and {out / f'{name}_curve.png'}")


if __name__ == "__main__":
    main()
