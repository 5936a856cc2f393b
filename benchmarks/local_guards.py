"""What the local write guards and OpenSSH resolution cost, in one run.

(a) Writing a planned apply into a scratch copy of a pinned release: the guarded
``local.write_plan`` (stage + compile, undo copies, originals, journal, manifest, renames,
fsyncs) under ``local.locked`` (lock, journal recovery, temp-file sweep), against the bare
minimum of staging, compiling and renaming the same files. The plan is made once, outside
the timing. (b) Resolving one ssh_config alias with ``ssh -G`` against paramiko's parser.
Medians of N runs; the ratio column is guarded / bare.

    python benchmarks/local_guards.py [--runs 7] [--release 0.5.10.post1]
"""

from __future__ import annotations

import argparse
import os
import py_compile
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from rich.console import Console
from rich.table import Table

from dynspec_patch.patcher import local, ssh
from dynspec_patch.patcher.engine import Plan, plan_apply
from dynspec_patch.patcher.releases import find_pin, release_dir


def median_ms(setup: Callable[[], object], fn: Callable[[object], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        state = setup()
        started = time.perf_counter()
        fn(state)
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def bare_write(package: Path, plan: Plan) -> None:
    """Stage, compile and rename: what any careful writer does, without journal or lock."""
    for change in plan.changes:
        target = package / change.path
        tmp = target.with_name(f".{target.name}.bench-tmp")
        tmp.write_bytes(change.after or b"")
        py_compile.compile(str(tmp), cfile=str(tmp) + "c", doraise=True)
        os.unlink(str(tmp) + "c")
        os.replace(tmp, target)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--release", default="0.5.10.post1")
    args = parser.parse_args()
    source = release_dir(find_pin(args.release))
    scratch = Path(tempfile.mkdtemp(prefix="dynspec-bench-"))
    plan = plan_apply(local.read_snapshot(source))
    counter = iter(range(10**6))

    def fresh_tree() -> Path:
        package = scratch / str(next(counter)) / "sglang"
        shutil.copytree(source, package)
        return package

    def guarded(package: object) -> None:
        with local.locked(package):  # type: ignore[arg-type]
            local.write_plan(package, plan)  # type: ignore[arg-type]

    bare = median_ms(fresh_tree, lambda p: bare_write(p, plan), args.runs)  # type: ignore[arg-type]
    safe = median_ms(fresh_tree, guarded, args.runs)

    config = scratch / "ssh_config"
    config.write_text("Host bench\n  HostName 127.0.0.1\n  Port 2222\n  User bench\n")
    by_ssh = median_ms(lambda: None, lambda _: ssh.resolve_target(
        "bench", ssh_config=str(config)), args.runs)
    with mock.patch.object(ssh.shutil, "which", return_value=None):
        by_paramiko = median_ms(lambda: None, lambda _: ssh.resolve_target(
            "bench", ssh_config=str(config)), args.runs)
    shutil.rmtree(scratch, ignore_errors=True)

    table = Table(title=f"local guards and host resolution (median of {args.runs})")
    for column in ("what", "baseline", "ms", "guarded / OpenSSH", "ms", "ratio"):
        table.add_column(column)
    table.add_row(f"apply {args.release} ({len(plan.changes)} files)", "stage+compile+rename",
                  f"{bare:.1f}", "locked, journalled write_plan", f"{safe:.1f}",
                  f"{safe / bare:.2f}")
    table.add_row("resolve an ssh_config alias", "paramiko parser", f"{by_paramiko:.1f}",
                  "ssh -G", f"{by_ssh:.1f}", f"{by_ssh / by_paramiko:.2f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
