"""A fleet on this machine: several SGLang "hosts", a real sglang-router, a load generator.

Each ``FleetHost`` is its own OpenSSH ``sshd`` (its own port on 127.0.0.1, host key, client key
and PID namespace, so the remote agent sees that host's server only), its own copy of a venv
with a real pinned release, and a fake server (``fake/fake_server.py``) on its own port. All
servers report one model path, a local directory holding a tiny ``tokenizer.json``, so the
router (which loads the tokenizer of each model it sees) never looks anything up online.

``Router`` runs the real ``sglang-router`` (PyPI) on 127.0.0.1 with retries off, so a request
that hits a stopped server fails instead of being retried elsewhere. ``Load`` sends bounded
``/generate`` traffic through it from a few threads and counts what failed.

Used by tests/remote/test_fleet_*.py and benchmarks/fleet.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import remote_harness as harness
from remote_harness import HOSTILE, OP_USER, FakeServer, Sshd

ROOT = Path(__file__).resolve().parents[2]
SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")
# A WordLevel tokenizer in the Hugging Face tokenizers format: what the router loads.
TOKENIZER = {
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
    "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "ping": 1, "pong": 2},
              "unk_token": "[UNK]"},
}


def _bin(name: str) -> str:
    """A console script of the Python that runs the tests (the project's venv)."""
    return str(Path(sys.executable).parent / name)


@dataclass
class FleetHost:
    name: str
    sshd: Sshd
    root: Path
    venv: Path
    server: FakeServer | None = None

    @property
    def package(self) -> Path:
        return harness.package_dir(self.venv)

    @property
    def state(self) -> Path:
        return self.package.parent / ".dynspec-patch"

    @property
    def worker_url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    def start_server(self, model: Path, env: dict[str, str] | None = None) -> FakeServer:
        port = harness.free_port()
        cwd = self.root / "cwd"
        cwd.mkdir(exist_ok=True)
        argv = [str(self.venv / "bin" / "python"), "-m", "sglang.launch_server",
                "--model-path", str(model), "--port", str(port), *SPEC]
        full_env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
                    "SGLANG_ENABLE_SPEC_V2": "1", "FAKE_SGLANG_GENERATE_SECONDS": "0.2",
                    **(env or {})}
        self.server = FakeServer(self.venv, cwd, port, argv, full_env, self.root / "server.log",
                                 ns_init=self.sshd.ns_init)
        self.server.start()
        return self.server

    def inventory_vars(self) -> dict[str, object]:
        return {
            "ansible_host": "127.0.0.1", "ansible_port": self.sshd.port,
            "ansible_user": OP_USER,
            "ansible_ssh_private_key_file": str(self.sshd.client_key),
            "ansible_ssh_common_args": f"-o UserKnownHostsFile={self.sshd.known_hosts} "
                                       "-o StrictHostKeyChecking=yes",
        }

    def options(self):
        from dynspec_patch.patcher.remote_commands import HostOptions

        return HostOptions(host="127.0.0.1", port=self.sshd.port, user=OP_USER,
                           identity_file=str(self.sshd.client_key),
                           known_hosts=str(self.sshd.known_hosts),
                           ssh_config=str(self.sshd.base / "ssh_config"))

    def stop(self) -> None:
        self.sshd.stop()  # PID 1 of the namespace: its servers die with it
        harness.kill_matching(str(self.root))
        if self.server is not None:  # its nsenter ends with the namespace: reap it
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.extra["popen"].wait(timeout=30)


def make_fleet(base: Path, pristine: Path, count: int,
               env: dict[int, dict[str, str]] | None = None) -> tuple[list[FleetHost], Path]:
    """``count`` hosts under ``base``, each serving; ``env[i]`` adds to host i's server env."""
    model = base / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    hosts = []
    for i in range(count):
        hbase = base / f"host{i}"
        (hbase / "sshd").mkdir(parents=True)
        sshd = harness.start_sshd(hbase / "sshd")
        root = hbase / HOSTILE
        root.mkdir()
        venv = root / "venv"
        subprocess.run(["cp", "-a", str(pristine), str(venv)], check=True)
        host = FleetHost(f"gpu{i}", sshd, root, venv)
        hosts.append(host)
        host.start_server(model, (env or {}).get(i))
    for host in hosts:
        assert host.server is not None
        host.server.wait_healthy()
    return hosts, model


def write_inventory(path: Path, hosts: list[FleetHost], group: str = "sglang") -> Path:
    """A YAML inventory (JSON is YAML) with each host's own sshd port, key and known_hosts."""
    path.write_text(json.dumps({group: {"hosts": {h.name: h.inventory_vars() for h in hosts}}}))
    return path


