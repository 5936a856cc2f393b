"""Decide what to do with an SGLang tree: route the release, run the codemods, build a plan.

Pure: it takes a *snapshot* (the bytes of ``SNAPSHOT_PATHS``, relative to the ``sglang``
package directory, ``None`` for a missing file) and returns a ``Plan``. Reading and writing
files, locally or over SSH, is the callers' business. Each file is parsed at most once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from dynspec_patch.patcher.errors import UsageError
from dynspec_patch.patcher.manifest import FileRecord, Manifest, sha256_or_none
from dynspec_patch.transforms import (
    CODEMODS,
    AddDisableThresholdArgCommand,
    AddDisableThresholdSpecFieldsCommand,
    HookEagleWorkerCommand,
    HookEagleWorkerV2Command,
    InstallRuntimeModuleCommand,
)
from dynspec_patch.transforms.markers import TOOL_VERSION, Patched, Unknown, Unpatched
from dynspec_patch.transforms.native_adaptive import (
    CONFIG_FILE_NAME,
    NativeConfig,
    adaptive_unsupported_reason,
    native_config,
)

VERSION_PATHS = ("version.py", "_version.py")
KERNEL_PATHS = ("srt/speculative/eagle_info.py", "srt/speculative/eagle_utils.py")
WORKER_CODEMODS = {"v1": HookEagleWorkerCommand, "v2": HookEagleWorkerV2Command}
SNAPSHOT_PATHS: tuple[str, ...] = (
    *VERSION_PATHS,
    *KERNEL_PATHS,
    InstallRuntimeModuleCommand.PATH,
    AddDisableThresholdArgCommand.PATH,
    AddDisableThresholdSpecFieldsCommand.PATH,
    HookEagleWorkerCommand.PATH,
    HookEagleWorkerV2Command.PATH,
)
WORKER_CHOICES = ("auto", "v1", "v2", "both")
ROUTES = ("patch", "native")
# The route of releases that offer both (SGLang 0.5.14+, which have SGLang's own steps-0
# adaptive speculation) when --route is not given. The one place to change it.
DEFAULT_ROUTE = "patch"
ADAPTIVE_FLAG = "--speculative-adaptive"
DEFAULT_NUM_STEPS = 3
MAX_THRESHOLD = 65536  # far above any decode batch SGLang runs; larger is a typo
# --threshold auto: the patched server's own controller picks plain or speculative steps by
# expected goodput at each batch size (patch route only)
AUTO_THRESHOLD = "auto"
Threshold = int | Literal["auto"]
MAX_NUM_STEPS = 64
THRESHOLD_FLAG = "--speculative-disable-batch-threshold"
NATIVE_AUTO_REFUSAL = (
    "--threshold auto needs the patch route: SGLang's --speculative-adaptive switches on "
    "acceptance alone, not on goodput per batch size (use --route patch, or --threshold N "
    "with --route native); nothing was written"
)

Snapshot = Mapping[str, bytes | None]

_INTEGER = re.compile(r"[+-]?[0-9]+")
_PREPARE_WITH_PAGE_SIZE = re.compile(r"def prepare_for_verify\(self, batch[^)]*page_size")
_VERSION_RE = re.compile(
    r"""^__version__\s*=\s*(?:version\s*=\s*)?(?:\w+\s*=\s*)?["']([^"']+)["']""", re.M
)


@dataclass(frozen=True)
class FileChange:
    path: str
    before: bytes | None
    after: bytes | None
    state_before: str
    state_after: str
    action: str  # patched|reverted|restored|unchanged|added|removed|refused|skipped
    reason: str = ""
    # apply over an older tool version's patch: the file as it was before any dynspec-patch
    # (None: it did not exist), so the manifest and the saved original stay the true ones
    original: bytes | None = None

    @property
    def first_bytes(self) -> bytes | None:
        """What this file held before dynspec-patch ever touched it."""
        return self.original if self.state_before == "patched" else self.before

    @classmethod
    def kept(
        cls, path: str, data: bytes | None, state: str, action: str, reason: str
    ) -> FileChange:
        """A file whose bytes stay as they are (unchanged, skipped or refused)."""
        return cls(path, data, data, state, state, action, reason)

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "state_before": self.state_before,
            "state_after": self.state_after,
            "action": self.action,
            "reason": self.reason,
            "sha256_before": sha256_or_none(self.before),
            "sha256_after": sha256_or_none(self.after),
        }


@dataclass(frozen=True)
class Plan:
    operation: str  # apply|revert|status
    sglang_version: str | None
    route: str  # patch|native|unsupported
    reason: str
    files: tuple[FileChange, ...] = ()
    native: NativeConfig | None = None
    server_flags: tuple[str, ...] = field(default=())
    patchable_workers: tuple[str, ...] = ()  # present, and accepted by their codemod
    refusal: str | None = None  # refused as a whole (e.g. a server the native route can't serve)
    routes: tuple[str, ...] = ()  # the routes this release offers (--route)

    @property
    def refused(self) -> bool:
        return (
            self.refusal is not None
            or self.route == "unsupported"
            or any(f.action == "refused" for f in self.files)
        )

    @property
    def refusal_reason(self) -> str:
        if self.refusal is not None:
            return self.refusal
        for change in self.files:
            if change.action == "refused":
                return f"{change.path}: {change.reason}"
        return self.reason

    @property
    def changes(self) -> tuple[FileChange, ...]:
        return tuple(f for f in self.files if f.changed)

    def to_json(self) -> dict[str, object]:
        return {
            "operation": self.operation,
            "sglang_version": self.sglang_version,
            "route": self.route,
            "routes": list(self.routes),
            "reason": self.reason,
            "refused": self.refused,
            "files": [f.to_json() for f in self.files],
            "server_flags": list(self.server_flags),
            "native": self.native.to_json() if self.native else None,
        }


def release_version(snapshot: Snapshot) -> str | None:
    """The version label (``version.py`` ≤0.5.6.post2, ``_version.py`` from 0.5.7)."""
    for path in reversed(VERSION_PATHS):
        data = snapshot.get(path)
        if data and (match := _VERSION_RE.search(data.decode("utf-8", "replace"))):
            return match[1]
    return None


def _text(snapshot: Snapshot, path: str) -> str | None:
    data = snapshot.get(path)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "\0"  # never valid Python: the codemod reports it as a syntax error


def routes_offered(v2_facts: Mapping[str, object]) -> tuple[str, ...]:
    """Both routes where SGLang has its own steps-0 path (0.5.14+), else the patch only."""
    return ROUTES if v2_facts.get("native_steps_zero") else ("patch",)


def validate_route(route: str | None) -> None:
    if route is not None and route not in ROUTES:
        raise UsageError(f"--route must be one of {', '.join(ROUTES)}, got {route!r}")


def _route(
    snapshot: Snapshot, v2_facts: Mapping[str, object], requested: str | None = None
) -> tuple[str, str]:
    """Which route this tree takes, decided from its structure and ``--route``."""
    if snapshot.get(AddDisableThresholdArgCommand.PATH) is None:
        return "unsupported", "no srt/server_args.py: not an SGLang package directory"
    if v2_facts.get("native_steps_zero"):
        if (requested or DEFAULT_ROUTE) == "native":
            return "native", (
                "EAGLEWorkerV2 has the steps-0 path (SGLang 0.5.14+): the threshold maps onto "
                "--speculative-adaptive, no source change"
            )
        return "patch", (
            "EAGLEWorkerV2 of SGLang 0.5.14+ patched: the fallback's target forward runs on "
            "DECODE graphs (--route native uses SGLang's own --speculative-adaptive instead)"
        )
    if requested == "native":
        return "unsupported", (
            "--route native needs SGLang 0.5.14+ (its steps-0 --speculative-adaptive); "
            "this release takes the patch route"
        )
    if all(snapshot.get(c.PATH) is None for c in WORKER_CODEMODS.values()):
        return "unsupported", "no EAGLE worker in this release (EAGLE arrived in 0.4.1.post4)"
    kernels = "".join(_text(snapshot, path) or "" for path in KERNEL_PATHS)
    if "verify_tree_greedy" not in kernels:
        if "eagle_verify_retrive" in kernels:
            return "unsupported", (
                "greedy verify uses the Triton eagle_verify_retrive kernel, which reads out of "
                "bounds for a one-node tree (releases before 0.4.4.post2)"
            )
        return "unsupported", "verify kernel not recognised (no verify_tree_greedy)"
    if not _PREPARE_WITH_PAGE_SIZE.search(kernels):
        return "unsupported", (
            "EagleVerifyInput.prepare_for_verify takes no page_size (before 0.4.4.post4): "
            "the runtime cannot allocate its one-node tree there"
        )
    return "patch", "speculative workers present and patchable (0.4.4.post4 – 0.5.13.post1 layout)"


def _selected_workers(
    snapshot: Snapshot, worker: str, live_worker: str | None
) -> tuple[list[str], str]:
    present = [name for name, c in WORKER_CODEMODS.items() if snapshot.get(c.PATH) is not None]
    if worker == "auto" and live_worker in WORKER_CODEMODS:
        return [live_worker], f"the running server uses {live_worker}"
    if worker in ("auto", "both"):
        return present, "every worker file present"
    return [worker], f"--worker {worker}"


class _Analyses:
    """Each file of the snapshot analysed (so parsed) at most once per plan."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self._done: dict[str, object] = {}

    def of(self, codemod: object) -> object:
        path: str = codemod.PATH  # type: ignore[attr-defined]
        if path not in self._done:
            self._done[path] = codemod.analyse(_text(self.snapshot, path))  # type: ignore[attr-defined]
        return self._done[path]

    def v2_facts(self) -> Mapping[str, object]:
        if self.snapshot.get(HookEagleWorkerV2Command.PATH) is None:
            return {}
        return self.of(HookEagleWorkerV2Command()).facts  # type: ignore[attr-defined]


