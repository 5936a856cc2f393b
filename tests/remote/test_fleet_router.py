"""``apply --host H --router URL`` behind a real sglang-router under load: each server leaves
the router, drains, restarts and comes back, and no request fails; without ``--router`` the
same roll drops requests (so the load generator does see drops); a failed restart leaves the
server out of the router; a worker the router does not list, or its last healthy one (also
when an unhealthy one is still listed), is refused before writing; the drain waits for
requests that outlive its settle time; the worker is back and healthy in the router when the
command returns."""

from __future__ import annotations

import json
import os
import re
import signal
import time

from fleet_harness import Load
from remote_harness import OP_USER, tree_bytes

from dynspec_patch.patcher import cli


def cli_host(capsys, host, *args: str) -> tuple[int, dict | str, str]:
    code = cli.run([*args, "--host", f"{OP_USER}@127.0.0.1:{host.sshd.port}",
                    "--identity-file", str(host.sshd.client_key),
                    "--known-hosts", str(host.sshd.known_hosts),
                    "--ssh-config", str(host.sshd.base / "ssh_config"), "--json"])
    captured = capsys.readouterr()
    out = captured.out
    return code, (json.loads(out) if out.strip().startswith("{") else out), captured.err


def roll(capsys, hosts, *extra: str) -> list[dict]:
    results = []
    for host in hosts:
        code, out, err = cli_host(capsys, host, "apply", "--threshold", "16",
                                  "--health-timeout", "30", *extra)
        assert code == 0, err
        assert out["restart"]["restarted"] is True
        results.append(out)
    return results


def test_rolling_apply_through_the_router_fails_no_request(fleet, capsys):
    hosts = fleet(3)
    router = fleet.router(hosts)
    load = Load(router.url, clients=6).start()
    try:
        time.sleep(1.0)
        results = roll(capsys, hosts, "--router", router.url)
        time.sleep(1.0)  # traffic after the last server came back
    finally:
        report = load.stop()
    for host, out in zip(hosts, results, strict=True):
        moved = out["router"]
        assert moved["worker"] == host.worker_url
        assert moved["removed"] is True and moved["added_back"] is True
        assert moved["drain"]["method"].startswith("/v1/loads at 0")
        assert out["live_worker"] == "v2"
    assert report.failed == 0, report.reasons
    assert report.ok >= 60
    # every restarted server is back in the router and answered requests after its restart
    assert router.healthy_workers() == {h.worker_url for h in hosts}
    for host in hosts:
        info = host.server.info()
        assert info["speculative_disable_batch_threshold"] == 16
        assert report.answered_by[host.server.port, info["fake_pid"]] > 0
    assert not router.looked_online()


def test_the_same_roll_without_the_router_step_drops_requests(fleet, capsys):
    hosts = fleet(2)
    router = fleet.router(hosts)
    load = Load(router.url, clients=6).start()
    try:
        time.sleep(1.0)
        results = roll(capsys, hosts)
    finally:
        report = load.stop()
    assert all(out.get("router") is None for out in results)
    assert report.failed > 0  # stopped servers and cut requests: the load generator sees them
    assert report.ok > 0


def test_failed_restart_leaves_the_worker_out_and_refusals_write_nothing(fleet, capsys):
    good, bad = fleet(2, env={1: {"FAKE_SGLANG_FAIL_IF_PATCHED": "1"}})
    router = fleet.router([good, bad])
    original = tree_bytes(bad.package)

    # a dry run reads the router but changes nothing there
    code, out, err = cli_host(capsys, bad, "apply", "--threshold", "16", "--dry-run",
                              "--router", router.url)
    assert code == 0, err
    assert out["restart"].startswith("would restart")
    assert out["router"]["worker"] == bad.worker_url and "removed" not in out["router"]
    assert router.healthy_workers() == {good.worker_url, bad.worker_url}

    # a URL the router does not list: refused before anything is written (exit 3)
    code, _, err = cli_host(capsys, bad, "apply", "--threshold", "16", "--router", router.url,
                            "--router-worker-url", "http://127.0.0.2:1")
    assert code == 3 and "is not a worker of the router" in err
    assert tree_bytes(bad.package) == original
    assert router.healthy_workers() == {good.worker_url, bad.worker_url}

    load = Load(router.url, clients=4).start()
    try:
        time.sleep(0.5)
        code, _, err = cli_host(capsys, bad, "apply", "--threshold", "16", "--router", router.url,
                                "--health-timeout", "30")
        time.sleep(0.5)
    finally:
        report = load.stop()
    assert code == 4, err
    assert "healthy again" in err and f"{bad.worker_url} is left OUT of the router" in err
    assert tree_bytes(bad.package) == original
    assert "speculative_disable_batch_threshold" not in bad.server.info()  # original code runs
    assert bad.server.get("/health")[0] == 200
    assert router.healthy_workers() == {good.worker_url}
    assert report.failed == 0, report.reasons

    # the router's last healthy worker is never taken out: refused before writing (exit 3)
    good_before = tree_bytes(good.package)
    code, _, err = cli_host(capsys, good, "apply", "--threshold", "16", "--router", router.url)
    assert code == 3 and "only healthy worker" in err, err
    assert tree_bytes(good.package) == good_before
    assert router.healthy_workers() == {good.worker_url}

    # --router is for --host only
    assert cli.run(["apply", "--sglang-root", str(bad.package), "--router", router.url]) == 2


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


