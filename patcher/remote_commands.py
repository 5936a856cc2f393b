"""``--host`` commands: the CLI's entry points for a remote SGLang host.

Each function opens exactly one SSH connection (plus one per ProxyJump hop), runs one remote
agent over it, and returns a JSON-able dict; ``"plan"`` holds the engine's ``Plan`` for the CLI
to render. Errors are ``patcher.errors`` exceptions: UsageError 2, RefusedError 3 (nothing
written), RollbackError 4 (files restored, original server relaunched), DynspecError 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dynspec_patch.patcher import deploy, router
from dynspec_patch.patcher.container import DockerOptions
from dynspec_patch.patcher.deploy import Faults
from dynspec_patch.patcher.engine import Threshold
from dynspec_patch.patcher.router import Rotation, rolling
from dynspec_patch.patcher.ssh import resolve_target


@dataclass(frozen=True)
class HostOptions:
    host: str
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    ssh_config: str | None = None
    accept_new_host_key: bool = False
    connect_timeout: float = 15.0
    docker_client: str | None = None  # else $DYNSPEC_DOCKER_CLIENT, else docker on the host
    docker_host: str | None = None  # else $DYNSPEC_DOCKER_HOST, else the container's dockerd


def _run(opts: HostOptions, fn: Callable[..., dict[str, Any]], faults: Faults | None = None,
         on_progress: Callable[[str], None] | None = None, **kwargs: Any) -> dict[str, Any]:
    target = resolve_target(
        opts.host, port=opts.port, user=opts.user, identity_file=opts.identity_file,
        known_hosts=opts.known_hosts,
        ssh_config=opts.ssh_config or os.environ.get("DYNSPEC_SSH_CONFIG") or None,
        connect_timeout=opts.connect_timeout,
    )
    accept_new = opts.accept_new_host_key or target.accept_new_host_key
    docker = DockerOptions.resolve(opts.docker_client, opts.docker_host)
    with deploy.session(target, accept_new_host_key=accept_new, faults=faults,
                        on_progress=on_progress, docker=docker) as s:
        result = fn(s, **kwargs)
        stats = s.conn.stats
        result["ssh"] = {"connections": stats.connections, "round_trips": stats.round_trips,
                         "steps": list(stats.log),
                         "seconds": [[name, round(sec, 4)] for name, sec in stats.seconds]}
        return result


def detect_path(opts: HostOptions, *, pid: int | None, port: int | None) -> dict[str, Any]:
    """Release, route, live worker with evidence, patch state per file, recommended action."""
    return _run(opts, deploy.detect_path, pid=pid, port=port)


def apply(opts: HostOptions, *, threshold: Threshold | None, worker: str, dry_run: bool,
          no_restart: bool, restart_cmd: str | None, pid: int | None, port: int | None,
          health_timeout: float, stop_timeout: float = 60.0, faults: Faults | None = None,
          on_progress: Callable[[str], None] | None = None,
          commit_image: str | None = None,
          rotation: Rotation | None = None, route: str | None = None) -> dict[str, Any]:
    """Patch the host's sglang (or write the native config), then restart and prove it;
    with ``rotation`` the server is out of its sglang-router while it restarts; for a server
    in a container, optionally ``docker commit`` it as ``commit_image``; ``route`` is
    ``--route`` (patch | native; None: the release's default)."""
    return _run(opts, rolling, faults, on_progress, operation=deploy.apply, rotation=rotation,
                threshold=threshold, worker=worker, dry_run=dry_run, no_restart=no_restart,
                restart_cmd=restart_cmd, pid=pid, port=port, health_timeout=health_timeout,
                stop_timeout=stop_timeout, commit_image=commit_image, route=route)


def revert(opts: HostOptions, *, dry_run: bool, force: bool, no_restart: bool,
           restart_cmd: str | None, pid: int | None, port: int | None,
           health_timeout: float, stop_timeout: float = 60.0, faults: Faults | None = None,
           on_progress: Callable[[str], None] | None = None,
           rotation: Rotation | None = None,
           restore_originals: bool = False) -> dict[str, Any]:
    """Restore the original bytes (refused if a file changed since apply, unless force;
    ``restore_originals`` puts the copies saved at apply back where a plain revert can't);
    with ``rotation`` the server is out of its sglang-router while it restarts."""
    return _run(opts, rolling, faults, on_progress, operation=deploy.revert, rotation=rotation,
                dry_run=dry_run, force=force, no_restart=no_restart, restart_cmd=restart_cmd,
                pid=pid, port=port, health_timeout=health_timeout, stop_timeout=stop_timeout,
                restore_originals=restore_originals)


def status(opts: HostOptions) -> dict[str, Any]:
    """original | patched | mixed | unknown, restart pending, what the server runs; a router
    rotation an earlier run left unfinished is finished (the worker put back) where its server
    answers."""
    return _run(opts, router.status)
