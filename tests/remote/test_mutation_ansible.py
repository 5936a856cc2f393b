"""The action plugin's own decisions, through a real ``ansible-playbook`` and the loopback sshd:
which become settings it refuses, and that the inventory's port, user, key and SSH arguments
are the ones it connects with (mutants of plugins/action/sglang_dynspec.py that the fleet
tests left alive: see tools/mutation.py). No SGLang server runs, so a host reached and logged
into answers "no running SGLang server"."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from fleet_harness import ansible_playbook
from remote_harness import OP_USER

PLAY = """\
- hosts: all
  gather_facts: false
  tasks:
    - dynspec.patch.sglang_dynspec:
        threshold: 8
"""


def play(sshd, workdir: Path) -> dict[str, dict]:
    """One play over one host per case; each host's failure, by host name."""
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
    }
    inventory = workdir / "inventory.json"
    inventory.write_text(json.dumps({"all": {"hosts": hosts}}))
    (workdir / "play.yml").write_text(PLAY)
    run = ansible_playbook(workdir, inventory, str(workdir / "play.yml"),
                           "--forks", str(len(hosts)))
    found = {name: json.loads(result) for name, result in
             re.findall(r"^fatal: \[(\w+)\]: FAILED! => (\{.*\})$", run.stdout, re.M)}
    assert set(found) == set(hosts), run.stdout + run.stderr
    # ActionBase.run warns when the plugin hands it a tmp
    assert "no longer honors the tmp parameter" not in run.stdout + run.stderr
    return found


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
        sshd, tmp_path, monkeypatch):
    outcomes = play(sshd, tmp_path)
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

    # a controller without the package: one line that says where to install it
    assert play_without_the_package(sshd, tmp_path, monkeypatch)["msg"] == (
        "the dynspec-patch Python package is not installed for the Python that runs Ansible on "
        "the controller (hidden by the test); pip install it there")
