"""The planning engine's decisions on small inputs, exactly (mutants of ``patcher.engine`` that
kept the release-level tests green: see tools/mutation.py). No SGLang source is parsed here: each
function is given the plan, manifest or snapshot bytes it decides from."""

from __future__ import annotations

import pytest

from dynspec_patch.patcher import engine
from dynspec_patch.patcher.engine import FileChange, Plan
from dynspec_patch.patcher.errors import UsageError
from dynspec_patch.patcher.manifest import FileRecord, Manifest, sha256_or_none
from dynspec_patch.transforms.markers import TOOL_VERSION

RUNTIME = engine.InstallRuntimeModuleCommand.PATH
ARGS = engine.AddDisableThresholdArgCommand.PATH
V1 = engine.HookEagleWorkerCommand.PATH
V2 = engine.HookEagleWorkerV2Command.PATH
KERNEL = engine.KERNEL_PATHS[0]
PATCHABLE_KERNEL = (b"def verify_tree_greedy(): ...\n"
                    b"def prepare_for_verify(self, batch, page_size): ...\n")


def sha(data: bytes | None) -> str | None:
    return sha256_or_none(data)


def test_the_release_version_prefers_underscore_version_and_reads_every_spelling():
    assert engine.release_version({"version.py": b'__version__ = "0.5.6.post2"\n'}) == (
        "0.5.6.post2")
    both = {"version.py": b'__version__ = "0.1"\n',
            "_version.py": b'__version__ = version = "0.5.7"\n'}
    assert engine.release_version(both) == "0.5.7"
    assert engine.release_version({"_version.py": b"x = 1\n", "version.py": None}) is None
    assert engine.release_version({"_version.py": b"\xff\n__version__ = '0.5.9'\n"}) == "0.5.9"
    assert engine.release_version({}) is None


def test_text_of_a_file_that_is_not_utf8_is_never_python():
    assert engine._text({"a.py": b"x = 1\n"}, "a.py") == "x = 1\n"
    assert engine._text({"a.py": None}, "a.py") is None
    assert engine._text({}, "a.py") is None
    assert engine._text({"a.py": b"\xff"}, "a.py") == "\0"


@pytest.mark.parametrize(("snapshot", "facts", "expected"), [
    ({}, {}, ("unsupported", "no srt/server_args.py: not an SGLang package directory")),
    ({ARGS: b""}, {"native_steps_zero": True},
     ("patch", "EAGLEWorkerV2 of SGLang 0.5.14+ patched: the fallback's target forward runs on "
               "DECODE graphs (--route native uses SGLang's own --speculative-adaptive instead)")),
    ({ARGS: b"", V1: None}, {},
     ("unsupported", "no EAGLE worker in this release (EAGLE arrived in 0.4.1.post4)")),
    ({ARGS: b"", V1: b"", KERNEL: b"eagle_verify_retrive"}, {},
     ("unsupported", "greedy verify uses the Triton eagle_verify_retrive kernel, which reads out "
                     "of bounds for a one-node tree (releases before 0.4.4.post2)")),
    ({ARGS: b"", V2: b"", KERNEL: b"other"}, {},
     ("unsupported", "verify kernel not recognised (no verify_tree_greedy)")),
    ({ARGS: b"", V1: b"", KERNEL: b"verify_tree_greedy\ndef prepare_for_verify(self, batch):"},
     {}, ("unsupported", "EagleVerifyInput.prepare_for_verify takes no page_size (before "
                         "0.4.4.post4): the runtime cannot allocate its one-node tree there")),
    ({ARGS: b"", V1: b"", engine.KERNEL_PATHS[1]: PATCHABLE_KERNEL}, {},
     ("patch", "speculative workers present and patchable (0.4.4.post4 – 0.5.13.post1 layout)")),
])
def test_route_from_the_trees_structure(snapshot, facts, expected):
    assert engine._route(snapshot, facts) == expected


def test_route_native_is_taken_only_where_asked_and_offered():
    assert engine._route({ARGS: b""}, {"native_steps_zero": True}, "native") == (
        "native", "EAGLEWorkerV2 has the steps-0 path (SGLang 0.5.14+): the threshold maps onto "
                  "--speculative-adaptive, no source change")
    assert engine._route({ARGS: b""}, {}, "native")[0] == "unsupported"


def test_workers_follow_the_live_server_then_the_option():
    both = {V1: b"", V2: b""}
    assert engine._selected_workers(both, "auto", "v2") == (
        ["v2"], "the running server uses v2")
    assert engine._selected_workers(both, "auto", None) == (
        ["v1", "v2"], "every worker file present")
    assert engine._selected_workers({V1: b"", V2: None}, "both", None) == (
        ["v1"], "every worker file present")
    assert engine._selected_workers(both, "auto", "eagle3") == (
        ["v1", "v2"], "every worker file present")
    assert engine._selected_workers(both, "v1", "v2") == (["v1"], "--worker v1")


