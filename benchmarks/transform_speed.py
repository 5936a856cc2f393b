"""Whole-transform time vs a bare ``libcst.parse_module`` of the same files, per pinned release.

For each release: the files ``plan_apply`` reads are loaded once; then, median of N runs,
(a) ``libcst.parse_module`` of every Python target file, (b) ``plan_apply`` on the unpatched
snapshot (route, analyse, insert, generate code), (c) ``plan_apply`` on the patched snapshot
(the idempotent re-run: analyse, strip, re-insert, compare). Goal: (b) and (c) ≤ 2 × (a).

    python benchmarks/transform_speed.py [--runs 5] [--pins fixtures/pins.toml]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import libcst
from rich.console import Console
from rich.table import Table

from dynspec_patch.patcher import local
from dynspec_patch.patcher.engine import plan_apply
from dynspec_patch.patcher.releases import load_pins, release_dir
from dynspec_patch.transforms import (
    AddDisableThresholdArgCommand,
    HookEagleWorkerCommand,
    HookEagleWorkerV2Command,
)

LIBCST_TARGETS = {
    AddDisableThresholdArgCommand.PATH,
    HookEagleWorkerCommand.PATH,
    HookEagleWorkerV2Command.PATH,
}


def median_seconds(fn: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pins", type=Path, default=None)
    args = parser.parse_args()

    table = Table(title=f"transform time vs bare libcst parse (median of {args.runs})")
    for column in (
        "release",
        "route",
        "files parsed",
        "KiB",
        "parse (s)",
        "apply (s)",
        "apply/parse",
        "re-apply (s)",
        "re-apply/parse",
    ):
        table.add_column(column, justify="right")
    for pin in load_pins(args.pins):
        snapshot = local.read_snapshot(release_dir(pin))
        first = plan_apply(snapshot, worker="both", threshold=8)
        parsed = [f.path for f in first.files if f.path in LIBCST_TARGETS and f.before]
        if first.route == "native":
            parsed = [HookEagleWorkerV2Command.PATH]
        texts = [snapshot[path].decode() for path in parsed]  # type: ignore[union-attr]
        if not texts:
            table.add_row(pin.version, first.route, "0", *["-"] * 6)
            continue
        parse = median_seconds(
            lambda texts=texts: [libcst.parse_module(t) for t in texts], args.runs
        )
        apply_s = median_seconds(
            lambda snapshot=snapshot: plan_apply(snapshot, worker="both", threshold=8), args.runs
        )
        row = [
            pin.version,
            first.route,
            str(len(parsed)),
            f"{sum(len(t) for t in texts) / 1024:.0f}",
            f"{parse:.3f}",
            f"{apply_s:.3f}",
            f"{apply_s / parse:.2f}" if parse else "-",
        ]
        if first.route == "patch" and not first.refused:
            patched = dict(snapshot) | {f.path: f.after for f in first.files}
            again = median_seconds(
                lambda patched=patched: plan_apply(patched, worker="both", threshold=8), args.runs
            )
            row += [f"{again:.3f}", f"{again / parse:.2f}"]
        else:
            row += ["-", "-"]
        table.add_row(*row)
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
