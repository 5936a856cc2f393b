"""``dynspec-patch ... --host`` end to end through the CLI: output and exit codes."""

from __future__ import annotations

import json

from remote_harness import OP_USER, tree_bytes

from dynspec_patch.patcher import cli

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")


def run_json(capsys, argv):
    code = cli.run(argv)
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip().startswith("{") else out)


def test_cli_apply_status_revert_exit_codes(make_host, box, capsys):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    host.server(*SPEC, env={"SGLANG_ENABLE_SPEC_V2": "1"})

    code, out = run_json(capsys, ["detect-path", "--host", box, "--json"])
    assert code == 0 and out["live_worker"] == "v2" and out["route"] == "patch"

    code, out = run_json(capsys, ["apply", "--host", box, "--threshold", "16", "--dry-run",
                                  "--json"])
    assert code == 0 and "+++ b/srt/server_args.py" in out["diff"]
    assert tree_bytes(host.package) == original

    code, out = run_json(capsys, ["apply", "--host", box, "--threshold", "16", "--json"])
    assert code == 0 and out["restart"]["restarted"] is True
    assert out["ssh"]["connections"] == 1

    code, out = run_json(capsys, ["status", "--host", box, "--json"])
    assert code == 0 and out["host_state"] == "patched" and out["server_runs"] == "patched code"

    target = host.package / "srt/server_args.py"
    target.write_bytes(target.read_bytes() + b"# edited\n")
    code, _ = run_json(capsys, ["revert", "--host", box, "--json"])
    assert code == 3  # refused: the file changed since apply
    code, out = run_json(capsys, ["revert", "--host", box, "--force", "--json"])
    assert code == 0 and out["restart"]["restarted"] is True


def test_cli_rollback_is_exit_4_and_several_servers_exit_2(make_host, box, capsys):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    srv = host.server(*SPEC, env={"FAKE_SGLANG_FAIL_IF_PATCHED": "1"})
    code = cli.run(["apply", "--host", box, "--threshold", "16", "--health-timeout", "20"])
    err = capsys.readouterr().err
    assert code == 4 and "healthy again" in err
    assert tree_bytes(host.package) == original
    assert srv.get("/health")[0] == 200
    host.server(*SPEC)
    code = cli.run(["apply", "--host", box, "--threshold", "16"])
    assert code == 2 and "--pid or --port" in capsys.readouterr().err


def test_cli_unreachable_host_is_exit_1(sshd, tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "ssh_config"
    port = sshd.port + 1 if sshd.port < 65535 else sshd.port - 1
    cfg.write_text(f"Host dead\n  HostName 127.0.0.1\n  Port {port}\n  User {OP_USER}\n"
                   f"  IdentityFile {sshd.client_key}\n  UserKnownHostsFile {sshd.known_hosts}\n"
                   "  ConnectTimeout 3\n")
    monkeypatch.setenv("DYNSPEC_SSH_CONFIG", str(cfg))
    assert cli.run(["status", "--host", "dead"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_cli_connection_options_and_host_key_policy(sshd, tmp_path, monkeypatch, capsys):
    empty_config = tmp_path / "ssh_config"
    empty_config.write_text("")
    monkeypatch.setenv("DYNSPEC_SSH_CONFIG", str(empty_config))
    fresh = tmp_path / "known_hosts"
    fresh.write_text("")
    base = ["status", "--host", f"{OP_USER}@127.0.0.1:{sshd.port}",
            "--identity-file", str(sshd.client_key)]

    assert cli.run([*base, "--known-hosts", str(fresh)]) == 3  # unknown key: refused
    assert "not in known_hosts" in capsys.readouterr().err
    assert fresh.read_text() == ""

    assert cli.run([*base, "--known-hosts", str(fresh), "--accept-new-host-key"]) == 0
    assert fresh.read_text().strip()  # recorded on first sight
    capsys.readouterr()
    assert cli.run([*base, "--known-hosts", str(fresh)]) == 0  # and trusted from then on
    assert cli.run([*base, "--known-hosts", str(sshd.known_hosts)]) == 0