def test_versions_compare_by_their_numbers():
    assert engine.version_key("0.5.10.post1") == (0, 5, 10, 1)
    assert engine.version_key("0.1.10") > engine.version_key("0.1.9")
    assert not engine.newer_than_me(None)
    assert not engine.newer_than_me(TOOL_VERSION)
    assert engine.newer_than_me("99.0")
    assert not engine.newer_than_me("0.0.1")
    assert engine._newer_refusal("99.0") == (
        f"patched by dynspec-patch 99.0, newer than this one ({TOOL_VERSION}): use "
        "dynspec-patch >= 99.0; nothing was downgraded")


def test_a_recorded_file_mismatches_only_when_its_bytes_are_not_the_recorded_after():
    recorded = {"a.py": FileRecord("a.py", sha(b"old"), sha(b"new"))}
    assert not engine._recorded_mismatch("a.py", b"new", recorded)
    assert engine._recorded_mismatch("a.py", b"edited", recorded)
    assert not engine._recorded_mismatch("b.py", b"anything", recorded)


@pytest.mark.parametrize("kwargs", [
    {"threshold": 1}, {"threshold": engine.MAX_THRESHOLD}, {"num_steps": 1},
    {"num_steps": engine.MAX_NUM_STEPS}, {"worker": "both"}, {}])
def test_option_values_at_their_bounds_are_accepted(kwargs):
    engine.validate_options(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"threshold": 0}, "--threshold must be between 1 and 65536, got 0"),
    ({"threshold": 65537}, "--threshold must be between 1 and 65536, got 65537"),
    ({"num_steps": 0}, "--num-steps must be between 1 and 64, got 0"),
    ({"num_steps": 65}, "--num-steps must be between 1 and 64, got 65"),
    ({"worker": "v3"}, "--worker must be one of auto, v1, v2, both, got 'v3'"),
])
def test_bad_option_values_are_refused_in_one_line(kwargs, message):
    with pytest.raises(UsageError) as refused:
        engine.validate_options(**kwargs)
    assert str(refused.value) == message


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"threshold": 0}, "--threshold must be between 1 and 65536, got 0"),
    ({"num_steps": 65}, "--num-steps must be between 1 and 64, got 65"),
    ({"worker": "v3"}, "--worker must be one of auto, v1, v2, both, got 'v3'"),
    ({"route": "fast"}, "--route must be one of patch, native, got 'fast'"),
])
def test_a_plan_checks_its_options_before_reading_the_tree(kwargs, message):
    with pytest.raises(UsageError) as refused:
        engine.plan_apply({}, **kwargs)
    assert str(refused.value) == message


def test_nothing_is_written_while_a_file_is_refused():
    patched = FileChange("a.py", b"x", b"y", "unpatched", "patched", "patched", "why")
    assert engine._as_not_written(patched) == FileChange(
        "a.py", b"x", b"x", "unpatched", "unpatched", "skipped",
        "nothing is written while a file is refused")
    refused = FileChange.kept("b.py", b"z", "unknown", "refused", "edited")
    assert engine._as_not_written(refused) is refused
    skipped = FileChange.kept("c.py", b"z", "unpatched", "skipped", "not selected")
    assert engine._as_not_written(skipped) is skipped


def test_restore_original_puts_back_only_an_intact_saved_original():
    refused = FileChange.kept("a.py", b"edited", "unknown", "refused", "hand-edited")
    record = FileRecord("a.py", sha(b"orig"), sha(b"patched"))
    assert engine._restore_original(refused, record, {"a.py": b"orig"}) == FileChange(
        "a.py", b"edited", b"orig", "unknown", "original", "restored",
        "saved original put back (hand-edited)")
    created = FileRecord("a.py", None, sha(b"patched"))
    assert engine._restore_original(refused, created, {}).after is None
    assert engine._restore_original(refused, created, {}).action == "restored"
    for originals in ({"a.py": b"damaged"}, {}):
        assert engine._restore_original(refused, record, originals) == FileChange.kept(
            "a.py", b"edited", "unknown", "refused",
            "hand-edited; no intact saved original to restore")


def test_the_manifest_keeps_a_files_first_original_across_applies():
    first = Plan("apply", "0.5.4", "patch", "", (
        FileChange("a.py", b"orig", b"p1", "unpatched", "patched", "patched"),
        FileChange.kept("b.py", b"same", "unpatched", "unchanged", "")))
    manifest = engine.next_manifest(None, first)
    assert manifest.sglang_version == "0.5.4"
    assert manifest.files == (FileRecord("a.py", sha(b"orig"), sha(b"p1")),)
    upgrade = Plan("apply", "0.5.4", "patch", "", (
        FileChange("a.py", b"p1", b"p2", "patched", "patched", "patched", original=b"orig"),
        FileChange("c.py", None, b"new", "missing", "patched", "added")))
    assert engine.next_manifest(manifest, upgrade).files == (
        FileRecord("a.py", sha(b"orig"), sha(b"p2")), FileRecord("c.py", None, sha(b"new")))
    older_patch = Plan("apply", "0.5.4", "patch", "", (
        FileChange("d.py", b"p0", b"p2", "patched", "patched", "patched", original=b"orig0"),))
    assert engine.next_manifest(None, older_patch).files == (
        FileRecord("d.py", sha(b"orig0"), sha(b"p2")),)
    revert = Plan("revert", "0.5.4", "patch", "", (
        FileChange("a.py", b"p2", b"orig", "patched", "unpatched", "reverted"),))
    assert engine.next_manifest(Manifest("0.5.4", manifest.files), revert) is None


