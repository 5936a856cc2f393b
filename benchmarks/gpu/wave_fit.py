"""Issue 15: where a loaded level's time goes, from one-wave levels at two output lengths.

usage: python benchmarks/gpu/wave_fit.py RESULTS_JSON [--patched dyn-v2] [--plain base]
  RESULTS_JSON  name -> client.py result, as the kit's session writes $OUT/results.json, run
                with ``--olens A,B`` and without ``--duration`` (the kit: ``OLENS=128,512
                DURATION=0``), so each level is one wave of c requests sent together; further
                servers of a kind (NAME@N) pool with the first

A wave of c requests of L new tokens takes about ``fixed + L * per_token``: ``per_token`` is one
decode step of c requests, ``fixed`` what the wave costs beyond its decode steps (the prefill
of c prompts, the steps around it, HTTP). A least-squares line through every wave of a kind at
each c gives both. The table prints them per kind, then the patched kind's per-token time
over plain decoding's (its decode speed: above 1 is slower) and its fixed time minus plain
decoding's (what each wave costs it more outside the decode steps). On 2026-12-04 the patched
server's closed-loop level at c = 64 ran at 0.950 of plain decoding while its steady decode
lines ran at 0.979; this splits such a gap without a trace. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from envelope_report import pooled


def waves(result: dict) -> dict[int, list[tuple[int, float]]]:
    """Concurrency -> (output length, wall seconds) of each one-wave level that has both."""
    out: dict[int, list[tuple[int, float]]] = {}
    for level in result.get("levels", []):
        if "duration_s" in level or "olen" not in level or "wall_s" not in level:
            continue
        out.setdefault(int(level["concurrency"]), []).append(
            (int(level["olen"]), float(level["wall_s"]))
        )
    return out


def fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(fixed, per_token) seconds of the least-squares line wall = fixed + olen * per_token;
    None unless the points hold at least two output lengths."""
    if len({olen for olen, _ in points}) < 2:
        return None
    line = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return line.intercept, line.slope


def table(results: dict, kinds: list[str]) -> str:
    kinds = [k for k in kinds if k in results]
    fits = {k: {c: (len(p), fit(p)) for c, p in waves(results[k]).items()} for k in kinds}
    lines = ["| c | server | waves | fixed ms | per-token ms |", "|---|---|---|---|---|"]
    for c in sorted({c for k in kinds for c in fits[k]}):
        for k in kinds:
            if c not in fits[k]:
                continue
            count, line = fits[k][c]
            cells = ["–", "–"] if line is None else [f"{1000 * v:.3f}" for v in line]
            lines.append(f"| {c} | {k} | {count} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comparison(results: dict, patched: str, plain: str) -> str:
    if patched not in results or plain not in results:
        return ""
    ours, theirs = waves(results[patched]), waves(results[plain])
    rows = []
    for c in sorted(set(ours) & set(theirs)):
        mine, base = fit(ours[c]), fit(theirs[c])
        if mine is None or base is None:
            continue
        rows.append(
            f"| {c} | {mine[1] / base[1]:.3f} | {1000 * (mine[0] - base[0]):+.1f} |"
        )
    if not rows:
        return ""
    head = f"| c | per-token {patched} ÷ {plain} | fixed {patched} − {plain} (ms per wave) |"
    return "\n".join([head, "|---|---|---|", *rows])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    ap.add_argument("results")
    ap.add_argument("--patched", default="dyn-v2")
    ap.add_argument("--plain", default="base")
    a = ap.parse_args(argv)
    results = pooled(json.loads(Path(a.results).read_text()))
    for part in (table(results, [a.patched, a.plain]), comparison(results, a.patched, a.plain)):
        if part:
            print(part, end="\n\n")


if __name__ == "__main__":
    main(sys.argv[1:])
