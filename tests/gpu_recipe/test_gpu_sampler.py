"""gpu_sampler.py against a stand-in nvidia-smi: what a level records of the GPU it ran on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "kit"
sys.path.insert(0, str(KIT / "scripts"))

from gpu_sampler import GpuSampler, parse_line  # noqa: E402

# A stand-in nvidia-smi: one line per call, or one per --loop-ms until killed. The SM clock
# falls 10 MHz a line from 1980; the reasons are GPU idle + SW power cap (0x5). With
# OLD_NAMES_ONLY it refuses the newer reasons field, as drivers before 535 do.
FAKE = r'''#!/usr/bin/env python3
import os, sys, time
query = next(a for a in sys.argv if a.startswith("--query-gpu="))
if os.environ.get("OLD_NAMES_ONLY") and "clocks_event_reasons" in query:
    print('Field "clocks_event_reasons.active" is not a valid field to query.', file=sys.stderr)
    sys.exit(2)
with open(os.environ["FAKE_SMI_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\n")
loop = [a for a in sys.argv if a.startswith("--loop-ms=")]
n = 0
while True:
    print("[N/A], 2619, 40, 300.0, 0x1" if n == 1 else
          f"{1980 - 10 * n}, 2619, {40 + n}, {600.0 + n}, 0x0000000000000005", flush=True)
    n += 1
    if not loop:
        break
    time.sleep(int(loop[0].split("=")[1]) / 1000)
'''


@pytest.fixture
def fake_smi(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "bin" / "nvidia-smi"
    path.parent.mkdir()
    path.write_text(FAKE)
    path.chmod(0o755)
    monkeypatch.setenv("FAKE_SMI_LOG", str(tmp_path / "calls.log"))
    return path


def test_a_line_is_four_numbers_and_a_hex_mask_or_nothing():
    assert parse_line("1980, 2619, 41, 612.34, 0x0000000000000004\n") == (
        1980.0, 2619.0, 41.0, 612.34, 4)
    assert parse_line("[N/A], 2619, 40, 300.0, 0x1") is None
    assert parse_line("1980, 2619, 41, 612.34") is None
    assert parse_line("") is None


def test_the_samples_of_an_open_sampler_are_condensed(fake_smi, tmp_path):
    with GpuSampler(interval_ms=20, command=str(fake_smi)) as gpu:
        time.sleep(1.0)
    summary = gpu.summary()
    assert summary is not None and summary["samples"] >= 3  # the first sample, then the loop
    # the loop's own lines run 1980, [N/A] (skipped), 1960, 1950, ... after the first sample
    assert summary["sm_mhz_min"] < summary["sm_mhz_mean"] < 1980
    assert summary["mem_mhz_mean"] == 2619.0
    assert summary["temperature_c_max"] > 40
    assert summary["throttle_reasons"] == ["sw_power_cap"]  # idle (0x1) is not reported
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 2 and "--loop-ms=20" in calls[1] and "--id=0" in calls[1]
    assert "clocks_event_reasons.active" in calls[1]
    assert gpu._proc is not None and gpu._proc.poll() is not None  # closing ended the loop
    time.sleep(0.1)
    assert gpu.summary()["samples"] == summary["samples"]


def test_an_older_nvidia_smi_gets_the_older_field_name(fake_smi, tmp_path, monkeypatch):
    monkeypatch.setenv("OLD_NAMES_ONLY", "1")
    with GpuSampler(interval_ms=20, command=str(fake_smi)) as gpu:
        time.sleep(0.1)
    assert gpu.summary() is not None
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert all("clocks_throttle_reasons.active" in call for call in calls)


def test_no_nvidia_smi_records_nothing(tmp_path):
    with GpuSampler(command=str(tmp_path / "absent")) as gpu:
        pass
    assert gpu.summary() is None


def test_every_envelope_level_records_its_gpu(fake_smi, tmp_path):
    """envelope.py against a server that is not there: every level fails, and still carries
    the GPU's record of its span (None on a machine without nvidia-smi)."""
    out = tmp_path / "env.json"
    cmd = [sys.executable, str(KIT / "scripts" / "envelope.py"), "http://127.0.0.1:9", str(out),
           "env-x", "--levels", "1,2", "--regions", "accept0", "--duration", "0.2",
           "--repeats", "1", "--keep-cache"]
    env = {**os.environ, "PATH": f"{fake_smi.parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=120)
    levels = json.loads(out.read_text())["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    assert all(lv["gpu"]["throttle_reasons"] == ["sw_power_cap"] for lv in levels)
    assert all("client" in lv["host"]["processes"] for lv in levels)  # host_sampler.py
    bare = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    subprocess.run(cmd, check=True, capture_output=True, env=bare, timeout=120)
    assert all(lv["gpu"] is None for lv in json.loads(out.read_text())["levels"])
