"""One loader for every model config under conf/model/.

A model config names its ``source``:

* ``embedded``: a GGUF inside a PyPI package, converted once to an HF folder (see ``embedded.py``);
* ``random``: a seeded model built from a config dict (unit tests) or from a vendored paper architecture
  (``architecture: qwen3_8b``, cut by ``num_layers``, ``cut`` and ``overrides``: see ``architecture.py``),
  in the config's dtype and directly on its device; the tokenizer is borrowed from the embedded model (or none);
* ``hub``: a Hugging Face repository id or a local folder.

dtype, device and attention implementation come from the same config, and ``chat_template_options``:
keyword arguments every chat-template call of the run receives (Qwen3's ``enable_thinking`` switch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from kvresearch.errors import KVResearchError
from kvresearch.models import architecture, embedded, hub

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model in eval mode with its tokenizer (``None`` for a random model without one)."""

    name: str
    model: PreTrainedModel
    tokenizer: Any

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.model.parameters()).device


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise KVResearchError(f"Unknown model.dtype '{name}'; use one of {sorted(DTYPES)}.")
    return DTYPES[name]


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise KVResearchError(
            f"model.device={name} but no CUDA device is visible. Use model.device=cpu (slow for 8B models) "
            "or run on a GPU machine."
        )
    return name


def _embedded(cfg: Mapping[str, Any]) -> str:
    return str(
        embedded.embedded_folder(
            cfg["name"],
            cfg["package"],
            cfg["gguf_file"],
            dict(cfg.get("chat_tokens") or {}),
            bool(cfg.get("assembled")),
        )
    )


def _tokenizer_for_random(cfg: Mapping[str, Any]) -> tuple[Any, str | None]:
    """The tokenizer a random model borrows, and the folder it comes from."""
    source = cfg.get("tokenizer")
    if source is None:
        return None, None
    folder = _embedded(source) if isinstance(source, Mapping) else str(source)  # an embedded model's config, or a path
    return AutoTokenizer.from_pretrained(folder), folder


def random_config(cfg: Mapping[str, Any]) -> Any:
    """The transformers config a random model is built from.

    ``cfg['architecture']`` names a vendored paper model, or ``cfg['config']`` is a config dict with
    ``model_type``; either is cut by ``num_layers``, ``cut`` and ``overrides``.
    """
    if cfg.get("architecture"):
        fields = architecture.text_config(str(cfg["architecture"]))
    elif cfg.get("config"):
        fields = dict(cfg["config"])
    else:
        raise KVResearchError("model.source=random needs model.architecture (a vendored paper model) or model.config.")
    return architecture.build_config(fields, cfg.get("num_layers"), cfg.get("cut"), cfg.get("overrides"))


def build_random(cfg: Mapping[str, Any], device: str = "cpu") -> PreTrainedModel:
    """A seeded model of :func:`random_config`, initialised in ``cfg['dtype']`` directly on ``device``."""
    torch.manual_seed(int(cfg.get("seed", 0)))
    with torch.device(device):
        return AutoModelForCausalLM.from_config(random_config(cfg), dtype=_dtype(cfg.get("dtype", "float32")))


def with_template_options(tokenizer: Any, options: Mapping[str, Any] | None) -> Any:
    """``tokenizer`` whose ``apply_chat_template`` takes ``options`` as defaults (a call's own arguments win)."""
    if tokenizer is None or not options:
        return tokenizer
    original, defaults = tokenizer.apply_chat_template, dict(options)

    def apply_chat_template(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**defaults, **kwargs})

    tokenizer.apply_chat_template = apply_chat_template
    return tokenizer


def load_model(cfg: Mapping[str, Any]) -> LoadedModel:
    """Load the model described by a conf/model/*.yaml config.

    Raises:
        KVResearchError: unknown source, missing package, or a hub model neither cached nor reachable.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no per-tensor loading bars in logs
    source = cfg.get("source")
    if source == "hub":  # first, so that an unavailable model fails within seconds whatever else is wrong
        hub.ensure_available(cfg["repo_id"], cfg.get("revision"))
    dtype = _dtype(cfg.get("dtype", "float32"))
    device = _device(cfg.get("device", "cpu"))
    attn = cfg.get("attn_implementation", "sdpa")
    if source == "random":
        model = build_random(cfg, device)
        tokenizer, folder = _tokenizer_for_random(cfg)
        if folder is not None:  # tools that load the tokenizer from the model (kvpress's KVzipPress) find it
            model.config.name_or_path = folder
    elif source in ("embedded", "hub"):
        if source == "embedded":
            path = _embedded(cfg)
            revision = None
        else:
            path, revision = cfg["repo_id"], cfg.get("revision")
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
        model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=dtype, attn_implementation=attn)
    else:
        raise KVResearchError(f"model.source must be 'embedded', 'random' or 'hub', got {source!r}.")
    if source == "random":
        model.set_attn_implementation(attn)
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    tokenizer = with_template_options(tokenizer, cfg.get("chat_template_options"))
    return LoadedModel(name=str(cfg.get("name", source)), model=model, tokenizer=tokenizer)
