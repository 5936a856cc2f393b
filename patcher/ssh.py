"""The SSH link to one host: the only module that imports paramiko.

A host is resolved exactly as the OpenSSH client would (``ssh -G``: Include, Match, wildcards,
tokens, first value wins) wherever ``ssh`` is installed, and with paramiko's own ssh_config
parser otherwise. ``Connection`` then honours HostName, User, Port, IdentityFile,
CertificateFile, IdentityAgent, IdentitiesOnly, ProxyCommand, ProxyJump chains,
UserKnownHostsFile / GlobalKnownHostsFile (hashed entries too), HashKnownHosts,
StrictHostKeyChecking accept-new, ConnectTimeout and ServerAliveInterval; it checks the host key
against known_hosts with a reject policy (``accept_new_host_key`` only adds hosts that are
absent; a changed key is always refused), authenticates with key files and the SSH agent, and
counts what it does so the benchmark can report round trips.

Round trips are counted as the exchanges we wait on: one per ``run`` (exec and its result), one
per agent request, one per HTTP GET through a ``direct-tcpip`` channel.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import logging
import os
import select
import shlex
import shutil
import socket
import subprocess
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import paramiko
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

from dynspec_patch.patcher.errors import DynspecError, RefusedError, UsageError
from dynspec_patch.patcher.remote_agent import (
    BOOTSTRAP,  # the agent starts itself the same way in a container
)

# paramiko logs a refused direct-tcpip channel ("Secsh channel N open FAILED") at ERROR, which
# Python's last-resort handler prints on stderr; every failure reaches the user as our own one
# line instead. Only paramiko's logger is touched: an application's logging stays its own.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class ConnectError(DynspecError):
    """The host could not be reached or refused us (exit 1)."""


class HostKeyError(RefusedError):
    """The host key is unknown or changed: nothing was sent (exit 3)."""


class ConnectionLost(DynspecError):
    """The connection dropped in the middle of a step (exit 1)."""


class RemoteError(DynspecError):
    """A remote step failed; carries the one-line reason."""


@dataclass(frozen=True)
class SshTarget:
    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...] = ()
    proxy_jump: str | None = None
    known_hosts: tuple[str, ...] = ()
    connect_timeout: float = 15.0
    keepalive: int = 15
    config_path: str | None = None
    accept_new_host_key: bool = False  # ssh_config StrictHostKeyChecking accept-new
    proxy_command: str | None = None  # tokens already expanded
    identity_agent: str | None = None  # a socket path; "none": no agent
    certificate_files: tuple[str, ...] = ()
    identities_only: bool = False
    hash_known_hosts: bool = False
    global_known_hosts: tuple[str, ...] = ()
    resolved_by: str = "paramiko"  # "ssh -G" where the OpenSSH client resolved it


@dataclass
class Stats:
    connections: int = 0
    execs: int = 0
    requests: int = 0
    http: int = 0
    log: list[str] = field(default_factory=list)
    seconds: list[tuple[str, float]] = field(default_factory=list)  # step -> wall time

    @property
    def round_trips(self) -> int:
        return self.execs + self.requests + self.http


def _split_user_host(host: str) -> tuple[str | None, str]:
    if "@" in host:
        user, _, rest = host.rpartition("@")
        return user, rest
    return None, host


def resolve_target(
    host: str,
    *,
    port: int | None = None,
    user: str | None = None,
    identity_file: str | None = None,
    known_hosts: str | None = None,
    ssh_config: str | None = None,
    connect_timeout: float | None = None,
) -> SshTarget:
    """Merge the command line over ``ssh_config`` (command line wins; ``user@`` + a different
    ``--user`` is ambiguous and refused)."""
    at_user, alias = _split_user_host(host)
    if alias.count(":") == 1 and alias.rsplit(":", 1)[1].isdigit():  # host:port
        alias, port_s = alias.rsplit(":", 1)
        if port and port != int(port_s):
            raise UsageError(f"port given twice: {port_s} in {host!r} and --port {port}")
        port = int(port_s)
    if at_user and user and at_user != user:
        raise UsageError(f"user given twice: {at_user!r} in {host!r} and --user {user!r}")
    user = user or at_user
    if ssh_config and not os.path.exists(ssh_config):
        raise UsageError(f"ssh config {ssh_config} does not exist")
    ssh = shutil.which("ssh")
    if ssh is not None:
        return _resolve_with_openssh(ssh, alias, port=port, user=user,
                                     identity_file=identity_file, known_hosts=known_hosts,
                                     ssh_config=ssh_config, connect_timeout=connect_timeout)
    cfg_path = ssh_config or os.path.expanduser("~/.ssh/config")
    entry: dict[str, Any] = {}
    if os.path.exists(cfg_path):
        try:
            entry = dict(paramiko.SSHConfig.from_path(cfg_path).lookup(alias))
        except (OSError, paramiko.SSHException) as exc:
            raise UsageError(f"cannot read ssh config {cfg_path}: {exc}") from exc
    identities = [identity_file] if identity_file else list(entry.get("identityfile", []))
    kh = [known_hosts] if known_hosts else entry.get("userknownhostsfile", "").split()
    if not kh:
        kh = [os.path.expanduser("~/.ssh/known_hosts")]
    jump = entry.get("proxyjump")
    if jump and jump.lower() == "none":
        jump = None
    try:
        timeout = connect_timeout or float(entry.get("connecttimeout", 15))
        keepalive = int(entry.get("serveraliveinterval", 15)) or 15
        final_port = port or int(entry.get("port", 22))
    except ValueError as exc:
        raise UsageError(f"bad value in ssh config for {alias}: {exc}") from exc
    return SshTarget(
        alias=alias,
        hostname=entry.get("hostname", alias),
        port=final_port,
        user=user or entry.get("user") or _local_user(),
        identity_files=tuple(os.path.expanduser(p) for p in identities),
        proxy_jump=jump,
        known_hosts=tuple(os.path.expanduser(p) for p in kh),
        connect_timeout=timeout,
        keepalive=keepalive,
        config_path=cfg_path if os.path.exists(cfg_path) else None,
        accept_new_host_key=entry.get("stricthostkeychecking", "").lower() == "accept-new",
    )


def _resolve_with_openssh(ssh: str, alias: str, *, port: int | None, user: str | None,
                          identity_file: str | None, known_hosts: str | None,
                          ssh_config: str | None, connect_timeout: float | None) -> SshTarget:
    """``ssh -G``: the OpenSSH client's own resolution of ``alias`` (command line wins)."""
    cmd = [ssh, "-G"]
    if ssh_config:
        cmd += ["-F", ssh_config]
    if port:
        cmd += ["-p", str(port)]
    if user:
        cmd += ["-l", user]
    cmd += ["--", alias]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"ssh -G {alias} failed: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"ssh -G {alias} failed: {tail}")
    entry: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        entry.setdefault(key.lower(), []).append(value)

    def one(key: str, default: str | None = None) -> str | None:
        return entry.get(key, [default])[0]

    hostname = one("hostname", alias) or alias
    final_user = one("user") or _local_user()
    final_port = int(one("port", "22") or 22)
    tokens = {"%%": "%", "%h": hostname, "%p": str(final_port), "%r": final_user,
              "%n": alias, "%u": _local_user(), "%d": os.path.expanduser("~"),
              "%l": socket.gethostname().split(".")[0], "%L": socket.gethostname()}

    def path(value: str) -> str:
        return os.path.expanduser(_expand_tokens(value, tokens))

    identities = [identity_file] if identity_file else [path(v) for v in entry.get(
        "identityfile", [])]
    kh = [known_hosts] if known_hosts else [path(p) for v in entry.get(
        "userknownhostsfile", []) for p in v.split()]
    jump = one("proxyjump")
    command = one("proxycommand")
    timeout_s = one("connecttimeout", "none")
    agent = one("identityagent")
    return SshTarget(
        alias=alias,
        hostname=hostname,
        port=final_port,
        user=final_user,
        identity_files=tuple(identities),
        proxy_jump=None if not jump or jump == "none" else jump,
        known_hosts=tuple(kh) or (os.path.expanduser("~/.ssh/known_hosts"),),
        connect_timeout=connect_timeout or (
            float(timeout_s) if timeout_s and timeout_s != "none" else 15.0),
        keepalive=int(one("serveraliveinterval", "0") or 0) or 15,
        config_path=ssh_config,
        accept_new_host_key=one("stricthostkeychecking") == "accept-new",
        proxy_command=None if not command or command == "none" else _expand_tokens(
            command, tokens),
        identity_agent=None if agent is None or agent == "SSH_AUTH_SOCK" else (
            agent if agent == "none" else path(agent)),
        certificate_files=tuple(path(v) for v in entry.get("certificatefile", [])),
        identities_only=one("identitiesonly") == "yes",
        hash_known_hosts=one("hashknownhosts") == "yes",
        global_known_hosts=tuple(path(p) for v in entry.get("globalknownhostsfile", [])
                                 for p in v.split()),
        resolved_by="ssh -G",
    )


