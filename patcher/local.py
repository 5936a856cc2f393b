"""An SGLang tree on this machine: find it, snapshot it, write a plan into it with the same
guards as the remote agent (``patcher/remote_agent.py``), whose journal format it shares.

``locked(package)`` holds ``<state>/lock`` (``flock``, released by the kernel if we die) for the
whole command, finishes or undoes a commit an earlier run left half done (its journal), and
removes temporary files an interrupted run left beside the targets. ``write_plan`` then:

1. writes every new file to a temporary file beside its target and compiles it
   (``py_compile``); any failure leaves the tree untouched;
2. saves undo copies, the true originals (first apply) and a journal holding the next
   manifest, and writes that manifest — all before any target is replaced;
3. renames every staged file into place; an ``OSError`` (disk full, permissions, read-only)
   puts the undo copies back; a kill leaves the journal for the next run to finish.

The state lives in ``<parent of the sglang package>/.dynspec-patch/``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import getpass
import json
import os
import py_compile
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dynspec_patch.patcher import remote_agent
from dynspec_patch.patcher.engine import SNAPSHOT_PATHS, Plan, next_manifest
from dynspec_patch.patcher.errors import DynspecError, RefusedError, UsageError
from dynspec_patch.patcher.manifest import (
    MANIFEST_NAME,
    STATE_DIR_NAME,
    FileRecord,
    Manifest,
    sha256_or_none,
)
from dynspec_patch.transforms.native_adaptive import CONFIG_FILE_NAME

LOCK_NAME = "lock"
JOURNAL_NAME = "journal.json"
TEMP_MARK = ".dynspec-"  # every temporary file we (or the agent) write carries it
FAULT_ENV = "DYNSPEC_TEST_FAULT"  # die-mid-commit: exit between two renames (tests only)


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


def read_originals(package: Path, paths: tuple[str, ...] = SNAPSHOT_PATHS) -> dict[str, bytes]:
    """The originals saved at first apply (for ``revert --restore-originals``)."""
    saved = {}
    for relpath in paths:
        with contextlib.suppress(OSError):
            saved[relpath] = (state_dir(package) / "originals" / relpath).read_bytes()
    return saved


# --------------------------------------------------------------------------- the lock


@dataclass
class LockedTree:
    """A tree held by this run: what the lock's housekeeping found on the way in."""

    package: Path
    recovered: str | None = None  # how an interrupted commit was finished, if there was one
    removed_temp_files: list[str] = field(default_factory=list)

    def report(self) -> dict[str, object]:
        return {
            "recovered_interrupted_commit": self.recovered,
            "removed_temp_files": self.removed_temp_files,
        }


def _lock_line() -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"pid {os.getpid()} user {getpass.getuser()} since {stamp}\n"