def test_an_unhealthy_worker_still_listed_is_not_another_worker(fleet, capsys):
    """sglang-router keeps a worker that fails its health checks listed (is_healthy false):
    the last healthy worker must still be refused."""
    good, sick = fleet(2)
    router = fleet.router([good, sick], options=("--health-check-interval-secs", "1",
                                                 "--health-failure-threshold", "1"))
    os.kill(sick.server.outer(), signal.SIGKILL)
    _wait_for(lambda: router.health() == {good.worker_url: True, sick.worker_url: False}, 30,
              "the router lists the killed server as unhealthy")
    before = tree_bytes(good.package)
    pid = good.server.info()["fake_pid"]
    code, _, err = cli_host(capsys, good, "apply", "--threshold", "16", "--router", router.url)
    assert code == 3 and "is the only healthy worker" in err, err
    assert tree_bytes(good.package) == before
    assert good.server.info()["fake_pid"] == pid
    assert router.health() == {good.worker_url: True, sick.worker_url: False}


def test_the_drain_waits_for_requests_that_outlive_the_settle_time(fleet, capsys):
    """Each request on the rolled server takes 4 s, four times the drain's 1 s settle time:
    the server is stopped only when the last of them has been answered through the router."""
    fast, slow = fleet(2, env={1: {"FAKE_SGLANG_GENERATE_SECONDS": "4"}})
    router = fleet.router([fast, slow])
    old_pid = slow.server.info()["fake_pid"]
    load = Load(router.url, clients=6).start()
    try:
        _wait_for(lambda: json.loads(slow.server.get("/v1/loads")[1])["loads"][0][
            "num_total_reqs"] >= 2, 10, "requests in flight on the slow server")
        code, out, err = cli_host(capsys, slow, "apply", "--threshold", "16",
                                  "--router", router.url, "--health-timeout", "30")
    finally:
        report = load.stop()
    assert code == 0, err
    drain = out["router"]["drain"]
    assert drain["in_flight_at_removal"] >= 2
    assert drain["method"] == "/v1/loads at 0 for 1.0s"
    assert drain["seconds"] > 2.0  # the slowest request in flight had up to 4 s left
    # what the router saw: every request it forwarded was answered, the old server's too
    assert report.failed == 0, report.reasons
    assert report.answered_by[slow.server.port, old_pid] >= drain["in_flight_at_removal"]
    # what the server saw: nothing in flight when it was told to stop
    stops = re.findall(r"SIGTERM with (\d+) request\(s\) in flight", slow.server.log.read_text())
    assert stops == ["0"]
    assert router.healthy_workers() == {fast.worker_url, slow.worker_url}


def test_the_command_returns_once_the_router_lists_the_worker_healthy(fleet, capsys):
    """The router adds a worker in the background, after reading its model info (3 s here):
    the command must wait for that, not return when the router accepted the request."""
    other, rolled = fleet(2, env={1: {"FAKE_SGLANG_MODEL_INFO_SECONDS": "3"}})
    router = fleet.router([other, rolled])
    code, out, err = cli_host(capsys, rolled, "apply", "--threshold", "16",
                              "--router", router.url, "--health-timeout", "30")
    listed = router.health()  # the moment the command returned
    assert code == 0, err
    assert listed == {other.worker_url: True, rolled.worker_url: True}
    assert out["router"]["added_back"] is True and out["router"]["add_seconds"] >= 3.0
    assert rolled.server.info()["speculative_disable_batch_threshold"] == 16
