"""``python -m kvresearch.experiment``: see :mod:`kvresearch.experiment.cli`."""

from kvresearch.experiment.cli import main

main()
