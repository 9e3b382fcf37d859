"""Stage ``needle``: the full-cache model answers needle questions in the essay haystack.

``python -m kvresearch.stages.needle model=smollm2_135m needle.context_tokens=2048``
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from kvresearch.benchmarks.needle import needle_sample
from kvresearch.errors import KVResearchError
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.models.session import dense_answer
from kvresearch.prompts import build_prompt
from kvresearch.runs import RunContext, stage_main, write_json


def run(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """Answer one needle question per depth; report accuracy, prefill time and decode speed."""
    loaded = load_model(cfg.model)
    if loaded.tokenizer is None:
        raise KVResearchError(f"model '{loaded.name}' has no tokenizer; the needle stage needs text.")
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    rows = []
    for i, depth in enumerate(cfg.needle.depths):
        sample = needle_sample(loaded.tokenizer, cfg.needle.context_tokens, float(depth), seed=cfg.seed + i)
        prompt = build_prompt(loaded.tokenizer, sample["context"], sample["question"], sample["answer_prefix"])
        if prompt.n_tokens + sample["max_new_tokens"] > cfg.model.max_context:
            raise KVResearchError(
                f"needle.context_tokens={cfg.needle.context_tokens} gives prompts of {prompt.n_tokens} tokens "
                f"(+ {sample['max_new_tokens']} to generate), over model.max_context={cfg.model.max_context}: "
                "lower needle.context_tokens. Nothing was truncated."
            )
        gen = dense_answer(session, prompt, sample["max_new_tokens"])
        text = loaded.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        row = {
            "depth": float(depth),
            "context_tokens": gen.context_len,
            "expected": sample["answer"][0],
            "prediction": text.strip(),
            "correct": sample["answer"][0] in text,
            "prefill_s": round(gen.prefill_s, 3),
            "decode_tokens_per_s": round(gen.decode_tokens_per_s, 2),
        }
        rows.append(row)
        ctx.tracker.log(row, step=i)
        print(
            f"[needle] depth {row['depth']:.2f} | {row['context_tokens']} tokens | prefill {row['prefill_s']:.2f} s | "
            f"decode {row['decode_tokens_per_s']:.1f} tok/s | expected {row['expected']} | "
            f"answer {row['prediction']!r} | {'correct' if row['correct'] else 'WRONG'}",
            flush=True,
        )
    write_json(ctx.out_dir / "predictions.json", rows)
    n = len(rows)
    return {
        "model": loaded.name,
        "samples": n,
        "accuracy": sum(r["correct"] for r in rows) / n,
        "mean_prefill_s": sum(r["prefill_s"] for r in rows) / n,
        "mean_decode_tokens_per_s": sum(r["decode_tokens_per_s"] for r in rows) / n,
    }


main = stage_main("needle", run)

if __name__ == "__main__":
    main()
