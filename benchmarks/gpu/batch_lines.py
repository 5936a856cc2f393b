"""Issue 15: a closed-loop level's waves, from the server's own batch log lines.

usage: python benchmarks/gpu/batch_lines.py PATCHED_LOG[@FROM-TO] PLAIN_LOG[@FROM-TO] [-c C]
                                            [--list]
  *_LOG     an SGLang server log (the kit writes ``work/logs/NAME.server.log``), split into
            levels where it says the radix cache was flushed (the kit's client flushes it before
            each level), the two logs' levels compared in order; ``@FROM-TO`` keeps the lines
            logged from FROM to TO (HH:MM:SS, both included)
  -c        only the levels at concurrency C (a level's: the batch size most decode lines ran)
  --list    first print every wave of each level (its boundary's time, in step or not)

SGLang logs one ``Decode batch`` line every 40 decode steps, its ``gen throughput`` the tokens
of those steps over the time since the line before; and one ``Prefill batch`` line per prefill
batch. So the time between two decode lines is ``40 * bs / gen_throughput`` (every step of a
closed-loop level at c runs bs = c), and the lines cover the level's time without a gap.

When every request of a level asks for the same number of tokens, c requests finish on one
step and the next c arrive together: a *wave*. A wave here runs from one *boundary* (a decode
line that follows prefill lines: its 40 steps hold the end of the last wave, the client's
replies and new requests, and the prefills) to the next. It is *in step* when its prefills
began on an empty batch and every decode line in it ran all c requests; once requests fall
out of step (a decode step runs between two prefills of one wave), later waves stay split and
prefill while the rest decode.

Per level and log: the waves in step on both servers (the client sends the same prompts in
the same order to both, so the k-th wave of one is the k-th of the other) out of the log's
whole waves, prefill batches per wave, each boundary's time beyond 40 steady steps (its
neighbours' mean), the steady lines' time per 40 steps, tokens per second over those waves,
and over the level as it ran (from its first boundary on, as many tokens on both servers:
the figure for a level whose waves fell out of step); then the patched log over the plain
one. On 2026-12-04's logs this split the patched server's c = 64 closed loop (RESULTS.md).
Standard library only.
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

STEPS_PER_LINE = 40  # SGLang's decode_log_interval default
# "[2026-12-04 17:52:43 TP0] ...": the time (SGLANG_LOG_MS adds ".123"), then the scheduler's
# ranks where there are several; only rank 0's lines are read (every rank logs its batches).
_TIME = re.compile(r"(\d\d:\d\d:\d\d)(?:\.\d+)?((?: [A-Z_]+\d+)*)\]")
_OTHER_RANK = re.compile(r"[A-Z_]+[1-9]\d*")
_DECODE = re.compile(r"Decode batch.*?#running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+)")
_PREFILL = re.compile(r"Prefill batch.*?#new-seq: (\d+).*?#running-req: (\d+)")
_FLUSH = "Cache flushed successfully"


@dataclass
class Line:
    time: str
    prefill: bool
    size: int  # decode: requests in the batch; prefill: new requests
    running: int = 0  # prefill: requests already running
    ms: float = 0.0  # decode: time since the decode line before


@dataclass
class Wave:
    start: str  # the boundary line's time (HH:MM:SS)
    boundary_ms: float  # the boundary line's time beyond 40 steady steps
    steady_ms: list[float] = field(default_factory=list)  # the other lines' times
    ms: float = 0.0  # every line of the wave
    tokens: int = 0
    prefills: int = 0
    in_step: bool = True


def read_lines(path: str, start: str | None = None, end: str | None = None) -> list[Line]:
    """The batch lines of one server log, from ``start`` to ``end`` (HH:MM:SS, included)."""
    return [line for level in read_levels(path, start, end) for line in level]


def read_levels(path: str, start: str | None = None, end: str | None = None) -> list[list[Line]]:
    """The batch lines of one server log, from ``start`` to ``end`` (HH:MM:SS, included), split
    into levels where the log says the radix cache was flushed (the kit's client flushes it
    before every level); the lines before the first flush are dropped where there is one."""
    levels: list[list[Line]] = [[]]
    flushed = False
    for text in Path(path).read_text(errors="replace").splitlines():
        when = _TIME.search(text)
        if when is None or (start and when[1] < start) or (end and when[1] > end):
            continue
        if any(_OTHER_RANK.fullmatch(rank) for rank in when[2].split()):
            continue
        if _FLUSH in text:
            levels.append([])
            flushed = True
            continue
        lines = levels[-1]
        if decode := _DECODE.search(text):
            size, rate = int(decode[1]), float(decode[2])
            ms = 1000 * STEPS_PER_LINE * size / rate if rate > 0 else 0.0
            lines.append(Line(when[1], False, size, ms=ms))
        elif prefill := _PREFILL.search(text):
            lines.append(Line(when[1], True, int(prefill[1]), running=int(prefill[2])))
    return [level for level in (levels[1:] if flushed else levels) if level]


def concurrency_of(lines: list[Line]) -> int | None:
    """The largest decode batch of a level (None: no decode line). The client keeps c requests
    in flight, so a level reaches c, though out of step most of its lines may run fewer (a
    level of c = 128 whose requests finish one by one runs mostly 127)."""
    return max((line.size for line in lines if not line.prefill), default=None)


def between_boundaries(lines: list[Line]) -> list[Line]:
    """The decode lines after a level's first boundary (whose time holds the level's start)
    up to its last one (after which requests drain): the level at full load, whole waves or
    not."""
    decode = [i for i, line in enumerate(lines) if not line.prefill]
    marks = [n for n, i in enumerate(decode) if i > 0 and lines[i - 1].prefill]
    if len(marks) < 2:
        return []
    return [lines[i] for i in decode[marks[0] + 1 : marks[-1]]]


def rate_over(lines: list[Line], tokens: float) -> float:
    """Tokens per second over the first ``tokens`` tokens of these decode lines (the last line
    taken in part); NaN where they hold fewer."""
    done = ms = 0.0
    for line in lines:
        step_tokens = STEPS_PER_LINE * line.size
        if done + step_tokens >= tokens:
            return tokens / (ms + line.ms * (tokens - done) / step_tokens) * 1000
        done, ms = done + step_tokens, ms + line.ms
    return float("nan")


def waves(lines: list[Line], concurrency: int) -> list[Wave]:
    """Every whole wave at ``concurrency``: from one boundary to the next, both inside the
    lines, with a steady decode line on each side of its boundary."""
    decode = [i for i, line in enumerate(lines) if not line.prefill]
    boundaries = [
        n for n, i in enumerate(decode) if n > 0 and lines[i - 1].prefill and n + 1 < len(decode)
    ]
    out = []
    for first, following in itertools.pairwise(boundaries):
        i = decode[first]
        before, after = lines[decode[first - 1]], lines[decode[first + 1]]
        if lines[i].size != concurrency or before.size != after.size or after.size != concurrency:
            continue
        steady = (before.ms + after.ms) / 2
        wave = Wave(lines[i].time, boundary_ms=lines[i].ms - steady)
        prefills = [ln for ln in lines[decode[first - 1] + 1 : i] if ln.prefill]
        wave.prefills = len(prefills)
        wave.in_step = prefills[0].running == 0 and sum(p.size for p in prefills) == concurrency
        for n in range(first, following):
            line = lines[decode[n]]
            wave.ms += line.ms
            wave.tokens += STEPS_PER_LINE * line.size
            wave.in_step = wave.in_step and line.size == concurrency
            if n != first:
                wave.steady_ms.append(line.ms)
        wave.in_step = wave.in_step and not any(
            ln.prefill for ln in lines[i + 1 : decode[following - 1]]
        )
        out.append(wave)
    return out


def summary(found: list[Wave], in_step: list[bool] | None = None) -> dict[str, float]:
    """Figures over the waves in step (NaN where there is none), and the rate over every whole
    wave, in step or not. ``in_step``, where given, marks the first waves instead of their
    own flags (those in step on both servers), and the waves after them count as not."""
    marks = [w.in_step for w in found] if in_step is None else in_step
    kept = [w for w, keep in zip(found, marks, strict=False) if keep]
    steady = [ms for w in kept for ms in w.steady_ms]
    nan = float("nan")
    return {
        "in_step": len(kept),
        "all": len(found),
        "prefills": statistics.mean(w.prefills for w in kept) if kept else nan,
        "boundary_ms": statistics.median(w.boundary_ms for w in kept) if kept else nan,
        "steady_ms": statistics.mean(steady) if steady else nan,
        "tok_s": sum(w.tokens for w in kept) / sum(w.ms for w in kept) * 1000 if kept else nan,
    }


def listing(found: list[Wave]) -> str:
    """One row per wave, to find a level's window."""
    rows = ["| boundary at | in step | prefill batches | boundary ms | wave ms | tokens |",
            "|---|---|---|---|---|---|"]
    for w in found:
        rows.append(
            f"| {w.start} | {'yes' if w.in_step else 'no'} | {w.prefills} | "
            f"{w.boundary_ms:.0f} | {w.ms:.0f} | {w.tokens} |"
        )
    return "\n".join(rows)


