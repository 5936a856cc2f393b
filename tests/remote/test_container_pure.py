"""The pure container decisions (``patcher.container``) and the agent's init-wrapper rule."""

from __future__ import annotations

import json

import pytest

from dynspec_patch.patcher import container
from dynspec_patch.patcher.errors import RefusedError, UsageError
from dynspec_patch.patcher.remote_agent import is_server_argv

SERVER = ["python3", "-m", "sglang.launch_server", "--model-path", "/m", "--port", "30000"]
FLAG = ["--speculative-disable-batch-threshold", "8"]
C = {"id": "a" * 64, "name": "sglang", "image": "lmsysorg/sglang:v0.5.4", "entrypoint": None,
     "command": SERVER, "network_mode": "host", "restart_policy": "always"}


def test_an_init_wrapper_is_not_the_server():
    assert is_server_argv(SERVER)
    assert not is_server_argv(["/sbin/docker-init", "--", *SERVER])
    assert not is_server_argv(["tini", "--", *SERVER])


def test_restart_argv_keeps_the_containers_command_or_refuses():
    desired = SERVER + FLAG
    with pytest.raises(RefusedError, match="cannot add --speculative-disable-batch-threshold 8"):
        container.restart_argv(C, SERVER, desired, restart_cmd=None, no_restart=False,
                               commit_image=None)
    keep = {"restart_cmd": None, "no_restart": False}
    assert container.restart_argv(C, SERVER, desired, **keep, commit_image="t") == SERVER
    assert container.restart_argv(C, SERVER, SERVER, **keep, commit_image=None) == SERVER
    assert container.restart_argv(C, SERVER, desired, restart_cmd="x", no_restart=False,
                                  commit_image=None) == desired
    with pytest.raises(RefusedError, match="cannot drop"):  # revert of a flag in the command
        container.restart_argv(C, desired, SERVER, **keep, commit_image=None)


def test_image_changes_set_cmd_or_entrypoint():
    desired = SERVER + FLAG
    assert container.image_changes(C, SERVER, desired)[0] == [f"CMD {json.dumps(desired)}"]
    with_ep = {**C, "entrypoint": ["python3", "-m", "sglang.launch_server"]}
    assert container.image_changes(with_ep, SERVER, desired)[0] == [
        f"CMD {json.dumps(desired[3:])}"]
    other_ep = {**C, "entrypoint": ["/bin/sh", "-c"], "command": ["/bin/sh", "-c", "run.sh"]}
    changes, why = container.image_changes(other_ep, SERVER, desired)
    assert changes == [] and "not the container's own command" in why
    assert container.image_changes(C, SERVER, SERVER)[0] == []


def test_durability_from_the_containers_layer():
    pkg = "/usr/lib/python3/dist-packages/sglang"
    files = ["srt/server_args.py"]
    in_layer = {**C, "layer_changes": [{"change": "C", "path": f"{pkg}/srt/server_args.py"}]}
    assert container.durability(in_layer, pkg, files).startswith("container layer only")
    in_image = {**C, "layer_changes": []}
    assert container.durability(in_image, pkg, files).startswith("durable")
    assert container.durability(in_image, pkg, []) == "nothing is patched"
    assert container.durability({**C, "layer_changes": None}, pkg, files).startswith("unknown")
    both = ["srt/server_args.py", "srt/speculative/eagle_worker_v2.py"]
    part = {**C, "layer_changes": [{"change": "C", "path": f"{pkg}/{both[1]}"}]}
    assert container.durability(part, pkg, both).startswith("container layer only")


@pytest.mark.parametrize("tag", ["", " x", "a b", "-x"])
def test_bad_image_tags_are_usage_errors(tag):
    with pytest.raises(UsageError):
        container.check_tag(tag)


def test_commit_image_without_host_is_a_usage_error(tmp_path, capsys):
    from dynspec_patch.patcher import cli

    assert cli.run(["apply", "--sglang-root", str(tmp_path), "--commit-image", "x:y"]) == 2
    assert "--commit-image applies only with --host" in capsys.readouterr().err
