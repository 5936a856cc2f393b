"""The command line's contract: revert always has a way back, options are checked before
anything is read or any host contacted, one line per failure, one JSON object per exit,
readable tables, --version, -h, examples, completion, and ``fetch`` without pip."""

from __future__ import annotations

import http.server
import json
import shlex
import threading
from pathlib import Path

import pytest

from dynspec_patch.patcher import local
from dynspec_patch.patcher.cli import run
from dynspec_patch.patcher.engine import plan_apply
from dynspec_patch.patcher.releases import fetch_wheel, find_pin, release_dir
from tests.codemods.cli_process import run_cli

V1 = "srt/speculative/eagle_worker.py"
V2 = "srt/speculative/eagle_worker_v2.py"
UNREACHABLE = "127.0.0.1:1"  # if validation ever let a command through, it fails locally


def _sources(package: Path) -> dict[str, bytes]:
    return {str(p.relative_to(package)): p.read_bytes() for p in package.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- revert


def test_revert_on_the_native_route_removes_the_config_it_wrote(scratch, capsys):
    package = scratch(find_pin("0.5.23"))
    before = _sources(package)
    argv = ["apply", "--sglang-root", str(package), "--route", "native", "--threshold", "8"]
    assert run(argv) == 0
    config = local.native_config_path(package)
    assert config.exists()
    capsys.readouterr()
    assert run(["revert", "--sglang-root", str(package), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["route"] == "native" and out["removed"] == str(config)
    assert shlex.split(out["relaunch_without"]) == [
        "--speculative-adaptive",
        "--speculative-adaptive-config",
        str(config),
    ]
    assert not config.exists() and _sources(package) == before


def test_revert_restore_originals_undoes_an_edit_inside_the_inserted_statements(
    scratch, capsys
):
    package = scratch(find_pin("0.5.10.post1"))
    original = _sources(package)
    assert run(["apply", "--sglang-root", str(package)]) == 0
    hook = package / V1
    inserted = "maybe_fallback_v1(self, batch)"
    hook.write_text(hook.read_text().replace(inserted, "maybe_fallback_v1(self, batch, )"))
    capsys.readouterr()
    assert run(["revert", "--sglang-root", str(package)]) == 3
    assert "--restore-originals" in capsys.readouterr().err
    assert run(["revert", "--sglang-root", str(package), "--restore-originals", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {f["path"]: f["action"] for f in out["files"]}[V1] == "restored"
    assert _sources(package) == original
    assert not local.state_dir(package).joinpath("originals").exists()


def test_revert_leaves_alone_a_file_dynspec_patch_never_touched(scratch, capsys):
    package = scratch(find_pin("0.5.10.post1"))
    original = _sources(package)
    assert run(["apply", "--sglang-root", str(package), "--worker", "v1"]) == 0
    other = package / V2
    edited = other.read_bytes() + b"# a local dynspec experiment\n"  # unknown to the codemod
    other.write_bytes(edited)
    capsys.readouterr()
    assert run(["revert", "--sglang-root", str(package), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {f["path"]: f["action"] for f in out["files"]}[V2] == "skipped"
    assert other.read_bytes() == edited
    assert _sources(package) == original | {V2: edited}


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("server_args", "argv", "reason"),
    [
        ({"speculative_eagle_topk": 4}, [], "topk 1 only"),
        ({}, ["--speculative-eagle-topk", "2"], "topk 1 only"),
        ({"enable_dp_attention": True}, [], "DP attention"),
        ({}, ["--enable-multi-layer-eagle"], "multi-layer EAGLE"),
        ({"enable_two_batch_overlap": True}, [], "two-batch overlap"),
        ({}, ["--enable-pdmux"], "pdmux"),
    ],
)
def test_native_route_refuses_servers_where_adaptive_switches_itself_off(
    server_args, argv, reason
):
    snapshot = local.read_snapshot(release_dir(find_pin("0.5.16")))
    plan = plan_apply(
        snapshot, threshold=8, server_args=server_args, server_argv=argv, route="native"
    )
    assert plan.refused and reason in plan.refusal_reason
    assert "nothing was written" in plan.refusal_reason
    fine = plan_apply(
        snapshot, threshold=8, server_args={"speculative_eagle_topk": 1}, route="native"
    )
    assert not fine.refused


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["apply", "--num-steps", "0"], "--num-steps must be between 1 and"),
        (["apply", "--num-steps", "-3"], "--num-steps must be between 1 and"),
        (["apply", "--threshold", "0"], "--threshold must be between 1 and 65536"),
        (["apply", "--threshold", "1000000"], "--threshold must be between 1 and 65536"),
        (["apply", "--worker", "v3"], "--worker must be one of"),
        (["apply", "--pid", "12"], "--pid applies only with --host"),
        (["revert", "--restart-cmd", "true"], "--restart-cmd applies only with --host"),
        (["status", "--accept-new-host-key"], "--accept-new-host-key applies only with --host"),
        (["detect-path", "--connect-timeout", "3"], "--connect-timeout applies only with --host"),
        (["apply", "--host", UNREACHABLE], "give --host or --sglang-root, not both"),
    ],
)
def test_bad_options_are_usage_errors_before_anything_is_read(scratch, argv, message):
    package = scratch(find_pin("0.5.10.post1"))
    before = _sources(package)
    done = run_cli(*argv, "--sglang-root", str(package))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr
    assert _sources(package) == before and not local.state_dir(package).exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["apply", "--host", UNREACHABLE, "--identity-file", "/nonexistent/key"], "not a readable"),
        (["apply", "--host", UNREACHABLE, "--num-steps", "3"], "--num-steps applies only with"),
        (["apply", "--host", UNREACHABLE, "--threshold", "-1"], "--threshold must be"),
        (["apply", "--host", UNREACHABLE, "--health-timeout", "0"], "--health-timeout must be"),
        (["status", "--host", "user@"], "--host must be [user@]host[:port]"),
        (["status", "--host", "box:99999"], "--host must be [user@]host[:port]"),
        (["status", "--host", "two words"], "--host must be [user@]host[:port]"),
    ],
)
def test_host_options_are_checked_before_connecting(argv, message):
    done = run_cli(*argv)
    assert done.returncode == 2 and message in done.stderr
    assert "cannot reach" not in done.stderr and "cannot connect" not in done.stderr