def version_key(version: str) -> tuple[int, ...]:
    """``0.1.0`` < ``0.1.10`` < ``0.2.0.post1``: the numbers of a version, in order."""
    return tuple(int(part) for part in re.findall(r"\d+", version))


def newer_than_me(version: str | None) -> bool:
    return version is not None and version_key(version) > version_key(TOOL_VERSION)


def _newer_refusal(version: str) -> str:
    return (
        f"patched by dynspec-patch {version}, newer than this one ({TOOL_VERSION}): "
        f"use dynspec-patch >= {version}; nothing was downgraded"
    )


def _state_label(state: object) -> str:
    return state.label  # type: ignore[attr-defined]


def _recorded_mismatch(path: str, data: bytes | None, recorded: Mapping[str, FileRecord]) -> bool:
    record = recorded.get(path)
    return record is not None and sha256_or_none(data) != record.sha256_after


EDITED_SINCE_APPLY = "changed since dynspec-patch wrote it (sha256 differs from the manifest)"


def _encode(text: str | None) -> bytes | None:
    return None if text is None else text.encode("utf-8")


def _apply_one(
    codemod: object, analyses: _Analyses, recorded: Mapping[str, FileRecord]
) -> FileChange:
    path: str = codemod.PATH  # type: ignore[attr-defined]
    before = analyses.snapshot.get(path)
    analysis = analyses.of(codemod)
    state = analysis.state
    if isinstance(state, Patched) and newer_than_me(state.version):
        return FileChange.kept(path, before, "patched", "refused", _newer_refusal(state.version))
    if isinstance(state, Patched) and _recorded_mismatch(path, before, recorded):
        state = Unknown(EDITED_SINCE_APPLY)
        analysis.refusal = state.reason
    label = _state_label(state)
    if analysis.refusal is not None:
        return FileChange.kept(path, before, label, "refused", analysis.refusal)
    after = _encode(codemod.apply(analysis))  # type: ignore[attr-defined]
    if after == before:
        return FileChange(path, before, after, label, label, "unchanged", state.describe())
    action = "added" if before is None else "patched"
    original = _encode(codemod.revert(analysis)) if isinstance(state, Patched) else before  # type: ignore[attr-defined]
    return FileChange(
        path, before, after, label, "patched", action, state.describe(), original=original
    )


