"""Our surrogate as kvpress's ``KVzapModel`` (loadable by ``KVzapPress``), in memory or on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvresearch.errors import KVResearchError
from kvresearch.surrogate.modules import Surrogate


def kvpress_loads(surrogate: Surrogate) -> bool:
    """Whether kvpress's ``KVzapModel`` has ``surrogate``'s shape (h alone, a linear map or one hidden layer)."""
    config = surrogate.config
    return not config.context and (config.kind == "linear" or config.mlp_layers == 1)


def kvpress_model(surrogate: Surrogate) -> Any:
    """Kvpress's KVzapConfig/KVzapModel holding the same weights as ``surrogate``."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    cfg = surrogate.config
    if not kvpress_loads(surrogate):
        raise KVResearchError(
            f"kvpress's KVzapModel reads h alone through at most one hidden layer; this surrogate has "
            f"{cfg.mlp_layers} (surrogate.mlp_layers) and reads {list(cfg.context) or 'h alone'} (surrogate.context). "
            "Use it through kvresearch's KVzap methods, or train one with mlp_layers=1 and context=[] for kvpress."
        )
    model = KVzapModel(
        KVzapConfig(
            input_dim=cfg.hidden,
            output_dim=cfg.kv_heads,
            n_modules=cfg.layers,
            hidden_dim=cfg.mlp_hidden if cfg.kind == "mlp" else None,
        )
    )
    linears = [m for module in model.layers for m in ([module] if cfg.kind == "linear" else [module[0], module[2]])]
    per_layer = len(surrogate.weights)
    with torch.no_grad():
        for layer in range(cfg.layers):
            for i in range(per_layer):
                linear = linears[layer * per_layer + i]
                linear.weight.copy_(surrogate.weights[i][layer].T)  # nn.Linear stores (out, in)
                linear.bias.copy_(surrogate.biases[i][layer])
    return model.eval()


def to_kvpress(surrogate: Surrogate, folder: Path) -> Path:
    """Write ``folder`` in kvpress's layout (config.json + safetensors), for kvpress users."""
    kvpress_model(surrogate).save_pretrained(folder)
    return folder
