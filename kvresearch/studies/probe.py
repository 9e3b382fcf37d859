"""What limits the KVzap surrogate on a left-out source: ridge fits on richer inputs than the hidden state.

    python -m kvresearch.studies.probe [--extract RUN (default: the surrogate study's)] [--left-out essays]
        [--layers 0,1,...] [--inputs h,value_norms,neighbours,position,counts,rates,length] [--alphas 1,100,...]
        [--fit ridge|mlp] [--mlp-layers 1] [--out outputs/surrogate_probe.json]

Each input set is a closed-form ridge per layer (float64, ``kvresearch.ops.ridge``, as ``surrogate=linear``;
alpha 1 as its default, or each of ``--alphas``, solved from the same statistics) trained on every document
of the other sources and tested on all of ``--left-out``; held-out R^2 pooled per layer (the surrogate
study's measure), mean over the chosen layers:

* ``h``: the surrogate's own input, the attention input h_i (the baseline; equals the study's linear point);
* ``value_norms``: h_i and the exact log ||v_i W_O^g|| of every query head g (the KVzip+ score's second
  factor, a function of h_i that a linear map cannot form);
* ``neighbours``: h_i, h_{i-1} and h_{i+1} (needs an extract of every position, ``extract.samples_per_doc``
  above the document length; rows whose neighbour was not sampled use their own h, and the share that had
  both neighbours is reported);
* ``position``: h_i and log(1 + i), the offset inside the document;
* ``counts``: h_i and six in-document counts, each as log(1 + n), that no per-token surrogate sees: how often
  the token occurs in its document, how often the previous token does (the keys an induction head splits its
  attention over), how often the bigram (previous, this) does, the earlier occurrences of the token and of the
  bigram, and the document's length. The token ids come from rebuilding the extract's corpus
  (its ``config.yaml``), checked document by document against its manifest;
* ``rates``: h_i and the first five counts in the length-free form that ``surrogate.context=[counts]`` reads
  (``kvresearch.surrogate.context.count_rates``: log(1 + count per 1,000 tokens of the document));
* ``length``: h_i and log(1 + n), n the document's length (``surrogate.context=[length]``);
* ``a+b``: h_i and what both add (``value_norms+position``);
* ``factored`` (``--fit mlp`` only): the MLP reads h_i alone and predicts one term per query head g; the exact
  log ||v_i W_O^g|| is added to it and the group's max taken as a logsumexp, the KVzip+ score's own form.

``--fit mlp`` trains the recipe's MLP instead (``conf/surrogate/mlp.yaml``: width D/8, AdamW, cosine, its
weight decay, epochs and batch; Lightning, all chosen layers at once, as ``train_surrogate`` does) on the
same inputs, without a validation split; ``--mlp-layers N`` gives it N hidden layers of that width
(``+surrogate.mlp_layers=N`` in ``train_surrogate``).

Written to ``--out`` (JSON: per layer and mean per input set); the numbers are quoted in docs/surrogates.md.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError
from sklearn.metrics import r2_score

from kvresearch.errors import KVResearchError
from kvresearch.models import ModelAdapter, load_model
from kvresearch.ops.ridge import RidgeAccumulator
from kvresearch.ops.scores import value_output_norms
from kvresearch.runs import outputs_root, repo_root, resolve_run, write_json
from kvresearch.studies.surrogates import study_extract
from kvresearch.surrogate.context import count_rates, raw_counts
from kvresearch.surrogate.data import ExtractRun
from kvresearch.surrogate.lightning import SurrogateModule
from kvresearch.surrogate.modules import Surrogate, SurrogateConfig

INPUTS = ("h", "value_norms", "neighbours", "position", "counts", "rates", "length", "factored")
COUNTS = ("token", "previous token", "bigram", "token before", "bigram before", "document length")


def token_counts(ids: np.ndarray) -> np.ndarray:
    """(n, 6) float32: log(1 + count) of each :data:`COUNTS` entry at every position of one document's ids (n,).

    The first five are ``kvresearch.surrogate.context.raw_counts``; the previous token and the bigram of
    position 0 do not exist: their counts are 0.
    """
    raw = raw_counts(ids)
    return np.log1p(np.c_[raw, np.full(len(raw), len(raw))]).astype(np.float32)


def document_ids(run: ExtractRun, tokenizer: Any) -> dict[int, np.ndarray]:
    """Document index -> token ids, the documents rebuilt from the run's own config (refused if it changed)."""
    try:
        return run.document_ids(tokenizer)
    except KVResearchError as error:
        raise SystemExit(f"'counts', 'rates': {error} Or leave those inputs out.") from error


