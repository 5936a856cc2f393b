"""One host of a fleet, as the Ansible action plugin ``dynspec.patch.sglang_dynspec`` (and
``benchmarks/fleet.py``) drive it from the controller.

- ``ssh_target`` turns a host's connection settings (Ansible's ``ansible_host``,
  ``ansible_port``, ``ansible_user``, ``ansible_ssh_private_key_file``,
  ``ansible_ssh_common_args`` / ``ansible_ssh_extra_args``) into an ``SshTarget`` through
  OpenSSH's own ``ssh -G``, so ``-o``, ``-J`` / ProxyJump, ``-F`` and ssh_config resolve
  exactly as ``ssh`` would resolve them.
- ``run_host`` opens one SSH connection (paramiko, ``patcher.ssh``), runs ``apply`` (state
  present) or ``revert`` (absent) of ``patcher.deploy`` — through ``patcher.router`` when a
  router is given — and returns a module result: ``changed`` only when a file changed or the
  server restarted, ``rolled_back`` when a restart failed and the originals came back.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dynspec_patch.patcher import deploy
from dynspec_patch.patcher.engine import Plan, Threshold, parse_threshold
from dynspec_patch.patcher.errors import DynspecError, RollbackError, UsageError
from dynspec_patch.patcher.facts import ServerProcess
from dynspec_patch.patcher.router import Rotation, RouterClient, rolling
from dynspec_patch.patcher.ssh import Connection, SshTarget


def _jump_without_brackets(jump: str) -> str:
    """``ssh -G`` writes ``user@[host]:port``; ``patcher.ssh`` reads ``user@host:port``."""
    return ",".join(re.sub(r"\[([^\]:]+)\]", r"\1", hop) for hop in jump.split(","))


def _config_file(ssh_args: Sequence[str]) -> str | None:
    """The ``-F file`` among ssh options, if any."""
    for i, arg in enumerate(ssh_args):
        if arg == "-F" and i + 1 < len(ssh_args):
            return os.path.expanduser(ssh_args[i + 1])
        if arg.startswith("-F") and len(arg) > 2:
            return os.path.expanduser(arg[2:])
    return None


def ssh_target(host: str, *, port: int | None = None, user: str | None = None,
               private_key_file: str | None = None, ssh_args: Sequence[str] = (),
               connect_timeout: float = 15.0) -> SshTarget:
    """Resolve ``host`` with ``ssh -G`` (OpenSSH on the controller) into an ``SshTarget``."""
    cmd = ["ssh", "-G", *ssh_args]
    if port:
        cmd += ["-p", str(port)]
    if user:
        cmd += ["-l", user]
    if private_key_file:
        cmd += ["-i", os.path.expanduser(private_key_file)]
    try:
        done = subprocess.run([*cmd, "--", host], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"cannot run ssh -G (openssh-client) on the controller: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"ssh -G cannot resolve {host} with {shlex.join(ssh_args)}: {tail}")
    single: dict[str, str] = {}
    identities: list[str] = []
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "identityfile":
            identities.append(os.path.expanduser(value))
        else:
            single.setdefault(key, value)
    if single.get("proxycommand", "none") != "none":
        raise UsageError(f"{host}: ProxyCommand is not supported; use ProxyJump (-J)")
    jump = single.get("proxyjump", "none")
    config = _config_file(ssh_args)
    timeout = single.get("connecttimeout", "none")
    return SshTarget(
        alias=host,
        hostname=single["hostname"],
        port=int(single["port"]),
        user=single["user"],
        identity_files=tuple(p for p in identities if os.path.exists(p)),
        proxy_jump=None if jump == "none" else _jump_without_brackets(jump),
        known_hosts=tuple(os.path.expanduser(p)
                          for p in single.get("userknownhostsfile", "").split()),
        connect_timeout=connect_timeout if timeout == "none" else float(timeout),
        keepalive=int(single.get("serveraliveinterval", "0")) or 15,
        config_path=config,  # ProxyJump hops are looked up there (ssh -F), as ssh does
        accept_new_host_key=single.get("stricthostkeychecking") == "accept-new",
    )


@dataclass(frozen=True)
class HostTask:
    """The module's parameters."""

    state: str = "present"  # present | absent
    threshold: Threshold | None = None  # an int 1..65536 or "auto"
    worker: str = "auto"
    route: str | None = None  # patch | native (None: the release's default)
    restart: bool = True
    restart_cmd: str | None = None
    health_timeout: float = 1200.0
    stop_timeout: float = 60.0
    server_port: int | None = None
    server_pid: int | None = None
    router: str | None = None
    router_worker_url: str | None = None
    drain_timeout: float = 600.0
    force: bool = False


def unified_diff(plan: Plan) -> str:
    """The plan's changes as one unified diff (paths relative to the sglang package)."""
    lines: list[str] = []
    for change in plan.changes:
        before = (change.before or b"").decode("utf-8", "replace").splitlines(keepends=True)
        after = (change.after or b"").decode("utf-8", "replace").splitlines(keepends=True)
        old = f"a/{change.path}" if change.before is not None else "/dev/null"
        new = f"b/{change.path}" if change.after is not None else "/dev/null"
        lines += (line if line.endswith("\n") else line + "\n"
                  for line in difflib.unified_diff(before, after, old, new))
    return "".join(lines)


