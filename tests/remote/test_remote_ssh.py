"""The SSH layer against the loopback sshd: config resolution, ProxyJump, I/O, sudo, restart-cmd."""

from __future__ import annotations

import shlex
import stat

import pytest
from remote_harness import OP_USER, PLAIN_USER, tree_bytes

from dynspec_patch.patcher import remote_commands as rc
from dynspec_patch.patcher.errors import RollbackError, UsageError
from dynspec_patch.patcher.ssh import Connection, resolve_target

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")


def connect(sshd, user=OP_USER, **kw):
    return Connection(resolve_target("127.0.0.1", port=sshd.port, user=user,
                                     identity_file=str(sshd.client_key),
                                     known_hosts=str(sshd.known_hosts),
                                     ssh_config=str(sshd.base / "ssh_config"), **kw))


def test_large_stdout_and_stderr_do_not_deadlock(sshd):
    with connect(sshd) as conn:
        res = conn.run("head -c 3000000 /dev/zero; head -c 3000000 /dev/zero >&2; exit 7")
    assert (res.status, len(res.stdout), len(res.stderr)) == (7, 3_000_000, 3_000_000)


def test_http_get_reaches_the_remote_loopback(make_host, sshd):
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC)
    with connect(sshd) as conn:
        resp = conn.http_get(srv.port, "/server_info")
    assert resp.status == 200 and resp.json()["port"] == srv.port


def test_ssh_config_alias_and_proxyjump_through_a_second_login(sshd, tmp_path):
    cfg = tmp_path / "config"
    common = (f"  HostName 127.0.0.1\n  Port {sshd.port}\n  IdentityFile {sshd.client_key}\n"
              f"  UserKnownHostsFile {sshd.known_hosts}\n")
    cfg.write_text(f"Host jump\n  User {PLAIN_USER}\n{common}"
                   f"Host gpu-box\n  User {OP_USER}\n  ProxyJump jump\n{common}")
    target = resolve_target("gpu-box", ssh_config=str(cfg))
    assert (target.hostname, target.port, target.user, target.proxy_jump) == (
        "127.0.0.1", sshd.port, OP_USER, "jump")
    with Connection(target) as conn:
        assert conn.run("id -un").stdout.strip() == OP_USER.encode()
        assert conn.stats.connections == 2  # the jump hop and the target through it
    out = rc.status(rc.HostOptions(host="gpu-box", ssh_config=str(cfg)))
    assert out["ssh"]["connections"] == 2
    assert out["login"].startswith(f"{OP_USER}@127.0.0.1")


def test_user_given_twice_differently_is_refused(sshd):
    with pytest.raises(UsageError, match="user given twice"):
        resolve_target(f"root@127.0.0.1:{sshd.port}", user=OP_USER,
                       ssh_config=str(sshd.base / "ssh_config"))


def test_sudo_is_used_only_when_not_root(sshd):
    with connect(sshd, user=OP_USER) as conn:
        hello = conn.agent().hello
    assert (hello["euid"], hello["sudo_user"]) == (0, OP_USER)
    with connect(sshd, user=PLAIN_USER) as conn:
        hello = conn.agent().hello
    assert hello["euid"] != 0 and hello["sudo_user"] is None


def test_plain_user_cannot_restart_a_root_server_without_sudo(make_host, sshd):
    host = make_host("0.5.10.post1")
    host.server(*SPEC)
    out = rc.detect_path(host.options(user=PLAIN_USER), pid=None, port=None)
    assert out["live_worker"] == "v1"  # /server_info needs no privileges
    assert "unreadable" in out["servers"][0]["environment"]


def _restart_script(host, srv, pidfile, extra: list[str]) -> str:
    env = " ".join(shlex.quote(f"{k}={v}") for k, v in srv.env.items())
    argv = " ".join(shlex.quote(a) for a in [*srv.argv, *extra])
    script = host.root / "restart it.sh"
    script.write_text(
        "#!/bin/sh\n"
        f'kill "$(cat {shlex.quote(str(pidfile))})" 2>/dev/null || true\n'
        "sleep 0.5\n"
        f"cd {shlex.quote(str(srv.cwd))} || exit 1\n"
        f"env -i {env} setsid {argv} >> {shlex.quote(str(srv.log))} 2>&1 < /dev/null &\n"
        f"echo $! > {shlex.quote(str(pidfile))}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return shlex.quote(str(script))


def test_restart_cmd_is_used_and_proven(make_host):
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC)
    pidfile = host.root / "pid"
    pidfile.write_text(str(srv.pid))
    cmd = _restart_script(host, srv, pidfile, ["--speculative-disable-batch-threshold", "32"])
    out = rc.apply(host.options(), threshold=32, worker="auto", dry_run=False, no_restart=False,
                   restart_cmd=cmd, pid=None, port=None, health_timeout=30.0)
    assert out["restart"]["restarted"] is True
    assert srv.info()["speculative_disable_batch_threshold"] == 32


def test_restart_cmd_that_does_not_pass_the_flag_is_rolled_back(make_host):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    srv = host.server(*SPEC)
    pidfile = host.root / "pid"
    pidfile.write_text(str(srv.pid))
    cmd = _restart_script(host, srv, pidfile, [])
    with pytest.raises(RollbackError, match="does not report the patch"):
        rc.apply(host.options(), threshold=32, worker="auto", dry_run=False, no_restart=False,
                 restart_cmd=cmd, pid=None, port=None, health_timeout=30.0, stop_timeout=5.0)
    assert tree_bytes(host.package) == original
    assert "speculative_disable_batch_threshold" not in srv.info()


def test_root_login_runs_the_agent_without_sudo(sshd):
    with connect(sshd, user="root") as conn:
        hello = conn.agent().hello
    assert (hello["euid"], hello["sudo_user"]) == (0, None)
