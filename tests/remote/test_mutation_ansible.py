"""The action plugin's own decisions, through a real ``ansible-playbook`` and the loopback sshd:
which become settings it refuses, and that the inventory's port, user, key, connect timeout and
SSH arguments are the ones it connects with, whichever connection plugin the host names
(mutants of plugins/action/sglang_dynspec.py that the fleet tests left alive: see
tools/mutation.py). No SGLang server runs behind the shared sshd, so a host reached and logged
into there answers "no running SGLang server"; one fleet host (its own sshd and fake server)
shows check mode, diff and sudo."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from fleet_harness import ansible_playbook
from remote_harness import OP_USER, tree_bytes

# the task keywords are per host: a host var sets them, the others get Ansible's defaults (the
# `port` keyword loses to ansible_port, which every host but keyword_port sets)
PLAY = """\
- hosts: all
  gather_facts: false
  tasks:
    - dynspec.patch.sglang_dynspec:
        threshold: 8
      port: "{{ keyword_port | default(22) }}"
      check_mode: "{{ dry_run | default(false) }}"
      diff: "{{ show_diff | default(false) }}"
"""


def play(sshd, workdir: Path, served: list[dict]) -> tuple[dict[str, dict], str]:
    """One play over one host per case; each host's result, by host name, and the play's
    output. ``served``: the inventory vars of two fleet hosts, each with a fake server."""
    reach = {"ansible_host": "127.0.0.1", "ansible_port": sshd.port, "ansible_user": OP_USER,
             "ansible_ssh_private_key_file": str(sshd.client_key),
             "ansible_ssh_common_args": f"-o UserKnownHostsFile={sshd.known_hosts}"}
    hosts = {
        "reached": reach,
        "sudo": {**reach, "ansible_become": True, "ansible_become_method": "sudo"},
        "su": {**reach, "ansible_become": True, "ansible_become_method": "su"},
        "password": {**reach, "ansible_become": True, "ansible_become_pass": "secret"},
        "common_args": {**reach, "ansible_ssh_common_args": "-o ProxyCommand=nc %h %p"},
        "extra_args": {**reach, "ansible_ssh_extra_args": "-o ProxyCommand=nc %h %p"},
        "bad_port": {**reach, "ansible_port": 70000},
        "other_user": {**reach, "ansible_user": "nobody-here"},
        "other_key": {**reach, "ansible_ssh_private_key_file": str(workdir / "no-such-key")},
        # a host missing from known_hosts: refused, unless host key checking is off
        "unknown_key": {**reach, "ansible_ssh_common_args":
                        f"-o UserKnownHostsFile={workdir / 'known_hosts.strict'}"},
        "no_checking": {**reach, "ansible_host_key_checking": False,
                        "ansible_ssh_common_args":
                        f"-o UserKnownHostsFile={workdir / 'known_hosts.accepting'}"},
        # the port only in the `port` keyword: the ssh plugin's option has it, the play
        # context does not
        "keyword_port": {**{k: v for k, v in reach.items() if k != "ansible_port"},
                         "keyword_port": sshd.port},
        # a timeout of 0 makes the socket non-blocking: the connect fails at once
        "no_timeout": {**reach, "ansible_ssh_timeout": 0},
        # the local plugin has no port, user, key, SSH arguments, timeout or host key checking
        # options: the play context's port, user and key, checking on, the controller's
        # known_hosts (which lacks this sshd)
        "local": {**{k: v for k, v in reach.items() if k != "ansible_ssh_common_args"},
                  "ansible_connection": "local"},
        # check mode with diff, under sudo; beside it an apply without become, refused before
        # anything is written (the package is root's); an apply under sudo on the other host
        "dry_run": {**served[0], "ansible_become": True, "dry_run": True, "show_diff": True},
        "no_sudo": served[0],
        "sudo_apply": {**served[1], "ansible_become": True},
    }
    inventory = workdir / "inventory.json"
    inventory.write_text(json.dumps({"all": {"hosts": hosts}}))
    (workdir / "play.yml").write_text(PLAY)
    run = ansible_playbook(workdir, inventory, str(workdir / "play.yml"),
                           "--forks", str(len(hosts)), "-v")
    lines = re.findall(r"^(fatal|changed|ok): \[(\w+)\](?:: FAILED!)? => (\{.*\})$",
                       run.stdout, re.M)
    found = {name: json.loads(result) for _status, name, result in lines}
    assert set(found) == set(hosts), run.stdout + run.stderr
    # every host fails but the two that plan or apply on a fleet host
    failed = {name for status, name, _result in lines if status == "fatal"}
    assert failed == set(hosts) - {"dry_run", "sudo_apply"}, run.stdout
    # ActionBase.run warns when the plugin hands it a tmp
    assert "no longer honors the tmp parameter" not in run.stdout + run.stderr
    return found, run.stdout


def play_without_the_package(sshd, workdir: Path, monkeypatch) -> dict:
    """One host, with a ``dynspec_patch`` ahead on PYTHONPATH that cannot be imported."""
    shadow = workdir / "shadow" / "dynspec_patch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(shadow.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    inventory = workdir / "inventory-missing.json"
    inventory.write_text(json.dumps({"all": {"hosts": {"reached": {
        "ansible_host": "127.0.0.1", "ansible_port": sshd.port}}}}))
    run = ansible_playbook(workdir, inventory, str(workdir / "play.yml"))
    [result] = re.findall(r"^fatal: \[reached\]: FAILED! => (\{.*\})$", run.stdout, re.M)
    return json.loads(result)


# One test: its plays are what run the plugin (in ansible-playbook's processes), and mutmut
# counts a mutant's tests by who ran its code
def test_the_plugin_refuses_become_it_cannot_honour_and_connects_as_the_inventory_says(
        sshd, fleet, tmp_path, monkeypatch):
    served, applied = fleet(2)
    before, pid = tree_bytes(served.package), served.server.info()["fake_pid"]
    controller_known_hosts = Path("~/.ssh/known_hosts").expanduser()
    try:
        outcomes, output = play(sshd, tmp_path,
                                [served.inventory_vars(), applied.inventory_vars()])
    finally:
        # a build that wrongly accepts new host keys records the local host's in the
        # controller's own known_hosts: take it out again
        _forget(controller_known_hosts, f"[127.0.0.1]:{sshd.port} ")
    # reached and logged into with the inventory's port, user and key
    assert outcomes["reached"]["msg"].startswith("no running SGLang server"), outcomes
    assert outcomes["sudo"]["msg"].startswith("no running SGLang server"), outcomes

    # become other than passwordless sudo is refused
    assert outcomes["su"]["msg"] == (
        "become_method su is not supported: the host side runs under sudo -n")
    assert outcomes["password"]["msg"] == (
        "a become password is not supported: the host side runs under sudo -n (passwordless "
        "sudo, or log in as root)")

    # both kinds of SSH arguments reach ssh
    for name in ("common_args", "extra_args"):
        assert outcomes[name]["msg"] == (
            "127.0.0.1: ProxyCommand is not supported; use ProxyJump (-J)"), outcomes[name]
        assert outcomes[name]["exit_code"] == 2

    # port, user and key come from the inventory
    assert "70000" in outcomes["bad_port"]["msg"]
    assert outcomes["bad_port"]["exit_code"] == 2
    for name in ("other_user", "other_key"):
        assert not outcomes[name]["msg"].startswith("no running SGLang server"), outcomes[name]
    assert "nobody-here" in outcomes["other_user"]["msg"]

    # host_key_checking false is accept-new: the absent host is recorded, then logged into
    assert outcomes["unknown_key"]["msg"].startswith(
        f"host key of [127.0.0.1]:{sshd.port} is not in known_hosts"), outcomes["unknown_key"]
    assert not (tmp_path / "known_hosts.strict").exists()
    assert outcomes["no_checking"]["msg"].startswith("no running SGLang server"), outcomes
    assert sshd.host_pub.split()[1] in (tmp_path / "known_hosts.accepting").read_text()

    # the port from the `port` keyword alone, the timeout from the inventory
    assert outcomes["keyword_port"]["msg"].startswith("no running SGLang server"), outcomes
    assert outcomes["no_timeout"]["msg"].startswith(
        f"cannot reach 127.0.0.1:{sshd.port}: "), outcomes["no_timeout"]

    # a connection plugin without those options: the play context's port (the host key
    # exchange ran on it), SSH arguments that are none, host key checking on
    assert outcomes["local"]["msg"].startswith(
        f"host key of [127.0.0.1]:{sshd.port} "), outcomes["local"]
    assert outcomes["local"]["exit_code"] != 0

    # check mode and diff reach the host: the plan and its diff, nothing written or restarted
    dry_run = outcomes["dry_run"]
    assert dry_run["changed"] is True and not dry_run.get("failed"), dry_run
    # (the callback prints a result's diff, and keeps it out of the result it prints)
    assert "+++ b/srt/speculative/eagle_worker_v2.py" in output
    assert tree_bytes(served.package) == before
    assert served.server.info()["fake_pid"] == pid
    # sudo is what lets the apply write: without become the login user cannot write root's
    # package, so nothing is written
    assert outcomes["no_sudo"]["msg"].endswith(
        f"is not writable by {OP_USER} (and sudo -n is not available): nothing was written"
    ), outcomes["no_sudo"]
    assert outcomes["sudo_apply"]["changed"] is True, outcomes["sudo_apply"]
    assert "srt/server_args.py" in outcomes["sudo_apply"]["files_changed"]

    # a controller without the package: one line that says where to install it
    assert play_without_the_package(sshd, tmp_path, monkeypatch)["msg"] == (
        "the dynspec-patch Python package is not installed for the Python that runs Ansible on "
        "the controller (hidden by the test); pip install it there")


def _forget(known_hosts: Path, prefix: str) -> None:
    if not known_hosts.exists():
        return
    lines = known_hosts.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith(prefix)]
    if kept != lines:
        known_hosts.write_text("".join(kept))
