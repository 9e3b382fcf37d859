"""KVzap surrogates: modules, training data, Lightning wrappers, fit metrics, export."""

from kvresearch.surrogate.modules import Surrogate, SurrogateConfig, from_run

__all__ = ["Surrogate", "SurrogateConfig", "from_run"]