def _cell(value: float, form: str) -> str:
    return "–" if value != value else format(value, form)  # NaN: no figure


def table(figures: dict[str, dict[str, float]], concurrency: int) -> str:
    nan = float("nan")
    rows = [
        f"| c = {concurrency} | waves in step (both) / all | prefill batches per wave | "
        f"boundary ms beyond 40 steady steps (median) | steady ms per {STEPS_PER_LINE} steps | "
        "tok/s over whole waves in step | tok/s over the level's first tokens (as many on "
        "both) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        rows.append(
            f"| {name} | {f['in_step']} / {f['all']} | {_cell(f['prefills'], '.1f')} | "
            f"{_cell(f['boundary_ms'], '.0f')} | {_cell(f['steady_ms'], '.1f')} | "
            f"{_cell(f['tok_s'], '.0f')} | {_cell(f.get('level_tok_s', nan), '.0f')} |"
        )
    patched, plain = figures.values()
    rows.append(
        f"| patched ÷ plain | | | {_cell(patched['boundary_ms'] - plain['boundary_ms'], '+.0f')} "
        f"| {_cell(plain['steady_ms'] / patched['steady_ms'], '.3f')} (speed) | "
        f"{_cell(patched['tok_s'] / plain['tok_s'], '.3f')} | "
        f"{_cell(patched.get('level_tok_s', nan) / plain.get('level_tok_s', nan), '.3f')} |"
    )
    return "\n".join(rows)


