"""Shared test set-up: tests never download (CI fetches the pins first, see .ci/run)."""

from __future__ import annotations

import os

os.environ.setdefault("DYNSPEC_OFFLINE", "1")