def _expand_tokens(value: str, tokens: dict[str, str]) -> str:
    """ssh_config's ``%`` tokens (``%%`` is a literal percent sign)."""
    out, i = [], 0
    while i < len(value):
        pair = value[i:i + 2]
        if pair in tokens:
            out.append(tokens[pair])
            i += 2
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def _local_user() -> str:
    import getpass

    return getpass.getuser()


@contextlib.contextmanager
def _agent_socket(path: str | None) -> Any:
    """Point paramiko's agent client at ``IdentityAgent`` for the length of the login."""
    if path is None or path == "none":
        yield
        return
    saved = os.environ.get("SSH_AUTH_SOCK")
    os.environ["SSH_AUTH_SOCK"] = path
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("SSH_AUTH_SOCK", None)
        else:
            os.environ["SSH_AUTH_SOCK"] = saved


def _certified_key(identities: list[str], certificates: tuple[str, ...]) -> paramiko.PKey | None:
    """The first identity that loads with one of ``CertificateFile`` (an OpenSSH certificate)."""
    for cert in (c for c in certificates if os.path.exists(c)):
        for identity in identities:
            try:
                key = paramiko.PKey.from_path(identity)
                key.load_certificate(cert)
            except (OSError, ValueError, paramiko.SSHException):
                continue
            return key
    return None


