"""The prepared device check: what a first GPU minute should measure, at the papers' shapes, with no hub.

On a random-weight paper architecture (Qwen3-8B in bfloat16 by default; ``--plan tiny`` is its tiny cut on the
CPU, which the test suite runs so that this never rots), in order of priority:

1. ``decode``: the Triton decode kernel against the torch path (sdpa per KV head) on the same ragged cache,
   teacher-forced on the same tokens: max abs logit difference and decode tokens/s at each context with 1x, 3x
   and 10x of the entries kept (a seeded random subset per layer and head, compacted: real eviction);
2. ``kvzap``: KVzap's prefill overhead with random MLP and linear surrogates of the reference's width (hidden/8)
   against a plain prefill through the same cache, the threshold set to keep about a third;
3. ``memory``: peak GPU memory of a prefill plus ``new_tokens`` decoding steps: full cache, KVzap at ~3x with
   real eviction, and kvpress's DMSPress(KVzapPress) with the same surrogate and threshold (it only masks);
4. ``extraction``: KVzip+ oracle rows/s (the double-pass prefill and the blocked scoring) at ``extract_tokens``;
5. ``am``: AM-HighestAttnKeys and AM-OMP compaction time of one layer (every KV head, repeat queries) at
   ``am_tokens``, keep 0.1;
6. ``eval``: per-sample seconds of the evaluate stage against kvpress's own pipeline on ``eval_samples`` RULER
   samples at the first context (full cache, SnapKV at keep 0.5, KVzap-MLP against DMSPress(KVzapPress)),
   predictions compared item by item (``kvresearch/speed.py``, as ``make bench-eval``).

A step starts only while the time budget lasts; what does not fit is listed under ``cut``, with the reason.
Writes ``device_check.json`` and ``device_check.md`` into ``--out``.

    python -m kvresearch.device_check --out "$OUT"            # on a GPU: Qwen3-8B shape, bf16, 8k and 32k
    python -m kvresearch.device_check --out /tmp/dc --plan tiny  # anywhere: the tiny cut on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from kvresearch.device_steps import (
    KEEPS,
    WINDOW,
    Clock,
    random_ids,
    random_surrogates,
    step_am,
    step_decode,
    step_eval,
    step_extraction,
    step_kvzap,
    step_memory,
    threshold_for,
)
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.models.architecture import text_config

PLANS: dict[str, dict[str, Any]] = {
    "gpu": {
        "architecture": "qwen3_8b",
        "cut": None,
        "dtype": "bfloat16",
        "device": "cuda",
        "contexts": [8192, 32768],
        "new_tokens": 32,
        "extract_tokens": 8192,
        "am_tokens": 8192,
        "eval_samples": 3,
        "budget_s": 420,
    },
    "tiny": {
        "architecture": "qwen3_8b",
        "cut": "tiny",
        "dtype": "float32",
        "device": "cpu",
        "contexts": [256, 512],
        "new_tokens": 3,
        "extract_tokens": 256,
        "am_tokens": 256,
        "eval_samples": 1,
        "budget_s": 600,
    },
}


def versions() -> dict[str, str | None]:
    """Python and the packages the check runs on."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "triton", "kvpress", "lightning", "scikit-learn", "hydra-core", "omegaconf"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def summary(report: dict[str, Any]) -> str:
    """The Markdown summary of a report."""
    s = report["settings"]
    lines = [
        f"# Device check: {report['device']}",
        "",
        f"{s['architecture']} architecture (cut: {s['cut']}), random weights, {s['dtype']}, "
        f"{report['finished_s']:.0f} s of a {s['budget_s']} s budget. Versions: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v)
        + ".",
        "",
    ]
    for name, rows in report["steps"].items():
        rows = rows if isinstance(rows, list) else [rows]
        keys = list(dict.fromkeys(k for r in rows for k in r))
        lines += [f"## {name}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
        lines.append("")
    if report["cut"]:
        lines += ["## Cut", "", *[f"- {name}: {why}" for name, why in report["cut"].items()], ""]
    return "\n".join(lines)


def run(plan: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run the steps of ``plan`` within its budget; write the JSON and Markdown into ``out``."""
    start = time.perf_counter()
    if plan["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA device is visible: use --plan tiny on a CPU.")
    loaded = load_model(
        {
            "name": plan["architecture"],
            "source": "random",
            "architecture": plan["architecture"],
            "cut": plan["cut"],
            "dtype": plan["dtype"],
            "device": plan["device"],
            "seed": 0,
        }
    )
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    clock = Clock(session.device)
    triton_ok = session.device.type == "cuda" or _interpreted()
    steps: dict[str, Any] = {}
    why = interpreter_refuses() if os.environ.get("TRITON_INTERPRET") == "1" else "TRITON_INTERPRET unset"
    cut: dict[str, str] = {} if triton_ok else {"decode.triton": f"no CUDA device, and {why}"}
    taus: dict[str, float] = {}

    def kvzap() -> list[dict[str, Any]]:
        ids = random_ids(min(plan["contexts"]), 0)  # thresholds for ~3x, reused by the memory step
        for kind, surrogate in random_surrogates(session).items():
            taus[kind] = threshold_for(session, surrogate, ids, 1 / 3)
        return step_kvzap(session, plan, clock, taus)

    plan_steps: list[tuple[str, Callable[[], Any]]] = [
        ("decode", lambda: step_decode(session, plan, clock, triton_ok)),
        ("kvzap", kvzap),
        ("memory", lambda: step_memory(session, plan, clock, taus)),
        ("extraction", lambda: step_extraction(session, plan, clock)),
        ("am", lambda: step_am(session, plan, clock)),
        ("eval", lambda: step_eval(session, plan, taus)),
    ]
    device = (
        torch.cuda.get_device_name(session.device) if session.device.type == "cuda" else f"CPU ({platform.machine()})"
    )
    report = {
        "device": device,
        "settings": {**plan, "window": WINDOW, "keeps": list(KEEPS), "model_config": text_config(plan["architecture"])},
        "versions": versions(),
        "steps": steps,
        "cut": cut,
        "finished_s": 0.0,
    }
    for name, fn in plan_steps:
        elapsed = time.perf_counter() - start
        if elapsed > plan["budget_s"]:
            cut[name] = f"the budget of {plan['budget_s']} s was spent ({elapsed:.0f} s)"
            continue
        try:
            steps[name] = fn()
        except torch.OutOfMemoryError as error:
            cut[name] = f"out of memory: {str(error)[:200]}"
        finally:
            if session.device.type == "cuda":
                torch.cuda.empty_cache()
        report["finished_s"] = round(time.perf_counter() - start, 1)
        write(report, out)  # after every step: a run stopped from outside keeps what it measured
    report["finished_s"] = round(time.perf_counter() - start, 1)
    write(report, out)
    return report


def write(report: dict[str, Any], out: Path) -> None:
    """``device_check.json`` and ``device_check.md`` in ``out``, each written to a temporary name, then renamed."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("device_check.json", json.dumps(report, indent=2) + "\n"),
        ("device_check.md", summary(report)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def _interpreted() -> bool:
    """TRITON_INTERPRET=1 with an interpreter that runs the kernel: see :func:`interpreter_refuses`."""
    return os.environ.get("TRITON_INTERPRET") == "1" and not interpreter_refuses()


def interpreter_refuses() -> str | None:
    """Why this Triton's interpreter cannot run the decode kernel here, or None.

    Triton 3.6's interpreter (the GPU image's) hands a loop bound to ``range`` as a 1-element array, which NumPy
    2.4 and later refuse to convert to an integer; Triton 3.9 runs it. Compiled on a GPU the kernel is unaffected.
    """
    import numpy

    triton = tuple(int(x) for x in metadata.version("triton").split(".")[:2])
    numpy_version = tuple(int(x) for x in numpy.__version__.split(".")[:2])
    if triton < (3, 7) and numpy_version >= (2, 4):
        return f"the interpreter of Triton {metadata.version('triton')} cannot index with NumPy {numpy.__version__}"
    return None


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--out DIR [--plan gpu|tiny] [--budget-s S] [--contexts N ...]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for device_check.json and .md")
    parser.add_argument("--plan", choices=sorted(PLANS), default="gpu")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting steps after this many seconds")
    parser.add_argument("--contexts", type=int, nargs="*", default=None)
    args = parser.parse_args(argv)
    plan = dict(PLANS[args.plan])
    if args.budget_s is not None:
        plan["budget_s"] = args.budget_s
    if args.contexts:
        plan["contexts"] = args.contexts
    report = run(plan, args.out)
    print(
        f"[device_check] wrote {args.out / 'device_check.json'} and device_check.md; cut: {report['cut'] or 'nothing'}"
    )


if __name__ == "__main__":
    main()
