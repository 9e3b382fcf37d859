"""Stage ``evaluate``: one model x one method x one benchmark (``kvresearch/evaluation.py`` does the work).

``python -m kvresearch.stages.evaluate method=kvzap_mlp method.threshold=-4``; sweep with ``-m``, e.g.
``-m method=snapkv,kvzap_mlp,am_omp method.keep_ratio=0.5,0.25``. Across jobs: ``-m evaluate.num_shards=N
evaluate.shard_index=0,...,N-1`` answers contiguous blocks of the samples, then the same command with
``evaluate.num_shards=N`` alone merges them (``kvresearch/sharding.py``); its metrics are the single job's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvresearch.answering import Settings
from kvresearch.benchmarks.loader import calibration_samples, load_samples
from kvresearch.data.memo import TensorMemo
from kvresearch.evaluation import (
    ANSWER_GROUPS,
    SHARD_KEYS,
    evaluate,
    merge_predictions,
    prepare,
    reference_answers,
    summarize,
)
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.runs import RunContext, build, stage_main
from kvresearch.runs.resolve import full_cache_run
from kvresearch.sharding import merging, part_range, part_runs


def run(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """Compress, answer and score every sample; compare with the full cache; summarize."""
    method = build(cfg.method)  # options are checked before the model loads
    ctx.inputs.add_all(method.inputs())
    settings = Settings.from_config(cfg.evaluate, cfg.model, cfg.benchmark)
    recorded = {  # what the full-cache answers depend on: a reference run must match it
        "model": {k: cfg.model.get(k) for k in ("name", "dtype", "device", "attn_implementation")},
        "benchmark": OmegaConf.to_container(cfg.benchmark, resolve=True),
    }
    evaluate_cfg = OmegaConf.to_container(cfg.evaluate, resolve=True)
    shards, index = int(cfg.evaluate.num_shards), cfg.evaluate.shard_index
    if merging(shards, index):
        parts = part_runs(ctx.out_dir, "evaluate", shards, cfg.evaluate.parts, ctx.inputs)
        records, first = merge_predictions(ctx.out_dir, parts, recorded)
        merged = {"method": first["method"], "evaluate": evaluate_cfg, "reference_run": first["reference_run"]}
        return {**recorded, **merged, "merged_parts": [str(p) for p in parts], **summarize(records)}
    # A part of a sharded run takes the merged full-cache run split the same way, else an unsplit one.
    explicit, drops = cfg.evaluate.reference_run, (SHARD_KEYS[:1], SHARD_KEYS)
    find = lambda: full_cache_run("evaluate", explicit, ctx.out_dir, ANSWER_GROUPS, ctx.inputs, drops, True)
    folder = find() if settings.fidelity else None
    reference = reference_answers(folder, recorded) if folder is not None and folder != ctx.out_dir else None
    loaded = load_model(cfg.model)
    memo = TensorMemo(Path(cfg.paths.root) / "memo" / f"{cfg.model.name}-{cfg.model.dtype}")  # shared by its cells
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer, memo)
    samples = load_samples(cfg.benchmark, loaded.tokenizer)[: cfg.evaluate.max_samples or None]
    calibration = None
    if method.needs_held_out():  # e.g. KVzap's threshold calibrated to a target prune ratio
        held_out = calibration_samples(cfg.benchmark, loaded.tokenizer, samples, int(cfg.evaluate.calibration_samples))
        calibration = prepare(session, method, held_out, settings)
    samples = [samples[i] for i in part_range(len(samples), shards, int(index or 0), "evaluate")]
    records = evaluate(session, method, samples, ctx.out_dir, settings, reference, ctx.tracker)
    return {
        **recorded,
        "method": method.describe(),
        "evaluate": evaluate_cfg,
        "reference_run": str(folder or ""),
        "calibration": calibration,
        **summarize(records),
    }


main = stage_main("evaluate", run)

if __name__ == "__main__":
    main()
