"""The papers' architectures without their weights: vendored configs, random builds, tiny cuts through every stage.

Each vendored config.json is checked against an independent second source (AI-Hypercomputer/maxtext's model
configs, numbers copied below; kvresearch/models/architectures/PROVENANCE.md). Every paper family's tiny cut
(2 layers, the real heads, head_dim, qk-norm, rope scaling and sliding windows) runs every stage in bfloat16
and float32, and its full-cache logits equal transformers' own forward pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from kvresearch.models import ModelAdapter, load_model
from kvresearch.models.architecture import build_config, names, parameter_count, text_config
from kvresearch.models.cache import RaggedCache
from kvresearch.models.ragged_attention import ragged_attention_enabled
from kvresearch.runs import execute
from kvresearch.stages import evaluate, extract, fidelity, lm_eval, train_surrogate
from kvresearch.surrogate.data import ExtractRun, predict
from kvresearch.surrogate.modules import from_run
from tests.helpers import compose_stage, model_config

pytestmark = pytest.mark.compat  # also run on the GPU image's versions (make compat)

PAPER = ["qwen3_4b", "qwen3_8b", "qwen3_32b", "llama31_8b", "gemma3_12b"]
# maxtext's src/MaxText/configs/models/<name>.yml (see PROVENANCE.md): emb_dim, mlp_dim, layers, query heads,
# KV heads, head_dim, vocabulary, norm epsilon, rotary base, tied embeddings (logits_via_embedding).
MAXTEXT = {
    "qwen3_4b": (2560, 9728, 36, 32, 8, 128, 151936, 1e-6, 1_000_000, True),
    "qwen3_8b": (4096, 12288, 36, 32, 8, 128, 151936, 1e-6, 1_000_000, False),
    "qwen3_32b": (5120, 25600, 64, 64, 8, 128, 151936, 1e-6, 1_000_000, False),
    "llama31_8b": (4096, 14336, 32, 32, 8, 128, 128256, 1e-5, 500_000, False),
    "gemma3_12b": (3840, 15360, 48, 16, 8, 256, 262144, 1e-6, 1_000_000, True),
}
CUT = ["model.source=random", "model.cut=tiny", "model.device=cpu"]


def paper_model(name: str, dtype: str = "float32", **fields: object):
    cfg = model_config(name)
    OmegaConf.set_struct(cfg, False)
    cfg.merge_with({"source": "random", "cut": "tiny", "device": "cpu", "dtype": dtype, **fields})
    return load_model(cfg)


def test_the_vendored_configs_agree_with_the_second_source() -> None:
    assert names() == sorted(PAPER)
    for name, (hidden, mlp, layers, heads, kv, head_dim, vocab, eps, theta, tied) in MAXTEXT.items():
        c = build_config(text_config(name))
        rope = c.rope_parameters.get("full_attention", c.rope_parameters)
        vocab_seen = c.vocab_size - (64 if name == "gemma3_12b" else 0)  # the hub's Gemma adds 64 image tokens
        assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (hidden, mlp, layers), name
        assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, vocab_seen) == (heads, kv, head_dim, vocab)
        assert (c.rms_norm_eps, rope["rope_theta"], c.tie_word_embeddings) == (eps, theta, tied), name
    llama = build_config(text_config("llama31_8b")).rope_parameters
    assert (llama["rope_type"], llama["factor"], llama["original_max_position_embeddings"]) == ("llama3", 8.0, 8192)
    gemma = build_config(text_config("gemma3_12b"))
    assert gemma.sliding_window == 1024 and gemma.layer_types.count("full_attention") == 8  # 5 local per global
    assert gemma.rope_parameters["full_attention"]["factor"] == 8.0 and gemma.query_pre_attn_scalar == 256


def test_a_full_size_build_has_the_published_parameter_count() -> None:
    """Built on the meta device (no memory): Llama-3.1-8B has 8,030,261,248 parameters (its safetensors index);
    Gemma-3-12B's text model 11,765,788,416 with keras-hub's 262,144-token vocabulary (gemma3_12b_text)."""
    for name, published, extra_vocab in (("llama31_8b", 8_030_261_248, 0), ("gemma3_12b", 11_765_788_416, 64)):
        config = build_config(text_config(name))
        assert parameter_count(config) - extra_vocab * config.hidden_size == published, name


def test_a_cut_keeps_the_attention_and_holds_both_layer_kinds() -> None:
    gemma = paper_model("gemma3_12b").model.config
    assert gemma.layer_types == ["sliding_attention", "full_attention"] and gemma.sliding_window == 1024
    assert (gemma.num_attention_heads, gemma.num_key_value_heads, gemma.head_dim) == (16, 8, 256)
    llama = paper_model("llama31_8b", num_layers=3, cut=None, overrides={"hidden_size": 64, "vocab_size": 1000})
    assert llama.model.config.head_dim == 128 and llama.model.config.num_hidden_layers == 3  # heads not narrowed
    assert llama.name == "llama31_8b-random-L3" and paper_model("qwen3_8b").name == "qwen3_8b-random-tiny"
    assert model_config("qwen3_8b").name == "qwen3_8b"  # the real model's name is unchanged
    assert paper_model("qwen3_32b", "bfloat16").model.dtype == torch.bfloat16


def _decode(model, cache, ids: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Logits of the prefill of ``ids`` (1, T), then of each of ``tokens`` fed one at a time: (1 + steps, vocab)."""
    logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()]
    for token in tokens:
        step = torch.tensor([[token]])
        logits.append(model(input_ids=step, past_key_values=cache, use_cache=True).logits[0, -1].float())
    return torch.stack(logits)


