"""The envelope table and plot (issue 16) from the kit's envelope results.

usage: python benchmarks/gpu/envelope_report.py RESULTS_JSON [OUT_SVG] [--log [SERVER=]LOG ...]
  RESULTS_JSON  name -> envelope.py result, as the kit's session writes $OUT/results.json:
                env-base (plain decoding), env-eagle (unpatched EAGLE-3), env-fixed-T<N> (one
                per hand-picked T), env-auto (--speculative-disable-batch-threshold auto);
                further servers of one kind (NAME@N) count as more repeats of it, and a
                table shows them side by side
  OUT_SVG       the plot (default: envelope.svg beside RESULTS_JSON): output tok/s against
                concurrency, one panel per acceptance region, the servers as lines
  --log         an auto server's log (SERVER=LOG, e.g. env-auto@2=env-auto@2.server.log; a
                bare LOG is env-auto's), as often as there are auto servers: its ``[dynspec]
                auto:`` switch lines, laid against that server's levels' wall-clock spans, give
                each level's switches and how long after the level's start the first one came
                (the burst goal: within 2 s each way)

Per region and concurrency c the table shows each server's output tok/s (the mean of its
repeats), the best fixed T at that c (which T in brackets), auto ÷ max(plain, EAGLE-3) and
auto ÷ best fixed T, then each region's worst ratio against the issue's goals (>= 0.95, >= 0.97).
Plain decoding does not depend on the region: where env-base did not run a region, the mean of
the regions it ran stands for it. Standard library only (the SVG is written by hand).
"""

from __future__ import annotations

import argparse
import calendar
import json
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PLAIN, EAGLE, AUTO, FIXED_PREFIX = "env-base", "env-eagle", "env-auto", "env-fixed-T"
GOAL_VS_MAX = 0.95  # auto >= 95 % of max(plain, unpatched EAGLE-3)
GOAL_VS_FIXED = 0.97  # auto within 3 % of the best fixed T
COLOURS = {PLAIN: "#1f77b4", EAGLE: "#ff7f0e", AUTO: "#d62728"}
FIXED_COLOURS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


def tok_s(result: dict) -> dict[str, dict[int, float]]:
    """region -> concurrency -> mean output tok/s over the repeats (failed levels and the burst
    levels, which measure switching, left out)."""
    values: dict[str, dict[int, list[float]]] = {}
    for level in result.get("levels", []):
        if "output_tok_per_s" not in level or level.get("phase") == "burst":
            continue
        region = values.setdefault(level.get("region", "?"), {})
        region.setdefault(int(level["concurrency"]), []).append(float(level["output_tok_per_s"]))
    return {r: {c: statistics.mean(v) for c, v in by_c.items()} for r, by_c in values.items()}


def server_kind(name: str) -> str:
    """The kind a result's server was: ``env-auto@2`` (the kit's ``run.sh`` name for a further
    server of a variant) is an ``env-auto``."""
    return name.partition("@")[0]


def pooled(results: dict) -> dict:
    """One entry per server kind: the levels of its further servers (``NAME@N``, as the kit's
    ``run.sh`` names them) join the first server's as more repeats, so means run over servers."""
    out: dict = {}
    for name, result in results.items():
        kind = server_kind(name)
        if kind in out:
            out[kind]["levels"] += result.get("levels", [])
        else:
            out[kind] = {**result, "levels": list(result.get("levels", []))}
    return out


def server_spread(results: dict) -> str:
    """For each server kind run on several servers: each server's tok/s per region and
    concurrency, and the largest over the smallest (empty when no kind ran twice)."""
    kinds: dict[str, list[str]] = {}
    for name in results:
        kinds.setdefault(server_kind(name), []).append(name)
    rows = []
    for kind, names in kinds.items():
        if len(names) < 2:
            continue
        per_server = [tok_s(results[name]) for name in names]
        cells = sorted({(r, c) for one in per_server for r, by_c in one.items() for c in by_c})
        for region, c in cells:
            values = [one.get(region, {}).get(c) for one in per_server]
            known = [v for v in values if v is not None]
            if len(known) > 1:
                rows.append(f"| {kind} | {region} | {c} | "
                            + " / ".join(_cell(v) for v in values)
                            + f" | {max(known) / min(known):.3f} |")
    if not rows:
        return ""
    return "\n".join(["| server | region | c | tok/s, server by server | largest ÷ smallest |",
                      "|---|---|---|---|---|", *rows])


