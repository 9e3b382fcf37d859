"""Progress bars that do not flood logs: a live bar on a terminal, a line every ``every_s`` seconds elsewhere."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm.auto import tqdm


class Progress:
    """A progress bar for ``total`` steps of ``desc``."""

    def __init__(self, total: int, desc: str, unit: str = "it", every_s: float = 60.0):
        self.interactive = sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=desc, unit=unit, disable=not self.interactive, dynamic_ncols=True)
        self.total, self.desc, self.every_s = total, desc, every_s
        self.done, self.last = 0, time.monotonic()

    def update(self, n: int = 1, **postfix: Any) -> None:
        """``n`` more steps done; ``postfix`` shows alongside."""
        self.done += n
        if self.interactive:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)
        elif time.monotonic() - self.last >= self.every_s or self.done == self.total:
            extra = " ".join(f"{k}={v}" for k, v in postfix.items())
            print(f"[{self.desc}] {self.done}/{self.total} {extra}", flush=True)
            self.last = time.monotonic()

    def close(self) -> None:
        """End the bar."""
        self.bar.close()