@pytest.mark.parametrize("name", PAPER)
def test_full_cache_logits_equal_transformers_in_float32_and_bfloat16(name: str) -> None:
    """A 1,100-token prefill (past Gemma-3's 1,024-token window) and 3 decoding steps (the same tokens for
    every run) through our ragged cache against transformers' DynamicCache and sdpa.

    float32: equal to 1e-4. bfloat16: our error against the float32 reference is at most twice transformers'
    own bfloat16 error plus 0.02 (a logit of this model is O(1); bfloat16 keeps 8 bits of mantissa, so two
    different but correct reduction orders differ by about as much as each differs from float32).
    """
    g = torch.Generator().manual_seed(0)
    ids, tokens = torch.randint(0, 49152, (1, 1100), generator=g), torch.randint(0, 49152, (3,), generator=g).tolist()
    exact = None
    for dtype in ("float32", "bfloat16"):
        model = paper_model(name, dtype).model
        reference = _decode(model, DynamicCache(config=model.config), ids, tokens)
        adapter = ModelAdapter(model)
        with ragged_attention_enabled(model):
            cache = RaggedCache(adapter.num_layers, [x.sliding_window for x in adapter.layers])
            ours = _decode(model, cache, ids, tokens)
        if dtype == "float32":
            torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
            exact = reference
        else:
            own = (reference - exact).abs().max()
            assert (ours - exact).abs().max() <= 2 * own + 0.02, (float((ours - exact).abs().max()), float(own))


def test_a_hub_layout_folder_loads_offline_through_source_hub(tmp_path: Path) -> None:
    """save_pretrained of a cut and its tokenizer: the path of a user with a local copy of the weights."""
    built = paper_model("qwen3_8b")
    built.model.save_pretrained(tmp_path / "qwen3")
    built.tokenizer.save_pretrained(tmp_path / "qwen3")
    cfg = model_config("qwen3_8b")
    cfg.merge_with({"repo_id": str(tmp_path / "qwen3"), "device": "cpu", "dtype": "float32"})
    loaded = load_model(cfg)
    assert loaded.name == "qwen3_8b" and type(loaded.model).__name__ == "Qwen3ForCausalLM"
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    torch.testing.assert_close(loaded.model(ids).logits, built.model(ids).logits)
    assert loaded.tokenizer("hello").input_ids == built.tokenizer("hello").input_ids