def _known_hosts_name(hostname: str, port: int) -> str:
    return hostname if port == 22 else f"[{hostname}]:{port}"


class _AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Add a host that is absent from known_hosts (never one whose key changed: paramiko
    raises BadHostKeyException for those before asking a policy)."""

    def __init__(self, path: str, hashed: bool = False) -> None:
        self.path = path
        self.hashed = hashed  # ssh_config HashKnownHosts yes

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str,
                         key: paramiko.PKey) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        name = paramiko.HostKeys.hash_host(hostname) if self.hashed else hostname
        with open(self.path, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            fh.write(f"{name} {key.get_name()} {key.get_base64()}\n")


def _load_known_hosts(host_keys: paramiko.HostKeys, path: str) -> None:
    """Add one known_hosts file's keys, skipping a line that does not parse, as OpenSSH does
    (paramiko's ``HostKeys.load`` gives up on the whole file at a key that is not base64)."""
    with open(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            try:
                entry = HostKeyEntry.from_line(line, lineno)
            except (InvalidHostKey, paramiko.SSHException):
                continue
            if entry is not None:
                for name in entry.hostnames:
                    host_keys.add(name, entry.key.get_name(), entry.key)


# How a user of the CLI has an absent host key added (the unknown-key message ends with it).
ACCEPT_NEW_HINT = "pass --accept-new-host-key"


class _RejectPolicy(paramiko.MissingHostKeyPolicy):
    def __init__(self, accept_new_hint: str = ACCEPT_NEW_HINT) -> None:
        self.accept_new_hint = accept_new_hint

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str,
                         key: paramiko.PKey) -> None:
        raise HostKeyError(
            f"host key of {hostname} is not in known_hosts ({key.get_name()} "
            f"{key.fingerprint}); verify it and add it, or {self.accept_new_hint}"
        )


@dataclass(frozen=True)
class CommandResult:
    command: str
    status: int
    stdout: bytes
    stderr: bytes

    def check(self, what: str) -> CommandResult:
        if self.status != 0:
            tail = self.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
            raise RemoteError(f"{what} failed (exit {self.status}): {tail[0]}")
        return self


@dataclass(frozen=True)
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body.decode())


