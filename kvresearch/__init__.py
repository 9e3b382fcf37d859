"""kvresearch: KV-cache compression research (KVzip+/KVzap and Attention Matching)."""

import os

# Quiet, non-interactive defaults for library logging; a user's own settings win.
for _key, _value in {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_SILENT": "true",
}.items():
    os.environ.setdefault(_key, _value)

__version__ = "0.1.0"
