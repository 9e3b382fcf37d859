"""lm-eval integration: the ``kvresearch`` model (registered on import) and task configs for the vendored data.

``python -m kvresearch.lmeval run --model kvresearch --model_args model=smollm2_135m,method=kvzap_mlp
--tasks kvr_quality`` is lm-eval's own command line with this model registered and ``tasks/`` included;
``simple_evaluate(model="kvresearch", ...)`` works once this package is imported.
"""

from pathlib import Path

from kvresearch.lmeval.model import KVResearchLM

TASKS_DIR = Path(__file__).parent / "tasks"

__all__ = ["TASKS_DIR", "KVResearchLM"]
