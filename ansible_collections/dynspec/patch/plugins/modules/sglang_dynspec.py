# Copyright: dynspec-patch authors
# Apache-2.0

"""Documentation of dynspec.patch.sglang_dynspec; the work is done on the controller by the
action plugin of the same name (plugins/action/sglang_dynspec.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_dynspec
short_description: Add dynamic speculation disable to a live SGLang server
description:
  - Patches the SGLang installed on the host (or, with O(route=native) on SGLang 0.5.14+,
    writes the native C(--speculative-adaptive) config) so the running EAGLE worker stops
    speculating while the
    decode batch is larger than O(threshold), restarts the server with the new flag, gates on
    C(/health) and C(/health_generate), and proves the flag through C(/server_info).
  - Runs on the controller as an action plugin. It drives dynspec-patch's own Python API over
    its own SSH connection (paramiko), built from the host's connection variables
    C(ansible_host), C(ansible_port), C(ansible_user), C(ansible_ssh_private_key_file),
    C(ansible_ssh_common_args) and C(ansible_ssh_extra_args) (resolved with OpenSSH's
    C(ssh -G), so C(-o ProxyJump=...), C(-J) and ssh_config apply). Host keys are checked
    against the known_hosts files C(ssh -G) reports; with host_key_checking off a key seen for
    the first time is recorded, a changed key is always refused.
  - With O(router), the server is taken out of that sglang-router just before it is stopped,
    its in-flight requests are drained (read on the host through C(/v1/loads) or
    C(/get_load)), and it is added back once the restarted server is healthy; the router is
    called from the controller. If the restart fails the server is left out of the router.
  - A failed restart restores the original files and relaunches the original command; the
    task then fails with RV(rolled_back=true).
  - Needs the dynspec-patch Python package in the Python that runs Ansible on the controller,
    and OpenSSH's C(ssh) client there. The host needs only a python3.
version_added: "0.1.0"
author:
  # validate-modules wants "Name (@github-handle)"; the project has no GitHub account yet, and
  # "(!UNKNOWN)" is the form ansible-test accepts for an author without one.
  - dynspec-patch authors (!UNKNOWN)
options:
  state:
    description:
      - V(present) patches (idempotently) and restarts; V(absent) restores the original bytes
        and restarts without the flag.
    type: str
    choices: [present, absent]
    default: present
  threshold:
    description:
      - Decode batch size above which the EAGLE worker stops speculating
        (C(--speculative-disable-batch-threshold)), an integer from 1 to 65536, or V(auto),
        with which the patched server picks a plain or a speculative step at each batch size
        by expected tokens per second (patch route only, V(route=native) refuses it). Without
        it the files are patched and the launch flags are left as they are.
    type: raw
  worker:
    description:
      - Which worker to patch; V(auto) patches the worker the running server really uses.
    type: str
    choices: [auto, v1, v2, both]
    default: auto
  route:
    description:
      - On SGLang 0.5.14+, which offer both, V(patch) patches the EAGLE worker (the default)
        and V(native) writes a C(--speculative-adaptive) config for SGLang's own steps-0 path
        instead. Older releases take V(patch) only. A V(v2) server that runs
        C(--speculative-adaptive) is refused on the patch route (two controllers).
    type: str
    choices: [patch, native]
  restart:
    description:
      - Restart the server after changing files. V(false) leaves a "restart pending" mark.
    type: bool
    default: true
  restart_cmd:
    description:
      - Restart with this shell command on the host (systemd, docker, supervisor) instead of
        relaunching the recovered command line.
    type: str
  health_timeout:
    description: Seconds to wait for the restarted server's health.
    type: float
    default: 1200.0
  stop_timeout:
    description: Seconds between SIGTERM and SIGKILL when the server is stopped.
    type: float
    default: 60.0
  server_port:
    description: The server to act on when several run on the host (its port).
    type: int
  server_pid:
    description: The server to act on when several run on the host (its pid).
    type: int
  router:
    description:
      - URL of the sglang-router (0.3+, C(/workers) API) that the server is a worker of, as
        the controller reaches it.
    type: str
  router_worker_url:
    description:
      - The server's URL as the router lists it. Default C(http://HOSTNAME:PORT) with the
        SSH hostname and the server's port.
    type: str
  drain_timeout:
    description:
      - Seconds to wait for the server's in-flight requests to finish once it is out of the
        router. If it does not drain, it is put back and not restarted (the task fails).
    type: float
    default: 600.0
  force:
    description: (V(absent)) revert even if a file changed since it was patched.
    type: bool
    default: false
attributes:
  check_mode:
    support: full
    description: A dry run; reports what would change, writes nothing, touches no router.
  diff_mode:
    support: full
    description: The unified diff of every file that changes.
  platform:
    support: full
    platforms: posix
    description: The host side runs on POSIX hosts (Linux); the controller needs OpenSSH's C(ssh).
notes:
  - Use C(serial) and C(max_fail_percentage) to roll the fleet; the collection's playbook
    C(dynspec.patch.roll) does.
  - C(become) means C(sudo -n) on the host (no password); other become methods are refused.
"""

