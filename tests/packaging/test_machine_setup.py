"""The README's test command does its own machine set-up (issue 13, item 6): as root it installs
the missing system packages with no service started; as another user it says in one line what
is missing and starts nothing.

dpkg-query and apt-get are stand-ins on PATH here (this machine's packages are installed and
shared): dpkg-query reports the packages named in $MISSING as not installed, apt-get records its
arguments and whether the policy-rc.d guard was in place while it ran.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
POLICY = Path("/usr/sbin/policy-rc.d")
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A scratch directory the user ``nobody`` can read too (pytest's own is root's only)."""
    path = Path(tempfile.mkdtemp(prefix="dynspec-setup-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def package_manager(tmp_path: Path) -> Path:
    """A bin directory with the two stand-ins; apt-get's record goes to ``tmp_path/apt.log``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dpkg-query").write_text(
        '#!/bin/sh\nfor p; do :; done\n'  # the last argument is the package
        'case " $MISSING " in *" $p "*) printf "un "; exit 1;; esac\nprintf "ii "\n')
    (bin_dir / "apt-get").write_text(
        f'#!/bin/sh\n{{ printf "%s|" "$*"; cat {POLICY} 2>/dev/null | tail -n 1; }}'
        f' >> {tmp_path}/apt.log\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    return bin_dir


def run(argv: list[str], bin_dir: Path, missing: str, venv: Path
        ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MISSING": missing,
           "DYNSPEC_VENV": str(venv), "HOME": str(venv.parent)}
    return subprocess.run(argv, capture_output=True, text=True, check=False, env=env,
                          timeout=120)


def apt_calls(tmp_path: Path) -> list[tuple[str, str]]:
    log = tmp_path / "apt.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [tuple(line.split("|")) for line in lines]


def test_as_root_the_missing_packages_are_installed_with_services_held_off(
        package_manager, tmp_path):
    policy_before = POLICY.exists()
    setup = run(["bash", str(REPO / "tests" / "setup_machine.sh")], package_manager,
                "docker.io pipx", tmp_path / "venv")
    assert setup.returncode == 0, setup.stderr
    update, install = apt_calls(tmp_path)
    assert update[0].startswith("update")
    assert install[0].split()[-2:] == ["docker.io", "pipx"] and "-y" in install[0].split()
    assert install[1] == "exit 101"  # policy-rc.d: no package starts its service
    assert POLICY.exists() == policy_before  # a guard it put in place is removed again


def test_as_root_with_every_package_present_nothing_is_installed(package_manager, tmp_path):
    setup = run(["bash", str(REPO / "tests" / "setup_machine.sh")], package_manager, "",
                tmp_path / "venv")
    assert setup.returncode == 0 and not setup.stdout and not setup.stderr
    assert apt_calls(tmp_path) == []


def test_the_readme_command_as_a_user_names_what_is_missing_in_one_line(
        package_manager, tmp_path):
    venv = tmp_path / "venv"
    suite = run([*NOBODY, "bash", str(REPO / "tests" / "run.sh")], package_manager,
                "openssh-server docker.io", venv)
    assert suite.returncode == 1
    assert suite.stderr.count("\n") == 1, suite.stderr
    assert suite.stderr.startswith("tests/run.sh: missing system packages: openssh-server "
                                   "docker.io ")
    assert apt_calls(tmp_path) == [] and not venv.exists()  # stopped before anything else
    everything = run([*NOBODY, "bash", str(REPO / "tests" / "run.sh")], package_manager, "",
                     venv)
    assert everything.returncode == 1 and everything.stderr.startswith("tests/run.sh: needs root")
    assert not venv.exists()
