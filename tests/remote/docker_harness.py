"""A real Docker engine for the container tests, started inside the test sshd's PID namespace.

Debian's ``docker.io``: ``/usr/sbin/dockerd`` with its own socket, data root and exec root,
``--bridge=none --iptables=false --ip-forward=false --ip-masq=false`` (it changes nothing in
the machine's network), ``--init`` (``docker restart`` would wait 10 s for a Python PID 1), and
a cgroup parent of its own. It runs under ``nsenter`` in the sshd's PID and mount namespaces, so
the containers' processes are on "the host" the remote agent sees over SSH, exactly as on a
GPU box. The client is always ``/usr/bin/docker`` (the package's) with ``-H unix://<ours>``.

The base image is built offline: a root filesystem made here from the machine's own Python
(the interpreter, its standard library, and the shared libraries ``ldd`` names), the real
pinned SGLang release installed ``--no-deps`` from the tool's sha256-checked cache, and the
fake-server hook, then ``docker import``. Containers run with ``--network host``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from remote_harness import FAKE_DIR, _children, outer_pid

from dynspec_patch.patcher.releases import fetch_wheel, find_pin

DOCKER = "/usr/bin/docker"
DOCKERD = "/usr/sbin/dockerd"
PYTHON = "/usr/bin/python3.11"
SITE = "/usr/local/lib/python3.11/dist-packages"  # Debian's python3 reads this first
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
               "pydoc_data", "unittest", "__pycache__"}


@dataclass
class Engine:
    base: Path
    socket: Path
    outer: int  # dockerd as seen from the root namespace
    ns_init: int
    cgroup_parent: str
    log: Path
    started_in: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    def cli(self, *args: str, check: bool = True, timeout: float = 120,
            stdin: bytes | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([DOCKER, "-H", self.host, *args], input=stdin,
                              capture_output=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:3])} failed: "
                               f"{proc.stderr.decode(errors='replace').strip()}")
        return proc

    def inspect(self, name: str) -> dict:
        return json.loads(self.cli("inspect", "--type", "container", name).stdout)[0]

    def stop(self) -> None:
        ids = self.cli("ps", "-aq", check=False).stdout.decode().split()
        if ids:
            self.cli("rm", "-f", *ids, check=False, timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.outer, signal.SIGTERM)
        deadline = time.time() + 20
        while time.time() < deadline and Path(f"/proc/{self.outer}").exists():
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.outer, signal.SIGKILL)
        remove_cgroups(self.cgroup_parent)


def require_docker() -> None:
    """The container tier needs the engine: missing, it fails (CI installs docker.io)."""
    missing = [p for p in (DOCKER, DOCKERD, "/usr/bin/containerd", "/usr/bin/runc")
               if not Path(p).exists()]
    if missing:
        raise RuntimeError(f"the container tests need Debian's docker.io (missing {missing}): "
                           "apt-get install -y --no-install-recommends docker.io")


def remove_cgroups(parent: str) -> None:
    root = Path("/sys/fs/cgroup")
    for top in [root, *(p for p in root.iterdir() if p.is_dir())]:
        mine = top / parent.strip("/")
        if not mine.is_dir():
            continue
        for d in sorted((p for p in mine.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            mine.rmdir()


def start_engine(base: Path, ns_init: int, tag: str) -> Engine:
    require_docker()
    started = time.perf_counter()
    base.mkdir(parents=True, exist_ok=True)
    sock = base / "docker.sock"
    log = base / "dockerd.log"
    parent = f"/dynspec-test-{tag}"
    cmd = ["nsenter", "-t", str(ns_init), "--pid", "--mount", "--",
           DOCKERD, "-H", f"unix://{sock}", "--data-root", str(base / "data"),
           "--exec-root", str(base / "exec"), "--pidfile", str(base / "docker.pid"),
           "--storage-driver=overlay2", "--iptables=false", "--ip-forward=false",
           "--ip-masq=false", "--bridge=none", "--init", f"--cgroup-parent={parent}"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)
    deadline = time.time() + 60
    while True:
        ok = subprocess.run([DOCKER, "-H", f"unix://{sock}", "version"],
                            capture_output=True).returncode == 0
        if ok:
            break
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError(f"dockerd did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    inner = int((base / "docker.pid").read_text().strip())
    children = _children(proc.pid)
    outer = children[0] if children else outer_pid(ns_init, inner)
    return Engine(base, sock, outer, ns_init, parent, log, time.perf_counter() - started)


def _libraries(paths: list[Path]) -> set[str]:
    libs: set[str] = set()
    for path in paths:
        out = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            m = re.search(r"(/\S+)\s+\(0x", line)
            if m:
                libs.add(m.group(1))
    return libs


def build_rootfs(dest: Path, version: str) -> Path:
    """The machine's Python 3.11 and a real SGLang release (``--no-deps``) in a bare tree."""
    stdlib = Path("/usr/lib/python3.11")
    shutil.copytree(stdlib, dest / stdlib.relative_to("/"), symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in STDLIB_SKIP])
    (dest / "usr/bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(PYTHON, dest / "usr/bin/python3.11")
    os.symlink("python3.11", dest / "usr/bin/python3")
    for lib in _libraries([Path(PYTHON), *sorted((stdlib / "lib-dynload").glob("*.so"))]):
        target = dest / lib.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(lib), target)
    for name in ("lib", "lib64", "bin"):  # usrmerge: /lib64/ld-linux... is the loader path
        if not (dest / name).exists():
            (dest / "usr" / name).mkdir(parents=True, exist_ok=True)
            os.symlink(f"usr/{name}", dest / name)
    for d in ("tmp", "etc", "proc", "sys", "dev", "models/toy model", "srv"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    (dest / "tmp").chmod(0o1777)
    (dest / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                     "sglang:x:1000:1000::/srv:/bin/sh\n")
    (dest / "etc/group").write_text("root:x:0:\nsglang:x:1000:\n")
    site = dest / SITE.lstrip("/")
    site.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-compile", "--target", str(site), str(fetch_wheel(find_pin(version)))],
                   check=True, capture_output=True)
    shutil.copy(FAKE_DIR / "_dynspec_fake_hook.py", site / "_dynspec_fake_hook.py")
    shutil.copy(FAKE_DIR / "fake_server.py", site / "_dynspec_fake_server.py")
    (site / "_dynspec_fake.pth").write_text("import _dynspec_fake_hook\n")
    return dest