def parse_threshold(value: object) -> Threshold | None:
    """``--threshold`` as given (command-line text, or an Ansible int or string): an integer
    in 1..MAX_THRESHOLD or ``auto``; anything else is a usage error (exit 2)."""
    if value == AUTO_THRESHOLD:
        return AUTO_THRESHOLD  # a plain str (Ansible hands a tagged str subclass)
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        value = int(value)
    validate_options(threshold=value)  # type: ignore[arg-type]
    return value  # type: ignore[return-value]


def validate_options(
    *,
    threshold: Threshold | None = None,
    num_steps: int | None = None,
    worker: str = "auto",
    route: str | None = None,
) -> None:
    """Refuse bad option values before anything is read or any host is contacted (exit 2)."""
    validate_route(route)
    if threshold is not None and threshold != AUTO_THRESHOLD:
        if not isinstance(threshold, int) or isinstance(threshold, bool):
            raise UsageError(
                f"--threshold must be an integer between 1 and {MAX_THRESHOLD} or "
                f"{AUTO_THRESHOLD}, got {threshold!r}"
            )
        if not 1 <= threshold <= MAX_THRESHOLD:
            raise UsageError(
                f"--threshold must be between 1 and {MAX_THRESHOLD}, got {threshold}"
            )
    if num_steps is not None and not 1 <= num_steps <= MAX_NUM_STEPS:
        raise UsageError(f"--num-steps must be between 1 and {MAX_NUM_STEPS}, got {num_steps}")
    if worker not in WORKER_CHOICES:
        raise UsageError(f"--worker must be one of {', '.join(WORKER_CHOICES)}, got {worker!r}")


