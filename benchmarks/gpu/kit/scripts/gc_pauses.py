"""The load client's own garbage-collector pauses while a measurement runs (stdlib only).

A collection holds the GIL: every client thread stops sending and reading for its length, and
the server of a closed loop may idle. On an H200 (2026-12-04) the time each request spent
outside SGLang's e2e_latency doubled in the middle one of three repeats, on plain and patched
servers alike; these pauses are one place that time could go, and now each level says.

    with GcPauses() as pauses:
        ...                                   # the level
    level["client_gc"] = pauses.summary()
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Counts and times this process's collections while open (a context manager)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._started: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses.append((int(info["generation"]), time.perf_counter() - self._started))
            self._started = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        """Collections per generation, their total and longest pause in ms."""
        return {
            "collections": [sum(1 for g, _ in self.pauses if g == n) for n in range(3)],
            "total_ms": round(1000 * sum(s for _, s in self.pauses), 2),
            "longest_ms": round(1000 * max((s for _, s in self.pauses), default=0.0), 2),
        }
