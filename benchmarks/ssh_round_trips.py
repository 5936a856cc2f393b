"""SSH round trips and wall time of the ``--host`` commands against a loopback sshd.

Starts its own sshd on 127.0.0.1 (needs root, openssh-server, sudo), builds a venv with a
real pinned SGLang release and the fake server from tests/remote, then runs each command
``--repeat`` times on fresh copies of the host and prints a table. Goal for
``apply --no-restart``: at most 6 round trips over one connection.

    python benchmarks/ssh_round_trips.py [--release 0.5.10.post1] [--repeat 5]

A round trip is one exchange the client waits on: an exec (the agent start counts as one),
one agent request, or one HTTP GET through a direct-tcpip channel.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "remote"))

import remote_harness as harness  # noqa: E402

from dynspec_patch.patcher import remote_commands as rc  # noqa: E402
from dynspec_patch.patcher.remote_commands import HostOptions  # noqa: E402

SPEC = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default="0.5.10.post1")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    base = harness.make_base()
    (base / "sshd").mkdir()
    sshd = harness.start_sshd(base / "sshd")
    try:
        pristine = harness.build_venv(base / "pristine", args.release)
        rows: dict[str, list[tuple[int, int, int, int, int, float]]] = {}
        breakdown: dict[str, list[float]] = {}

        def record(name: str, out: dict, seconds: float) -> None:
            ssh = out["ssh"]
            steps = ssh["steps"]
            execs = sum(1 for s in steps if s.startswith("exec"))
            requests = sum(1 for s in steps if s.startswith("request"))
            rows.setdefault(name, []).append(
                (ssh["connections"], execs, requests, ssh["round_trips"] - execs - requests,
                 ssh["round_trips"], seconds))

        for i in range(args.repeat):
            root = base / f"host{i}" / harness.HOSTILE
            root.mkdir(parents=True)
            venv = root / "venv"
            subprocess.run(["cp", "-a", str(pristine), str(venv)], check=True)
            port = harness.free_port()
            cwd = root / "cwd"
            cwd.mkdir()
            srv = harness.FakeServer(
                venv, cwd, port,
                [str(venv / "bin" / "python"), "-m", "sglang.launch_server", "--model-path",
                 "m", "--port", str(port), *SPEC],
                {"PATH": "/usr/bin:/bin", "SGLANG_ENABLE_SPEC_V2": "1"}, root / "server.log",
                ns_init=sshd.ns_init)
            srv.start()
            srv.wait_healthy()
            opts = HostOptions(host="127.0.0.1", port=sshd.port, user=harness.OP_USER,
                               identity_file=str(sshd.client_key),
                               known_hosts=str(sshd.known_hosts),
                               ssh_config=str(sshd.base / "ssh_config"))
            common = {"threshold": 32, "worker": "auto", "restart_cmd": None, "pid": None,
                      "port": None, "health_timeout": 60.0}
            apply_ = partial(rc.apply, opts, **common)
            revert_ = partial(rc.revert, opts, force=False, restart_cmd=None, pid=None,
                              port=None, health_timeout=60.0)
            commands: list[tuple[str, Callable[[], dict]]] = [
                ("detect-path", partial(rc.detect_path, opts, pid=None, port=None)),
                ("apply --dry-run", partial(apply_, dry_run=True, no_restart=False)),
                ("apply --no-restart", partial(apply_, dry_run=False, no_restart=True)),
                ("status", partial(rc.status, opts)),
                ("apply (restart)", partial(apply_, dry_run=False, no_restart=False)),
                ("apply again (no-op)", partial(apply_, dry_run=False, no_restart=False)),
                ("revert (restart)", partial(revert_, dry_run=False, no_restart=False)),
            ]
            for name, fn in commands:
                t0 = time.perf_counter()
                out = fn()
                wall = time.perf_counter() - t0
                record(name, out, wall)
                if os.environ.get("BENCH_DEBUG"):
                    print(name, out["ssh"]["steps"], out.get("files_changed"))
                if name == "apply --no-restart":
                    remote = 0.0
                    for step, sec in out["ssh"]["seconds"]:
                        breakdown.setdefault(step.split(" 127.")[0], []).append(sec)
                        remote += sec
                    breakdown.setdefault("local (engine planning, libcst)", []).append(
                        wall - remote)
            harness.kill_matching(str(root))

        header = ("command", "connections", "execs", "agent requests", "http GETs",
                  "round trips", "wall median (s)", "wall min-max (s)")
        table = [header]
        for name, samples in rows.items():
            first = samples[0]
            walls = [s[5] for s in samples]
            table.append((name, str(first[0]), str(first[1]), str(first[2]), str(first[3]),
                          str(first[4]), f"{statistics.median(walls):.3f}",
                          f"{min(walls):.3f}-{max(walls):.3f}"))
        widths = [max(len(r[c]) for r in table) for c in range(len(header))]
        print(f"sglang {args.release}, {args.repeat} runs each, sshd on 127.0.0.1, "
              f"login {harness.OP_USER} + sudo -n")
        for n, row in enumerate(table):
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
            if n == 0:
                print("  ".join("-" * w for w in widths))
        print("\nwhere apply --no-restart spends its time (median s):")
        for step, secs in breakdown.items():
            print(f"  {step:<34} {statistics.median(secs):.3f}")
        no_restart = rows["apply --no-restart"][0]
        ok = no_restart[0] == 1 and no_restart[4] <= 6
        print(f"\napply --no-restart: {no_restart[4]} round trips over {no_restart[0]} "
              f"connection(s): {'meets' if ok else 'MISSES'} the goal (<= 6, one connection)")
        return 0 if ok else 1
    finally:
        harness.kill_matching(str(base))
        sshd.stop()
        harness.remove_test_accounts()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
