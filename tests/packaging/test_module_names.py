"""module_names.py, the CI step that resolves every module name the package spells as a string
(issue 13: ``resources.files("patcher")`` outlived the rename and broke every installed
``apply --host``), finds such names however they are spelled, and only those."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("module_names.py")


def scan(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The check as tests/run.sh runs it: isolated, from outside the checkout."""
    return subprocess.run([sys.executable, "-I", str(SCRIPT), *argv], cwd=cwd,
                          capture_output=True, text=True, check=False, timeout=120)


def test_names_from_before_the_rename_fail_the_check_wherever_they_are_spelled(tmp_path):
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "old_names.py").write_text(
        "import importlib\n"
        "import subprocess\n"
        "import sys\n"
        "from importlib import resources\n"
        "from importlib.resources import files as package_files\n"
        "\n"
        "RUNTIME = 'transforms.runtime'\n"
        "\n"
        "\n"
        "def digest():\n"  # the shape of the original bug: names in a loop over literals
        "    for package, pattern in (('patcher', 'engine.py'), ('fixtures', '*.toml')):\n"
        "        resources.files(package).glob(pattern)\n"
        "    package_files(RUNTIME)\n"
        "    importlib.import_module('patcher.cli')\n"
        "    __import__('transforms')\n"
        "    subprocess.run([sys.executable, '-m', 'patcher.remote_agent'])\n"
        "    return 'ssh host python3 -m patcher.cli status'\n"
    )
    run = scan(str(sources), cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    failed = sorted(line.split(": ", 1)[1] for line in run.stdout.splitlines()
                    if "DOES NOT RESOLVE" in line)
    assert [" ".join(line.split()[:2]) for line in failed] == [
        "module patcher.cli",  # import_module
        "module patcher.cli",  # "python3 -m" in a command string
        "module patcher.remote_agent",  # argv list
        "module transforms",  # __import__
        "package fixtures",
        "package patcher",
        "package transforms.runtime",  # a module-level constant, through an import alias
    ]
    assert run.stdout.splitlines()[-1] == "7 module names checked, 7 do not resolve"


def test_names_that_resolve_pass_and_a_docker_m_or_the_hosts_sglang_are_not_checked(tmp_path):
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "good.py").write_text(
        "import sys\n"
        "from importlib import resources\n"
        "\n"
        "resources.files('dynspec_patch.transforms.runtime')\n"
        "ARGV = [sys.executable, '-m', 'dynspec_patch.patcher.cli']\n"
        "COMMIT = ['docker', 'commit', '-m', 'not a module', 'c', 't']\n"
        "LAUNCH = 'python3 -m sglang.launch_server --port 1'\n"
    )
    run = scan(str(sources), cwd=tmp_path)
    assert run.returncode == 0, run.stdout
    assert "on the GPU host" in run.stdout and "not a module" not in run.stdout
    assert run.stdout.splitlines()[-1] == "3 module names checked, 0 do not resolve"


def test_the_installed_package_passes_and_its_call_sites_are_found(tmp_path):
    run = scan(cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    for found in ("dynspec_patch/patcher/ssh.py", "dynspec_patch/transforms/runtime_install.py",
                  "entry point dynspec-patch: dynspec_patch.patcher.cli:main -> loaded"):
        assert found in run.stdout, found