def plan_apply(
    snapshot: Snapshot,
    *,
    worker: str = "auto",
    live_worker: str | None = None,
    threshold: Threshold | None = None,
    num_steps: int | None = None,
    cuda_graph_bs: Sequence[int] | None = None,
    native_config_path: str = CONFIG_FILE_NAME,
    recorded: Mapping[str, FileRecord] | None = None,
    server_args: Mapping[str, object] | None = None,
    server_argv: Sequence[str] = (),
    route: str | None = None,
) -> Plan:
    """Plan ``apply``: which files change and how, or why nothing may be written.

    ``server_args``/``server_argv`` describe the running server where one is known (``--host``):
    on the native route a configuration SGLang would silently run without the threshold
    is refused, and on the patch route a v2 server that runs SGLang's own
    ``--speculative-adaptive`` (two controllers; the runtime would stay off). ``route`` is
    ``--route`` (None: ``DEFAULT_ROUTE`` where a release offers both).
    """
    validate_options(threshold=threshold, num_steps=num_steps, worker=worker, route=route)
    recorded = recorded or {}
    version = release_version(snapshot)
    analyses = _Analyses(snapshot)
    routes = routes_offered(analyses.v2_facts())
    route, reason = _route(snapshot, analyses.v2_facts(), route)
    if route == "unsupported":
        return Plan("apply", version, route, reason, routes=routes)
    if route == "native":
        if threshold is None:
            raise UsageError("the native route needs --threshold N to build its config")
        if threshold == AUTO_THRESHOLD:
            return Plan("apply", version, route, reason, refusal=NATIVE_AUTO_REFUSAL,
                        routes=routes)
        config = native_config(
            threshold, num_steps or DEFAULT_NUM_STEPS, native_config_path, cuda_graph_bs
        )
        why_not = adaptive_unsupported_reason(server_args or {}, server_argv)
        refusal = None
        if why_not is not None:
            refusal = (
                f"SGLang {version} switches --speculative-adaptive off for this server "
                f"({why_not}): the threshold would do nothing; nothing was written"
            )
        elif _any_patched(analyses):
            refusal = (
                "this tree carries the patch route: run dynspec-patch revert first (one "
                "controller at a time); nothing was written"
            )
        return Plan(
            "apply",
            version,
            route,
            reason,
            native=config,
            server_flags=config.flags,
            refusal=refusal,
            routes=routes,
        )

    selected, why = _selected_workers(snapshot, worker, live_worker)
    files = [_apply_one(codemod, analyses, recorded) for codemod in _core_codemods(snapshot)]
    for name, codemod_class in WORKER_CODEMODS.items():
        path = codemod_class.PATH
        if name in selected and snapshot.get(path) is None:
            reason = f"this release has no {path} ({name} worker)"
            files.append(FileChange.kept(path, None, "missing", "refused", reason))
        elif name in selected:
            files.append(_apply_one(codemod_class(), analyses, recorded))
        elif snapshot.get(path) is not None:
            label = _status_one(codemod_class(), analyses).state_before
            reason = f"not selected ({why})"
            files.append(FileChange.kept(path, snapshot[path], label, "skipped", reason))
    if any(f.action == "refused" for f in files):
        files = [_as_not_written(f) for f in files]
    flags = (THRESHOLD_FLAG, str(threshold)) if threshold is not None else ()
    return Plan(
        "apply",
        version,
        route,
        f"{reason}; workers: {why}",
        tuple(files),
        server_flags=flags,
        patchable_workers=_patchable_workers(analyses),
        refusal=_adaptive_conflict(selected, live_worker, server_args or {}, server_argv),
        routes=routes,
    )


