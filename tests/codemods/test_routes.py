"""``--route``: SGLang 0.5.14+ offer the patch and the native route; older releases the patch.

The default is one constant (``engine.DEFAULT_ROUTE``); status and detect-path show the route a
tree is on; a v2 server that runs SGLang's own ``--speculative-adaptive`` is refused on the
patch route (two controllers would fight), nothing written.
"""

from __future__ import annotations

import json

import pytest

from dynspec_patch.patcher import engine, local, plan_cache
from dynspec_patch.patcher.cli import run
from dynspec_patch.patcher.releases import find_pin, release_dir
from tests.codemods.conftest import tree_bytes

V2 = "srt/speculative/eagle_worker_v2.py"


def cli_json(capsys, *argv: str) -> tuple[int, dict]:
    code = run([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("default", ["patch", "native"])
def test_the_default_route_of_0517_is_the_one_constant(scratch, capsys, monkeypatch, default):
    monkeypatch.setattr(engine, "DEFAULT_ROUTE", default)
    package = scratch(find_pin("0.5.17"))
    code, result = cli_json(capsys, "apply", "--sglang-root", str(package), "--threshold", "8")
    assert code == 0, result
    assert result["route"] == default and result["routes"] == ["patch", "native"]
    assert bool(result["files"]) == (default == "patch")
    assert (result["native"] is not None) == (default == "native")


def test_status_and_revert_follow_the_route_the_tree_is_on(scratch, capsys):
    package = scratch(find_pin("0.5.17"))
    original = tree_bytes(package)
    root = ("--sglang-root", str(package))
    code, status = cli_json(capsys, "status", *root)
    assert code == 0 and status["route"] == engine.DEFAULT_ROUTE
    assert status["routes"] == ["patch", "native"]

    assert cli_json(capsys, "apply", *root, "--route", "native", "--threshold", "8")[0] == 0
    assert cli_json(capsys, "status", *root)[1]["route"] == "native"
    code, detected = cli_json(capsys, "detect-path", *root)
    assert detected["route"] == "native" and "--route native" in detected["recommended"]
    code, back = cli_json(capsys, "revert", *root)
    assert code == 0 and back["route"] == "native" and back["removed"]

    code, patched = cli_json(capsys, "apply", *root, "--route", "patch", "--threshold", "8")
    assert code == 0 and patched["route"] == "patch"
    assert {f["path"]: f["action"] for f in patched["files"]}[V2] == "patched"
    code, status = cli_json(capsys, "status", *root)
    assert status["route"] == "patch" and status["tree_state"] == "patched"
    # One route at a time: the native config is not written over the patch.
    code, native = cli_json(capsys, "apply", *root, "--route", "native", "--threshold", "8")
    assert code == 3 and "revert first" in native["error"]
    assert not local.native_config_path(package).exists()
    code, back = cli_json(capsys, "revert", *root)
    assert code == 0 and back["route"] == "patch"
    assert tree_bytes(package) == original


def test_native_route_on_a_release_without_steps_zero_is_refused(scratch, capsys):
    package = scratch(find_pin("0.5.13.post1"))
    before = tree_bytes(package.parent)
    argv = ["apply", "--sglang-root", str(package), "--route", "native", "--threshold", "8"]
    assert run(argv) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--route native needs SGLang 0.5.14+" in err
    assert tree_bytes(package.parent) == before


def test_an_unknown_route_is_a_usage_error(capsys):
    assert run(["apply", "--sglang-root", "/nonexistent", "--route", "steps0"]) == 2
    assert "--route must be one of patch, native" in capsys.readouterr().err


@pytest.fixture(scope="module")
def snapshots():
    return {v: local.read_snapshot(release_dir(find_pin(v))) for v in ("0.5.12.post1", "0.5.17")}


@pytest.mark.parametrize(
    ("server_args", "argv"),
    [({"speculative_adaptive": True}, ()), ({}, ("--speculative-adaptive",))],
)
def test_patch_route_refuses_a_v2_server_running_sglang_adaptive(snapshots, server_args, argv):
    plan = engine.plan_apply(
        snapshots["0.5.17"], threshold=8, server_args=server_args, server_argv=argv
    )
    assert plan.route == "patch" and plan.refused
    assert "--speculative-adaptive" in plan.refusal_reason
    assert "--route native" in plan.refusal_reason
    assert "nothing was written" in plan.refusal_reason
    # Not the other controller's business: without SGLang's adaptive, the plan goes through.
    assert not engine.plan_apply(snapshots["0.5.17"], threshold=8).refused
    # The native route is SGLang's adaptive itself.
    native = engine.plan_apply(
        snapshots["0.5.17"], threshold=8, server_args=server_args, server_argv=argv,
        route="native",
    )
    assert native.route == "native" and not native.refused


@pytest.mark.parametrize(("live", "refused"), [("v1", False), ("v2", True)])
def test_on_0512_only_the_v2_worker_conflicts_with_sglang_adaptive(snapshots, live, refused):
    # v1's fallback never reaches the adaptive controller (it runs before the spec path).
    plan = engine.plan_apply(
        snapshots["0.5.12.post1"],
        worker="both",  # v2's file is patched either way; what runs is the live worker
        live_worker=live,
        threshold=8,
        server_args={"speculative_adaptive": True},
    )
    assert plan.refused is refused


def test_the_plan_cache_does_not_reuse_a_plan_across_the_adaptive_conflict(
    snapshots, tmp_path, monkeypatch
):
    monkeypatch.setenv("DYNSPEC_CACHE", str(tmp_path))
    fine = plan_cache.plan_apply(snapshots["0.5.17"], live_worker="v2", threshold=8)
    assert not fine.refused and list((tmp_path / "plans").glob("*.json"))
    conflict = plan_cache.plan_apply(
        snapshots["0.5.17"], live_worker="v2", threshold=8, server_argv=("--speculative-adaptive",)
    )
    assert conflict.refused
    assert plan_cache.plan_apply(snapshots["0.5.17"], live_worker="v2", threshold=8) == fine


def test_on_0523_the_spec_fields_file_is_part_of_the_patch(scratch, capsys):
    # S4: the checks in server_args.py read fields that only the Spec namespace declares, so a
    # tree with one of the two patched is not "patched" (its server would not start).
    package = scratch(find_pin("0.5.23"))
    spec = package / "srt/arg_groups/fields/spec.py"
    original_spec = spec.read_bytes()
    root = ("--sglang-root", str(package))
    assert cli_json(capsys, "apply", *root, "--threshold", "8")[0] == 0
    assert cli_json(capsys, "status", *root)[1]["tree_state"] == "patched"
    spec.write_bytes(original_spec)
    code, status = cli_json(capsys, "status", *root)
    assert code == 0 and status["tree_state"] == "mixed"
    # Judged from the files alone too (a tree patched by an older tool left no manifest).
    (package.parent / ".dynspec-patch" / "manifest.json").unlink()
    code, status = cli_json(capsys, "status", *root)
    assert code == 0 and status["tree_state"] == "mixed"
