"""Version-stamped markers and the three states a target file can be in.

Every statement a codemod inserts ends with the comment ``# dynspec-patch <version>``, so the
state of a file is provable from its bytes: ``Unpatched`` (no trace of us), ``Patched``
(exactly what that tool version writes), or ``Unknown`` (anything else — refused, never guessed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TOOL_VERSION = "0.1.0"
MARKER_TEXT = "dynspec-patch"
MARKER_RE = re.compile(r"#\s*dynspec-patch\s+(?P<version>\d[\w.+-]*)\s*$")


def marker_comment(version: str = TOOL_VERSION) -> str:
    return f"# {MARKER_TEXT} {version}"


@dataclass(frozen=True)
class Unpatched:
    label = "unpatched"

    def describe(self) -> str:
        return "unpatched"


@dataclass(frozen=True)
class Patched:
    version: str
    label = "patched"

    def describe(self) -> str:
        return f"patched by dynspec-patch {self.version}"


@dataclass(frozen=True)
class Unknown:
    reason: str
    label = "unknown"

    def describe(self) -> str:
        return f"unknown: {self.reason}"


FileState = Unpatched | Patched | Unknown
