"""The papers' tables and figures as experiments (``conf/experiment/``).

Configs and cells (:mod:`.config`), tables (:mod:`.results`), figures, and the command line
``python -m kvresearch.experiment list|run|table`` (:mod:`.cli`).
"""

from kvresearch.experiment.config import Cell, Step, cells, load, names, select, step_run, steps, x_axis
from kvresearch.experiment.results import NOT_RUN, Result, latex, markdown, read, recorded, summary_line, table

__all__ = [
    "NOT_RUN",
    "Cell",
    "Result",
    "Step",
    "cells",
    "latex",
    "load",
    "markdown",
    "names",
    "read",
    "recorded",
    "select",
    "step_run",
    "steps",
    "summary_line",
    "table",
    "x_axis",
]
