"""The agent's lock and journal, run in this process on a local tree (mutants of
``patcher.remote_agent`` that no in-process test saw: see tools/mutation.py). Over SSH the same
functions run on the host's own python3, where a mutant cannot."""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import re
import stat
from pathlib import Path

import pytest

from dynspec_patch.patcher import remote_agent as agent


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    pkg = tmp_path / "sglang"
    (pkg / "srt").mkdir(parents=True)
    state = tmp_path / agent.STATE_DIRNAME
    state.mkdir()
    return pkg, state


@pytest.fixture(autouse=True)
def _no_lock_held():
    agent._lock_fd = None
    yield
    if agent._lock_fd is not None:
        os.close(agent._lock_fd)
    agent._lock_fd = None


def test_the_state_dir_is_beside_the_package():
    assert agent.state_dir_for("/opt/site/sglang") == "/opt/site/.dynspec-patch"


def test_the_lock_is_taken_once_and_names_its_holder(tmp_path: Path):
    state = tmp_path / "new" / agent.STATE_DIRNAME
    agent.take_lock(str(state))
    fd = agent._lock_fd
    assert stat.S_IMODE(state.stat().st_mode) == 0o755
    line = (state / "lock").read_text()
    assert re.fullmatch(rf"pid {os.getpid()} user \S+ since "
                        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\n", line)
    agent.take_lock(str(state))  # the second request of the same command keeps it
    assert agent._lock_fd == fd
    assert agent.lock_holder(str(state)) == line.strip()


def test_sudo_user_is_named_as_the_holder(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SUDO_USER", "alice")
    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
    try:
        agent.hold_flock(fd, "busy")
        assert (tmp_path / "lock").read_text().startswith(f"pid {os.getpid()} user alice since ")
    finally:
        os.close(fd)


def test_a_held_lock_is_busy_with_its_holder_and_the_fd_closed(tmp_path: Path):
    path = tmp_path / "lock"
    path.write_text("pid 7 user bob since then\n")
    holder = os.open(path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(agent.Busy) as busy:
            agent.hold_flock(fd, "another run holds it")
        assert str(busy.value) == "another run holds it (pid 7 user bob since then)"
        with pytest.raises(OSError):
            os.fstat(fd)  # closed
        path.write_text("")
        fd = os.open(path, os.O_RDWR)
        with pytest.raises(agent.Busy, match=r"^x \(unknown holder\)$"):
            agent.hold_flock(fd, "x")
        assert agent.lock_holder(str(tmp_path)) == "unknown holder"
    finally:
        os.close(holder)
    assert agent.lock_holder(str(tmp_path)) is None
    assert agent.lock_holder(str(tmp_path / "nowhere")) is None


def test_a_state_dir_that_cannot_be_made_is_not_swallowed(tmp_path: Path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        agent.take_lock(str(tmp_path / "file" / agent.STATE_DIRNAME))


def test_json_files_read_as_missing_corrupt_or_their_value(tmp_path: Path):
    assert agent.read_json(str(tmp_path / "none.json")) is None
    (tmp_path / "bad.json").write_text("{")
    assert agent.read_json(str(tmp_path / "bad.json")) == {"corrupt": True}
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert agent.read_json(str(tmp_path / "ok.json")) == {"a": 1}
    assert agent.read_bytes(str(tmp_path / "ok.json" / "under-a-file")) is None
    assert agent.sha256_file(str(tmp_path / "ok.json")) == sha(b'{"a": 1}')
    assert agent.sha256_file(str(tmp_path / "none")) is None


def test_an_atomic_write_leaves_no_temp_file_and_copies_the_mode_asked_for(tmp_path: Path):
    like = tmp_path / "like.py"
    like.write_text("")
    os.chmod(like, 0o600)
    agent.write_atomic(str(tmp_path / "a.py"), b"A", like=str(like))
    assert stat.S_IMODE((tmp_path / "a.py").stat().st_mode) == 0o600
    agent.write_atomic(str(tmp_path / "b.py"), b"B", like=str(tmp_path / "missing"))
    assert stat.S_IMODE((tmp_path / "b.py").stat().st_mode) == 0o644 & ~_umask()
    agent.write_atomic(str(tmp_path / "c.py"), b"C", mode=0o640)
    assert stat.S_IMODE((tmp_path / "c.py").stat().st_mode) == 0o640 & ~_umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py", "b.py", "c.py", "like.py"]
    assert (tmp_path / "a.py").read_bytes() == b"A"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_finish_commit_writes_the_manifest_and_the_restart_mark(tree):
    _pkg, state = tree
    (state / "originals").mkdir()
    (state / "journal.json").write_text("{}")
    agent.finish_commit(str(state), {"manifest": b64(b"M1"), "pending": {"port": 1},
                                     "clear_backup": False})
    assert (state / "manifest.json").read_bytes() == b"M1"
    assert json.loads((state / "restart-pending.json").read_text()) == {"port": 1}
    assert (state / "originals").is_dir() and not (state / "journal.json").exists()
    (state / "journal.json").write_text("{}")
    agent.finish_commit(str(state), {"pending": None, "clear_pending": False})  # no manifest key
    assert (state / "manifest.json").read_bytes() == b"M1"
    assert (state / "restart-pending.json").exists()
    (state / "journal.json").write_text("{}")
    agent.finish_commit(str(state), {"manifest": None, "clear_backup": True})
    assert not (state / "manifest.json").exists() and not (state / "originals").exists()
    assert not (state / "restart-pending.json").exists()  # clear_pending defaults to true


def _journal(state: Path, files: list[dict], manifest: bytes | None = b"NEW") -> None:
    (state / "journal.json").write_text(json.dumps(
        {"files": files, "manifest": b64(manifest) if manifest else None, "pending": None}))


def _undo_meta(state: Path, pkg: Path, files: dict[str, bytes | None],
               manifest: bytes | None = b"OLD", **extra: object) -> None:
    undo = state / "undo"
    entries = []
    for path, before in files.items():
        if before is not None:
            (undo / path).parent.mkdir(parents=True, exist_ok=True)
            (undo / path).write_bytes(before)
        entries.append({"path": path, "existed": before is not None,
                        "sha": sha(before) if before is not None else None})
    (undo / "meta.json").write_text(json.dumps(
        {"files": entries, "manifest": b64(manifest) if manifest else None, **extra}))


def test_an_interrupted_commit_whose_staged_files_are_intact_is_finished(tree):
    pkg, state = tree
    (pkg / "srt/a.py").write_bytes(b"A1")  # renamed already
    (pkg / "srt/b.py").write_bytes(b"B0")
    staged = pkg / "srt/.b.py.dynspec-stage.tmp"
    staged.write_bytes(b"B1")
    (pkg / "srt/gone.py").write_bytes(b"G0")
    _journal(state, [
        {"path": "srt/a.py", "after_sha": sha(b"A1"), "tmp": None},
        {"path": "srt/b.py", "after_sha": sha(b"B1"), "tmp": str(staged)},
        {"path": "srt/gone.py", "after_sha": None, "tmp": None},
        {"path": "srt/never.py", "after_sha": None, "tmp": None}])
    done = agent.recover_journal(str(state), str(pkg))
    assert done == {"action": "rolled-forward", "files": ["srt/b.py", "srt/gone.py"]}
    assert (pkg / "srt/b.py").read_bytes() == b"B1" and not staged.exists()
    assert not (pkg / "srt/gone.py").exists()
    assert (state / "manifest.json").read_bytes() == b"NEW"
    assert not (state / "journal.json").exists()
    assert "recovered interrupted commit by finishing it (2 files)" in (
        state / "audit.log").read_text()
    assert agent.recover_journal(str(state), str(pkg)) is None


def test_an_interrupted_commit_with_a_lost_staged_file_is_undone(tree):
    pkg, state = tree
    (pkg / "srt/a.py").write_bytes(b"A1")
    (pkg / "srt/b.py").write_bytes(b"B0")
    _journal(state, [{"path": "srt/a.py", "after_sha": sha(b"A1"), "tmp": None},
                     {"path": "srt/b.py", "after_sha": sha(b"B1"),
                      "tmp": str(pkg / "srt/.b.py.lost.tmp")}])
    _undo_meta(state, pkg, {"srt/a.py": b"A0", "srt/b.py": b"B0"})
    assert agent.recover_journal(str(state), str(pkg)) == {"action": "rolled-back"}
    assert (pkg / "srt/a.py").read_bytes() == b"A0"
    assert (state / "manifest.json").read_bytes() == b"OLD"
    assert not (state / "journal.json").exists()
    assert "recovered interrupted commit by undoing it" in (state / "audit.log").read_text()


def test_undo_puts_back_files_manifest_and_mark(tree):
    pkg, state = tree
    (pkg / "srt/a.py").write_bytes(b"A1")
    (pkg / "srt/added.py").write_bytes(b"N")
    (state / "manifest.json").write_bytes(b"NEW")
    (state / "originals").mkdir()
    _undo_meta(state, pkg, {"srt/a.py": b"A0", "srt/added.py": None}, manifest=None,
               pending={"port": 2})
    assert agent.undo(str(state), str(pkg)) == ["srt/a.py", "srt/added.py"]
    assert (pkg / "srt/a.py").read_bytes() == b"A0" and not (pkg / "srt/added.py").exists()
    assert sorted(p.name for p in (pkg / "srt").iterdir()) == ["a.py"]
    assert not (state / "manifest.json").exists() and not (state / "originals").exists()
    assert json.loads((state / "restart-pending.json").read_text()) == {"port": 2}
    _undo_meta(state, pkg, {"srt/a.py": b"A0"}, manifest=b"KEEP")
    (state / "originals").mkdir()
    agent.undo(str(state), str(pkg))
    assert (state / "manifest.json").read_bytes() == b"KEEP"
    assert (state / "originals").is_dir() and not (state / "restart-pending.json").exists()


def test_undo_of_a_commit_that_did_not_manage_the_manifest_leaves_it(tree):
    pkg, state = tree
    (state / "manifest.json").write_bytes(b"M")
    (state / "originals").mkdir()
    (pkg / "srt/a.py").write_bytes(b"A1")
    _undo_meta(state, pkg, {"srt/a.py": b"A0"}, manifest=None, manifest_managed=False)
    agent.undo(str(state), str(pkg))
    assert (state / "manifest.json").read_bytes() == b"M" and (state / "originals").is_dir()


def test_undo_refuses_without_information_or_with_a_damaged_copy(tree):
    pkg, state = tree
    with pytest.raises(agent.Refused) as none:
        agent.undo(str(state), str(pkg))
    assert str(none.value) == f"no undo information in {state / 'undo'}"
    (state / "undo").mkdir()
    (state / "undo" / "meta.json").write_text("{")
    with pytest.raises(agent.Refused, match=r"^no undo information in "):
        agent.undo(str(state), str(pkg))
    _undo_meta(state, pkg, {"srt/a.py": b"A0"})
    (state / "undo" / "srt/a.py").write_bytes(b"damaged")
    (pkg / "srt/a.py").write_bytes(b"A1")
    with pytest.raises(agent.Refused) as damaged:
        agent.undo(str(state), str(pkg))
    assert str(damaged.value) == "undo copy of srt/a.py is damaged"
    assert (pkg / "srt/a.py").read_bytes() == b"A1"


@pytest.mark.parametrize(("argv", "value"), [
    (["--port", "1"], "1"), (["--port", "1", "--next"], "1"), (["--port=2"], "2"),
    (["--port", "1", "--port=3"], "3"),
    (["--port"], None), (["--portx=1", "--ports", "2"], None), ([], None)])
def test_a_flags_last_value_wins(argv, value):
    assert agent.flag_value(argv, "--port") == value


@pytest.mark.parametrize(("argv", "server"), [
    (["python3", "-m", "sglang.launch_server"], True),
    (["python3", "-msglang.launch_server"], True),
    (["python3", "-m"], False),
    (["/usr/bin/sglang", "serve", "--model", "m"], True),
    (["python3", "/x/sglang", "serve"], True),
    (["python3", "a", "sglang", "serve"], False),
    (["python3", "/opt/sglang/launch_server.py"], True),
    (["/opt/sglang/launch_server.py"], True),
    (["python3", "x", "/opt/sglang/launch_server.py"], False),
    (["sglang"], False), ([], False)])
def test_server_argv_forms(argv, server):
    assert agent.is_server_argv(argv) is server


@pytest.fixture
def umask_zero():
    old = os.umask(0)
    yield
    os.umask(old)


def test_the_lock_files_modes_do_not_depend_on_the_umask(tmp_path: Path, umask_zero):
    state = tmp_path / agent.STATE_DIRNAME
    agent.take_lock(str(state))
    assert stat.S_IMODE(state.stat().st_mode) == 0o755
    assert stat.S_IMODE((state / "lock").stat().st_mode) == 0o644


def test_an_existing_state_dir_is_locked_and_a_held_one_names_its_holder(tree):
    _pkg, state = tree
    (state / "lock").write_text("pid 3 user carol since then\n")
    holder = os.open(state / "lock", os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(agent.Busy) as busy:
            agent.take_lock(str(state))
        assert str(busy.value) == (f"another dynspec-patch run holds {state / 'lock'} "
                                   "(pid 3 user carol since then)")
    finally:
        os.close(holder)
    agent.take_lock(str(state))
    assert agent._lock_fd is not None


def test_a_state_dir_it_may_not_write_is_refused_in_one_line(tmp_path: Path, monkeypatch):
    import errno
    import getpass

    def denied(*_args, **_kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "makedirs", denied)
    with pytest.raises(agent.Refused) as refused:
        agent.take_lock(str(tmp_path / agent.STATE_DIRNAME))
    assert str(refused.value) == (
        f"{tmp_path} is not writable by {getpass.getuser()} (and sudo -n is not available): "
        "nothing was written")

    def read_only(*_args, **_kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "makedirs", read_only)
    with pytest.raises(agent.Refused) as refused:
        agent.take_lock(str(tmp_path / agent.STATE_DIRNAME))
    assert str(refused.value) == f"{tmp_path} is on a read-only filesystem: nothing was written"


def test_a_holder_line_that_is_not_utf8_is_still_shown(tmp_path: Path):
    path = tmp_path / "lock"
    path.write_bytes(b"pid 9 user \xff since then\n")
    holder = os.open(path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        assert agent.lock_holder(str(tmp_path)) == "pid 9 user \ufffd since then"
        fd = os.open(path, os.O_RDWR)
        with pytest.raises(agent.Busy) as busy:
            agent.hold_flock(fd, "x")
        assert str(busy.value) == "x (pid 9 user \ufffd since then)"
    finally:
        os.close(holder)


def test_the_holder_line_is_stamped_in_utc_whatever_the_zone(tmp_path: Path, monkeypatch):
    import datetime
    import time

    from dynspec_patch.patcher import local

    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+5:30: a local stamp is hours off
    time.tzset()
    try:
        fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
        try:
            agent.hold_flock(fd, "busy")
        finally:
            os.close(fd)
        lines = [(tmp_path / "lock").read_text(), local._lock_line()]
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    now = datetime.datetime.now(datetime.UTC)
    for line in lines:
        stamp = datetime.datetime.strptime(line.split(" since ")[1].strip(),
                                           "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
        assert abs((now - stamp).total_seconds()) < 600, line


def test_temporary_files_are_written_beside_their_target(tree, monkeypatch):
    pkg, state = tree
    renamed = []
    real_rename = os.rename

    def recording_rename(src, dst):
        renamed.append((src, dst))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", recording_rename)
    agent.write_atomic(str(state / "manifest.json"), b"M")
    (pkg / "srt/a.py").write_bytes(b"A1")
    _undo_meta(state, pkg, {"srt/a.py": b"A0"})
    agent.undo(str(state), str(pkg))
    assert renamed[0] == (str(state / f".manifest.json.dynspec-{os.getpid()}.tmp"),
                          str(state / "manifest.json"))
    assert (str(pkg / "srt/.a.py.dynspec-undo.tmp"), str(pkg / "srt/a.py")) in renamed


def test_a_journal_without_files_still_finishes(tree):
    pkg, state = tree
    (state / "journal.json").write_text(json.dumps({"manifest": b64(b"M")}))
    assert agent.recover_journal(str(state), str(pkg)) == {"action": "rolled-forward",
                                                          "files": []}
    assert (state / "manifest.json").read_bytes() == b"M"


def test_recoveries_are_audited_word_for_word(tree):
    pkg, state = tree
    (pkg / "srt/a.py").write_bytes(b"A0")
    staged = pkg / "srt/.a.py.dynspec-stage.tmp"
    staged.write_bytes(b"A1")
    _journal(state, [{"path": "srt/a.py", "after_sha": sha(b"A1"), "tmp": str(staged)}])
    agent.recover_journal(str(state), str(pkg))
    _journal(state, [{"path": "srt/a.py", "after_sha": sha(b"A2"), "tmp": None}])
    _undo_meta(state, pkg, {"srt/a.py": b"A0"})
    agent.recover_journal(str(state), str(pkg))
    lines = [line.split(" ", 1)[1] for line in (state / "audit.log").read_text().splitlines()]
    assert lines == ["recovered interrupted commit by finishing it (1 files)",
                     "recovered interrupted commit by undoing it"]


def test_clearing_originals_that_were_never_saved_is_not_an_error(tree):
    pkg, state = tree
    (state / "journal.json").write_text("{}")
    agent.finish_commit(str(state), {"manifest": None, "clear_backup": True})
    (pkg / "srt/a.py").write_bytes(b"A1")
    _undo_meta(state, pkg, {"srt/a.py": b"A0"}, manifest=None)
    agent.undo(str(state), str(pkg))
    assert not (state / "originals").exists()
