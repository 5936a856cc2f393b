"""torch.distributed ranks on this machine: one Python process per rank, over gloo on
127.0.0.1, for the tests of what TP ranks must agree on."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_lines_of_ranks(
    script: str,
    world: int,
    args_of: Callable[[int, str], list[str]],
    env: Mapping[str, str] | None = None,
    timeout: float = 180,
) -> list[str]:
    """Run ``python -c script *args_of(rank, port)`` for each rank at once; each rank's last
    line of output, in rank order. A rank that fails fails the call, and the ranks still
    running are killed rather than left waiting for it."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args_of(rank, port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ if env is None else env),
        )
        for rank in range(world)
    ]
    lines = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"rank {rank}: {err}"
            lines.append(out.strip().splitlines()[-1])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return lines
