"""The collection's playbook ``dynspec.patch.roll`` run by a real ``ansible-playbook`` against
an inventory of hosts on this machine (each its own sshd, account key, known_hosts and fake
server), with the real sglang-router in front and load on it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from fleet_harness import Load, ansible_playbook, recap, write_inventory
from remote_harness import tree_bytes

from dynspec_patch.patcher import fleet as fleet_module

THRESHOLD = "speculative_disable_batch_threshold"


def test_roll_stops_at_a_failed_restart_which_is_rolled_back_and_left_out(fleet):
    hosts = fleet(3, env={1: {"FAKE_SGLANG_FAIL_IF_PATCHED": "1"}})
    first, failing, last = hosts
    router = fleet.router(hosts)
    workdir = first.root.parent
    inventory = write_inventory(workdir / "inventory.json", hosts)
    before = {h.name: tree_bytes(h.package) for h in hosts}
    pid_last = last.server.info()["fake_pid"]

    load = Load(router.url, clients=6).start()
    try:
        time.sleep(1.0)
        run = ansible_playbook(workdir, inventory, "dynspec.patch.roll",
                               "-e", "dynspec_threshold=24",
                               "-e", f"sglang_router_url={router.url}",
                               "-e", "dynspec_health_timeout=30")
        time.sleep(0.5)
    finally:
        report = load.stop()
    out = run.stdout
    assert run.returncode == 2, out + run.stderr  # 2: a host failed
    table = recap(out)
    assert table[first.name]["changed"] == 1 and table[first.name]["failed"] == 0
    assert table[failing.name]["failed"] == 1
    assert last.name not in table or table[last.name]["ok"] == 0  # never reached
    assert "NO MORE HOSTS LEFT" in out

    # the failure says what happened: rolled back, healthy, left out of the router
    failure = json.loads(re.search(r"fatal: \[gpu1\]: FAILED! => (\{.*\})", out).group(1))
    assert failure["rolled_back"] is True
    assert failure["after_failure"]["host_state"] == "original"
    assert failure["after_failure"]["server_runs"] == "original code"
    assert failure["router"]["removed"] is True and "added_back" not in failure["router"]
    assert "left OUT of the router" in failure["msg"]
    assert failure["server_pid_after"] != failure["server_pid_before"]

    # earlier host patched and serving the flag, failed host original and healthy, later untouched
    assert tree_bytes(first.package) != before[first.name]
    assert first.server.info()[THRESHOLD] == 24
    assert tree_bytes(failing.package) == before[failing.name]
    assert THRESHOLD not in failing.server.info() and failing.server.get("/health")[0] == 200
    assert tree_bytes(last.package) == before[last.name]
    assert last.server.info()["fake_pid"] == pid_last
    assert router.healthy_workers() == {first.worker_url, last.worker_url}
    assert report.failed == 0, report.reasons
    assert report.ok > 0
    assert not router.looked_online()


def test_check_mode_diff_then_apply_then_nothing_to_do(fleet):
    hosts = fleet(2)
    workdir = hosts[0].root.parent
    inventory = write_inventory(workdir / "inventory.json", hosts)
    before = {h.name: tree_bytes(h.package) for h in hosts}
    pids = {h.name: h.server.info()["fake_pid"] for h in hosts}
    args = ("dynspec.patch.roll", "-e", "dynspec_threshold=8", "-e", "dynspec_serial=100%")

    check = ansible_playbook(workdir, inventory, *args, "--check", "--diff")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "+++ b/srt/speculative/eagle_worker_v2.py" in check.stdout
    assert "+++ b/srt/server_args.py" in check.stdout
    assert all(recap(check.stdout)[h.name]["changed"] == 1 for h in hosts)
    for h in hosts:  # nothing written, nothing restarted
        assert tree_bytes(h.package) == before[h.name]
        assert h.server.info()["fake_pid"] == pids[h.name]

    apply = ansible_playbook(workdir, inventory, *args)
    assert apply.returncode == 0, apply.stdout + apply.stderr
    assert all(recap(apply.stdout)[h.name]["changed"] == 1 for h in hosts)
    for h in hosts:
        info = h.server.info()
        assert info[THRESHOLD] == 8 and info["fake_pid"] != pids[h.name]

    again = ansible_playbook(workdir, inventory, *args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert all(recap(again.stdout)[h.name]["changed"] == 0 for h in hosts)

    revert = ansible_playbook(workdir, inventory, "dynspec.patch.roll",
                              "-e", "dynspec_state=absent")
    assert revert.returncode == 0, revert.stdout + revert.stderr
    for h in hosts:
        assert tree_bytes(h.package) == before[h.name]
        assert THRESHOLD not in h.server.info()


def test_a_host_key_missing_from_known_hosts_fails_unless_host_key_checking_is_off(
        fleet, monkeypatch):
    """Ansible's ``host_key_checking`` (on by default) decides: on, a host whose key is not in
    its known_hosts fails and nothing is added or written; off, the key is added (as
    OpenSSH's accept-new does) and the play goes on."""
    (host,) = fleet(1)
    workdir = host.root.parent
    known = workdir / "known_hosts"
    known.write_text("")
    host_vars = {**host.inventory_vars(),
                 "ansible_ssh_common_args": f"-o UserKnownHostsFile={known}"}
    inventory = workdir / "inventory.json"
    inventory.write_text(json.dumps({"sglang": {"hosts": {host.name: host_vars}}}))
    before = tree_bytes(host.package)
    logins = host.sshd.log.read_text().count("Accepted publickey")

    run = ansible_playbook(workdir, inventory, "dynspec.patch.roll", "-e", "dynspec_threshold=8")
    assert run.returncode == 2, run.stdout + run.stderr
    assert recap(run.stdout)[host.name]["failed"] == 1
    failure = json.loads(re.search(r"fatal: \[gpu0\]: FAILED! => (\{.*\})", run.stdout).group(1))
    assert f"host key of [127.0.0.1]:{host.sshd.port} is not in known_hosts" in failure["msg"]
    # the way out an Ansible user has, not the CLI's flag
    assert failure["msg"].endswith(f"or {fleet_module.ANSIBLE_ACCEPT_NEW_HINT}"), failure["msg"]
    assert "--accept-new-host-key" not in failure["msg"]
    assert known.read_text() == ""
    assert host.sshd.log.read_text().count("Accepted publickey") == logins  # never logged in
    assert tree_bytes(host.package) == before

    monkeypatch.setenv("ANSIBLE_HOST_KEY_CHECKING", "False")
    run = ansible_playbook(workdir, inventory, "dynspec.patch.roll", "--check",
                           "-e", "dynspec_threshold=8")
    assert run.returncode == 0, run.stdout + run.stderr
    assert recap(run.stdout)[host.name]["changed"] == 1
    assert known.read_text().split() == [f"[127.0.0.1]:{host.sshd.port}",
                                         *host.sshd.host_pub.split()]


def test_collection_builds_and_its_documentation_matches_the_argument_spec(tmp_path):
    import subprocess
    import sys

    import yaml
    from fleet_harness import ROOT, _bin

    collection = ROOT / "ansible_collections" / "dynspec" / "patch"
    built = subprocess.run([_bin("ansible-galaxy"), "collection", "build", str(collection),
                            "--output-path", str(tmp_path)], capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0, built.stderr
    tarball = tmp_path / "dynspec-patch-0.1.0.tar.gz"
    assert tarball.exists()
    # the documentation as installed from the built collection (the checkout itself never goes
    # on sys.path: there it would also make the product's source importable, issue 13)
    installed = subprocess.run([_bin("ansible-galaxy"), "collection", "install", "--offline",
                                "-p", str(tmp_path / "collections"), str(tarball)],
                               capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stderr
    sys.path.insert(0, str(tmp_path / "collections"))
    try:
        from ansible_collections.dynspec.patch.plugins.module_utils.sglang_dynspec_spec import (
            ARGUMENT_SPEC,
        )
        from ansible_collections.dynspec.patch.plugins.modules import sglang_dynspec
    finally:
        sys.path.remove(str(tmp_path / "collections"))
    assert Path(sglang_dynspec.__file__).is_relative_to(tmp_path)
    documented = yaml.safe_load(sglang_dynspec.DOCUMENTATION)["options"]
    assert set(documented) == set(ARGUMENT_SPEC)
    for name, spec in ARGUMENT_SPEC.items():
        doc = documented[name]
        assert doc["type"] == spec["type"], name
        assert doc.get("default") == spec.get("default"), name
        assert doc.get("choices") == spec.get("choices"), name
    yaml.safe_load(sglang_dynspec.EXAMPLES)
    returned = yaml.safe_load(sglang_dynspec.RETURN)
    assert {"route", "live_worker", "files", "server_pid_before", "server_pid_after",
            "rolled_back", "router"} <= set(returned)


def test_proxyjump_from_ansible_ssh_common_args(fleet):
    """``ansible_ssh_common_args: -F cfg -J jump``: the module reaches the host through the
    jump host's own sshd, resolved by ``ssh -G`` and the ssh_config, as ssh would."""
    jump, target = fleet(2)
    workdir = target.root.parent
    known = workdir / "known_hosts"
    known.write_text(jump.sshd.known_hosts.read_text() + target.sshd.known_hosts.read_text())
    config = workdir / "ssh_config"
    config.write_text(f"Host jump\n  HostName 127.0.0.1\n  Port {jump.sshd.port}\n"
                      f"  User {jump.inventory_vars()['ansible_user']}\n"
                      f"  IdentityFile {jump.sshd.client_key}\n")
    logins_before = jump.sshd.log.read_text().count("Accepted publickey")
    host_vars = {**target.inventory_vars(), "ansible_ssh_common_args":
                 f"-F {config} -J jump -o UserKnownHostsFile={known}"}
    inventory = workdir / "inventory.json"
    inventory.write_text(json.dumps({"sglang": {"hosts": {target.name: host_vars}}}))

    run = ansible_playbook(workdir, inventory, "dynspec.patch.roll", "--check",
                           "-e", "dynspec_threshold=8")
    assert run.returncode == 0, run.stdout + run.stderr
    assert recap(run.stdout)[target.name]["changed"] == 1
    assert jump.sshd.log.read_text().count("Accepted publickey") == logins_before + 1