def _core_codemods(snapshot: Snapshot) -> list[object]:
    """The runtime module and the ServerArgs codemods (the Spec fields file only where it is)."""
    codemods: list[object] = [InstallRuntimeModuleCommand(), AddDisableThresholdArgCommand()]
    if snapshot.get(AddDisableThresholdSpecFieldsCommand.PATH) is not None:
        codemods.append(AddDisableThresholdSpecFieldsCommand())
    return codemods


def runs_sglang_adaptive(server_args: Mapping[str, object], argv: Sequence[str]) -> bool:
    """Whether the server runs SGLang's own ``--speculative-adaptive``."""
    if ADAPTIVE_FLAG in argv:
        return True
    return bool(server_args.get("speculative_adaptive"))


def _adaptive_conflict(
    selected: Sequence[str],
    live_worker: str | None,
    server_args: Mapping[str, object],
    argv: Sequence[str],
) -> str | None:
    """The patch route on a v2 server that runs SGLang's adaptive: two controllers, refused.

    The runtime would turn itself off there (one warning); v1 and the adaptive coexist, since
    the v1 fallback never reaches the adaptive controller.
    """
    if "v2" not in selected or live_worker == "v1" or not runs_sglang_adaptive(server_args, argv):
        return None
    return (
        "the server runs SGLang's own --speculative-adaptive, which would keep control (the "
        "patch would stay off): relaunch it without --speculative-adaptive (after the native "
        "route, dynspec-patch revert does that), or use --route native; nothing was written"
    )


def _as_not_written(change: FileChange) -> FileChange:
    if change.action in ("refused", "skipped"):
        return change
    reason = "nothing is written while a file is refused"
    return FileChange.kept(change.path, change.before, change.state_before, "skipped", reason)


def _revert_one(
    codemod: object,
    snapshot: Snapshot,
    recorded: Mapping[str, FileRecord],
    force: bool,
    originals: Mapping[str, bytes | None] | None,
) -> FileChange:
    path: str = codemod.PATH  # type: ignore[attr-defined]
    before = snapshot.get(path)
    analysis = codemod.analyse(_text(snapshot, path))  # type: ignore[attr-defined]
    label = _state_label(analysis.state)
    record = recorded.get(path)
    if recorded and record is None and not isinstance(analysis.state, Patched):
        reason = "never touched by dynspec-patch (not in the manifest)"
        return FileChange.kept(path, before, label, "skipped", reason)
    change = _plain_revert(codemod, path, before, analysis, label, record, force)
    if change.action == "refused" and originals is not None and record is not None:
        return _restore_original(change, record, originals)
    return change


def _plain_revert(
    codemod: object,
    path: str,
    before: bytes | None,
    analysis: object,
    label: str,
    record: FileRecord | None,
    force: bool,
) -> FileChange:
    state = analysis.state  # type: ignore[attr-defined]
    if isinstance(state, Unknown):
        hint = "; --restore-originals puts back the original saved at apply" if record else ""
        return FileChange.kept(path, before, label, "refused", state.reason + hint)
    if isinstance(state, Unpatched):
        return FileChange.kept(path, before, label, "unchanged", "not patched")
    if not force and record is not None and sha256_or_none(before) != record.sha256_after:
        reason = (
            "changed since dynspec-patch wrote it (sha256 differs from the manifest); "
            "--force reverts anyway, --restore-originals puts the saved original back"
        )
        return FileChange.kept(path, before, label, "refused", reason)
    after = _encode(codemod.revert(analysis))  # type: ignore[attr-defined]
    if not force and record is not None and sha256_or_none(after) != record.sha256_before:
        reason = "reverting would not restore the bytes recorded at apply time"
        return FileChange.kept(path, before, label, "refused", reason)
    action = "removed" if after is None else "reverted"
    return FileChange(path, before, after, label, "unpatched", action, state.describe())