_WINDOW = re.compile(r"@(\d\d:\d\d:\d\d)?-(\d\d:\d\d:\d\d)?$")


def split_window(spec: str) -> tuple[str, str | None, str | None]:
    """``LOG[@FROM-TO]`` as (log, from, to); an ``@`` not followed by a window belongs to the
    name (the kit names a kind's second server ``NAME@2``)."""
    window = _WINDOW.search(spec)
    if window is None:
        return spec, None, None
    return spec[: window.start()], window[1], window[2]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    ap.add_argument("patched")
    ap.add_argument("plain")
    ap.add_argument("-c", "--concurrency", type=int, help="only levels at this concurrency")
    ap.add_argument("--list", action="store_true", help="first, every wave of each level")
    a = ap.parse_args(argv)
    levels = {}
    for kind, spec in (("patched", a.patched), ("plain", a.plain)):
        path, start, end = split_window(spec)
        levels[f"{kind}: {Path(path).name}"] = read_levels(path, start, end)
    (patched, ours), (plain, theirs) = levels.items()
    for n, (mine, base) in enumerate(zip(ours, theirs, strict=False), start=1):
        c = concurrency_of(mine)
        if c is None or c != concurrency_of(base) or a.concurrency not in (None, c):
            continue
        if a.list:
            for name, lines in ((patched, mine), (plain, base)):
                print(f"level {n}, {name}\n\n{listing(waves(lines, c))}\n")
        # The client sends the same prompts in the same order to both servers, so the k-th
        # wave of one is the k-th of the other (the faster server fits more in a level).
        ours_w, theirs_w = waves(mine, c), waves(base, c)
        both = [p.in_step and b.in_step for p, b in zip(ours_w, theirs_w, strict=False)]
        figures = {patched: summary(ours_w, both), plain: summary(theirs_w, both)}
        # the level as it ran, waves in step or not: the same first tokens on both servers
        spans = between_boundaries(mine), between_boundaries(base)
        tokens = min(sum(STEPS_PER_LINE * line.size for line in span) for span in spans)
        for figure, span in zip(figures.values(), spans, strict=True):
            figure["level_tok_s"] = rate_over(span, tokens) if tokens else float("nan")
        print(f"level {n} (after the log's flush {n})\n\n{table(figures, c)}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
