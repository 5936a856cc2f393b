"""Fleet wall times: ``ansible-playbook dynspec.patch.roll`` on 1, 4 and 16 hosts.

Each host is its own loopback sshd (own port, key, PID namespace) with a venv holding a real
pinned SGLang release and the fake server of tests/remote (0.2 s per generation); a real
sglang-router fronts them and a load generator sends requests through it during the roll.
Needs root, openssh-server, sudo, and ansible-core + sglang-router in this Python
(``./.venv``, which ``tests/run.sh`` makes).

For each fleet size it times
- a check-mode run (``--check --diff``, every host at once with ``--forks N``), and
- a rolling apply through the router (``serial: 1``, restart + health gate included),
and counts the requests that failed during the roll. Goal: 16 hosts in check mode within 2x
the time of one host; 0 failed requests. The controller's plan cache (patcher/plan_cache.py)
is emptied before each check-mode run, so each size plans its release once, cold.

    python benchmarks/fleet.py [--sizes 1 4 16] [--release 0.5.10.post1]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "remote"))

import fleet_harness as fleet  # noqa: E402
import remote_harness as harness  # noqa: E402

from dynspec_patch.patcher.releases import cache_dir  # noqa: E402


def run_size(base: Path, pristine: Path, size: int) -> dict[str, Any]:
    hosts, _ = fleet.make_fleet(base, pristine, size)
    router = fleet.Router.start(base, [h.worker_url for h in hosts])
    try:
        inventory = fleet.write_inventory(base / "inventory.json", hosts)
        shutil.rmtree(cache_dir() / "plans", ignore_errors=True)  # every size plans once, cold
        started = time.perf_counter()
        check = fleet.ansible_playbook(base, inventory, "dynspec.patch.roll", "--check",
                                       "--diff", "--forks", str(size), "-e", "dynspec_serial=100%",
                                       "-e", "dynspec_threshold=16", timeout=900)
        check_s = time.perf_counter() - started
        if check.returncode != 0 or any(r["changed"] != 1 for r in
                                        fleet.recap(check.stdout).values()):
            raise RuntimeError(f"check mode failed:\n{check.stdout[-3000:]}{check.stderr}")
        # One server cannot leave its router without failing every request (the module
        # refuses): a fleet of one rolls without the router and without load.
        through_router = size > 1
        extra = ("-e", f"sglang_router_url={router.url}") if through_router else ()
        load = fleet.Load(router.url, clients=6, max_seconds=1800)
        if through_router:
            load.start()
            time.sleep(1.0)
        try:
            started = time.perf_counter()
            roll = fleet.ansible_playbook(base, inventory, "dynspec.patch.roll",
                                          "-e", "dynspec_threshold=16", *extra,
                                          "-e", "dynspec_health_timeout=60", timeout=1800)
            roll_s = time.perf_counter() - started
        finally:
            report = load.stop() if through_router else None
        table = fleet.recap(roll.stdout)
        if roll.returncode != 0 or any(r["changed"] != 1 for r in table.values()):
            raise RuntimeError(f"rolling apply failed:\n{roll.stdout[-3000:]}{roll.stderr}")
        return {"hosts": size, "check_s": check_s, "roll_s": roll_s,
                "ok": report.ok if report else "-", "failed": report.failed if report else "-",
                "router": "yes" if through_router else "no (one server)"}
    finally:
        router.stop()
        for host in hosts:
            host.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--release", default="0.5.10.post1")
    args = parser.parse_args()

    base = harness.make_base()
    try:
        pristine = harness.build_venv(base / "pristine", args.release)
        rows = [run_size(base / f"fleet{size}", pristine, size) for size in args.sizes]
    finally:
        harness.kill_matching(str(base))
        harness.remove_test_accounts()
        shutil.rmtree(base, ignore_errors=True)

    one = next((r["check_s"] for r in rows if r["hosts"] == 1), rows[0]["check_s"])
    print(f"\nsglang {args.release}, fake servers (0.2 s per generation), real sglang-router, "
          "6 load clients; check mode: all hosts at once (--forks N); apply: serial 1\n")
    header = ("hosts", "check mode (s)", "vs 1 host", "rolling apply (s)", "per host (s)",
              "through router", "requests ok", "requests failed")
    print(" | ".join(header))
    print(" | ".join("-" * len(h) for h in header))
    for r in rows:
        print(" | ".join([
            str(r["hosts"]), f"{r['check_s']:.1f}", f"{r['check_s'] / one:.2f}x",
            f"{r['roll_s']:.1f}", f"{r['roll_s'] / r['hosts']:.1f}", r["router"],
            str(r["ok"]), str(r["failed"])]))
    worst = max(r["check_s"] / one for r in rows)
    failed = sum(r["failed"] for r in rows if isinstance(r["failed"], int))
    print(f"\ngoal check mode <= 2x one host: {'met' if worst <= 2 else 'NOT met'} "
          f"({worst:.2f}x); goal 0 failed requests: {'met' if failed == 0 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