def _status(**states: str) -> Plan:
    files = tuple(FileChange.kept(path, b"", state, "unchanged", f"{path} is {state}")
                  for path, state in states.items())
    return Plan("status", "0.5.4", "patch", "", files)


def test_tree_state_from_the_manifests_hashes():
    records = (FileRecord(RUNTIME, None, sha(b"rt")), FileRecord(ARGS, sha(b"a0"), sha(b"a1")))
    manifest = Manifest("0.5.4", records)
    plan = _status(**{RUNTIME: "patched", ARGS: "patched"})
    assert engine.tree_state(plan, manifest, {RUNTIME: b"rt", ARGS: b"a1"}) == (
        engine.TreeState("patched"))
    original = _status(**{RUNTIME: "missing", ARGS: "unpatched"})
    assert engine.tree_state(original, manifest, {RUNTIME: None, ARGS: b"a0"}) == (
        engine.TreeState("original"))
    assert engine.tree_state(plan, manifest, {RUNTIME: b"rt", ARGS: b"a0"}) == (
        engine.TreeState("mixed", ("files are partly patched",)))
    assert engine.tree_state(plan, manifest, {RUNTIME: b"rt", ARGS: b"edited"}) == (
        engine.TreeState("mixed", (f"{ARGS}: matches neither the recorded original nor patch",)))


def test_tree_state_names_a_newer_tools_manifest_and_hooks_without_their_runtime():
    newer = Manifest("0.5.4", (FileRecord(ARGS, sha(b"a0"), sha(b"a1")),), tool_version="99.0")
    state = engine.tree_state(_status(**{ARGS: "patched"}), newer, {ARGS: b"a1"})
    assert state == engine.TreeState("mixed", (
        f"the manifest was written by dynspec-patch 99.0, newer than this one ({TOOL_VERSION})",))
    hooked = _status(**{RUNTIME: "missing", ARGS: "patched", V1: "patched", V2: "patched"})
    assert engine.tree_state(hooked, None, {RUNTIME: None}) == engine.TreeState("mixed", (
        f"{V1}, {V2} import(s) {RUNTIME}, which is missing",))
    foreign = _status(**{RUNTIME: "unpatched", ARGS: "patched", V1: "patched"})
    assert engine.tree_state(foreign, None, {RUNTIME: b"someone else's"}) == engine.TreeState(
        "mixed", (f"{V1} import(s) {RUNTIME}, which is not ours",))
    # hooks in place but the files back at their recorded originals: not "original"
    back = Manifest("0.5.4", (FileRecord(ARGS, sha(b"a0"), sha(b"a1")),))
    assert engine.tree_state(_status(**{RUNTIME: "patched", ARGS: "unpatched", V1: "patched"}),
                             back, {ARGS: b"a0"}).state == "mixed"


def test_tree_state_without_a_manifest_from_the_files_states():
    assert engine.tree_state(_status(), None, {}) == engine.TreeState("original")
    assert engine.tree_state(_status(**{RUNTIME: "missing", ARGS: "unpatched"}), None, {}) == (
        engine.TreeState("original"))
    patched = _status(**{RUNTIME: "patched", ARGS: "patched", V2: "patched"})
    assert engine.tree_state(patched, None, {RUNTIME: b""}) == engine.TreeState("patched")
    half = _status(**{RUNTIME: "patched", ARGS: "unpatched", V2: "patched"})
    assert engine.tree_state(half, None, {RUNTIME: b""}) == engine.TreeState(
        "mixed", ("files are partly patched",))
    core_only = _status(**{RUNTIME: "patched", ARGS: "patched", V2: "unpatched"})
    assert engine.tree_state(core_only, None, {RUNTIME: b""}).state == "mixed"
    empty_manifest = Manifest("0.5.4", ())
    assert engine.tree_state(patched, empty_manifest, {RUNTIME: b""}) == (
        engine.TreeState("patched"))
    assert engine.TreeState("mixed", ("x",)).to_json() == {"state": "mixed", "problems": ["x"]}


def test_a_file_change_reports_what_it_held_first_and_its_hashes():
    upgrade = FileChange("a.py", b"p1", b"p2", "patched", "patched", "patched", "r", b"orig")
    assert upgrade.first_bytes == b"orig"
    fresh = FileChange("a.py", b"orig", b"p1", "unpatched", "patched", "patched", "r", b"x")
    assert fresh.first_bytes == b"orig"
    assert fresh.changed
    assert not FileChange.kept("a.py", b"same", "unpatched", "unchanged", "r").changed
    assert fresh.to_json() == {
        "path": "a.py", "state_before": "unpatched", "state_after": "patched",
        "action": "patched", "reason": "r", "sha256_before": sha(b"orig"),
        "sha256_after": sha(b"p1")}


