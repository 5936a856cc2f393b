"""A throw-away OpenSSH server on 127.0.0.1, test accounts, and SGLang "hosts" made of venvs.

Everything lives under one temp dir (mode 755 so the test accounts can read their
authorized_keys). Needs root, ``/usr/sbin/sshd`` (openssh-server), ``sudo`` and util-linux
``unshare``/``nsenter``.

sshd runs as PID 1 of its own PID namespace (``unshare --pid --fork --mount-proc``), and the
fake servers are started inside it with ``nsenter``: what the remote agent sees in ``/proc``
is this session's servers only, so two test sessions on one machine do not see each other's
servers, and killed servers are reaped at once. Test accounts carry a per-session suffix.
PIDs reported over SSH are namespace PIDs; ``outer_pid`` maps them back for ``/proc`` reads.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dynspec_patch.patcher.releases import fetch_wheel, find_pin

FAKE_DIR = Path(__file__).parent / "fake"
_TAG = secrets.token_hex(3)
OP_USER = f"dsp-op-{_TAG}"  # passwordless sudo
PLAIN_USER = f"dsp-pl-{_TAG}"  # no sudo
HOSTILE = "it's a $(touch pwned) `touch pwned2` dir"
SYSTEM_PYTHON = "/usr/bin/python3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(*cmd: str, **kw: object) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)  # type: ignore[call-overload]


def remove_test_accounts() -> None:
    """Undo ``ensure_user``: no passwordless-sudo test account outlives the session."""
    for name in (OP_USER, PLAIN_USER):
        Path(f"/etc/sudoers.d/dynspec-test-{name}").unlink(missing_ok=True)
        subprocess.run(["userdel", "-r", name], capture_output=True, check=False)


def ensure_user(name: str, sudo: bool) -> None:
    try:
        sh("id", "-u", name)
    except subprocess.CalledProcessError:
        sh("useradd", "-m", "-s", "/bin/bash", name)
    sh("usermod", "-p", "*", name)  # unlock: sshd with UsePAM no refuses locked accounts
    sudoers = Path(f"/etc/sudoers.d/dynspec-test-{name}")
    if sudo:
        sudoers.write_text(f"{name} ALL=(ALL) NOPASSWD:ALL\n")
        sudoers.chmod(0o440)
    elif sudoers.exists():
        sudoers.unlink()


@dataclass
class Sshd:
    base: Path
    port: int
    pid: int  # the unshare process (root namespace)
    client_key: Path
    known_hosts: Path
    host_pub: str
    log: Path
    ns_init: int = 0  # sshd, PID 1 of the namespace, as seen from outside

    def stop(self) -> None:
        # --kill-child: sshd (PID 1 inside) dies with unshare, and the namespace with it
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        # reaped here: a zombie left behind is picked up by whoever waits for any child next
        # (mutmut's os.wait() for its workers, which then fails on the unknown pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


@dataclass
class LoginKeys:
    """Keys beside the operator account's own: a stranger's key sshd refuses, a key only an
    ssh-agent (``agent_sock``) holds, and an OpenSSH user certificate for ``cert_key``, stored
    under a name paramiko does not try by itself, from a CA the account trusts."""

    stranger: Path
    agent_sock: Path
    agent_pid: int
    cert_key: Path
    certificate: Path

    def stop(self) -> None:
        os.kill(self.agent_pid, signal.SIGTERM)


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


def make_login_keys(sshd: Sshd, base: Path, identity: str) -> LoginKeys:
    """``LoginKeys`` in ``base`` (the certificate is ``base/certificate.pub``), the agent's key and
    the CA added to the operator's authorized keys on ``sshd``; ``stop()`` ends the agent."""
    stranger, agent_key, ca, cert_key = (
        keygen(base / name) for name in ("stranger", "agent_key", "ca", "cert_key"))
    subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-I", identity, "-n", OP_USER,
                    "-V", "+1h", f"{cert_key}.pub"], check=True)
    os.replace(f"{cert_key}-cert.pub", base / "certificate.pub")
    with (sshd.base / f"authorized_keys.{OP_USER}").open("a") as fh:
        fh.write((base / "agent_key.pub").read_text())
        fh.write("cert-authority " + (base / "ca.pub").read_text())
    sock = base / "agent.sock"
    started = subprocess.run(["ssh-agent", "-s", "-a", str(sock)], capture_output=True,
                             text=True, check=True).stdout
    agent_pid = int(re.search(r"SSH_AGENT_PID=(\d+)", started)[1])
    subprocess.run(["ssh-add", "-q", str(agent_key)], check=True, capture_output=True,
                   env={**os.environ, "SSH_AUTH_SOCK": str(sock)})
    return LoginKeys(stranger, sock, agent_pid, cert_key, base / "certificate.pub")


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def outer_pid(ns_init: int, inner: int) -> int:
    """The root-namespace PID of the process that is ``inner`` inside the test namespace."""
    ns = os.readlink(f"/proc/{ns_init}/ns/pid")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
            if os.readlink(f"/proc/{name}/ns/pid") != ns:
                continue
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:") and line.split()[-1] == str(inner):
                return int(name)
    raise LookupError(f"no process {inner} in the test namespace")