# --------------------------------------------------------------------------- errors, --json


def test_an_os_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    done = run_cli("fetch", "0.4.6.post5", "--dest", str(blocker))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert str(blocker) in done.stderr
    debug = run_cli("fetch", "0.4.6.post5", "--dest", str(blocker), "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["apply", "--no-such-flag"], 2),
        (["apply"], 2),
        (["apply", "--sglang-root", "/nonexistent"], 2),
        (["status", "--host", "bad:port"], 2),
        (["fetch", "9.9.9", "--dest", "/tmp"], 2),
        (["probe", "--sglang-root", "{v0434}"], 3),
        (["apply", "--sglang-root", "{v0510}", "--route", "native"], 3),
        (["apply", "--sglang-root", "{v0510}", "--route", "steps0"], 2),
        (["apply", "--sglang-root", "{v0434}"], 3),
        (["status", "--sglang-root", "{v0510}"], 0),
    ],
)
def test_json_prints_one_object_on_every_exit(argv, code):
    trees = {
        "{v0523}": release_dir(find_pin("0.5.23")),
        "{v0434}": release_dir(find_pin("0.4.3.post4")),
        "{v0510}": release_dir(find_pin("0.5.10.post1")),
    }
    done = run_cli(*[str(trees.get(a, a)) for a in argv], "--json")
    assert done.returncode == code, done.stderr
    data = json.loads(done.stdout)  # exactly one object, nothing else on stdout
    assert isinstance(data, dict)
    if code:
        assert data["exit_code"] == code and data["error"]
        assert done.stderr.count("\n") == 1


