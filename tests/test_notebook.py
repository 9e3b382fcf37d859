"""notebooks/results.ipynb executes (nbclient) on a small fixture run folder, so it cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
import yaml
from nbclient import NotebookClient

from kvresearch import experiment as experiments
from kvresearch.runs import repo_root


def plant(folder: Path, scores: list[float], prune: float) -> None:
    """A finished evaluate run folder: metrics, per-answer predictions, DONE."""
    folder.mkdir(parents=True)
    records = [{"id": f"task#{i}", "score": s, "prune_ratio": prune} for i, s in enumerate(scores)]
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    overall = {"prune_ratio": prune, "samples": len(scores), "score": 100 * sum(scores) / len(scores)}
    (folder / "metrics.json").write_text(json.dumps({"overall": overall, "method": {"name": "x"}}))
    (folder / "DONE").write_text("planted\n")


@pytest.mark.slow
def test_results_notebook_executes_on_a_fixture_experiment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [
        {"method": "full", "reference": True},
        {"method": "snapkv", "sweep": {"method.keep_ratio": [0.5, 0.25]}},
    ]
    variant = {"models": ["tiny_random"], "shared": ["benchmark=ruler"], "rows": rows}
    spec = tmp_path / "fixture.yaml"
    spec.write_text(
        yaml.safe_dump({"title": "fixture", "paper": "none", "variants": {"twin": variant, "hub": variant}})
    )
    cells = experiments.cells(experiments.load(str(spec)), "twin")
    plant(cells[0].folder(tmp_path / "out"), [1, 1, 0, 1], 0.0)
    plant(cells[1].folder(tmp_path / "out"), [1, 0, 0, 1], 0.5)  # keep 0.25 is left unrun
    monkeypatch.setenv("KVRESEARCH_OUTPUTS", str(tmp_path / "out"))
    monkeypatch.setenv("KVR_EXPERIMENT", str(spec))
    notebook = nbformat.read(repo_root() / "notebooks" / "results.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "2 of 3 cells finished" in text and "not run" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the curve was drawn
