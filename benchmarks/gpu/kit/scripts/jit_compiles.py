"""Kernels compiled while a level ran: the files the server's JIT caches gained meanwhile.

A kernel that Triton or TVM-FFI compiles at its first call stalls the step that calls it for
0.1-1 s, and a server meets such calls at each new shape, once per machine: the first server
of a fresh machine compiles what later servers load from the cache. v1's first server on a
machine ran slower than later ones three times (RESULTS.md, 2026-12-02 and 2026-12-05) with
the host's CPUs and the GPU's clocks the same; whether it compiled during its levels is what
this records. The client runs beside the server with the same environment (the kit's run.sh
exports ``TRITON_CACHE_DIR`` and ``TVM_FFI_CACHE_DIR`` for both), so the cache directories it
reads are the server's:

    with JitCompiles() as jit:
        ...                                   # the level
    level["jit_compiled"] = jit.summary()

Per cache: how many files appeared, and the kernels they name (Triton's ``<kernel>.json``
metadata, TVM-FFI's built ``.so`` libraries). Reads only; None where no cache directory exists.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# (name in the summary, environment variable, default directory when it is unset)
CACHES = (
    ("triton", "TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"),
    ("tvm_ffi", "TVM_FFI_CACHE_DIR", None),
)
NAMED_BY = {"triton": ".json", "tvm_ffi": ".so"}


def cache_dirs(env: Mapping[str, str]) -> dict[str, Path]:
    dirs = {}
    for name, variable, default in CACHES:
        path = Path(env[variable]) if env.get(variable) else default
        if path is not None:
            dirs[name] = path
    return dirs


def files_under(root: Path) -> set[str]:
    """Every file below ``root``, relative to it; empty if there is no such directory."""
    if not root.is_dir():
        return set()
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


class JitCompiles:
    """The JIT caches' new files between entering and leaving (a context manager)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.dirs = cache_dirs(os.environ if env is None else env)
        self.before: dict[str, set[str]] = {}
        self.new: dict[str, set[str]] = {}

    def __enter__(self) -> JitCompiles:
        self.before = {name: files_under(path) for name, path in self.dirs.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        self.new = {name: files_under(path) - self.before[name]
                    for name, path in self.dirs.items()}

    def summary(self) -> dict[str, Any] | None:
        """None if no cache directory existed at either end."""
        seen = {name for name, path in self.dirs.items()
                if self.before.get(name) or self.new.get(name) or path.is_dir()}
        if not seen:
            return None
        out = {}
        for name in sorted(seen):
            files = self.new.get(name, set())
            kernels = sorted({Path(f).name.removesuffix(NAMED_BY[name]) for f in files
                              if f.endswith(NAMED_BY[name]) and not Path(f).name.startswith("__")})
            out[name] = {"new_files": len(files), "kernels": kernels}
        return out