def _module_result(out: dict[str, Any], *, check_mode: bool, diff: bool,
                   pid_before: int | None) -> dict[str, Any]:
    plan: Plan = out["plan"]
    restart = out.get("restart")
    restarted = isinstance(restart, dict) and bool(restart.get("restarted"))
    if check_mode:
        changed = bool(plan.changes) or str(restart or "").startswith("would")
    else:
        changed = bool(out.get("files_changed")) or restarted or bool(out.get("resumed_rotation"))
    result: dict[str, Any] = {
        "changed": changed,
        "failed": plan.refused,
        "rolled_back": False,
        "sglang_version": plan.sglang_version,
        "route": plan.route,
        "routes": list(plan.routes),
        "reason": plan.reason,
        "live_worker": out.get("live_worker"),
        "live_worker_source": out.get("live_worker_source"),
        "files": [f.to_json() for f in plan.files],
        "files_changed": [c.path for c in plan.changes] if check_mode
        else out.get("files_changed", []),
        "server_flags": list(plan.server_flags),
        "server_pid_before": pid_before if pid_before is not None else out.get("server_pid"),
        "server_pid_after": restart.get("pid") if restarted else out.get("server_pid"),
        "restart": restart,
        "router": out.get("router"),
        "resumed_rotation": out.get("resumed_rotation"),
    }
    if plan.refused:
        result["msg"] = plan.refusal_reason
    if diff and plan.changes:
        result["diff"] = {"prepared": unified_diff(plan)}
    return result


def _after_failure(s: deploy.Session) -> dict[str, Any]:
    """Read the host again after a failure: what its files are and what its server runs."""
    try:
        st = deploy.status(s)
    except DynspecError as exc:
        return {"error": f"could not read the host after the failure: {exc}"}
    return {"host_state": st.get("host_state"), "server_pid": st.get("server_pid"),
            "server_runs": st.get("server_runs"), "restart_pending": st.get("restart_pending")}


def _still_connected(conn: Connection) -> bool:
    try:
        return conn.transport.is_active()
    except DynspecError:
        return False


# How an Ansible user has an absent host key added (what the action plugin maps to accept-new).
ANSIBLE_ACCEPT_NEW_HINT = (
    "turn Ansible's host_key_checking off for this host (ANSIBLE_HOST_KEY_CHECKING=False, or "
    "-o StrictHostKeyChecking=accept-new in ansible_ssh_common_args)"
)


def run_host(target: SshTarget, task: HostTask, *, check_mode: bool = False,
             diff: bool = False, use_sudo: bool = True,
             accept_new_host_key: bool = False) -> dict[str, Any]:
    """Apply or revert on one host over one SSH connection; never raises a DynspecError:
    failures come back as ``failed: true`` with one ``msg`` line and an ``exit_code``."""
    rotation = (Rotation(RouterClient(task.router), worker_url=task.router_worker_url,
                         drain_timeout=task.drain_timeout) if task.router else None)
    pid_before: list[int] = []

    def note_pid(_s: Any, server: ServerProcess, _facts: Any) -> None:
        pid_before.append(server.pid)

    common: dict[str, Any] = {
        "dry_run": check_mode, "no_restart": not task.restart, "restart_cmd": task.restart_cmd,
        "pid": task.server_pid, "port": task.server_port,
        "health_timeout": task.health_timeout, "stop_timeout": task.stop_timeout,
    }
    conn = Connection(target, accept_new_host_key=accept_new_host_key or
                      target.accept_new_host_key, accept_new_hint=ANSIBLE_ACCEPT_NEW_HINT)
    s: deploy.Session | None = None
    try:
        if task.state == "present":  # Ansible hands "24" from -e as a string: an int or "auto"
            operation, extra = deploy.apply, {"threshold": parse_threshold(task.threshold),
                                              "worker": task.worker, "route": task.route}
        else:
            operation, extra = deploy.revert, {"force": task.force}
        conn.open()
        s = deploy.Session(conn, conn.agent(use_sudo=use_sudo), deploy.Faults())
        out = rolling(s, operation=operation, rotation=rotation, observe_restart=note_pid,
                      **common, **extra)
        return _module_result(out, check_mode=check_mode, diff=diff,
                              pid_before=pid_before[0] if pid_before else None)
    except DynspecError as exc:
        failed: dict[str, Any] = {
            "changed": isinstance(exc, RollbackError) or bool(rotation and rotation.left_out),
            "failed": True, "msg": str(exc), "exit_code": exc.exit_code,
            "rolled_back": isinstance(exc, RollbackError),
            "server_pid_before": pid_before[0] if pid_before else None,
            "router": rotation.report if rotation else None,
        }
        if s is not None and _still_connected(conn):
            failed["after_failure"] = _after_failure(s)
            failed["server_pid_after"] = failed["after_failure"].get("server_pid")
        return failed
    finally:
        conn.close()
