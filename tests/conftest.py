"""Fixtures: the tiny random model and the embedded model, loaded once per session; CUDA-only tests skipped.

Tests never touch the checkout's outputs/ or its run records (docs/results/runs/): both roots are temporary
folders for the session.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["KVRESEARCH_OUTPUTS"] = tempfile.mkdtemp(prefix="kvr-test-outputs-")
os.environ["KVRESEARCH_RECORDS"] = tempfile.mkdtemp(prefix="kvr-test-records-")

from kvresearch.models import LoadedModel, load_model
from tests.helpers import model_config

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """The seeded 3-layer GQA llama of conf/model/tiny_random.yaml, with the embedded model's tokenizer."""
    return load_model(model_config("tiny_random"))


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct."""
    return load_model(model_config("smollm2_135m"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``gpu`` tests where no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