EXAMPLES = r"""
- name: Roll the patch, one server at a time, through the router
  hosts: sglang
  gather_facts: false
  serial: 1
  max_fail_percentage: 0
  tasks:
    - name: Dynamic speculation disable above a batch of 32
      dynspec.patch.sglang_dynspec:
        state: present
        threshold: 32
        router: http://router.internal:30000

- name: No threshold to tune, the server picks plain or speculative steps itself
  dynspec.patch.sglang_dynspec:
    threshold: auto

- name: See what would change (check mode with a diff), all hosts at once
  dynspec.patch.sglang_dynspec:
    threshold: 32
  check_mode: true
  diff: true

- name: Revert, restarting through systemd
  dynspec.patch.sglang_dynspec:
    state: absent
    restart_cmd: systemctl restart sglang
  become: true
"""

RETURN = r"""
route:
  description: V(patch), V(native) (SGLang 0.5.14+, no source change) or V(unsupported).
  returned: when the host was read
  type: str
routes:
  description: The routes the release offers (V([patch, native]) on SGLang 0.5.14+).
  returned: when the host was read
  type: list
  elements: str
sglang_version:
  description: The release installed on the host.
  returned: when the host was read
  type: str
live_worker:
  description: The EAGLE worker the running server uses (v1, v2) and how it was found.
  returned: when the host was read
  type: str
files:
  description: Every file considered, with its state before and after and the action taken.
  returned: when the host was read
  type: list
  elements: dict
  sample:
    - path: srt/speculative/eagle_worker_v2.py
      state_before: unpatched
      state_after: patched
      action: patched
files_changed:
  description: Paths (relative to the sglang package) that changed (or would, in check mode).
  returned: when the host was read
  type: list
  elements: str
server_pid_before:
  description: The server's pid before the run.
  returned: when a server runs
  type: int
server_pid_after:
  description: The server's pid after the run (the relaunched one after a restart or a
    rollback).
  returned: when a server runs
  type: int
restart:
  description: What happened to the server (a dict with pid, proof and log after a restart;
    a sentence otherwise; in check mode what would happen).
  returned: always
  type: raw
router:
  description: With O(router), what was done there (removed, drain, added_back, seconds).
  returned: with router, or when an earlier run left the server out of a router
  type: dict
resumed_rotation:
  description:
    - When an earlier run left the server out of its router (it was cut short between taking
      the worker out and putting it back, as recorded on the host), the line saying that this
      run finished that rotation (null otherwise).
  returned: success
  type: str
rolled_back:
  description: True when the restart failed and the original files and command came back.
  returned: always
  type: bool
after_failure:
  description: The host read again after a failure (host_state, server_pid, server_runs).
  returned: on failure
  type: dict
diff:
  description: The unified diff (in diff mode).
  returned: in diff mode, when files change
  type: dict
"""


def main() -> None:
    from ansible.module_utils.basic import AnsibleModule

    from ansible_collections.dynspec.patch.plugins.module_utils.sglang_dynspec_spec import (
        ARGUMENT_SPEC,
    )

    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    module.fail_json(msg="dynspec.patch.sglang_dynspec runs on the controller (action plugin); "
                         "this file only documents it")


if __name__ == "__main__":
    main()