def start_sshd(base: Path) -> Sshd:
    if not Path("/usr/sbin/sshd").exists() or not shutil.which("sudo"):
        raise RuntimeError("needs openssh-server and sudo: apt-get install -y "
                           "--no-install-recommends openssh-server sudo")
    os.chmod(base, 0o755)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    ensure_user(OP_USER, sudo=True)
    ensure_user(PLAIN_USER, sudo=False)
    hostkey = base / "ssh_host_ed25519_key"
    client = base / "client_key"
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey))
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(client))
    pub = (base / "client_key.pub").read_text()
    for user in (OP_USER, PLAIN_USER, "root"):
        keys = base / f"authorized_keys.{user}"
        keys.write_text(pub)
        keys.chmod(0o644)
    port = free_port()
    conf = base / "sshd_config"
    pidfile = base / "sshd.pid"
    log = base / "sshd.log"
    conf.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {hostkey}\nPidFile {pidfile}\n"
        f"AuthorizedKeysFile {base}/authorized_keys.%u\nUsePAM no\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nStrictModes no\nPermitRootLogin prohibit-password\n"
        "Subsystem sftp internal-sftp\nAllowTcpForwarding yes\nMaxStartups 100\n"
        "MaxSessions 100\nLogLevel VERBOSE\n"
    )
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
         "/usr/sbin/sshd", "-D", "-f", str(conf), "-E", str(log)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    deadline = time.time() + 10
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError(f"sshd did not start: {log.read_text() if log.exists() else ''}")
        time.sleep(0.05)
    ns_init = _children(proc.pid)[0]
    host_pub = (base / "ssh_host_ed25519_key.pub").read_text().split()
    known = base / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    known.chmod(0o644)
    (base / "ssh_config").write_text("")
    return Sshd(base, port, proc.pid, client, known, " ".join(host_pub[:2]), log, ns_init)


def build_venv(dest: Path, version: str, owner: str | None = None) -> Path:
    """A venv with the real pinned release installed --no-deps plus the fake-server hook."""
    wheel = fetch_wheel(find_pin(version))
    sh(SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(dest))
    sh(sys.executable, "-m", "pip", "--python", str(dest / "bin" / "python"), "install",
       "--quiet", "--no-deps", "--no-compile", str(wheel))
    site = next((dest / "lib").glob("python3*/site-packages"))
    shutil.copy(FAKE_DIR / "_dynspec_fake_hook.py", site / "_dynspec_fake_hook.py")
    shutil.copy(FAKE_DIR / "fake_server.py", site / "_dynspec_fake_server.py")
    (site / "_dynspec_fake.pth").write_text("import _dynspec_fake_hook\n")
    if owner:
        sh("chown", "-R", owner, str(dest))
    return dest


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def package_dir(venv: Path) -> Path:
    return site_packages(venv) / "sglang"


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@dataclass
class FakeServer:
    venv: Path
    cwd: Path
    port: int
    argv: list[str]
    env: dict[str, str]
    log: Path
    user: str | None = None
    pid: int = 0  # inside the namespace: what the agent reports
    ns_init: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        """Where it listens: its ``--host`` (the fake server's default is 127.0.0.1)."""
        for i, arg in enumerate(self.argv):
            if arg == "--host" and i + 1 < len(self.argv):
                return self.argv[i + 1]
        return "127.0.0.1"

    def start(self) -> FakeServer:
        """Start inside the sshd's PID namespace, like a server that runs on that host."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["nsenter", "-t", str(self.ns_init), "--pid", "--mount", f"--wd={self.cwd}"]
        if self.user:
            import pwd

            pw = pwd.getpwnam(self.user)
            cmd += ["--setgid", str(pw.pw_gid), "--setuid", str(pw.pw_uid)]
        out = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(["/usr/bin/nsenter", *cmd[1:], "--", *self.argv],
                                cwd=self.cwd, env=self.env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        out.close()
        self.extra["popen"] = proc
        return self

    def outer(self, inner: int | None = None) -> int:
        return outer_pid(self.ns_init, inner if inner is not None else self.pid)

    def wait_healthy(self, timeout: float = 20) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.get("/health")[0] == 200:
                if not self.pid:
                    self.pid = int(self.get("/fake_pid")[1])
                return
            time.sleep(0.05)
        raise RuntimeError(f"fake server on {self.port} not healthy: {self.log.read_text()[-500:]}")

    def get(self, path: str) -> tuple[int | None, bytes]:
        try:
            with urllib.request.urlopen(f"http://{self.address}:{self.port}{path}",
                                        timeout=2) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except OSError:
            return None, b""

    def info(self) -> dict:
        import json

        for path in ("/server_info", "/get_server_info"):
            status, body = self.get(path)
            if status == 200:
                return json.loads(body)
        raise RuntimeError("no server info")


def pids_matching(needle: str) -> list[int]:
    """Processes whose command line mentions ``needle`` (the test's own unique dir)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if needle.encode() in raw and int(name) != os.getpid():
            found.append(int(name))
    return found


def kill_matching(needle: str) -> None:
    for pid in pids_matching(needle):
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def make_base() -> Path:
    base = Path(tempfile.mkdtemp(prefix="dynspec-remote-"))
    base.chmod(0o755)
    return base
