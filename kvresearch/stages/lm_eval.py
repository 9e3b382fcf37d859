"""Stage ``lm_eval``: lm-eval tasks on a compressed cache (the ``kvresearch`` lm-eval model).

``python -m kvresearch.stages.lm_eval method=kvzap_mlp lm_eval.tasks=[kvr_quality,kvr_longbench_qasper]``;
sweep methods with ``-m``. The run folder gets lm-eval's results JSON (``lm_eval_results.json``), the
per-sample logs (``samples_<task>.jsonl``) and lm-eval's request cache, from which a killed run resumes.
"""

from __future__ import annotations

import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvresearch.lmeval import TASKS_DIR, KVResearchLM
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.runs import RunContext, build, stage_main, write_atomic


def _json(value: Any, indent: int | None = 1) -> str:
    from lm_eval.utils import handle_non_serializable

    return json.dumps(value, indent=indent, default=handle_non_serializable, ensure_ascii=False)


def run(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """Evaluate the tasks; write lm-eval's results and samples; return the scores."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    opts = cfg.lm_eval
    method = build(cfg.method)  # options are checked before the model loads
    ctx.inputs.add_all(method.inputs())
    loaded = load_model(cfg.model)
    lm = KVResearchLM(
        Session(ModelAdapter(loaded.model), loaded.tokenizer),
        method,
        query_aware=bool(opts.query_aware),
        document_split=opts.document_split,
        max_length=opts.max_length,
        seed=int(cfg.seed),
    )
    metadata = OmegaConf.to_container(opts.metadata, resolve=True)
    results = simple_evaluate(
        model=lm,
        tasks=list(opts.tasks),
        num_fewshot=opts.num_fewshot,
        limit=opts.limit,
        gen_kwargs=OmegaConf.to_container(opts.gen_kwargs, resolve=True) if opts.gen_kwargs else None,
        apply_chat_template=bool(opts.apply_chat_template),
        use_cache=str(ctx.out_dir / "lm_eval_cache"),
        task_manager=TaskManager(include_path=str(TASKS_DIR), metadata=metadata),
        bootstrap_iters=int(opts.bootstrap_iters),
        random_seed=int(cfg.seed),
        log_samples=True,
    )
    assert results is not None  # a single process is always rank 0
    for task, rows in results.pop("samples", {}).items():
        write_atomic(ctx.out_dir / f"samples_{task}.jsonl", "".join(_json(row, None) + "\n" for row in rows))
    write_atomic(ctx.out_dir / "lm_eval_results.json", _json(results) + "\n")
    return {
        "model": {k: cfg.model.get(k) for k in ("name", "dtype", "device", "attn_implementation")},
        "method": method.describe(),
        "lm_eval": OmegaConf.to_container(opts, resolve=True),
        "results": json.loads(_json(results["results"])),
        "documents_compressed": lm.compressions,
    }


main = stage_main("lm_eval", run)

if __name__ == "__main__":
    main()
