"""Parity with the OpenSSH client: the tool reaches exactly the aliases ``ssh -F CFG ALIAS true``
reaches, on the loopback sshd — Include, Match, wildcards, tokens, first value wins,
ProxyCommand, a ProxyJump chain, a key held only in an ssh-agent (IdentityAgent), an OpenSSH
user certificate (CertificateFile), hashed known_hosts; and aliases both must fail."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from remote_harness import OP_USER, make_login_keys

from dynspec_patch.patcher import ssh as ssh_module
from dynspec_patch.patcher.errors import DynspecError
from dynspec_patch.patcher.ssh import Connection, resolve_target

REACHABLE = ("direct", "first-wins", "box.loop", "matched", "included", "tokens", "proxied",
             "jumped", "via-agent", "certified", "hashed")
UNREACHABLE = ("wrong-port", "wrong-key", "unknown-key", "agent-missing")


@pytest.fixture(scope="module")
def parity(sshd, tmp_path_factory) -> Iterator[Path]:
    base = tmp_path_factory.mktemp("parity")
    # a key only the agent holds, and a CA whose certificates the account accepts
    login = make_login_keys(sshd, base, "parity")
    stranger, cert_key, sock = login.stranger, login.cert_key, login.agent_sock
    (base / "keys").mkdir()
    shutil.copy(sshd.client_key, base / "keys" / f"{OP_USER}.key")
    os.chmod(base / "keys" / f"{OP_USER}.key", 0o600)
    hashed = base / "known_hosts_hashed"
    shutil.copy(sshd.known_hosts, hashed)
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(hashed)], check=True,
                   capture_output=True)
    assert hashed.read_text().startswith("|1|")
    (base / "empty_known_hosts").write_text("")
    # sshd listens on 127.0.0.1 only: 127.0.0.2 is reached through the ProxyCommand or not at all
    proxied_kh = base / "known_hosts_proxied"
    proxied_kh.write_text(sshd.known_hosts.read_text().replace("[127.0.0.1]", "[127.0.0.2]"))
    (base / "conf.d").mkdir()
    (base / "conf.d" / "extra.conf").write_text(
        f"Host included\n  HostName 127.0.0.1\n  IdentityFile {sshd.client_key}\n")
    cfg = base / "ssh_config"
    key = sshd.client_key
    cfg.write_text(f"""Include {base}/conf.d/*.conf

Host direct
  HostName 127.0.0.1
  IdentityFile {key}
Host first-wins
  HostName 127.0.0.1
  IdentityFile {key}
  Port {sshd.port}
Host first-wins
  Port 1
Host *.loop
  HostName 127.0.0.1
  IdentityFile {key}
Match originalhost matched
  HostName 127.0.0.1
  IdentityFile {key}
Host tokens
  HostName 127.0.0.1
  IdentityFile {base}/keys/%r.key
Host proxied
  HostName 127.0.0.2
  IdentityFile {key}
  UserKnownHostsFile {proxied_kh}
  ProxyCommand ssh -F {cfg} -W 127.0.0.1:%p direct
Host jumped
  HostName 127.0.0.1
  IdentityFile {key}
  ProxyJump direct,direct
Host via-agent
  HostName 127.0.0.1
  IdentityAgent {sock}
Host agent-missing
  HostName 127.0.0.1
  IdentityAgent {base}/no-such-agent.sock
Host certified
  HostName 127.0.0.1
  IdentityFile {cert_key}
  CertificateFile {base}/certificate.pub
Host hashed
  HostName 127.0.0.1
  IdentityFile {key}
  UserKnownHostsFile {hashed}
Host wrong-port
  HostName 127.0.0.1
  IdentityFile {key}
  Port 1
Host wrong-key
  HostName 127.0.0.1
  IdentityFile {stranger}
  IdentitiesOnly yes
Host unknown-key
  HostName 127.0.0.1
  IdentityFile {key}
  UserKnownHostsFile {base}/empty_known_hosts
Host *
  Port {sshd.port}
  User {OP_USER}
  UserKnownHostsFile {sshd.known_hosts}
  StrictHostKeyChecking yes
  ConnectTimeout 5
  BatchMode yes
""")
    yield cfg
    login.stop()


def _openssh_reaches(cfg: Path, alias: str) -> bool:
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    done = subprocess.run(["ssh", "-F", str(cfg), alias, "true"], stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=60, env=env, check=False)
    return done.returncode == 0


def _tool_reaches(cfg: Path, alias: str) -> bool:
    try:
        with Connection(resolve_target(alias, ssh_config=str(cfg))) as conn:
            return conn.run("true").status == 0
    except DynspecError:
        return False


@pytest.mark.parametrize("alias", REACHABLE + UNREACHABLE)
def test_the_tool_reaches_exactly_what_openssh_reaches(parity, alias, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    expected = alias in REACHABLE
    assert _openssh_reaches(parity, alias) is expected  # the fixture itself is right
    assert _tool_reaches(parity, alias) is expected


def test_resolution_is_openssh_s_own_where_it_is_installed(parity):
    target = resolve_target("tokens", ssh_config=str(parity))
    assert target.resolved_by == "ssh -G"
    assert target.identity_files[0].endswith(f"/keys/{OP_USER}.key")  # %r expanded
    assert resolve_target("first-wins", ssh_config=str(parity)).port != 1


def test_without_an_openssh_client_paramiko_s_parser_is_used(parity, monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(ssh_module.shutil, "which",
                        lambda name, *a, **k: None if name == "ssh" else real_which(name, *a, **k))
    target = resolve_target("direct", ssh_config=str(parity))
    assert target.resolved_by == "paramiko"
    with Connection(target) as conn:
        assert conn.run("true").status == 0
