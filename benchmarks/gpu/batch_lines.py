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

Per log: waves in step / all, prefill batches per wave, each boundary's time beyond 40 steady
steps (its neighbours' mean), the steady lines' time per 40 steps, and the tokens per second
over whole waves in step; then the patched log over the plain one. On 2026-12-04 this split
the patched server's c = 64 closed loop (RESULTS.md). Standard library only.
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
_TIME = re.compile(r"(\d\d:\d\d:\d\d)\]")
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
    """The decode batch size most of a level's decode lines ran (None: no decode line)."""
    sizes = [line.size for line in lines if not line.prefill]
    return statistics.mode(sizes) if sizes else None


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


def paired(mine: list[Wave], theirs: list[Wave]) -> tuple[list[Wave], list[Wave]]:
    """The waves both levels ran, by their order in the level (the client sends the same
    prompts in the same order to both servers; the faster one fits more waves in a level)."""
    count = min(len(mine), len(theirs))
    return mine[:count], theirs[:count]


def summary(found: list[Wave], in_step: list[bool] | None = None) -> dict[str, float]:
    """Figures over the waves in step (``in_step``: where given, the waves marked True there;
    NaN where there is none), and the rate over every whole wave, in step or not."""
    marks = in_step if in_step is not None else [w.in_step for w in found]
    kept = [w for w, keep in zip(found, marks, strict=True) if keep]
    steady = [ms for w in kept for ms in w.steady_ms]
    nan = float("nan")
    return {
        "in_step": len(kept),
        "all": len(found),
        "prefills": statistics.mean(w.prefills for w in kept) if kept else nan,
        "boundary_ms": statistics.median(w.boundary_ms for w in kept) if kept else nan,
        "steady_ms": statistics.mean(steady) if steady else nan,
        "tok_s": sum(w.tokens for w in kept) / sum(w.ms for w in kept) * 1000 if kept else nan,
        "all_tok_s": sum(w.tokens for w in found) / sum(w.ms for w in found) * 1000
        if found
        else nan,
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
    rows = [
        f"| c = {concurrency} | waves in step (both) / all | prefill batches per wave | "
        f"boundary ms beyond 40 steady steps (median) | steady ms per {STEPS_PER_LINE} steps | "
        "tok/s over whole waves in step | tok/s over every whole wave |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        rows.append(
            f"| {name} | {f['in_step']} / {f['all']} | {_cell(f['prefills'], '.1f')} | "
            f"{_cell(f['boundary_ms'], '.0f')} | {_cell(f['steady_ms'], '.1f')} | "
            f"{_cell(f['tok_s'], '.0f')} | {_cell(f['all_tok_s'], '.0f')} |"
        )
    patched, plain = figures.values()
    rows.append(
        f"| patched ÷ plain | | | {_cell(patched['boundary_ms'] - plain['boundary_ms'], '+.0f')} "
        f"| {_cell(plain['steady_ms'] / patched['steady_ms'], '.3f')} (speed) | "
        f"{_cell(patched['tok_s'] / plain['tok_s'], '.3f')} | "
        f"{_cell(patched['all_tok_s'] / plain['all_tok_s'], '.3f')} |"
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
        ours_w, theirs_w = paired(waves(mine, c), waves(base, c))
        both = [p.in_step and b.in_step for p, b in zip(ours_w, theirs_w, strict=True)]
        figures = {patched: summary(ours_w, both), plain: summary(theirs_w, both)}
        print(f"level {n} (after the log's flush {n})\n\n{table(figures, c)}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
