"""A throw-away OpenSSH server on 127.0.0.1, test accounts, and SGLang "hosts" made of venvs.

Everything lives under one temp dir (mode 755 so the test accounts can read their
authorized_keys). Needs root, ``/usr/sbin/sshd`` (openssh-server) and ``sudo``.
"""

from __future__ import annotations

import contextlib
import os
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

from patcher.releases import fetch_wheel, find_pin

FAKE_DIR = Path(__file__).parent / "fake"
OP_USER = "dsp-op"  # passwordless sudo
PLAIN_USER = "dsp-plain"  # no sudo
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
    pid: int
    client_key: Path
    known_hosts: Path
    host_pub: str
    log: Path

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)


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
    sh("/usr/sbin/sshd", "-f", str(conf), "-E", str(log))
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.05)
    host_pub = (base / "ssh_host_ed25519_key.pub").read_text().split()
    known = base / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    known.chmod(0o644)
    (base / "ssh_config").write_text("")
    return Sshd(base, port, int(pidfile.read_text()), client, known, " ".join(host_pub[:2]), log)


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
    pid: int = 0
    marker: str = ""
    extra: dict = field(default_factory=dict)

    def start(self) -> FakeServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        kwargs: dict = {}
        if self.user:
            import pwd

            pw = pwd.getpwnam(self.user)
            kwargs = {"user": pw.pw_uid, "group": pw.pw_gid}
        proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, **kwargs)
        out.close()
        self.pid = proc.pid
        self.extra["popen"] = proc
        return self

    def wait_healthy(self, timeout: float = 20) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.get("/health")[0] == 200:
                return
            time.sleep(0.05)
        raise RuntimeError(f"fake server on {self.port} not healthy: {self.log.read_text()[-500:]}")

    def get(self, path: str) -> tuple[int | None, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
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
