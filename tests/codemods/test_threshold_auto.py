"""``--threshold auto`` (issue 16): the word travels to the launch flag on the patch route, is
refused on the native route with nothing written, and any other word is a usage error before
anything is read. A fixed T keeps its own tests (test_cli_contract, test_pinned_releases)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynspec_patch.patcher import local
from dynspec_patch.patcher.engine import NATIVE_AUTO_REFUSAL, parse_threshold
from dynspec_patch.patcher.errors import UsageError
from dynspec_patch.patcher.facts import effective_from_argv
from dynspec_patch.patcher.releases import find_pin
from tests.codemods.cli_process import run_cli

AUTO_FLAG = ["--speculative-disable-batch-threshold", "auto"]
UNREACHABLE = "127.0.0.1:1"  # a command that got past validation fails locally, not elsewhere
BAD_WORD = "--threshold must be an integer between 1 and 65536 or auto"


def _sources(package: Path) -> dict[str, bytes]:
    return {str(p.relative_to(package)): p.read_bytes() for p in package.rglob("*") if p.is_file()}


def _json(*argv: str) -> tuple[int, dict, str]:
    done = run_cli(*argv, "--json")
    return done.returncode, json.loads(done.stdout), done.stderr  # one object, or this raises


@pytest.mark.parametrize("version", ["0.5.10.post1", "0.5.23"])
def test_apply_auto_patches_and_names_the_auto_launch_flag(scratch, version):
    package = scratch(find_pin(version))
    code, applied, _ = _json("apply", "--sglang-root", str(package), "--threshold", "auto")
    assert code == 0
    assert applied["route"] == "patch" and not applied["refused"]
    assert applied["server_flags"] == AUTO_FLAG
    assert {f["action"] for f in applied["files"]} >= {"patched"}

    for command in ("status", "detect-path"):
        code, report, _ = _json(command, "--sglang-root", str(package))
        assert code == 0 and report["tree_state"] == "patched", command

    human = run_cli("apply", "--sglang-root", str(package), "--threshold", "auto")
    assert human.returncode == 0
    assert "launch flag: --speculative-disable-batch-threshold auto" in human.stdout
    # the tree is the same for every threshold: a fixed T afterwards changes no file
    code, fixed, _ = _json("apply", "--sglang-root", str(package), "--threshold", "8")
    assert code == 0 and fixed["server_flags"] == ["--speculative-disable-batch-threshold", "8"]
    assert {f["action"] for f in fixed["files"]} <= {"unchanged", "skipped"}


def test_auto_on_the_native_route_is_refused_and_writes_nothing(scratch):
    package = scratch(find_pin("0.5.23"))
    before = _sources(package)
    argv = ("apply", "--sglang-root", str(package), "--route", "native", "--threshold", "auto")
    code, refused, stderr = _json(*argv)
    assert code == 3
    assert refused["error"] == NATIVE_AUTO_REFUSAL and refused["exit_code"] == 3
    assert refused["route"] == "native" and refused["server_flags"] == []
    assert stderr.count("\n") == 1 and NATIVE_AUTO_REFUSAL in stderr
    human = run_cli(*argv)
    assert human.returncode == 3 and human.stderr.count("\n") == 1
    assert _sources(package) == before
    assert not local.state_dir(package).exists()
    assert not local.native_config_path(package).exists()


@pytest.mark.parametrize("word", ["fast", "Auto", "8.5", "", "0x10", "auto8"])
def test_other_words_are_usage_errors_before_anything_is_read(scratch, word):
    package = scratch(find_pin("0.5.10.post1"))
    before = _sources(package)
    code, error, stderr = _json("apply", "--sglang-root", str(package), "--threshold", word)
    assert code == 2 and error == {"error": f"{BAD_WORD}, got {word!r}", "exit_code": 2}
    assert stderr.count("\n") == 1 and BAD_WORD in stderr
    assert _sources(package) == before and not local.state_dir(package).exists()


@pytest.mark.parametrize("word", ["fast", "-1"])
def test_a_bad_word_is_refused_before_connecting(word):
    done = run_cli("apply", "--host", UNREACHABLE, "--threshold", word)
    assert done.returncode == 2 and "--threshold must be" in done.stderr
    assert "cannot reach" not in done.stderr and "cannot connect" not in done.stderr


@pytest.mark.parametrize(
    ("given", "parsed"),
    [("auto", "auto"), ("24", 24), (" 24 ", 24), (24, 24), (None, None), ("65536", 65536)],
)
def test_parse_threshold_takes_ints_digit_strings_and_auto(given, parsed):
    assert parse_threshold(given) == parsed


@pytest.mark.parametrize("given", [True, 2.0, "AUTO", "0", 0, "65537", ["auto"]])
def test_parse_threshold_refuses_everything_else(given):
    with pytest.raises(UsageError, match="--threshold must be"):
        parse_threshold(given)


def test_a_server_argv_with_auto_reads_as_auto():
    argv = ["python", "-m", "sglang.launch_server", "--speculative-algorithm", "EAGLE3", *AUTO_FLAG]
    values, _ = effective_from_argv("0.5.10.post1", argv, {})
    assert values["speculative_disable_batch_threshold"] == "auto"
    values, _ = effective_from_argv("0.5.10.post1", [*argv[:-1], "16"], {})
    assert values["speculative_disable_batch_threshold"] == 16
