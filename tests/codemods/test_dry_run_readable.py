"""A dry run a person can read (issue 13, item 4): the hooks' diff first, then server_args.py,
and the ~1,300-line runtime module as one line (path, lines, sha256) unless ``--full-diff``;
``--json`` keeps every diff in full."""

from __future__ import annotations

import hashlib
import json
import re

from dynspec_patch.patcher.cli import run
from dynspec_patch.patcher.releases import find_pin

RUNTIME = "srt/speculative/dynspec_fallback.py"
HOOKS_THEN_ARGS = ["srt/speculative/eagle_worker.py", "srt/speculative/eagle_worker_v2.py",
                   "srt/server_args.py"]


def _headers(text: str) -> list[str]:
    """The files a unified diff shows, in order (its ``+++ b/PATH`` / ``--- a/PATH`` lines)."""
    return re.findall(r"^\+\+\+ b/(\S+)|^--- a/(\S+)\n\+\+\+ /dev/null", text, re.M)


def _shown(text: str) -> list[str]:
    return [new or old for new, old in _headers(text)]


def _runtime_line(text: str) -> str:
    (line,) = [line for line in text.splitlines() if line.startswith(f"{RUNTIME}:")]
    return line


def test_dry_runs_show_hooks_then_server_args_and_the_runtime_as_one_line(scratch, capsys):
    package = scratch(find_pin("0.5.10.post1"))
    capsys.readouterr()
    assert run(["apply", "--sglang-root", str(package), "--threshold", "8", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert _shown(text) == HOOKS_THEN_ARGS
    assert run(["apply", "--sglang-root", str(package), "--threshold", "8", "--dry-run",
                "--full-diff"]) == 0
    full = capsys.readouterr().out
    assert run(["apply", "--sglang-root", str(package), "--threshold", "8"]) == 0
    written = (package / RUNTIME).read_bytes()  # what the one line must describe
    lines = len(written.splitlines())
    assert lines > 1000

    line = _runtime_line(text)
    assert f"{lines:,} lines" in line and "new file" in line
    assert hashlib.sha256(written).hexdigest() in line
    assert "--full-diff" in line
    assert text.index("+++ b/srt/server_args.py") < text.index(line)  # after the diffs
    assert len(text.splitlines()) < 200  # a screenful or two, not 1,400 lines

    assert _shown(full) == [*HOOKS_THEN_ARGS, RUNTIME]
    runtime_diff = full.split(f"+++ b/{RUNTIME}\n", 1)[1]
    assert sum(1 for row in runtime_diff.splitlines() if row.startswith("+")) >= lines

    capsys.readouterr()
    assert run(["revert", "--sglang-root", str(package), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert _shown(text) == HOOKS_THEN_ARGS
    line = _runtime_line(text)
    assert "removed" in line and f"{lines:,} lines" in line


def test_json_keeps_the_full_diff_in_plan_order(scratch, capsys):
    package = scratch(find_pin("0.5.10.post1"))
    capsys.readouterr()
    argv = ["apply", "--sglang-root", str(package), "--threshold", "8", "--dry-run", "--json"]
    assert run(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert run([*argv, "--full-diff"]) == 0
    assert json.loads(capsys.readouterr().out) == plain
    # the plan's order, as before: runtime module, server_args.py, the hooks
    assert _shown(plain["diff"]) == [RUNTIME, HOOKS_THEN_ARGS[2], *HOOKS_THEN_ARGS[:2]]


def test_full_diff_needs_dry_run(scratch, capsys):
    package = scratch(find_pin("0.5.10.post1"))
    assert run(["apply", "--sglang-root", str(package), "--full-diff"]) == 2
    assert "--full-diff applies only with --dry-run" in capsys.readouterr().err
