"""Shared set-up of the runtime tests.

Behaviour tests need torch (CPU build, ``torch==2.13.0``). On a developer machine without it
they are skipped with a reason; under CI (``CI`` set) a missing torch is an error, so the suite
can never pass by silently skipping them.
"""

import importlib.util
import os

import pytest

TORCH_MISSING = importlib.util.find_spec("torch") is None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "torch: needs torch==2.13.0 (CPU); CI installs it")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not TORCH_MISSING:
        return
    if os.environ.get("CI"):
        raise pytest.UsageError(
            "torch is not installed but CI must run the torch tests (pip install torch==2.13.0)"
        )
    skip = pytest.mark.skip(reason="torch not installed (CI installs torch==2.13.0)")
    for item in items:
        if "torch" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_adapters():
    """Every test resolves its adapter anew (production resolves once per process)."""
    from dynspec_patch.transforms.runtime import dynspec_fallback

    dynspec_fallback.reset_for_tests()
    yield
    dynspec_fallback.reset_for_tests()


@pytest.fixture(autouse=True)
def _opt_in_levers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The width-1 draft-extend and the start-up warm-up run by default only on SGLang's
    <= 0.5.13 layout, the one-argmax sampling only where it has run on a GPU (``lever_on``);
    every stand-in test runs with all three on, so the levers run beside the rest on every
    layout. A test that wants them off sets the variable to "0"; the
    tests of the default (test_warmup.py) unset them."""
    from dynspec_patch.transforms.runtime import dynspec_fallback

    monkeypatch.setenv(dynspec_fallback.DRAFT_EXTEND_WIDTH1_ENV, "1")
    monkeypatch.setenv(dynspec_fallback.WARMUP_ENV, "1")
    monkeypatch.setenv(dynspec_fallback.GREEDY_ARGMAX_ENV, "1")


@pytest.fixture
def resume_after_one_small_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculation resumes at the first small decode batch (with ``min_dwell_steps`` 1), so a
    stand-in test reaches the resume path in a step; test_controller.py tests the default (32
    small batches in a row)."""
    from dynspec_patch.transforms.runtime import dynspec_fallback

    monkeypatch.setattr(dynspec_fallback, "RESUME_SMALL_STEPS", 1)
