"""A server that listens on one address that is not 127.0.0.1 (issue 13, 2d): every check,
on the host and through the SSH tunnel, reaches it at the address it listens on, and paramiko
never prints its own ``Secsh channel N open FAILED`` lines on stderr."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

from remote_harness import free_port

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")
ADDRESS = "127.0.0.2"  # loopback, but not where a check aimed at 127.0.0.1 finds it


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI in its own process: stderr is what a user (or Ansible) sees."""
    return subprocess.run([sys.executable, "-m", "dynspec_patch.patcher.cli", *argv],
                          capture_output=True, text=True, timeout=300)


def test_apply_proves_a_server_bound_to_one_address_through_the_tunnel(make_host, box):
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC, "--host", ADDRESS, env={"SGLANG_ENABLE_SPEC_V2": "1"})
    assert srv.get("/health")[0] == 200
    with socket.socket() as probe:  # and nothing answers on 127.0.0.1
        assert probe.connect_ex(("127.0.0.1", srv.port)) != 0

    done = cli("apply", "--host", box, "--threshold", "16", "--health-timeout", "30", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["live_worker"] == "v2"  # its /server_info was read at ADDRESS
    assert out["restart"]["restarted"] is True
    assert out["restart"]["verified_through_ssh_tunnel"] is True
    assert "Secsh" not in done.stderr and "open FAILED" not in done.stderr, done.stderr
    assert srv.info()["speculative_disable_batch_threshold"] == 16

    done = cli("status", "--host", box)
    assert done.returncode == 0 and "Secsh" not in done.stderr, done.stderr


def test_a_refused_tunnel_is_our_one_line_not_paramiko_logging(sshd):
    """``Connection.http_get`` to a port nothing listens on: a RemoteError, and stderr empty
    (paramiko logs the refused channel at ERROR, which Python would print by itself)."""
    script = textwrap.dedent(f"""
        from dynspec_patch.patcher.ssh import Connection, RemoteError, resolve_target
        target = resolve_target("127.0.0.1", port={sshd.port}, user="root",
                                identity_file={str(sshd.client_key)!r},
                                known_hosts={str(sshd.known_hosts)!r},
                                ssh_config={str(sshd.base / "ssh_config")!r})
        with Connection(target) as conn:
            try:
                conn.http_get({free_port()}, "/health")
            except RemoteError as exc:
                print("refused:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: cannot open 127.0.0.1:")
    assert done.stderr == ""
