from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import remote_harness as harness
from remote_harness import HOSTILE, OP_USER, FakeServer, Sshd

_counter = itertools.count()
_HOSTS: list[Host] = []


@pytest.fixture(scope="session")
def remote_base() -> Iterator[Path]:
    base = harness.make_base()
    yield base
    harness.kill_matching(str(base))
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def sshd(remote_base: Path) -> Iterator[Sshd]:
    (remote_base / "sshd").mkdir()
    server = harness.start_sshd(remote_base / "sshd")
    yield server
    server.stop()
    harness.kill_matching(str(remote_base))
    harness.remove_test_accounts()


@pytest.fixture(scope="session")
def pristine_venvs(remote_base: Path):
    cache: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in cache:
            cache[version] = harness.build_venv(remote_base / "venvs" / version, version)
        return cache[version]

    return get


class Host:
    """One simulated GPU box: a hostile-path venv with a real release, and its fake server."""

    def __init__(self, sshd: Sshd, root: Path, venv: Path) -> None:
        self.sshd = sshd
        self.root = root
        self.venv = venv
        self.servers: list[FakeServer] = []

    @property
    def package(self) -> Path:
        return harness.package_dir(self.venv)

    @property
    def state(self) -> Path:
        return self.package.parent / ".dynspec-patch"

    def options(self, user: str = OP_USER, **kw: object):
        from dynspec_patch.patcher.remote_commands import HostOptions

        return HostOptions(host="127.0.0.1", port=self.sshd.port, user=user,
                           identity_file=str(self.sshd.client_key),
                           known_hosts=str(self.sshd.known_hosts),
                           ssh_config=str(self.sshd.base / "ssh_config"), **kw)

    def stop_servers(self) -> None:
        harness.kill_matching(str(self.root))

    def server(self, *args: str, env: dict[str, str] | None = None, port: int | None = None,
               user: str | None = None, start: bool = True, healthy: bool = True) -> FakeServer:
        port = port or harness.free_port()
        cwd = self.root / "cwd with 'quotes' and $(echo x)"
        cwd.mkdir(exist_ok=True)
        if user:
            subprocess.run(["chown", user, str(cwd)], check=True)
        argv = [str(self.venv / "bin" / "python"), "-m", "sglang.launch_server",
                "--model-path", str(self.root / "model dir"), "--port", str(port), *args]
        full_env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
                    "DYNSPEC_TEST_TAG": "a;b $(x) 'q'", **(env or {})}
        srv = FakeServer(self.venv, cwd, port, argv, full_env, self.root / "server.log", user,
                         ns_init=self.sshd.ns_init)
        self.servers.append(srv)
        if start:
            srv.start()
            if healthy:
                srv.wait_healthy()
        return srv


@pytest.fixture
def make_host(sshd: Sshd, remote_base: Path, pristine_venvs) -> Iterator:
    made: list[Host] = []

    def make(version: str = "0.5.10.post1", owner: str | None = None) -> Host:
        root = remote_base / "hosts" / f"h{next(_counter)}" / HOSTILE
        root.mkdir(parents=True)
        os.chmod(root.parent, 0o755)
        venv = root / "venv"
        subprocess.run(["cp", "-a", str(pristine_venvs(version)), str(venv)], check=True)
        if owner:
            subprocess.run(["chown", "-R", owner, str(root)], check=True)
        host = Host(sshd, root, venv)
        made.append(host)
        _HOSTS.append(host)
        return host

    yield make
    for host in made:
        harness.kill_matching(str(host.root))


@pytest.fixture(autouse=True)
def _no_pwned(remote_base: Path) -> Iterator[None]:
    yield
    for home in ("/", "/root", f"/home/{OP_USER}", f"/home/{harness.PLAIN_USER}"):
        for name in ("pwned", "pwned2"):
            assert not os.path.exists(os.path.join(home, name)), f"shell injection: {home}/{name}"
    for host in list(_HOSTS):
        for d in (host.root, host.root.parent, *(srv.cwd for srv in host.servers)):
            hits = list(d.glob("pwned*"))
            assert not hits, f"shell injection created {hits}"
    _HOSTS.clear()


def pytest_collection_modifyitems(items: list) -> None:
    for item in items:
        if "tests/remote" in str(item.fspath):
            item.add_marker(pytest.mark.ssh)

