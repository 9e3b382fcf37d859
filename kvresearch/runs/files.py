"""Files that are never half-written: a temporary name, then a rename; JSON read with an error that says what to do."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvresearch.errors import KVResearchError


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path, fix: str) -> Any:
    """Read a JSON file, or raise one paragraph naming it and saying what to do (``fix``)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise KVResearchError(f"{path} is missing. {fix}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise KVResearchError(f"{path} is not valid JSON (damaged or half-written: {error}). {fix}") from error