def test_a_plan_is_refused_by_its_refusal_its_route_or_any_file():
    ok = FileChange("a.py", b"x", b"y", "unpatched", "patched", "patched", "fine")
    refused = FileChange.kept("b.py", b"z", "unknown", "refused", "edited by hand")
    plan = Plan("apply", "0.5.4", "patch", "the reason", (ok,), server_flags=("--f", "8"))
    assert not plan.refused
    assert plan.refusal_reason == "the reason"
    assert plan.changes == (ok,)
    assert Plan("apply", None, "unsupported", "no EAGLE").refused
    with_file = Plan("apply", "0.5.4", "patch", "r", (ok, refused))
    assert with_file.refused
    assert with_file.refusal_reason == "b.py: edited by hand"
    whole = Plan("apply", "0.5.14", "native", "r", refusal="adaptive is off")
    assert whole.refused and whole.refusal_reason == "adaptive is off"
    assert plan.to_json() == {
        "operation": "apply", "sglang_version": "0.5.4", "route": "patch", "routes": [],
        "reason": "the reason", "refused": False, "files": [ok.to_json()],
        "server_flags": ["--f", "8"], "native": None}


# ---------------------------------------------------------------- whole plans on a small tree
# The codemods' own before/after texts (test_codemods_text) make a tree the engine accepts.


def small_tree() -> dict[str, bytes | None]:
    from tests.codemods.test_codemods_text import SERVER_ARGS_BEFORE, V1_BEFORE

    tree: dict[str, bytes | None] = dict.fromkeys(engine.SNAPSHOT_PATHS)
    tree.update({"version.py": b'__version__ = "0.5.4"\n', engine.KERNEL_PATHS[1]: PATCHABLE_KERNEL,
                 ARGS: SERVER_ARGS_BEFORE.encode(), V1: V1_BEFORE.encode()})
    return tree


def applied(tree: dict[str, bytes | None], plan: Plan) -> dict[str, bytes | None]:
    return {**tree, **{f.path: f.after for f in plan.files}}


def rows(plan: Plan) -> list[tuple[str, str, str, str, str]]:
    return [(f.path, f.state_before, f.state_after, f.action, f.reason) for f in plan.files]


def test_apply_on_a_small_tree_patches_every_file_it_needs():
    from tests.codemods.test_codemods_text import SERVER_ARGS_AFTER, V1_AFTER

    tree = small_tree()
    plan = engine.plan_apply(tree, threshold=8)
    assert rows(plan) == [(RUNTIME, "unpatched", "patched", "added", "unpatched"),
                          (ARGS, "unpatched", "patched", "patched", "unpatched"),
                          (V1, "unpatched", "patched", "patched", "unpatched")]
    assert (plan.operation, plan.sglang_version, plan.route) == ("apply", "0.5.4", "patch")
    assert plan.reason == ("speculative workers present and patchable (0.4.4.post4 – "
                           "0.5.13.post1 layout); workers: every worker file present")
    assert plan.server_flags == ("--speculative-disable-batch-threshold", "8")
    assert plan.patchable_workers == ("v1",)
    after = {f.path: f for f in plan.files}
    assert after[ARGS].after == SERVER_ARGS_AFTER.encode()
    assert after[V1].after == V1_AFTER.encode()
    assert b"class DynSpecController" in after[RUNTIME].after
    assert after[ARGS].original == tree[ARGS] and after[RUNTIME].original is None
    assert engine.plan_apply(tree).server_flags == ()


def test_apply_again_changes_nothing():
    tree = small_tree()
    again = engine.plan_apply(applied(tree, engine.plan_apply(tree, threshold=8)), threshold=8)
    assert [(p, b, a, act) for p, b, a, act, _ in rows(again)] == [
        (RUNTIME, "patched", "patched", "unchanged"), (ARGS, "patched", "patched", "unchanged"),
        (V1, "patched", "patched", "unchanged")]
    assert {f.reason for f in again.files} == {f"patched by dynspec-patch {TOOL_VERSION}"}
    assert again.changes == ()


def test_a_newer_tools_patch_is_refused_and_nothing_else_is_written():
    from tests.codemods.test_codemods_text import V1_AFTER

    tree = {**small_tree(), V1: V1_AFTER.replace(TOOL_VERSION, "99.0").encode()}
    plan = engine.plan_apply(tree, threshold=8)
    assert plan.refused
    assert rows(plan) == [
        (RUNTIME, "unpatched", "unpatched", "skipped", "nothing is written while a file is "
                                                       "refused"),
        (ARGS, "unpatched", "unpatched", "skipped", "nothing is written while a file is refused"),
        (V1, "patched", "patched", "refused", engine._newer_refusal("99.0"))]
    assert plan.changes == ()


def test_an_older_tools_patch_is_upgraded_with_the_true_original():
    from tests.codemods.test_codemods_text import V1_AFTER, V1_BEFORE

    older = V1_AFTER.replace(TOOL_VERSION, "0.0.9").encode()
    plan = engine.plan_apply({**small_tree(), V1: older}, threshold=8)
    change = next(f for f in plan.files if f.path == V1)
    assert (change.state_before, change.action, change.after) == (
        "patched", "patched", V1_AFTER.encode())
    assert change.original == V1_BEFORE.encode()


