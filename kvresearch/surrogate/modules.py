"""KVzap surrogates: per-layer maps from the attention input h (hidden) to log KVzip+ per KV head.

All layers live in one module with stacked weights, so a batch of (rows, layers, hidden) runs as one
batched matmul instead of a Python loop of small ones:

* linear: ``h W_l + b_l`` with W_l of shape (hidden, kv_heads);
* mlp: ``GELU(h W1_l + b1_l) W2_l + b2_l`` with W1_l (hidden, hidden/8) and W2_l (hidden/8, kv_heads);
  ``mlp_layers`` > 1 stacks that many GELU layers of the same width before the output map;
* ``context`` widens the input: h and the columns of ``kvresearch.surrogate.context`` (value-output norms,
  position, in-context count rates, context length), which the caller appends (training data, the KVzap pruner).

Plain ``nn.Module``: usable without Lightning. Saved as safetensors plus a JSON config.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from kvresearch.errors import KVResearchError
from kvresearch.runs import read_json, resolve_run
from kvresearch.surrogate.context import canonical, context_width

CONFIG_NAME = "surrogate.json"
WEIGHTS_NAME = "surrogate.safetensors"


@dataclass(frozen=True)
class SurrogateConfig:
    """Shape of a surrogate and the model it is for."""

    kind: str  # "linear" or "mlp"
    layers: int
    hidden: int  # D, the model's hidden size
    kv_heads: int
    mlp_hidden: int | None = None  # D/8 for the MLP by default
    model: str | None = None  # the model the surrogate was trained for
    mlp_layers: int = 1  # hidden layers of the MLP (1: the reference's shape, the only one kvpress loads)
    context: tuple[str, ...] = ()  # inputs appended to h (kvresearch.surrogate.context); () reads h alone
    q_heads: int = 0  # the model's query heads (the width of the ``value_norms`` input)

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "mlp"):
            raise KVResearchError(f"surrogate kind must be 'linear' or 'mlp', got {self.kind!r}")
        if self.mlp_layers < 1:
            raise KVResearchError(f"surrogate.mlp_layers must be at least 1, got {self.mlp_layers}")
        object.__setattr__(self, "context", canonical(self.context))  # a list from JSON or Hydra, in one order
        if "value_norms" in self.context and self.q_heads < 1:
            raise KVResearchError("surrogate.context has 'value_norms': the config needs the model's q_heads.")

    @property
    def inputs(self) -> int:
        """Input width: h and the context columns."""
        return self.hidden + context_width(self.context, self.q_heads)


class Surrogate(nn.Module):
    """Maps h (rows, layers, hidden) to predicted log KVzip+ (rows, layers, kv_heads)."""

    def __init__(self, config: SurrogateConfig):
        super().__init__()
        if config.kind == "mlp" and config.mlp_hidden is None:
            config = SurrogateConfig(**{**asdict(config), "mlp_hidden": config.hidden // 8})
        self.config = config
        self.source: str | None = None  # the train_surrogate run it came from, when loaded from one
        L, D, H = config.layers, config.inputs, config.kv_heads
        widths = [D, H] if config.kind == "linear" else [D, *[int(config.mlp_hidden or 0)] * config.mlp_layers, H]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for fan_in, fan_out in itertools.pairwise(widths):
            bound = 1 / math.sqrt(fan_in)  # nn.Linear's default initialisation, per layer
            self.weights.append(nn.Parameter(torch.empty(L, fan_in, fan_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(L, fan_out).uniform_(-bound, bound)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (rows, layers, inputs) -> (rows, layers, kv_heads); inputs = hidden + the context columns."""
        x = h.to(self.weights[0].dtype).transpose(0, 1)  # (L, rows, D)
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            x = torch.baddbmm(b[:, None, :], x, w)  # (L, rows, out)
            if i < len(self.weights) - 1:
                x = nn.functional.gelu(x)
        return x.transpose(0, 1)

    def forward_layer(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """One layer's scores: h (..., inputs) -> (..., kv_heads), for use inside a forward pass."""
        x = h.to(self.weights[0].dtype)
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            x = torch.addmm(b[layer], x.reshape(-1, x.shape[-1]), w[layer]).view(*x.shape[:-1], -1)
            if i < len(self.weights) - 1:
                x = nn.functional.gelu(x)
        return x

    def rescale_output(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Fold ``mean + std * output`` into the last map: mean and std (layers, kv_heads).

        A surrogate trained on standardized targets ``(y - mean) / std`` then predicts y itself, and its export
        (ours and kvpress's) is an ordinary surrogate.
        """
        with torch.no_grad():
            self.weights[-1].mul_(std.to(self.weights[-1])[:, None, :])
            self.biases[-1].mul_(std.to(self.biases[-1])).add_(mean.to(self.biases[-1]))

    def describe(self) -> dict[str, object]:
        """What a run records about the surrogate it used."""
        out: dict[str, object] = {"kind": self.config.kind, "model": self.config.model, "run": self.source}
        return out | ({"context": list(self.config.context)} if self.config.context else {})

    def flops_per_token(self) -> int:
        """Multiply-adds x 2 per token per layer."""
        return sum(2 * w.shape[1] * w.shape[2] for w in self.weights)

    # ------------------------------------------------------------------ persistence
    def save(self, folder: Path) -> None:
        """Write ``surrogate.safetensors`` and ``surrogate.json`` into ``folder``."""
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"weight.{i}": w.detach().contiguous() for i, w in enumerate(self.weights)}
        tensors |= {f"bias.{i}": b.detach().contiguous() for i, b in enumerate(self.biases)}
        save_file(tensors, str(folder / WEIGHTS_NAME))
        (folder / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path | str, expect_model: str | None = None) -> Surrogate:
        """A surrogate saved by :meth:`save`; ``expect_model`` refuses one trained for another model."""
        folder = Path(folder)
        redo = (
            "Re-train it (`make train-surrogate ARGS='force=true'` for the default runs) or point the method at "
            "another train_surrogate run (paths.surrogate_mlp / paths.surrogate_linear)."
        )
        if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
            raise KVResearchError(f"No surrogate at {folder} (expected {CONFIG_NAME} and {WEIGHTS_NAME}). {redo}")
        try:
            config = SurrogateConfig(**json.loads((folder / CONFIG_NAME).read_text()))
        except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as error:
            raise KVResearchError(f"{folder / CONFIG_NAME} is damaged ({error}). {redo}") from error
        if expect_model is not None and config.model not in (None, expect_model):
            raise KVResearchError(
                f"The surrogate at {folder} was trained for model '{config.model}', not '{expect_model}'. "
                f"Extract and train one for {expect_model} (make train-surrogate ARGS='model={expect_model}')."
            )
        module = cls(config)
        try:
            tensors = load_file(str(folder / WEIGHTS_NAME))
            with torch.no_grad():
                for i, (w, b) in enumerate(zip(module.weights, module.biases, strict=True)):
                    w.copy_(tensors[f"weight.{i}"])
                    b.copy_(tensors[f"bias.{i}"])
        except (OSError, KeyError, RuntimeError, SafetensorError) as error:
            raise KVResearchError(f"{folder / WEIGHTS_NAME} cannot be read ({error}). {redo}") from error
        if not all(bool(torch.isfinite(p).all()) for p in module.parameters()):
            raise KVResearchError(f"{folder / WEIGHTS_NAME} holds non-finite weights. {redo}")
        return module.eval()


def from_run(run: str, kind: str, model: str | None = None, root: str | None = None) -> Surrogate:
    """The surrogate exported by a finished train_surrogate run, checked against what that run recorded.

    Args:
        run: the run's folder (absolute or relative to ``root``) or its run id.
        kind: "linear" or "mlp": the kind the caller expects (a KVzap-MLP method refuses a linear run).
        model: the model the surrogate must have been trained for (None: any).
        root: the outputs root (default: ``$KVRESEARCH_OUTPUTS`` or outputs/).
    """
    folder = resolve_run(run, "train_surrogate", root)
    recorded = read_json(folder / "metrics.json", "Re-run that train_surrogate run with force=true.")
    if recorded.get("kind") != kind:
        raise KVResearchError(
            f"The train_surrogate run {folder} trained a {recorded.get('kind')} surrogate, but this method needs "
            f"{kind}: point it at a {kind} run (paths.surrogate_{kind}=<run folder or id>)."
        )
    if model is not None and recorded.get("model") != model:
        raise KVResearchError(
            f"The train_surrogate run {folder} was trained for model '{recorded.get('model')}', not '{model}'. "
            f"Extract and train one for {model} (make train-surrogate ARGS='model={model}'), or point "
            f"paths.surrogate_{kind} at such a run."
        )
    surrogate = Surrogate.load(folder / "export", expect_model=model)
    surrogate.source = str(folder)
    return surrogate
