"""Local apply/revert with the remote agent's guards, on real pinned release files.

Lock, journal, originals and manifest before any rename, rollback on a write failure, cleanup of
an interrupted run's temporary files, the shared three-state judgement, version downgrades, and
files libcst cannot reproduce exactly.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dynspec_patch.patcher import local
from dynspec_patch.patcher.cli import run
from dynspec_patch.patcher.manifest import Manifest
from dynspec_patch.patcher.releases import find_pin
from tests.codemods.cli_process import run_cli

SERVER_ARGS = "srt/server_args.py"
RUNTIME = "srt/speculative/dynspec_fallback.py"
V1 = "srt/speculative/eagle_worker.py"
V2 = "srt/speculative/eagle_worker_v2.py"


def _json_run(capsys, *argv: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = run([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _sources(package: Path) -> dict[str, bytes]:
    """The package's files (what SGLang imports), without the state directory."""
    return {str(p.relative_to(package)): p.read_bytes() for p in package.rglob("*") if p.is_file()}


@pytest.fixture
def release(scratch):
    return scratch(find_pin("0.5.10.post1"))


def test_a_second_run_is_refused_while_one_holds_the_lock(release, capsys):
    before = _sources(release)
    state = local.state_dir(release)
    state.mkdir()
    with open(state / "lock", "a+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.write("pid 4242 user someone since now\n")
        holder.flush()
        assert run(["apply", "--sglang-root", str(release)]) == 3
        assert "another dynspec-patch run holds" in capsys.readouterr().err
        assert _sources(release) == before
        code, out = _json_run(capsys, "status", "--sglang-root", str(release))
        assert code == 0 and out["run_in_progress"].startswith("pid 4242")
    assert run(["apply", "--sglang-root", str(release)]) == 0


# The tool's own lock (``local.locked``, what every writing command holds) in a process of its
# own, until the test closes its stdin.
HOLD_THE_LOCK = """
import sys
from pathlib import Path
from dynspec_patch.patcher import local
with local.locked(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_the_tool_holds_the_lock_exclusively_against_a_second_real_run(release, capsys):
    """Both sides are the tool: a holder through ``local.locked`` in its own process and a
    real ``apply`` process. A shared lock would let both through."""
    before = _sources(release)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(release)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        second = run_cli("apply", "--sglang-root", str(release))
        assert second.returncode == 3, second.stderr
        assert f"another dynspec-patch run holds {local.state_dir(release) / 'lock'}" in (
            second.stderr)
        assert f"(pid {holder.pid} user " in second.stderr
        assert _sources(release) == before
        code, out = _json_run(capsys, "status", "--sglang-root", str(release))
        assert code == 0 and out["run_in_progress"].startswith(f"pid {holder.pid} ")
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0
    assert run_cli("apply", "--sglang-root", str(release)).returncode == 0


def test_kill_between_two_renames_is_finished_by_the_next_run(release, capsys):
    original = _sources(release)
    killed = run_cli(
        "apply", "--sglang-root", str(release), env={"DYNSPEC_TEST_FAULT": "die-mid-commit"}
    )
    assert killed.returncode == 9
    state = local.state_dir(release)
    assert (state / "journal.json").exists()
    assert Manifest.from_bytes((state / "manifest.json").read_bytes()).files  # written first
    code, out = _json_run(capsys, "status", "--sglang-root", str(release))
    assert code == 0
    assert out["tree_state"] == "mixed" and out["interrupted_commit"].startswith("yes")
    code, out = _json_run(capsys, "apply", "--sglang-root", str(release))
    assert code == 0 and out["recovered_interrupted_commit"] == "rolled-forward"
    assert not (state / "journal.json").exists()
    code, out = _json_run(capsys, "status", "--sglang-root", str(release))
    assert code == 0 and out["tree_state"] == "patched" and out["problems"] == []
    assert run(["revert", "--sglang-root", str(release)]) == 0
    assert _sources(release) == original


def _failing_replace(monkeypatch, package: Path, fail_at: int, error: int = errno.ENOSPC) -> list:
    """os.replace fails with ``error`` on the ``fail_at``-th rename of a package file."""
    real = os.replace
    renamed: list[str] = []

    def replace(src, dst, *args, **kwargs):
        if str(dst).startswith(str(package)):
            renamed.append(str(dst))
            if len(renamed) == fail_at:
                raise OSError(error, os.strerror(error), str(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    return renamed


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_a_write_failure_mid_apply_restores_every_file(release, monkeypatch, capsys, error):
    original = _sources(release)
    renamed = _failing_replace(monkeypatch, release, fail_at=3, error=error)
    assert run(["apply", "--sglang-root", str(release)]) == 1
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "every file was restored" in message
    assert os.strerror(error) in message and "Traceback" not in message
    assert len(renamed) == 3
    assert _sources(release) == original
    state = local.state_dir(release)
    assert sorted(p.name for p in state.iterdir()) == ["lock"]  # no manifest, no originals


def test_a_write_failure_mid_revert_leaves_the_tree_patched(release, monkeypatch, capsys):
    assert run(["apply", "--sglang-root", str(release)]) == 0
    patched = _sources(release)
    manifest = (local.state_dir(release) / "manifest.json").read_bytes()
    _failing_replace(monkeypatch, release, fail_at=2)
    assert run(["revert", "--sglang-root", str(release)]) == 1
    assert _sources(release) == patched
    assert (local.state_dir(release) / "manifest.json").read_bytes() == manifest
    monkeypatch.undo()
    assert run(["revert", "--sglang-root", str(release)]) == 0


def test_manifest_originals_and_journal_exist_before_the_first_rename(release, monkeypatch):
    original = (release / SERVER_ARGS).read_bytes()
    state = local.state_dir(release)
    seen: list[tuple[bool, bool, bool]] = []
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if str(dst).startswith(str(release)) and not seen:
            seen.append(
                (
                    (state / "manifest.json").exists(),
                    (state / "journal.json").exists(),
                    (state / "originals" / SERVER_ARGS).read_bytes() == original,
                )
            )
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    assert run(["apply", "--sglang-root", str(release)]) == 0
    assert seen == [(True, True, True)]


def test_temporary_files_of_an_interrupted_run_are_removed_and_reported(release, capsys):
    leftovers = [
        release / "srt" / f".server_args.py.k3j2{local.TEMP_MARK}tmp",
        release / "srt" / f".server_args.py.k3j2{local.TEMP_MARK}tmp.pyc",
        release / "srt" / "speculative" / ".eagle_worker.py.dynspec-stage.tmp",  # the agent's
    ]
    for path in leftovers:
        path.write_text("half")
    unrelated = release / "srt" / ".keep.tmp"
    unrelated.write_text("not ours")
    code, out = _json_run(capsys, "apply", "--sglang-root", str(release))
    assert code == 0
    assert sorted(out["removed_temp_files"]) == sorted(map(str, leftovers))
    assert not any(path.exists() for path in leftovers) and unrelated.exists()


def test_status_flags_hooks_whose_runtime_module_is_missing(release, capsys):
    assert run(["apply", "--sglang-root", str(release)]) == 0
    (release / RUNTIME).unlink()
    code, out = _json_run(capsys, "status", "--sglang-root", str(release))
    assert code == 0 and out["tree_state"] == "mixed"
    assert any("dynspec_fallback.py, which is missing" in p for p in out["problems"])


def test_status_checks_the_manifest_hashes_not_only_the_markers(release, capsys):
    assert run(["apply", "--sglang-root", str(release)]) == 0
    target = release / SERVER_ARGS
    target.write_bytes(target.read_bytes() + b"# edited after apply\n")
    code, out = _json_run(capsys, "status", "--sglang-root", str(release))
    assert code == 0
    assert [f["state_before"] for f in out["files"] if f["path"] == SERVER_ARGS] == ["unknown"]
    assert out["tree_state"] == "mixed"
    assert any(SERVER_ARGS in p and "manifest" in p for p in out["problems"])


def _restamp(package: Path, old: str, new: str) -> None:
    for relpath in (RUNTIME, SERVER_ARGS, V1, V2):
        path = package / relpath
        path.write_bytes(path.read_bytes().replace(f"dynspec-patch {old}".encode(),
                                                   f"dynspec-patch {new}".encode()))


def test_a_newer_tools_patch_is_never_downgraded(release, capsys):
    assert run(["apply", "--sglang-root", str(release)]) == 0
    _restamp(release, "0.1.0", "9.2.0")
    manifest_path = local.state_dir(release) / "manifest.json"  # as that newer tool records it
    recorded = json.loads(manifest_path.read_bytes())
    recorded["tool_version"] = "9.2.0"
    for record in recorded["files"]:
        after = (release / record["path"]).read_bytes()
        record["sha256_after"] = hashlib.sha256(after).hexdigest()
    manifest_path.write_text(json.dumps(recorded))
    newer = _sources(release)
    assert run(["apply", "--sglang-root", str(release)]) == 3
    message = capsys.readouterr().err
    assert "patched by dynspec-patch 9.2.0, newer than this one (0.1.0)" in message
    assert _sources(release) == newer


def test_upgrading_an_old_patch_without_manifest_keeps_the_true_originals(release, capsys):
    original = _sources(release)
    assert run(["apply", "--sglang-root", str(release)]) == 0
    _restamp(release, "0.1.0", "0.0.1")
    for path in local.state_dir(release).iterdir():  # an old tool kept no manifest
        if path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path)
    code, out = _json_run(capsys, "apply", "--sglang-root", str(release))
    assert code == 0 and {f["state_before"] for f in out["files"]} == {"patched"}
    manifest = local.read_manifest(release)
    for record in manifest.files:
        expected = original.get(record.path)
        assert record.sha256_before == (hashlib.sha256(expected).hexdigest() if expected else None)
    saved = local.state_dir(release) / "originals" / SERVER_ARGS
    assert saved.read_bytes() == original[SERVER_ARGS]
    assert run(["revert", "--sglang-root", str(release)]) == 0
    assert _sources(release) == original


def test_a_byte_order_mark_is_refused_in_one_line(release):
    target = release / V1
    target.write_bytes(b"\xef\xbb\xbf" + target.read_bytes())
    before = _sources(release)
    for argv in (["apply"], ["detect-path"], ["status"], ["probe"]):
        done = run_cli(*argv, "--sglang-root", str(release))
        assert "Traceback" not in done.stderr, argv
        if argv == ["apply"]:
            assert done.returncode == 3
            assert done.stderr.count("\n") == 1 and "byte-order mark" in done.stderr
    assert _sources(release) == before


def test_a_file_libcst_cannot_reproduce_exactly_is_refused(release, capsys):
    target = release / SERVER_ARGS
    source = target.read_bytes()
    target.write_bytes(source.replace(b"\nclass ServerArgs", b"\n\x0cclass ServerArgs", 1))
    assert b"\x0c" in target.read_bytes()
    before = _sources(release)
    assert run(["apply", "--sglang-root", str(release)]) == 3
    assert "cannot reproduce this file byte for byte" in capsys.readouterr().err
    assert _sources(release) == before


def test_an_unknown_file_in_a_tree_without_manifest_makes_the_tree_unknown(release, capsys):
    """No manifest (never patched here, or by a tool that kept none): the files alone decide."""
    target = release / SERVER_ARGS
    target.write_text(target.read_text().replace('"--speculative-num-draft-tokens"',
                                                 '"--renamed-by-a-fork"'))
    assert not local.state_dir(release).exists()
    code, out = _json_run(capsys, "status", "--sglang-root", str(release))
    assert code == 0
    assert {f["path"]: f["state_before"] for f in out["files"]}[SERVER_ARGS] == "unknown"
    assert out["tree_state"] == "unknown"
    assert any(p.startswith(f"{SERVER_ARGS}: ") for p in out["problems"])


def test_reapply_over_a_hand_edited_patched_file_is_refused_by_the_manifest_hash(
    release, capsys
):
    """The edit keeps every marker and hook, so only the manifest's sha256 can see it."""
    assert run(["apply", "--sglang-root", str(release)]) == 0
    target = release / SERVER_ARGS
    target.write_bytes(target.read_bytes() + b"# an operator's hot-fix after apply\n")
    before = _sources(release)
    manifest = (local.state_dir(release) / "manifest.json").read_bytes()
    code, out = _json_run(capsys, "apply", "--sglang-root", str(release))
    assert code == 3 and out["exit_code"] == 3 and out["refused"] is True
    refused = {f["path"]: f for f in out["files"] if f["action"] == "refused"}
    assert list(refused) == [SERVER_ARGS]
    assert refused[SERVER_ARGS]["state_before"] == "unknown"
    assert "sha256 differs from the manifest" in refused[SERVER_ARGS]["reason"]
    assert _sources(release) == before
    assert (local.state_dir(release) / "manifest.json").read_bytes() == manifest
