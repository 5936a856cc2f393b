"""Servers in Docker containers: what the client decides (the agent does the work on the host).

The remote agent recognises a server whose mount namespace is not the host's, names its
container (``docker inspect``), and runs a second copy of itself inside it (``docker exec``, the
container's own Python) for everything that touches the package. This module holds the pure
decisions that follow:

- ``docker restart`` replays the container's command as it was created: a restart cannot add
  or drop a server flag. ``restart_argv`` says what the restarted server will run, or refuses
  (nothing written) when the requested flags could only come from re-creating the container;
- durability: the patch lives in the container's writable layer. ``docker restart`` (and
  stop/start) keep it; a container re-created from its image loses it, unless the image itself
  carries it. ``durability`` tells which, from ``docker diff`` as the agent read it;
- ``--commit-image TAG``: ``docker commit`` of the patched container, with the new command
  (``image_changes``) when the flags differ, to re-create the container from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynspec_patch.patcher.errors import RefusedError, UsageError

ENV_CLIENT = "DYNSPEC_DOCKER_CLIENT"
ENV_HOST = "DYNSPEC_DOCKER_HOST"


@dataclass(frozen=True)
class DockerOptions:
    """Which docker client the agent runs on the host and which daemon it talks to (default:
    ``docker`` on the root PATH, and the dockerd whose data root holds the container)."""

    client: str | None = None
    host: str | None = None

    @classmethod
    def resolve(cls, client: str | None, host: str | None) -> DockerOptions:
        return cls(client or os.environ.get(ENV_CLIENT) or None,
                   host or os.environ.get(ENV_HOST) or None)

    def to_args(self) -> dict[str, str | None]:
        return {"docker_client": self.client, "docker_host": self.host}


def name(container: Mapping[str, Any]) -> str:
    return str(container.get("name") or str(container.get("id", ""))[:12])


def restart_argv(container: Mapping[str, Any], server_argv: Sequence[str],
                 desired: Sequence[str], *, restart_cmd: str | None, no_restart: bool,
                 commit_image: str | None) -> list[str]:
    """The argv the restarted server will run. ``docker restart`` keeps the container's
    command, so flags can only change through ``--restart-cmd`` (re-creating the container)
    or later, from an image made with ``--commit-image``."""
    if restart_cmd or list(desired) == list(server_argv):
        return list(desired)
    if commit_image or no_restart:
        return list(server_argv)
    added = [a for a in desired if a not in server_argv]
    dropped = [a for a in server_argv if a not in desired]
    change = " ".join(([f"add {' '.join(added)}"] if added else [])
                      + ([f"drop {' '.join(dropped)}"] if dropped else []))
    raise RefusedError(
        f"the server runs in container {name(container)}, whose command is fixed when the "
        f"container is created: docker restart cannot {change}. Use --commit-image TAG (an image "
        "whose command has it, to re-create the container from), --restart-cmd with the "
        "command that re-creates the container, or apply without --threshold (patch only). "
        "Nothing was written")


def image_changes(container: Mapping[str, Any], server_argv: Sequence[str],
                  desired: Sequence[str]) -> tuple[list[str], str]:
    """``docker commit --change`` lines that give the image the desired server command."""
    if list(desired) == list(server_argv):
        return [], "the image keeps the container's command"
    entrypoint = list(container.get("entrypoint") or [])
    command = [c for c in container.get("command") or [] if c is not None]
    if command != list(server_argv):
        return [], ("the server is not the container's own command (started by "
                    f"{command[:1]}): add {' '.join(a for a in desired if a not in server_argv)}"
                    " where that command starts it")
    if list(desired[:len(entrypoint)]) == entrypoint:  # also true without an ENTRYPOINT
        return [f"CMD {json.dumps(list(desired[len(entrypoint):]))}"], "CMD set to the new command"
    return ([f"ENTRYPOINT {json.dumps(list(desired))}", "CMD []"],
            "ENTRYPOINT set to the new command")


def check_tag(tag: str) -> None:
    if not tag or tag != tag.strip() or any(c.isspace() for c in tag) or tag.startswith("-"):
        raise UsageError(f"--commit-image must be an image reference like repo:tag, got {tag!r}")


def durability(container: Mapping[str, Any], package_dir: str | None,
               patched_paths: Sequence[str]) -> str:
    """Where the patch lives: in the image (survives re-creation) or only in the container's
    writable layer (kept by docker restart, lost when the container is re-created)."""
    if not patched_paths or package_dir is None:
        return "nothing is patched"
    changed = container.get("layer_changes")
    if changed is None:
        return "unknown (docker diff failed)"
    in_layer = {c["path"] for c in changed}
    mine = [p for p in patched_paths if f"{package_dir.rstrip('/')}/{p}" in in_layer]
    image = container.get("image")
    if not mine:
        return (f"durable: the patched files are part of image {image} (re-creating the "
                "container keeps the patch)")
    return (f"container layer only: docker restart keeps the patch, but a container re-created "
            f"from image {image} (docker rm + run, compose up --force-recreate, a new pod) loses "
            "it; make an image with apply --commit-image TAG and re-create the container from it")


def run_hint(container: Mapping[str, Any], tag: str) -> str:
    net = container.get("network_mode")
    parts = ["docker run -d", f"--name {name(container)}"]
    if net and net != "default":
        parts.append(f"--network {net}")
    policy = container.get("restart_policy")
    if policy and policy != "no":
        parts.append(f"--restart {policy}")
    parts.append("... (the container's other options) " + tag)
    return " ".join(parts)