@contextlib.contextmanager
def locked(package: Path) -> Iterator[LockedTree]:
    """Hold ``<state>/lock`` for the whole command (refused, exit 3, if another run holds it)."""
    state = state_dir(package)
    path = state / LOCK_NAME
    try:
        state.mkdir(exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RefusedError(
            f"cannot create {path} ({exc.strerror}) as {getpass.getuser()}: nothing was written"
        ) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "unknown holder"
            raise RefusedError(
                f"another dynspec-patch run holds {path} ({holder}): nothing was written"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, _lock_line().encode())
        tree = LockedTree(package)
        tree.recovered = _recover(package, state)
        tree.removed_temp_files = _remove_temp_files(package, state)
        yield tree
    finally:
        os.close(fd)  # releases the flock


def lock_holder(package: Path) -> str | None:
    """Who holds the tree's lock right now (None: nobody); never waits, never creates it."""
    return remote_agent.lock_holder(str(state_dir(package)))


def interrupted(package: Path) -> bool:
    return (state_dir(package) / JOURNAL_NAME).exists()


def _recover(package: Path, state: Path) -> str | None:
    if not (state / JOURNAL_NAME).exists():
        return None
    try:
        done = remote_agent.recover_journal(str(state), str(package))
    except remote_agent.Refused as exc:
        raise RefusedError(
            f"an interrupted commit in {state} cannot be finished or undone: {exc}"
        ) from exc
    return done["action"] if done else None


def _remove_temp_files(package: Path, state: Path) -> list[str]:
    """Temporary files an interrupted run left beside the targets or in the state dir."""
    directories = {(package / relpath).parent for relpath in SNAPSHOT_PATHS} | {state}
    removed = []
    for directory in sorted(directories):
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(directory):
                if entry.name.startswith(".") and TEMP_MARK in entry.name and entry.is_file():
                    os.unlink(entry.path)
                    removed.append(entry.path)
    shutil.rmtree(state / "undo", ignore_errors=True)  # only meaningful with a journal
    return removed


# --------------------------------------------------------------------------- writing


def _atomic_write(target: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".dynspec-tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
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


def _stage_all(package: Path, plan: Plan) -> dict[str, Path]:
    staged: dict[str, Path] = {}
    try:
        for change in plan.changes:
            if change.after is not None:
                staged[change.path] = _stage(package / change.path, change.after)
    except BaseException as exc:
        for path in staged.values():
            path.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise RefusedError(
                f"cannot write beside {exc.filename or package} ({exc.strerror}): "
                "nothing was written"
            ) from exc
        raise
    return staged


def _b64(data: bytes | None) -> str | None:
    return remote_agent.b64(data)


def _prepare(package: Path, plan: Plan, staged: Mapping[str, Path]) -> dict[str, object]:
    """Undo copies, originals, journal and manifest: everything before the first rename."""
    state = state_dir(package)
    state.mkdir(exist_ok=True)
    previous = read_manifest(package)
    known = previous.by_path() if previous else {}
    undo_dir = state / "undo"
    shutil.rmtree(undo_dir, ignore_errors=True)
    undo_dir.mkdir()
    meta: dict[str, object] = {
        "files": [],
        "manifest": _b64(previous.to_bytes()) if previous else None,
        "pending": None,
        "manifest_managed": True,
    }
    files = []
    for change in plan.changes:
        target = package / change.path
        entry = {
            "path": change.path,
            "before_sha": sha256_or_none(change.before),
            "after_sha": sha256_or_none(change.after),
            "tmp": str(staged[change.path]) if change.path in staged else None,
        }
        files.append(entry)
        meta["files"].append(  # type: ignore[attr-defined]
            {"path": change.path, "existed": change.before is not None,
             "sha": entry["before_sha"], "after_sha": entry["after_sha"]}
        )
        if change.before is not None:
            copy = undo_dir / change.path
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(target, copy)
        original = change.first_bytes
        backup = state / "originals" / change.path
        keep = plan.operation == "apply" and change.path not in known and original is not None
        if keep and not backup.exists():
            backup.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(backup, original)  # type: ignore[arg-type]
    _atomic_write(undo_dir / "meta.json", json.dumps(meta).encode())
    manifest = next_manifest(previous, plan)
    journal = {
        "files": files,
        "manifest": _b64(manifest.to_bytes()) if manifest else None,
        "clear_backup": manifest is None,
        "pending": None,
        "clear_pending": False,
        "writer": "local",
    }
    _atomic_write(state / JOURNAL_NAME, json.dumps(journal).encode())
    manifest_path = state / MANIFEST_NAME
    if manifest is None:
        manifest_path.unlink(missing_ok=True)
    else:
        _atomic_write(manifest_path, manifest.to_bytes())
    remote_agent.fsync_dir(str(state))
    return journal


def write_plan(package: Path, plan: Plan) -> None:
    """Write every change of ``plan``: staged and compiled, journalled, then renamed in order.

    On an ``OSError`` after the first byte of state was written, everything is put back
    (files, manifest, originals) and the error is reported in one line.
    """
    if plan.refused:
        raise RefusedError(plan.refusal_reason)
    if not plan.changes:
        return
    staged = _stage_all(package, plan)
    state = str(state_dir(package))
    try:
        journal = _prepare(package, plan, staged)
        for index, change in enumerate(plan.changes):
            target = package / change.path
            if change.after is None:
                target.unlink(missing_ok=True)
            else:
                os.replace(staged[change.path], target)
                del staged[change.path]
            remote_agent.fsync_dir(str(target.parent))
            if index == 0 and len(plan.changes) > 1 and os.environ.get(FAULT_ENV) == (
                "die-mid-commit"
            ):
                os._exit(9)
        remote_agent.finish_commit(state, journal)
    except OSError as exc:
        for path in staged.values():
            path.unlink(missing_ok=True)
        _roll_back(package)
        where = exc.filename or package
        raise DynspecError(
            f"writing {where} failed ({exc.strerror}); every file was restored"
        ) from exc
    shutil.rmtree(Path(state) / "undo", ignore_errors=True)


def _roll_back(package: Path) -> None:
    state = state_dir(package)
    if not (state / "undo" / "meta.json").exists():
        (state / JOURNAL_NAME).unlink(missing_ok=True)
        return  # nothing had been replaced yet, and nothing recorded
    try:
        remote_agent.undo(str(state), str(package))
    except (OSError, remote_agent.Refused) as exc:
        raise DynspecError(
            f"a write failed and restoring the originals failed too ({exc}); the journal in "
            f"{state} lets the next run finish the job"
        ) from exc
    shutil.rmtree(state / "undo", ignore_errors=True)


def recorded_files(package: Path) -> Mapping[str, FileRecord]:
    manifest = read_manifest(package)
    return manifest.by_path() if manifest else {}


def write_native_config(package: Path, config: Mapping[str, object]) -> Path:
    path = native_config_path(package)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, (json.dumps(config, indent=2) + "\n").encode())
    return path


def remove_native_config(package: Path) -> Path | None:
    """Remove the adaptive config ``apply`` wrote (native route); its path, if there was one."""
    path = native_config_path(package)
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    return path