def _restore_original(
    refused: FileChange, record: FileRecord, originals: Mapping[str, bytes | None]
) -> FileChange:
    """``--restore-originals``: the saved original, when it hashes to what apply recorded."""
    path = refused.path
    if record.sha256_before is None:
        saved = None  # dynspec-patch created this file: the original state is "absent"
    elif path in originals and sha256_or_none(originals[path]) == record.sha256_before:
        saved = originals[path]
    else:
        reason = f"{refused.reason}; no intact saved original to restore"
        return FileChange.kept(path, refused.before, refused.state_before, "refused", reason)
    reason = f"saved original put back ({refused.reason})"
    return FileChange(
        path, refused.before, saved, refused.state_before, "original", "restored", reason
    )


def plan_revert(
    snapshot: Snapshot,
    *,
    recorded: Mapping[str, FileRecord] | None = None,
    force: bool = False,
    originals: Mapping[str, bytes | None] | None = None,
) -> Plan:
    """Plan ``revert``: every patched file back to its original bytes, hooks first.

    ``originals`` (the saved copies, given for ``--restore-originals``) replace a file whose
    plain revert is refused, provided it hashes to the ``before`` the manifest recorded.
    Where a manifest exists, files it does not list are left alone unless they carry our patch.
    """
    recorded = recorded or {}
    version = release_version(snapshot)
    analyses = _Analyses(snapshot)
    routes = routes_offered(analyses.v2_facts())
    if "native" in routes and not _any_patched(analyses):
        return Plan(
            "revert", version, "native", "no source change to undo (native route)", routes=routes
        )
    codemods = (
        HookEagleWorkerV2Command(),
        HookEagleWorkerCommand(),
        AddDisableThresholdSpecFieldsCommand(),
        AddDisableThresholdArgCommand(),
        InstallRuntimeModuleCommand(),
    )
    files = tuple(
        _revert_one(codemod, snapshot, recorded, force, originals)
        for codemod in codemods
        if snapshot.get(codemod.PATH) is not None
    )
    if any(f.action == "refused" for f in files):
        files = tuple(_as_not_written(f) for f in files)
    reason = "remove everything dynspec-patch inserted"
    return Plan("revert", version, "patch", reason, files, routes=routes)


def _any_patched(analyses: _Analyses) -> bool:
    """Whether any file carries dynspec-patch's statements (the patch route was applied)."""
    for codemod_class in CODEMODS:
        if analyses.snapshot.get(codemod_class.PATH) is None:
            continue
        analysis = analyses.of(codemod_class())
        if isinstance(analysis.state, Patched) or (  # type: ignore[attr-defined]
            isinstance(analysis.state, Unknown)  # type: ignore[attr-defined]
            and b"dynspec-patch" in (analyses.snapshot.get(codemod_class.PATH) or b"")
        ):
            return True
    return False


def _status_one(
    codemod: object, analyses: _Analyses, recorded: Mapping[str, FileRecord] | None = None
) -> FileChange:
    """One file's state as ``apply`` judges it: a patched file whose bytes differ from what
    the manifest recorded (edited by hand since) is ``unknown``, as ``apply`` refuses it."""
    path: str = codemod.PATH  # type: ignore[attr-defined]
    data = analyses.snapshot.get(path)
    analysis = analyses.of(codemod)
    if isinstance(analysis.state, Patched) and _recorded_mismatch(path, data, recorded or {}):
        return FileChange.kept(path, data, "unknown", "unchanged", EDITED_SINCE_APPLY)
    label = _state_label(analysis.state)
    reason = analysis.refusal or analysis.state.describe()
    return FileChange.kept(path, data, label, "unchanged", reason)


def _patchable_workers(analyses: _Analyses) -> tuple[str, ...]:
    """The workers (v1, v2) present in the tree that the codemods would accept."""
    return tuple(
        name
        for name, codemod_class in WORKER_CODEMODS.items()
        if analyses.snapshot.get(codemod_class.PATH) is not None
        and analyses.of(codemod_class()).refusal is None  # type: ignore[attr-defined]
    )


