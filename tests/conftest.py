"""Shared fixtures: composed stage configs, the tiny random model, the embedded model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvresearch.models import LoadedModel, load_model
from kvresearch.runs import CONF_DIR

torch.set_num_threads(min(2, os.cpu_count() or 1))


def compose_stage(name: str, out_dir: Path, overrides: list[str] | None = None) -> DictConfig:
    """A stage's primary config as Hydra composes it, with its run folder at ``out_dir``."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=[f"out_dir={out_dir}", "run_name=test", *(overrides or [])])


def model_config(name: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(f"model/{name}").model


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model(model_config("tiny_random"))


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    return load_model(model_config("smollm2_135m"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
