"""A CLI killed while it drains a server it took out of the real sglang-router (issue 13, 2b):
the rotation is recorded on the host before the worker leaves the router, so the next
``apply`` (the same command) or ``status`` finishes it and says so, instead of refusing with
"is not a worker of the router" and leaving the server out for good."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

from remote_harness import OP_USER

GENERATE_SECONDS = "15"  # one request in flight on host 0 keeps its drain waiting


def host_args(host) -> list[str]:
    return ["--host", f"{OP_USER}@127.0.0.1:{host.sshd.port}",
            "--identity-file", str(host.sshd.client_key),
            "--known-hosts", str(host.sshd.known_hosts),
            "--ssh-config", str(host.sshd.base / "ssh_config")]


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "dynspec_patch.patcher.cli", *argv]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*argv), capture_output=True, text=True, timeout=300)


def in_flight(host) -> int:
    with urllib.request.urlopen(host.worker_url + "/v1/loads", timeout=5) as resp:
        return sum(row["num_total_reqs"] for row in json.loads(resp.read())["loads"])


def send_slow_request(host) -> dict:
    """One /generate straight to the server (not through the router), answered after
    GENERATE_SECONDS; returns what became of it."""
    outcome: dict = {}

    def send() -> None:
        body = json.dumps({"text": "ping", "sampling_params": {"max_new_tokens": 1}}).encode()
        request = urllib.request.Request(host.worker_url + "/generate", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                outcome["answer"] = json.loads(resp.read())
        except OSError as exc:
            outcome["error"] = repr(exc)

    outcome["thread"] = threading.Thread(target=send, daemon=True)
    outcome["thread"].start()
    deadline = time.time() + 30
    while in_flight(host) == 0:
        assert time.time() < deadline, "the slow request never reached the server"
        time.sleep(0.05)
    return outcome


def wait_lock_free(host, timeout: float = 60) -> None:
    """The host's agent exits once its connection is gone, and its flock goes with it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        fd = os.open(host.state / "lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.05)
        finally:
            os.close(fd)
    raise AssertionError("the remote agent never released the lock")


def kill_the_cli_during_the_drain(fleet):
    """Two hosts behind the router; ``apply --router`` on host 0 is killed (SIGKILL) once
    the router no longer lists host 0, while a request in flight keeps the drain waiting."""
    slow, other = fleet(2, env={0: {"FAKE_SGLANG_GENERATE_SECONDS": GENERATE_SECONDS}})
    router = fleet.router([slow, other])
    request = send_slow_request(slow)
    command = ["apply", *host_args(slow), "--threshold", "16", "--health-timeout", "30",
               "--router", router.url]
    first = subprocess.Popen(cli(*command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.time() + 120
    while slow.worker_url in (router.healthy_workers() or set()):
        assert first.poll() is None, first.communicate()
        assert time.time() < deadline, "the worker never left the router"
        time.sleep(0.05)
    first.kill()
    first.wait(timeout=30)
    assert in_flight(slow) == 1  # killed while it drained
    wait_lock_free(slow)
    assert router.healthy_workers() == {other.worker_url}  # left out, restart pending
    assert (slow.state / "restart-pending.json").exists()
    return slow, other, router, request, command


def test_the_same_apply_again_finishes_the_rotation_a_killed_run_left(fleet):
    slow, other, router, request, command = kill_the_cli_during_the_drain(fleet)

    again = run(*command)  # the human output this time
    assert again.returncode == 0, again.stderr
    (line,) = [row for row in again.stdout.splitlines() if row.startswith("resumed rotation:")]
    assert f"left {slow.worker_url} out of the router {router.url}" in line
    assert "this run finished that rotation (put it back)" in line
    assert router.healthy_workers() == {slow.worker_url, other.worker_url}
    assert slow.server.info()["speculative_disable_batch_threshold"] == 16  # restarted
    assert not (slow.state / "router-rotation.json").exists()
    assert not (slow.state / "restart-pending.json").exists()
    request["thread"].join(timeout=60)
    assert "answer" in request, request  # drained, not cut by the restart
    assert "text" in request["answer"]


def test_status_puts_back_the_worker_a_killed_run_left_out(fleet):
    slow, other, router, _request, command = kill_the_cli_during_the_drain(fleet)
    record = json.loads((slow.state / "router-rotation.json").read_text())
    assert record["worker"] == slow.worker_url and record["router"] == router.url

    done = run("status", *host_args(slow), "--json")
    assert done.returncode == 0, done.stderr
    st = json.loads(done.stdout)
    assert st["router_rotation"]["worker"] == slow.worker_url
    assert "this run finished that rotation (put it back)" in st["resumed_rotation"]
    assert st["router"]["added_back"] is True
    assert st["restart_pending"] is not None and st["server_runs"] == "original code"
    assert router.healthy_workers() == {slow.worker_url, other.worker_url}
    assert not (slow.state / "router-rotation.json").exists()

    again = run(*command, "--json")  # the restart still pending: a normal rotation now
    assert again.returncode == 0, again.stderr
    out = json.loads(again.stdout)
    assert out["restart"]["restarted"] is True and out["router"]["added_back"] is True
    assert "resumed_rotation" not in out
    assert router.healthy_workers() == {slow.worker_url, other.worker_url}


def test_revert_without_the_router_option_finishes_it_too(fleet):
    """The record names the router: a ``revert`` with no ``--router`` drains the server,
    reverts and restarts it, and puts it back."""
    slow, other, router, request, _command = kill_the_cli_during_the_drain(fleet)

    done = run("revert", *host_args(slow), "--health-timeout", "30", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["restart"]["restarted"] is True
    assert "this run finished that rotation (put it back)" in out["resumed_rotation"]
    assert out["router"]["drain"]["method"].startswith("/v1/loads at 0")  # drained first
    assert router.healthy_workers() == {slow.worker_url, other.worker_url}
    assert "speculative_disable_batch_threshold" not in slow.server.info()  # original code
    assert not (slow.state / "router-rotation.json").exists()
    request["thread"].join(timeout=60)
    assert "text" in request.get("answer", {}), request
