"""An SGLang server in a Docker container on the SSH host: detect, apply, re-apply, status
(durability), --commit-image, revert, a failed restart (rolled back), and a container without
what the tool needs (refused, exit 3).

Real parts: Debian's dockerd started by the fixtures (own socket and data root, no bridge, no
iptables), an image imported offline from a root fs made here with the real 0.5.10.post1
release, the fake server as the container's command (host network), the loopback sshd.
"""

from __future__ import annotations

import json
import os
import shlex

import pytest
from docker_harness import DOCKER, SITE, server_argv, server_info, wait_healthy

from dynspec_patch.patcher import cli
from dynspec_patch.patcher import remote_commands as rc
from dynspec_patch.patcher.errors import RefusedError, RollbackError

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")
PACKAGE = f"{SITE}/sglang"
STATE = f"{SITE}/.dynspec-patch"
FIELD = "speculative_disable_batch_threshold"
HASHES = (
    "import hashlib, json, os, sys\n"
    "root = sys.argv[1]\n"
    "out = {}\n"
    "for d, _, names in os.walk(root):\n"
    "    for n in names:\n"
    "        if '__pycache__' not in d:\n"
    "            p = os.path.join(d, n)\n"
    "            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, 'rb').read()).hexdigest()\n"
    "print(json.dumps(out))\n"
)


def package_hashes(engine, name: str) -> dict[str, str]:
    """sha256 of every file of the sglang package, read inside the container."""
    return json.loads(engine.cli("exec", name, "python3", "-c", HASHES, PACKAGE).stdout)


def listing(engine, name: str, directory: str) -> list[str]:
    """``os.listdir`` inside the container (the image has Python and no coreutils)."""
    code = "import json, os, sys; print(json.dumps(sorted(os.listdir(sys.argv[1]))))"
    return json.loads(engine.cli("exec", name, "python3", "-c", code, directory).stdout)


def read_json(engine, name: str, path: str) -> dict:
    code = "import sys; sys.stdout.write(open(sys.argv[1]).read())"
    return json.loads(engine.cli("exec", name, "python3", "-c", code, path).stdout)


def layer_paths(engine, name: str) -> list[str]:
    """Files under site-packages that the container's layer changed (``docker diff``), less
    Python's own byte-code caches and the directories that hold the changes."""
    lines = engine.cli("diff", name).stdout.decode().splitlines()
    paths = [line.split(" ", 1)[1] for line in lines]
    mine = [p for p in paths if p.startswith(SITE) and "__pycache__" not in p]
    return [p for p in mine if not any(q.startswith(p + "/") for q in paths)]


def started_at(engine, name: str) -> str:
    return engine.inspect(name)["State"]["StartedAt"]


def apply(ch, **kw):
    args = {"threshold": None, "worker": "auto", "dry_run": False, "no_restart": False,
            "restart_cmd": None, "pid": None, "port": None, "health_timeout": 30.0,
            "stop_timeout": 5.0}
    args.update(kw)
    return rc.apply(args.pop("opts", None) or ch.options(), **args)


def revert(ch, **kw):
    args = {"dry_run": False, "force": False, "no_restart": False, "restart_cmd": None,
            "pid": None, "port": None, "health_timeout": 30.0, "stop_timeout": 5.0}
    args.update(kw)
    return rc.revert(ch.options(), **args)


def test_detect_names_the_container_and_the_package_inside_it(container_host):
    engine = container_host.engine
    name, port = container_host.run(*SPEC)
    out = rc.detect_path(container_host.options(), pid=None, port=None)
    inspected = engine.inspect(name)
    c = out["container"]
    assert c["id"] == inspected["Id"] and c["name"] == name
    assert c["image"] == container_host.image
    assert c["restart_policy"] == "unless-stopped"
    assert c["started_by"].startswith("docker run")
    assert c["command"] == ["python3", "-m", "sglang.launch_server", "--model-path",
                            "/models/toy model", "--host", "127.0.0.1", "--port", str(port), *SPEC]
    assert c["docker_host"] == engine.host  # found from the dockerd that holds the container
    assert c["network_mode"] == "host"
    assert len(out["servers"]) == 1  # docker-init carries the same argv: it is not a server
    assert out["servers"][0]["container_id"] == inspected["Id"]
    assert out["package_dir"] == PACKAGE
    assert out["state_dir"] == STATE
    assert out["release"] == "0.5.10.post1"
    assert out["live_worker"] == "v1" and out["live_worker_source"] == "/server_info"
    assert out["host_state"] == "original"
    assert layer_paths(engine, name) == []  # detection writes nothing


