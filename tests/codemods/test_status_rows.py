"""``status`` agrees with ``apply`` row by row (issue 13, item 3): a patched file edited by hand
outside the inserted statements is still "patched" to its codemod, but ``apply`` refuses it as
``unknown`` (its sha256 is not the one the manifest recorded); its own ``status`` row says so."""

from __future__ import annotations

import json

import pytest

from dynspec_patch.patcher.cli import run
from dynspec_patch.patcher.releases import find_pin

SERVER_ARGS = "srt/server_args.py"
V1 = "srt/speculative/eagle_worker.py"
EDITED_SINCE_APPLY = "changed since dynspec-patch wrote it (sha256 differs from the manifest)"


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = run([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("edited", [SERVER_ARGS, V1])
def test_a_hand_edited_patched_file_is_unknown_in_its_own_status_row(scratch, capsys, edited):
    package = scratch(find_pin("0.5.10.post1"))
    assert run(["apply", "--sglang-root", str(package), "--threshold", "8"]) == 0
    target = package / edited
    target.write_text(target.read_text() + "\n# local hot-fix\n")
    capsys.readouterr()

    code, status = cli_json(capsys, "status", "--sglang-root", str(package))
    assert code == 0
    rows = {f["path"]: f for f in status["files"]}
    assert rows[edited]["state_before"] == "unknown"
    assert rows[edited]["reason"] == EDITED_SINCE_APPLY
    assert status["tree_state"] == "mixed"
    assert status["problems"] == [f"{edited}: {EDITED_SINCE_APPLY}"]  # once, in its own words

    code, applied = cli_json(capsys, "apply", "--sglang-root", str(package), "--threshold", "8")
    assert code == 3
    assert {f["path"]: f["state_before"] for f in applied["files"]} == {
        path: row["state_before"] for path, row in rows.items()
    }
    code, detected = cli_json(capsys, "detect-path", "--sglang-root", str(package))
    assert {f["path"]: f["state_before"] for f in detected["files"]} == {
        path: row["state_before"] for path, row in rows.items()
    }

    assert run(["status", "--sglang-root", str(package)]) == 0
    table = capsys.readouterr().out
    (row,) = [line for line in table.splitlines() if line.lstrip().startswith(edited)]
    assert "unknown" in row and "patched" not in row.replace(EDITED_SINCE_APPLY, "")
