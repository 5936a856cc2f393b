"""An SGLang tree on this machine: find it, snapshot it, write a plan into it atomically.

Every new file is written to a temporary file in its target's directory and compiled with
``py_compile`` first; only when all of them compile are they renamed into place, so a
failure leaves the tree as it was. The manifest and backups of the originals live in
``<parent of the sglang package>/.dynspec-patch/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import py_compile
import tempfile
from collections.abc import Mapping
from pathlib import Path

from patcher.engine import SNAPSHOT_PATHS, Plan, next_manifest
from patcher.errors import DynspecError, RefusedError, UsageError
from patcher.manifest import MANIFEST_NAME, STATE_DIR_NAME, FileRecord, Manifest
from transforms.native_adaptive import CONFIG_FILE_NAME


def resolve_sglang_dir(root: Path) -> Path:
    """The ``sglang`` package directory for DIR: the package itself, a checkout, a site-packages."""
    for candidate in (root, root / "python" / "sglang", root / "sglang"):
        if (candidate / "srt").is_dir() and (candidate / "__init__.py").exists():
            return candidate.resolve()
    raise UsageError(f"not an SGLang package directory or checkout: {root}")


def read_snapshot(
    package: Path, paths: tuple[str, ...] = SNAPSHOT_PATHS
) -> dict[str, bytes | None]:
    snapshot: dict[str, bytes | None] = {}
    for relpath in paths:
        try:
            snapshot[relpath] = (package / relpath).read_bytes()
        except FileNotFoundError:
            snapshot[relpath] = None
        except OSError as exc:
            raise DynspecError(f"cannot read {package / relpath}: {exc.strerror}") from exc
    return snapshot


def state_dir(package: Path) -> Path:
    return package.parent / STATE_DIR_NAME


def native_config_path(package: Path) -> Path:
    return state_dir(package) / CONFIG_FILE_NAME


def read_manifest(package: Path) -> Manifest | None:
    path = state_dir(package) / MANIFEST_NAME
    try:
        return Manifest.from_bytes(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise DynspecError(f"unreadable manifest {path}: {exc}") from exc


def _atomic_write(target: Path, data: bytes, mode: int | None = None) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _stage(target: Path, data: bytes) -> Path:
    """Write ``data`` beside ``target`` with its mode, and prove it compiles."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".dynspec-tmp")
    staged = Path(tmp)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    if target.exists():
        os.chmod(staged, target.stat().st_mode & 0o7777)
    else:
        os.chmod(staged, 0o644)
    compiled = staged.with_name(staged.name + ".pyc")
    try:
        py_compile.compile(str(staged), cfile=str(compiled), dfile=str(target), doraise=True)
    except py_compile.PyCompileError as exc:
        staged.unlink()
        raise RefusedError(
            f"{target} would not compile: {exc.msg.strip().splitlines()[-1]}"
        ) from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            compiled.unlink()
    return staged


def write_plan(package: Path, plan: Plan) -> None:
    """Write every change of ``plan``: all staged and compiled first, then renamed in order."""
    if plan.refused:
        raise RefusedError(plan.refusal_reason)
    changes = plan.changes
    staged: dict[str, Path] = {}
    try:
        for change in changes:
            if change.after is not None:
                staged[change.path] = _stage(package / change.path, change.after)
    except BaseException:
        for path in staged.values():
            path.unlink(missing_ok=True)
        raise
    done = []
    try:
        for change in changes:
            target = package / change.path
            if change.after is None:
                target.unlink()
            else:
                os.replace(staged.pop(change.path), target)
            done.append(change)
    except OSError as exc:
        for change in reversed(done):  # put back what was already replaced
            target = package / change.path
            if change.before is None:
                target.unlink(missing_ok=True)
            else:
                _atomic_write(target, change.before)
        for path in staged.values():
            path.unlink(missing_ok=True)
        raise DynspecError(f"writing {exc.filename} failed ({exc.strerror}); restored") from exc
    _record(package, plan)


def _record(package: Path, plan: Plan) -> None:
    """Keep the manifest (and backups of originals) in step with what was written."""
    directory = state_dir(package)
    previous = read_manifest(package)
    known = previous.by_path() if previous else {}
    for change in plan.changes:
        backup = directory / "originals" / change.path
        if plan.operation == "revert":
            backup.unlink(missing_ok=True)
        elif change.path not in known and change.before is not None and not backup.exists():
            backup.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(backup, change.before)
    manifest = next_manifest(previous, plan)
    manifest_path = directory / MANIFEST_NAME
    if manifest is None:
        manifest_path.unlink(missing_ok=True)
        return
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_write(manifest_path, manifest.to_bytes())


def recorded_files(package: Path) -> Mapping[str, FileRecord]:
    manifest = read_manifest(package)
    return manifest.by_path() if manifest else {}


def write_native_config(package: Path, config: Mapping[str, object]) -> Path:
    path = native_config_path(package)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, (json.dumps(config, indent=2) + "\n").encode())
    return path
