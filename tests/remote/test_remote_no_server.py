"""No server runs, and the tool says why instead of pointing at the python3 on PATH (issue 13,
2c): another run is restarting it (the restart's marker on the host), or its Docker container
is stopped (``docker inspect``)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from remote_harness import OP_USER

from dynspec_patch.patcher import remote_commands as rc

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")
WRONG_ADVICE = "--no-restart to patch the files of the python3 on PATH"


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynspec_patch.patcher.cli", *argv],
                          capture_output=True, text=True, timeout=300)


def test_a_run_that_arrives_while_another_has_the_server_stopped_says_so(make_host, box,
                                                                        tmp_path):
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC)
    hold = tmp_path / "hold"
    hold.touch()
    # The first run restarts through a command that stops the server, then waits (here: for
    # the test) before it starts the patched one: the window a second run can fall into.
    relaunch = [str(host.venv / "bin" / "python"), "-m", "sglang.launch_server",
                "--model-path", str(host.root / "model dir"), "--port", str(srv.port), *SPEC,
                "--speculative-disable-batch-threshold", "16"]
    restart_cmd = (f"kill {srv.pid}; while [ -e {shlex.quote(str(hold))} ]; do sleep 0.1; "
                   f"done; setsid {shlex.join(relaunch)} >> {shlex.quote(str(srv.log))} 2>&1 "
                   "< /dev/null &")
    first = subprocess.Popen(
        [sys.executable, "-m", "dynspec_patch.patcher.cli", "apply", "--host", box,
         "--threshold", "16", "--restart-cmd", restart_cmd, "--health-timeout", "60", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while srv.get("/health")[0] is not None:
            assert time.time() < deadline and first.poll() is None, first.communicate()
            time.sleep(0.05)
        assert first.poll() is None  # it waits for the hold: the server is stopped

        second = cli("apply", "--host", box, "--threshold", "16")
        assert second.returncode == 3, second.stderr
        assert WRONG_ADVICE not in second.stderr
        assert "another dynspec-patch run" in second.stderr
        assert f"is restarting the one on port {srv.port}" in second.stderr
        assert "nothing was written" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1

        status = cli("status", "--host", box, "--json")
        assert status.returncode == 0, status.stderr
        st = json.loads(status.stdout)
        assert f"is restarting the one on port {srv.port}" in st["no_server_because"]
        assert "wait until it is done" in st["recommended"]
    finally:
        hold.unlink()
        out, err = first.communicate(timeout=180)
    assert first.returncode == 0, err
    assert json.loads(out)["restart"]["restarted"] is True
    assert srv.info()["speculative_disable_batch_threshold"] == 16
    assert not list(Path("/tmp/dynspec-patch-restarts").glob(f"port-{srv.port}"))
    assert cli("status", "--host", box, "--json").returncode == 0


def test_apply_on_a_stopped_container_says_it_is_stopped(container_host, monkeypatch):
    name, port = container_host.run(*SPEC)
    container_host.engine.cli("stop", "-t", "5", name)
    monkeypatch.setenv("DYNSPEC_DOCKER_CLIENT", "/usr/bin/docker")
    sshd = container_host.sshd
    target = ["--host", f"{OP_USER}@127.0.0.1:{sshd.port}", "--identity-file",
              str(sshd.client_key), "--known-hosts", str(sshd.known_hosts),
              "--ssh-config", str(sshd.base / "ssh_config")]

    done = cli("apply", *target)
    assert done.returncode == 3, done.stderr
    assert WRONG_ADVICE not in done.stderr
    assert f"its container {name} (image {container_host.image}) is exited" in done.stderr
    assert f"docker start {name}" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1

    st = rc.status(container_host.options())
    assert f"docker start {name}" in st["no_server_because"]

    container_host.engine.cli("start", name)  # what it says to do, and then it works
    from docker_harness import wait_healthy

    wait_healthy(port)
    done = cli("apply", *target, "--health-timeout", "30", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["restart"]["restarted"] is True
