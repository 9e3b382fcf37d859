"""Model glue: loading (embedded, random, hub), the adapter, hooks, the ragged cache, sessions, kvpress.

The only package that imports transformers.
"""

from kvresearch.models.adapter import ModelAdapter
from kvresearch.models.load import LoadedModel, load_model
from kvresearch.models.session import Session

__all__ = ["LoadedModel", "ModelAdapter", "Session", "load_model"]