class Split:
    """The rows of some documents: hidden states (rows, layers, D), scores (rows, layers, Hkv), neighbours.

    The hidden states stay in the extract's own dtype (bfloat16 by default: half the memory, converted exactly).

    ``ids`` (document index -> its token ids): for the ``counts`` and ``rates`` inputs.
    """

    def __init__(self, run: ExtractRun, documents: set[int], ids: dict[int, np.ndarray] | None = None):
        rows = run.rows_of(documents)
        self.h, self.y = run.fetch(rows, run.stored_dtype)
        pos = np.concatenate([np.asarray(s.pos) for s in run.shards])[rows]
        doc = run.doc[rows]
        where = {(int(d), int(p)): i for i, (d, p) in enumerate(zip(doc, pos, strict=True))}
        own = range(len(rows))
        self.prev = torch.tensor([where.get((int(d), int(p) - 1), i) for i, d, p in zip(own, doc, pos, strict=True)])
        self.next = torch.tensor([where.get((int(d), int(p) + 1), i) for i, d, p in zip(own, doc, pos, strict=True)])
        own_t = torch.arange(len(rows))
        self.both_neighbours = float(((self.prev != own_t) & (self.next != own_t)).float().mean())
        self.counts: torch.Tensor | None = None
        self.rates: torch.Tensor | None = None
        self.log_pos = torch.log1p(torch.from_numpy(pos.astype(np.float32)))[:, None]
        n_tokens = {d["index"]: d["n_tokens"] for d in run.manifest["documents"]}
        self.log_len = torch.log1p(torch.tensor([float(n_tokens[int(d)]) for d in doc]))[:, None]
        if ids is not None:
            docs = sorted({int(d) for d in doc})
            counts = {d: torch.from_numpy(token_counts(ids[d])) for d in docs}
            rates = {d: count_rates(ids[d]) for d in docs}
            self.counts = torch.stack([counts[int(d)][p] for d, p in zip(doc, pos, strict=True)])
            self.rates = torch.stack([rates[int(d)][p] for d, p in zip(doc, pos, strict=True)])


def extra(split: Split, layer: int, name: str, adapter: ModelAdapter) -> torch.Tensor:
    """(rows, columns) that input ``name`` adds to h at one layer (none for ``h``)."""
    h = split.h[:, layer]  # the extract's dtype; converted only where an input computes from it
    if name == "h":
        return h[:, :0].float()
    if name in ("value_norms", "factored"):
        with torch.no_grad():
            _, _, v = adapter.project(layer, h.float()[None])  # v: (1, Hkv, rows, d)
            norms = value_output_norms(v[0], adapter.output_weight(layer).float())  # (Hkv, G, rows)
        return norms.flatten(0, 1).T.clamp_min(1e-12).log()
    if name == "neighbours":
        return torch.cat([h[split.prev], h[split.next]], 1).float()
    if name == "position":
        return split.log_pos
    if name == "length":
        return split.log_len
    if name in ("counts", "rates"):
        column = split.counts if name == "counts" else split.rates
        assert column is not None, "built without token ids"
        return column
    raise SystemExit(f"unknown input {name!r}; choose from {', '.join(INPUTS)} (join with + to combine)")


def features(split: Split, layer: int, which: str, adapter: ModelAdapter) -> torch.Tensor:
    """(rows, features) of one input set (``value_norms+position``: h and both) at one layer."""
    return torch.cat([split.h[:, layer].float(), *(extra(split, layer, name, adapter) for name in which.split("+"))], 1)


def stacked(split: Split, layers: list[int], which: str, adapter: ModelAdapter) -> torch.Tensor:
    """(rows, len(layers), features) of one input set at every chosen layer, in the hidden states' dtype.

    A bfloat16 extract's extra columns are rounded to bfloat16 too: the rows of every document of a corpus fit
    in memory (the MLP computes in float32; h itself is exact either way).
    """
    first = features(split, layers[0], which, adapter)
    out = first.new_empty(len(first), len(layers), first.shape[1], dtype=split.h.dtype)
    out[:, 0] = first
    for i, layer in enumerate(layers[1:], 1):
        out[:, i] = features(split, layer, which, adapter)
    return out


