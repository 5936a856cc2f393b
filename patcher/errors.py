"""Every error dynspec-patch raises, and the exit code each maps to.

    DynspecError                 exit 1  anything unexpected that we still explain in one line
    ├── UsageError               exit 2  the command line or an input path is wrong
    ├── RefusedError             exit 3  unsupported release or unknown file state; nothing written
    ├── ReleaseFetchError        exit 1  a pinned wheel could not be downloaded or failed its sha256
    └── RollbackError            exit 4  files were changed, something failed, originals restored

Foreign exceptions (OSError, paramiko, libcst) are mapped into this tree where they cross
into the patcher, with ``raise ... from``.
"""

from __future__ import annotations


class DynspecError(Exception):
    exit_code = 1

    def __init__(self, message: str = "", *, reported: bool = False) -> None:
        super().__init__(message)
        self.reported = reported  # the --json object already carries this error


class UsageError(DynspecError):
    exit_code = 2


class RefusedError(DynspecError):
    exit_code = 3


class ReleaseFetchError(DynspecError):
    exit_code = 1


class RollbackError(DynspecError):
    exit_code = 4
