"""What the container decisions tell the user, word for word (mutants that kept
``test_container_pure`` green: see tools/mutation.py)."""

from __future__ import annotations

import json

import pytest

from dynspec_patch.patcher import container
from dynspec_patch.patcher.errors import RefusedError, UsageError

SERVER = ["python3", "-m", "sglang.launch_server", "--model-path", "/m", "--port", "30000"]
FLAG = ["--speculative-disable-batch-threshold", "8"]
C = {"id": "0123456789abcdef" * 4, "name": "sglang", "image": "lmsysorg/sglang:v0.5.4",
     "entrypoint": None, "command": SERVER, "network_mode": "host", "restart_policy": "always"}
PKG = "/usr/lib/python3/dist-packages/sglang"


def test_a_container_is_named_by_its_name_else_its_short_id():
    assert container.name(C) == "sglang"
    assert container.name({**C, "name": ""}) == "0123456789ab"
    assert container.name({}) == ""


def test_the_restart_refusal_names_the_container_what_changes_and_the_ways_out():
    with_old = [*SERVER, "--old-flag", "3"]
    with pytest.raises(RefusedError) as refused:
        container.restart_argv(C, with_old, [*SERVER, *FLAG], restart_cmd=None,
                               no_restart=False, commit_image=None)
    assert str(refused.value) == (
        "the server runs in container sglang, whose command is fixed when the container is "
        "created: docker restart cannot add --speculative-disable-batch-threshold 8 drop "
        "--old-flag 3. Use --commit-image TAG (an image whose command has it, to re-create the "
        "container from), --restart-cmd with the command that re-creates the container, or "
        "apply without --threshold (patch only). Nothing was written")
    with pytest.raises(RefusedError) as add_only:
        container.restart_argv(C, SERVER, [*SERVER, *FLAG], restart_cmd=None,
                               no_restart=False, commit_image=None)
    assert "docker restart cannot add --speculative-disable-batch-threshold 8. Use" in str(
        add_only.value)


def test_apply_without_restart_keeps_the_containers_command():
    assert container.restart_argv(C, SERVER, [*SERVER, *FLAG], restart_cmd=None,
                                  no_restart=True, commit_image=None) == SERVER


def test_image_changes_say_what_the_image_gets():
    desired = [*SERVER, *FLAG]
    assert container.image_changes(C, SERVER, SERVER) == (
        [], "the image keeps the container's command")
    assert container.image_changes(C, SERVER, desired) == (
        [f"CMD {json.dumps(desired)}"], "CMD set to the new command")
    other_ep = {**C, "entrypoint": ["/bin/sh"]}
    assert container.image_changes(other_ep, SERVER, desired) == (
        [f"ENTRYPOINT {json.dumps(desired)}", "CMD []"], "ENTRYPOINT set to the new command")
    wrapped = {**C, "command": ["/bin/sh", "-c", "run.sh"]}
    assert container.image_changes(wrapped, [*SERVER, "--old"], [*SERVER, "--old", *FLAG]) == (
        [], "the server is not the container's own command (started by ['/bin/sh']): add "
            "--speculative-disable-batch-threshold 8 where that command starts it")


@pytest.mark.parametrize("tag", ["repo:tag", "registry.local:5000/team/sglang:patched", "x"])
def test_good_image_tags_pass(tag):
    container.check_tag(tag)


def test_a_bad_image_tag_says_what_a_tag_is():
    with pytest.raises(UsageError) as bad:
        container.check_tag("a b")
    assert str(bad.value) == "--commit-image must be an image reference like repo:tag, got 'a b'"


def test_durability_names_the_image_and_what_to_do():
    files = ["srt/server_args.py"]
    in_layer = {**C, "layer_changes": [{"change": "C", "path": f"{PKG}/srt/server_args.py"}]}
    # a package directory written with a trailing slash is the same directory
    assert container.durability(in_layer, PKG + "/", files) == (
        "container layer only: docker restart keeps the patch, but a container re-created "
        "from image lmsysorg/sglang:v0.5.4 (docker rm + run, compose up --force-recreate, a new "
        "pod) loses it; make an image with apply --commit-image TAG and re-create the container "
        "from it")
    assert container.durability({**C, "layer_changes": []}, PKG, files) == (
        "durable: the patched files are part of image lmsysorg/sglang:v0.5.4 (re-creating the "
        "container keeps the patch)")
    assert container.durability(in_layer, None, files) == "nothing is patched"
    assert container.durability({**C, "layer_changes": None}, PKG, files) == (
        "unknown (docker diff failed)")


def test_the_run_hint_keeps_the_network_and_restart_policy():
    assert container.run_hint(C, "me/sglang:patched") == (
        "docker run -d --name sglang --network host --restart always ... (the container's "
        "other options) me/sglang:patched")
    plain = {**C, "network_mode": "default", "restart_policy": "no"}
    assert container.run_hint(plain, "t") == (
        "docker run -d --name sglang ... (the container's other options) t")


def test_docker_options_come_from_the_command_line_then_the_environment(monkeypatch):
    monkeypatch.setenv(container.ENV_CLIENT, "/usr/bin/docker")
    monkeypatch.setenv(container.ENV_HOST, "unix:///run/d.sock")
    assert container.DockerOptions.resolve(None, None).to_args() == {
        "docker_client": "/usr/bin/docker", "docker_host": "unix:///run/d.sock"}
    assert container.DockerOptions.resolve("/opt/docker", "tcp://h:1").to_args() == {
        "docker_client": "/opt/docker", "docker_host": "tcp://h:1"}
    monkeypatch.setenv(container.ENV_CLIENT, "")
    monkeypatch.delenv(container.ENV_HOST)
    assert container.DockerOptions.resolve("", None) == container.DockerOptions(None, None)
