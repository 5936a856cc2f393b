"""Local mode's guards in-process, on a small tree and hand-made plans (mutants of
``patcher.local`` that kept the CLI-level tests green: see tools/mutation.py). The plans are
``patcher.engine.Plan`` values as the engine makes them; no SGLang source is parsed."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from dynspec_patch.patcher import local
from dynspec_patch.patcher.engine import FileChange, Plan
from dynspec_patch.patcher.errors import DynspecError, RefusedError, UsageError
from dynspec_patch.patcher.manifest import FileRecord, Manifest, sha256_or_none

ARGS = "srt/server_args.py"
RUNTIME = "srt/speculative/dynspec_fallback.py"


def sha(data: bytes | None) -> str | None:
    return sha256_or_none(data)


@pytest.fixture
def package(tmp_path: Path) -> Path:
    pkg = tmp_path / "site" / "sglang"
    (pkg / "srt" / "speculative").mkdir(parents=True)
    (pkg / "__init__.py").write_bytes(b"")
    (pkg / ARGS).write_bytes(b"A = 0\n")
    os.chmod(pkg / ARGS, 0o600)
    return pkg


def apply_plan(*changes: FileChange) -> Plan:
    return Plan("apply", "0.5.4", "patch", "test plan", changes)


def patch_args(before: bytes = b"A = 0\n", after: bytes = b"A = 1\n") -> FileChange:
    return FileChange(ARGS, before, after, "unpatched", "patched", "patched")


def add_runtime(after: bytes = b"R = 1\n") -> FileChange:
    return FileChange(RUNTIME, None, after, "missing", "patched", "added")


def test_the_package_is_found_in_a_checkout_a_site_packages_or_itself(package: Path):
    site = package.parent
    assert local.resolve_sglang_dir(package) == package.resolve()
    assert local.resolve_sglang_dir(site) == package.resolve()
    checkout = site.parent / "checkout"
    (checkout / "python").mkdir(parents=True)
    (checkout / "python" / "sglang").symlink_to(package)
    assert local.resolve_sglang_dir(checkout) == package.resolve()
    (package / "__init__.py").unlink()
    with pytest.raises(UsageError) as missing:
        local.resolve_sglang_dir(site)
    assert str(missing.value) == f"not an SGLang package directory or checkout: {site}"


def test_a_snapshot_reads_each_file_and_names_one_it_cannot_read(package: Path):
    assert local.read_snapshot(package, (ARGS, RUNTIME)) == {ARGS: b"A = 0\n", RUNTIME: None}
    (package / "srt" / "version.py").mkdir()
    with pytest.raises(DynspecError) as unreadable:
        local.read_snapshot(package, ("srt/version.py",))
    assert str(unreadable.value) == (
        f"cannot read {package / 'srt/version.py'}: Is a directory")


def test_a_damaged_manifest_is_an_error_not_a_missing_one(package: Path):
    assert local.read_manifest(package) is None
    assert local.recorded_files(package) == {}
    state = local.state_dir(package)
    state.mkdir()
    (state / "manifest.json").write_text("{not json")
    with pytest.raises(DynspecError, match=r"^unreadable manifest .*manifest\.json: "):
        local.read_manifest(package)


def test_the_lock_records_its_holder_and_clears_an_interrupted_runs_leftovers(package: Path):
    state = local.state_dir(package)
    state.mkdir()
    leftovers = [package / "srt" / ".server_args.py.abc.dynspec-tmp",
                 package / "srt" / "speculative" / ".x.dynspec-stage.tmp",
                 state / ".manifest.json.q.dynspec-tmp"]
    kept = [package / "srt" / ".hidden", package / "srt" / "server_args.dynspec-tmp",
            package.parent / ".beside.dynspec-tmp"]
    for path in leftovers + kept:
        path.write_bytes(b"x")
    (package / "srt" / ".dir.dynspec-tmp").mkdir()
    (state / "undo").mkdir()
    with local.locked(package) as tree:
        holder = (state / "lock").read_text()
        assert re.fullmatch(rf"pid {os.getpid()} user \S+ since "
                            r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\n", holder)
        assert local.lock_holder(package) == holder.strip()
        assert sorted(tree.removed_temp_files) == sorted(str(p) for p in leftovers)
        assert tree.report() == {"recovered_interrupted_commit": None,
                                 "removed_temp_files": tree.removed_temp_files}
    assert all(p.exists() for p in kept) and not any(p.exists() for p in leftovers)
    assert (package / "srt" / ".dir.dynspec-tmp").is_dir()
    assert not (state / "undo").exists()
    assert local.lock_holder(package) is None


def test_a_held_lock_is_refused_with_its_holder(package: Path):
    state = local.state_dir(package)
    state.mkdir()
    (state / "lock").write_text("pid 1 user someone since then\n")
    fd = os.open(state / "lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        with pytest.raises(RefusedError) as refused, local.locked(package):
            pass
    finally:
        os.close(fd)
    assert str(refused.value) == (f"another dynspec-patch run holds {state / 'lock'} "
                                  "(pid 1 user someone since then): nothing was written")


def test_a_state_dir_that_cannot_be_made_is_refused(package: Path):
    local.state_dir(package).write_text("a file where the state directory goes")
    with pytest.raises(RefusedError) as refused, local.locked(package):
        pass
    assert re.fullmatch(rf"cannot create {re.escape(str(local.state_dir(package) / 'lock'))} "
                        r"\(.+\) as \S+: nothing was written", str(refused.value))


def test_apply_writes_files_manifest_and_first_originals(package: Path):
    local.write_plan(package, apply_plan(patch_args(), add_runtime()))
    assert (package / ARGS).read_bytes() == b"A = 1\n"
    assert stat.S_IMODE((package / ARGS).stat().st_mode) == 0o600  # the target's mode kept
    assert stat.S_IMODE((package / RUNTIME).stat().st_mode) == 0o644
    state = local.state_dir(package)
    assert local.read_manifest(package).files == (
        FileRecord(ARGS, sha(b"A = 0\n"), sha(b"A = 1\n")),
        FileRecord(RUNTIME, None, sha(b"R = 1\n")))
    assert local.read_originals(package, (ARGS, RUNTIME)) == {ARGS: b"A = 0\n"}
    assert not (state / "journal.json").exists() and not (state / "undo").exists()
    assert not local.interrupted(package)
    # a second apply keeps the first original and the first `before`
    local.write_plan(package, apply_plan(patch_args(b"A = 1\n", b"A = 2\n")))
    assert local.read_originals(package, (ARGS,)) == {ARGS: b"A = 0\n"}
    assert local.recorded_files(package)[ARGS] == FileRecord(ARGS, sha(b"A = 0\n"),
                                                            sha(b"A = 2\n"))
    assert sorted(p.name for p in (package / "srt").iterdir()) == [
        "server_args.py", "speculative"]


def test_revert_removes_added_files_the_manifest_and_the_originals(package: Path):
    local.write_plan(package, apply_plan(patch_args(), add_runtime()))
    revert = Plan("revert", "0.5.4", "patch", "", (
        FileChange(ARGS, b"A = 1\n", b"A = 0\n", "patched", "unpatched", "reverted"),
        FileChange(RUNTIME, b"R = 1\n", None, "patched", "unpatched", "removed")))
    local.write_plan(package, revert)
    assert (package / ARGS).read_bytes() == b"A = 0\n"
    assert not (package / RUNTIME).exists()
    assert local.read_manifest(package) is None
    assert not (local.state_dir(package) / "originals").exists()


def test_a_refused_plan_writes_nothing_and_an_empty_one_nothing_either(package: Path):
    refused = apply_plan(FileChange.kept(ARGS, b"A = 0\n", "unknown", "refused", "hand-edited"))
    with pytest.raises(RefusedError) as why:
        local.write_plan(package, refused)
    assert str(why.value) == f"{ARGS}: hand-edited"
    local.write_plan(package, apply_plan(FileChange.kept(ARGS, b"A = 0\n", "patched",
                                                         "unchanged", "")))
    assert not local.state_dir(package).exists()


def test_a_file_that_would_not_compile_is_refused_before_anything_is_written(package: Path):
    with pytest.raises(RefusedError) as refused:
        local.write_plan(package, apply_plan(add_runtime(), patch_args(after=b"A = (\n")))
    assert re.fullmatch(rf"{re.escape(str(package / ARGS))} would not compile: .+",
                        str(refused.value))
    assert "\n" not in str(refused.value)
    assert (package / ARGS).read_bytes() == b"A = 0\n"
    assert not (package / RUNTIME).exists() and not local.state_dir(package).exists()
    assert sorted(p.name for p in (package / "srt").rglob("*")) == [
        "server_args.py", "speculative"]


def test_a_file_that_cannot_be_staged_is_refused_in_one_line(package: Path):
    missing_dir = FileChange("srt/nowhere/x.py", None, b"X = 1\n", "missing", "patched", "added")
    with pytest.raises(RefusedError) as refused:
        local.write_plan(package, apply_plan(patch_args(), missing_dir))
    assert re.fullmatch(rf"cannot write beside {re.escape(str(package / 'srt/nowhere'))}/"
                        r"\.x\.py\.\w+\.dynspec-tmp \(No such file or directory\): "
                        "nothing was written", str(refused.value))
    assert sorted(p.name for p in (package / "srt").iterdir()) == [
        "server_args.py", "speculative"]


def test_a_write_failure_after_the_journal_restores_every_file(package: Path):
    local.write_plan(package, apply_plan(patch_args()))
    manifest = (local.state_dir(package) / "manifest.json").read_bytes()
    # the second target is a directory: its undo copy fails after the first was prepared
    (package / "srt" / "speculative" / "eagle_worker.py").mkdir()
    second = FileChange("srt/speculative/eagle_worker.py", b"", b"W = 1\n", "unpatched",
                        "patched", "patched")
    with pytest.raises(DynspecError) as failed:
        local.write_plan(package, apply_plan(patch_args(b"A = 1\n", b"A = 2\n"), second))
    assert str(failed.value) == (
        f"writing {package / 'srt/speculative/eagle_worker.py'} failed (Is a directory); "
        "every file was restored")
    assert (package / ARGS).read_bytes() == b"A = 1\n"
    assert (local.state_dir(package) / "manifest.json").read_bytes() == manifest
    assert not local.interrupted(package)
    assert [p.name for p in (package / "srt").iterdir() if p.name.startswith(".")] == []


def test_the_native_config_is_written_whole_and_removed(package: Path):
    path = local.write_native_config(package, {"threshold": 8})
    assert path == local.state_dir(package) / local.CONFIG_FILE_NAME
    assert json.loads(path.read_text()) == {"threshold": 8}
    assert path.read_text().endswith("}\n")
    assert local.remove_native_config(package) == path
    assert not path.exists()
    assert local.remove_native_config(package) is None


def test_an_interrupted_commit_is_finished_by_the_next_lock(package: Path):
    state = local.state_dir(package)
    state.mkdir()
    new_manifest = Manifest("0.5.4", (FileRecord(ARGS, sha(b"A = 0\n"), sha(b"A = 1\n")),))
    (package / ARGS).write_bytes(b"A = 1\n")  # the rename happened, the commit did not finish
    journal = {"files": [{"path": ARGS, "before_sha": sha(b"A = 0\n"),
                          "after_sha": sha(b"A = 1\n"), "tmp": None}],
               "manifest": local._b64(new_manifest.to_bytes()), "clear_backup": False,
               "pending": None, "clear_pending": False, "writer": "local"}
    (state / "journal.json").write_text(json.dumps(journal))
    assert local.interrupted(package)
    with local.locked(package) as tree:
        assert tree.recovered is not None
    assert not local.interrupted(package)
    assert local.read_manifest(package).files == new_manifest.files


def args_and_worker_plan(package: Path) -> Plan:
    """Two changes in two directories, the second nested: srt/ and srt/speculative/."""
    (package / WORKER).write_bytes(b"W = 0\n")
    return apply_plan(patch_args(), FileChange(WORKER, b"W = 0\n", b"W = 1\n", "unpatched",
                                               "patched", "patched"))


WORKER = "srt/speculative/eagle_worker.py"


def test_the_journal_and_undo_record_are_in_the_format_the_agent_shares(package: Path):
    local.write_plan(package, apply_plan(patch_args()))  # a previous manifest
    previous = (local.state_dir(package) / "manifest.json").read_bytes()
    plan = apply_plan(patch_args(b"A = 1\n", b"A = 2\n"), add_runtime())
    staged = local._stage_all(package, plan)
    journal = local._prepare(package, plan, staged)
    state = local.state_dir(package)
    manifest = (state / "manifest.json").read_bytes()
    assert json.loads((state / "journal.json").read_text()) == journal == {
        "files": [{"path": ARGS, "before_sha": sha(b"A = 1\n"), "after_sha": sha(b"A = 2\n"),
                   "tmp": str(staged[ARGS])},
                  {"path": RUNTIME, "before_sha": None, "after_sha": sha(b"R = 1\n"),
                   "tmp": str(staged[RUNTIME])}],
        "manifest": local._b64(manifest), "clear_backup": False, "pending": None,
        "clear_pending": False, "writer": "local"}
    assert json.loads((state / "undo" / "meta.json").read_text()) == {
        "files": [{"path": ARGS, "existed": True, "sha": sha(b"A = 1\n"),
                   "after_sha": sha(b"A = 2\n")},
                  {"path": RUNTIME, "existed": False, "sha": None, "after_sha": sha(b"R = 1\n")}],
        "manifest": local._b64(previous), "pending": None, "manifest_managed": True}
    assert (state / "undo" / ARGS).read_bytes() == b"A = 1\n"
    assert Manifest.from_bytes(manifest).files == (
        FileRecord(ARGS, sha(b"A = 0\n"), sha(b"A = 2\n")),
        FileRecord(RUNTIME, None, sha(b"R = 1\n")))


def test_a_commit_killed_between_two_renames_is_finished_by_the_next_run(package: Path):
    import subprocess
    import sys

    plan = args_and_worker_plan(package)
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from dynspec_patch.patcher import local\n"
        "from dynspec_patch.patcher.engine import FileChange, Plan\n"
        "changes = (FileChange('srt/server_args.py', b'A = 0\\n', b'A = 1\\n', 'unpatched',"
        " 'patched', 'patched'), FileChange('srt/speculative/eagle_worker.py', b'W = 0\\n',"
        " b'W = 1\\n', 'unpatched', 'patched', 'patched'))\n"
        "local.write_plan(Path(sys.argv[1]), Plan('apply', '0.5.4', 'patch', '', changes))\n")
    env = {**os.environ, local.FAULT_ENV: "die-mid-commit"}
    killed = subprocess.run([sys.executable, "-c", script, str(package)], env=env, check=False)
    assert killed.returncode == 9
    assert (package / ARGS).read_bytes() == b"A = 1\n"
    assert (package / WORKER).read_bytes() == b"W = 0\n"  # the second rename never happened
    assert local.interrupted(package)
    with local.locked(package) as tree:
        assert tree.recovered == "rolled-forward"
    assert (package / WORKER).read_bytes() == b"W = 1\n"
    assert local.read_manifest(package).files == (
        FileRecord(ARGS, sha(b"A = 0\n"), sha(b"A = 1\n")),
        FileRecord(WORKER, sha(b"W = 0\n"), sha(b"W = 1\n")))
    assert local.read_originals(package, (ARGS, WORKER)) == {ARGS: b"A = 0\n", WORKER: b"W = 0\n"}
    assert plan.changes  # the plan written in the child is this one
    # one change has no second rename to die before: the fault never fires
    one_change = script.replace(", FileChange('srt/spec", ",)#")
    assert "changes = (FileChange(" in one_change and ",)#" in one_change
    one = subprocess.run([sys.executable, "-c", one_change, str(package)], env=env, check=False)
    assert one.returncode == 0


def test_a_commit_whose_staged_file_was_lost_is_undone_to_the_previous_manifest(package: Path):
    local.write_plan(package, apply_plan(patch_args()))
    state = local.state_dir(package)
    previous = (state / "manifest.json").read_bytes()
    (package / WORKER).write_bytes(b"W = 0\n")
    plan = apply_plan(patch_args(b"A = 1\n", b"A = 2\n"),
                      FileChange(WORKER, b"W = 0\n", b"W = 1\n", "unpatched", "patched",
                                 "patched"))
    staged = local._stage_all(package, plan)
    local._prepare(package, plan, staged)
    os.replace(staged[ARGS], package / ARGS)
    staged[WORKER].unlink()  # killed, and the staged file is gone
    with local.locked(package) as tree:
        assert tree.recovered == "rolled-back"
    assert (package / ARGS).read_bytes() == b"A = 1\n"
    assert (package / WORKER).read_bytes() == b"W = 0\n"
    assert (state / "manifest.json").read_bytes() == previous
    assert local.read_originals(package, (ARGS,)) == {ARGS: b"A = 0\n"}


def test_a_restore_that_fails_says_the_journal_will_finish_it(package: Path):
    plan = args_and_worker_plan(package)
    staged = local._stage_all(package, plan)
    local._prepare(package, plan, staged)
    state = local.state_dir(package)
    (state / "undo" / ARGS).write_bytes(b"damaged")
    with pytest.raises(DynspecError) as failed:
        local._roll_back(package)
    assert str(failed.value) == (
        f"a write failed and restoring the originals failed too (undo copy of {ARGS} is "
        f"damaged); the journal in {state} lets the next run finish the job")
    assert local.interrupted(package) and (state / "undo").is_dir()


def test_a_roll_back_before_any_undo_record_only_drops_the_journal(package: Path):
    state = local.state_dir(package)
    state.mkdir()
    (state / "journal.json").write_text("{}")
    local._roll_back(package)
    assert not local.interrupted(package)


def test_a_restart_mark_left_by_a_remote_run_outlives_a_local_write(package: Path):
    state = local.state_dir(package)
    state.mkdir()
    (state / "restart-pending.json").write_text('{"port": 30000}')
    local.write_plan(package, apply_plan(patch_args()))
    assert json.loads((state / "restart-pending.json").read_text()) == {"port": 30000}


def test_an_atomic_write_that_fails_leaves_no_temp_file(package: Path, monkeypatch):
    target = package / "srt" / "manifest.json"
    renamed = []

    def failing_replace(src, dst):
        renamed.append(Path(src))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        local._atomic_write(target, b"{}")
    assert renamed[0].parent == target.parent
    assert re.fullmatch(r"\.manifest\.json\.\w+\.dynspec-tmp", renamed[0].name)
    assert not renamed[0].exists() and not target.exists()


def test_staging_compiles_beside_the_target_and_reports_the_error_line(package: Path,
                                                                        monkeypatch):
    monkeypatch.chdir(package.parent)
    with pytest.raises(RefusedError) as refused:
        local._stage(package / ARGS, b"A = (\n")
    assert str(refused.value) == (
        f"{package / ARGS} would not compile: SyntaxError: '(' was never closed")
    staged = local._stage(package / ARGS, b"A = 2\n")
    assert staged.read_bytes() == b"A = 2\n"
    assert sorted(p.name for p in package.parent.iterdir()) == ["sglang"]
    assert sorted(p.name for p in (package / "srt").iterdir()) == sorted(
        ["server_args.py", "speculative", staged.name])


def test_a_rename_that_fails_midway_puts_the_renamed_file_back(package: Path, monkeypatch):
    local.write_plan(package, apply_plan(patch_args()))
    state = local.state_dir(package)
    manifest = (state / "manifest.json").read_bytes()
    plan = args_and_worker_plan(package)
    plan = apply_plan(patch_args(b"A = 1\n", b"A = 2\n"), plan.files[1])
    real_replace = os.replace
    renames = []

    def second_rename_fails(src, dst):
        if Path(dst) == package / WORKER:
            raise OSError(28, "No space left on device", str(dst))
        renames.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", second_rename_fails)
    with pytest.raises(DynspecError) as failed:
        local.write_plan(package, plan)
    monkeypatch.undo()
    assert package / ARGS in [Path(p) for p in renames]  # the first rename had happened
    assert str(failed.value) == (f"writing {package / WORKER} failed (No space left on "
                                 "device); every file was restored")
    assert (package / ARGS).read_bytes() == b"A = 1\n"
    assert (package / WORKER).read_bytes() == b"W = 0\n"
    assert (state / "manifest.json").read_bytes() == manifest
    assert not (state / "undo").exists() and not local.interrupted(package)
    assert not [p for p in (package / "srt").rglob(".*")]


def test_the_native_config_is_rewritten_in_place(package: Path):
    local.write_native_config(package, {"threshold": 8})
    path = local.write_native_config(package, {"threshold": 16, "steps": [1, 2]})
    assert path.read_text() == '{\n  "threshold": 16,\n  "steps": [\n    1,\n    2\n  ]\n}\n'


def test_files_in_one_nested_directory_are_saved_and_restored(package: Path, monkeypatch):
    v2 = "srt/speculative/eagle_worker_v2.py"
    (package / WORKER).write_bytes(b"W = 0\n")
    (package / v2).write_bytes(b"V = 0\n")
    plan = apply_plan(FileChange(WORKER, b"W = 0\n", b"W = 1\n", "unpatched", "patched",
                                 "patched"),
                      FileChange(v2, b"V = 0\n", b"V = 1\n", "unpatched", "patched", "patched"))
    real_replace = os.replace

    def last_rename_fails(src, dst):
        if Path(dst) == package / v2:
            raise OSError(28, "No space left on device", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", last_rename_fails)
    with pytest.raises(DynspecError, match=r"every file was restored$"):
        local.write_plan(package, plan)
    monkeypatch.undo()
    assert (package / WORKER).read_bytes() == b"W = 0\n"
    local.write_plan(package, plan)
    assert local.read_originals(package, (WORKER, v2)) == {WORKER: b"W = 0\n", v2: b"V = 0\n"}


def test_a_file_already_in_the_manifest_gets_no_new_original(package: Path):
    local.write_plan(package, apply_plan(patch_args()))
    shutil.rmtree(local.state_dir(package) / "originals")
    local.write_plan(package, apply_plan(
        FileChange(ARGS, b"A = 1\n", b"A = 2\n", "patched", "patched", "patched",
                   original=b"A = 0\n")))
    assert not (local.state_dir(package) / "originals").exists()


def test_revert_of_a_tree_without_a_manifest_removes_nothing_it_lacks(package: Path):
    (package / ARGS).write_bytes(b"A = 1\n")  # patched by an old tool that kept no manifest
    local.write_plan(package, Plan("revert", "0.5.4", "patch", "", (
        FileChange(ARGS, b"A = 1\n", b"A = 0\n", "patched", "unpatched", "reverted"),)))
    assert (package / ARGS).read_bytes() == b"A = 0\n"
    assert local.read_manifest(package) is None


def test_an_interrupted_commit_that_cannot_be_finished_or_undone_is_refused(package: Path):
    state = local.state_dir(package)
    state.mkdir()
    (state / "journal.json").write_text(json.dumps({"files": [
        {"path": ARGS, "before_sha": sha(b"A = 0\n"), "after_sha": sha(b"A = 9\n"),
         "tmp": str(package / "srt" / ".lost.dynspec-tmp")}]}))
    with pytest.raises(RefusedError) as refused, local.locked(package):
        pass
    assert str(refused.value) == (
        f"an interrupted commit in {state} cannot be finished or undone: no undo information "
        f"in {state / 'undo'}")


def test_a_tree_without_a_speculative_directory_is_locked(package: Path):
    shutil.rmtree(package / "srt" / "speculative")
    with local.locked(package) as tree:
        assert tree.removed_temp_files == []
