"""GPU-hours of each experiment's hub variant, from its cells and per-token costs (``make sizing``).

For every cell of ``conf/experiment/<name>.yaml``'s hub variant (model x method x budget point), the workload of
its benchmark (contexts, context tokens, answers per context, new tokens per answer: ``WORKLOADS``, the published
dataset sizes) times the cost of one context:

* prefill: ``2 P C + 2 L H d C^2`` FLOPs (projections and MLPs; causal attention, both products), at
  ``PREFILL_FLOPS`` achieved;
* compression on top of the prefill: KVzip+ and Attention Matching run the repeat prompt (a prefill of 2C, plus
  the KVzip+ scores), AM's self-study also decodes ``SELF_STUDY_TOKENS``; KVzap and the presses add nothing
  that counts at this scale;
* decoding: memory-bound at batch 1, ``(weight bytes + KV bytes) / DECODE_BANDWIDTH`` per token.

Where ``docs/results/gpu/device_check.json`` holds a measurement of the same architecture (a GPU run of the device
check), its measured prefill and decode rates replace the estimates for that model, scaled by context; every
number says which it is. Model sizes come from the vendored architectures (built on the meta device).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from kvresearch.models.architecture import build_config, parameter_count, text_config

PREFILL_FLOPS = 400e12  # bf16 FLOP/s achieved in a long prefill on one H100 (40% of its dense peak): assumed
DECODE_BANDWIDTH = 2.3e12  # bytes/s read per decoding step on one H100 (70% of 3.35 TB/s): assumed
SELF_STUDY_TOKENS = 5 * 128  # AM's self-study answers: five prompts of 128 tokens
# benchmark -> (contexts, context tokens, answers per context, new tokens per answer, source of the numbers).
# RULER's come from the cell's own settings (tasks x samples x lengths); the others are the full hub datasets.
WORKLOADS: dict[str, tuple[int, int, int, int, str]] = {
    "longbench": (3750, 9000, 1, 64, "LongBench v1, 16 English tasks: 3,750 samples, mean context ~9k tokens"),
    "longbench_v2": (503, 32000, 1, 64, "LongBench v2: 503 questions, contexts cut to 32k tokens"),
    "quality": (230, 6000, 9, 16, "QuALITY dev: 230 articles (~6k tokens), 2,086 questions"),
    "longhealth": (20, 12000, 20, 32, "LongHealth: 20 patients (~12k tokens each), 400 questions"),
    "aime25": (30, 200, 8, 32000, "AIME 2025: 30 problems, 8 samples each, up to 32k new tokens"),
}


@dataclass(frozen=True)
class Shape:
    """What the cost model needs of an architecture."""

    params: int
    layers: int
    attn_width: int  # query heads x head_dim
    kv_bytes_per_token: int  # bf16 keys and values over all layers

    def prefill_flops(self, tokens: int) -> float:
        """FLOPs of a prefill of ``tokens``."""
        return 2 * self.params * tokens + 2 * self.layers * self.attn_width * tokens**2

    def decode_s(self, context: int) -> float:
        """Seconds per decoded token after ``context`` tokens (memory-bound estimate)."""
        return (2 * self.params + self.kv_bytes_per_token * context) / DECODE_BANDWIDTH


@cache
def shape(architecture: str) -> Shape:
    """Parameters and attention sizes of a vendored architecture (meta device: no memory)."""
    config = build_config(text_config(architecture))
    params = parameter_count(config)
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    return Shape(params, config.num_hidden_layers, config.num_attention_heads * config.head_dim, kv)


def workload(benchmark: Any) -> tuple[int, int, int, int, str]:
    """(contexts, context tokens, answers per context, new tokens, source) of a composed benchmark config."""
    if benchmark.name == "ruler":
        tasks, lengths = list(benchmark.tasks), list(benchmark.lengths)
        n = len(tasks) * int(benchmark.samples_per_task)
        return n * len(lengths), int(sum(lengths) / len(lengths)), 1, 64, f"RULER: {len(tasks)} tasks x samples"
    return WORKLOADS[str(benchmark.name)]


def compress_s(method: str, shape_: Shape, context: int, measured: dict[str, float] | None) -> float:
    """Seconds to prefill and compress one context."""
    prefill = (measured or {}).get("prefill_tokens_per_s")
    seconds = context / prefill if prefill else shape_.prefill_flops(context) / PREFILL_FLOPS
    if method.startswith(("kvzip", "am_", "kvpress_kvzip")):
        repeat = shape_.prefill_flops(2 * context) + 2 * shape_.layers * shape_.attn_width * context * 2 * context
        seconds += repeat / PREFILL_FLOPS
    if method.startswith("am_"):
        seconds += SELF_STUDY_TOKENS * shape_.decode_s(context)
    return seconds


def measured_rates(path: Path) -> dict[str, dict[str, float]]:
    """Per architecture, the prefill and decode rates a GPU device check measured (empty where none ran)."""
    if not path.is_file():
        return {}
    report = json.loads(path.read_text())
    if not str(report.get("device", "")).startswith("NVIDIA") or report["settings"].get("cut"):
        return {}
    steps = report["steps"]
    rates: dict[str, float] = {}
    plain = [r for r in steps.get("kvzap", []) if r["surrogate"] == "mlp"]
    if plain:
        longest = max(plain, key=lambda r: r["context"])
        rates["prefill_tokens_per_s"] = longest["context"] / longest["plain_prefill_s"]
    full = [r for r in steps.get("decode", []) if r["kept"] == 1.0]
    if full:
        longest = max(full, key=lambda r: r["context"])
        rates["decode_tokens_per_s"] = longest.get("triton_tokens_per_s") or longest["torch_tokens_per_s"]
    return {report["settings"]["architecture"]: rates}


EXTRACT_DOCUMENTS, EXTRACT_TOKENS = 2400, 8192  # the KVzap paper's 1.2M rows at 500 rows per 8k-token document


def architecture_of(model: str, overrides: tuple[str, ...]) -> str:
    """The vendored architecture a cell runs: its last ``model=`` override, else its model label."""
    named = [o.split("=", 1)[1] for o in overrides if o.startswith("model=")]
    return named[-1] if named else model


def experiment_rows(name: str, rates: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Per model of ``name``'s hub variant: cells, contexts, GPU-hours and whether the rates were measured."""
    from hydra import compose, initialize_config_dir

    from kvresearch import experiment as experiments
    from kvresearch.runs import CONF_DIR

    exp = experiments.load(name)
    per_model: dict[str, dict[str, Any]] = {}
    for cell in experiments.cells(exp, "hub"):
        entry = per_model.setdefault(
            cell.model,
            {"experiment": name, "model": cell.model, "cells": 0, "contexts": 0, "gpu_hours": 0.0, "source": ""},
        )
        architecture = architecture_of(cell.model, cell.overrides)  # a model row's label may name its benchmark
        measured = rates.get(architecture)
        entry["rates"] = "measured" if measured else "estimated"
        s = shape(architecture)
        entry["cells"] += 1
        if cell.stage == "train_surrogate":  # the cell's cost is its extract (one per model, shared by both rows)
            if entry["contexts"] == 0:
                entry["contexts"] = EXTRACT_DOCUMENTS
                entry["gpu_hours"] += EXTRACT_DOCUMENTS * compress_s("kvzip", s, EXTRACT_TOKENS, measured) / 3600
                entry["source"] = f"extraction: {EXTRACT_DOCUMENTS} documents of {EXTRACT_TOKENS} tokens"
            continue
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(cell.stage, overrides=list(cell.overrides))
        contexts, tokens, answers, new_tokens, source = workload(cfg.benchmark)
        if cell.stage == "fidelity":  # one long generation from each of the benchmark's first prompts
            contexts, answers, new_tokens = int(cfg.fidelity.prompts), 1, int(cfg.fidelity.new_tokens)
            source = f"{source.split(':')[0]}: the first {contexts} prompts, {new_tokens} new tokens each"
        else:
            new_tokens = int(cfg.evaluate.get("max_new_tokens") or new_tokens)
        decode_rate = (measured or {}).get("decode_tokens_per_s")
        decode_s = 1 / decode_rate if decode_rate else s.decode_s(tokens)
        method = str(cfg.method.get("name", cell.row))
        seconds = contexts * (compress_s(method, s, tokens, measured) + answers * new_tokens * decode_s)
        entry["contexts"] += contexts
        entry["gpu_hours"] += seconds / 3600
        entry["source"] = source
    return list(per_model.values())


