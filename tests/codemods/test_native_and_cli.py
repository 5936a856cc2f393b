"""Native config translation, CLI usage errors, atomic local writes, and the release cache."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dynspec_patch.patcher import local
from dynspec_patch.patcher.cli import run
from dynspec_patch.patcher.engine import FileChange, Plan
from dynspec_patch.patcher.errors import RefusedError, ReleaseFetchError
from dynspec_patch.patcher.releases import Pin, fetch_wheel, find_pin, release_dir
from dynspec_patch.transforms.native_adaptive import native_config


@pytest.mark.parametrize(
    ("threshold", "graph_bs", "effective", "key"),
    [
        (8, None, 8, "9"),
        (8, [1, 2, 4, 8, 16], 8, "9"),  # a captured size: exact
        (10, [1, 2, 4, 8, 16, 24], 16, "17"),  # padded up: speculation runs to 16
        (300, [1, 2, 4, 8, 256], 300, "301"),  # above every graph size: no padding
    ],
)
def test_native_slot_key_sits_above_the_padded_threshold(threshold, graph_bs, effective, key):
    config = native_config(threshold, 3, "/etc/x.json", graph_bs)
    assert config.effective_threshold == effective
    assert config.config == {"1": {"candidate_steps": [3]}, key: {"candidate_steps": [0]}}
    assert config.flags == (
        "--speculative-adaptive",
        "--speculative-adaptive-config",
        "/etc/x.json",
    )
    assert any(str(effective) in note for note in config.notes) == (effective != threshold)


def test_usage_errors_exit_2(tmp_path, capsys):
    assert run(["apply", "--sglang-root", str(tmp_path)]) == 2
    assert "not an SGLang package" in capsys.readouterr().err
    assert run(["apply"]) == 2
    assert run(["apply", "--no-such-flag"]) == 2


def test_bad_worker_choice_exits_2(scratch, capsys):
    package = scratch(find_pin("0.5.10.post1"))
    assert run(["apply", "--sglang-root", str(package), "--worker", "v3"]) == 2
    assert "--worker must be one of" in capsys.readouterr().err


def test_missing_worker_file_is_refused(scratch, capsys):
    package = scratch(find_pin("0.5.13.post1"))  # v1 was removed in 0.5.13
    assert run(["apply", "--sglang-root", str(package), "--worker", "v1"]) == 3
    assert "no srt/speculative/eagle_worker.py" in capsys.readouterr().err


def test_console_script_exit_codes(scratch, tmp_path):
    package = scratch(find_pin("0.4.3.post4"))
    cmd = [sys.executable, "-m", "dynspec_patch.patcher.cli"]
    refused = subprocess.run(
        [*cmd, "apply", "--sglang-root", str(package)], capture_output=True, text=True, check=False
    )
    assert refused.returncode == 3
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("dynspec-patch: ")
    usage = subprocess.run(
        [*cmd, "apply", "--sglang-root", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert usage.returncode == 2


def test_write_plan_writes_nothing_if_any_file_fails_to_compile(tmp_path):
    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    good, bad = package / "srt" / "a.py", package / "srt" / "b.py"
    good.write_text("A = 1\n")
    bad.write_text("B = 1\n")
    plan = Plan(
        "apply",
        "x",
        "patch",
        "test",
        (
            FileChange("srt/a.py", b"A = 1\n", b"A = 2\n", "unpatched", "patched", "patched"),
            FileChange("srt/b.py", b"B = 1\n", b"B = (\n", "unpatched", "patched", "patched"),
        ),
    )
    with pytest.raises(RefusedError, match=r"b\.py would not compile"):
        local.write_plan(package, plan)
    assert good.read_text() == "A = 1\n" and bad.read_text() == "B = 1\n"
    assert sorted(p.name for p in (package / "srt").iterdir()) == ["a.py", "b.py"]
    assert not (tmp_path / ".dynspec-patch").exists()


def test_written_files_keep_their_mode(scratch, capsys):
    package = scratch(find_pin("0.5.5.post2"))
    target = package / "srt" / "server_args.py"
    target.chmod(0o640)
    assert run(["apply", "--sglang-root", str(package)]) == 0
    assert target.stat().st_mode & 0o777 == 0o640


def test_corrupt_cached_wheel_is_rejected_offline(tmp_path, monkeypatch):
    pin = find_pin("0.4.6.post5")
    cached = fetch_wheel(pin)  # from the real cache, sha256-checked
    monkeypatch.setenv("DYNSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("DYNSPEC_OFFLINE", "1")
    (tmp_path / "wheels").mkdir()
    corrupt = tmp_path / "wheels" / pin.wheel
    shutil.copy(cached, corrupt)
    with corrupt.open("r+b") as fh:
        fh.seek(1000)
        fh.write(b"\0\0\0\0")
    with pytest.raises(ReleaseFetchError, match="DYNSPEC_OFFLINE"):
        release_dir(pin)
    assert not corrupt.exists()  # never trusted again


def test_pin_with_a_wrong_hash_is_not_served_from_cache(tmp_path, monkeypatch):
    real = find_pin("0.4.6.post5")
    cached = fetch_wheel(real)
    monkeypatch.setenv("DYNSPEC_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    shutil.copy(cached, tmp_path / "wheels" / real.wheel)
    wrong = Pin(real.version, real.wheel, "0" * 64, real.route)
    with pytest.raises(ReleaseFetchError):
        release_dir(wrong)
    assert not (tmp_path / "releases" / real.version).exists()
    shutil.copy(cached, tmp_path / "wheels" / real.wheel)
    unpacked = release_dir(real)
    assert (unpacked / "srt" / "server_args.py").exists()
    assert Path(unpacked.parent / ".complete").read_text().strip() == real.sha256


def test_probe_command_exit_codes(scratch, capsys):
    package = scratch(find_pin("0.5.10.post1"))
    assert run(["probe", "--sglang-root", str(release_dir(find_pin("0.5.10.post1")))]) == 0
    assert run(["probe", "--sglang-root", str(release_dir(find_pin("0.5.23")))]) == 0
    assert run(["probe", "--sglang-root", str(release_dir(find_pin("0.4.3.post4")))]) == 3
    info = package.parent / "full"
    shutil.copytree(release_dir(find_pin("0.5.10.post1")), info / "sglang")
    eagle_info = info / "sglang" / "srt" / "speculative" / "eagle_info.py"
    eagle_info.write_text(eagle_info.read_text().replace("retrive_next_sibling", "retr_sibling"))
    capsys.readouterr()
    assert run(["probe", "--sglang-root", str(info / "sglang"), "--json"]) == 1
    assert '"found": false' in capsys.readouterr().out
    assert run(["detect-path", "--sglang-root", str(info / "sglang"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runtime"].startswith("the runtime would stay off")
    good = release_dir(find_pin("0.5.10.post1"))
    assert run(["detect-path", "--sglang-root", str(good), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runtime"].startswith("all ")


@pytest.mark.parametrize(
    ("spec", "host", "port", "user"),
    [
        ("gpu-box-1", "gpu-box-1", None, None),
        ("ubuntu@gpu-box-1:2222", "gpu-box-1", 2222, "ubuntu"),
        ("[::1]:2200", "::1", 2200, None),
        ("ops@[::1]", "::1", None, "ops"),
    ],
)
def test_host_spec_is_split_into_user_host_and_port(spec, host, port, user):
    from dynspec_patch.patcher.cli import _host_options

    options = _host_options(spec, None, None, None, False, 15.0)
    assert (options.host, options.port, options.user) == (host, port, user)


def test_bad_host_spec_is_a_usage_error(capsys):
    assert run(["status", "--host", "gpu:notaport"]) == 2
    assert "--host must be [user@]host[:port]" in capsys.readouterr().err


def test_prepare_for_verify_without_page_size_is_unsupported():
    from dynspec_patch.patcher.engine import plan_apply

    snapshot = local.read_snapshot(release_dir(find_pin("0.4.6.post5")))
    utils = "srt/speculative/eagle_utils.py"
    older = snapshot[utils].replace(
        b"def prepare_for_verify(self, batch: ScheduleBatch, page_size: int)",
        b"def prepare_for_verify(self, batch: ScheduleBatch)",
    )
    assert older != snapshot[utils]
    plan = plan_apply(snapshot | {utils: older})
    assert plan.route == "unsupported" and "page_size" in plan.reason
    assert plan_apply(snapshot).route == "patch"
