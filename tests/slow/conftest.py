"""Fixtures of the slow tier: patched scratch trees and the driver run inside a release venv.

Each (release, worker) is driven once per session in its own interpreter (``harness/drive.py
all``) and the tests assert on the JSON it reports. A missing venv or wheel is an error, not a
skip: this tier only runs when asked for (``pytest -m slow``), and then it must really run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dynspec_patch.patcher.releases import fetch_wheel, find_pin

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class SlowRelease:
    version: str
    venv: str
    workers: tuple[str, ...]


# Which pinned releases are imported for real, in which venv (setup_envs.sh builds them).
# The triton split is not the 0.4/0.5 split test-environment.md §3 suggests: 0.4.10.post2
# imports with triton 3.9 but not 3.3.1 (triton.autotune at import starts the CUDA driver
# under fake CUDA); 0.4.6.post5 needs 3.3.1 (triton.runtime.cache.default_cache_dir is gone
# in 3.9).
SLOW_RELEASES: tuple[SlowRelease, ...] = (
    SlowRelease("0.4.6.post5", "triton331", ("v1",)),
    SlowRelease("0.4.10.post2", "triton39", ("v1",)),
    SlowRelease("0.5.5.post2", "triton39", ("v1", "v2")),
    SlowRelease("0.5.10.post1", "triton39", ("v1", "v2")),
    SlowRelease("0.5.12.post1", "triton39", ("v1", "v2")),
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``case`` (every worker), ``v1_case`` and ``v2_case`` over SLOW_RELEASES."""
    for name, variants in (("case", ("v1", "v2")), ("v1_case", ("v1",)), ("v2_case", ("v2",))):
        if name in metafunc.fixturenames:
            cases = [(r, w) for r in SLOW_RELEASES for w in r.workers if w in variants]
            metafunc.parametrize(name, cases, ids=[f"{r.version}-{w}" for r, w in cases])


def envs_root() -> Path:
    if env := os.environ.get("DYNSPEC_IMPORT_ENVS"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dynspec-patch" / "import-envs"


def venv_python(name: str) -> Path:
    python = envs_root() / name / "bin" / "python"
    if not (envs_root() / name / ".built").exists():
        pytest.fail(f"import venv {name} is missing: run `bash tests/slow/setup_envs.sh`")
    return python


def patch_tree(version: str, dest: Path) -> Path:
    """Unpack the whole pinned wheel (not only .py: sglang.jit_kernel needs its csrc) and
    patch it with the real CLI. Returns the directory to put on PYTHONPATH."""
    wheel = fetch_wheel(find_pin(version))
    root = dest / f"sglang-{version}"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root, members=[n for n in archive.namelist()
                                          if n.startswith("sglang/")])
    cmd = [sys.executable, "-m", "dynspec_patch.patcher.cli", "apply",
           "--sglang-root", str(root / "sglang"), "--worker", "both"]
    proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.fail(f"dynspec-patch apply failed on {version}:\n{proc.stdout}\n{proc.stderr}")
    return root


_RUNS: dict[tuple[str, str], dict[str, Any]] = {}


class Parts:
    """The driver's report; reading a part that raised inside the driver fails the test."""

    def __init__(self, report: dict[str, Any], where: str) -> None:
        self._report = report
        self._where = where

    def __getitem__(self, name: str) -> dict[str, Any]:
        part = self._report[name]
        if not part.get("ok"):
            pytest.fail(f"{self._where} {name}: {part['error']}\n{part['traceback']}")
        return part


@pytest.fixture(scope="session")
def drive(tmp_path_factory: pytest.TempPathFactory):
    """drive(release, variant)[part] -> that part of the driver's JSON report; a part that
    raised inside the driver fails the test that reads it, with the driver's traceback."""
    trees: dict[str, Path] = {}

    def run(release: SlowRelease, variant: str) -> dict[str, Any]:
        key = (release.version, variant)
        where = f"{release.version} {variant}"
        if key in _RUNS:
            return Parts(_RUNS[key], where)
        if release.version not in trees:
            trees[release.version] = patch_tree(release.version, tmp_path_factory.mktemp("tree"))
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "PYTHONPATH": os.pathsep.join(
                [str(HERE / "stubs"), str(HERE / "harness"), str(trees[release.version])]
            ),
            "PYTHONDONTWRITEBYTECODE": "1",
            "HF_HUB_OFFLINE": "1",  # nothing here needs the hub; never try it
            "TRANSFORMERS_OFFLINE": "1",
        }
        cmd = [str(venv_python(release.venv)), str(HERE / "harness" / "drive.py"), "all",
               variant]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                              timeout=600)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            pytest.fail(f"driver crashed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        report = json.loads(lines[-1])
        if not report.get("ok"):
            pytest.fail(f"{release.version} {variant}: {report['error']}\n{report['traceback']}")
        _RUNS[key] = report
        return Parts(report, where)

    return run


@pytest.fixture(scope="session")
def toy() -> Any:
    """harness/toy_model.py (torch-free), to compute the expected tokens independently."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("slow_toy_model", HERE / "harness" /
                                                  "toy_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
