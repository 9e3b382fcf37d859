"""KVzap surrogates: modules, training data, Lightning wrappers, fit metrics, export."""

from kvresearch.surrogate.modules import Surrogate, SurrogateConfig

__all__ = ["Surrogate", "SurrogateConfig"]
