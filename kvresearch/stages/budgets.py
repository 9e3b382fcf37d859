"""Stage ``budgets``: non-uniform head budgets for Attention Matching by measured sensitivity.

``python -m kvresearch.stages.budgets`` (``make stage-budgets``) writes ``budgets.json`` ({"L{layer}H{kv_head}":
share}, the reference's format) and ``sensitivities.json`` into its run folder; compaction then takes
``method.budgets.heads=<run folder>/budgets.json``. See ``kvresearch/budget_search.py`` for the procedure.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvresearch.answering import Settings, prompts_of
from kvresearch.benchmarks.loader import load_samples
from kvresearch.budget_search import Context, allocate, full_answers, sensitivities
from kvresearch.errors import KVResearchError
from kvresearch.methods.attention_matching import AttentionMatching
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.runs import RunContext, build, stage_main, write_json


def run(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """Full answers, per-head loss curves, greedy exchange; the budget file."""
    method = build(cfg.method)
    ctx.inputs.add_all(method.inputs())
    if not isinstance(method, AttentionMatching):
        raise KVResearchError(f"budgets are searched for an Attention Matching method, got method={method.name}.")
    search = cfg.budgets
    levels = [float(x) for x in search.levels]
    start = float(search.start)
    loaded = load_model(cfg.model)
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    shape = {"query_aware": False, "fidelity": False, "max_new_tokens": int(search.new_tokens)}
    settings = Settings.from_config(shape, cfg.model, cfg.benchmark)  # the benchmark's prompt budget cuts too
    samples = load_samples(cfg.benchmark, loaded.tokenizer)[: int(search.contexts)]
    contexts = [Context(prompts_of(loaded.tokenizer, s, settings)[: int(search.questions)]) for s in samples]
    for context in contexts:
        full_answers(session, context, int(search.new_tokens))
    loss = sensitivities(session, method, contexts, levels, start)
    result = allocate(loss, levels, start)
    write_json(ctx.out_dir / "sensitivities.json", {f"L{i}H{h}@{r:g}": v for ((i, h), r), v in sorted(loss.items())})
    write_json(ctx.out_dir / "budgets.json", result["shares"])
    return {
        "model": {k: cfg.model.get(k) for k in ("name", "dtype", "device")},
        "method": method.describe(),
        "budgets": OmegaConf.to_container(search, resolve=True),
        "predicted_loss_change": result["predicted_loss_change"],
        "ratios": result["ratios"],
    }


main = stage_main("budgets", run)

if __name__ == "__main__":
    main()