def test_the_workers_planned_follow_the_option_and_the_live_server():
    tree = small_tree()
    missing = engine.plan_apply(tree, threshold=8, worker="v2")
    assert rows(missing)[-1] == (V2, "missing", "missing", "refused",
                                 f"this release has no {V2} (v2 worker)")
    assert [f.action for f in missing.files] == ["skipped", "skipped", "skipped", "refused"]
    assert engine.plan_apply(tree, worker="v1").reason.endswith("; workers: --worker v1")
    assert engine.plan_apply(tree, live_worker="v1").reason.endswith(
        "; workers: the running server uses v1")
    with_v2 = {**tree, V2: b"x = 1\n"}
    not_selected = engine.plan_apply(with_v2, worker="v1")
    assert rows(not_selected)[-1][:4] == (V2, "unknown", "unknown", "skipped")
    assert rows(not_selected)[-1][4] == "not selected (--worker v1)"


def test_an_unsupported_tree_gets_a_plan_without_files():
    plan = engine.plan_apply({"version.py": b'__version__ = "0.5.4"\n'}, threshold=8)
    assert (plan.route, plan.files, plan.refused) == ("unsupported", (), True)
    assert engine.plan_status({}).route == "unsupported"
    assert engine.plan_status({}).files == ()


def test_revert_puts_every_file_back_hooks_first():
    tree = small_tree()
    patched = applied(tree, engine.plan_apply(tree, threshold=8))
    plan = engine.plan_revert(patched)
    assert [(p, b, a, act) for p, b, a, act, _ in rows(plan)] == [
        (V1, "patched", "unpatched", "reverted"), (ARGS, "patched", "unpatched", "reverted"),
        (RUNTIME, "patched", "unpatched", "removed")]
    assert (plan.operation, plan.route, plan.reason) == (
        "revert", "patch", "remove everything dynspec-patch inserted")
    assert applied(patched, plan) == tree
    assert [f.action for f in engine.plan_revert(tree).files] == ["unchanged", "unchanged"]
    assert {f.reason for f in engine.plan_revert(tree).files} == {"not patched"}


def _records(tree, patched) -> dict[str, FileRecord]:
    return {p: FileRecord(p, sha(tree[p]), sha(patched[p])) for p in (RUNTIME, ARGS, V1)}


def test_revert_guards_a_hand_edited_file_and_what_it_would_restore():
    tree = small_tree()
    patched = applied(tree, engine.plan_apply(tree, threshold=8))
    recorded = _records(tree, patched)
    edited = {**patched, ARGS: patched[ARGS] + b"# edited\n"}
    plan = engine.plan_revert(edited, recorded=recorded)
    assert rows(plan)[1] == (ARGS, "patched", "patched", "refused",
                             "changed since dynspec-patch wrote it (sha256 differs from the "
                             "manifest); --force reverts anyway, --restore-originals puts the "
                             "saved original back")
    assert [f.action for f in plan.files] == ["skipped", "refused", "skipped"]
    forced = engine.plan_revert(edited, recorded=recorded, force=True)
    assert [f.action for f in forced.files] == ["reverted", "reverted", "removed"]
    restored = engine.plan_revert(edited, recorded=recorded, originals={ARGS: tree[ARGS]})
    assert [f.action for f in restored.files] == ["reverted", "restored", "removed"]
    assert applied(edited, restored) == tree
    wrong_before = {**recorded, V1: FileRecord(V1, sha(b"another original"), sha(patched[V1]))}
    assert rows(engine.plan_revert(patched, recorded=wrong_before))[0] == (
        V1, "patched", "patched", "refused",
        "reverting would not restore the bytes recorded at apply time")


def test_revert_with_a_manifest_leaves_files_it_never_wrote():
    tree = small_tree()
    patched = applied(tree, engine.plan_apply(tree, threshold=8))
    only_args = {ARGS: _records(tree, patched)[ARGS]}
    half = {**patched, V1: tree[V1], RUNTIME: tree[RUNTIME]}
    plan = engine.plan_revert(half, recorded=only_args)
    assert rows(plan)[0] == (V1, "unpatched", "unpatched", "skipped",
                             "never touched by dynspec-patch (not in the manifest)")
    assert rows(plan)[1][3] == "reverted"
    unknown = {**patched, ARGS: b"x = (\n"}
    hinted = engine.plan_revert(unknown, recorded=_records(tree, patched))
    assert hinted.files[1].action == "refused"
    assert hinted.files[1].reason.endswith(
        "; --restore-originals puts back the original saved at apply")
    assert not engine.plan_revert(unknown).files[1].reason.endswith("at apply")


def test_status_of_a_patched_small_tree():
    tree = small_tree()
    patched = applied(tree, engine.plan_apply(tree, threshold=8))
    status = engine.plan_status(patched)
    assert [(p, b, act) for p, b, _, act, _ in rows(status)] == [
        (RUNTIME, "patched", "unchanged"), (ARGS, "patched", "unchanged"),
        (V1, "patched", "unchanged")]
    assert (status.operation, status.sglang_version, status.patchable_workers) == (
        "status", "0.5.4", ("v1",))
    assert status.reason.startswith("speculative workers present and patchable")
    assert engine.tree_state(status, None, patched) == engine.TreeState("patched")
    assert engine.tree_state(engine.plan_status(tree), None, tree) == engine.TreeState(
        "original")


