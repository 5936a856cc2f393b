"""detect-path / apply / status / revert on a server in a Docker container vs on the bare host.

Starts what tests/remote uses (needs root, openssh-server, sudo, Debian's docker.io): a
loopback sshd in its own PID namespace, a dockerd inside it (own socket and data root,
``--bridge=none --iptables=false``), an image imported offline from a root fs made here with
a real pinned release, and the fake SGLang server from tests/remote. Each round runs the
same commands on a fresh bare-host server (a venv) and a fresh container (host network),
then prints the set-up costs and one table with medians and the container/host ratio.

    python benchmarks/container_vs_host.py [--release 0.5.10.post1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "remote"))

import docker_harness  # noqa: E402
import remote_harness as harness  # noqa: E402

from dynspec_patch.patcher import remote_commands as rc  # noqa: E402
from dynspec_patch.patcher.remote_commands import HostOptions  # noqa: E402

SPEC = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1"]
RESTART = {"dry_run": False, "no_restart": False, "restart_cmd": None, "pid": None,
           "port": None, "health_timeout": 30.0, "stop_timeout": 5.0}


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def commands(opts: HostOptions) -> list[tuple[str, Callable[[], object]]]:
    return [
        ("detect-path", lambda: rc.detect_path(opts, pid=None, port=None)),
        ("apply (restart, proof)", lambda: rc.apply(opts, threshold=None, worker="auto",
                                                   **RESTART)),
        ("apply again (no-op)", lambda: rc.apply(opts, threshold=None, worker="auto",
                                                **RESTART)),
        ("status", lambda: rc.status(opts)),
        ("revert (restart, proof)", lambda: rc.revert(opts, force=False, **RESTART)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default="0.5.10.post1")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    base = harness.make_base()
    (base / "sshd").mkdir()
    sshd = harness.start_sshd(base / "sshd")
    engine = None
    setup: dict[str, float] = {}
    try:
        engine = docker_harness.start_engine(base / "docker", sshd.ns_init, "bench")
        setup["dockerd start (until it answers)"] = engine.started_in
        setup["root fs (python + release)"] = timed(
            lambda: docker_harness.build_rootfs(base / "rootfs", args.release))
        image = f"dynspec-bench/sglang:{args.release}"
        setup["docker import"] = docker_harness.import_image(engine, base / "rootfs", image)
        setup["bare-host venv (python + release)"] = timed(
            lambda: harness.build_venv(base / "pristine", args.release))
        rows: dict[str, dict[str, list[float]]] = {}
        opts_base = {"host": "127.0.0.1", "port": sshd.port, "user": harness.OP_USER,
                     "identity_file": str(sshd.client_key),
                     "known_hosts": str(sshd.known_hosts),
                     "ssh_config": str(sshd.base / "ssh_config")}
        for i in range(args.repeat):
            # bare host: a venv and the fake server in the sshd's namespace
            root = base / f"host{i}"
            root.mkdir()
            venv = root / "venv"
            subprocess.run(["cp", "-a", str(base / "pristine"), str(venv)], check=True)
            port = harness.free_port()
            srv = harness.FakeServer(
                venv, root, port,
                [str(venv / "bin" / "python"), "-m", "sglang.launch_server", "--model-path",
                 "m", "--port", str(port), *SPEC], {"PATH": "/usr/bin:/bin"},
                root / "server.log", ns_init=sshd.ns_init)
            srv.start()
            srv.wait_healthy()
            for name, fn in commands(HostOptions(**opts_base)):
                rows.setdefault(name, {}).setdefault("host", []).append(timed(fn))
            harness.kill_matching(str(root))

            port = harness.free_port()
            started = time.perf_counter()
            cid = docker_harness.run_container(engine, image, f"bench{i}",
                                               docker_harness.server_argv(port, *SPEC))
            docker_harness.wait_healthy(port)
            setup.setdefault("docker run until healthy", time.perf_counter() - started)
            for name, fn in commands(HostOptions(**opts_base, docker_client=docker_harness.DOCKER)):
                rows.setdefault(name, {}).setdefault("container", []).append(timed(fn))
            started = time.perf_counter()
            engine.cli("restart", "-t", "5", f"bench{i}")
            docker_harness.wait_healthy(port)
            setup.setdefault("plain docker restart until healthy", time.perf_counter() - started)
            engine.cli("rm", "-f", f"bench{i}")
            shutil.rmtree(f"/tmp/dynspec-patch-container-{cid[:12]}", ignore_errors=True)

        print(f"set-up (release {args.release})")
        print(f"{'step':<40} {'s':>8}")
        for name, sec in setup.items():
            print(f"{name:<40} {sec:>8.2f}")
        print()
        print(f"median of {args.repeat} rounds, seconds (one SSH connection per command)")
        print(f"{'command':<26} {'bare host':>10} {'container':>10} {'ratio':>7}")
        for name, by in rows.items():
            host, cont = statistics.median(by["host"]), statistics.median(by["container"])
            print(f"{name:<26} {host:>10.2f} {cont:>10.2f} {cont / host:>7.2f}")
    finally:
        if engine is not None:
            engine.stop()
        sshd.stop()
        harness.kill_matching(str(base))
        harness.remove_test_accounts()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