def import_image(engine: Engine, rootfs: Path, tag: str) -> float:
    started = time.perf_counter()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    assert tar.stdout is not None
    proc = subprocess.run([DOCKER, "-H", engine.host, "import", "-", tag], stdin=tar.stdout,
                          capture_output=True, timeout=300)
    tar.wait()
    if proc.returncode != 0 or tar.returncode != 0:
        raise RuntimeError(f"docker import failed: {proc.stderr.decode(errors='replace')}")
    return time.perf_counter() - started


def server_argv(port: int, *args: str) -> list[str]:
    return ["python3", "-m", "sglang.launch_server", "--model-path", "/models/toy model",
            "--host", "127.0.0.1", "--port", str(port), *args]


def run_container(engine: Engine, image: str, name: str, argv: list[str],
                  env: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> str:
    """``docker run -d --network host`` with the server as the container's command."""
    env_args = [a for k, v in (env or {}).items() for a in ("-e", f"{k}={v}")]
    out = engine.cli("run", "-d", "--pull=never", "--network", "host", "--name", name,
                     "--restart", "unless-stopped", "-w", "/srv", *env_args, *extra,
                     image, *argv)
    return out.stdout.decode().strip()


def wait_healthy(port: int, timeout: float = 30) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"container server on {port} not healthy")


def server_info(port: int) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/get_server_info", timeout=5) as r:
        return json.loads(r.read())
