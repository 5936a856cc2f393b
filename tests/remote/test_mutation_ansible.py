"""The action plugin's own decisions, through a real ``ansible-playbook`` and the loopback sshd:
which become settings it refuses, and that the inventory's port, user, key and SSH arguments
are the ones it connects with (mutants of plugins/action/sglang_dynspec.py that the fleet
tests left alive: see tools/mutation.py). No SGLang server runs, so a host reached and logged
into answers "no running SGLang server"."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fleet_harness import ansible_playbook
from remote_harness import OP_USER

PLAY = """\
- hosts: all
  gather_facts: false
  tasks:
    - dynspec.patch.sglang_dynspec:
        threshold: 8
"""


@pytest.fixture(scope="module")
def outcomes(sshd, tmp_path_factory) -> dict[str, dict]:
    workdir: Path = tmp_path_factory.mktemp("ansible-plugin")
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
    }
    inventory = workdir / "inventory.json"
    inventory.write_text(json.dumps({"all": {"hosts": hosts}}))
    (workdir / "play.yml").write_text(PLAY)
    run = ansible_playbook(workdir, inventory, str(workdir / "play.yml"), "--forks", "9")
    found = {name: json.loads(result) for name, result in
             re.findall(r"^fatal: \[(\w+)\]: FAILED! => (\{.*\})$", run.stdout, re.M)}
    assert set(found) == set(hosts), run.stdout + run.stderr
    return found


def test_a_reached_host_is_logged_into_with_the_inventorys_port_user_and_key(outcomes):
    assert outcomes["reached"]["msg"].startswith("no running SGLang server"), outcomes
    assert outcomes["sudo"]["msg"].startswith("no running SGLang server"), outcomes


def test_become_other_than_passwordless_sudo_is_refused(outcomes):
    assert outcomes["su"]["msg"] == (
        "become_method su is not supported: the host side runs under sudo -n")
    assert outcomes["password"]["msg"] == (
        "a become password is not supported: the host side runs under sudo -n (passwordless "
        "sudo, or log in as root)")


def test_both_kinds_of_ssh_arguments_reach_ssh(outcomes):
    for name in ("common_args", "extra_args"):
        assert outcomes[name]["msg"] == (
            "127.0.0.1: ProxyCommand is not supported; use ProxyJump (-J)"), outcomes[name]
        assert outcomes[name]["exit_code"] == 2


def test_port_user_and_key_come_from_the_inventory(outcomes):
    assert "70000" in outcomes["bad_port"]["msg"]
    assert outcomes["bad_port"]["exit_code"] == 2
    for name in ("other_user", "other_key"):
        assert not outcomes[name]["msg"].startswith("no running SGLang server"), outcomes[name]
    assert "nobody-here" in outcomes["other_user"]["msg"]
