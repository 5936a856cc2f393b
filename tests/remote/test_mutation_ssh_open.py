"""``Connection.open`` against the loopback sshd: each login option it hands paramiko is seen to
matter (mutants of ``patcher.ssh`` that the host-key tests left alive: see tools/mutation.py).

Every test logs in with an ``SshTarget`` made here (no ssh_config), from an empty HOME and with
no SSH_AUTH_SOCK, so the only keys, agents and known_hosts in play are the ones it names.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
from remote_harness import OP_USER, make_login_keys

from dynspec_patch.patcher import ssh
from dynspec_patch.patcher.errors import UsageError

# a ProxyCommand: relays its stdin/stdout to 127.0.0.1:PORT
RELAY = """
import os, socket, sys, threading
link = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def upstream():
    while data := os.read(0, 65536):
        link.sendall(data)
    link.shutdown(socket.SHUT_WR)
threading.Thread(target=upstream, daemon=True).start()
while data := link.recv(65536):
    os.write(1, data)
"""


@pytest.fixture(scope="module")
def keys(sshd, tmp_path_factory) -> Iterator[dict[str, Path]]:
    """A stranger's key, a key only an ssh-agent holds, and an OpenSSH user certificate (under a
    name paramiko does not try by itself) whose CA the account trusts."""
    login = make_login_keys(sshd, tmp_path_factory.mktemp("open"), "open")
    yield {"stranger": login.stranger, "agent": login.agent_sock, "cert_key": login.cert_key,
           "certificate": login.certificate}
    login.stop()


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch) -> Path:
    """An empty HOME (paramiko's default keys live in ~/.ssh) and no agent in the environment."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home


def target(sshd, **fields) -> ssh.SshTarget:
    values = {"alias": "box", "hostname": "127.0.0.1", "port": sshd.port, "user": OP_USER,
              "identity_files": (str(sshd.client_key),), "known_hosts": (str(sshd.known_hosts),),
              **fields}
    return ssh.SshTarget(**values)


def login_name(t: ssh.SshTarget, **kw) -> str:
    with ssh.Connection(t, **kw) as conn:
        return conn.run("id -un").check("id").stdout.decode().strip()


def test_the_login_uses_the_target_s_user_timeouts_and_keepalive(sshd, monkeypatch):
    given: list[dict] = []
    keepalives: list[int] = []
    real_connect, real_keepalive = paramiko.SSHClient.connect, paramiko.Transport.set_keepalive

    def connect(client, hostname, **kw):
        given.append(kw)
        return real_connect(client, hostname, **kw)

    def set_keepalive(transport, interval):
        keepalives.append(interval)
        return real_keepalive(transport, interval)

    monkeypatch.setattr(paramiko.SSHClient, "connect", connect)
    monkeypatch.setattr(paramiko.Transport, "set_keepalive", set_keepalive)
    before = time.perf_counter()
    with ssh.Connection(target(sshd, connect_timeout=7.5, keepalive=3)) as conn:
        assert conn.run("id -un").stdout.decode().strip() == OP_USER
        elapsed = time.perf_counter() - before
        conn.open()  # already open: nothing happens
        assert conn.stats.connections == 1
        [(step, seconds)] = conn.stats.seconds
    assert step == "connect box" and 0 < seconds < elapsed
    [kw] = given
    assert {name: kw[name] for name in ("timeout", "banner_timeout", "auth_timeout",
                                        "channel_timeout")} == dict.fromkeys(
        ("timeout", "banner_timeout", "auth_timeout", "channel_timeout"), 7.5)
    assert keepalives == [3]


def test_without_identity_files_the_keys_in_home_are_tried(sshd, home):
    shutil.copy(sshd.client_key, home / ".ssh" / "id_ed25519")
    assert login_name(target(sshd, identity_files=())) == OP_USER


def test_identity_files_replace_the_keys_in_home(sshd, home, keys):
    shutil.copy(sshd.client_key, home / ".ssh" / "id_ed25519")
    with pytest.raises(ssh.ConnectError) as refused:
        login_name(target(sshd, identity_files=(str(keys["stranger"]),)))
    assert str(refused.value).startswith(f"authentication to {OP_USER}@box failed: ")
    (home / ".ssh" / "id_ed25519").unlink()
    assert login_name(target(sshd)) == OP_USER  # the named key alone


def test_identity_agent_is_asked_for_keys(sshd, keys):
    assert login_name(target(sshd, identity_files=(), identity_agent=str(keys["agent"]))) \
        == OP_USER
    assert "SSH_AUTH_SOCK" not in os.environ  # put back as it was


def test_identity_agent_none_ignores_the_environment_s_agent(sshd, keys, monkeypatch):
    monkeypatch.setenv("SSH_AUTH_SOCK", str(keys["agent"]))
    assert login_name(target(sshd, identity_files=())) == OP_USER  # the agent alone logs in
    with pytest.raises(ssh.ConnectError):
        login_name(target(sshd, identity_files=(), identity_agent="none"))


def test_identities_only_leaves_the_agent_out(sshd, keys):
    agent_and_stranger = {"identity_files": (str(keys["stranger"]),),
                          "identity_agent": str(keys["agent"])}
    assert login_name(target(sshd, **agent_and_stranger)) == OP_USER
    with pytest.raises(ssh.ConnectError, match=r"authentication to .* failed"):
        login_name(target(sshd, **agent_and_stranger, identities_only=True))


def test_a_certificate_file_signs_the_identity(sshd, keys):
    certified = target(sshd, identity_files=(str(keys["cert_key"]),))
    with pytest.raises(ssh.ConnectError, match=r"authentication to .* failed"):
        login_name(certified)  # the bare key is not authorized
    assert login_name(ssh.SshTarget(**{**certified.__dict__, "certificate_files": (
        str(keys["certificate"]),)})) == OP_USER


def test_the_proxy_command_carries_the_login(sshd, tmp_path):
    # sshd listens on 127.0.0.1 only: 127.0.0.2 is reached through the relay or not at all
    relay = tmp_path / "relay.py"
    relay.write_text(RELAY)
    known = tmp_path / "known_hosts"
    known.write_text(sshd.known_hosts.read_text().replace("[127.0.0.1]", "[127.0.0.2]"))
    proxied = target(sshd, hostname="127.0.0.2", known_hosts=(str(known),),
                     proxy_command=f"{sys.executable} {relay} {sshd.port}")
    assert login_name(proxied) == OP_USER
    with pytest.raises(ssh.ConnectError, match=r"cannot reach 127\.0\.0\.2"):
        login_name(ssh.SshTarget(**{**proxied.__dict__, "proxy_command": None}))


def test_global_known_hosts_are_read_and_a_broken_one_is_skipped(sshd, tmp_path):
    empty, broken = tmp_path / "empty", tmp_path / "broken"
    empty.write_text("")
    broken.write_text("[127.0.0.1]:22 ssh-ed25519 !!not-base64!!\n")
    global_files = (str(tmp_path / "missing"), str(broken), str(sshd.known_hosts))
    assert login_name(target(sshd, known_hosts=(str(empty),),
                             global_known_hosts=global_files)) == OP_USER
    with pytest.raises(ssh.HostKeyError, match="not in known_hosts"):
        login_name(target(sshd, known_hosts=(str(empty),), global_known_hosts=global_files[:2]))


@pytest.mark.parametrize("content", [None, b"\xff\xfe not text\n"])
def test_an_unreadable_known_hosts_is_one_clear_refusal(sshd, tmp_path, content):
    known = tmp_path / "known_hosts"
    if content is None:
        known.mkdir()
    else:
        known.write_bytes(content)
    with pytest.raises(UsageError) as refused:
        login_name(target(sshd, known_hosts=(str(known),)))
    assert str(refused.value).startswith(f"cannot read known_hosts {known}: ")


def test_a_known_hosts_line_that_does_not_parse_is_skipped_as_openssh_does(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    bad = f"[127.0.0.1]:{sshd.port} ssh-ed25519 !!not-base64!!\n"
    known.write_text(bad + "gpu9 ssh-ed25519\n" + sshd.known_hosts.read_text())
    assert login_name(target(sshd, known_hosts=(str(known),))) == OP_USER
    known.write_text(bad)  # nothing else there: the host is unknown, not the file unreadable
    with pytest.raises(ssh.HostKeyError, match="not in known_hosts"):
        login_name(target(sshd, known_hosts=(str(known),)))


def test_accept_new_writes_a_hashed_entry_into_the_first_known_hosts(sshd, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_text("")
    second.write_text("")
    accepting = target(sshd, known_hosts=(str(first), str(second)), hash_known_hosts=True)
    assert login_name(accepting, accept_new_host_key=True) == OP_USER
    assert second.read_text() == ""
    line = first.read_text()
    assert line.startswith("|1|") and "127.0.0.1" not in line
    assert line.split()[1:] == sshd.host_pub.split()
    assert login_name(accepting) == OP_USER  # known from then on


def test_a_changed_host_key_is_refused_by_name(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    other = paramiko.Ed25519Key.from_private_key_file(str(sshd.client_key))
    known.write_text(f"[127.0.0.1]:{sshd.port} ssh-ed25519 {other.get_base64()}\n")
    with pytest.raises(ssh.HostKeyError) as refused:
        login_name(target(sshd, known_hosts=(str(known),)), accept_new_host_key=True)
    assert str(refused.value) == ("host key of box CHANGED (got ssh-ed25519, known_hosts has "
                                  "another key): refusing to connect")


def test_a_peer_that_is_no_ssh_server_is_a_connect_error(sshd):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def hang_up() -> None:
            peer, _ = listener.accept()
            peer.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
            peer.close()

        threading.Thread(target=hang_up, daemon=True).start()
        with pytest.raises(ssh.ConnectError) as failed:
            login_name(target(sshd, port=listener.getsockname()[1], connect_timeout=5))
    assert str(failed.value).startswith("cannot connect to box: ")