NATIVE_V2 = (b"class EAGLEWorkerV2:\n    def _build_trivial_verify_input(self):\n        pass\n"
             b"    def forward_batch_generation(self, batch):\n        pass\n")


def test_the_native_route_builds_its_config_or_refuses_a_server_it_cannot_serve():
    tree = {ARGS: b"", V2: NATIVE_V2, "_version.py": b'__version__ = "0.5.14"\n'}
    with pytest.raises(UsageError) as no_threshold:
        engine.plan_apply(tree, route="native")
    assert str(no_threshold.value) == "the native route needs --threshold N to build its config"
    plan = engine.plan_apply(
        tree, route="native", threshold=8, native_config_path="/s/adaptive.json"
    )
    expected = engine.native_config(8, engine.DEFAULT_NUM_STEPS, "/s/adaptive.json", None)
    assert (plan.route, plan.files, plan.native, plan.refusal) == ("native", (), expected, None)
    assert plan.server_flags == expected.flags
    native = engine.plan_apply(tree, route="native", threshold=8, num_steps=5).native
    assert native == engine.native_config(8, 5, engine.CONFIG_FILE_NAME, None)
    assert engine.plan_apply(tree, route="native", threshold=8, cuda_graph_bs=[1, 2]).native == (
        engine.native_config(8, engine.DEFAULT_NUM_STEPS, engine.CONFIG_FILE_NAME, [1, 2]))
    refused = engine.plan_apply(
        tree, route="native", threshold=8, server_args={"speculative_eagle_topk": 4}
    )
    assert refused.refusal == (
        "SGLang 0.5.14 switches --speculative-adaptive off for this server "
        "(speculative_eagle_topk=4 (adaptive supports topk 1 only)): the threshold would do "
        "nothing; nothing was written")
    by_argv = engine.plan_apply(tree, route="native", threshold=8,
                                server_argv=["--speculative-eagle-topk", "2"])
    assert by_argv.refused
    revert = engine.plan_revert(tree)
    assert (revert.route, revert.reason, revert.files) == (
        "native", "no source change to undo (native route)", ())
    assert engine.plan_status(tree, native_applied=True).route == "native"


def test_every_kept_file_keeps_its_bytes_and_says_why():
    tree = small_tree()
    patched = applied(tree, engine.plan_apply(tree, threshold=8))
    only_args = {ARGS: _records(tree, patched)[ARGS]}
    half = {**patched, V1: tree[V1]}
    skipped = engine.plan_revert(half, recorded=only_args).files[0]
    assert (skipped.before, skipped.after) == (tree[V1], tree[V1])
    broken = {**patched, ARGS: b"x = (\n"}
    refused = engine.plan_revert(broken).files[1]
    analysis = engine.AddDisableThresholdArgCommand().analyse("x = (\n")
    assert refused == FileChange.kept(ARGS, b"x = (\n", "unknown", "refused",
                                      analysis.state.reason)
    status = engine.plan_status(patched)
    assert status.files[1] == FileChange.kept(ARGS, patched[ARGS], "patched", "unchanged",
                                              f"patched by dynspec-patch {TOOL_VERSION}")
    assert status.route == "patch"
    assert engine.plan_status({"version.py": b'__version__ = "0.5.4"\n'}) == Plan(
        "status", "0.5.4", "unsupported",
        "no srt/server_args.py: not an SGLang package directory", routes=("patch",))
    assert engine.plan_status(broken).files[1].reason == analysis.refusal


def test_a_native_plan_carries_its_config_in_json():
    config = engine.native_config(8, 3, "/s/adaptive.json", None)
    plan = Plan("apply", "0.5.14", "native", "r", native=config)
    assert plan.to_json()["native"] == config.to_json()


def test_the_manifest_keeps_records_of_files_the_plan_does_not_touch():
    previous = Manifest("0.5.4", (FileRecord("a.py", sha(b"true"), sha(b"p1")),
                                  FileRecord("b.py", sha(b"b0"), sha(b"b1"))))
    upgrade = Plan("apply", "0.5.4", "patch", "", (
        FileChange("a.py", b"p1", b"p2", "patched", "patched", "patched"),))
    assert engine.next_manifest(previous, upgrade).files == (
        FileRecord("a.py", sha(b"true"), sha(b"p2")), FileRecord("b.py", sha(b"b0"), sha(b"b1")))
    revert = Plan("revert", "0.5.4", "patch", "", (
        FileChange("a.py", b"p1", b"orig", "patched", "unpatched", "reverted"),
        FileChange("b.py", b"b1", b"b0", "patched", "unpatched", "reverted"),
        FileChange("c.py", b"c1", b"c0", "patched", "unpatched", "reverted")))
    assert engine.next_manifest(previous, revert) is None


