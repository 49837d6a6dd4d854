"""A minimal progress bar on stderr (no dependency): shown only on a terminal, or when
asked for, so that logs and pipes stay clean.

>>> with Progress(total=3, label="profiling", enabled=False) as bar:
...     for _ in range(3):
...         bar.advance()
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, *, enabled: bool | None = None,
                 stream: TextIO | None = None, width: int = 28):
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width = width
        self.done = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._draw(force=True)
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + n)
        self._draw(note=note)

    def _draw(self, *, force: bool = False, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < 0.1 and self.done < self.total:
            return
        self._last_draw = now
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self._start
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} "
                          f"{elapsed:5.1f}s {note[:30]:<30}")
        self.stream.flush()
