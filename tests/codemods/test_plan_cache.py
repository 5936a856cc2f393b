"""The controller's plan cache: a cached plan equals a fresh one, byte for byte; any change of
input gets its own entry; a damaged entry is planned again; native plans are not stored."""

from __future__ import annotations

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