def gpu_clocks(results: dict) -> str:
    """Per server: the GPU as its levels found it (envelope.py's ``"gpu"``: SM clock mean and
    lowest, hottest temperature, mean power, throttle reasons); empty where none was recorded.
    Servers whose GPU ran at other clocks are not comparable."""
    rows = []
    for name, result in results.items():
        seen = [lv["gpu"] for lv in result.get("levels", []) if lv.get("gpu")]
        if not seen:
            continue
        reasons = sorted({r for g in seen for r in g.get("throttle_reasons", [])})
        rows.append(
            f"| {name} | {len(seen)} | "
            f"{statistics.mean(g['sm_mhz_mean'] for g in seen):.0f} | "
            f"{min(g['sm_mhz_min'] for g in seen):.0f} | "
            f"{max(g['temperature_c_max'] for g in seen):.0f} | "
            f"{statistics.mean(g['power_w_mean'] for g in seen):.0f} | "
            f"{', '.join(reasons) or '–'} |")
    if not rows:
        return ""
    return "\n".join(["| server | levels | SM MHz, mean | SM MHz, lowest | °C, hottest | W, mean "
                      "| throttle reasons |", "|---|---|---|---|---|---|---|", *rows])


def fixed_thresholds(results: dict) -> list[tuple[int, str]]:
    out = []
    for name in results:
        if name.startswith(FIXED_PREFIX) and name[len(FIXED_PREFIX):].isdigit():
            out.append((int(name[len(FIXED_PREFIX):]), name))
    return sorted(out)


@dataclass(frozen=True)
class Row:
    concurrency: int
    plain: float | None
    eagle: float | None
    fixed: dict[int, float]  # T -> tok/s
    auto: float | None

    @property
    def best_fixed(self) -> tuple[int, float] | None:
        if not self.fixed:
            return None
        t = max(self.fixed, key=lambda k: (self.fixed[k], -k))
        return t, self.fixed[t]

    @property
    def vs_max(self) -> float | None:
        known = [v for v in (self.plain, self.eagle) if v is not None]
        if self.auto is None or not known:
            return None
        return self.auto / max(known)

    @property
    def vs_fixed(self) -> float | None:
        best = self.best_fixed
        return None if self.auto is None or best is None else self.auto / best[1]


def plain_region(plain: dict[str, dict[int, float]], region: str) -> dict[int, float]:
    """Plain decoding at ``region``; where it did not run that region, the mean of the regions
    it ran stands for it (plain decoding does not read the draft), at each concurrency."""
    if region in plain:
        return plain[region]
    levels = sorted({c for by_c in plain.values() for c in by_c})
    return {c: statistics.mean(by_c[c] for by_c in plain.values() if c in by_c) for c in levels}


def envelope(results: dict) -> dict[str, list[Row]]:
    """region -> one Row per concurrency that any server measured there."""
    auto, eagle, plain = (tok_s(results.get(k, {})) for k in (AUTO, EAGLE, PLAIN))
    fixed = {t: tok_s(results[name]) for t, name in fixed_thresholds(results)}
    regions = list(results.get(AUTO, {}).get("regions") or auto or eagle)
    for by_region in (eagle, *fixed.values()):
        regions += [r for r in by_region if r not in regions]
    table: dict[str, list[Row]] = {}
    for region in regions:
        base = plain_region(plain, region)
        series = [auto.get(region, {}), eagle.get(region, {}), base,
                  *(f.get(region, {}) for f in fixed.values())]
        levels = sorted({c for s in series for c in s})
        table[region] = [
            Row(c, base.get(c), eagle.get(region, {}).get(c),
                {t: f[region][c] for t, f in fixed.items() if c in f.get(region, {})},
                auto.get(region, {}).get(c))
            for c in levels
        ]
    return table


