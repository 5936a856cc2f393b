"""The CLI run as a user runs it: its own process, ``python -m dynspec_patch.patcher.cli``."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynspec_patch.patcher.cli", *argv],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )
