"""Faults injected into apply: the host ends up original or fully patched, and status says which."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import time
from pathlib import Path

import pytest
from remote_harness import tree_bytes

from dynspec_patch.patcher import remote_commands as rc
from dynspec_patch.patcher.deploy import Faults
from dynspec_patch.patcher.errors import DynspecError
from dynspec_patch.patcher.manifest import sha256_or_none

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")


def apply(host, faults=None, **kw):
    args = {"threshold": 32, "worker": "auto", "dry_run": False, "no_restart": False,
            "restart_cmd": None, "pid": None, "port": None, "health_timeout": 30.0,
            "stop_timeout": 5.0}
    args.update(kw)
    return rc.apply(host.options(), faults=faults, **args)


def wait_lock_free(state: Path, timeout: float = 60) -> None:
    """The agent of a dropped connection finishes its step, then exits and drops the flock."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        fd = os.open(state / "lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.05)
        finally:
            os.close(fd)
    raise AssertionError("the remote agent never released the lock")


def sig_ign(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return status.split("SigIgn:")[1].split()[0]


def no_debris(host) -> list[str]:
    return [str(p) for p in host.package.rglob("*.dynspec-*.tmp")]


def assert_fully_patched(host) -> None:
    manifest = json.loads((host.state / "manifest.json").read_bytes())
    for record in manifest["files"]:
        data = (host.package / record["path"]).read_bytes()
        assert sha256_or_none(data) == record["sha256_after"], record["path"]
    assert not (host.state / "journal.json").exists()


@pytest.mark.parametrize("step", ["facts", "stage-sent", "staged"])
def test_connection_dropped_before_commit_leaves_the_host_original(make_host, step):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    srv = host.server(*SPEC)
    with pytest.raises(DynspecError):
        apply(host, Faults(drop_connection_after=step))
    wait_lock_free(host.state)
    assert tree_bytes(host.package) == original
    assert no_debris(host) == []
    st = rc.status(host.options())
    assert st["host_state"] == "original"
    assert st["restart_pending"] is None
    assert srv.get("/health")[0] == 200
    # and a clean run afterwards goes all the way
    out = apply(host)
    assert out["restart"]["restarted"] is True
    assert_fully_patched(host)


@pytest.mark.parametrize("step", ["commit-sent", "committed"])
def test_connection_dropped_after_commit_leaves_it_patched_with_restart_pending(make_host, step):
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC)
    with pytest.raises(DynspecError):
        apply(host, Faults(drop_connection_after=step))
    wait_lock_free(host.state)
    assert_fully_patched(host)
    assert no_debris(host) == []
    st = rc.status(host.options())
    assert st["host_state"] == "patched"
    assert st["restart_pending"] is not None
    assert st["server_runs"] == "original code"
    out = apply(host)  # finishes the job: no file changes, the pending restart happens
    assert out["plan"].changes == ()
    assert out["restart"]["restarted"] is True
    assert srv.info()["speculative_disable_batch_threshold"] == 32


def test_connection_dropped_during_restart_the_host_finishes_it(make_host):
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC)
    with pytest.raises(DynspecError):
        apply(host, Faults(drop_connection_after="restart-sent"))
    wait_lock_free(host.state)
    assert_fully_patched(host)
    st = rc.status(host.options())
    assert st["host_state"] == "patched"
    assert st["restart_pending"] is None
    assert st["server_runs"] == "patched code"
    assert srv.info()["speculative_disable_batch_threshold"] == 32


def test_connection_dropped_during_a_failing_restart_still_rolls_back(make_host):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    srv = host.server(*SPEC, env={"FAKE_SGLANG_FAIL_IF_PATCHED": "1"})
    with pytest.raises(DynspecError):
        apply(host, Faults(drop_connection_after="restart-sent"))
    wait_lock_free(host.state)
    assert tree_bytes(host.package) == original
    st = rc.status(host.options())
    assert st["host_state"] == "original"
    assert st["server_runs"] == "original code"
    assert srv.get("/health")[0] == 200


def test_agent_killed_between_two_renames_is_recovered_by_the_next_run(make_host):
    host = make_host("0.5.10.post1")
    host.server(*SPEC)
    with pytest.raises(DynspecError, match="agent stopped"):
        apply(host, Faults(agent="die-mid-commit"))
    wait_lock_free(host.state)
    st = rc.status(host.options())
    assert st["interrupted_commit"] is True
    assert st["host_state"] == "mixed"
    out = apply(host)
    assert out["recovered_interrupted_commit"]["action"] == "rolled-forward"
    assert out["restart"]["restarted"] is True
    assert_fully_patched(host)
    assert no_debris(host) == []
    assert rc.status(host.options())["host_state"] == "patched"


def test_relaunch_keeps_hostile_argv_env_and_cwd(make_host):
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC, "--served-model-name", "it's \"quoted\" $(touch pwned) `x`")
    before = srv.info()
    ignored_before = sig_ign(srv.outer())
    out = apply(host)
    after = srv.info()
    # no SIGHUP-ignore leaks from the agent into the relaunched server
    assert sig_ign(srv.outer(after["fake_pid"])) == ignored_before
    assert after["fake_pid"] == out["restart"]["pid"] != before["fake_pid"]
    assert after["fake_cwd"] == before["fake_cwd"] == str(srv.cwd)
    assert after["fake_env_tag"] == "a;b $(x) 'q'"
    assert after["fake_argv"] == [*before["fake_argv"],
                                  "--speculative-disable-batch-threshold", "32"]


def test_restart_waits_until_nvidia_smi_no_longer_lists_the_old_server(make_host):
    host = make_host("0.5.10.post1")
    bin_dir = host.root / "fake bin"
    bin_dir.mkdir()
    counter = host.root / "smi-calls"
    smi = bin_dir / "nvidia-smi"
    srv = host.server(*SPEC, env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, start=False)
    srv.start()
    srv.wait_healthy()
    # lists the old server's pid as a GPU user for its first three calls, then frees it
    c = shlex.quote(str(counter))
    smi.write_text(f"""#!/bin/sh
n=$(cat {c} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {c}
[ $n -le 3 ] && echo {srv.pid}
exit 0
""")
    smi.chmod(0o755)
    out = apply(host)
    assert out["restart"]["gpu_memory"] == "free"
    assert int(counter.read_text()) == 4
