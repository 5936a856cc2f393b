"""Issue 15's side-by-side table from one hold's client.py results (the kit's ``session``).

usage: python benchmarks/gpu/side_by_side.py RESULTS_JSON [--patched dyn-v2] [--plain base]
           [--against eagle-v2 --against native-v2]
  RESULTS_JSON  name -> client.py result, as the kit's session writes $OUT/results.json; a
                further server of a kind (NAME@N) counts as more repeats of it, so servers run
                in alternating order (dyn-v2, base, ..., dyn-v2@2, base@2) pool into one mean

Prints, per concurrency: each kind's output tok/s by the wall, loaded (client.py's
``loaded_tok_per_s``: each client's tokens over its own busy time, without the clients' idle
time in the drain after the deadline), full load (``full_load_tok_per_s``: the same over the
requests that ended before the first client stopped, leaving out a partial wave the deadline
let some clients start: the figure to compare closed-loop levels by) and by the server's own
times (``server_tok_per_s``: the same over SGLang's e2e_latency, without HTTP and the client;
"–" for results that lack it), each a mean over every repeat of every server of that kind;
then the patched kind divided by plain decoding and by each ``--against`` kind, on every
figure; then the same ratio server by server (the first patched server over the first plain
one, the second over the second); then each server's SM clock per level, mean and lowest
(client.py's ``"gpu"``), since a server that ran at lower clocks is not comparable; then, per
server and level, the host as its scheduler met it (client.py's ``"host"``, host_sampler.py: the
scheduler's main thread's CPU share, its run-queue wait, involuntary switches, the CPUs it ran
on, how busy their SMT siblings were, how often another sampled process shared its core; the
client's CPU share and CPUs; the host's busy share and load), since a host-bound step (v1)
slows with its core, not with the GPU; then the levels during which the server compiled
kernels (client.py's ``"jit_compiled"``: the JIT caches' new files).
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from envelope_report import pooled, server_kind

FIGURES = (
    ("wall", "output_tok_per_s"),
    ("loaded", "loaded_tok_per_s"),
    ("full load", "full_load_tok_per_s"),
    ("server", "server_tok_per_s"),
)


def by_level(result: dict, key: str) -> dict[int, float]:
    """Concurrency -> the mean of ``key`` over the levels that recorded it."""
    values: dict[int, list[float]] = {}
    for level in result.get("levels", []):
        if level.get(key) is not None:
            values.setdefault(int(level["concurrency"]), []).append(float(level[key]))
    return {c: statistics.mean(v) for c, v in values.items()}


def ratio(a: dict[int, float], b: dict[int, float], c: int) -> str:
    return f"{a[c] / b[c]:.3f}" if c in a and c in b else "–"


def figures(result: dict) -> list[dict[int, float]]:
    """``by_level`` of each of FIGURES, in that order."""
    return [by_level(result, key) for _, key in FIGURES]


def speed_table(results: dict, kinds: list[str]) -> str:
    kinds = [k for k in kinds if k in results]
    columns = [column for k in kinds for column in figures(results[k])]
    levels = sorted({c for k in kinds for c in by_level(results[k], "output_tok_per_s")})
    head = " | ".join(f"{k} {label}" for k in kinds for label, _ in FIGURES)
    lines = [f"| c | {head} |", "|---" * (1 + len(FIGURES) * len(kinds)) + "|"]
    for c in levels:
        cells = ["–" if c not in column else f"{column[c]:.1f}" for column in columns]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(results: dict, patched: str, others: list[str]) -> str:
    others = [o for o in others if o in results]
    if patched not in results or not others:
        return ""
    ours = figures(results[patched])
    pairs = [(mine, theirs) for o in others
             for mine, theirs in zip(ours, figures(results[o]), strict=True)]
    head = " | ".join(f"÷ {o} ({label})" for o in others for label, _ in FIGURES)
    lines = [f"| c | {head} |", "|---" * (1 + len(FIGURES) * len(others)) + "|"]
    for c in sorted(ours[0]):
        lines.append(f"| {c} | " + " | ".join(ratio(m, t, c) for m, t in pairs) + " |")
    return "\n".join(lines)


def pairs_table(raw: dict, patched: str, plain: str) -> str:
    """The patched servers over the plain ones in run order: first over first, second over
    second (the ABAB pairs), by the full-load figure where both recorded it, else the loaded."""
    mine = [n for n in raw if server_kind(n) == patched]
    theirs = [n for n in raw if server_kind(n) == plain]
    rows = []
    for a, b in zip(mine, theirs, strict=False):
        full = by_level(raw[a], "full_load_tok_per_s"), by_level(raw[b], "full_load_tok_per_s")
        loaded = by_level(raw[a], "loaded_tok_per_s"), by_level(raw[b], "loaded_tok_per_s")
        cells = ", ".join(
            f"c = {c}: " + (f"{ratio(*full, c)} (full load)" if c in full[0] and c in full[1]
                            else f"{ratio(*loaded, c)} (loaded)")
            for c in sorted(loaded[0]) if c in loaded[1])
        rows.append(f"| {a} ÷ {b} | {cells} |")
    if not rows:
        return ""
    return "\n".join(["| pair | ratio by concurrency |", "|---|---|", *rows])


def clocks_table(raw: dict) -> str:
    rows = []
    for name, result in raw.items():
        cells = []
        for level in result.get("levels", []):
            gpu = level.get("gpu")
            if gpu:
                cells.append(f"c{level['concurrency']}: {gpu['sm_mhz_mean']:.0f}"
                             f" (≥ {gpu['sm_mhz_min']:.0f})")
        if cells:
            rows.append(f"| {name} | {'; '.join(cells)} |")
    if not rows:
        return ""
    return "\n".join(["| server | SM MHz per level, mean (lowest) |", "|---|---|", *rows])


def host_table(raw: dict) -> str:
    def cell(value: object) -> str:
        if value is None:
            return "–"
        if isinstance(value, list):
            return ",".join(map(str, value))
        return f"{value:.0f}" if isinstance(value, float) and value >= 10 else str(value)

    rows = []
    for name, result in raw.items():
        for level in result.get("levels", []):
            host = level.get("host")
            if not host:
                continue
            sched = host["processes"].get("scheduler") or {}
            client = host["processes"].get("client") or {}
            cells = [sched.get(k) for k in ("cpu_pct", "runqueue_wait_pct",
                                            "involuntary_switches_per_s", "cpus",
                                            "smt_sibling_busy_pct", "core_shared_pct")]
            cells += [client.get("cpu_pct"), client.get("cpus"),
                      host["host"]["busy_pct"], host["host"]["load_1min"]]
            rows.append(f"| {name} | {level['concurrency']} | "
                        + " | ".join(cell(v) for v in cells) + " |")
    if not rows:
        return ""
    return "\n".join([
        "| server | c | scheduler CPU % | run-queue wait % | involuntary switches/s | its CPUs"
        " | SMT siblings busy % | core shared % | client CPU % | client's CPUs | host busy %"
        " | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows])


def jit_table(raw: dict) -> str:
    """Levels during which the server's JIT caches gained files (client.py's ``"jit_compiled"``):
    kernels a server compiled at first use, stalling the step that called them."""
    rows = []
    for name, result in raw.items():
        for level in result.get("levels", []):
            for cache, new in sorted((level.get("jit_compiled") or {}).items()):
                if new["new_files"]:
                    rows.append(f"| {name} | {level['concurrency']} | {level.get('repeat', 0)} | "
                                f"{cache} | {new['new_files']} | {', '.join(new['kernels'])} |")
    if not rows:
        return ""
    return "\n".join(["| server | c | repeat | cache | new files | kernels |",
                      "|---|---|---|---|---|---|", *rows])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    ap.add_argument("results")
    ap.add_argument("--patched", default="dyn-v2")
    ap.add_argument("--plain", default="base")
    ap.add_argument("--against", action="append", default=[])
    a = ap.parse_args(argv)
    raw = json.loads(Path(a.results).read_text())
    results = pooled(raw)
    kinds = [a.patched, a.plain, *a.against]
    for part in (speed_table(results, kinds),
                 ratio_table(results, a.patched, [a.plain, *a.against]),
                 pairs_table(raw, a.patched, a.plain), clocks_table(raw), host_table(raw),
                 jit_table(raw)):
        if part:
            print(part, end="\n\n")


if __name__ == "__main__":
    main(sys.argv[1:])
