"""On a host as locally (issue 13, items 3 and 4): ``status`` agrees with ``apply`` row by row
(a patched file edited by hand is ``unknown`` in its own row), and a dry run reads as a person
needs it (the hooks, then server_args.py, the runtime module as one line unless
``--full-diff``; ``--json`` keeps every diff)."""

from __future__ import annotations

import hashlib
import json
import re

from dynspec_patch.patcher import cli
from dynspec_patch.patcher import remote_commands as rc

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")
V2_ENV = {"SGLANG_ENABLE_SPEC_V2": "1"}
RUNTIME = "srt/speculative/dynspec_fallback.py"
SERVER_ARGS = "srt/server_args.py"
V2 = "srt/speculative/eagle_worker_v2.py"


def apply(host, **kw):
    args = {"threshold": 16, "worker": "auto", "dry_run": False, "no_restart": False,
            "restart_cmd": None, "pid": None, "port": None, "health_timeout": 30.0,
            "stop_timeout": 5.0}
    args.update(kw)
    return rc.apply(host.options(), **args)


def rows(result) -> dict[str, str]:
    return {f.path: f.state_before for f in result["plan"].files}


def test_status_on_a_host_agrees_with_apply_row_by_row(make_host):
    host = make_host("0.5.10.post1")
    host.server(*SPEC, env=V2_ENV)
    apply(host)
    target = host.package / SERVER_ARGS
    target.write_bytes(target.read_bytes() + b"# local hot-fix\n")

    st = rc.status(host.options())
    assert rows(st)[SERVER_ARGS] == "unknown"
    assert st["host_state"] == "mixed"
    assert [p for p in st["problems"] if p.startswith(SERVER_ARGS)] == [
        f"{SERVER_ARGS}: changed since dynspec-patch wrote it (sha256 differs from the manifest)"]
    assert rows(apply(host, dry_run=True)) == rows(st)
    assert rows(rc.detect_path(host.options(), pid=None, port=None)) == rows(st)
    refused = apply(host)["plan"]  # the CLI exits 3 on it
    assert refused.refused and "sha256 differs from the manifest" in refused.refusal_reason


def _shown(text: str) -> list[str]:
    found = re.findall(r"^\+\+\+ b/(\S+)", text, re.M)
    return found + [f"{line.split(':')[0]} (one line)" for line in text.splitlines()
                    if line.startswith(f"{RUNTIME}:")]


def test_a_host_dry_run_reads_hooks_first_and_the_runtime_as_one_line(make_host, box, capsys):
    host = make_host("0.5.10.post1")
    host.server(*SPEC, env=V2_ENV)  # the live worker is v2: only its hook is patched
    dry = ["apply", "--host", box, "--threshold", "16", "--dry-run"]

    assert cli.run(dry) == 0
    text = capsys.readouterr().out
    assert _shown(text) == [V2, SERVER_ARGS, f"{RUNTIME} (one line)"]

    assert cli.run([*dry, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    (runtime,) = [f for f in full["files"] if f["path"] == RUNTIME]
    after = full["diff"].split(f"+++ b/{RUNTIME}\n", 1)[1].split("\n--- ", 1)[0]
    added = [row[1:] for row in after.splitlines() if row.startswith("+")]
    line = next(row for row in text.splitlines() if row.startswith(f"{RUNTIME}:"))
    assert f"{len(added):,} lines" in line and runtime["sha256_after"] in line
    assert hashlib.sha256(("\n".join(added) + "\n").encode()).hexdigest() == \
        runtime["sha256_after"]  # the JSON diff is the whole module

    assert cli.run([*dry, "--full-diff"]) == 0
    assert _shown(capsys.readouterr().out) == [V2, SERVER_ARGS, RUNTIME]