def test_apply_reapply_status_and_revert_inside_the_container(container_host):
    engine = container_host.engine
    name, port = container_host.run(*SPEC)
    original = package_hashes(engine, name)
    container_id, first_start = engine.inspect(name)["Id"], started_at(engine, name)

    out = apply(container_host)
    assert out["restart"]["restarted"] is True
    assert out["restart"]["proof"]["checked"] == {FIELD: "<present>"}
    assert out["restart"]["verified_through_ssh_tunnel"] is True
    assert engine.inspect(name)["Id"] == container_id  # restarted, not re-created
    assert started_at(engine, name) != first_start
    info = server_info(port)
    assert FIELD in info and info[FIELD] is None  # patched code, the container's own command
    patched = package_hashes(engine, name)
    assert sorted(p for p in patched if patched[p] != original.get(p)) == sorted(
        out["files_changed"])
    manifest = read_json(engine, name, f"{STATE}/manifest.json")
    assert {f["path"] for f in manifest["files"]} == set(out["files_changed"])
    assert f"{PACKAGE}/srt/server_args.py" in layer_paths(engine, name)

    st = rc.status(container_host.options())
    assert st["host_state"] == "patched" and st["server_runs"] == "patched code"
    assert st["durability"].startswith("container layer only")
    assert st["restart_pending"] is None

    restarted_at = started_at(engine, name)
    again = apply(container_host)
    assert again["plan"].changes == ()
    assert again["restart"].startswith("not needed")
    assert started_at(engine, name) == restarted_at
    assert package_hashes(engine, name) == patched

    back = revert(container_host)
    assert back["restart"]["restarted"] is True
    assert package_hashes(engine, name) == original
    assert FIELD not in server_info(port)
    st = rc.status(container_host.options())
    assert st["host_state"] == "original" and st["server_runs"] == "original code"
    assert st["durability"] == "nothing is patched"


def test_threshold_needs_commit_image_which_makes_a_durable_patched_image(container_host):
    engine = container_host.engine
    name, port = container_host.run(*SPEC)
    original = package_hashes(engine, name)
    with pytest.raises(RefusedError, match="docker restart cannot add "
                                           "--speculative-disable-batch-threshold 16"):
        apply(container_host, threshold=16)
    assert package_hashes(engine, name) == original
    assert layer_paths(engine, name) == [f"{STATE}/lock"]  # the lock only: nothing written

    tag = f"dynspec-test/sglang:patched-{name}"
    out = apply(container_host, threshold=16, commit_image=tag)
    assert out["restart"]["restarted"] is True
    image = out["image"]
    assert image["tag"] == tag and image["image_id"].startswith("sha256:")
    assert image["changes"] == ["CMD " + json.dumps(
        ["python3", "-m", "sglang.launch_server", "--model-path", "/models/toy model",
         "--host", "127.0.0.1", "--port", str(port), *SPEC, "--speculative-disable-batch-"
         "threshold", "16"])]
    assert server_info(port)[FIELD] is None  # the running container keeps its command

    # re-create it from the committed image: the patch and the flag come with it
    engine.cli("rm", "-f", name)
    engine.cli("run", "-d", "--pull=never", "--network", "host", "--name", name, tag)
    wait_healthy(port)
    assert server_info(port)[FIELD] == 16
    st = rc.status(container_host.options())
    assert st["host_state"] == "patched"
    assert st["durability"].startswith("durable")
    assert layer_paths(engine, name) == []
    engine.cli("rm", "-f", name)
    engine.cli("rmi", tag)


