from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import remote_harness as harness
from remote_harness import HOSTILE, OP_USER, FakeServer, Sshd

_counter = itertools.count()
_HOSTS: list[Host] = []
_DOCKER_TIMINGS: dict[str, float] = {}  # printed in the summary when the container tier ran


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



@pytest.fixture
def box(sshd: Sshd, tmp_path: Path, monkeypatch) -> str:
    """``gpu-box``: an ssh_config alias for the loopback sshd, found via DYNSPEC_SSH_CONFIG."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host gpu-box\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {OP_USER}\n"
                   f"  IdentityFile {sshd.client_key}\n  UserKnownHostsFile {sshd.known_hosts}\n")
    monkeypatch.setenv("DYNSPEC_SSH_CONFIG", str(cfg))
    return "gpu-box"


# --------------------------------------------------------------------------- Docker containers


@pytest.fixture(scope="session")
def docker_engine(sshd: Sshd, remote_base: Path) -> Iterator:
    """A real dockerd (Debian's docker.io) on the test host, stopped at the end of the session."""
    import docker_harness

    engine = docker_harness.start_engine(remote_base / "docker", sshd.ns_init, harness._TAG)
    engine.timings = _DOCKER_TIMINGS
    _DOCKER_TIMINGS["dockerd start (until it answers)"] = engine.started_in
    yield engine
    stopping = time.perf_counter()
    engine.stop()
    _DOCKER_TIMINGS["dockerd stop (containers removed)"] = time.perf_counter() - stopping


def pytest_terminal_summary(terminalreporter) -> None:
    if _DOCKER_TIMINGS:
        terminalreporter.section("Docker engine timings (s)")
        for name, seconds in _DOCKER_TIMINGS.items():
            terminalreporter.write_line(f"{name:<40} {seconds:8.2f}")


@pytest.fixture(scope="session")
def sglang_image(docker_engine, remote_base: Path) -> str:
    """``dynspec-test/sglang:0.5.10.post1``: a root fs made here, imported offline."""
    import docker_harness

    tag = "dynspec-test/sglang:0.5.10.post1"
    started = time.perf_counter()
    docker_harness.build_rootfs(remote_base / "rootfs", "0.5.10.post1")
    docker_engine.timings["rootfs build"] = time.perf_counter() - started
    docker_engine.timings["docker import"] = docker_harness.import_image(
        docker_engine, remote_base / "rootfs", tag)
    shutil.rmtree(remote_base / "rootfs")
    return tag


class ContainerHost:
    """The test host with one SGLang server running in a Docker container (host network)."""

    def __init__(self, sshd: Sshd, engine, image: str) -> None:
        self.sshd = sshd
        self.engine = engine
        self.image = image
        self.names: list[str] = []
        self.ids: set[str] = set()

    def options(self, **kw: object):
        from dynspec_patch.patcher.remote_commands import HostOptions

        kw.setdefault("docker_client", "/usr/bin/docker")
        return HostOptions(host="127.0.0.1", port=self.sshd.port, user=OP_USER,
                           identity_file=str(self.sshd.client_key),
                           known_hosts=str(self.sshd.known_hosts),
                           ssh_config=str(self.sshd.base / "ssh_config"), **kw)

    def run(self, *args: str, env: dict[str, str] | None = None, extra: tuple[str, ...] = (),
            image: str | None = None, command: list[str] | None = None) -> tuple[str, int]:
        import docker_harness

        port = harness.free_port()
        name = f"sglang-{harness._TAG}-{next(_counter)}"
        self.names.append(name)
        started = time.perf_counter()
        self.ids.add(docker_harness.run_container(
            self.engine, image or self.image, name,
            docker_harness.server_argv(port, *args) if command is None else command, env, extra))
        docker_harness.wait_healthy(port)
        self.engine.timings.setdefault("docker run until healthy (first)",
                                       time.perf_counter() - started)
        return name, port

    def remove(self) -> None:
        """Remove the containers, and what the agent kept for them in the host's /tmp (the
        per-container lock, restart-command logs)."""
        if not self.names:
            return
        ids = self.engine.cli("inspect", "-f", "{{.Id}}", *self.names,
                              check=False).stdout.decode().split()
        self.engine.cli("rm", "-f", *self.names, check=False)
        for cid in self.ids | set(ids):  # a --restart-cmd may have re-created one
            shutil.rmtree(f"/tmp/dynspec-patch-container-{cid[:12]}", ignore_errors=True)
            for log in Path("/tmp").glob(f"dynspec-patch-{cid[:12]}-*.log"):
                log.unlink()


@pytest.fixture
def container_host(sshd: Sshd, docker_engine, sglang_image: str) -> Iterator[ContainerHost]:
    made = ContainerHost(sshd, docker_engine, sglang_image)
    yield made
    made.remove()


# --------------------------------------------------------------------------- fleets


class Fleet:
    """Builds fleets of hosts (own sshd each) and sglang-routers; stops them all at teardown."""

    def __init__(self, base: Path, pristine_venvs) -> None:
        self.base = base
        self.pristine_venvs = pristine_venvs
        self.hosts: list = []
        self.routers: list = []

    def __call__(self, count: int, env: dict[int, dict[str, str]] | None = None,
                 release: str = "0.5.10.post1") -> list:
        import fleet_harness

        base = self.base / f"fleet{next(_counter)}"
        hosts, _ = fleet_harness.make_fleet(base, self.pristine_venvs(release), count, env)
        self.hosts += hosts
        return hosts

    def router(self, hosts: list, options: tuple[str, ...] = ()):
        import fleet_harness

        router = fleet_harness.Router.start(hosts[0].root.parent,
                                            [h.worker_url for h in hosts], options=options)
        self.routers.append(router)
        return router

    def close(self) -> None:
        for router in self.routers:
            router.stop()
        for host in self.hosts:
            host.stop()


@pytest.fixture
def fleet(sshd: Sshd, remote_base: Path, pristine_venvs) -> Iterator[Fleet]:
    """``fleet(n)``: n hosts, each its own sshd + venv + fake server; ``fleet.router(hosts)``."""
    made = Fleet(remote_base / "fleets", pristine_venvs)
    yield made
    made.close()