# ----------------------------------------------------------------------------------- every stage on every cut
EXTRACT = [
    "corpus.min_tokens=300",
    "corpus.max_tokens=400",
    "corpus.n_train_per_source=6",
    "corpus.n_test_per_source=1",
]
EVALUATE = [
    "benchmark.lengths=[400]",
    "benchmark.samples_per_task=1",
    "benchmark.tasks=[niah_single_1]",
    "evaluate.max_new_tokens=4",
]
METHODS = {  # the method and its budget: keep half (AM: a tenth, its self-study answers cut to 8 tokens)
    "full": [],
    "kvzap_mlp": ["method.keep_ratio=0.5"],  # a random model's log-scores sit anywhere: a ratio, not a threshold
    "kvzap_linear": ["method.keep_ratio=0.5"],
    "kvzip_plus": ["method.keep_ratio=0.5"],
    "am_highest": ["method.keep_ratio=0.1", "method.queries.self_study={max_new_tokens:8}"],
    "am_omp": ["method.keep_ratio=0.1", "method.queries.self_study={max_new_tokens:8}"],
    "snapkv": ["method.keep_ratio=0.5"],
    "tova": ["method.keep_ratio=0.5"],
}


def _beats_the_constant(run: ExtractRun, surrogate) -> tuple[float, float]:
    """Held-out MSE of the surrogate and of the training targets' mean, pooled over rows, layers and heads."""
    documents = run.split_documents(0.05, 0)
    mean, _ = run.target_moments(run.rows_of(documents["train"] | documents["val"]))
    truth, pred = predict(surrogate, run, run.rows_of(documents["test"]))
    return float(np.mean((truth - pred) ** 2)), float(np.mean((truth - mean.numpy()) ** 2))


# Every cut in bfloat16 (the papers' dtype) and in float32: 10 runs of about half a minute each.
STAGE_RUNS = [(name, dtype) for dtype in ("bfloat16", "float32") for name in PAPER]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype"), STAGE_RUNS)
def test_every_stage_runs_on_the_tiny_cut(name: str, dtype: str, tmp_path: Path) -> None:
    model = [f"model={name}", *CUT, f"model.dtype={dtype}", f"paths.root={tmp_path}"]
    done = execute(compose_stage("extract", None, [*model, *EXTRACT]), extract.run)
    assert done["documents_done"] == 21
    ids = {}
    for kind in ("linear", "mlp"):
        lines = [f"paths.root={tmp_path}", f"paths.extract='{done['run']['id']}'", f"surrogate={kind}"]
        lines += ["surrogate.epochs=4", "surrogate.standardize_targets=true"]  # random weights: scores near -11
        ids[kind] = execute(compose_stage("train_surrogate", None, lines), train_surrogate.run)
        surrogate = from_run(ids[kind]["run"]["id"], kind, f"{name}-random-tiny", str(tmp_path))
        ours, constant = _beats_the_constant(ExtractRun(tmp_path / "extract" / done["run"]["name"]), surrogate)
        assert ours < constant, (kind, ours, constant)
    hand_off = [f"paths.surrogate_{k}='{m['run']['id']}'" for k, m in ids.items()]  # quoted: 12e45678 is a float
    for method, knobs in METHODS.items():
        metrics = execute(
            compose_stage("evaluate", None, [*model, *EVALUATE, *hand_off, f"method={method}", *knobs]), evaluate.run
        )
        prune = metrics["overall"]["prune_ratio"]
        assert (prune == 0.0) if method == "full" else (0.3 < prune < 1.0), (method, prune)
    metrics = execute(
        compose_stage(
            "fidelity", None, [*model, "benchmark=aime25", "fidelity.prompts=1", "fidelity.new_tokens=6", "method=full"]
        ),
        fidelity.run,
    )
    assert metrics["overall"]["token_agreement"] == 1.0
    out = tmp_path / "lm_eval"
    lines = ["lm_eval.tasks=[kvr_quality]", "lm_eval.limit=1", "lm_eval.max_length=1024", "method=kvzap_mlp"]
    metrics = execute(compose_stage("lm_eval", out, [*model, *hand_off, *lines]), lm_eval.run)
    assert json.loads((out / "lm_eval_results.json").read_text())["results"]["kvr_quality"]["acc,none"] in (0.0, 1.0)
