"""Install ``transforms/runtime/dynspec_fallback.py`` as ``srt/speculative/dynspec_fallback.py``."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from dynspec_patch.transforms.markers import (
    MARKER_TEXT,
    TOOL_VERSION,
    FileState,
    Patched,
    Unknown,
    Unpatched,
)

_HEADER_RE = re.compile(
    rf"# {MARKER_TEXT} (?P<version>\d[\w.+-]*) sha256=(?P<sha>[0-9a-f]{{64}})"
    r" \(installed file; edits are detected\)\n"
)


def runtime_source() -> str:
    return (resources.files("dynspec_patch.transforms.runtime") / "dynspec_fallback.py").read_text()


def _render(body: str, version: str) -> str:
    digest = hashlib.sha256(body.encode()).hexdigest()
    return f"# {MARKER_TEXT} {version} sha256={digest} (installed file; edits are detected)\n{body}"


@dataclass
class RuntimeAnalysis:
    source: str | None
    state: FileState
    refusal: str | None = None


class InstallRuntimeModuleCommand:
    """Add the runtime module, prefixed by a marker line carrying the sha256 of its body.

    The marker makes hand edits of the installed file visible (state ``unknown``), and a file
    of that name that dynspec-patch did not write is refused, never overwritten.
    """

    NAME = "runtime"
    DESCRIPTION = "the dynspec_fallback runtime module"
    PATH = "srt/speculative/dynspec_fallback.py"

    def __init__(self, body: str | None = None) -> None:
        self.body = runtime_source() if body is None else body

    def analyse(self, source: str | None) -> RuntimeAnalysis:
        if source is None:
            return RuntimeAnalysis(source, Unpatched())
        match = _HEADER_RE.match(source)
        if match is None:
            reason = "a dynspec_fallback.py that dynspec-patch did not write"
            return RuntimeAnalysis(source, Unknown(reason), reason)
        body = source[match.end() :]
        if hashlib.sha256(body.encode()).hexdigest() != match["sha"]:
            reason = "the installed runtime module was edited after installation"
            return RuntimeAnalysis(source, Unknown(reason), reason)
        return RuntimeAnalysis(source, Patched(match["version"]))

    def apply(self, analysis: RuntimeAnalysis, version: str = TOOL_VERSION) -> str:
        if analysis.refusal is not None:
            raise ValueError(f"{self.PATH}: refused: {analysis.refusal}")
        return _render(self.body, version)

    def revert(self, analysis: RuntimeAnalysis) -> str | None:
        """None: the file is removed."""
        if analysis.refusal is not None:
            raise ValueError(f"{self.PATH}: refused: {analysis.refusal}")
        return None
