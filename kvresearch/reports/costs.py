"""The cost of each benchmark from finished evaluate runs: tokens and seconds per context and per answer.

    python -m kvresearch.reports.costs [--root outputs] [--method full]

Prints a Markdown table, one row per run of ``--method``: benchmark, tasks, contexts and answers, prompt
tokens per answer (mean, max), compression seconds per context, decoding seconds per answer, and wall
seconds per answer (the whole run, fidelity measurements included), so that a user can size a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvresearch.runs import outputs_root


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(outputs_root()))
    parser.add_argument("--method", default="full")
    args = parser.parse_args()
    print(
        "| benchmark | tasks | budget | contexts | answers | prompt tokens (mean / max) | compress s per context "
        "| decode s per answer | new tokens per answer | wall s per answer |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for done in sorted(Path(args.root).glob("evaluate/*/DONE")):
        metrics = json.loads((done.parent / "metrics.json").read_text())
        if metrics["method"]["name"] != args.method:
            continue
        records = [json.loads(x) for x in (done.parent / "predictions.jsonl").read_text().splitlines() if x.strip()]
        contexts = {r["id"].split("/")[0] for r in records}
        per_context = {r["id"].split("/")[0]: r["compress_s"] for r in records}
        bench = metrics["benchmark"]
        tokens = [r["prompt_tokens"] for r in records]
        print(
            f"| {bench['name']} | {', '.join(sorted(metrics['tasks']))} | {bench.get('max_prompt_tokens') or 'model'} "
            f"| {len(contexts)} | {len(records)} | {statistics.fmean(tokens):.0f} / {max(tokens)} "
            f"| {statistics.fmean(per_context.values()):.1f} | {statistics.fmean(r['decode_s'] for r in records):.1f} "
            f"| {statistics.fmean(r['new_tokens'] for r in records):.0f} | {metrics['wall_s'] / len(records):.1f} |"
        )


if __name__ == "__main__":
    main()