def test_unknown_files_are_problems_of_a_recorded_tree():
    records = (FileRecord(ARGS, sha(b"a0"), sha(b"a1")),)
    plan = _status(**{ARGS: "unpatched", V2: "unknown"})
    assert engine.tree_state(plan, Manifest("0.5.4", records), {ARGS: b"a0"}) == (
        engine.TreeState("original", (f"{V2}: {V2} is unknown",)))


def test_every_planned_file_carries_its_path_bytes_and_reason():
    from tests.codemods.test_codemods_text import V1_AFTER

    tree = small_tree()
    with pytest.raises(UsageError):
        engine.plan_apply(tree, threshold=0)
    fresh = engine.plan_apply(tree, threshold=8)
    assert fresh.files[1] == FileChange(ARGS, tree[ARGS], fresh.files[1].after, "unpatched",
                                        "patched", "patched", "unpatched", original=tree[ARGS])
    newer = {**tree, V1: V1_AFTER.replace(TOOL_VERSION, "99.0").encode()}
    assert engine.plan_apply(newer).files[2] == FileChange.kept(
        V1, newer[V1], "patched", "refused", engine._newer_refusal("99.0"))
    foreign = {**tree, V1: b"x = 1\n"}
    refused = engine.plan_apply(foreign, worker="v1").files[2]
    analysis = engine.HookEagleWorkerCommand().analyse("x = 1\n")
    assert refused == FileChange.kept(V1, b"x = 1\n", "unknown", "refused", analysis.refusal)
    with_v2 = {**tree, V2: b"x = 1\n"}
    assert engine.plan_apply(with_v2, worker="v1").files[3] == FileChange.kept(
        V2, b"x = 1\n", "unknown", "skipped", "not selected (--worker v1)")
    unsupported = engine.plan_apply({"version.py": b'__version__ = "0.5.4"\n'})
    assert (unsupported.operation, unsupported.sglang_version) == ("apply", "0.5.4")
    native = engine.plan_apply({ARGS: b"", V2: NATIVE_V2}, threshold=8)
    assert native.operation == "apply"


def test_every_reverted_file_carries_its_path_bytes_and_reason():
    tree = small_tree()
    patched = applied(tree, engine.plan_apply(tree, threshold=8))
    plan = engine.plan_revert(patched)
    assert (plan.sglang_version, plan.files[1]) == ("0.5.4", FileChange(
        ARGS, patched[ARGS], tree[ARGS], "patched", "unpatched", "reverted",
        f"patched by dynspec-patch {TOOL_VERSION}"))
    assert engine.plan_revert(tree).files[0] == FileChange.kept(
        V1, tree[V1], "unpatched", "unchanged", "not patched")
    recorded = _records(tree, patched)
    edited = {**patched, ARGS: patched[ARGS] + b"# edited\n"}
    assert engine.plan_revert(edited, recorded=recorded).files[1].before == edited[ARGS]
    wrong_before = {**recorded, V1: FileRecord(V1, sha(b"another"), sha(patched[V1]))}
    refused = engine.plan_revert(patched, recorded=wrong_before).files[0]
    assert (refused.before, refused.after) == (patched[V1], patched[V1])
    native = engine.plan_revert({ARGS: b"", V2: NATIVE_V2,
                                 "_version.py": b'__version__ = "0.5.14"\n'})
    assert (native.operation, native.sglang_version) == ("revert", "0.5.14")


# ------------------------------------------------------------- routes and the manifest's hashes

ADAPTIVE_REFUSAL = (
    "the server runs SGLang's own --speculative-adaptive, which would keep control (the patch "
    "would stay off): relaunch it without --speculative-adaptive (after the native route, "
    "dynspec-patch revert does that), or use --route native; nothing was written")
NATIVE_TREE = {ARGS: b"", V2: NATIVE_V2, "_version.py": b'__version__ = "0.5.14"\n'}
# server_args.py unknown to its codemod but naming the tool: the patch route was there
PATCHED_NATIVE_TREE = {**NATIVE_TREE, ARGS: b"# dynspec-patch\n"}


@pytest.mark.parametrize(("selected", "live", "server_args", "argv", "refused"), [
    (["v2"], None, {"speculative_adaptive": True}, (), True),
    (["v2"], "v2", {}, (engine.ADAPTIVE_FLAG,), True),
    (["v1", "v2"], None, {}, (engine.ADAPTIVE_FLAG,), True),
    (["v1"], None, {"speculative_adaptive": True}, (), False),
    (["v1", "v2"], "v1", {"speculative_adaptive": True}, (), False),
    (["v2"], None, {"speculative_adaptive": False}, (), False),
])
def test_sglang_s_adaptive_conflicts_with_the_patch_only_on_a_v2_server(
        selected, live, server_args, argv, refused):
    conflict = engine._adaptive_conflict(selected, live, server_args, argv)
    assert conflict == (ADAPTIVE_REFUSAL if refused else None)


def test_the_patch_plan_carries_the_adaptive_conflict_of_the_server_it_would_patch():
    adaptive = {"speculative_adaptive": True}
    assert engine.plan_apply(NATIVE_TREE, threshold=8, server_args=adaptive).refusal == (
        ADAPTIVE_REFUSAL)
    assert engine.plan_apply(NATIVE_TREE, threshold=8, worker="v2", live_worker="v1",
                             server_args=adaptive).refusal is None


