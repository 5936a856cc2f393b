"""``--threshold auto`` over the real loopback sshd (issue 16): the restarted server's argv
carries ``--speculative-disable-batch-threshold auto``, the proof after the restart expects
``"auto"``, and ``status`` / ``detect-path`` show it (human and ``--json``), also where only the
command line tells (no server info, no log line). The native route refuses it untouched."""

from __future__ import annotations

import json

from remote_harness import tree_bytes

from dynspec_patch.patcher import cli
from dynspec_patch.transforms.native_adaptive import CONFIG_FILE_NAME

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")
AUTO_FLAG = ["--speculative-disable-batch-threshold", "auto"]
FIELD = "speculative_disable_batch_threshold"


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.run([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)  # one object on every exit


def test_apply_auto_restarts_with_auto_and_status_shows_it(make_host, box, capsys):
    host = make_host("0.5.10.post1")
    srv = host.server(*SPEC, env={"SGLANG_ENABLE_SPEC_V2": "1"})
    code, out = run_json(capsys, "apply", "--host", box, "--threshold", "auto")
    assert code == 0 and out["restart"]["restarted"] is True
    assert out["server_flags"] == AUTO_FLAG
    assert out["restart"]["proof"]["checked"] == {FIELD: "auto"}
    info = srv.info()
    assert info[FIELD] == "auto" and info["fake_argv"][-2:] == AUTO_FLAG

    for command in ("status", "detect-path"):
        code, report = run_json(capsys, command, "--host", box)
        assert code == 0 and report["running_threshold"] == "auto", command
    assert cli.run(["status", "--host", box]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["running", "threshold", "auto"] in rows

    # back to a fixed T: no file changes, one restart, the flag once with the new value
    code, out = run_json(capsys, "apply", "--host", box, "--threshold", "16")
    assert code == 0 and out["files_changed"] == [] and out["restart"]["restarted"] is True
    argv = srv.info()["fake_argv"]
    assert argv.count("--speculative-disable-batch-threshold") == 1 and argv[-1] == "16"
    assert srv.info()[FIELD] == 16


def test_status_reads_auto_from_the_command_line_alone(make_host, box, capsys):
    host = make_host("0.5.10.post1")
    host.server(*SPEC)
    code, out = run_json(capsys, "apply", "--host", box, "--threshold", "auto", "--no-restart")
    assert code == 0 and out["files_changed"]
    host.stop_servers()
    (host.root / "server.log").write_bytes(b"")  # the first server's server_args= line goes
    # the patched server, relaunched by hand: it answers no info endpoint, logs no server_args=
    quiet = {"FAKE_SGLANG_NO_INFO": "1", "FAKE_SGLANG_NO_LOG_LINE": "1"}
    host.server(*SPEC, *AUTO_FLAG, env=quiet)
    code, report = run_json(capsys, "status", "--host", box)
    assert code == 0 and report["running_threshold"] == "auto"


def test_auto_on_the_native_route_is_refused_before_anything_changes(make_host, box, capsys):
    host = make_host("0.5.23")
    original = tree_bytes(host.package)
    srv = host.server(*SPEC, env={"SGLANG_ENABLE_SPEC_V2": "1"})
    pid = srv.info()["fake_pid"]
    code, out = run_json(capsys, "apply", "--host", box, "--route", "native",
                         "--threshold", "auto")
    assert code == 3 and out["exit_code"] == 3
    assert out["error"].startswith("--threshold auto needs the patch route")
    assert tree_bytes(host.package) == original
    assert not (host.state / CONFIG_FILE_NAME).exists()
    assert srv.info()["fake_pid"] == pid  # not restarted