class Factored(torch.nn.Module):
    """log KVzip+ as logsumexp over g of (an MLP's term for query head g + the exact log ||v W_O^g||).

    Input (rows, layers, D + Hkv G): h, then the log norms; output (rows, layers, Hkv).
    """

    def __init__(self, mlp: Surrogate, hidden: int, kv_heads: int):
        super().__init__()
        self.mlp, self.hidden, self.kv_heads = mlp, hidden, kv_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scores from the hidden state and the log value norms."""
        h, log_norms = x[..., : self.hidden], x[..., self.hidden :]
        terms = (self.mlp(h) + log_norms).unflatten(-1, (self.kv_heads, -1))  # (rows, layers, Hkv, G)
        return terms.logsumexp(-1)


def ridge_r2(
    x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor, alphas: list[float]
) -> list[float]:
    """Held-out R^2 (pooled over heads and rows) of a ridge fit at each of ``alphas``; x (rows, features)."""
    acc = RidgeAccumulator(1, x.shape[1], y.shape[1])
    acc.update(x[:, None], y[:, None])
    truth = y_test.double().numpy().ravel()
    r2 = []
    for alpha in alphas:
        weights, bias = acc.solve(alpha)
        r2.append(float(r2_score(truth, (x_test.double() @ weights[0] + bias[0]).numpy().ravel())))
    return r2


def mlp_r2(
    x: torch.Tensor,
    y: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    recipe: DictConfig,
    hidden: int,
    factored: bool,
    mlp_layers: int = 1,
    seed: int = 0,
) -> list[float]:
    """Held-out R^2 per layer (pooled over heads and rows) of the recipe's MLP, all layers trained at once.

    x: (rows, layers, features), h's ``hidden`` (D) columns first; y: (rows, layers, Hkv). The width is the
    recipe's (D/8 unless it sets one) whatever the inputs, ``mlp_layers`` hidden layers of it. ``factored``: the
    columns after h are the log norms that :class:`Factored` adds to the MLP's terms, one per query head.
    """
    layers, features, kv_heads = x.shape[1], x.shape[2], y.shape[2]
    width = int(recipe.mlp_hidden or hidden // 8)
    L.seed_everything(seed, verbose=False)  # the initial weights and the order
    if factored:
        mlp = Surrogate(SurrogateConfig("mlp", layers, hidden, features - hidden, width, mlp_layers=mlp_layers))
        net: torch.nn.Module = Factored(mlp, hidden, kv_heads)
    else:
        net = Surrogate(SurrogateConfig("mlp", layers, features, kv_heads, width, mlp_layers=mlp_layers))
    data = torch.utils.data.TensorDataset(x, y)  # indexed a batch at a time (a list of rows), not row by row
    order = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(data), int(recipe.batch_size), False)
    batches = torch.utils.data.DataLoader(data, sampler=order, batch_size=None)
    module = SurrogateModule(net, float(recipe.lr), float(recipe.weight_decay), int(recipe.epochs))  # type: ignore[arg-type]
    trainer = L.Trainer(
        max_epochs=int(recipe.epochs), gradient_clip_val=float(recipe.grad_clip), logger=False, accelerator="cpu",
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, batches)
    with torch.no_grad():
        pred = torch.cat([net(chunk) for chunk in x_test.split(4096)])
    return [float(r2_score(y_test[:, i].numpy().ravel(), pred[:, i].numpy().ravel())) for i in range(layers)]


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extract", default=None, help="an extract run; default: the surrogate study's")
    parser.add_argument("--left-out", default="essays")
    parser.add_argument("--layers", default=None, help="comma-separated; default every layer")
    parser.add_argument("--inputs", default="h,value_norms,position,value_norms+position")
    parser.add_argument("--alphas", default="1", help="ridge penalties, comma-separated (1: surrogate=linear's)")
    parser.add_argument("--fit", choices=("ridge", "mlp"), default="ridge")
    parser.add_argument("--set", nargs="*", default=[], help="--fit mlp: recipe overrides, e.g. weight_decay=0.01")
    parser.add_argument("--mlp-layers", type=int, default=1, help="--fit mlp: hidden layers of the recipe's width")
    parser.add_argument("--seed", type=int, default=0, help="--fit mlp: the initial weights and the batch order")
    parser.add_argument("--out", default=str(outputs_root() / "surrogate_probe.json"))
    args = parser.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    inputs = args.inputs.split(",")
    if any("factored" in w.split("+") and (w != "factored" or args.fit != "mlp") for w in inputs):
        raise SystemExit("'factored' is a form of the MLP: pass it alone, with --fit mlp (ridge: 'value_norms')")
    recipe = OmegaConf.load(repo_root() / "conf/surrogate/mlp.yaml")
    assert isinstance(recipe, DictConfig)
    OmegaConf.set_struct(recipe, True)  # a misspelt --set key is an error, not a new key
    try:
        recipe.merge_with_dotlist(args.set)
    except (ConfigAttributeError, ConfigKeyError) as error:
        message = str(error).splitlines()[0]
        raise SystemExit(f"--set: {message}; the recipe's keys: {', '.join(map(str, recipe))}") from error
    torch.set_num_threads(max(1, torch.get_num_threads()))
    folder = resolve_run(args.extract or study_extract(), "extract")
    run = ExtractRun(folder)
    loaded = load_model(OmegaConf.load(folder / "config.yaml").model)
    adapter = ModelAdapter(loaded.model)
    docs = [d for d in run.manifest["documents"] if d["status"] == "done"]
    if args.left_out not in {d["source"] for d in docs}:
        raise SystemExit(f"no source {args.left_out!r} in {folder}; sources: {sorted({d['source'] for d in docs})}")
    wants_ids = any({"counts", "rates"} & set(w.split("+")) for w in inputs)
    ids = document_ids(run, loaded.tokenizer) if wants_ids else None
    train = Split(run, {d["index"] for d in docs if d["source"] != args.left_out}, ids)
    test = Split(run, {d["index"] for d in docs if d["source"] == args.left_out}, ids)
    layers = [int(i) for i in args.layers.split(",")] if args.layers else list(range(adapter.num_layers))
    label = {(w, a): w if len(alphas) == 1 else f"{w}@alpha={a:g}" for w in inputs for a in alphas}
    per_layer: dict[str, list[float]] = {name: [] for name in label.values()} if args.fit == "ridge" else {}
    for which in inputs if args.fit == "mlp" else []:
        x, x_test = (stacked(split, layers, which, adapter) for split in (train, test))
        factored = which == "factored"
        y, y_test = train.y[:, layers], test.y[:, layers]
        shape = (adapter.hidden_size, factored, args.mlp_layers, args.seed)
        per_layer[which] = mlp_r2(x, y, x_test, y_test, recipe, *shape)
        del x, x_test  # before the next input set's copies (Lightning's trainer holds them in a cycle)
        gc.collect()
        print(f"[probe] mlp on {which}: " + " ".join(f"{v:.3f}" for v in per_layer[which]), flush=True)
    for layer in layers if args.fit == "ridge" else []:
        for which in inputs:
            x, x_test = features(train, layer, which, adapter), features(test, layer, which, adapter)
            r2 = ridge_r2(x, train.y[:, layer], x_test, test.y[:, layer], alphas)
            for alpha, value in zip(alphas, r2, strict=True):
                per_layer[label[which, alpha]].append(value)
        print(f"[probe] layer {layer}: " + " ".join(f"{w} {v[-1]:.3f}" for w, v in per_layer.items()), flush=True)
    result: dict[str, Any] = {
        "extract": str(folder), "left_out": args.left_out, "layers": layers, "fit": args.fit,
        **({"recipe": OmegaConf.to_container(recipe), "mlp_layers": args.mlp_layers, "seed": args.seed}
           if args.fit == "mlp" else {"alphas": alphas}),
        "rows": {"train": len(train.y), "test": len(test.y)},
        "both_neighbours_share": {"train": train.both_neighbours, "test": test.both_neighbours},
        "r2_pooled_per_layer": per_layer, "mean": {w: float(np.mean(v)) for w, v in per_layer.items()},
    }  # fmt: skip
    write_json(Path(args.out), result)
    print({w: round(m, 4) for w, m in result["mean"].items()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
