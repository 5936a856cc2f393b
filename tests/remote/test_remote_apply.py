"""apply / revert / status / detect-path against a real sshd on 127.0.0.1 and a fake server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from remote_harness import OP_USER, PLAIN_USER, tree_bytes

from dynspec_patch.patcher import remote_commands as rc
from dynspec_patch.patcher.errors import RefusedError, RollbackError, UsageError

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")


def apply(host, **kw):
    args = {"threshold": 32, "worker": "auto", "dry_run": False, "no_restart": False,
            "restart_cmd": None, "pid": None, "port": None, "health_timeout": 30.0,
            "stop_timeout": 5.0}
    args.update(kw)
    opts = args.pop("opts", None) or host.options()
    return rc.apply(opts, **args)


def revert(host, **kw):
    args = {"dry_run": False, "force": False, "no_restart": False, "restart_cmd": None,
            "pid": None, "port": None, "health_timeout": 30.0, "stop_timeout": 5.0}
    args.update(kw)
    return rc.revert(host.options(), **args)


def files_of(plan, action):
    return sorted(f.path for f in plan.files if f.action == action)


def test_live_worker_comes_from_reported_args_not_the_command_line(make_host):
    # 0.5.10.post1: SGLANG_ENABLE_SPEC_V2=1 forces overlap ON even with --disable-overlap-schedule
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC, "--disable-overlap-schedule", env={"SGLANG_ENABLE_SPEC_V2": "1"})
    assert srv.info()["disable_overlap_schedule"] is False
    out = rc.detect_path(host.options(), pid=None, port=None)
    assert out["live_worker"] == "v2"
    assert out["live_worker_source"] == "/server_info"
    assert out["disable_overlap_schedule"] is False
    assert out["release"] == "0.5.10.post1"
    assert out["server_pid"] == srv.pid
    # and the same command line without the env var runs v1 (the reported value flips)
    host.stop_servers()
    host2 = make_host("0.5.10.post1")
    host2.server(*SPEC, "--disable-overlap-schedule")
    assert rc.detect_path(host2.options(), pid=None, port=None)["live_worker"] == "v1"


def test_apply_restarts_proves_and_second_apply_is_a_noop(make_host):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    srv = host.server(*SPEC, env={"SGLANG_ENABLE_SPEC_V2": "1"})
    out = apply(host)
    plan = out["plan"]
    assert out["live_worker"] == "v2"
    assert "srt/speculative/eagle_worker_v2.py" in files_of(plan, "patched")
    assert "srt/speculative/eagle_worker.py" in files_of(plan, "skipped")
    assert out["restart"]["restarted"] is True
    assert out["restart"]["proof"]["checked"] == {"speculative_disable_batch_threshold": 32}
    assert out["restart"]["verified_through_ssh_tunnel"] is True
    new_pid = out["restart"]["pid"]
    assert new_pid != srv.pid
    info = srv.info()
    assert info["speculative_disable_batch_threshold"] == 32
    assert info["disable_overlap_schedule"] is False  # env survived the relaunch
    manifest = json.loads((host.state / "manifest.json").read_bytes())
    assert {f["path"] for f in manifest["files"]} == set(out["files_changed"])
    assert not (host.state / "restart-pending.json").exists()
    patched = tree_bytes(host.package)
    assert patched != original

    again = apply(host)
    assert again["plan"].changes == ()
    assert again["restart"].startswith("not needed")
    assert again["server_pid"] == new_pid
    assert tree_bytes(host.package) == patched
    assert again["ssh"]["connections"] == 1

    back = revert(host)
    assert back["restart"]["restarted"] is True
    assert tree_bytes(host.package) == original
    assert "speculative_disable_batch_threshold" not in srv.info()
    assert not (host.state / "manifest.json").exists()
    st = rc.status(host.options())
    assert st["host_state"] == "original"
    assert st["server_runs"] == "original code"


def test_no_restart_leaves_a_pending_mark_that_status_shows(make_host):
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC)
    out = apply(host, no_restart=True)
    assert out["restart"].startswith("pending")
    st = rc.status(host.options())
    assert st["host_state"] == "patched"
    assert st["restart_pending"] is not None
    assert st["server_runs"] == "original code"
    assert st["server_pid"] == srv.pid
    # the next apply changes no file but performs the pending restart
    out2 = apply(host)
    assert out2["plan"].changes == ()
    assert out2["restart"]["restarted"] is True
    assert "a restart was pending" in out2["restart"]["why"]
    assert rc.status(host.options())["restart_pending"] is None


def test_restart_failure_rolls_back_and_the_original_server_is_healthy(make_host):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    srv = host.server(*SPEC, env={"FAKE_SGLANG_FAIL_IF_PATCHED": "1"})
    with pytest.raises(RollbackError) as err:
        apply(host)
    assert "healthy again" in str(err.value)
    assert tree_bytes(host.package) == original
    info = srv.info()
    assert "speculative_disable_batch_threshold" not in info
    st = rc.status(host.options())
    assert st["host_state"] == "original"
    assert st["restart_pending"] is None
    assert st["server_runs"] == "original code"


def test_unhealthy_patched_server_times_out_and_rolls_back(make_host):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    srv = host.server(*SPEC, env={"FAKE_SGLANG_UNHEALTHY_IF_PATCHED": "1"})
    with pytest.raises(RollbackError, match="not healthy within"):
        apply(host, health_timeout=2.0)
    assert tree_bytes(host.package) == original
    assert srv.get("/health")[0] == 200


def test_stubborn_process_tree_is_killed(make_host):
    host = make_host("0.5.10.post1")
    host.server(*SPEC, env={"FAKE_SGLANG_IGNORE_TERM": "1", "FAKE_SGLANG_CHILD": "1"})
    out = apply(host)
    assert out["restart"]["restarted"] is True


def test_revert_refuses_a_file_edited_after_apply_unless_forced(make_host):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    host.server(*SPEC)
    apply(host, no_restart=True)
    target = host.package / "srt/server_args.py"
    target.write_bytes(target.read_bytes() + b"\n# hot-fix by an operator\n")
    edited = tree_bytes(host.package)
    out = revert(host, no_restart=True)
    assert out["plan"].refused
    assert tree_bytes(host.package) == edited
    forced = revert(host, force=True, no_restart=True)
    assert not forced["plan"].refused
    assert tree_bytes(host.package) != edited
    del original


def test_concurrent_apply_is_refused(make_host):
    from dynspec_patch.patcher import deploy
    from dynspec_patch.patcher.ssh import resolve_target

    host = make_host("0.5.10.post1")
    host.server(*SPEC)
    o = host.options()
    target = resolve_target(o.host, port=o.port, user=o.user, identity_file=o.identity_file,
                            known_hosts=o.known_hosts, ssh_config=o.ssh_config)
    with deploy.session(target, accept_new_host_key=False) as first:
        from dynspec_patch.patcher.facts import gather

        gather(first.agent, pid=None, port=None, lock=True)
        before = tree_bytes(host.package)
        with pytest.raises(RefusedError, match="holds"):
            apply(host)
        assert tree_bytes(host.package) == before
        assert "pid" in rc.status(host.options())["run_in_progress"]
    # the lock dies with its holder: the next run goes through
    assert apply(host, no_restart=True)["restart"].startswith("pending")


def test_unknown_host_key_is_refused_and_accept_new_only_adds_absent_hosts(make_host, tmp_path):
    host = make_host("0.5.10.post1")
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    opts = rc.HostOptions(host="127.0.0.1", port=host.sshd.port, user=OP_USER,
                          identity_file=str(host.sshd.client_key), known_hosts=str(empty),
                          ssh_config=host.options().ssh_config)
    with pytest.raises(RefusedError, match="not in known_hosts"):
        rc.status(opts)
    assert empty.read_text() == ""
    accepted = rc.HostOptions(**{**opts.__dict__, "accept_new_host_key": True})
    rc.status(accepted)
    assert host.sshd.host_pub.split()[1] in empty.read_text()
    rc.status(opts)  # now known
    # a CHANGED key is refused even with accept_new_host_key
    empty.write_text(f"[127.0.0.1]:{host.sshd.port} ssh-ed25519 "
                     "AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n")
    with pytest.raises(RefusedError, match="CHANGED"):
        rc.status(accepted)


def test_several_servers_need_pid_or_port(make_host):
    host = make_host("0.5.10.post1")
    a = host.server(*SPEC)
    b = host.server(*SPEC)
    with pytest.raises(UsageError, match="several"):
        rc.detect_path(host.options(), pid=None, port=None)
    assert rc.detect_path(host.options(), pid=None, port=b.port)["server_pid"] == b.pid
    assert rc.detect_path(host.options(), pid=a.pid, port=None)["server_pid"] == a.pid


def test_no_server_is_reported(make_host):
    host = make_host("0.5.10.post1")
    out = rc.detect_path(host.options(), pid=None, port=None)
    assert out["servers"] == [] and out["live_worker"] == "none"
    with pytest.raises(RefusedError, match="no running SGLang server"):
        apply(host)


def test_old_release_serves_only_get_server_info(make_host):
    host = make_host("0.4.6.post5")
    host.server(*SPEC)
    out = rc.detect_path(host.options(), pid=None, port=None)
    assert out["live_worker"] == "v1"
    assert out["live_worker_source"] == "/get_server_info"
    res = apply(host)
    assert res["restart"]["proof"]["endpoint"] == "/get_server_info"


def test_log_line_then_argv_fallbacks(make_host):
    host = make_host("0.5.10.post1")
    host.server(*SPEC, env={"FAKE_SGLANG_NO_INFO": "1", "SGLANG_ENABLE_SPEC_V2": "1"})
    out = rc.detect_path(host.options(), pid=None, port=None)
    assert out["live_worker_source"].startswith("log:")
    assert out["live_worker"] == "v2"


def test_native_route_writes_config_and_flags(make_host):
    host = make_host("0.5.16")
    srv = host.server(*SPEC)
    out = apply(host, threshold=48, route="native")
    assert out["plan"].route == "native"
    assert out["restart"]["restarted"] is True
    info = srv.info()
    assert info["speculative_adaptive"] is True
    cfg = json.loads((host.state / "dynspec-adaptive.json").read_text())
    assert cfg["49"] == {"candidate_steps": [0]}
    assert rc.status(host.options())["plan"].route == "native"  # the route the host is on
    again = apply(host, threshold=48, route="native")
    assert again["restart"].startswith("not needed")
    back = revert(host)
    assert back["restart"]["restarted"] is True
    assert not (host.state / "dynspec-adaptive.json").exists()
    assert srv.info()["speculative_adaptive"] is False


def test_plain_user_without_sudo_patches_its_own_venv(make_host):
    host = make_host("0.5.10.post1", owner=PLAIN_USER)
    host.server(*SPEC, user=PLAIN_USER)
    out = apply(host, opts=host.options(user=PLAIN_USER))
    assert out["sudo"] is False and out["remote_user"] == PLAIN_USER
    assert out["restart"]["restarted"] is True
    assert (host.state / "manifest.json").stat().st_uid != 0


def test_dry_run_writes_nothing(make_host):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    srv = host.server(*SPEC)
    out = apply(host, dry_run=True)
    assert out["plan"].changes
    assert "--speculative-disable-batch-threshold" in out["would_run"]
    assert tree_bytes(host.package) == original
    assert not host.state.exists() or not any(host.state.iterdir())
    assert srv.get("/health")[0] == 200


def test_argv_and_env_are_the_last_fallback(make_host):
    host = make_host("0.5.10.post1")
    host.server(*SPEC, "--disable-overlap-schedule",
                env={"FAKE_SGLANG_NO_INFO": "1", "FAKE_SGLANG_NO_LOG_LINE": "1",
                     "SGLANG_ENABLE_SPEC_V2": "yes"})
    out = rc.detect_path(host.options(), pid=None, port=None)
    assert out["live_worker_source"] == "argv+env"
    assert out["live_worker"] == "v2"  # 0.5.10: the env var beats the flag
    assert any("SGLANG_ENABLE_SPEC_V2='yes'" in e for e in out["live_worker_evidence"])


def test_sudo_agent_relaunches_the_server_as_its_own_user(make_host):
    import pwd

    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC, user=PLAIN_USER)
    out = apply(host)  # login dsp-op, agent root through sudo -n
    assert out["sudo"] is True
    new_pid = out["restart"]["pid"]
    status = Path(f"/proc/{srv.outer(new_pid)}/status").read_text()
    uid = int(status.split("Uid:")[1].split()[0])
    assert uid == pwd.getpwnam(PLAIN_USER).pw_uid
    assert srv.info()["speculative_disable_batch_threshold"] == 32


def test_a_new_threshold_restarts_without_touching_files(make_host):
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC)
    apply(host)
    patched = tree_bytes(host.package)
    out = apply(host, threshold=64)
    assert out["plan"].changes == ()
    assert out["restart"]["restarted"] is True
    assert srv.info()["speculative_disable_batch_threshold"] == 64
    assert srv.info()["fake_argv"].count("--speculative-disable-batch-threshold") == 1
    assert tree_bytes(host.package) == patched


def test_api_key_is_used_for_server_info_and_never_printed(make_host):
    host = make_host("0.5.10.post1")
    host.server(*SPEC, "--api-key", "s3cret-key")
    out = apply(host, dry_run=True)
    assert "s3cret-key" not in json.dumps({k: v for k, v in out.items() if k != "plan"})
    assert out["live_worker_source"] == "/server_info"


def test_login_without_sudo_on_a_root_server_is_refused_before_writing(make_host):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    host.server(*SPEC)
    with pytest.raises(RefusedError, match="nothing was written"):
        apply(host, opts=host.options(user=PLAIN_USER))
    assert tree_bytes(host.package) == original
    assert not host.state.exists()


def test_sglang_serve_entrypoint_is_found_and_relaunched(make_host):
    host = make_host("0.5.10.post1")
    script = host.venv / "bin" / "sglang"
    script.write_text("import runpy, sys\n"
                      "assert sys.argv[1] == 'serve'\n"
                      "sys.argv = [sys.argv[0], *sys.argv[2:]]\n"
                      "runpy.run_module('sglang.launch_server', run_name='__main__')\n")
    srv = host.server(*SPEC, start=False)
    srv.argv = [srv.argv[0], str(script), "serve", *srv.argv[3:]]
    srv.start()
    srv.wait_healthy()
    out = apply(host)
    assert out["server_pid"] == srv.pid
    assert out["restart"]["restarted"] is True
    info = srv.info()
    assert info["speculative_disable_batch_threshold"] == 32
    new_argv = Path(f"/proc/{srv.outer(info['fake_pid'])}/cmdline").read_bytes().split(b"\0")
    assert new_argv[1:3] == [str(script).encode(), b"serve"]
