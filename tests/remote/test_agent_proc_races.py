"""The remote agent reads ``/proc`` while processes come and go: one that exits between being
listed and being read is gone, not an error (issue 13, 2a: a healthy host was rolled back with
``restart failed: [Errno 3] No such process``).

The race is made deterministic with a real process: the agent opens ``/proc/PID/<file>`` of a
child of this test, the child is killed and reaped before the agent reads the open file, and
the kernel answers that read with ``ESRCH`` (``ProcessLookupError``), exactly as it does when a
short-lived process on a busy host exits at that moment.
"""

from __future__ import annotations

import builtins
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from dynspec_patch.patcher import remote_agent

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
# argv that the agent takes for a server (``-m sglang.launch_server``), so it reads its status too
SERVER_LIKE = [*SLEEPER, "-m", "sglang.launch_server", "--port", "1"]


class VanishOnRead:
    """``open`` for the agent's module: opening ``/proc/<victim>/<name>`` kills and reaps the
    victim before the agent gets the file, so the agent's read meets the vanished process."""

    def __init__(self, victim: subprocess.Popen, name: str) -> None:
        self.victim = victim
        self.prefix = f"/proc/{victim.pid}/{name}"
        self.vanished = False

    def __call__(self, path, *args, **kwargs):
        fh = builtins.open(path, *args, **kwargs)  # noqa: SIM115 - the agent closes it
        if str(path) == self.prefix and not self.vanished:
            self.victim.kill()
            self.victim.wait()  # reaped: the /proc entry is gone, the open file reads ESRCH
            self.vanished = True
        return fh


@pytest.fixture
def victim() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(SERVER_LIKE)
    # Until the child has exec'd, /proc/PID/cmdline is still this test's, and the agent would
    # not take it for a server (a race that made the [status] case fail under load).
    argv = "\0".join(SERVER_LIKE).encode()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
            if fh.read().rstrip(b"\0") == argv:
                break
        time.sleep(0.01)
    else:
        pytest.fail("the victim process never exec'd its argv")
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _vanish(monkeypatch, victim: subprocess.Popen, name: str) -> VanishOnRead:
    hook = VanishOnRead(victim, name)
    monkeypatch.setattr(remote_agent, "open", hook, raising=False)
    return hook


def test_the_kernel_answers_a_read_of_a_reaped_process_with_esrch(victim):
    """The premise of the tests below, on this machine's kernel."""
    with open(f"/proc/{victim.pid}/stat", "rb") as fh:
        victim.kill()
        victim.wait()
        with pytest.raises(ProcessLookupError):
            fh.read()


@pytest.mark.parametrize("name", ["stat", "cmdline", "status"])
def test_a_process_that_exits_while_it_is_read_is_skipped_by_find_servers(
        monkeypatch, victim, name):
    hook = _vanish(monkeypatch, victim, name)
    servers = remote_agent.find_servers()
    assert hook.vanished, f"the agent never read /proc/PID/{name} of a listed process"
    assert victim.pid not in [s["pid"] for s in servers]


def test_the_process_tree_is_stopped_while_an_unrelated_process_exits(monkeypatch, victim):
    """``stop_tree`` (the restart's first step) walks every process's ``stat``."""
    tree = subprocess.Popen([sys.executable, "-c",
                             "import subprocess, sys, time\n"
                             f"subprocess.Popen({SLEEPER!r})\n"
                             "time.sleep(120)"], start_new_session=True)
    try:
        deadline = time.time() + 10
        while not remote_agent.descendants(tree.pid) and time.time() < deadline:
            time.sleep(0.05)
        child = remote_agent.descendants(tree.pid)
        assert child, "the test tree's child never started"
        hook = _vanish(monkeypatch, victim, "stat")
        done = remote_agent.stop_tree({"pid": tree.pid}, stop_timeout=10)
        assert hook.vanished
        assert set(done["stopped"]) == {tree.pid, *child}
        tree.wait(timeout=10)
        assert not remote_agent.alive(child[0])
    finally:
        if tree.poll() is None:
            os.killpg(tree.pid, signal.SIGKILL)
            tree.wait()