class Connection:
    """One SSH connection to one host (and its jump hosts); a context manager.

    ``accept_new_hint`` ends the message for a host key absent from known_hosts: how the
    caller's user has it added (the CLI's flag by default; the Ansible plugin names
    ``host_key_checking``)."""

    def __init__(self, target: SshTarget, *, accept_new_host_key: bool = False,
                 accept_new_hint: str = ACCEPT_NEW_HINT,
                 _via: Connection | None = None) -> None:
        self.target = target
        self.accept_new_host_key = accept_new_host_key
        self.accept_new_hint = accept_new_hint
        self.stats = Stats()
        self._client: paramiko.SSHClient | None = None
        self._via = _via
        self._jump: Connection | None = _via
        self._agent: AgentSession | None = None

    # -- opening -------------------------------------------------------------------------
    def __enter__(self) -> Connection:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def transport(self) -> paramiko.Transport:
        if self._client is None:
            self.open()
        assert self._client is not None
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            raise ConnectionLost(f"connection to {self.target.alias} is closed")
        return transport

    def open(self) -> None:
        if self._client is not None:
            return
        started = time.perf_counter()
        t = self.target
        sock = self._open_socket()
        client = paramiko.SSHClient()
        for path in t.known_hosts:
            if os.path.exists(path):
                try:
                    _load_known_hosts(client.get_host_keys(), path)
                except (OSError, UnicodeDecodeError) as exc:
                    raise UsageError(f"cannot read known_hosts {path}: {exc}") from exc
        for path in t.global_known_hosts:  # a system file that does not parse is skipped
            with contextlib.suppress(OSError, UnicodeDecodeError, InvalidHostKey):
                client.load_system_host_keys(path)
        policy: paramiko.MissingHostKeyPolicy = (
            _AcceptNewPolicy(t.known_hosts[0], t.hash_known_hosts)
            if self.accept_new_host_key else _RejectPolicy(self.accept_new_hint)
        )
        client.set_missing_host_key_policy(policy)
        # paramiko never saves known_hosts here: _AcceptNewPolicy appends the new line itself.
        keys = [p for p in t.identity_files if os.path.exists(p)]
        try:
            with _agent_socket(t.identity_agent):
                client.connect(
                    t.hostname, port=t.port, username=t.user, sock=sock,
                    pkey=_certified_key(keys, t.certificate_files),
                    key_filename=keys or None,
                    look_for_keys=not t.identity_files,
                    allow_agent=t.identity_agent != "none" and not t.identities_only,
                    timeout=t.connect_timeout, banner_timeout=t.connect_timeout,
                    auth_timeout=t.connect_timeout, channel_timeout=t.connect_timeout,
                )
        except HostKeyError:
            sock.close()
            raise
        except paramiko.BadHostKeyException as exc:
            sock.close()
            raise HostKeyError(
                f"host key of {t.alias} CHANGED (got {exc.key.get_name()}, known_hosts has "
                f"another key): refusing to connect"
            ) from exc
        except paramiko.AuthenticationException as exc:
            sock.close()
            raise ConnectError(f"authentication to {t.user}@{t.alias} failed: {exc}") from exc
        except (paramiko.SSHException, OSError, EOFError) as exc:
            sock.close()
            raise ConnectError(f"cannot connect to {t.alias}: {exc}") from exc
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(t.keepalive)
        self._client = client
        self.stats.connections += 1
        self.stats.seconds.append((f"connect {t.alias}", time.perf_counter() - started))

    def _open_socket(self) -> Any:
        t = self.target
        if self._via is not None:
            return self._direct_tcpip(self._via)
        if t.proxy_jump:
            # ssh(1): "-J a,b" reaches a first, then b through a, then the target through b.
            via: Connection | None = None
            for hop in (h.strip() for h in t.proxy_jump.split(",")):
                if not hop:
                    continue
                hop_user, rest = _split_user_host(hop)
                hop_port = None
                if rest.count(":") == 1:
                    rest, hop_port_s = rest.split(":")
                    hop_port = int(hop_port_s)
                hop_target = resolve_target(
                    f"{hop_user}@{rest}" if hop_user else rest, port=hop_port,
                    ssh_config=t.config_path, connect_timeout=t.connect_timeout,
                    known_hosts=t.known_hosts[0] if t.known_hosts else None,
                )
                hop_target = SshTarget(**{**hop_target.__dict__, "proxy_jump": None})
                conn = Connection(hop_target, accept_new_host_key=self.accept_new_host_key,
                                  accept_new_hint=self.accept_new_hint, _via=via)
                conn.open()
                self.stats.connections += 1
                via = conn
            assert via is not None
            self._jump = via
            return self._direct_tcpip(via)
        if t.proxy_command:
            try:
                return paramiko.ProxyCommand(t.proxy_command)
            except (paramiko.SSHException, OSError) as exc:
                raise ConnectError(f"ProxyCommand for {t.alias} failed: {exc}") from exc
        try:
            sock = socket.create_connection((t.hostname, t.port), timeout=t.connect_timeout)
        except OSError as exc:
            raise ConnectError(f"cannot reach {t.hostname}:{t.port}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _direct_tcpip(self, via: Connection) -> Any:
        t = self.target
        try:
            return via.transport.open_channel(
                "direct-tcpip", (t.hostname, t.port), ("127.0.0.1", 0),
                timeout=t.connect_timeout)
        except (paramiko.SSHException, OSError) as exc:
            raise ConnectError(
                f"{via.target.alias} cannot reach {t.hostname}:{t.port}: {exc}") from exc

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._jump is not None:
            self._jump.close()
            self._jump = None

    def abort(self) -> None:
        """Drop the TCP connection without a goodbye (fault injection in tests)."""
        if self._client is not None:
            transport = self._client.get_transport()
            if transport is not None and transport.sock is not None:
                with contextlib.suppress(OSError):
                    transport.sock.shutdown(socket.SHUT_RDWR)
                transport.sock.close()

    # -- commands ------------------------------------------------------------------------
    def run(self, command: str, *, stdin: bytes | None = None,
            timeout: float = 120.0) -> CommandResult:
        """Run ``command`` through the login shell; stdout and stderr are read as they come,
        before the exit status, so a large output cannot deadlock the channel."""
        self.stats.execs += 1
        self.stats.log.append(f"exec {command[:60]}")
        try:
            chan = self.transport.open_session(timeout=self.target.connect_timeout)
            chan.exec_command(command)
            if stdin is not None:
                chan.sendall(stdin)
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + timeout
            while True:
                if chan.recv_ready():
                    out += chan.recv(1 << 16)
                    continue
                if chan.recv_stderr_ready():
                    err += chan.recv_stderr(1 << 16)
                    continue
                if chan.eof_received or chan.closed:
                    # EOF comes after the last data byte (exit-status may come before it)
                    break
                if time.monotonic() > deadline:
                    chan.close()
                    raise RemoteError(f"remote command timed out after {timeout:.0f}s")
                select.select([chan], [], [], 0.5)
                if not self.transport.is_active():
                    raise ConnectionLost(f"connection to {self.target.alias} lost")
            remaining = max(1.0, deadline - time.monotonic())
            status = -1
            while time.monotonic() < deadline + remaining and not chan.closed:
                if chan.exit_status_ready():
                    break
                select.select([chan], [], [], 0.2)
            if chan.exit_status_ready():
                status = chan.recv_exit_status()
            chan.close()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise ConnectionLost(f"connection to {self.target.alias} lost: {exc}") from exc
        return CommandResult(command, status, bytes(out), bytes(err))

    def http_get(self, port: int, path: str, *, host: str = "127.0.0.1",
                 timeout: float = 10.0, headers: dict[str, str] | None = None) -> HttpResponse:
        """GET ``path`` from ``host:port`` as seen from the remote machine (direct-tcpip)."""
        self.stats.http += 1
        try:
            chan = self.transport.open_channel("direct-tcpip", (host, port), ("127.0.0.1", 0),
                                               timeout=timeout)
        except paramiko.ChannelException as exc:
            raise RemoteError(f"cannot open {host}:{port} on the host: {exc}") from exc
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise ConnectionLost(f"connection lost: {exc}") from exc
        try:
            chan.settimeout(timeout)
            lines = [f"GET {path} HTTP/1.0", f"Host: {host}:{port}", "Connection: close"]
            lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
            chan.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            data = bytearray()
            while True:
                chunk = chan.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
        except TimeoutError as exc:
            raise RemoteError(f"GET {path} on {host}:{port} timed out") from exc
        finally:
            chan.close()
        return _parse_http(bytes(data))

    # -- the remote agent ----------------------------------------------------------------
    def agent(self, *, use_sudo: bool = True,
              on_progress: Callable[[str], None] | None = None) -> AgentSession:
        if self._agent is None:
            self._agent = AgentSession(self, use_sudo=use_sudo, on_progress=on_progress)
        return self._agent


def _parse_http(data: bytes) -> HttpResponse:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError) as exc:
        raise RemoteError(f"not an HTTP response: {lines[0][:80]!r}") from exc
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = bytearray(), body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out += rest[:size]
            rest = rest[size + 2:]
        body = bytes(out)
    return HttpResponse(status, headers, body)


