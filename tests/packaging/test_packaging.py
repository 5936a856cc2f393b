"""What ``pip install dynspec-patch`` puts on a machine: one import name, a license, bounds."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built from this checkout, offline (no build isolation; setuptools: test dep)."""
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout.split()
    for name in listed:  # a clean copy: a stale build/ in the checkout must not leak in
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(source)],
        check=True, capture_output=True,
    )
    (built,) = out.glob("dynspec_patch-*.whl")
    return zipfile.ZipFile(built)


def test_one_top_level_import_name(wheel):
    top = {name.split("/")[0] for name in wheel.namelist() if not name.endswith("/")}
    packages = {name for name in top if not name.endswith(".dist-info")}
    assert packages == {"dynspec_patch"}  # never "fixtures", "patcher" or "transforms"
    names = set(wheel.namelist())
    for module in ("patcher/cli.py", "patcher/remote_agent.py", "transforms/runtime/"
                   "dynspec_fallback.py", "fixtures/pins.toml"):
        assert f"dynspec_patch/{module}" in names, module


def test_license_is_an_spdx_expression_with_its_file(wheel):
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    text = wheel.read(metadata).decode()
    assert "License-Expression: Apache-2.0" in text
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel.namelist())
    assert "Apache License" in (REPO / "LICENSE").read_text()


def test_the_console_script_points_into_the_package(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    assert "dynspec-patch = dynspec_patch.patcher.cli:main" in wheel.read(entry_points).decode()


def test_lower_bounds_are_the_ones_proven_to_work():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    bounds = dict(dep.split(">=") for dep in project["dependencies"])
    assert bounds["typer"] == "0.15.4"  # 0.15.3 + click 8.2 crashes on every --help
    run_sh = (REPO / "tests" / "run.sh").read_text()
    assert 'replace(">=", "==")' in run_sh and "test_cli_contract.py" in run_sh
