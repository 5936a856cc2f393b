"""Fleet wall times: ``ansible-playbook dynspec.patch.roll`` on 1, 4 and 16 hosts.

Each host is its own loopback sshd (own port, key, PID namespace) with a venv holding a real
pinned SGLang release and the fake server of tests/remote (0.2 s per generation); a real
sglang-router fronts them and a load generator sends requests through it during the roll.
Needs root, openssh-server, sudo, and ansible-core + sglang-router in this Python
(``./.venv``, which ``tests/run.sh`` makes).

For each fleet size it builds the fleet once and takes ``--samples`` samples (default 5) of
- a check-mode run (``--check --diff``, every host at once with ``--forks N``), and
- a rolling apply through the router (``serial: 1``, restart + health gate included),
  counting the requests that failed during the roll; an untimed revert (every host at once)
  puts the fleet back before the next sample.
It prints the median and the min-max of each; a sample that fails is reported (its host and
message) and the fleet is built anew for the next one. Goal: 16 hosts in check mode within 2x
one host (medians); 0 failed requests. The controller's plan cache (patcher/plan_cache.py)
is emptied before each check-mode run, so each sample plans its release once, cold.

    python benchmarks/fleet.py [--sizes 1 4 16] [--samples 5] [--check-only]
                               [--release 0.5.10.post1]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "remote"))

import fleet_harness as fleet  # noqa: E402
import remote_harness as harness  # noqa: E402

from dynspec_patch.patcher.releases import cache_dir  # noqa: E402


class PlaybookFailed(RuntimeError):
    """A run in which some host did not change (its ``fatal:`` line is the message)."""


def playbook(base: Path, inventory: Path, what: str, *args: str, timeout: float,
             hosts: int) -> float:
    """Run ``dynspec.patch.roll``; its wall time, once every host changed."""
    started = time.perf_counter()
    run = fleet.ansible_playbook(base, inventory, "dynspec.patch.roll", *args, timeout=timeout)
    seconds = time.perf_counter() - started
    table = fleet.recap(run.stdout) if "PLAY RECAP" in run.stdout else {}
    if run.returncode != 0 or len(table) != hosts or any(r["changed"] != 1
                                                         for r in table.values()):
        fatal = re.search(r'^fatal: \[(\S+)\]: .*?"msg": "([^"]*)', run.stdout, re.MULTILINE)
        raise PlaybookFailed(f"{what}: " + (f"{fatal[1]}: {fatal[2]}" if fatal else
                                            f"{run.stdout[-3000:]}{run.stderr}"))
    return seconds


@dataclass
class TestFleet:
    """``size`` hosts behind one router, and their inventory."""

    base: Path
    hosts: list[fleet.FleetHost]
    router: fleet.Router
    inventory: Path

    @classmethod
    def make(cls, base: Path, pristine: Path, size: int) -> TestFleet:
        hosts, _ = fleet.make_fleet(base, pristine, size)
        router = fleet.Router.start(base, [h.worker_url for h in hosts])
        return cls(base, hosts, router, fleet.write_inventory(base / "inventory.json", hosts))

    def stop(self) -> None:
        self.router.stop()
        for host in self.hosts:
            host.stop()


def sample(f: TestFleet, size: int, check_only: bool, row: dict[str, Any]) -> None:
    """One check-mode run and (unless check_only) one rolling apply, then a revert."""
    every_host = ("--forks", str(size), "-e", "dynspec_serial=100%")
    shutil.rmtree(cache_dir() / "plans", ignore_errors=True)  # each sample plans cold
    row["check_s"].append(playbook(f.base, f.inventory, "check mode", "--check", "--diff",
                                   *every_host, "-e", "dynspec_threshold=16", timeout=900,
                                   hosts=size))
    if check_only:
        return
    # One server cannot leave its router without failing every request (the module
    # refuses): a fleet of one rolls without the router and without load.
    through_router = size > 1
    extra = ("-e", f"sglang_router_url={f.router.url}") if through_router else ()
    load = fleet.Load(f.router.url, clients=6, max_seconds=1800)
    if through_router:
        load.start()
        time.sleep(1.0)
    try:
        row["roll_s"].append(playbook(f.base, f.inventory, "rolling apply",
                                      "-e", "dynspec_threshold=16", *extra,
                                      "-e", "dynspec_health_timeout=60", timeout=1800,
                                      hosts=size))
    finally:
        report = load.stop() if through_router else None
        if report is not None:
            row["ok"] += report.ok
            row["failed"] += report.failed
    playbook(f.base, f.inventory, "revert", *every_host, "-e", "dynspec_state=absent",
             "-e", "dynspec_health_timeout=60", timeout=1800, hosts=size)


def run_size(base: Path, pristine: Path, size: int, samples: int,
             check_only: bool) -> dict[str, Any]:
    """``samples`` samples on one fleet; a failed sample is recorded and the fleet rebuilt."""
    row: dict[str, Any] = {"hosts": size, "check_s": [], "roll_s": [], "ok": 0, "failed": 0,
                           "router": "yes" if size > 1 else "no (one server)",
                           "failed_samples": []}
    builds = 0
    f = TestFleet.make(base / f"build{builds}", pristine, size)
    try:
        for i in range(samples):
            try:
                sample(f, size, check_only, row)
            except PlaybookFailed as exc:
                row["failed_samples"].append(str(exc))
                f.stop()
                builds += 1
                f = TestFleet.make(base / f"build{builds}", pristine, size)
            print(f"hosts={size} sample {i + 1}/{samples}: check {row['check_s'][-1:]} "
                  f"roll {row['roll_s'][-1:]} failed samples {len(row['failed_samples'])}",
                  file=sys.stderr, flush=True)
        return row
    finally:
        f.stop()


def spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--samples", type=int, default=5, help="samples per fleet size")
    parser.add_argument("--check-only", action="store_true",
                        help="time check mode only (no rolling apply)")
    parser.add_argument("--release", default="0.5.10.post1")
    args = parser.parse_args()
    if args.samples < 1:
        parser.error("--samples must be at least 1")

    base = harness.make_base()
    try:
        pristine = harness.build_venv(base / "pristine", args.release)
        rows = [run_size(base / f"fleet{size}", pristine, size, args.samples, args.check_only)
                for size in args.sizes]
    finally:
        harness.kill_matching(str(base))
        harness.remove_test_accounts()
        shutil.rmtree(base, ignore_errors=True)

    one = median(next((r for r in rows if r["hosts"] == 1), rows[0])["check_s"])
    assert one is not None
    print(f"\nsglang {args.release}, fake servers (0.2 s per generation), real sglang-router, "
          f"6 load clients; check mode: all hosts at once (--forks N); apply: serial 1; "
          f"{args.samples} samples per size: median (min-max)\n")
    header = ("hosts", "check mode (s)", "min-max", "vs 1 host", "rolling apply (s)", "min-max",
              "per host (s)", "through router", "requests ok", "requests failed")
    print(" | ".join(header))
    print(" | ".join("-" * len(h) for h in header))
    for r in rows:
        check, roll = median(r["check_s"]), median(r["roll_s"])
        assert check is not None
        rolled = roll is not None and r["router"] == "yes"
        print(" | ".join([
            str(r["hosts"]), seconds(check), spread(r["check_s"]), f"{check / one:.2f}x",
            seconds(roll), spread(r["roll_s"]),
            seconds(None if roll is None else roll / r["hosts"]), r["router"],
            str(r["ok"]) if rolled else "-", str(r["failed"]) if rolled else "-"]))
    for r in rows:
        for failure in r["failed_samples"]:
            print(f"failed sample, {r['hosts']} hosts: {failure[:400]}")
    worst = max(median(r["check_s"]) / one for r in rows)  # type: ignore[operator]
    failed = sum(r["failed"] for r in rows)
    print(f"\ngoal check mode <= 2x one host (medians): {'met' if worst <= 2 else 'NOT met'} "
          f"({worst:.2f}x)" + ("" if args.check_only else
                               f"; goal 0 failed requests: {'met' if failed == 0 else 'NOT met'}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
