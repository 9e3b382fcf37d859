"""Model glue: loading (embedded, random, hub), the adapter, hooks."""

from kvresearch.models.adapter import ModelAdapter
from kvresearch.models.load import LoadedModel, load_model

__all__ = ["LoadedModel", "ModelAdapter", "load_model"]