def test_the_native_route_on_a_tree_that_carries_the_patch_is_refused_whole():
    plan = engine.plan_apply(PATCHED_NATIVE_TREE, route="native", threshold=8)
    config = engine.native_config(8, engine.DEFAULT_NUM_STEPS, engine.CONFIG_FILE_NAME, None)
    assert plan == Plan(
        "apply", "0.5.14", "native",
        "EAGLEWorkerV2 has the steps-0 path (SGLang 0.5.14+): the threshold maps onto "
        "--speculative-adaptive, no source change", native=config, server_flags=config.flags,
        refusal="this tree carries the patch route: run dynspec-patch revert first (one "
                "controller at a time); nothing was written", routes=("patch", "native"))
    assert engine.plan_apply(NATIVE_TREE, route="native", threshold=8).refusal is None


def test_status_shows_the_route_the_tree_is_on():
    assert engine.plan_status(NATIVE_TREE).route == "patch"  # what apply would take
    assert engine.plan_status(NATIVE_TREE, native_applied=True).route == "native"
    assert engine.plan_status(PATCHED_NATIVE_TREE, native_applied=True).route == "patch"
    assert engine.plan_status(NATIVE_TREE).routes == ("patch", "native")


def test_route_native_on_a_release_without_it_plans_nothing_and_says_why():
    plan = engine.plan_apply(small_tree(), route="native", threshold=8)
    assert plan == Plan("apply", "0.5.4", "unsupported",
                        "--route native needs SGLang 0.5.14+ (its steps-0 "
                        "--speculative-adaptive); this release takes the patch route",
                        routes=("patch",))


def test_every_plan_names_the_routes_its_release_offers():
    tree = small_tree()
    patched = applied(tree, engine.plan_apply(tree, threshold=8))
    assert engine.plan_apply(tree, threshold=8).routes == ("patch",)
    assert engine.plan_revert(patched).routes == ("patch",)
    assert engine.plan_status(patched).routes == ("patch",)
    assert engine.plan_revert(NATIVE_TREE).routes == ("patch", "native")


def test_a_patched_file_edited_since_apply_is_unknown_to_status_and_refused_by_apply():
    tree = small_tree()
    patched = applied(tree, engine.plan_apply(tree, threshold=8))
    recorded = _records(tree, patched)
    for path in (ARGS, V1):
        edited = {**patched, path: patched[path] + b"# edited\n"}
        row = {f.path: f for f in engine.plan_status(edited, recorded).files}[path]
        assert row == FileChange.kept(path, edited[path], "unknown", "unchanged",
                                      engine.EDITED_SINCE_APPLY)
        plan = engine.plan_apply(edited, threshold=8, recorded=recorded)
        assert {f.path: f for f in plan.files}[path] == FileChange.kept(
            path, edited[path], "unknown", "refused", engine.EDITED_SINCE_APPLY)
    # as recorded: patched, and nothing to do
    assert {f.action for f in engine.plan_apply(patched, threshold=8, recorded=recorded).files} \
        == {"unchanged"}
    assert [f.state_before for f in engine.plan_status(patched, recorded).files] == (
        ["patched"] * 3)


def test_the_spec_fields_file_is_a_core_file_where_the_release_has_it():
    spec = engine.AddDisableThresholdSpecFieldsCommand
    core = [engine.InstallRuntimeModuleCommand, engine.AddDisableThresholdArgCommand]
    assert [type(c) for c in engine._core_codemods({spec.PATH: b""})] == [*core, spec]
    assert [type(c) for c in engine._core_codemods({})] == core


def test_a_worker_its_codemod_refuses_is_not_patchable():
    assert engine.plan_status({**small_tree(), V1: b"x = (\n"}).patchable_workers == ()


def test_tree_state_lists_an_unknown_recorded_file_once_and_checks_the_others():
    records = (FileRecord(ARGS, sha(b"a0"), sha(b"a1")), FileRecord(V1, sha(b"v0"), sha(b"v1")))
    plan = _status(**{RUNTIME: "patched", ARGS: "unknown", V1: "patched"})
    state = engine.tree_state(plan, Manifest("0.5.4", records),
                              {RUNTIME: b"rt", ARGS: b"edited", V1: b"edited"})
    assert state == engine.TreeState("mixed", (
        f"{ARGS}: {ARGS} is unknown", f"{V1}: matches neither the recorded original nor patch"))


def test_tree_state_counts_the_spec_fields_file_among_the_core_files():
    spec = engine.AddDisableThresholdSpecFieldsCommand.PATH
    patched = _status(**{RUNTIME: "patched", ARGS: "patched", spec: "patched", V2: "patched"})
    assert engine.tree_state(patched, None, {RUNTIME: b""}) == engine.TreeState("patched")
    half = _status(**{RUNTIME: "patched", ARGS: "patched", spec: "unpatched", V2: "patched"})
    assert engine.tree_state(half, None, {RUNTIME: b""}).state == "mixed"