def ansible_playbook(workdir: Path, inventory: Path, *args: str,
                     timeout: float = 300) -> subprocess.CompletedProcess:
    """``ansible-playbook`` of the project's venv, with the repository's collection on the
    collections path and everything Ansible writes kept under ``workdir``."""
    (workdir / "ansible.cfg").write_text("[defaults]\nretry_files_enabled = False\n")
    env = {**os.environ, "ANSIBLE_CONFIG": str(workdir / "ansible.cfg"),
           "ANSIBLE_COLLECTIONS_PATH": str(ROOT), "ANSIBLE_HOME": str(workdir / "ansible-home"),
           "ANSIBLE_LOCAL_TEMP": str(workdir / "ansible-tmp"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_DEPRECATION_WARNINGS": "0",
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    return subprocess.run([_bin("ansible-playbook"), "-i", str(inventory), *args],
                          cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def recap(output: str) -> dict[str, dict[str, int]]:
    """The PLAY RECAP lines: host -> {ok, changed, unreachable, failed, skipped, ...}."""
    lines = output.split("PLAY RECAP", 1)[1].splitlines()[1:]
    table: dict[str, dict[str, int]] = {}
    for line in lines:
        name, sep, counts = line.partition(":")
        if not sep or "=" not in counts:
            continue
        table[name.strip()] = {k: int(v) for k, v in
                               (pair.split("=") for pair in counts.split())}
    return table


@dataclass
class Router:
    """The real sglang-router on 127.0.0.1 in front of ``workers``."""

    url: str
    proc: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, workdir: Path, workers: list[str], timeout: float = 60,
              options: tuple[str, ...] = ()) -> Router:
        """``options``: more ``sglang-router launch`` options (its health checks, say)."""
        port, metrics = harness.free_port(), harness.free_port()
        log = workdir / "router.log"
        out = open(log, "wb")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            [_bin("sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
             "--policy", "round_robin", "--disable-retries", "--log-level", "warn",
             *options, "--worker-urls", *workers],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        out.close()
        router = cls(f"http://127.0.0.1:{port}", proc, log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listed = router.healthy_workers()
            if listed is not None and set(workers) <= listed:
                return router
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        router.stop()
        raise RuntimeError(f"sglang-router did not list {workers}: {log.read_text()[-2000:]}")

    def workers(self) -> list[dict] | None:
        try:
            with urllib.request.urlopen(self.url + "/workers", timeout=5) as resp:
                return json.loads(resp.read())["workers"]
        except (OSError, ValueError, KeyError):
            return None

    def health(self) -> dict[str, bool] | None:
        """Every listed worker's URL and whether the router counts it healthy."""
        listed = self.workers()
        return None if listed is None else {w["url"]: bool(w.get("is_healthy")) for w in listed}

    def healthy_workers(self) -> set[str] | None:
        listed = self.workers()
        return None if listed is None else {w["url"] for w in listed if w.get("is_healthy")}

    def looked_online(self) -> bool:
        """Did the router try to fetch anything from the internet (a tokenizer)?"""
        text = self.log.read_text(errors="replace")
        return "huggingface" in text.lower() or "https://" in text

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@dataclass
class LoadReport:
    ok: int = 0
    failed: int = 0
    reasons: Counter = field(default_factory=Counter)
    # (server port, server pid) -> requests: each host's PIDs are its own namespace's
    answered_by: Counter = field(default_factory=Counter)
    seconds: float = 0.0


class Load:
    """``clients`` threads POST ``/generate`` through the router until ``stop()``, at most
    ``max_seconds`` and ``max_requests`` in all (bounded: it always stops by itself)."""

    def __init__(self, url: str, clients: int = 6, max_seconds: float = 300,
                 max_requests: int = 50_000) -> None:
        self.url = url
        self.clients = clients
        self.max_seconds = max_seconds
        self.max_requests = max_requests
        self.report = LoadReport()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = 0.0

    def _one(self) -> None:
        body = json.dumps({"text": "ping", "sampling_params": {"max_new_tokens": 1}}).encode()
        request = urllib.request.Request(self.url + "/generate", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                answer = json.loads(resp.read())
            meta = answer.get("meta_info", {})
            server, reason = (meta.get("fake_port"), meta.get("fake_pid")), None
            if "text" not in answer:
                reason = "no text in the answer"
        except urllib.error.HTTPError as exc:
            server, reason = None, f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            server, reason = None, type(exc).__name__
        with self._lock:
            if reason is None:
                self.report.ok += 1
                self.report.answered_by[server] += 1
            else:
                self.report.failed += 1
                self.report.reasons[reason] += 1

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                sent = self.report.ok + self.report.failed
            if sent >= self.max_requests or time.monotonic() - self._started > self.max_seconds:
                return
            self._one()

    def start(self) -> Load:
        self._started = time.monotonic()
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(self.clients)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> LoadReport:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        self.report.seconds = time.monotonic() - self._started
        return self.report
