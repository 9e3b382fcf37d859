"""The device check's measurements (``device_check.py`` runs them): one function per step, shapes in the docstrings.

Each step takes the session, the plan (contexts, new tokens, ...) and a :class:`Clock`, and returns rows of numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from importlib import metadata
from typing import Any

import torch

from kvresearch.models import Session
from kvresearch.models.cache import RaggedCache
from kvresearch.models.ragged_attention import ragged_attention_enabled
from kvresearch.prompts import RepeatPrompt

KEEPS = (1.0, 1 / 3, 0.1)
WINDOW = 32  # KVzap's sliding window of recent tokens, never pruned


class Clock:
    """Wall time with the device synchronised, so GPU work is counted where it happens."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        """Wait for queued GPU work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """``fn()`` and its seconds."""
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start


def random_ids(n: int, seed: int, vocab: int = 49152) -> torch.Tensor:
    """(1, n) random token ids below 49,152 (valid for every paper vocabulary and the borrowed tokenizer)."""
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def repeat_ids(n: int, seed: int) -> RepeatPrompt:
    """KVzip's repeat prompt on random ids: an 8-token head, the context, a 16-token instruction, the context again.

    No tokenizer is needed: the check measures speed, so the words do not matter.
    """
    head, context, instruction = random_ids(8, seed), random_ids(n, seed + 1), random_ids(16, seed + 2)
    ids = torch.cat([head, context, instruction, context], 1)
    return RepeatPrompt(ids, slice(8, 8 + n), slice(24 + n, 24 + 2 * n))


def kept_subset(prefill: Any, keep: float, seed: int) -> list[list[torch.Tensor]]:
    """Per layer and KV head, a seeded random ``keep`` share of the positions, the last ``WINDOW`` always kept."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(prefill.num_layers):
        keys, _ = prefill.kv(layer)
        heads, n = keys.shape[0], keys.shape[1]
        count = max(WINDOW, math.ceil(keep * n))
        rows = []
        for _ in range(heads):
            old = torch.randperm(n - WINDOW, generator=g)[: count - WINDOW]
            rows.append(torch.cat([old, torch.arange(n - WINDOW, n)]).sort().values.to(keys.device))
        out.append(rows)
    return out


def decode(session: Session, cache: RaggedCache, tokens: list[int], clock: Clock) -> tuple[torch.Tensor, float]:
    """Feed ``tokens`` one at a time after ``cache``: their logits (steps, vocab) float32, and tokens/s."""
    device, logits = session.device, []

    def run() -> None:
        with ragged_attention_enabled(session.model), torch.no_grad():
            for token in tokens:
                step = torch.tensor([[token]], device=device)
                out = session.model(input_ids=step, past_key_values=cache, use_cache=True).logits[0, -1]
                logits.append(out.float())

    _, seconds = clock(run)
    return torch.stack(logits), len(tokens) / seconds


def step_decode(session: Session, plan: dict[str, Any], clock: Clock, triton_ok: bool) -> list[dict[str, Any]]:
    """Triton against torch on the same compacted ragged caches."""
    rows = []
    for n in plan["contexts"]:
        prefill = session.dense_prefill(random_ids(n, 0))
        tokens = random_ids(plan["new_tokens"], 1)[0].tolist()
        for keep in KEEPS:
            row: dict[str, Any] = {"context": n, "kept": round(keep, 4)}
            keep_rows = None if keep == 1.0 else kept_subset(prefill, keep, seed=2)
            results = {}
            for kernel in ("torch", "triton") if triton_ok else ("torch",):
                cache = prefill.ragged(keep_rows)
                cache.compact()
                decode(session, prefill.ragged(keep_rows).use_kernel(kernel), tokens[:1], clock)  # warm-up
                results[kernel] = decode(session, cache.use_kernel(kernel), tokens, clock)
                row[f"{kernel}_tokens_per_s"] = round(results[kernel][1], 2)
                row["kv_bytes_kept"] = cache.kv_bytes()["allocated"]
            if "triton" in results:
                row["max_abs_logit_diff"] = float((results["triton"][0] - results["torch"][0]).abs().max())
            rows.append(row)
            print("[device_check] decode", row, flush=True)
        del prefill
    return rows


def random_surrogates(session: Session) -> dict[str, Any]:
    """Seeded random KVzap surrogates (MLP of width hidden/8, linear) of the model's shape."""
    from kvresearch.surrogate import Surrogate, SurrogateConfig

    a = session.adapter
    out = {}
    for kind in ("mlp", "linear"):
        torch.manual_seed(0)
        config = SurrogateConfig(kind, a.num_layers, a.hidden_size, a.num_kv_heads)
        out[kind] = Surrogate(config).to(session.device, session.model.dtype).eval()
    return out