def plan_status(
    snapshot: Snapshot,
    recorded: Mapping[str, FileRecord] | None = None,
    *,
    native_applied: bool = False,
) -> Plan:
    """Route and per-file state, without planning any change (detect-path, status); with
    ``recorded`` (the manifest's files) each row says what ``apply`` would say of that file.

    On a release that offers both routes the route shown is the one the tree is on: patch
    when any file carries our statements, native when ``native_applied`` (the caller found
    the native route's config), else the one ``apply`` would take.
    """
    version = release_version(snapshot)
    analyses = _Analyses(snapshot)
    routes = routes_offered(analyses.v2_facts())
    requested = None
    if "native" in routes:
        requested = "patch" if _any_patched(analyses) or not native_applied else "native"
    route, reason = _route(snapshot, analyses.v2_facts(), requested)
    if route != "patch":
        return Plan("status", version, route, reason, routes=routes)
    files = [_status_one(codemod, analyses, recorded) for codemod in _core_codemods(snapshot)]
    for codemod_class in WORKER_CODEMODS.values():
        if snapshot.get(codemod_class.PATH) is not None:
            files.append(_status_one(codemod_class(), analyses, recorded))
    return Plan(
        "status",
        version,
        route,
        reason,
        tuple(files),
        patchable_workers=_patchable_workers(analyses),
        routes=routes,
    )


def next_manifest(previous: Manifest | None, plan: Plan) -> Manifest | None:
    """The manifest after ``plan`` is written: a file's first ``before`` is kept across applies."""
    records: dict[str, FileRecord] = previous.by_path() if previous else {}
    for change in plan.changes:
        first = records.get(change.path)
        if plan.operation == "revert":
            records.pop(change.path, None)
            continue
        original = first.sha256_before if first else sha256_or_none(change.first_bytes)
        records[change.path] = FileRecord(change.path, original, sha256_or_none(change.after))
    if not records:
        return None
    return Manifest(plan.sglang_version, tuple(records[p] for p in sorted(records)))


@dataclass(frozen=True)
class TreeState:
    """The one judgement of a whole tree that ``status``, ``apply`` and ``revert`` share."""

    state: str  # original | patched | mixed | unknown
    problems: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"state": self.state, "problems": list(self.problems)}


def tree_state(plan: Plan, manifest: Manifest | None, snapshot: Snapshot) -> TreeState:
    """original | patched | mixed | unknown, from the files' bytes and the manifest's hashes.

    ``plan`` is ``plan_status`` of ``snapshot``. ``mixed``: some files patched and others not
    (or not as recorded), or hooks that import a runtime module which is not installed.
    """
    states = {f.path: f.state_before for f in plan.files}
    problems: list[str] = []
    for f in plan.files:
        if f.state_before == "unknown":
            problems.append(f"{f.path}: {f.reason}")
    if manifest is not None and manifest.files:
        for record in manifest.files:
            current = sha256_or_none(snapshot.get(record.path))
            if states.get(record.path) == "unknown":
                continue  # its row's reason is listed above
            if current not in (record.sha256_after, record.sha256_before):
                problems.append(f"{record.path}: matches neither the recorded original nor patch")
    if newer_than_me(manifest.tool_version if manifest else None):
        problems.append(f"the manifest was written by dynspec-patch {manifest.tool_version}, "  # type: ignore[union-attr]
                        f"newer than this one ({TOOL_VERSION})")
    hooks = [c.PATH for c in WORKER_CODEMODS.values() if states.get(c.PATH) == "patched"]
    runtime = InstallRuntimeModuleCommand.PATH
    if hooks and states.get(runtime) != "patched":
        problems.append(f"{', '.join(hooks)} import(s) {runtime}, which is "
                        f"{'missing' if snapshot.get(runtime) is None else 'not ours'}")
    if manifest is not None and manifest.files:
        records = manifest.files
        current = {r.path: sha256_or_none(snapshot.get(r.path)) for r in records}
        if all(current[r.path] == r.sha256_after for r in records) and not problems:
            return TreeState("patched")
        if all(current[r.path] == r.sha256_before for r in records) and not hooks:
            return TreeState("original", tuple(problems))
        return TreeState("mixed", tuple(problems) or ("files are partly patched",))
    values = set(states.values())
    if "unknown" in values:
        return TreeState("unknown", tuple(problems))
    if not values or values <= {"unpatched", "missing"}:
        return TreeState("original")
    core = [runtime, AddDisableThresholdArgCommand.PATH]
    if AddDisableThresholdSpecFieldsCommand.PATH in states:
        core.append(AddDisableThresholdSpecFieldsCommand.PATH)
    if all(states.get(p) == "patched" for p in core) and hooks and not problems:
        return TreeState("patched")
    return TreeState("mixed", tuple(problems) or ("files are partly patched",))
