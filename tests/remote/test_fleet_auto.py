"""``threshold: auto`` through a real ``ansible-playbook`` (issue 16): the collection's roll
playbook with ``-e dynspec_threshold=auto`` restarts the server with ``auto`` and a second run
has nothing to do (the proof expects ``"auto"``); any other word, and ``auto`` on the native
route, fail the task with one line and write nothing."""

from __future__ import annotations

import json
import re

from fleet_harness import ansible_playbook, recap, write_inventory
from remote_harness import tree_bytes

THRESHOLD = "speculative_disable_batch_threshold"
ONE_TASK = """---
- hosts: sglang
  gather_facts: false
  become: true
  tasks:
    - dynspec.patch.sglang_dynspec:
        threshold: "{{ t }}"
        route: "{{ r | default(omit) }}"
        health_timeout: 30
"""


def _failure(output: str, host: str) -> dict:
    return json.loads(re.search(rf"fatal: \[{host}\]: FAILED! => (\{{.*\}})", output).group(1))


def test_roll_with_auto_restarts_with_auto_and_then_has_nothing_to_do(fleet):
    (host,) = fleet(1)
    workdir = host.root.parent
    inventory = write_inventory(workdir / "inventory.json", [host])
    pid = host.server.info()["fake_pid"]
    args = ("dynspec.patch.roll", "-e", "dynspec_threshold=auto")

    run = ansible_playbook(workdir, inventory, *args)
    assert run.returncode == 0, run.stdout + run.stderr
    assert recap(run.stdout)[host.name]["changed"] == 1
    info = host.server.info()
    assert info[THRESHOLD] == "auto" and info["fake_pid"] != pid
    assert info["fake_argv"][-2:] == ["--speculative-disable-batch-threshold", "auto"]

    again = ansible_playbook(workdir, inventory, *args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert recap(again.stdout)[host.name]["changed"] == 0
    assert host.server.info()["fake_pid"] == info["fake_pid"]


def test_a_bad_word_and_auto_on_the_native_route_fail_the_task_untouched(fleet):
    (old,) = fleet(1)
    (new,) = fleet(1, release="0.5.23")
    for host, extra, message in (
        (old, ["-e", "t=fast"],
         "--threshold must be an integer between 1 and 65536 or auto, got 'fast'"),
        (new, ["-e", "t=auto", "-e", "r=native"], "--threshold auto needs the patch route"),
    ):
        workdir = host.root.parent
        playbook = workdir / "one-task.yml"
        playbook.write_text(ONE_TASK)
        inventory = write_inventory(workdir / "inventory.json", [host])
        before = tree_bytes(host.package)
        pid = host.server.info()["fake_pid"]
        run = ansible_playbook(workdir, inventory, str(playbook), *extra)
        assert run.returncode == 2, run.stdout + run.stderr
        failure = _failure(run.stdout, host.name)
        assert failure["msg"].startswith(message) and "\n" not in failure["msg"]
        assert tree_bytes(host.package) == before
        assert host.server.info()["fake_pid"] == pid
