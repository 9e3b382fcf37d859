"""Shared test helpers: configs composed as a Hydra job sees them, tiny models of every family, planted runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from kvresearch.data.shards import ShardWriter, finished_shards
from kvresearch.models.load import build_random
from kvresearch.runs import CONF_DIR
from kvresearch.surrogate import Surrogate, SurrogateConfig

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
FAMILIES = {
    "llama": dict(model_type="llama", **TINY),
    "qwen2": dict(model_type="qwen2", **TINY),
    "qwen3": dict(model_type="qwen3", **TINY),
    "gemma3": dict(
        model_type="gemma3_text",
        sliding_window=8,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        **TINY,
    ),
}


SMALL_RULER = [  # 2 RULER samples at 1k tokens on the tiny model, 8 new tokens: evaluate runs in seconds
    "model=tiny_random",
    "benchmark.lengths=[1024]",
    "benchmark.samples_per_task=1",
    "benchmark.tasks=[niah_single_1,fwe]",
    "evaluate.max_samples=2",
    "evaluate.max_new_tokens=8",
]


def compose_stage(name: str, out_dir: Path | None = None, overrides: list[str] | None = None) -> DictConfig:
    """A stage's primary config as a Hydra job gets it: HydraConfig set (run names, overrides, sibling runs),
    no ``hydra`` node, the run folder at ``out_dir`` when given."""
    lines = [*(overrides or []), *([f"out_dir={out_dir}"] if out_dir is not None else [])]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(name, overrides=lines, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def model_config(name: str) -> DictConfig:
    """``conf/model/<name>.yaml`` as composed."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(f"model/{name}").model


def method_config(name: str, overrides: list[str] | None = None, paths: dict[str, str] | None = None) -> DictConfig:
    """``conf/method/<name>.yaml`` inside the evaluate config (so that ``${model.name}``, ``${paths.*}`` resolve)."""
    lines = [f"method={name}", *[f"method.{o}" for o in overrides or []], "model=tiny_random"]
    lines += [f"paths.{k}={v}" for k, v in (paths or {}).items()]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides=lines).method


def tiny_family(family: str, attn: str = "sdpa") -> torch.nn.Module:
    """A seeded float64 random model of ``family`` (3 layers, 4 query / 2 KV heads)."""
    model = build_random({"config": FAMILIES[family], "seed": 0, "dtype": "float64"})
    model.set_attn_implementation(attn)
    return model.eval()


def surrogate_run(folder: Path, layers: int, hidden: int, kv_heads: int, kind: str = "mlp", model: str = "tiny_random",
                  seed: int = 0, **shape: Any) -> Surrogate:  # fmt: skip
    """A finished train_surrogate run folder holding a seeded random surrogate (export, metrics, DONE).

    ``shape``: further :class:`SurrogateConfig` fields (``mlp_layers``, ``context``, ``q_heads``).
    """
    torch.manual_seed(seed)
    surrogate = Surrogate(SurrogateConfig(kind, layers, hidden, kv_heads, model=model, **shape)).eval()
    surrogate.save(folder / "export")
    (folder / "metrics.json").write_text(json.dumps({"kind": kind, "model": model, "fit": "planted"}))
    (folder / "DONE").write_text("planted\n")
    return surrogate


def budgets_run(folder: Path, layers: int, kv_heads: int) -> Path:
    """A finished budgets run folder with uneven per-head shares (the first head of each layer twice the others')."""
    weights = {f"L{i}H{h}": 2.0 if h == 0 else 1.0 for i in range(layers) for h in range(kv_heads)}
    total = sum(weights.values())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "budgets.json").write_text(json.dumps({k: v / total for k, v in weights.items()}))
    (folder / "metrics.json").write_text(json.dumps({"fit": "planted"}))
    (folder / "DONE").write_text("planted\n")
    return folder


def synthetic_extract(
    folder: Path,
    teacher: Callable[[torch.Tensor], torch.Tensor],
    layers: int,
    hidden: int,
    kv_heads: int,
    n_docs: int = 40,
    rows: int = 500,
    seed: int = 0,
    rows_per_shard: int = 4000,
) -> dict[str, Any]:
    """A finished extract run folder whose targets are ``teacher(h)`` exactly (on the bf16-rounded h)."""
    writer = ShardWriter(folder / "shards", "bfloat16", rows_per_shard=rows_per_shard)
    g = torch.Generator().manual_seed(seed)
    documents = []
    for i in range(n_docs):
        h = torch.randn(rows, layers, hidden, generator=g).bfloat16().float()
        with torch.no_grad():
            y = teacher(h)
        writer.add(i, torch.arange(rows), h, y)
        split = "test" if i % 8 == 0 else "train"
        documents.append(
            {"index": i, "doc_id": f"d{i}", "source": "synthetic", "split": split, "n_tokens": rows, "status": "done"}
        )
    writer.flush()
    shards = finished_shards(folder / "shards")
    manifest = {
        "model": "synthetic",
        "layout": {"layers": layers, "hidden": hidden, "kv_heads": kv_heads, "hidden_dtype": "bfloat16"},
        "documents": documents,
        "shards": [{"name": m["name"], "rows": m["rows"], "documents": m["documents"]} for m in shards],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "metrics.json").write_text(json.dumps({"samples": n_docs * rows}))
    (folder / "DONE").write_text("")
    return manifest