def table(rates: dict[str, dict[str, float]]) -> str:
    """The Markdown sizing table of every experiment's hub variant."""
    from kvresearch import experiment as experiments

    lines = [
        "| experiment | model | cells | contexts | GPU-hours (one H100) | rates | workload |",
        "|---|---|---|---|---|---|---|",
    ]
    totals: dict[str, float] = {}
    for name in experiments.names():
        for row in experiment_rows(name, rates):
            totals[name] = totals.get(name, 0.0) + row["gpu_hours"]
            lines.append(f"| {name} | {row['model']} | {row['cells']} | {row['contexts']:,} | {row['gpu_hours']:,.1f} "
                         f"| {row['rates']} | {row['source']} |")  # fmt: skip
    lines += ["", "| experiment | GPU-hours (one H100) |", "|---|---|"]
    lines += [f"| {name} | {hours:,.1f} |" for name, hours in totals.items()]
    lines.append(f"| **all** | **{sum(totals.values()):,.1f}** |")
    return "\n".join(lines)


def main() -> None:
    """Write docs/results/sizing.md from the experiment configs and docs/results/gpu/device_check.json."""
    root = Path(__file__).resolve().parent.parent
    rates = measured_rates(root / "docs" / "results" / "gpu" / "device_check.json")
    header = [
        "# Sizing: GPU-hours of each experiment's hub variant",
        "",
        "Built by `make sizing` (kvresearch/sizing.py) from `conf/experiment/*.yaml` (every hub cell: model x method x",
        "budget point) and per-token costs. **Rates**: `measured` where a GPU run of the device check",
        "(docs/results/gpu/) measured the architecture; otherwise `estimated`: prefill at an assumed",
        f"{PREFILL_FLOPS / 1e12:.0f} TFLOP/s achieved in bf16 on one H100, decoding memory-bound at an assumed",
        f"{DECODE_BANDWIDTH / 1e12:.1f} TB/s, batch 1; KVzip+ and AM add their repeat prefill (AM its self-study).",
        "Workloads are the full hub datasets (the last column); batching, several GPUs per model (Qwen3-32B) and",
        "early stops are not modelled. Read these as orders of magnitude until the device check has run on a GPU.",
        "",
    ]
    out = root / "docs" / "results" / "sizing.md"
    out.write_text("\n".join(header) + "\n" + table(rates) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
