"""``apply --host H --router URL`` behind a real sglang-router under load: each server leaves
the router, drains, restarts and comes back, and no request fails; without ``--router`` the
same roll drops requests (so the load generator does see drops); a failed restart leaves the
server out of the router; a worker the router does not list, or its last healthy one, is
refused before writing."""

from __future__ import annotations

import json
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
        assert report.answered_by[info["fake_pid"]] > 0
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