def agent_source() -> bytes:
    return (resources.files("dynspec_patch.patcher") / "remote_agent.py").read_bytes()




def agent_command(use_sudo: bool) -> str:
    """A POSIX sh line that finds a python3 and runs the agent, under ``sudo -n`` when we are
    not root and sudo works without a password; the agent's source travels as one argument."""
    code = base64.b64encode(zlib.compress(agent_source(), 9)).decode()
    run = f"-c {shlex.quote(BOOTSTRAP)} {code}"
    sudo = (
        'if [ "$(id -u)" != 0 ] && sudo -n true 2>/dev/null; then S="sudo -n"; else S=; fi; '
        if use_sudo else "S=; "
    )
    return (
        "PY=$(command -v python3 || command -v python || true); "
        'if [ -z "$PY" ]; then for d in /proc/[0-9]*; do '
        'if tr "\\0" " " < "$d/cmdline" 2>/dev/null | grep -q sglang; then '
        'PY=$(readlink "$d/exe"); break; fi; done; fi; '
        '[ -n "$PY" ] || { echo "no python3 on the host" >&2; exit 127; }; '
        f'{sudo}exec $S "$PY" {run}'
    )


class AgentSession:
    """The remote agent process: one channel, JSON lines both ways, the lock lives with it."""

    def __init__(self, conn: Connection, *, use_sudo: bool,
                 on_progress: Callable[[str], None] | None) -> None:
        self.conn = conn
        self.on_progress = on_progress
        self._buf = bytearray()
        self._err = bytearray()
        self._op = "start"
        self._sent_at = time.perf_counter()
        conn.stats.execs += 1
        conn.stats.log.append("exec agent")
        started = time.perf_counter()
        try:
            self.chan = conn.transport.open_session(timeout=conn.target.connect_timeout)
            self.chan.exec_command(agent_command(use_sudo))
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise ConnectionLost(f"cannot start the remote agent: {exc}") from exc
        hello = self._read_message(60.0)
        self.hello: dict[str, Any] = hello["result"]
        conn.stats.seconds.append(("agent start", time.perf_counter() - started))

    def close(self) -> None:
        try:
            self.chan.shutdown_write()
            self.chan.close()
        except (paramiko.SSHException, OSError, EOFError):
            pass

    def request(self, op: str, args: dict[str, Any] | None = None, *,
                timeout: float = 600.0) -> dict[str, Any]:
        """Send one request and wait for its answer; raise on a refusal or error."""
        self.send(op, args)
        return self.receive(timeout=timeout)

    def send(self, op: str, args: dict[str, Any] | None = None) -> None:
        self.conn.stats.requests += 1
        self.conn.stats.log.append(f"request {op}")
        self._op = op
        self._sent_at = time.perf_counter()
        line = json.dumps({"op": op, "args": args or {}}).encode() + b"\n"
        try:
            self.chan.sendall(line)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise ConnectionLost(f"connection lost sending {op}: {exc}") from exc

    def receive(self, *, timeout: float = 600.0) -> dict[str, Any]:
        try:
            msg = self._read_message(timeout)
        finally:
            self.conn.stats.seconds.append(
                (f"request {self._op}", time.perf_counter() - self._sent_at))
        if msg.get("ok"):
            return msg["result"]
        kind = msg.get("kind")
        if kind in ("refused", "busy"):
            raise RefusedError(msg["error"])
        raise RemoteError(f"remote {self._op} failed: {msg.get('error')}")

    def _read_message(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                raw = bytes(self._buf[:nl])
                del self._buf[: nl + 1]
                try:
                    msg = json.loads(raw.decode("utf-8", "replace"))
                except ValueError:
                    msg = None
                if not isinstance(msg, dict):
                    # a login shell that prints (motd, rc files) before the agent starts
                    self._err += raw + b"\n"
                    continue
                if "progress" in msg:
                    if self.on_progress:
                        self.on_progress(msg["progress"])
                    continue
                return msg
            try:
                if self.chan.recv_stderr_ready():
                    self._err += self.chan.recv_stderr(1 << 16)
                    continue
                if self.chan.recv_ready():
                    chunk = self.chan.recv(1 << 20)
                    if chunk:
                        self._buf += chunk
                        continue
                if self.chan.closed or self.chan.exit_status_ready() or self.chan.eof_received:
                    while self.chan.recv_stderr_ready():
                        self._err += self.chan.recv_stderr(1 << 16)
                    tail = self._err.decode("utf-8", "replace").strip().splitlines()[-1:]
                    if not self.conn.transport.is_active():
                        raise ConnectionLost("connection lost while waiting for the host")
                    raise RemoteError(
                        "remote agent stopped: " + (tail[0] if tail else "no message"))
                if time.monotonic() > deadline:
                    raise RemoteError(f"no answer from the host within {timeout:.0f}s")
                select.select([self.chan], [], [], 0.5)
            except (paramiko.SSHException, OSError, EOFError) as exc:
                raise ConnectionLost(f"connection lost: {exc}") from exc
