"""Stage ``fidelity``: long generations of one method against the full cache's (``kvresearch/fidelity.py``).

``python -m kvresearch.stages.fidelity method=kvzap_mlp method.decoding=true``; the full-cache generations
come from the sibling ``method=full`` run when it is finished (run it first), else are made here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvresearch.answering import Settings, check_lengths, prompts_of
from kvresearch.benchmarks.loader import load_samples
from kvresearch.errors import KVResearchError
from kvresearch.evaluation import Predictions, prompt_sha1
from kvresearch.fidelity import RECORD, run_prompts, summarize
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.runs import RunContext, build, stage_main
from kvresearch.runs.resolve import full_cache_run

GROUPS = ("model", "benchmark", "fidelity")  # what a full-cache generation depends on


def references(cfg: DictConfig, ctx: RunContext) -> tuple[Path | None, dict[str, dict[str, Any]]]:
    """The finished full-cache run and its records by prompt id (none when there is no such run)."""
    folder = full_cache_run("fidelity", cfg.fidelity.reference_run, ctx.out_dir, GROUPS, ctx.inputs)
    if folder is None or folder == ctx.out_dir.resolve():
        return None, {}
    return folder, Predictions(folder / "generations.jsonl", RECORD).load()


def run(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """Generate under the method and under the full cache; compare; summarize."""
    method = build(cfg.method)
    new_tokens = int(cfg.fidelity.new_tokens)
    settings = Settings(max_context=cfg.model.get("max_context"), max_new_tokens=new_tokens)
    ctx.inputs.add_all(method.inputs())
    folder, found = references(cfg, ctx)
    loaded = load_model(cfg.model)
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    samples = load_samples(cfg.benchmark, loaded.tokenizer)[: int(cfg.fidelity.prompts)]
    prompts = [prompts_of(loaded.tokenizer, s, settings)[:1] for s in samples]
    check_lengths(samples, prompts, settings)
    by_id = {s.record_id(0): p[0] for s, p in zip(samples, prompts, strict=True)}
    reference = {}
    for pid, record in found.items():
        if pid in by_id:
            if record["prompt_sha1"] != prompt_sha1(by_id[pid], new_tokens):
                raise KVResearchError(
                    f"The full-cache run {folder} generated {pid} from another prompt or length: re-run it with "
                    "force=true, or set fidelity.reference_run."
                )
            reference[pid] = list(record["tokens"])
    records = run_prompts(session, method, by_id, new_tokens, ctx.out_dir, reference)
    return {
        "model": {k: cfg.model.get(k) for k in ("name", "dtype", "device")},
        "benchmark": OmegaConf.to_container(cfg.benchmark, resolve=True),
        "method": method.describe(),
        "fidelity": OmegaConf.to_container(cfg.fidelity, resolve=True),
        "reference_run": str(folder or ""),
        "overall": summarize(records),
    }


main = stage_main("fidelity", run)

if __name__ == "__main__":
    main()