def _cell(value: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def markdown(table: dict[str, list[Row]]) -> str:
    out = []
    for region, rows in table.items():
        out += [f"### {region}", "",
                "| c | plain | EAGLE-3 | best fixed T | auto | auto ÷ max(plain, EAGLE-3) "
                "| auto ÷ best fixed T |", "|---|---|---|---|---|---|---|"]
        for row in rows:
            best = row.best_fixed
            fixed = "–" if best is None else f"{best[1]:.1f} (T{best[0]})"
            out.append(f"| {row.concurrency} | {_cell(row.plain)} | {_cell(row.eagle)} | "
                       f"{fixed} | {_cell(row.auto)} | {_cell(row.vs_max, '{:.3f}')} | "
                       f"{_cell(row.vs_fixed, '{:.3f}')} |")
        out.append("")
    return "\n".join(out)


def goals(table: dict[str, list[Row]]) -> str:
    out = ["| region | worst auto ÷ max(plain, EAGLE-3) (c) | goal 0.95 | "
           "worst auto ÷ best fixed T (c) | goal 0.97 |", "|---|---|---|---|---|"]
    for region, rows in table.items():
        cells = []
        for ratio, goal in ((Row.vs_max, GOAL_VS_MAX), (Row.vs_fixed, GOAL_VS_FIXED)):
            known = [(ratio.fget(r), r.concurrency) for r in rows if ratio.fget(r) is not None]
            if not known:
                cells += ["–", "not measured"]
                continue
            worst, at = min(known)
            cells += [f"{worst:.3f} (c = {at})", "met" if worst >= goal else "**not met**"]
        out.append(f"| {region} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def correctness(results: dict) -> str:
    out = ["| server | requests | failed | mismatched outputs |", "|---|---|---|---|"]
    for name, result in results.items():
        levels = [lv for lv in result.get("levels", []) if "requests" in lv]
        if not levels:
            continue
        total = [sum(lv.get(k, 0) for lv in levels) for k in ("requests", "failed", "mismatched")]
        out.append(f"| {name} | " + " | ".join(str(n) for n in total) + " |")
    return "\n".join(out)


SWITCH = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] \[dynspec\] auto: (\w+) -> (\w+) "
                    r"at decode bs=(\d+)")


def switch_times(log_text: str) -> list[tuple[float, str, int]]:
    """(unix time, new mode, batch size) of each switch line (SGLang logs UTC, to the second)."""
    out = []
    for line in log_text.splitlines():
        m = SWITCH.match(line)
        if m:
            when = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
            out.append((float(when), m.group(3), int(m.group(4))))
    return out


def switches_per_level(result: dict, log_text: str) -> str:
    """Per level: the switches inside its span, and seconds from its start to the first one
    (the log's one-second resolution: a switch in the level's first second shows as <= 1)."""
    switches = switch_times(log_text)
    out = ["| phase | region | c | switches | first switch after the level's start |",
           "|---|---|---|---|---|"]
    for level in result.get("levels", []):
        start, end = level.get("started_unix"), level.get("ended_unix")
        if start is None or end is None:
            continue
        inside = [(t, mode, bs) for t, mode, bs in switches if int(start) <= t < end]
        first = "–"
        if inside:
            t, mode, bs = inside[0]
            first = f"{math.ceil(max(0.0, t - start) + 1)} s or less (to {mode} at bs {bs})"
        out.append(f"| {level.get('phase', 'sweep')} | {level['region']} | "
                   f"{level['concurrency']} | {len(inside)} | {first} |")
    return "\n".join(out)


def svg(results: dict, table: dict[str, list[Row]], title: str) -> str:
    """Output tok/s against concurrency (log2 x axis), one panel per region."""
    pw, ph, ml, mb, mt = 330, 240, 58, 40, 28
    cols = 2
    rows_n = math.ceil(len(table) / cols)
    width, height = cols * (pw + ml + 20) + 10, rows_n * (ph + mb + mt) + 70
    servers = [(PLAIN, "plain decoding", COLOURS[PLAIN], "6,3"),
               (EAGLE, "EAGLE-3, unpatched", COLOURS[EAGLE], "6,3")]
    for i, (t, name) in enumerate(fixed_thresholds(results)):
        servers.append((name, f"fixed T = {t}", FIXED_COLOURS[i % len(FIXED_COLOURS)], "2,2"))
    servers.append((AUTO, "auto", COLOURS[AUTO], ""))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14">'
             f'{_escape(title)}</text>']
    for index, (region, rows) in enumerate(table.items()):
        x0 = 10 + (index % cols) * (pw + ml + 20) + ml
        y0 = 30 + (index // cols) * (ph + mb + mt) + mt
        parts.append(_panel(region, rows, servers, x0, y0, pw, ph))
    ly = height - 30
    for i, (_, label, colour, dash) in enumerate(servers):
        lx = 20 + i * (width - 40) / len(servers)
        parts.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 24}" y2="{ly}" stroke="{colour}" '
                     f'stroke-width="2" stroke-dasharray="{dash}"/>'
                     f'<text x="{lx + 28}" y="{ly + 4}">{_escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _series(rows: list[Row], name: str) -> dict[int, float]:
    out = {}
    for row in rows:
        value = {PLAIN: row.plain, EAGLE: row.eagle, AUTO: row.auto}.get(name)
        if name.startswith(FIXED_PREFIX):
            value = row.fixed.get(int(name[len(FIXED_PREFIX):]))
        if value is not None:
            out[row.concurrency] = value
    return out


