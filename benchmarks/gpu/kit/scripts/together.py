"""Run a level's client threads so that their first requests leave together (stdlib only).

A closed loop of c clients that each opened its connection with its first request sent its
first c requests spread out: thread starts, TCP handshakes and the GIL, one thread after
another. An idle SGLang scheduler prefills what has arrived and then decodes it, so a level
whose first requests come spread out runs out of step from its start: in the 2026-12-05 batch
lines the second c = 64 repeat's first wave reached the server as 51, then 13 requests, on
plain and patched servers alike (RESULTS.md), and levels out of step measured 0.90-0.97 of
plain decoding where levels in step measured 0.96-0.98. Here every thread first opens its
connection (keepalive.connect), then waits at a barrier; the level's clock starts when the
last one arrives, and all are released at once. benchmarks/gpu/client_start.py compares the
two starts against a stand-in server (on a 2-CPU machine: the first 64 requests arrived over
39 ms before, 14 ms with this; 128 over 86 and 30 ms).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from keepalive import connect

T = TypeVar("T")
GATHER_TIMEOUT_S = 60.0  # every thread connects well within this; a hung one breaks the level


def run_together(conc: int, client: Callable[[int, float], T], url: str,
                 timeout: float) -> tuple[list[T], float, float]:
    """``client(k, t0)`` for k in 0..conc-1, each on its own thread with its connection to
    ``url`` already open, all released at t0 (time.perf_counter(), when the last thread was
    ready). Returns the clients' results in order of k, t0, and how far apart (ms) the
    threads got going after the release (each client sends its first request then)."""
    started: list[float] = []
    gate = threading.Barrier(conc, action=lambda: started.append(time.perf_counter()))
    going: list[float] = []

    def thread(k: int) -> T:
        connect(url, timeout)
        gate.wait(GATHER_TIMEOUT_S)
        going.append(time.perf_counter())
        return client(k, started[0])

    with ThreadPoolExecutor(conc) as ex:
        results = list(ex.map(thread, range(conc)))
    return results, started[0], round(1000 * (max(going) - min(going)), 2)
