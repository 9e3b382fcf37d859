"""Hub models: fail fast, with one paragraph, when a model is neither cached nor reachable."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from kvresearch.errors import KVResearchError


def _is_cached(repo_id: str, revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return isinstance(found, str)


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """One TCP connection attempt to the hub endpoint; no retries."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def ensure_available(repo_id: str, revision: str | None = None) -> None:
    """Raise a clear error within seconds if ``repo_id`` can be neither read from disk nor downloaded."""
    if Path(repo_id).expanduser().is_dir() or _is_cached(repo_id, revision):
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes"}
    if not offline and _hub_reachable():
        return
    from huggingface_hub import constants

    why = "HF_HUB_OFFLINE is set" if offline else f"{constants.ENDPOINT} cannot be reached from this machine"
    raise KVResearchError(
        f"The model '{repo_id}' is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}. "
        f"On a machine with internet access run `hf download {repo_id}` (gated models such as Llama need "
        "`hf auth login` and an accepted licence first), then copy the cache here or point HF_HOME at it; "
        "or pass a local folder with `model.repo_id=/path/to/folder`. "
        "Without a GPU or the hub, use the embedded default `model=smollm2_135m`."
    )
