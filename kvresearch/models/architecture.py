"""The papers' architectures without their weights: vendored config.json files, cut to fit a CPU.

``architectures/<name>.json`` is the hub's config.json of a paper model (Qwen3-4B/8B/32B, Llama-3.1-8B-Instruct,
Gemma-3-12B-it; sources and cross-checks in ``architectures/PROVENANCE.md``). A model config with
``source: random`` and ``architecture: <name>`` builds that exact architecture with seeded random weights, so
speed and memory are measured at the real shapes without the hub. For multimodal checkpoints (Gemma-3-12B-it)
the text model is built: the vision tower holds no KV cache.

A cut keeps what the KV-cache methods see (query and KV head counts, head_dim, qk-norm, rotary and its
scaling, sliding windows) and shrinks the rest:

* ``num_layers``: the first N layers; where the model mixes sliding and global layers and the first N are all
  of one kind, the last of them takes the other kind, so that a cut always holds both;
* ``overrides``: any config field (``hidden_size``, ``intermediate_size``, ``vocab_size``, ...);
* ``cut: tiny``: 2 layers, hidden 128, MLP 256, the borrowed tokenizer's 49,152-token vocabulary: every
  paper family on 2 CPU cores in seconds.

A narrower ``hidden_size`` raises ``initializer_range`` by sqrt(full / cut width), so that q, k and v keep the
scale they have in the full-width random model (attention logits would otherwise shrink with the square of the
width and every head would attend almost uniformly).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from kvresearch.errors import KVResearchError

FOLDER = Path(__file__).parent / "architectures"
CUTS: dict[str, dict[str, Any]] = {
    "tiny": {"num_layers": 2, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 49152},
}
_HUB_ONLY = ("architectures", "torch_dtype", "dtype", "transformers_version")  # what a random build ignores


def model_name(base: str, source: str | None, cut: str | None = None, num_layers: int | None = None) -> str:
    """A model config's name (``${kvr.model_name:...}``): ``base``, or ``base-random[-cut][-L<n>]`` if random.

    A surrogate or run made on random weights is then never taken for the real model's.
    """
    if source != "random":
        return base
    return "-".join([base, "random", *([str(cut)] if cut else []), *([f"L{num_layers}"] if num_layers else [])])


def names() -> list[str]:
    """The vendored architectures."""
    return sorted(p.stem for p in FOLDER.glob("*.json"))


def hub_config(name: str) -> dict[str, Any]:
    """The vendored config.json of ``name`` as the hub has it."""
    path = FOLDER / f"{name}.json"
    if not path.is_file():
        raise KVResearchError(
            f"No vendored architecture '{name}'; available: {names()} (kvresearch/models/architectures/)."
        )
    return dict(json.loads(path.read_text()))


def text_config(name: str) -> dict[str, Any]:
    """The language model's config fields of ``name`` (the ``text_config`` of a multimodal checkpoint)."""
    config = hub_config(name)
    config = dict(config.get("text_config", config))
    return {k: v for k, v in config.items() if k not in _HUB_ONLY}


def _layer_types(config: PretrainedConfig, n: int) -> list[str] | None:
    """The first ``n`` layer types of ``config``, holding both kinds where the full model does."""
    types = getattr(config, "layer_types", None)
    if not types:
        return None
    cut = list(types[:n])
    missing = [kind for kind in dict.fromkeys(types) if kind not in cut]
    if missing and n > 1:
        cut[-1] = missing[0]
    return cut


def build_config(
    fields: Mapping[str, Any],
    num_layers: int | None = None,
    cut: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PretrainedConfig:
    """A transformers config from ``fields`` (with ``model_type``), cut as the module docstring says."""
    fields = dict(fields)
    if cut is not None and cut not in CUTS:
        raise KVResearchError(f"Unknown model.cut '{cut}'; use one of {sorted(CUTS)} or null.")
    preset = dict(CUTS.get(cut or "", {}))
    layers = preset.pop("num_layers", None) if num_layers is None else num_layers
    changes = {**preset, **dict(overrides or {})}
    model_type = fields.pop("model_type")
    full = AutoConfig.for_model(model_type, **fields)
    if layers is not None:
        if not 1 <= int(layers) <= full.num_hidden_layers:
            raise KVResearchError(f"model.num_layers={layers}: the model has 1 to {full.num_hidden_layers} layers.")
        fields["num_hidden_layers"] = int(layers)
        types = _layer_types(full, int(layers))
        if types is not None:
            fields["layer_types"] = types
    head_dim = getattr(full, "head_dim", None) or full.hidden_size // full.num_attention_heads
    fields["head_dim"] = head_dim  # pinned: a narrower hidden_size must not shrink the heads (llama derives it)
    if "hidden_size" in changes and "initializer_range" not in changes:  # keep the full width's activation scale:
        # a projection of h (unit RMS) has entries of std init x sqrt(hidden); a narrower cut would otherwise attend
        # almost uniformly (q.k shrinks with the square of the width) where the full random model does not
        changes["initializer_range"] = full.initializer_range * math.sqrt(full.hidden_size / changes["hidden_size"])
    unknown = [key for key in changes if not hasattr(full, key)]
    if unknown:
        raise KVResearchError(f"model.overrides names fields the {model_type} config lacks: {unknown}.")
    return AutoConfig.for_model(model_type, **{**fields, **changes})


def parameter_count(config: PretrainedConfig) -> int:
    """Parameters of the causal LM ``config`` builds, counted on the meta device (no memory, no time)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