def _panel(region: str, rows: list[Row], servers: list, x0: float, y0: float, pw: float,
           ph: float) -> str:
    levels = [r.concurrency for r in rows]
    top = max([v for name, *_ in servers for v in _series(rows, name).values()] or [1.0])
    lo, hi = math.log2(min(levels or [1])), math.log2(max(levels or [2]))
    span = (hi - lo) or 1.0

    def x(c: int) -> float:
        return x0 + (math.log2(c) - lo) / span * pw

    def y(v: float) -> float:
        return y0 + ph - v / (top * 1.05) * ph

    out = [f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
           f'<text x="{x0 + pw / 2}" y="{y0 - 8}" text-anchor="middle" font-size="12">'
           f'{_escape(region)}</text>']
    for c in levels:
        out.append(f'<text x="{x(c):.1f}" y="{y0 + ph + 14}" text-anchor="middle">{c}</text>')
    for k in range(5):
        v = top * 1.05 * k / 4
        out.append(f'<line x1="{x0}" y1="{y(v):.1f}" x2="{x0 + pw}" y2="{y(v):.1f}" '
                   f'stroke="#eee"/><text x="{x0 - 4}" y="{y(v) + 4:.1f}" '
                   f'text-anchor="end">{v:.0f}</text>')
    out.append(f'<text x="{x0 + pw / 2}" y="{y0 + ph + 30}" text-anchor="middle">'
               'concurrency</text>')
    for name, _label, colour, dash in servers:
        points = _series(rows, name)
        if not points:
            continue
        path = " ".join(f"{x(c):.1f},{y(v):.1f}" for c, v in sorted(points.items()))
        width = 2.5 if name == AUTO else 1.5
        out.append(f'<polyline data-server="{name}" points="{path}" fill="none" '
                   f'stroke="{colour}" stroke-width="{width}" stroke-dasharray="{dash}"/>')
    return "\n".join(out)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, metavar="RESULTS_JSON")
    parser.add_argument("out_svg", type=Path, nargs="?", metavar="OUT_SVG",
                        help="the plot (default: envelope.svg beside RESULTS_JSON)")
    parser.add_argument("--log", action="append", default=[], metavar="[SERVER=]LOG",
                        help="an auto server's log (bare: env-auto's): its switches per level; "
                             "repeat it for each auto server")
    args = parser.parse_args(argv)
    path = args.results
    try:
        per_server = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        parser.exit(2, f"envelope_report.py: cannot read {path}: {exc}\n")
    logs = []
    for given in args.log:
        server, _, log_path = given.partition("=") if "=" in given else (AUTO, "", given)
        if server not in per_server:
            parser.exit(2, f"envelope_report.py: --log {given}: no server {server!r} in {path}\n")
        try:
            logs.append((server, Path(log_path).read_text(errors="replace")))
        except OSError as exc:
            parser.exit(2, f"envelope_report.py: cannot read {log_path}: {exc}\n")
    results = pooled(per_server)
    out_svg = args.out_svg or path.parent / "envelope.svg"
    table = envelope(results)
    auto_args = results.get(AUTO, {}).get("effective_args") or {}
    print("## Envelope: output tok/s per concurrency and acceptance region\n")
    print(f"auto server: threshold {auto_args.get('speculative_disable_batch_threshold')!r}, "
          f"SGLang {auto_args.get('version')}, model {auto_args.get('model_path')}\n")
    print(markdown(table))
    print("## Goals\n")
    print(goals(table))
    clocks = gpu_clocks(per_server)
    if clocks:
        print("\n## The GPU during each server's levels\n")
        print(clocks)
    spread = server_spread(per_server)
    if spread:
        print("\n## Servers of one kind, side by side\n")
        print(spread)
    print("\n## Outputs checked against the crafted continuation\n")
    print(correctness(per_server))
    for server, log_text in logs:
        print(f"\n## auto's switches per level ({server})\n")
        print(switches_per_level(per_server[server], log_text))
    title = f"output tok/s vs concurrency, SGLang {auto_args.get('version') or '?'}"
    out_svg.write_text(svg(results, table, title))
    print(f"\nwrote {out_svg}")


if __name__ == "__main__":
    main(sys.argv[1:])
