"""(b) Bursty 1 <-> 64 load: acceptance must recover after speculation resumes.

A few long "survivor" requests stream greedily for the whole run. Between quiet windows (only
the survivors run, batch <= resume_below, so the server speculates) the script fires bursts of
--burst-size concurrent requests (batch > T, so the patched server runs fallback steps). The
survivors live through every switch, so their acceptance after a burst shows whether the draft
KV stayed warm during the fallback steps.

Two measurements per window:
- stream: delta(completion_tokens) / delta(spec_verify_ct) of the survivors' own meta_info
  (exact per window; a fallback step counts as one verify accepting one token);
- server: avg_spec_accept_length from /server_info internal_states, after zeroing the counters
  at the window start through /set_internal_state (when the release allows it).

Pass: every burst window is close to 1.0 (the fallback engaged) and every quiet window after a
burst is within --tolerance of the first quiet window.

    python benchmarks/gpu/bursty_accept.py --server-port 30001 --threshold 8
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from _client import Server, add_server_args, greedy_payload, server_from
from prompts import builtin_prompts


@dataclass
class Timeline:
    """(time, completion_tokens, spec_verify_ct) samples of one streamed request."""

    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    verifies: list[int] = field(default_factory=list)

    def add(self, t: float, tokens: int, verifies: int) -> None:
        self.times.append(t)
        self.tokens.append(tokens)
        self.verifies.append(verifies)

    def at(self, t: float) -> tuple[int, int] | None:
        i = bisect.bisect_right(self.times, t) - 1
        return (self.tokens[i], self.verifies[i]) if i >= 0 else None


def window_accept_length(timelines: list[Timeline], start: float, end: float) -> float | None:
    """Tokens per verify step of all survivors between ``start`` and ``end``."""
    d_tokens = d_verifies = 0
    for timeline in timelines:
        a, b = timeline.at(start), timeline.at(end)
        if a is None or b is None:
            continue
        d_tokens += b[0] - a[0]
        d_verifies += b[1] - a[1]
    return d_tokens / d_verifies if d_verifies > 0 else None


@dataclass
class Window:
    label: str
    start: float
    end: float
    server_avg: float | None


def judge(windows: list[Window], stream: list[float | None], tolerance: float,
          burst_ceiling: float) -> list[str]:
    """Failure messages (empty = pass)."""
    problems = []
    quiet = [(w, a) for w, a in zip(windows, stream, strict=True) if w.label.startswith("quiet")]
    bursts = [(w, a) for w, a in zip(windows, stream, strict=True) if w.label.startswith("burst")]
    if not quiet or quiet[0][1] is None:
        return ["no acceptance measured in the first quiet window (survivors too short?)"]
    reference = quiet[0][1]
    for w, a in bursts:
        if a is None or a > burst_ceiling:
            problems.append(f"{w.label}: accept length {a} > {burst_ceiling}: fallback not engaged")
    for w, a in quiet[1:]:
        if a is None:
            problems.append(f"{w.label}: no data (raise --survivor-tokens)")
        elif a < reference * (1 - tolerance):
            problems.append(f"{w.label}: accept length {a:.3f} < {1 - tolerance:.2f} x "
                            f"{reference:.3f} (pre-burst): draft state did not recover")
    return problems


def render(windows: list[Window], stream: list[float | None]) -> str:
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    rows = ["window        seconds  accept(stream)  avg_spec_accept_length(server)"]
    for w, a in zip(windows, stream, strict=True):
        rows.append(f"{w.label:<13} {w.end - w.start:7.1f}  {fmt(a):>14}  {fmt(w.server_avg):>30}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(parser, "server", 30001, "patched EAGLE server")
    parser.add_argument("--threshold", type=int, required=True,
                        help="the server's --speculative-disable-batch-threshold")
    parser.add_argument("--survivors", type=int, default=1,
                        help="long requests alive through every burst (keep <= resume_below)")
    parser.add_argument("--burst-size", type=int, default=64)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--window-seconds", type=float, default=20.0)
    parser.add_argument("--survivor-tokens", type=int, default=16384)
    parser.add_argument("--burst-tokens", type=int, default=512)
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--burst-ceiling", type=float, default=1.15,
                        help="max accept length accepted in a burst window (fallback = 1.0)")
    ns = parser.parse_args(argv)
    if ns.burst_size <= ns.threshold:
        parser.error("--burst-size must exceed --threshold, or no fallback step ever runs")

    server = server_from(ns, "server")
    timelines = [Timeline() for _ in range(ns.survivors)]
    stop = threading.Event()

    def survive(i: int) -> None:
        payload = greedy_payload(builtin_prompts()[i], ns.survivor_tokens, ignore_eos=True)
        payload["return_logprob"] = False
        for chunk in server.generate_stream(payload):
            meta = chunk.get("meta_info") or {}
            timelines[i].add(time.monotonic(), int(meta.get("completion_tokens", 0)),
                             int(meta.get("spec_verify_ct", 0)))
            if stop.is_set():
                return  # closing the stream aborts the request on the server

    threads = [threading.Thread(target=survive, args=(i,), daemon=True)
               for i in range(ns.survivors)]
    for thread in threads:
        thread.start()
    windows: list[Window] = []
    try:
        time.sleep(5.0)  # let the survivors pass prefill
        windows.append(quiet_window(server, "quiet-0", ns.window_seconds))
        for cycle in range(1, ns.cycles + 1):
            windows.append(burst_window(server, f"burst-{cycle}", ns))
            windows.append(quiet_window(server, f"quiet-{cycle}", ns.window_seconds))
    finally:
        stop.set()
    stream = [window_accept_length(timelines, w.start, w.end) for w in windows]
    print(render(windows, stream))
    problems = judge(windows, stream, ns.tolerance, ns.burst_ceiling)
    print(json.dumps({"pass": not problems, "problems": problems}, indent=2))
    return 1 if problems else 0


def quiet_window(server: Server, label: str, seconds: float) -> Window:
    reset = server.reset_spec_counters()
    start = time.monotonic()
    time.sleep(seconds)
    end = time.monotonic()
    return Window(label, start, end, server.avg_spec_accept_length() if reset else None)


def burst_window(server: Server, label: str, ns: argparse.Namespace) -> Window:
    reset = server.reset_spec_counters()
    prompts = builtin_prompts(ns.burst_size)
    start = time.monotonic()
    with ThreadPoolExecutor(ns.burst_size) as pool:
        list(pool.map(lambda p: server.generate(greedy_payload(p, ns.burst_tokens,
                                                               ignore_eos=True)), prompts))
    end = time.monotonic()
    return Window(label, start, end, server.avg_spec_accept_length() if reset else None)


if __name__ == "__main__":
    sys.exit(main())
