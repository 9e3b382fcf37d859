"""Where each eviction scope keeps a needle: KVzap's scores on RULER needle contexts, selected per scope.

    python -m kvresearch.studies.granularity [--task niah_single_2] [--samples 5] [--length 2048] [--keep 0.25]
        [--scopes global head token_layer token_model] [--reductions max mean rank] [--page-sizes 16]
        [--out outputs/granularity_needles.json]

For each context (the embedded model; KVzap-MLP of ``paths.surrogate_mlp`` with its window and sinks, as
``method=kvzap_mlp`` keeps a ``keep_ratio``), the surrogate's scores are selected by each scope
(``ops/selection.py``) at the same share. Per scope:

* ``heads_with_needle``: the share of (layer, KV head) that keep every token of the needle's value (the answer's
  tokens where they occur in the context);
* ``needle_tokens_kept``: the share of (layer, KV head, needle token) kept, which credits half a needle;
* ``kept_share``: each head's kept share of the context, its minimum, median and maximum over the heads. Under
  ``global`` it shows how unevenly one budget over the model spreads over the heads; ``head`` and the token
  scopes keep the same count in every head.

The token scopes rank a position by one score shared by the heads that keep or evict it together; the methods
take the best one (``reduction: max``) unless told otherwise. ``--reductions`` adds other reductions, as scopes
named ``token_layer/mean`` and so on (``ops.selection.position_scores``), to compare them before spending
generation on them. ``--page-sizes`` adds the token scopes keeping whole pages of positions (``page_size``, vLLM's
blocks of 16), as scopes named ``token_layer/page16`` and so on.
``token_layer/threshold`` is KVzap's threshold rule at ``token_layer`` with the threshold that keeps the share of
that context (scope ``token_layer_global``: one budget over every layer's positions): its ``kept_share`` shows
how unevenly the layers spend it.

No generation: it explains the ``granularity`` experiment's scores (docs/serving.md), it does not replace them.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from kvresearch.answering import Settings, prompts_of
from kvresearch.bench.eval import config
from kvresearch.benchmarks.loader import load_samples
from kvresearch.errors import KVResearchError
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.ops.selection import PAGED_SCOPES, REDUCTIONS, keep_topk_visible, protect_window
from kvresearch.progress import Progress
from kvresearch.runs import build, outputs_root, write_json


def needle_positions(context_ids: torch.Tensor, answer_ids: list[list[int]]) -> list[int]:
    """Positions in ``context_ids`` (T,) of the first occurrence of any of ``answer_ids`` (token spellings)."""
    ids = context_ids.tolist()
    for spelling in answer_ids:
        n = len(spelling)
        for start in range(len(ids) - n + 1):
            if n and ids[start : start + n] == spelling:
                return list(range(start, start + n))
    return []


def scope_summary(kept: list[list[torch.Tensor]], needle: list[int], n: int) -> dict[str, Any]:
    """``heads_with_needle``, ``needle_tokens_kept`` and ``kept_share`` (module docstring) of one selection."""
    want = torch.tensor(needle)
    shares = [len(rows) / n for layer in kept for rows in layer]
    held = [torch.isin(want, rows) for layer in kept for rows in layer]  # (needle,) per head
    return {
        "heads_with_needle": sum(bool(h.all()) for h in held) / len(held),
        "needle_tokens_kept": float(torch.stack(held).float().mean()),
        "kept_share": {"min": min(shares), "median": statistics.median(shares), "max": max(shares)},
    }


def selections(
    scores: list[torch.Tensor],
    keep: float,
    scopes: list[str],
    reductions: list[str],
    windows: list[int | None],
    page_sizes: tuple[int, ...] = (),
) -> dict[str, list[list[torch.Tensor]]]:
    """Scope label -> kept indices per layer and head: each scope, each token scope under each reduction and page."""
    kept = {scope: keep_topk_visible(scores, keep, scope, windows) for scope in scopes}
    if "token_layer" in scopes:  # the threshold that keeps the share of this context: one budget over the layers
        kept["token_layer/threshold"] = keep_topk_visible(scores, keep, "token_layer_global", windows)
    for scope in (s for s in scopes if s in PAGED_SCOPES):
        for reduction in (r for r in reductions if r != "max"):
            kept[f"{scope}/{reduction}"] = keep_topk_visible(scores, keep, scope, windows, reduction)
        for size in (p for p in page_sizes if p > 1):
            kept[f"{scope}/page{size}"] = keep_topk_visible(scores, keep, scope, windows, page_size=size)
    return kept


@torch.no_grad()
def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--keep", type=float, default=0.25)
    parser.add_argument("--scopes", nargs="+", default=["global", "head", "token_layer", "token_model"])
    parser.add_argument("--reductions", nargs="+", default=list(REDUCTIONS), choices=REDUCTIONS)
    parser.add_argument("--page-sizes", nargs="*", type=int, default=[16])
    parser.add_argument("--out", type=Path, default=outputs_root() / "granularity_needles.json")
    args = parser.parse_args()
    cfg = config(
        [
            "benchmark=ruler",
            f"benchmark.tasks=[{args.task}]",
            f"benchmark.samples_per_task={args.samples}",
            f"benchmark.lengths=[{args.length}]",
            "method=kvzap_mlp",
            f"method.keep_ratio={args.keep}",
        ]
    )
    loaded = load_model(cfg.model)
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    method = build(cfg.method)
    samples = load_samples(cfg.benchmark, loaded.tokenizer)
    windows = session.windows or [None] * len(session.adapter.layers)  # a sliding layer budgets what it shows
    rows: list[dict[str, Any]] = []
    bar = Progress(len(samples), "contexts", unit="context")
    for sample in samples:
        prompt = prompts_of(loaded.tokenizer, sample, Settings())[0]
        answers = sample.questions[0].references
        spellings = [loaded.tokenizer(p + a, add_special_tokens=False).input_ids for a in answers for p in (" ", "")]
        needle = needle_positions(prompt.context_ids[0], spellings)
        if not needle:
            raise KVResearchError(f"{sample.record_id(0)}: its answer {answers} is not in the context's tokens.")
        _, scores = method.scores(session, prompt.context_ids.to(session.device))
        scores = protect_window([s.cpu() for s in scores], method.window, method.sinks)
        n = prompt.context_ids.shape[1]
        kept = selections(scores, args.keep, args.scopes, args.reductions, windows, tuple(args.page_sizes))
        by_scope = {label: scope_summary(rows_kept, needle, n) for label, rows_kept in kept.items()}
        rows.append({"id": sample.record_id(0), "needle_tokens": len(needle), "context": n, "scopes": by_scope})
        bar.update()
    bar.close()
    labels = list(rows[0]["scopes"])
    mean = {key: {label: sum(r["scopes"][label][key] for r in rows) / len(rows) for label in labels}
            for key in ("heads_with_needle", "needle_tokens_kept")}  # fmt: skip
    report = {"task": args.task, "length": args.length, "keep": args.keep, "model": str(cfg.model.name),
              "surrogate": str(cfg.paths.surrogate_mlp), "window": method.window, "sinks": method.sinks,
              "heads_with_needle_mean": mean["heads_with_needle"],
              "needle_tokens_kept_mean": mean["needle_tokens_kept"], "contexts": rows}  # fmt: skip
    write_json(args.out, report)
    for label in labels:
        spread = [r["scopes"][label]["kept_share"] for r in rows]
        print(
            f"{label:22} heads keeping the needle {100 * mean['heads_with_needle'][label]:5.1f}%  needle tokens "
            f"kept {100 * mean['needle_tokens_kept'][label]:5.1f}%  kept share per head "
            f"min {min(s['min'] for s in spread):.3f} max {max(s['max'] for s in spread):.3f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
