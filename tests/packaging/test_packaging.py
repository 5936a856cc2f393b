"""What ``pip install dynspec-patch`` put on this machine: one import name, a license, bounds.

Read from the installed distribution's own records (RECORD, METADATA, entry_points.txt): the
suite runs the wheel tests/run.sh built from a clean copy of the checkout's files and installed
(tests/conftest.py refuses to run on anything else)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DIST = importlib.metadata.distribution("dynspec-patch")
REPO = Path(__file__).resolve().parents[2]


def installed_files() -> set[str]:
    return {f.as_posix() for f in DIST.files or ()
            if not f.as_posix().startswith("..") and "__pycache__" not in f.parts}


def test_one_top_level_import_name():
    top = {name.split("/")[0] for name in installed_files()}
    assert {n for n in top if not n.endswith(".dist-info")} == {"dynspec_patch"}  # never
    # "fixtures", "patcher" or "transforms"
    for module in ("patcher/cli.py", "patcher/remote_agent.py",
                   "transforms/runtime/dynspec_fallback.py", "fixtures/pins.toml"):
        assert f"dynspec_patch/{module}" in installed_files(), module


def test_license_is_an_spdx_expression_with_its_file():
    assert DIST.metadata["License-Expression"] == "Apache-2.0"
    (license_file,) = [f for f in DIST.files or () if f.as_posix().endswith("licenses/LICENSE")]
    assert "Apache License" in license_file.read_text()


def test_the_console_script_points_into_the_package():
    (script,) = DIST.entry_points.select(group="console_scripts")
    assert (script.name, script.value) == ("dynspec-patch", "dynspec_patch.patcher.cli:main")


def test_lower_bounds_are_the_ones_proven_to_work():
    bounds = dict(dep.split(">=") for dep in DIST.requires or () if "extra ==" not in dep)
    assert bounds["typer"] == "0.15.4"  # 0.15.3 + click 8.2 crashes on every --help
    run_sh = (REPO / "tests" / "run.sh").read_text()
    assert 'replace(">=", "==")' in run_sh and "test_cli_contract.py" in run_sh
