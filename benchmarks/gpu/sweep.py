"""(d) Throughput/latency sweep with sglang.bench_serving, one table for all servers.

Runs ``python -m sglang.bench_serving`` at each concurrency against each server (e.g. baseline,
EAGLE-3, patched EAGLE-3), after checking that every server really runs with the SAME
``max_running_requests`` (speculative servers silently default to 32 or 48, which caps the
"concurrency" a benchmark thinks it is measuring). Then prints one table.

    python benchmarks/gpu/sweep.py --max-running-requests 256 \\
        --server baseline=30000 --server eagle3=30002 --server patched=30001

``--table-only`` re-renders the table from the JSONL files of an earlier run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from _client import DEFAULT_HOST, Server

DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64,128,256"
COLUMNS = (  # (bench_serving key, header, format)
    ("output_throughput", "tok/s", "{:.0f}"),
    ("median_tpot_ms", "TPOT p50", "{:.1f}"),
    ("p99_tpot_ms", "TPOT p99", "{:.1f}"),
    ("median_ttft_ms", "TTFT p50", "{:.0f}"),
    ("accept_length", "acc", "{:.2f}"),
)


def parse_servers(values: list[str]) -> list[tuple[str, int]]:
    servers = []
    for value in values:
        label, sep, port = value.partition("=")
        if not sep or not label or not port.isdigit():
            raise argparse.ArgumentTypeError(f"--server wants LABEL=PORT, got {value!r}")
        servers.append((label, int(port)))
    return servers


def result_path(out_dir: Path, label: str, concurrency: int) -> Path:
    return out_dir / f"{label}_c{concurrency}.jsonl"


def bench_command(host: str, port: int, concurrency: int, ns: argparse.Namespace,
                  output: Path) -> list[str]:
    return [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
        "--host", host, "--port", str(port),
        "--dataset-name", "random", "--random-input-len", str(ns.input_len),
        "--random-output-len", str(ns.output_len), "--random-range-ratio", "1.0",
        "--num-prompts", str(max(64, concurrency * 8)), "--max-concurrency", str(concurrency),
        "--request-rate", "inf", "--warmup-requests", "8", "--seed", "1",
        "--output-file", str(output),
    ]


def load_last_record(path: Path) -> dict[str, Any] | None:
    """bench_serving appends one JSON line per run; the last one is this run's."""
    if not path.exists():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else None


def _cell(record: dict[str, Any] | None, key: str, fmt: str) -> str:
    value = None if record is None else record.get(key)
    return "-" if value is None else fmt.format(value)


def render_table(labels: list[str], concurrencies: list[int],
                 records: dict[tuple[str, int], dict[str, Any] | None]) -> str:
    """One row per concurrency, one column group per server."""
    headers = ["conc"] + [f"{label} {head}" for label in labels for _, head, _ in COLUMNS]
    rows = [headers]
    for c in concurrencies:
        row = [str(c)]
        for label in labels:
            record = records.get((label, c))
            row += [_cell(record, key, fmt) for key, _, fmt in COLUMNS]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(headers))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True))
                     for r in rows)


def check_max_running(host: str, servers: list[tuple[str, int]], expected: int) -> list[str]:
    problems = []
    for label, port in servers:
        info = Server(host, port).server_info()
        states = info.get("internal_states") or [{}]
        # The launch value, and (0.5.x) the scheduler's effective value per DP rank.
        actual = states[0].get("effective_max_running_requests_per_dp",
                               info.get("max_running_requests"))
        if actual != expected:
            problems.append(f"{label} (port {port}) runs max_running_requests={actual}, "
                            f"not {expected}: relaunch it with --max-running-requests {expected}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=DEFAULT_HOST, help="host of every server")
    parser.add_argument("--server", action="append", default=[], metavar="LABEL=PORT",
                        help="a server to benchmark; repeat (e.g. baseline=30000)")
    parser.add_argument("--max-running-requests", type=int, required=True,
                        help="the value every server was launched with")
    parser.add_argument("--concurrency", default=DEFAULT_CONCURRENCY)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--out-dir", type=Path, default=Path("sweep-results"))
    parser.add_argument("--table-only", action="store_true",
                        help="do not run anything; render the table from --out-dir")
    ns = parser.parse_args(argv)
    servers = parse_servers(ns.server)
    if not servers:
        parser.error("give at least one --server LABEL=PORT")
    concurrencies = [int(c) for c in ns.concurrency.split(",") if c.strip()]
    ns.out_dir.mkdir(parents=True, exist_ok=True)

    if not ns.table_only:
        problems = check_max_running(ns.host, servers, ns.max_running_requests)
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 2
        for label, port in servers:
            for c in concurrencies:
                output = result_path(ns.out_dir, label, c)
                output.unlink(missing_ok=True)
                subprocess.run(bench_command(ns.host, port, c, ns, output), check=True)

    labels = [label for label, _ in servers]
    records = {(label, c): load_last_record(result_path(ns.out_dir, label, c))
               for label in labels for c in concurrencies}
    print(render_table(labels, concurrencies, records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
