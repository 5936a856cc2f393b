"""apply, re-apply, revert and dry-run via the CLI, on the real files of every pinned release."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from dynspec_patch.patcher.cli import run
from dynspec_patch.patcher.engine import version_key
from dynspec_patch.patcher.releases import Pin, load_pins, release_dir
from dynspec_patch.transforms.markers import TOOL_VERSION, marker_comment

PINS = load_pins()
PATCHABLE = [pin for pin in PINS if pin.route == "patch"]
# SGLang 0.5.14+ also offer the native route (--route native).
NATIVE = [pin for pin in PINS if version_key(pin.version) >= version_key("0.5.14")]
UNSUPPORTED = [pin for pin in PINS if pin.route == "unsupported"]
WORKER_FILES = {"v1": "srt/speculative/eagle_worker.py", "v2": "srt/speculative/eagle_worker_v2.py"}
RUNTIME = "srt/speculative/dynspec_fallback.py"
SERVER_ARGS = "srt/server_args.py"
SPEC_FIELDS = "srt/arg_groups/fields/spec.py"  # 0.5.20+: the Spec namespace holds the fields


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = run([*argv, "--json"])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if captured.out.strip() else {"stderr": captured.err})


def worker_flag(pin: Pin) -> str:
    return pin.workers[0] if len(pin.workers) == 1 else "both"


def apply(capsys, package: Path, pin: Pin, *extra: str) -> tuple[int, dict]:
    return cli_json(
        capsys, "apply", "--sglang-root", str(package), "--worker", worker_flag(pin), *extra
    )


def class_body(tree: ast.Module, name: str) -> list[ast.stmt]:
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return cls.body


def method(body: list[ast.stmt], names: tuple[str, ...]) -> ast.FunctionDef:
    """The first of ``names`` that the class defines (names in order of preference)."""
    defined = {n.name: n for n in body if isinstance(n, ast.FunctionDef)}
    return next(defined[name] for name in names if name in defined)


THRESHOLD_PARSER = "_dynspec_threshold_arg"
NEW_FIELDS = {
    "speculative_disable_batch_threshold": ("Optional[int]", None),
    "speculative_disable_resume_below": ("Optional[int]", None),
    "speculative_disable_min_dwell_steps": ("int", 8),
}


def assert_server_args_patched(package: Path) -> None:
    """Fields (in the anchor's layout), flags (explicit or generated) and checks are there."""
    tree = ast.parse((package / SERVER_ARGS).read_text())
    body = class_body(tree, "ServerArgs")
    cli = method(body, ("add_cli_args",))
    check = ast.unparse(method(body, ("_handle_speculative_decoding", "__post_init__")))
    fields_module = tree
    if (package / SPEC_FIELDS).exists():  # S4: the fields sit in class Spec
        fields_module = ast.parse((package / SPEC_FIELDS).read_text())
        fields_body = class_body(fields_module, "Spec")
    else:
        fields_body = body
    # The threshold's flag parser (an int 1..65536 or auto) is a global beside the fields.
    functions = {n.name for n in fields_module.body if isinstance(n, ast.FunctionDef)}
    assert THRESHOLD_PARSER in functions
    fields = {n.target.id: n for n in fields_body if isinstance(n, ast.AnnAssign)}
    anchor = ast.unparse(fields["speculative_num_draft_tokens"].annotation)
    generated = "add_cli_args_from_dataclass(" in ast.unparse(cli)
    for name, (annotation, default) in NEW_FIELDS.items():
        field = fields[name]
        if anchor.startswith("A["):  # S2+: A[T, "help"(, NS(...))], as the anchor is
            declared = field.annotation
            assert isinstance(declared, ast.Subscript) and ast.unparse(declared.value) == "A"
            elements = declared.slice.elts  # type: ignore[attr-defined]
            assert ast.unparse(elements[0]) == annotation
            if name == "speculative_disable_batch_threshold":
                meta = ast.unparse(elements[1])
                assert meta.startswith("Arg(help='Run plain")
                assert meta.endswith(f"type_parser={THRESHOLD_PARSER})")
            else:
                assert isinstance(elements[1], ast.Constant) and elements[1].value
            assert ("NS('spec')" in anchor) == ("NS('spec')" in ast.unparse(declared))
        else:
            assert ast.unparse(field.annotation) == annotation
        assert isinstance(field.value, ast.Constant) and field.value.value == default
        flag = "--" + name.replace("_", "-")
        assert f"raise ValueError(f'{flag} " in check
        if anchor.startswith("A["):
            assert generated and flag not in ast.unparse(cli)  # generated from the field
            continue
        calls = [
            node
            for node in ast.walk(cli)
            if isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "add_argument"
            and node.args
            and getattr(node.args[0], "value", None) == flag
        ]
        assert len(calls) == 1
        keywords = {kw.arg: ast.unparse(kw.value) for kw in calls[0].keywords}
        parser = THRESHOLD_PARSER if name == "speculative_disable_batch_threshold" else "int"
        assert keywords["type"] == parser
        assert keywords["default"] == f"ServerArgs.{name}"
        assert "help" in keywords
    assert "speculative_disable_batch_threshold < 1" in check


def assert_hooked(source: str, class_name: str, function: str) -> None:
    tree = ast.parse(source)
    imports = [
        n
        for n in tree.body
        if isinstance(n, ast.ImportFrom)
        and n.module == "sglang.srt.speculative"
        and [a.name for a in n.names] == ["dynspec_fallback"]
    ]
    assert len(imports) == 1
    body = class_body(tree, class_name)
    entry = method(body, ("forward_batch_speculative_generation", "forward_batch_generation"))
    statements = entry.body[1:] if isinstance(entry.body[0], ast.Expr) else entry.body
    hook, guard = statements[0], statements[1]
    assert ast.unparse(hook).startswith(f"_dynspec_out = dynspec_fallback.{function}(self, ")
    first_param = entry.args.args[1].arg
    assert ast.unparse(hook.value.args[1]) == first_param
    assert ast.unparse(guard) == "if _dynspec_out is not None:\n    return _dynspec_out"
    assert source.count(f"dynspec_fallback.{function}") == 1


@pytest.mark.parametrize("pin", PATCHABLE, ids=lambda p: p.version)
def test_apply_patches_every_expected_file(pin, scratch, capsys):
    package = scratch(pin)
    originals = {
        p: (package / p).read_bytes()
        for p in (SERVER_ARGS, *WORKER_FILES.values())
        if (package / p).exists()
    }
    code, result = apply(capsys, package, pin, "--threshold", "4")
    assert code == 0, result
    assert result["route"] == "patch"
    assert result["server_flags"] == ["--speculative-disable-batch-threshold", "4"]
    actions = {f["path"]: f["action"] for f in result["files"]}
    expected = {RUNTIME: "added", SERVER_ARGS: "patched"}
    expected |= {WORKER_FILES[w]: "patched" for w in pin.workers}
    if (package / SPEC_FIELDS).exists():
        expected[SPEC_FIELDS] = "patched"
    for path, action in expected.items():
        assert actions[path] == action
        data = (package / path).read_bytes()
        assert data != originals.get(path)
        compile(data, path, "exec")
        assert marker_comment(TOOL_VERSION).encode() in data
    assert_server_args_patched(package)
    if "v1" in pin.workers:
        assert_hooked(
            (package / WORKER_FILES["v1"]).read_text(), "EAGLEWorker", "maybe_fallback_v1"
        )
    if "v2" in pin.workers:
        assert_hooked(
            (package / WORKER_FILES["v2"]).read_text(), "EAGLEWorkerV2", "maybe_fallback_v2"
        )
    for worker in set(WORKER_FILES) - set(pin.workers):
        path = WORKER_FILES[worker]
        if path in originals:  # present but not patched (e.g. the beta v2): untouched
            assert (package / path).read_bytes() == originals[path]


@pytest.mark.parametrize("pin", PATCHABLE, ids=lambda p: p.version)
def test_second_apply_is_byte_identical_and_revert_restores_originals(
    pin, scratch, snapshot_tree, capsys
):
    package = scratch(pin)
    original = snapshot_tree(package)
    assert apply(capsys, package, pin)[0] == 0
    patched = snapshot_tree(package)
    code, again = apply(capsys, package, pin)
    assert code == 0
    assert {f["action"] for f in again["files"]} <= {"unchanged", "skipped"}
    assert snapshot_tree(package) == patched
    code, reverted = cli_json(capsys, "revert", "--sglang-root", str(package))
    assert code == 0, reverted
    assert snapshot_tree(package) == original
    assert not (package.parent / ".dynspec-patch" / "manifest.json").exists()
    code, status = cli_json(capsys, "status", "--sglang-root", str(package))
    assert code == 0
    assert {f["state_before"] for f in status["files"]} == {"unpatched"}


@pytest.mark.parametrize("pin", PATCHABLE, ids=lambda p: p.version)
def test_dry_run_writes_nothing(pin, scratch, snapshot_tree, capsys):
    package = scratch(pin)
    before = snapshot_tree(package.parent)
    code, result = apply(capsys, package, pin, "--dry-run")
    assert code == 0
    assert "+from sglang.srt.speculative import dynspec_fallback" in result["diff"]
    assert snapshot_tree(package.parent) == before
    assert run(["apply", "--sglang-root", str(package), "--dry-run"]) in (0, 3)
    assert snapshot_tree(package.parent) == before


@pytest.mark.parametrize("pin", PATCHABLE, ids=lambda p: p.version)
def test_apply_reports_that_the_runtime_finds_every_name(pin, capsys):
    # The whole unpacked release (read-only: a dry run), since the probe follows imports.
    package = release_dir(pin)
    code, result = apply(capsys, package, pin, "--dry-run")
    assert code == 0
    assert result["runtime"].startswith("all "), result["runtime"]  # the hook is not inert


@pytest.mark.parametrize("pin", UNSUPPORTED, ids=lambda p: p.version)
def test_unsupported_release_is_refused_with_exit_3(pin, scratch, snapshot_tree, capsys):
    package = scratch(pin)
    before = snapshot_tree(package.parent)
    code, result = cli_json(capsys, "apply", "--sglang-root", str(package))
    assert code == 3
    assert result["route"] == "unsupported"
    assert "eagle_verify_retrive" in result["reason"]
    assert snapshot_tree(package.parent) == before


def test_beta_v2_is_refused_in_auto_and_v1_alone_is_patched(scratch, snapshot_tree, capsys):
    (pin,) = [p for p in PINS if p.refused]
    package = scratch(pin)
    before = snapshot_tree(package.parent)
    code, result = cli_json(capsys, "apply", "--sglang-root", str(package))
    assert code == 3
    refused = [f for f in result["files"] if f["action"] == "refused"]
    assert [f["path"] for f in refused] == [WORKER_FILES["v2"]]
    assert "beta" in refused[0]["reason"]
    assert snapshot_tree(package.parent) == before
    code, result = cli_json(capsys, "apply", "--sglang-root", str(package), "--worker", "v1")
    assert code == 0


@pytest.mark.parametrize("pin", NATIVE, ids=lambda p: p.version)
def test_native_release_gets_flags_and_config_not_a_patch(pin, scratch, snapshot_tree, capsys):
    package = scratch(pin)
    before = snapshot_tree(package)
    code, result = cli_json(
        capsys,
        "apply",
        "--sglang-root",
        str(package),
        "--route",
        "native",
        "--threshold",
        "16",
        "--num-steps",
        "3",
    )
    assert code == 0, result
    assert result["route"] == "native" and result["routes"] == ["patch", "native"]
    native = result["native"]
    assert native["flags"][:2] == ["--speculative-adaptive", "--speculative-adaptive-config"]
    assert native["config"] == {"1": {"candidate_steps": [3]}, "17": {"candidate_steps": [0]}}
    written = json.loads(Path(native["flags"][2]).read_text())
    assert written == native["config"]
    assert snapshot_tree(package) == before  # no source change
    needs_threshold = cli_json(capsys, "apply", "--sglang-root", str(package), "--route", "native")
    assert needs_threshold[0] == 2


def test_hand_edited_patched_file_is_unknown_and_refused(scratch, snapshot_tree, capsys):
    pin = next(p for p in PATCHABLE if p.version == "0.5.10.post1")
    package = scratch(pin)
    assert apply(capsys, package, pin)[0] == 0
    worker = package / WORKER_FILES["v1"]
    worker.write_text(
        worker.read_text().replace(
            "maybe_fallback_v1(self, batch)", "maybe_fallback_v1(self, batch, 3)"
        )
    )
    before = snapshot_tree(package.parent)
    code, status = cli_json(capsys, "status", "--sglang-root", str(package))
    states = {f["path"]: f["state_before"] for f in status["files"]}
    assert states[WORKER_FILES["v1"]] == "unknown"
    assert code == 0  # status only reports
    for command in ("apply", "revert"):
        code, result = cli_json(capsys, command, "--sglang-root", str(package))
        assert code == 3
        assert result["refused"] is True
        assert snapshot_tree(package.parent) == before


def test_edit_outside_the_hooks_is_caught_by_the_manifest(scratch, snapshot_tree, capsys):
    pin = next(p for p in PATCHABLE if p.version == "0.4.10.post2")
    package = scratch(pin)
    assert apply(capsys, package, pin)[0] == 0
    server_args = package / SERVER_ARGS
    server_args.write_text(server_args.read_text() + "\n# local hot-fix\n")
    code, result = cli_json(capsys, "revert", "--sglang-root", str(package))
    assert code == 3
    assert "manifest" in json.dumps(result)
    code, result = cli_json(capsys, "revert", "--sglang-root", str(package), "--force")
    assert code == 0
    assert server_args.read_text().endswith("\n# local hot-fix\n")  # the hot-fix survives


def test_partly_patched_file_is_unknown(scratch, capsys):
    pin = next(p for p in PATCHABLE if p.version == "0.5.12.post1")
    package = scratch(pin)
    assert apply(capsys, package, pin)[0] == 0
    server_args = package / SERVER_ARGS
    lines = server_args.read_text().splitlines(keepends=True)
    (field_line,) = [
        i
        for i, line in enumerate(lines)
        if line.lstrip().startswith("speculative_disable_batch_threshold:")
    ]
    del lines[field_line]
    server_args.write_text("".join(lines))
    code, result = cli_json(capsys, "apply", "--sglang-root", str(package))
    assert code == 3
    refused = {f["path"]: f["reason"] for f in result["files"] if f["action"] == "refused"}
    assert "partly patched" in refused[SERVER_ARGS]


def test_syntax_error_is_refused_naming_file_and_line(scratch, snapshot_tree, capsys):
    pin = next(p for p in PATCHABLE if p.version == "0.5.5.post2")
    package = scratch(pin)
    worker = package / WORKER_FILES["v2"]
    lines = worker.read_text().splitlines(keepends=True)
    lines[9] = "def broken(:\n"
    worker.write_text("".join(lines))
    before = snapshot_tree(package.parent)
    code = run(["apply", "--sglang-root", str(package)])
    err = capsys.readouterr().err
    assert code == 3
    assert "srt/speculative/eagle_worker_v2.py" in err and "line 10" in err
    assert snapshot_tree(package.parent) == before


def test_older_tool_version_is_upgraded_in_one_step(scratch, snapshot_tree, capsys):
    pin = next(p for p in PATCHABLE if p.version == "0.5.13.post1")
    package = scratch(pin)
    assert apply(capsys, package, pin)[0] == 0
    current = snapshot_tree(package)
    # Re-stamp every marker as an older release of the tool would have written it.
    for path, data in current.items():
        (package / path).write_bytes(data.replace(b"dynspec-patch 0.1.0", b"dynspec-patch 0.0.9"))
    (package.parent / ".dynspec-patch" / "manifest.json").unlink()
    code, status = cli_json(capsys, "status", "--sglang-root", str(package))
    assert {f["state_before"] for f in status["files"]} == {"patched"}
    assert all("0.0.9" in f["reason"] for f in status["files"])
    code, result = apply(capsys, package, pin)
    assert code == 0
    assert {f["action"] for f in result["files"]} == {"patched"}
    assert snapshot_tree(package) == current
