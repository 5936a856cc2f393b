"""benchmarks/gpu/side_by_side.py: ABAB servers pool into one mean per kind; ratios on every
figure; the pairs in run order; clocks per level."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"


def level(c: int, wall: float, loaded: float, sm: float | None = None,
          server: float | None = None, full: float | None = None) -> dict:
    gpu = {"sm_mhz_mean": sm, "sm_mhz_min": sm - 100} if sm else None
    return {"concurrency": c, "output_tok_per_s": wall, "loaded_tok_per_s": loaded, "gpu": gpu,
            "server_tok_per_s": server, "full_load_tok_per_s": full}


def run(tmp_path: Path, results: dict, *args: str) -> str:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    return subprocess.run([sys.executable, str(GPU / "side_by_side.py"), str(path), *args],
                          check=True, capture_output=True, text=True, timeout=60).stdout


def test_further_servers_pool_and_every_ratio_is_on_both_figures(tmp_path):
    results = {
        "dyn-v2": {"levels": [level(64, 90, 95, 1950, 99), level(64, 80, 85, server=97)]},
        "base": {"levels": [level(64, 100, 100, 1980, 110)]},
        "dyn-v2@2": {"levels": [level(64, 70, 80, server=92)]},  # pooled: 80, 86.667, 96
        "base@2": {"levels": [level(64, 100, 100, server=130)]},
        "eagle-v2": {"levels": [level(64, 20, 40)]},  # an older result: no server figure
    }
    out = run(tmp_path, results, "--against", "eagle-v2")
    row = "| 64 | 80.0 | 86.7 | – | 96.0 | 100.0 | 100.0 | – | 120.0 | 20.0 | 40.0 | – | – |"
    assert row in out
    assert "| 64 | 0.800 | 0.867 | – | 0.800 | 4.000 | 2.167 | – | – |" in out
    # pairs in run order, by the loaded figure: (95 + 85) / 2 / 100 and 80 / 100
    assert "| dyn-v2 ÷ base | c = 64: 0.900 (loaded) |" in out
    assert "| dyn-v2@2 ÷ base@2 | c = 64: 0.800 (loaded) |" in out
    assert "| dyn-v2 | c64: 1950 (≥ 1850) |" in out
    assert "dyn-v2@2 |" not in out.split("SM MHz")[1]  # it recorded no clocks


def test_a_kind_that_did_not_run_is_left_out(tmp_path):
    results = {"dyn-v2": {"levels": [level(1, 10, 10)]}, "base": {"levels": [level(1, 20, 20)]}}
    out = run(tmp_path, results, "--against", "native-v2")
    assert "native-v2" not in out
    assert "| 1 | 0.500 | 0.500 | – | – |" in out


def test_pairs_go_by_the_full_load_figure_where_both_servers_recorded_it(tmp_path):
    """A plain level whose partial last wave lifted its loaded figure (105) but not its full-load
    one (96): the pair reads the full-load ratio, per concurrency."""
    results = {
        "dyn-v2": {"levels": [level(64, 95, 96, full=95), level(128, 90, 90)]},
        "base": {"levels": [level(64, 98, 105, full=96), level(128, 100, 100, full=100)]},
    }
    out = run(tmp_path, results)
    assert "| 64 | 95.0 | 96.0 | 95.0 | – | 98.0 | 105.0 | 96.0 | – |" in out
    assert "| 64 | 0.969 | 0.914 | 0.990 | – |" in out
    assert "| dyn-v2 ÷ base | c = 64: 0.990 (full load), c = 128: 0.900 (loaded) |" in out


def test_the_host_table_shows_where_each_servers_scheduler_ran(tmp_path):
    """client.py's "host" per level: the scheduler's CPU, its wait, its cores, the client's."""
    sched = {"pid": 7, "cpu_pct": 99.1, "runqueue_wait_pct": 3.25,
             "involuntary_switches_per_s": 41.0, "cpus": [3], "numa_nodes": [0],
             "smt_sibling_busy_pct": 87.5, "core_shared_pct": 60.0}
    client = {"pid": 9, "cpu_pct": 55.0, "cpus": [11, 3], "runqueue_wait_pct": 0.0,
              "involuntary_switches_per_s": 2.0, "numa_nodes": [0],
              "smt_sibling_busy_pct": None, "core_shared_pct": 60.0}
    host = {"host": {"busy_pct": 21.5, "load_1min": 3.2, "cpus": 16, "cores": 8,
                     "numa_nodes": 1, "gpu_numa_nodes": [0], "cpu_mhz": None},
            "processes": {"scheduler": sched, "client": client}}
    first = level(64, 90, 95)
    first["host"] = host
    results = {"dyn-v1": {"levels": [first]}, "base-v1": {"levels": [level(64, 100, 100)]}}
    out = run(tmp_path, results, "--patched", "dyn-v1", "--plain", "base-v1")
    assert "| dyn-v1 | 64 | 99 | 3.25 | 41 | 3 | 88 | 60 | 55 | 11,3 | 22 | 3.2 |" in out
    assert "| base-v1 | 64 |" not in out  # it recorded no host


def test_levels_that_compiled_kernels_are_listed(tmp_path):
    compiled = level(128, 90, 95)
    compiled["repeat"] = 0
    compiled["jit_compiled"] = {"triton": {"new_files": 3, "kernels": ["a_kernel", "b_kernel"]},
                                "tvm_ffi": {"new_files": 0, "kernels": []}}
    quiet = level(128, 95, 96)
    quiet["repeat"] = 1
    quiet["jit_compiled"] = {"triton": {"new_files": 0, "kernels": []}}
    results = {"dyn-v1": {"levels": [compiled, quiet]}, "base-v1": {"levels": [level(128, 99, 99)]}}
    out = run(tmp_path, results, "--patched", "dyn-v1", "--plain", "base-v1")
    assert "| dyn-v1 | 128 | 0 | triton | 3 | a_kernel, b_kernel |" in out
    assert "| dyn-v1 | 128 | 1 |" not in out and "tvm_ffi" not in out
