"""benchmarks/gpu/wave_fit.py: one-wave levels at two output lengths split into a fixed part
per wave and a per-token part, per server kind, and the patched kind against plain decoding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))

import wave_fit  # noqa: E402


def wave(c: int, olen: int, fixed: float, per_token: float, noise: float = 0.0) -> dict:
    return {"concurrency": c, "olen": olen, "wall_s": fixed + olen * per_token + noise}


def test_the_line_through_two_lengths_gives_fixed_and_per_token_time():
    points = [(128, 0.2 + 128 * 0.007 + 0.001), (128, 0.2 + 128 * 0.007 - 0.001),
              (512, 0.2 + 512 * 0.007)]
    fixed, per_token = wave_fit.fit(points)
    assert fixed == pytest.approx(0.2, abs=2e-3)
    assert per_token == pytest.approx(0.007, rel=1e-3)
    assert wave_fit.fit([(128, 1.0), (128, 1.1)]) is None  # one length: no line


def test_closed_loop_levels_are_not_waves():
    result = {"levels": [wave(64, 128, 0.2, 0.007),
                         {**wave(64, 512, 0.2, 0.007), "duration_s": 10.0},
                         {"concurrency": 64, "wall_s": 3.0}]}  # no olen: an older result
    assert wave_fit.waves(result) == {64: [(128, 0.2 + 128 * 0.007)]}


def test_kinds_pool_and_the_patched_kind_is_compared_with_plain(tmp_path):
    results = {
        "dyn-v2": {"levels": [wave(64, 128, 0.30, 0.0070), wave(64, 512, 0.30, 0.0070)]},
        "base": {"levels": [wave(64, 128, 0.20, 0.0068), wave(64, 512, 0.20, 0.0068)]},
        "dyn-v2@2": {"levels": [wave(64, 128, 0.30, 0.0070)]},
        "base@2": {"levels": [wave(64, 512, 0.20, 0.0068)]},
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    out = subprocess.run([sys.executable, str(GPU / "wave_fit.py"), str(path)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert "| 64 | dyn-v2 | 3 | 300.000 | 7.000 |" in out
    assert "| 64 | base | 3 | 200.000 | 6.800 |" in out
    assert "| 64 | 1.029 | +100.0 |" in out
