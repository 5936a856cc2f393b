"""pytest plugin of ``tools/mutation.py``: in mutmut's stats pass, the mutated functions that a
test's own processes ran (written by ``sitecustomize.py``) count as run by that test."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_HITS = Path(tempfile.gettempdir()) / f"dynspec-mutation-hits-{os.getpid()}"


def _stats_pass() -> bool:
    return os.environ.get("MUTANT_UNDER_TEST") == "stats"


def pytest_configure(config: pytest.Config) -> None:
    os.environ["DYNSPEC_MUTATION_HITS"] = str(_HITS)


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _HITS.unlink(missing_ok=True)


@pytest.hookimpl(tryfirst=True)  # before mutmut's collector reads the hits of this test
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if not _stats_pass() or not _HITS.exists():
        return
    from mutmut.state import state

    state()._stats.update(_HITS.read_text().split())
    _HITS.unlink()
