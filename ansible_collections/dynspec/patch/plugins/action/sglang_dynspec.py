# Copyright: dynspec-patch authors
# Apache-2.0

"""dynspec.patch.sglang_dynspec: runs on the controller for each inventory host and drives
dynspec-patch's Python API (patcher.fleet) over its own SSH connection; nothing of Ansible's
runs on the host. See plugins/modules/sglang_dynspec.py for the documentation."""

from __future__ import annotations

import shlex
from typing import Any

from ansible.plugins.action import ActionBase

from ansible_collections.dynspec.patch.plugins.module_utils.sglang_dynspec_spec import (
    ARGUMENT_SPEC,
)

# Imported here, not in run(): the strategy loads this class in the ansible-playbook process
# before it forks a worker per host, so the forks inherit dynspec-patch already imported.
try:
    from dynspec_patch.patcher import fleet
    from dynspec_patch.patcher.errors import DynspecError

    MISSING = None
except ImportError as exc:
    MISSING = str(exc)


def _option(connection: Any, name: str, default: Any = None) -> Any:
    try:
        value = connection.get_option(name)
    except KeyError:  # a connection plugin without this option
        return default
    return default if value is None else value


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False  # our own SSH connection, not Ansible's
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars)
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        if MISSING is not None:
            return {**result, "failed": True,
                    "msg": "the dynspec-patch Python package is not installed for the Python "
                           f"that runs Ansible on the controller ({MISSING}); pip install it "
                           "there"}
        pc = self._play_context
        if pc.become and (pc.become_method or "sudo") != "sudo":
            return {**result, "failed": True,
                    "msg": f"become_method {pc.become_method} is not supported: the host side "
                           "runs under sudo -n"}
        if pc.become and pc.become_pass:
            return {**result, "failed": True,
                    "msg": "a become password is not supported: the host side runs under "
                           "sudo -n (passwordless sudo, or log in as root)"}
        conn = self._connection
        host = self._get_remote_addr(task_vars or {})
        ssh_args = [*shlex.split(_option(conn, "ssh_common_args", "") or ""),
                    *shlex.split(_option(conn, "ssh_extra_args", "") or "")]
        try:
            target = fleet.ssh_target(
                host, port=_option(conn, "port", pc.port),
                user=_option(conn, "remote_user", pc.remote_user),
                private_key_file=_option(conn, "private_key_file", pc.private_key_file),
                ssh_args=ssh_args, connect_timeout=float(_option(conn, "timeout", 15)))
        except DynspecError as exc:
            return {**result, "failed": True, "msg": str(exc), "exit_code": exc.exit_code}
        task = fleet.HostTask(**args)
        out = fleet.run_host(
            target, task, check_mode=bool(self._task.check_mode), diff=bool(self._task.diff),
            use_sudo=bool(pc.become),
            accept_new_host_key=not _option(conn, "host_key_checking", True))
        result.update(out)
        return result
