"""Shared test set-up: tests never download (tests/run.sh fetches the pins first), and every
session runs what users install (issue 13).

A session stops at once (exit 4, the reasons on one line) unless ``dynspec_patch`` is the
installed, non-editable wheel in the site-packages of the Python that runs pytest, the working
directory is outside the checkout, and neither ``sys.path`` nor ``PYTHONPATH`` holds a checkout
directory product code could be imported from. Run from the checkout, ``patcher/`` resolves as a
top-level namespace package: that hid an ``apply --host`` that failed for every installed user.
``tests/run.sh`` and ``tests/pytest.sh`` run pytest the accepted way. Checked when pytest starts
and again once every conftest and test module is imported (they may extend sys.path).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
import sysconfig
from pathlib import Path

import pytest

os.environ.setdefault("DYNSPEC_OFFLINE", "1")

CHECKOUT = Path(__file__).resolve().parents[1]
# Checkout directories allowed on sys.path: test helpers (tests/remote's harness modules) and
# the GPU recipe's scripts, which the wheel does not ship and which are tested from here.
HELPER_DIRS = (CHECKOUT / "tests", CHECKOUT / "benchmarks")
# The product's directories in the checkout, installed as dynspec_patch.<name>: as top-level
# names they exist only where the checkout leaks onto the path.
SOURCE_DIRS = ("patcher", "transforms", "fixtures")


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _checkout_source(path: Path) -> bool:
    """A directory of the checkout other than the virtualenv running pytest (./.venv may be in
    the checkout: its site-packages is where the wheel is installed)."""
    return _inside(path, CHECKOUT) and not _inside(path, Path(sys.prefix).resolve())


def not_the_installed_wheel() -> list[str]:
    """Why this process would not test the installed wheel (empty when it does)."""
    problems = []
    cwd = Path.cwd().resolve()
    if _inside(cwd, CHECKOUT):
        problems.append(f"the working directory {cwd} is inside the checkout")
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and _checkout_source(Path(entry).resolve()):
            problems.append(f"PYTHONPATH holds {entry}")
    for entry in sys.path:
        path = Path(entry or os.getcwd()).resolve()
        if _checkout_source(path) and not any(_inside(path, d) for d in HELPER_DIRS):
            problems.append(f"sys.path holds {entry or os.getcwd()}")
    for name in SOURCE_DIRS:
        spec = importlib.util.find_spec(name)
        places = [spec.origin or "", *(spec.submodule_search_locations or [])] if spec else []
        if any(p and _checkout_source(Path(p).resolve()) for p in places):
            problems.append(f"'import {name}' finds the checkout's {name}/")
    try:
        dist = importlib.metadata.distribution("dynspec-patch")
    except importlib.metadata.PackageNotFoundError:
        return [*problems, f"dynspec-patch is not installed in {sys.prefix}"]
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct_url.get("dir_info", {}).get("editable"):
        problems.append("dynspec-patch is installed editable (pip install -e)")
    # every package of the wheel, imported to be located below
    import dynspec_patch.fixtures
    import dynspec_patch.patcher
    import dynspec_patch.transforms.runtime

    site = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    places = [("the dynspec-patch distribution", Path(str(dist.locate_file(""))))]
    places += [(name, Path(module.__file__)) for name, module in sys.modules.items()
              if name.startswith("dynspec_patch.") and getattr(module, "__file__", None)]
    places += [("dynspec_patch", Path(p)) for p in dynspec_patch.__path__]
    elsewhere = [(name, place) for name, place in places
                 if not any(_inside(place.resolve(), s) for s in site)]
    if elsewhere:
        name, place = elsewhere[0]
        problems.append(f"{len(elsewhere)} parts of dynspec-patch are not the ones in "
                        f"site-packages ({name} from {place})")
    return problems


# tools/mutation.py runs the tests on purpose against a mutated copy of the source: its stage
# (this file's copy there) names itself here, and only that copy is exempt
MUTATION_STAGE_ENV = "DYNSPEC_MUTATION_STAGE"


def _stop_unless_installed(when: str) -> None:
    if os.environ.get(MUTATION_STAGE_ENV) == str(CHECKOUT):
        return
    problems = not_the_installed_wheel()
    if problems:
        pytest.exit(f"tests must run the installed wheel from outside the checkout ({when}; "
                    f"bash tests/pytest.sh ARGS runs them so): {'; '.join(problems)}",
                    returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_configure(config: pytest.Config) -> None:
    _stop_unless_installed("at start")


def pytest_collection_finish(session: pytest.Session) -> None:
    _stop_unless_installed("after collection")