def test_auto_travels_into_the_committed_image_and_its_server_reports_auto(container_host):
    engine = container_host.engine
    name, port = container_host.run(*SPEC)
    tag = f"dynspec-test/sglang:auto-{name}"
    out = apply(container_host, threshold="auto", commit_image=tag)
    assert out["restart"]["restarted"] is True
    assert json.loads(out["image"]["changes"][0][len("CMD "):])[-2:] == [
        "--speculative-disable-batch-threshold", "auto"]
    engine.cli("rm", "-f", name)
    engine.cli("run", "-d", "--pull=never", "--network", "host", "--name", name, tag)
    wait_healthy(port)
    assert server_info(port)[FIELD] == "auto"
    st = rc.status(container_host.options())
    assert st["host_state"] == "patched" and st["running_threshold"] == "auto"
    engine.cli("rm", "-f", name)
    engine.cli("rmi", tag)


def test_a_patch_partly_in_the_image_is_not_durable(container_host):
    """An image that carries the v1 patch (--commit-image), then the v2 worker patched in a
    container of it: v2's patch lives only in the container's layer, so the patch as a whole
    is lost when the container is re-created."""
    engine = container_host.engine
    name, port = container_host.run(*SPEC)
    tag = f"dynspec-test/sglang:v1-patched-{name}"
    out = apply(container_host, commit_image=tag)
    assert out["files_changed"] == ["srt/speculative/dynspec_fallback.py",
                                    "srt/server_args.py", "srt/speculative/eagle_worker.py"]
    engine.cli("rm", "-f", name)
    engine.cli("run", "-d", "--pull=never", "--network", "host", "--name", name, tag)
    wait_healthy(port)
    assert rc.status(container_host.options())["durability"].startswith("durable")
    try:
        out = apply(container_host, worker="both")
        assert out["files_changed"] == ["srt/speculative/eagle_worker_v2.py"]
        assert [p for p in layer_paths(engine, name) if p.startswith(PACKAGE)] == [
            f"{PACKAGE}/srt/speculative/eagle_worker_v2.py"]
        st = rc.status(container_host.options())
        assert st["host_state"] == "patched"
        assert st["durability"].startswith("container layer only")
    finally:
        engine.cli("rm", "-f", name)
        engine.cli("rmi", tag)


def test_no_restart_leaves_the_mark_in_the_container_and_the_next_apply_restarts(
        container_host):
    engine = container_host.engine
    name, port = container_host.run(*SPEC)
    first_start = started_at(engine, name)
    out = apply(container_host, no_restart=True)
    assert out["restart"].startswith("pending")
    assert started_at(engine, name) == first_start
    assert "restart-pending.json" in listing(engine, name, STATE)
    st = rc.status(container_host.options())
    assert st["host_state"] == "patched" and st["server_runs"] == "original code"
    assert st["restart_pending"] is not None

    out = apply(container_host)
    assert out["plan"].changes == ()
    assert "a restart was pending" in out["restart"]["why"]
    assert started_at(engine, name) != first_start
    assert FIELD in server_info(port)
    assert "restart-pending.json" not in listing(engine, name, STATE)
    assert "undo" not in listing(engine, name, STATE)


def test_a_second_run_is_refused_while_the_container_restarts(container_host):
    """The lock inside the container dies with its processes on docker restart: the host
    agent's per-container lock covers the restart."""
    import threading
    import time

    engine = container_host.engine
    name, _ = container_host.run(*SPEC, env={"FAKE_SGLANG_STARTUP_DELAY": "4"})
    first_start = started_at(engine, name)
    results: dict[str, object] = {}

    def first() -> None:
        try:
            results["out"] = apply(container_host)
        except Exception as exc:  # reported below
            results["error"] = exc

    thread = threading.Thread(target=first)
    thread.start()
    deadline = time.time() + 30
    while started_at(engine, name) == first_start and time.time() < deadline:
        time.sleep(0.05)
    assert started_at(engine, name) != first_start  # restarted, now in the health gate
    with pytest.raises(RefusedError, match=f"another dynspec-patch run works on container "
                                           f"{engine.inspect(name)['Id'][:12]}"):
        apply(container_host)
    assert rc.status(container_host.options())["run_in_progress"].startswith("pid ")
    thread.join(60)
    assert "error" not in results, results
    assert results["out"]["restart"]["restarted"] is True  # type: ignore[index]
    assert rc.status(container_host.options())["run_in_progress"] is None