def threshold_for(session: Session, surrogate: Any, ids: torch.Tensor, keep: float) -> float:
    """The log-space threshold that keeps about ``keep`` of the entries outside the window on ``ids``."""
    inputs = session.dense_prefill(ids, record_inputs=True).inputs
    with torch.no_grad():
        scores = torch.cat([surrogate.forward_layer(i, h[0, :-WINDOW]).float().flatten() for i, h in inputs.items()])
    sample = scores[
        torch.randperm(len(scores), generator=torch.Generator().manual_seed(0))[:1_000_000].to(scores.device)
    ]
    return float(sample.quantile(1 - keep))


def kvzap_prefill(session: Session, ids: torch.Tensor, pruner: Any | None) -> RaggedCache:
    """One prefill of ``ids`` into a ragged cache, pruned by ``pruner`` (None: the full cache)."""
    cache = session.new_cache()
    attached = pruner.attach(session.adapter, cache) if pruner else nullcontext()
    with ragged_attention_enabled(session.model), torch.no_grad(), attached:
        session.model(input_ids=ids.to(session.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.compact()
    return cache


def step_kvzap(session: Session, plan: dict[str, Any], clock: Clock, taus: dict[str, float]) -> list[dict[str, Any]]:
    """KVzap's prefill against the plain one, per context and surrogate."""
    from kvresearch.methods.kvzap import ThresholdPruner

    rows = []
    surrogates = random_surrogates(session)
    for n in plan["contexts"]:
        ids = random_ids(n, 0)
        kvzap_prefill(session, ids[:, :256], None)  # warm-up
        _, plain = clock(partial(kvzap_prefill, session, ids, None))
        for kind, surrogate in surrogates.items():
            pruner = ThresholdPruner(surrogate, taus[kind], WINDOW)
            cache, seconds = clock(partial(kvzap_prefill, session, ids, pruner))
            row = {
                "context": n,
                "surrogate": kind,
                "plain_prefill_s": round(plain, 4),
                "kvzap_prefill_s": round(seconds, 4),
                "overhead": round(seconds / plain - 1, 4),
                "prune_ratio": round(cache.stats()["prune_ratio"], 4),
                "flops_per_token_per_layer": surrogate.flops_per_token(),
            }
            rows.append(row)
            print("[device_check] kvzap", row, flush=True)
    return rows


def step_memory(session: Session, plan: dict[str, Any], clock: Clock, taus: dict[str, float]) -> dict[str, Any]:
    """Peak GPU bytes of a prefill and decoding: full cache, KVzap ~3x (evicting), kvpress's DMSPress (masking)."""
    from kvresearch.methods.baselines import kvzap_press
    from kvresearch.methods.kvzap import ThresholdPruner
    from kvresearch.models.presses import kvpress_prefill

    n = max(plan["contexts"])
    ids, tokens = random_ids(n, 0), random_ids(plan["new_tokens"], 1)[0].tolist()
    surrogate = random_surrogates(session)["mlp"]
    cuda = session.device.type == "cuda"
    out: dict[str, Any] = {"context": n, "threshold": taus["mlp"]}

    def peak(fn: Callable[[], Any]) -> int | None:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(session.device)
        fn()
        return int(torch.cuda.max_memory_allocated(session.device)) if cuda else None

    def ours(pruner: Any | None) -> None:
        cache = kvzap_prefill(session, ids, pruner)
        out[f"{'kvzap' if pruner else 'full'}_kv_bytes"] = cache.kv_bytes()["allocated"]
        decode(session, cache, tokens, clock)

    def kvpress() -> None:
        out["kvpress_kv_bytes"] = kvpress_prefill(session, ids, kvzap_press(surrogate, taus["mlp"], WINDOW))[1]

    out["full_peak_bytes"] = peak(lambda: ours(None))
    out["kvzap_peak_bytes"] = peak(lambda: ours(ThresholdPruner(surrogate, taus["mlp"], WINDOW)))
    try:
        out["kvpress_dms_peak_bytes"] = peak(kvpress)
    except (KeyError, TypeError, AttributeError) as error:  # kvpress 0.5.5 reads cache_position, gone in 5.17
        out["kvpress_dms_peak_bytes"] = None
        out["kvpress_refused"] = f"{type(error).__name__}: {error} (kvpress {metadata.version('kvpress')})"
    print("[device_check] memory", out, flush=True)
    return out


def step_extraction(session: Session, plan: dict[str, Any], clock: Clock) -> dict[str, Any]:
    """KVzip+ oracle scores of every context position from the double-pass prefill."""
    from kvresearch.capture import oracle_scores

    n = plan["extract_tokens"]
    prompt = repeat_ids(n, 3)
    with torch.no_grad():
        oracle_scores(session.adapter, repeat_ids(128, 4))  # warm-up
        _, seconds = clock(lambda: oracle_scores(session.adapter, prompt))
    out = {
        "context": n,
        "prompt_tokens": prompt.input_ids.shape[1],
        "seconds": round(seconds, 3),
        "rows_per_s": round(n / seconds, 1),
    }
    print("[device_check] extraction", out, flush=True)
    return out


def step_am(session: Session, plan: dict[str, Any], clock: Clock) -> list[dict[str, Any]]:
    """One layer's AM compaction (every KV head) from repeat-prefill queries, keep 0.1."""
    from kvresearch.methods.attention_matching import AttentionMatching
    from kvresearch.models.hooks import attention_calls

    n, a = plan["am_tokens"], session.adapter
    layer = next(i for i, spec in enumerate(a.layers) if spec.sliding_window is None)
    prompt = repeat_ids(n, 5)
    captured: dict[str, torch.Tensor] = {}

    def record(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if index == layer:
            captured.update(
                q=q[0, :, prompt.repeat].detach(),
                k=k[0, :, prompt.context].detach(),
                v=v[0, :, prompt.context].detach(),
            )

    with torch.no_grad(), attention_calls(a, record):
        session.model(input_ids=prompt.input_ids.to(session.device), use_cache=False, logits_to_keep=1)
    rows = []
    for method in (
        AttentionMatching(name="am_highest", keys={"select": "highest"}),
        AttentionMatching(name="am_omp", keys={"select": "omp", "drop_below": -7.0}),
    ):

        def compact(method: AttentionMatching = method) -> None:
            for h in range(a.num_kv_heads):
                q = captured["q"][h * a.group_size : (h + 1) * a.group_size].reshape(-1, a.head_dim)
                q = q[
                    torch.randperm(len(q), generator=torch.Generator().manual_seed(h))[
                        : method.queries.max_per_head
                    ].to(q.device)
                ]
                method.compact_head(
                    q.float(), captured["k"][h].float(), captured["v"][h].float(), a.layers[layer].scaling
                )

        _, seconds = clock(compact)
        rows.append(
            {
                "method": method.name,
                "layer": layer,
                "context": n,
                "keep_ratio": 0.1,
                "kv_heads": a.num_kv_heads,
                "seconds_per_layer": round(seconds, 3),
            }
        )
        print("[device_check] am", rows[-1], flush=True)
    return rows


def step_eval(session: Session, plan: dict[str, Any], taus: dict[str, float]) -> list[dict[str, Any]]:
    """Per-sample seconds of the evaluate stage against kvpress's pipeline (``kvresearch/speed.py``).

    RULER ``niah_single_2`` at the first context (at least 1,024 tokens), ``eval_samples`` samples: the full
    cache, SnapKV at keep 0.5 and KVzap-MLP (the random surrogate at the threshold of the ``kvzap`` step)
    against DMSPress(KVzapPress).
    """
    from hydra import compose, initialize_config_dir

    from kvresearch.answering import Settings
    from kvresearch.benchmarks.loader import load_samples
    from kvresearch.methods.base import FullCache
    from kvresearch.methods.baselines import kvzap_press
    from kvresearch.methods.kvzap import KVzap
    from kvresearch.models import load_model
    from kvresearch.runs import CONF_DIR, build
    from kvresearch.speed import KVpressPipeline, compare, turns

    n = max(min(plan["contexts"]), 1024)  # RULER's template and needle need about a thousand tokens
    lines = ["benchmark=ruler", f"benchmark.lengths=[{n}]", "benchmark.tasks=[niah_single_2]", "method=snapkv",
             f"benchmark.samples_per_task={plan['eval_samples']}", "method.keep_ratio=0.5", "model=qwen3_8b",
             "model.source=random", "model.cut=tiny", "model.device=cpu", "model.dtype=float32"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", lines)
    if session.tokenizer is None:  # a random model: RULER's prompts need words, so borrow the paper models' tokenizer
        try:
            tokenizer = load_model(cfg.model).tokenizer  # the tiny cut on the CPU: only its tokenizer is used
        except Exception as error:  # the GPU image may lack the embedded model's package
            return [{"method": "-", "skipped": f"no tokenizer to build RULER prompts: {type(error).__name__}: {error}"}]
        session = Session(session.adapter, tokenizer)
    samples = load_samples(cfg.benchmark, session.tokenizer)
    settings = Settings(fidelity=False, max_new_tokens=plan["new_tokens"])
    surrogate, tau = random_surrogates(session)["mlp"], taus["mlp"]
    methods = {
        "full": (FullCache(), None),
        "snapkv": (build(cfg.method), build(cfg.method).press),
        "kvzap_mlp": (KVzap(surrogate=surrogate, threshold=tau, window=WINDOW), kvzap_press(surrogate, tau, WINDOW)),
    }
    pipeline, rows = KVpressPipeline(session), []
    for name, (method, press) in methods.items():
        try:
            row = compare(name, n, turns(session, pipeline, method, press, samples, settings), {})
        except (KeyError, TypeError, AttributeError) as error:  # kvpress 0.5.5 against a newer transformers
            row = {"method": name, "tokens": n, "kvpress_refused": f"{type(error).__name__}: {error}"}
        row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        for side in ("ours", "kvpress"):
            if side in row:
                row[side] = {k: round(v, 4) for k, v in row[side].items() if k != "predictions"}
        rows.append(row)
        print("[device_check] eval", row, flush=True)
    return rows
