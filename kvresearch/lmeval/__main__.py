"""lm-eval's command line with the ``kvresearch`` model registered and the vendored tasks included."""

import sys

from lm_eval.__main__ import cli_evaluate

from kvresearch.lmeval import TASKS_DIR


def main() -> None:
    """Run lm-eval's command line (``run --model kvresearch --model_args ... --tasks ...``) with the tasks here."""
    if "--include_path" not in sys.argv:
        sys.argv += ["--include_path", str(TASKS_DIR)]
    cli_evaluate()


if __name__ == "__main__":
    main()
