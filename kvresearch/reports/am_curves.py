"""Attention Matching against eviction: log-perplexity of the full-context answers against compression ratio.

    python -m kvresearch.reports.am_curves --benchmark quality [--match <settings>] [--root outputs]
        [--out docs/results]

Reads the finished evaluate runs of ``--benchmark`` (one method x keep ratio each, all with the same
other overrides as their full-cache run) and writes ``<out>/am_<benchmark>_table.md`` (per method and
nominal ratio: measured compression ratio 1 / (1 - prune ratio), mean NLL per token of the full-cache
answers with its bootstrap 95% interval, exact agreement with the full-cache answer, benchmark score),
the claim check (at every nominal keep ratio of at most ``--claim-keep``: each AM variant's NLL minus the
best eviction method's at the same keep ratio, paired over the same answers, with its bootstrap 95%
interval) and ``<out>/am_<benchmark>_curve.png`` (NLL and agreement against the measured ratio, log
x-axis). A cell with no finished run is absent from the table and the plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from kvresearch.runs import outputs_root
from kvresearch.stats import bootstrap_mean, paired_difference

EVICTION = {"kvzip_plus", "kvzap_mlp", "kvzap_linear", "snapkv", "streaming_llm"}
BASELINES = EVICTION | {"summarize", "full"}  # dashed in the plot; the claim compares AM with EVICTION only


def runs(root: Path, benchmark: str, match: str = "") -> dict[str, list[dict]]:
    """Per method name, one row per finished run (folder name containing ``match``): ratio, NLL, agreement."""
    rows: dict[str, list[dict]] = defaultdict(list)
    for done in sorted(root.glob("evaluate/*/DONE")):
        if match not in done.parent.name:
            continue
        metrics = json.loads((done.parent / "metrics.json").read_text())
        if metrics["benchmark"]["name"] != benchmark:
            continue
        records = [json.loads(x) for x in (done.parent / "predictions.jsonl").read_text().splitlines() if x.strip()]
        nll = [r["full_answer_nll"] for r in records if r.get("full_answer_nll") is not None]
        if not nll:
            continue
        prune = statistics.fmean(r["prune_ratio"] for r in records)
        agree = [float(r["agrees_with_full"]) for r in records if r.get("agrees_with_full") is not None]
        interval = bootstrap_mean(nll)
        rows[metrics["method"]["name"]].append(
            {
                "nll_by_id": {r["id"]: r["full_answer_nll"] for r in records if r.get("full_answer_nll") is not None},
                "score": statistics.fmean(float(r["score"]) for r in records),
                "keep": metrics["method"].get("keep_ratio"),
                "ratio": 1 / max(1 - prune, 1e-9),
                "nll": interval.mean,
                "low": interval.low,
                "high": interval.high,
                "agreement": statistics.fmean(agree) if agree else None,
                "answers": len(nll),
            }
        )
    return rows


def claim_rows(data: dict[str, list[dict]], max_keep: float) -> list[str]:
    """Per keep ratio <= ``max_keep``: each AM variant's NLL minus the best eviction method's, paired."""
    lines = []
    keeps = sorted(
        {r["keep"] for rows in data.values() for r in rows if r["keep"] is not None and r["keep"] <= max_keep}
    )
    for keep in reversed(keeps):
        at = {name: r for name, rows in data.items() for r in rows if r["keep"] == keep}
        evictions = {n: r for n, r in at.items() if n in EVICTION}
        if not evictions:
            continue
        best = min(evictions, key=lambda n: evictions[n]["nll"])
        for name in sorted(n for n in at if n not in BASELINES):
            ids = sorted(set(at[name]["nll_by_id"]) & set(evictions[best]["nll_by_id"]))
            diff = paired_difference(
                [at[name]["nll_by_id"][i] for i in ids], [evictions[best]["nll_by_id"][i] for i in ids]
            )
            verdict = "below" if diff.high < 0 else "above" if diff.low > 0 else "not separated"
            interval = f"{diff.mean:+.3f} ({diff.low:+.3f} to {diff.high:+.3f})"
            lines.append(f"| {keep} | {name} | {best} | {len(ids)} | {interval} | {verdict} |")
    return lines


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmark", default="quality")
    parser.add_argument("--root", default=str(outputs_root()))
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--claim-keep", type=float, default=0.1, help="claim check at keep ratios up to this")
    parser.add_argument("--match", default="", help="only runs whose folder name contains this (one grid's settings)")
    args = parser.parse_args()
    data = runs(Path(args.root), args.benchmark, args.match)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Attention Matching against eviction on {args.benchmark} (python -m kvresearch.reports.am_curves)",
        "",
        "| method | keep | answers | compression (measured) | NLL of full answers (95% CI) | agreement with full "
        "| score |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in sorted(data):
        for r in sorted(data[name], key=lambda r: r["ratio"]):
            agree = "" if r["agreement"] is None else f"{r['agreement']:.2f}"
            lines.append(
                f"| {name} | {r['keep'] if r['keep'] is not None else '-'} | {r['answers']} | {r['ratio']:.1f}x | "
                f"{r['nll']:.3f} ({r['low']:.3f}-{r['high']:.3f}) | {agree} | {r['score']:.2f} |"
            )
    claim = claim_rows(data, args.claim_keep)
    if claim:
        lines += [
            "",
            f"Claim check: AM's NLL minus the best eviction method's at the same keep ratio (<= {args.claim_keep}),",
            "paired over the same answers; 'below' when the whole 95% interval is under zero.",
            "",
            "| keep | AM variant | best eviction | answers | NLL difference (95% CI) | AM is |",
            "|---|---|---|---|---|---|",
            *claim,
        ]
    (out / f"am_{args.benchmark}_table.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab20")
    for i, name in enumerate(sorted(data)):
        points = sorted(data[name], key=lambda r: r["ratio"])
        style = "--" if name in BASELINES else "-"
        for ax, key in zip(axes, ("nll", "agreement"), strict=True):
            xs = [p["ratio"] for p in points if p[key] is not None]
            ys = [p[key] for p in points if p[key] is not None]
            ax.plot(xs, ys, style, marker="o", color=colors(i % 20), label=name)
    for ax, label in zip(axes, ("NLL per token of the full-cache answers", "exact agreement with full"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("compression ratio (measured, 1 / (1 - prune ratio))")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{args.benchmark}: Attention Matching (solid) against eviction and summarization (dashed)")
    fig.tight_layout()
    fig.savefig(out / f"am_{args.benchmark}_curve.png", dpi=110)
    print(f"wrote {out}/am_{args.benchmark}_table.md and _curve.png")


if __name__ == "__main__":
    main()
