"""Scratch copies of real pinned SGLang releases (sha256-checked wheels from the cache)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dynspec_patch.patcher.engine import SNAPSHOT_PATHS
from dynspec_patch.patcher.releases import Pin, release_dir


def copy_targets(pin: Pin, dest: Path) -> Path:
    """The files dynspec-patch reads or writes, copied from the pinned release into ``dest``."""
    source = release_dir(pin)
    package = dest / "sglang"
    for relpath in ("__init__.py", *SNAPSHOT_PATHS):
        if (source / relpath).exists():
            (package / relpath).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / relpath, package / relpath)
    return package


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (the sglang dir and its state dir beside it), by path."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def scratch(tmp_path: Path):
    """``scratch(pin)`` -> a fresh sglang dir holding that release's target files."""

    def make(pin: Pin) -> Path:
        return copy_targets(pin, tmp_path / pin.version)

    return make


@pytest.fixture
def snapshot_tree():
    """``snapshot_tree(dir)`` -> every file under dir, by relative path."""
    return tree_bytes
