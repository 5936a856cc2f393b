"""Host-side parity for issue 8: refusals before restart, --restore-originals, the shared
tree judgement, and output a person can read — through the CLI against the loopback sshd."""

from __future__ import annotations

import json

import pytest
from remote_harness import tree_bytes

from dynspec_patch.patcher import cli

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3")


def run_json(capsys, argv):
    code = cli.run([*argv, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


@pytest.mark.parametrize("extra", [("--speculative-eagle-topk", "4"),
                                   ("--speculative-eagle-topk", "1", "--enable-dp-attention")])
def test_native_route_refuses_a_server_adaptive_would_ignore(make_host, box, capsys, extra):
    host = make_host("0.5.16")
    srv = host.server(*SPEC, *extra)
    code, out, err = run_json(
        capsys, ["apply", "--host", box, "--route", "native", "--threshold", "8"]
    )
    assert code == 3 and out["exit_code"] == 3
    assert "switches --speculative-adaptive off" in out["error"]
    assert err.count("\n") == 1
    assert not (host.state / "dynspec-adaptive.json").exists()
    assert srv.get("/health")[0] == 200 and srv.pid in [s["pid"] for s in out["servers"]]


def test_restore_originals_on_a_host(make_host, box, capsys):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    host.server(*SPEC, "--speculative-eagle-topk", "1", env={"SGLANG_ENABLE_SPEC_V2": "1"})
    code, _, _ = run_json(capsys, ["apply", "--host", box, "--threshold", "16"])
    assert code == 0
    hook = host.package / "srt/speculative/eagle_worker_v2.py"
    hook.write_text(hook.read_text().replace("# dynspec-patch 0.1.0", "# dynspec-patch 0.1.0 ", 1))
    code, out, _ = run_json(capsys, ["revert", "--host", box])
    assert code == 3 and "--restore-originals" in out["error"]
    code, out, _ = run_json(capsys, ["revert", "--host", box, "--restore-originals"])
    assert code == 0 and out["restart"]["restarted"] is True
    assert {f["path"]: f["action"] for f in out["files"]}[
        "srt/speculative/eagle_worker_v2.py"] == "restored"
    assert tree_bytes(host.package) == original


def test_host_status_flags_hooks_without_their_runtime_and_reads_as_a_table(
        make_host, box, capsys):
    host = make_host("0.5.10.post1")
    host.server(*SPEC, "--speculative-eagle-topk", "1")
    assert cli.run(["apply", "--host", box, "--threshold", "16", "--no-restart"]) == 0
    (host.package / "srt/speculative/dynspec_fallback.py").unlink()
    capsys.readouterr()
    code, out, _ = run_json(capsys, ["status", "--host", box])
    assert code == 0 and out["host_state"] == "mixed"
    assert any("dynspec_fallback.py, which is missing" in p for p in out["problems"])
    assert cli.run(["status", "--host", box]) == 0
    shown = capsys.readouterr().out
    assert "host state" in shown and " UTC" in shown
    for python_repr in ("{'", "['", "None", "True", "False"):
        assert python_repr not in shown
    recommended = next(line for line in shown.splitlines() if line.startswith("recommended:"))
    assert "--host H" not in recommended and "N " not in recommended


def test_a_failed_restart_is_one_short_line_naming_the_log_file(make_host, box, capsys):
    host = make_host("0.5.10.post1")
    host.server(*SPEC, "--speculative-eagle-topk", "1", env={"FAKE_SGLANG_FAIL_IF_PATCHED": "1"})
    code, out, err = run_json(capsys, ["apply", "--host", box, "--threshold", "16",
                                       "--health-timeout", "20"])
    assert code == 4 and out["exit_code"] == 4
    assert err.count("\n") == 1 and len(err) < 600
    log = err.split("the server's output is in ")[1].split(" on the host")[0]
    assert log.startswith(str(host.state)) and (host.state / log.rsplit("/", 1)[1]).exists()


def test_a_restart_reports_its_progress_on_stderr(make_host, box, capsys):
    host = make_host("0.5.10.post1")
    host.server(*SPEC, "--speculative-eagle-topk", "1")
    assert cli.run(["apply", "--host", box, "--threshold", "16", "--health-timeout", "30"]) == 0
    err = capsys.readouterr().err
    assert "... stopped pid" in err and "waiting for health" in err and "health ok" in err


@pytest.mark.parametrize("adaptive", [(), ("--speculative-adaptive",)], ids=["plain", "adaptive"])
def test_patch_route_on_0517_patches_or_refuses_a_server_running_sglang_adaptive(
        make_host, box, capsys, adaptive):
    # Two controllers must not run: a v2 server with SGLang's own --speculative-adaptive is
    # refused on the patch route (exit 3, one line, nothing written, the server untouched).
    host = make_host("0.5.17")
    original = tree_bytes(host.package)
    srv = host.server(*SPEC, "--speculative-eagle-topk", "1", *adaptive)
    code, out, err = run_json(capsys, ["apply", "--host", box, "--threshold", "8"])
    if not adaptive:
        assert code == 0, out
        assert out["route"] == "patch" and out["routes"] == ["patch", "native"]
        assert out["restart"]["restarted"] is True
        assert srv.info()["speculative_disable_batch_threshold"] == 8
        return
    assert code == 3 and out["exit_code"] == 3
    assert "--speculative-adaptive" in out["error"] and "--route native" in out["error"]
    assert err.count("\n") == 1
    assert tree_bytes(host.package) == original
    assert srv.get("/health")[0] == 200 and srv.pid in [s["pid"] for s in out["servers"]]
