"""Fidelity of long generations: what compression does to a generation, on any model.

For a prompt and a method, both caches generate ``new_tokens`` greedily with end tokens ignored (the
compressed one compressing while it decodes, if the method does):

* ``first_divergence``: the index of the first token where the compressed generation leaves the
  full-cache one (``new_tokens`` when they never part);
* ``token_agreement``: the share of positions with the same token;
* ``full_logppl``: the mean negative log-likelihood of the full-cache generation, teacher-forced one
  token at a time under the compressed cache (compression while decoding acts as while generating);
  under the full cache itself it is the floor every method is compared with;
* the prune ratio at the end (evicted share of every position seen, context and generated) and the
  KV bytes held (peak and final).

This is what a small model can tell where its task accuracy is zero (AIME on a 135M model).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvresearch.evaluation import Predictions, prompt_sha1
from kvresearch.methods.base import FullCache, Method
from kvresearch.models.session import Session
from kvresearch.progress import Progress
from kvresearch.prompts import Prompt

RECORD = (
    "id",
    "prompt_sha1",
    "prompt_tokens",
    "tokens",
    "first_divergence",
    "token_agreement",
    "full_logppl",
    "prune_ratio",
)


def agreement(ours: list[int], reference: list[int]) -> tuple[int, float]:
    """First divergence index (len when identical over the shorter) and the share of equal positions."""
    n = min(len(ours), len(reference))
    first = next((i for i in range(n) if ours[i] != reference[i]), n)
    same = sum(a == b for a, b in zip(ours[:n], reference[:n], strict=True))
    return first, same / max(len(reference), 1)


def measure(
    session: Session, method: Method, prompt: Prompt, new_tokens: int, reference: list[int] | None = None
) -> dict[str, Any]:
    """One prompt: the method's generation against the full cache's (``reference``, or generated here)."""
    cache = method.compress(session, prompt)
    decode = lambda c: method.decode_context(session, c)
    out = session.generate(cache, prompt.question_ids, new_tokens, decode_context=decode, eos=False)
    if reference is None:  # the full cache's generation: this one, or made here
        full = None if method.lossless else FullCache().compress(session, prompt)
        reference = (
            out.tokens if full is None else session.generate(full, prompt.question_ids, new_tokens, eos=False).tokens
        )
    logprobs = session.forced_logprobs(cache, prompt.question_ids, reference, decode)
    first, same = agreement(out.tokens, reference)
    return {
        "prompt_sha1": prompt_sha1(prompt, new_tokens),
        "prompt_tokens": prompt.n_tokens,
        "tokens": out.tokens,
        "first_divergence": first,
        "token_agreement": same,
        "full_logppl": float(-logprobs.mean()),
        "prune_ratio": out.kv.prune_ratio,
        "context_prune_ratio": cache.stats()["prune_ratio"],
        "decode_s": out.seconds,
        **out.kv.as_record(),
    }


def run_prompts(
    session: Session,
    method: Method,
    prompts: Mapping[str, Prompt],
    new_tokens: int,
    out_dir: Path,
    references: Mapping[str, list[int]] | None = None,
) -> list[dict[str, Any]]:
    """Every prompt (by id), resumable: one line per prompt in ``generations.jsonl``."""
    records = Predictions(out_dir / "generations.jsonl", RECORD)
    done = records.load()
    bar = Progress(len(prompts), f"fidelity {method.name}", unit="prompt")
    for pid, prompt in prompts.items():
        if pid not in done:
            reference = None if method.lossless else (references or {}).get(pid)
            record = {"id": pid, **measure(session, method, prompt, new_tokens, reference)}
            records.append(record)
            done[pid] = record
        bar.update(1, agreement=f"{done[pid]['token_agreement']:.2f}")
    bar.close()
    return [done[pid] for pid in prompts]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over prompts."""
    keys = ("first_divergence", "token_agreement", "full_logppl", "prune_ratio", "kv_bytes_peak_kept", "decode_s")
    mean = lambda key: sum(float(r[key]) for r in records if r.get(key) is not None) / max(len(records), 1)
    return {"prompts": len(records), **{key: mean(key) for key in keys}}
