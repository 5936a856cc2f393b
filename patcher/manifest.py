"""The record of one apply, kept beside the sglang package in ``.dynspec-patch/manifest.json``.

It holds, per file, the sha256 before and after; revert refuses when the current bytes are
not the recorded ``after`` (someone edited the file since), and checks that what it restores
hashes to the recorded ``before``.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

from dynspec_patch.transforms.markers import TOOL_VERSION

STATE_DIR_NAME = ".dynspec-patch"
MANIFEST_NAME = "manifest.json"


def sha256_or_none(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FileRecord:
    path: str
    sha256_before: str | None  # None: the file did not exist
    sha256_after: str | None  # None: the file was removed


@dataclass(frozen=True)
class Manifest:
    sglang_version: str | None
    files: tuple[FileRecord, ...]
    tool_version: str = TOOL_VERSION
    created: float = field(default_factory=time.time)
    user: str = field(default_factory=getpass.getuser)

    def by_path(self) -> dict[str, FileRecord]:
        return {record.path: record for record in self.files}

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        files = tuple(FileRecord(**record) for record in raw.pop("files"))
        return cls(files=files, **raw)