def test_restart_cmd_overrides_docker_restart(container_host):
    """A --restart-cmd that re-creates the container (from a commit of it) with the flag."""
    engine = container_host.engine
    name, port = container_host.run(*SPEC)
    old_id = engine.inspect(name)["Id"]
    docker = f"{DOCKER} -H {engine.host}"
    tag = f"dynspec-test/sglang:recreated-{name}"
    argv = shlex.join(server_argv(port, *SPEC, "--speculative-disable-batch-threshold", "16"))
    restart_cmd = (f"{docker} commit {name} {tag} && {docker} rm -f {name} && "
                   f"{docker} run -d --pull=never --network host --name {name} {tag} {argv}")
    out = apply(container_host, threshold=16, restart_cmd=restart_cmd)
    assert out["restart"]["restarted"] is True
    assert out["restart"]["proof"]["checked"] == {FIELD: 16}
    assert engine.inspect(name)["Id"] != old_id
    assert server_info(port)[FIELD] == 16
    st = rc.status(container_host.options())
    assert st["host_state"] == "patched" and st["restart_pending"] is None
    assert st["durability"].startswith("durable")


def test_failed_restart_is_rolled_back_inside_the_container(container_host):
    engine = container_host.engine
    name, port = container_host.run(*SPEC, env={"FAKE_SGLANG_FAIL_IF_PATCHED": "1"})
    original = package_hashes(engine, name)
    with pytest.raises(RollbackError) as err:
        apply(container_host)
    message = str(err.value)
    assert "healthy again" in message
    # one short line: the server's output stays in the container's log, which it names
    assert f"docker logs {name}" in message and "\n" not in message
    logs = engine.cli("logs", name, check=False)
    assert b"FAKE_SGLANG_FAIL_IF_PATCHED" in logs.stdout + logs.stderr
    assert package_hashes(engine, name) == original
    assert "manifest.json" not in listing(engine, name, STATE)
    assert engine.inspect(name)["State"]["Running"] is True
    wait_healthy(port)
    assert FIELD not in server_info(port)


@pytest.fixture
def box(box, monkeypatch):
    """conftest's ``gpu-box`` alias, with the docker.io package's own client."""
    monkeypatch.setenv("DYNSPEC_DOCKER_CLIENT", "/usr/bin/docker")
    return box


def test_containers_without_what_the_tool_needs_are_refused_exit_3(container_host, box, capsys,
                                                                  monkeypatch):
    engine = container_host.engine
    name, _ = container_host.run(*SPEC, extra=("--read-only",))
    original = package_hashes(engine, name)

    code = cli.run(["detect-path", "--host", box, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["container"]["read_only"] is True

    code = cli.run(["apply", "--host", box, "--json"])
    captured = capsys.readouterr()
    assert code == 3, captured
    assert "read-only filesystem" in captured.err
    assert package_hashes(engine, name) == original

    monkeypatch.setenv("DYNSPEC_DOCKER_CLIENT", "/nonexistent/docker")
    code = cli.run(["apply", "--host", box, "--json"])
    captured = capsys.readouterr()
    assert code == 3 and "no docker client on the host" in captured.err
    assert package_hashes(engine, name) == original


def test_a_private_mount_namespace_alone_is_not_a_container(make_host):
    """A systemd unit with PrivateTmp runs in a mount namespace of its own, on the host's
    root: it stays a bare-host server."""
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC, start=False)
    srv.argv = ["unshare", "--mount", "--propagation", "private", "--", *srv.argv]
    srv.start()
    srv.wait_healthy()
    inner = srv.outer()
    assert os.readlink(f"/proc/{inner}/ns/mnt") != os.readlink(f"/proc/{srv.ns_init}/ns/mnt")
    out = rc.detect_path(host.options(), pid=None, port=None)
    assert out["container"] is None
    assert out["servers"][0]["container_id"] is None
    assert out["package_dir"] == str(host.package)
    assert out["release"] == "0.5.10.post1"
