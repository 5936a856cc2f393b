"""``check-pins``: apply, re-apply and revert every codemod on real releases, in scratch copies."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dynspec_patch.patcher import local
from dynspec_patch.patcher.engine import Plan, plan_apply, plan_revert, plan_status
from dynspec_patch.patcher.errors import DynspecError
from dynspec_patch.patcher.releases import Pin, copy_release

CHECK_THRESHOLD = 8  # any value works: the patch itself does not depend on it


@dataclass(frozen=True)
class CheckRow:
    release: str
    route: str
    files_touched: int
    idempotent: str  # yes|no|n/a
    revert_exact: str  # yes|no|n/a
    seconds: float
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem

    def to_json(self) -> dict[str, object]:
        return asdict(self) | {"ok": self.ok}


def _tree_bytes(package: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(package)): path.read_bytes() for path in sorted(package.rglob("*.py"))
    }


def _worker_choice(pin: Pin | None) -> str:
    if pin is None or len(pin.workers) != 1:
        return "both" if pin is not None and pin.workers else "auto"
    return pin.workers[0]


def check_tree(package: Path, label: str, pin: Pin | None = None) -> CheckRow:
    """Apply → apply again → revert on ``package`` (a scratch copy: it is modified)."""
    started = time.perf_counter()
    original = _tree_bytes(package)
    snapshot = local.read_snapshot(package)
    status = plan_status(snapshot)
    # A pin says which route to expect; any other tree must be patchable one way or another.
    expected_route = pin.route if pin else status.route
    if pin is None and status.route == "unsupported":
        expected_route = "patch or native"

    def row(route: str, touched: int, idem: str, exact: str, problem: str = "") -> CheckRow:
        return CheckRow(label, route, touched, idem, exact, time.perf_counter() - started, problem)

    if status.route != expected_route:
        return row(
            status.route,
            0,
            "n/a",
            "n/a",
            f"route {status.route}, expected {expected_route}: {status.reason}",
        )
    if status.route == "unsupported":
        return row(status.route, 0, "n/a", "n/a")
    if pin is not None and pin.refused:
        auto = plan_apply(snapshot, threshold=CHECK_THRESHOLD)
        refused = sorted(f.path for f in auto.files if f.action == "refused")
        if not auto.refused:
            return row(status.route, 0, "n/a", "n/a", f"expected refusal of {pin.refused}")
        if len(refused) != len(pin.refused):
            return row(status.route, 0, "n/a", "n/a", f"refused {refused}")
    first = plan_apply(snapshot, worker=_worker_choice(pin), threshold=CHECK_THRESHOLD)
    if status.route == "native":
        ok = first.native is not None and not first.changes
        return row("native", 0, "n/a", "n/a", "" if ok else "native plan changed files")
    if first.refused:
        return row(first.route, 0, "n/a", "n/a", f"refused: {first.refusal_reason}")
    local.write_plan(package, first)
    second = plan_apply(
        local.read_snapshot(package),
        worker=_worker_choice(pin),
        threshold=CHECK_THRESHOLD,
        recorded=local.recorded_files(package),
    )
    idempotent = not second.changes and all(
        f.action in ("unchanged", "skipped") for f in second.files
    )
    back = plan_revert(local.read_snapshot(package), recorded=local.recorded_files(package))
    if back.refused:
        return row(
            first.route,
            len(first.changes),
            _yes(idempotent),
            "no",
            f"revert refused: {back.refusal_reason}",
        )
    local.write_plan(package, back)
    exact = _tree_bytes(package) == original
    problem = "" if idempotent and exact else _problem(first, idempotent, exact)
    return row(first.route, len(first.changes), _yes(idempotent), _yes(exact), problem)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _problem(plan: Plan, idempotent: bool, exact: bool) -> str:
    parts = [] if idempotent else ["second apply changed files"]
    if not exact:
        parts.append("revert did not restore the original bytes")
    return "; ".join(parts)


Progress = Callable[[str], None] | None


def check_pins(pins: Sequence[Pin], on_progress: Progress = None) -> list[CheckRow]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="dynspec-check-") as scratch:
        for index, pin in enumerate(pins, start=1):
            if on_progress:
                on_progress(f"[{index}/{len(pins)}] sglang {pin.version}")
            try:
                package = copy_release(pin, Path(scratch), on_progress=on_progress)
            except DynspecError as exc:
                rows.append(CheckRow(pin.version, "?", 0, "n/a", "n/a", 0.0, str(exc)))
                continue
            rows.append(check_tree(package, pin.version, pin))
            shutil.rmtree(package.parent)
    return rows


def check_roots(roots: Sequence[Path], on_progress: Progress = None) -> list[CheckRow]:
    """Check user-supplied trees (e.g. a fork), each in a scratch copy."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="dynspec-check-") as scratch:
        for index, root in enumerate(roots):
            if on_progress:
                on_progress(f"[{index + 1}/{len(roots)}] {root}")
            package = local.resolve_sglang_dir(root)
            copy = Path(scratch) / str(index) / "sglang"
            shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
            rows.append(check_tree(copy, str(root)))
    return rows
