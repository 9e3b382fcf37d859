"""Export a surrogate in kvpress's ``KVzapModel`` layout (loadable by ``KVzapPress``)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvresearch.surrogate.modules import Surrogate


def to_kvpress(surrogate: Surrogate, folder: Path) -> Path:
    """Write ``folder`` with kvpress's KVzapConfig/KVzapModel (config.json + safetensors)."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    cfg = surrogate.config
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
    model.save_pretrained(folder)
    return folder
