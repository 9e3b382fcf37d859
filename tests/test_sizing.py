"""GPU-hour sizing: every hub cell is priced on the architecture it runs."""

from __future__ import annotations

from kvresearch.sizing import architecture_of, experiment_rows


def test_a_cell_is_priced_on_its_model_override_not_its_label() -> None:
    assert architecture_of("qwen3_4b quality", ("model=qwen3_4b", "benchmark=quality")) == "qwen3_4b"
    assert architecture_of("llama31_8b", ("benchmark=ruler",)) == "llama31_8b"
    assert architecture_of("x", ("model=a", "model=b")) == "b"  # Hydra keeps the last


def test_an_experiment_whose_model_rows_carry_labels_is_sized() -> None:
    rows = experiment_rows("am_curves", {})  # its hub rows are labelled "qwen3_4b quality" and "qwen3_4b ruler"
    assert {r["model"] for r in rows} >= {"qwen3_4b quality"}
    assert all(r["cells"] > 0 and r["gpu_hours"] > 0 and r["rates"] == "estimated" for r in rows)


def test_a_fidelity_cell_counts_its_prompts_and_their_long_generations() -> None:
    rows = experiment_rows("fidelity", {})  # hub: 20 prompts of 1,024 new tokens per cell
    assert rows and all(r["contexts"] == 20 * r["cells"] for r in rows)
    assert all("the first 20 prompts, 1024 new tokens each" in r["source"] for r in rows)