def test_json_prints_one_object_on_an_internal_error(scratch, monkeypatch, capsys):
    """A bug (an exception nobody expects) still ends in one object, and the traceback."""
    package = scratch(find_pin("0.5.10.post1"))

    def broken_manifest_reader(_package):
        raise KeyError("sha256_after")  # what a bug in manifest handling would raise

    monkeypatch.setattr(local, "read_manifest", broken_manifest_reader)
    capsys.readouterr()
    assert run(["status", "--sglang-root", str(package), "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"error": "internal error: KeyError: 'sha256_after'",
                                        "exit_code": 1}
    assert "Traceback" in captured.err and "broken_manifest_reader" in captured.err


def test_version_help_examples_and_completion():
    from dynspec_patch.transforms.markers import TOOL_VERSION

    assert run_cli("--version").stdout.strip() == f"dynspec-patch {TOOL_VERSION}"
    short, long = run_cli("-h"), run_cli("--help")
    assert short.returncode == 0 and short.stdout == long.stdout
    assert "Examples:" in short.stdout and "dynspec-patch apply --host" in short.stdout
    for command in ("apply", "revert", "status", "detect-path", "fetch", "probe", "check-pins"):
        assert "Examples:" in run_cli(command, "-h").stdout, command
    script = run_cli("--show-completion", "bash")
    assert script.returncode == 0 and "_DYNSPEC_PATCH_COMPLETE" in script.stdout


def test_status_and_detect_path_read_as_tables_with_a_pasteable_command(scratch):
    package = scratch(find_pin("0.5.10.post1"))
    detect = run_cli("detect-path", "--sglang-root", str(package))
    assert detect.returncode == 0
    line = next(x for x in detect.stdout.splitlines() if x.startswith("recommended"))
    command = shlex.split(line.removeprefix("recommended:"))
    assert command[:2] == ["dynspec-patch", "apply"]
    assert run(command[1:]) == 0  # it can be pasted as printed
    assert run(["apply", "--sglang-root", str(package)]) == 0
    shown = run_cli("status", "--sglang-root", str(package)).stdout
    assert "tree state" in shown and "patched" in shown
    assert " UTC" in shown and "created" in shown
    for python_repr in ("{'", "['", "None", "True", "False"):
        assert python_repr not in shown


# --------------------------------------------------------------------------- fetch


class _FakePyPI(http.server.BaseHTTPRequestHandler):
    """PyPI's JSON API and file host for one wheel, on 127.0.0.1."""

    wheel: Path

    def do_GET(self) -> None:
        base = f"http://127.0.0.1:{self.server.server_address[1]}"
        if self.path.endswith("/json"):
            body = json.dumps(
                {"urls": [{"filename": self.wheel.name, "url": f"{base}/files/{self.wheel.name}"}]}
            ).encode()
        elif self.path == f"/files/{self.wheel.name}":
            body = self.wheel.read_bytes()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_fetch_downloads_from_pypi_when_pip_is_absent(tmp_path, monkeypatch, capsys):
    pin = find_pin("0.4.6.post5")
    _FakePyPI.wheel = fetch_wheel(pin)  # the real wheel, served from loopback
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakePyPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("DYNSPEC_CACHE", str(tmp_path / "cache"))
        monkeypatch.delenv("DYNSPEC_OFFLINE", raising=False)
        monkeypatch.setenv("DYNSPEC_PYPI_URL", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setattr("dynspec_patch.patcher.releases._pip_available", lambda: False)
        assert run(["fetch", pin.version, "--dest", str(tmp_path / "out")]) == 0
        target = Path(capsys.readouterr().out.strip())
        assert (target / "srt" / "server_args.py").exists()
        monkeypatch.setenv("DYNSPEC_PYPI_URL", "http://127.0.0.1:1")  # nothing listens
        monkeypatch.setenv("DYNSPEC_CACHE", str(tmp_path / "empty"))
        assert run(["fetch", pin.version, "--dest", str(tmp_path / "out2")]) == 1
        message = capsys.readouterr().err
        assert "pip is not installed in this environment" in message
        assert message.count("dynspec-patch:") == 1  # one error line after the progress line
    finally:
        server.shutdown()


def test_check_pins_reports_progress_on_stderr_but_not_with_json(scratch):
    package = scratch(find_pin("0.5.10.post1"))
    shown = run_cli("check-pins", "--sglang-root", str(package))
    assert shown.returncode == 0 and f"[1/1] {package}" in shown.stderr
    quiet = run_cli("check-pins", "--sglang-root", str(package), "--json")
    assert quiet.returncode == 0 and quiet.stderr == "" and json.loads(quiet.stdout)["rows"]
