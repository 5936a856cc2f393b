"""The host-key policies on paramiko's own objects, without a server (mutants of
``patcher.ssh`` that the sshd tests left alive: see tools/mutation.py)."""

from __future__ import annotations

import stat
from pathlib import Path

import paramiko
import pytest

from dynspec_patch.patcher import ssh
from dynspec_patch.patcher.errors import RefusedError


@pytest.fixture(scope="module")
def key() -> paramiko.PKey:
    return paramiko.ECDSAKey.generate()


def test_known_hosts_names_a_non_default_port_in_brackets():
    assert ssh._known_hosts_name("gpu1", 22) == "gpu1"
    assert ssh._known_hosts_name("10.0.0.1", 2222) == "[10.0.0.1]:2222"


def test_accept_new_records_the_key_in_a_private_directory(tmp_path: Path, key):
    path = tmp_path / "new" / "ssh" / "known_hosts"
    client = paramiko.SSHClient()
    ssh._AcceptNewPolicy(str(path)).missing_host_key(client, "[127.0.0.1]:2200", key)
    assert path.read_text() == f"[127.0.0.1]:2200 {key.get_name()} {key.get_base64()}\n"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert client.get_host_keys().lookup("[127.0.0.1]:2200")[key.get_name()] == key
    ssh._AcceptNewPolicy(str(path)).missing_host_key(client, "gpu2", key)
    assert path.read_text().splitlines()[1] == f"gpu2 {key.get_name()} {key.get_base64()}"
    # and OpenSSH's own parser reads what was written
    known = paramiko.HostKeys(str(path))
    assert known.lookup("gpu2")[key.get_name()] == key


def test_accept_new_hashes_the_name_when_known_hosts_are_hashed(tmp_path: Path, key):
    path = tmp_path / "known_hosts"
    ssh._AcceptNewPolicy(str(path), hashed=True).missing_host_key(
        paramiko.SSHClient(), "gpu3", key)
    line = path.read_text()
    assert line.startswith("|1|") and "gpu3" not in line
    assert paramiko.HostKeys(str(path)).lookup("gpu3")[key.get_name()] == key


def test_reject_names_the_host_its_key_and_the_way_to_accept(key):
    with pytest.raises(RefusedError) as refused:
        ssh._RejectPolicy().missing_host_key(paramiko.SSHClient(), "gpu4", key)
    assert isinstance(refused.value, ssh.HostKeyError)
    assert str(refused.value) == (
        f"host key of gpu4 is not in known_hosts ({key.get_name()} {key.fingerprint}); verify "
        "it and add it, or pass --accept-new-host-key")


def test_reject_ends_with_the_callers_own_way_to_accept(key):
    with pytest.raises(ssh.HostKeyError) as refused:
        ssh._RejectPolicy("set it in the inventory").missing_host_key(
            paramiko.SSHClient(), "gpu4", key)
    assert str(refused.value).endswith("verify it and add it, or set it in the inventory")


def test_a_connection_rejects_unknown_host_keys_unless_told_otherwise():
    target = ssh.SshTarget(alias="h", hostname="127.0.0.1", port=22, user="u")
    connection = ssh.Connection(target)
    assert connection.target is target and connection.stats == ssh.Stats()
    assert not connection.accept_new_host_key
    assert ssh.Connection(target, accept_new_host_key=True).accept_new_host_key


class _Hop:
    """A jump host's connection, as far as the connection through it sees one."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_connection_that_never_opened_closes_quietly():
    ssh.Connection(ssh.SshTarget(alias="h", hostname="127.0.0.1", port=22, user="u")).close()


def test_a_connection_through_a_hop_is_tunnelled_through_it_and_closes_it(monkeypatch):
    tunnels: list[object] = []
    monkeypatch.setattr(ssh.Connection, "_direct_tcpip",
                        lambda self, via: tunnels.append(via) or "channel")
    hop = _Hop()
    target = ssh.SshTarget(alias="h", hostname="127.0.0.1", port=22, user="u")
    connection = ssh.Connection(target, _via=hop)
    assert connection._open_socket() == "channel" and tunnels == [hop]
    connection.close()
    assert hop.closed
