"""The controller's plan cache: a cached plan equals a fresh one, byte for byte; any change of
input gets its own entry; a damaged entry is planned again; native plans are not stored."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from dynspec_patch.patcher import engine, local, plan_cache
from dynspec_patch.patcher.releases import find_pin, release_dir


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_cache, "cache_dir", lambda: tmp_path)
    return tmp_path / "plans"


def snapshot(version: str) -> dict[str, bytes | None]:
    return local.read_snapshot(release_dir(find_pin(version)))


def test_a_cached_plan_is_the_fresh_plan(cache, monkeypatch):
    snap = snapshot("0.5.10.post1")
    fresh = engine.plan_apply(snap, worker="auto", live_worker="v2", threshold=16)
    first = plan_cache.plan_apply(snap, worker="auto", live_worker="v2", threshold=16)
    assert len(list(cache.glob("*.json"))) == 1

    def no_planning(*_a, **_k):
        raise AssertionError("planned again although cached")

    monkeypatch.setattr(engine, "plan_apply", no_planning)
    second = plan_cache.plan_apply(snap, worker="auto", live_worker="v2", threshold=16)
    assert first == fresh and second == fresh
    assert any(f.changed for f in second.files)


def test_every_input_has_its_own_entry_and_a_damaged_one_is_replanned(cache):
    snap = snapshot("0.5.10.post1")
    base = plan_cache.plan_apply(snap, live_worker="v2", threshold=16)
    other = plan_cache.plan_apply(snap, live_worker="v2", threshold=17)
    v1 = plan_cache.plan_apply(snap, live_worker="v1", threshold=16)
    edited = dict(snap)
    path = "srt/speculative/eagle_worker_v2.py"
    edited[path] = (edited[path] or b"") + b"\n# edited\n"
    changed = plan_cache.plan_apply(edited, live_worker="v2", threshold=16)
    assert len(list(cache.glob("*.json"))) == 4
    assert other.server_flags != base.server_flags
    assert {f.path for f in v1.changes} != {f.path for f in base.changes}
    assert next(f for f in changed.files if f.path == path).after.endswith(b"# edited\n")
    for entry in cache.glob("*.json"):
        entry.write_text("{not json")
    assert plan_cache.plan_apply(snap, live_worker="v2", threshold=16) == base


def test_native_plans_are_not_stored(cache):
    snap = snapshot("0.5.16")
    plan = plan_cache.plan_apply(
        snap, threshold=8, native_config_path="/srv/a/cfg.json", route="native"
    )
    assert plan.route == "native" and plan.native is not None
    assert not list(cache.glob("*.json"))


def _digest_of(package_copy: Path) -> tuple[str, str]:
    """(plan_cache's file, its code digest) in a fresh interpreter that imports the
    ``dynspec_patch`` at ``package_copy`` (its parent first on sys.path)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from dynspec_patch.patcher import plan_cache; "
            "print(plan_cache.__file__); print(plan_cache._code_digest())")
    run = subprocess.run([sys.executable, "-I", "-c", code, str(package_copy.parent)],
                         capture_output=True, text=True, check=False, cwd=package_copy.parent)
    assert run.returncode == 0, run.stderr
    where, digest = run.stdout.split()
    return where, digest


def test_the_code_digest_covers_the_installed_planning_code_wherever_it_is_installed(tmp_path):
    """Issue 13: the digest named the packages from before the rename, so every plan of an
    installed dynspec-patch (every ``apply --host``) died with ModuleNotFoundError."""
    installed = Path(str(resources.files("dynspec_patch.patcher"))).parent
    copies = []
    for name in ("a", "b"):
        copy = tmp_path / name / "dynspec_patch"
        shutil.copytree(installed, copy, ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(copy)
    a, b = copies
    where, digest = _digest_of(a)
    assert Path(where).is_relative_to(a)  # the copy, not the installed package, was imported
    assert _digest_of(b)[1] == digest == plan_cache._code_digest()  # same code, same key
    with (b / "patcher" / "cli.py").open("a") as cli:
        cli.write("\n# not planning code\n")
    assert _digest_of(b)[1] == digest
    for planning in ("patcher/engine.py", "patcher/manifest.py", "transforms/runtime/x.py"):
        with (b / planning).open("a") as code:
            code.write("\n# changed\n")
        changed = _digest_of(b)[1]
        assert changed != digest, planning
        digest = changed
