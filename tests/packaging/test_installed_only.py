"""tests/conftest.py's guard: a session that would not test the installed wheel stops at once
(exit 4, one line of reasons) instead of passing on the checkout's files (issue 13)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "packaging" / "test_packaging.py"  # any quick test module


def pytest_session(cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir",
         str(REPO), "-p", "no:cacheprovider", "-q", str(PROBE)],
        cwd=cwd, env={**base, **env}, capture_output=True, text=True, check=False, timeout=300)


def test_the_way_tests_run_sh_runs_it_passes(tmp_path):
    session = pytest_session(tmp_path)
    assert session.returncode == 0, session.stdout + session.stderr


@pytest.mark.parametrize(("where", "env", "reason"), [
    ("checkout", {}, "the working directory"),  # python -m pytest in the checkout
    ("scratch", {"PYTHONPATH": str(REPO)}, f"PYTHONPATH holds {REPO}"),
])
def test_a_session_that_can_import_the_checkout_stops_at_once(tmp_path, where, env, reason):
    session = pytest_session(REPO if where == "checkout" else tmp_path, **env)
    assert session.returncode == pytest.ExitCode.USAGE_ERROR
    (line,) = [line for line in (session.stdout + session.stderr).splitlines()
               if "tests must run the installed wheel" in line]
    assert reason in line and "'import patcher' finds the checkout's patcher/" in line
