"""Fleet wall times: ``ansible-playbook dynspec.patch.roll`` on 1, 4 and 16 hosts.

Each host is its own loopback sshd (own port, key, PID namespace) with a venv holding a real
pinned SGLang release and the fake server of tests/remote (0.2 s per generation); a real
sglang-router fronts them and a load generator sends requests through it during the roll.
Needs root, openssh-server, sudo, and ansible-core + sglang-router in this Python
(``pip install -e '.[test]'``).

For each fleet size it builds the fleet once and takes ``--samples`` samples (default 5) of
- a check-mode run (``--check --diff``, every host at once with ``--forks N``), and
- a rolling apply through the router (``serial: 1``, restart + health gate included),
  counting the requests that failed during the roll; an untimed revert (every host at once)
  puts the fleet back before the next sample.
It prints the median and the min-max of each. Goal: 16 hosts in check mode within 2x one host
(medians); 0 failed requests. The controller's plan cache (patcher/plan_cache.py) is emptied
before each check-mode run, so each sample plans its release once, cold.

    python benchmarks/fleet.py [--sizes 1 4 16] [--samples 5] [--check-only]
                               [--release 0.5.10.post1]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "remote"))

import fleet_harness as fleet  # noqa: E402
import remote_harness as harness  # noqa: E402

from dynspec_patch.patcher.releases import cache_dir  # noqa: E402


def playbook(base: Path, inventory: Path, what: str, *args: str, timeout: float,
             hosts: int) -> float:
    """Run ``dynspec.patch.roll``; its wall time, once every host changed."""
    started = time.perf_counter()
    run = fleet.ansible_playbook(base, inventory, "dynspec.patch.roll", *args, timeout=timeout)
    seconds = time.perf_counter() - started
    table = fleet.recap(run.stdout)
    if run.returncode != 0 or len(table) != hosts or any(r["changed"] != 1
                                                         for r in table.values()):
        raise RuntimeError(f"{what} failed:\n{run.stdout[-3000:]}{run.stderr}")
    return seconds


def run_size(base: Path, pristine: Path, size: int, samples: int,
             check_only: bool) -> dict[str, Any]:
    hosts, _ = fleet.make_fleet(base, pristine, size)
    router = fleet.Router.start(base, [h.worker_url for h in hosts])
    inventory = fleet.write_inventory(base / "inventory.json", hosts)
    every_host = ("--forks", str(size), "-e", "dynspec_serial=100%")
    # One server cannot leave its router without failing every request (the module
    # refuses): a fleet of one rolls without the router and without load.
    through_router = size > 1
    extra = ("-e", f"sglang_router_url={router.url}") if through_router else ()
    row: dict[str, Any] = {"hosts": size, "check_s": [], "roll_s": [], "ok": 0, "failed": 0,
                           "router": "yes" if through_router else "no (one server)"}
    try:
        for _ in range(samples):
            shutil.rmtree(cache_dir() / "plans", ignore_errors=True)  # each sample plans cold
            row["check_s"].append(playbook(base, inventory, "check mode", "--check", "--diff",
                                           *every_host, "-e", "dynspec_threshold=16",
                                           timeout=900, hosts=size))
            if check_only:
                continue
            load = fleet.Load(router.url, clients=6, max_seconds=1800)
            if through_router:
                load.start()
                time.sleep(1.0)
            try:
                row["roll_s"].append(playbook(base, inventory, "rolling apply",
                                              "-e", "dynspec_threshold=16", *extra,
                                              "-e", "dynspec_health_timeout=60",
                                              timeout=1800, hosts=size))
            finally:
                report = load.stop() if through_router else None
            if report is not None:
                row["ok"] += report.ok
                row["failed"] += report.failed
            playbook(base, inventory, "revert", *every_host, "-e", "dynspec_state=absent",
                     "-e", "dynspec_health_timeout=60", timeout=1800, hosts=size)
        return row
    finally:
        router.stop()
        for host in hosts:
            host.stop()


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
    worst = max(median(r["check_s"]) / one for r in rows)  # type: ignore[operator]
    failed = sum(r["failed"] for r in rows)
    print(f"\ngoal check mode <= 2x one host (medians): {'met' if worst <= 2 else 'NOT met'} "
          f"({worst:.2f}x)" + ("" if args.check_only else
                               f"; goal 0 failed requests: {'met' if failed == 0 else 'NOT met'}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
