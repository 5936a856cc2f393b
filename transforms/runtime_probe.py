"""Static probe: does an SGLang tree have every name the injected runtime uses?

It parses (never imports) the release's sources and answers, for each entry of
``dynspec_fallback.NEEDS_BY_VARIANT``, whether the name exists. The runtime resolves the same
table against live objects with the same ``resolve_needs``, so the probe and the runtime agree
on which spelling (era) is used and cannot drift apart.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynspec_patch.transforms.runtime.dynspec_fallback import (
    NEEDS_BY_VARIANT,
    VERIFY_HELPER,
    Need,
    resolve_needs,
    tuple_return_arity,
    v2_draft_tp_mode,
    v2_grammar_mode,
)

Reader = Callable[[str], "str | None"]

WORKER_FILES: dict[str, tuple[str, str]] = {
    "v1": ("srt/speculative/eagle_worker.py", "EAGLEWorker"),
    "v2": ("srt/speculative/eagle_worker_v2.py", "EAGLEWorkerV2"),
}
V2_DRAFT_WORKER_CLASS = "EagleDraftWorker"
TARGET_WORKER = ("srt/managers/tp_worker.py", "TpModelWorker", "forward_batch_generation")
MODEL_RUNNER = ("srt/model_executor/model_runner.py", "ModelRunner")
SCHEDULE_BATCH = ("srt/managers/schedule_batch.py", "ScheduleBatch")
# The method whose presence marks SGLang's own steps-0 path (0.5.14+): the release also
# offers the native route (``ProbeReport.native``).
NATIVE_MARKER = "_build_trivial_verify_input"
# Needs whose resolved spelling names the era the adapter will run in.
ERA_KEYS = (
    "entry",
    "vo_next_input",
    "root_field",
    "target_kwarg",
    "graph_attr",
    "gbr_stride",
    "gbr_new_seq_lens",
    "gbr_allocate_lens",
    "sample_fn",
    "logprob_fn",
    "draft_tp_fn",
)


@dataclass(frozen=True)
class ProbeCheck:
    """One name the runtime uses, and whether the release has it."""

    name: str
    file: str
    found: bool
    detail: str


@dataclass(frozen=True)
class ProbeReport:
    """What the runtime would find in one SGLang tree."""

    era: str
    checks: list[ProbeCheck] = field(default_factory=list)
    native: bool = False

    @property
    def ok(self) -> bool:
        """True when at least one worker variant is present and every check passed."""
        return bool(self.checks) and all(c.found for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the report."""
        return {
            "era": self.era,
            "ok": self.ok,
            "native": self.native,
            "checks": [
                {"name": c.name, "file": c.file, "found": c.found, "detail": c.detail}
                for c in self.checks
            ],
        }


@dataclass
class _ClassInfo:
    file: str
    node: ast.ClassDef
    module: _Module


class _Module:
    """One parsed source file: its top-level bindings and classes."""

    def __init__(self, relpath: str, tree: ast.Module) -> None:
        self.relpath = relpath
        self.tree = tree
        self.bindings: dict[str, ast.AST] = {}
        for node in _top_level(tree.body):
            for name in _bound_names(node):
                self.bindings[name] = node  # the last binding wins, as at run time

    def package_parts(self) -> list[str]:
        # The package of "a/b/c.py" and of "a/b/__init__.py" is "a/b".
        return self.relpath.split("/")[:-1]


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module statements, including those under top-level if/try (guarded imports)."""
    for node in body:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            continue  # never executed: such imports would shadow the real class
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for handler in node.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(node.orelse)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _bound_names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.ImportFrom | ast.Import):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


class _Tree:
    """Source files of one release, parsed on demand."""

    def __init__(self, read: Reader) -> None:
        self._read = read
        self._modules: dict[str, _Module | None] = {}

    def module(self, relpath: str) -> _Module | None:
        if relpath not in self._modules:
            text = self._read(relpath)
            self._modules[relpath] = None if text is None else _Module(relpath, ast.parse(text))
        return self._modules[relpath]

    def module_for_import(self, origin: _Module, node: ast.ImportFrom) -> _Module | None:
        if node.level:
            base = origin.package_parts()[: len(origin.package_parts()) - node.level + 1]
            parts = base + (node.module.split(".") if node.module else [])
        else:
            parts = (node.module or "").split(".")
            if parts[0] != "sglang":
                return None
            parts = parts[1:]
        stem = "/".join(parts)
        return self.module(f"{stem}.py") or self.module(f"{stem}/__init__.py")

    def find_class(self, module: _Module, name: str, depth: int = 0) -> _ClassInfo | None:
        """Follow imports from ``module`` to the ClassDef bound as ``name``."""
        found = self.find_definition(module, name, depth)
        if found is not None and isinstance(found[1], ast.ClassDef):
            return _ClassInfo(found[0].relpath, found[1], found[0])
        return None

    def find_definition(
        self, module: _Module, name: str, depth: int = 0
    ) -> tuple[_Module, ast.AST] | None:
        """Follow imports from ``module`` to the def/class bound as ``name``: (module, node)."""
        node = module.bindings.get(name)
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            return module, node
        if isinstance(node, ast.ImportFrom) and depth < 8:
            source = self.module_for_import(module, node)
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            if source is not None:
                return self.find_definition(source, original, depth + 1)
        return None

    def module_of(self, module: _Module, name: str) -> _Module | None:
        """The module an imported global ``name`` of ``module`` comes from (itself if defined)."""
        found = self.find_definition(module, name)
        return found[0] if found is not None else None

    def class_in(self, relpath: str, name: str) -> _ClassInfo | None:
        module = self.module(relpath)
        return None if module is None else self.find_class(module, name)

    def lineage(self, info: _ClassInfo) -> Iterator[_ClassInfo]:
        """The class and its resolvable bases, nearest first."""
        seen: set[tuple[str, str]] = set()
        pending = [info]
        while pending:
            current = pending.pop(0)
            key = (current.file, current.node.name)
            if key in seen:
                continue
            seen.add(key)
            yield current
            for base in current.node.bases:
                if isinstance(base, ast.Name):
                    found = self.find_class(current.module, base.id)
                    if found is not None:
                        pending.append(found)


def _own_members(node: ast.ClassDef) -> set[str]:
    """Methods, class attributes, fields and ``self.x = ...`` attributes of one class body."""
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(item.name)
            for sub in ast.walk(item):
                targets: list[ast.expr] = []
                if isinstance(sub, ast.Assign):
                    targets = list(sub.targets)
                elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                    targets = [sub.target]
                for target in targets:
                    for t in ast.walk(target):
                        if (
                            isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                        ):
                            names.add(t.attr)
        else:
            names.update(_bound_names(item))
    return names


def _own_fields(node: ast.ClassDef) -> dict[str, bool]:
    """Annotated class-body names -> whether they have a default."""
    return {
        item.target.id: item.value is not None
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }


def _method(tree: _Tree, info: _ClassInfo, name: str) -> ast.FunctionDef | None:
    for cls in tree.lineage(info):
        for item in cls.node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                return item  # type: ignore[return-value]
    return None


def _params(fn: ast.FunctionDef) -> set[str]:
    args = fn.args
    return {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}


class _StaticHas:
    """``has`` for resolve_needs, answered from source; remembers where it looked."""

    def __init__(self, tree: _Tree, variant: str) -> None:
        self.tree = tree
        self.worker_file, worker_class = WORKER_FILES[variant]
        self.worker_module = tree.module(self.worker_file)
        self.worker = tree.class_in(self.worker_file, worker_class)
        self.draft_worker = tree.class_in(self.worker_file, V2_DRAFT_WORKER_CLASS)
        # The module holding the verify body: run_eagle_verify's (0.5.16+), else the worker's.
        self.verify_module = self.worker_module
        if self.worker_module is not None and VERIFY_HELPER in self.worker_module.bindings:
            self.verify_module = tree.module_of(self.worker_module, VERIFY_HELPER)
        self.where: dict[str, str] = {}

    def _members(self, info: _ClassInfo | None) -> set[str]:
        if info is None:
            return set()
        return set().union(*(_own_members(c.node) for c in self.tree.lineage(info)))

    def _global_class(self, owner: str) -> _ClassInfo | None:
        if self.worker_module is None:
            return None
        return self.tree.find_class(self.worker_module, owner)

    def fields(self, owner: str) -> dict[str, bool]:
        info = self._global_class(owner)
        merged: dict[str, bool] = {}
        if info is not None:
            for cls in reversed(list(self.tree.lineage(info))):
                merged.update(_own_fields(cls.node))
        return merged

    def function_params(self, name: str) -> tuple[set[str], str] | None:
        """Parameters of the function global ``name`` (verify module first), and its file."""
        for module in (self.verify_module, self.worker_module):
            found = self.tree.find_definition(module, name) if module is not None else None
            if found is not None and isinstance(found[1], ast.FunctionDef | ast.AsyncFunctionDef):
                return _params(found[1]), found[0].relpath  # type: ignore[arg-type]
        return None

    def __call__(self, need: Need, name: str) -> bool:
        scope = need.scope
        found, where = False, self.worker_file
        if scope == "module":
            found = self.worker_module is not None and name in self.worker_module.bindings
        elif scope == "verify_module":
            module = self.verify_module
            found = module is not None and name in module.bindings
            where = module.relpath if module is not None else where
        elif scope == "fn_param":
            params = self.function_params(need.owner)
            if params is not None:
                found, where = name in params[0], params[1]
        elif scope == "draft_param":
            fn = _method(self.tree, self.draft_worker, need.owner) if self.draft_worker else None
            found = fn is not None and name in _params(fn)
            where = self.draft_worker.file if self.draft_worker else where
        elif scope in ("worker", "draft_worker"):
            info = self.worker if scope == "worker" else self.draft_worker
            found, where = name in self._members(info), info.file if info else where
        elif scope in ("fields", "member"):
            info = self._global_class(need.owner)
            where = info.file if info else where
            found = name in (self.fields(need.owner) if scope == "fields" else self._members(info))
        elif scope == "param":
            owner, method = need.owner.split(".")
            info = self._global_class(owner)
            fn = _method(self.tree, info, method) if info else None
            where = info.file if info else where
            found = fn is not None and name in _params(fn)
        elif scope == "target_param":
            relpath, cls, method = TARGET_WORKER
            info = self.tree.class_in(relpath, cls)
            fn = _method(self.tree, info, method) if info else None
            found, where = fn is not None and name in _params(fn), relpath
        elif scope in ("runner_attr", "batch_member"):
            relpath, cls = MODEL_RUNNER if scope == "runner_attr" else SCHEDULE_BATCH
            found, where = name in self._members(self.tree.class_in(relpath, cls)), relpath
        else:
            raise ValueError(f"unknown scope {scope!r}")
        self.where[f"{need.key}:{name}"] = where
        return found


def _check_name(variant: str, need: Need) -> str:
    owner = f"{need.owner}." if need.owner else ""
    return f"{variant} {need.scope} {owner}{'|'.join(need.candidates)}"


def _probe_variant(tree: _Tree, variant: str) -> tuple[list[ProbeCheck], str]:
    has = _StaticHas(tree, variant)
    needs = NEEDS_BY_VARIANT[variant]
    names, _ = resolve_needs(needs, has)
    checks: list[ProbeCheck] = []
    for need in needs:
        if need.key not in names:
            continue  # conditional need of another era
        found_name = names[need.key]
        where = has.where.get(f"{need.key}:{found_name or need.candidates[-1]}", has.worker_file)
        if found_name is not None:
            detail = f"found {found_name}"
        elif need.optional:
            detail = "absent (optional)"
        else:
            detail = f"none of {', '.join(need.candidates)}"
        checks.append(
            ProbeCheck(
                _check_name(variant, need), where, found_name is not None or need.optional, detail
            )
        )
    checks.extend(_contract_checks(tree, has, variant, names))
    era = ", ".join(f"{k}={names[k]}" for k in ERA_KEYS if names.get(k))
    return checks, f"{variant}[{era}]"


def _contract_checks(
    tree: _Tree, has: _StaticHas, variant: str, names: dict[str, str | None]
) -> list[ProbeCheck]:
    """The checks the adapter makes beyond single names (see _build_adapter)."""
    checks: list[ProbeCheck] = []
    filled = {v for k, v in names.items() if k.startswith("vi_") and v is not None}
    unknown = sorted(
        n
        for n, has_default in has.fields("EagleVerifyInput").items()
        if not has_default and n not in filled
    )
    checks.append(
        ProbeCheck(
            f"{variant} EagleVerifyInput required fields all filled",
            has.worker_file,
            not unknown,
            f"unknown required: {', '.join(unknown)}" if unknown else "all known",
        )
    )
    if variant == "v1":
        helper = names.get("logprob_fn") or names.get("logprob_method")
        checks.append(
            ProbeCheck(
                "v1 logprob helper",
                has.worker_file,
                helper is not None,
                f"found {helper}" if helper else "neither helper",
            )
        )
        if names.get("entry") == "forward_batch_speculative_generation" and has.worker:
            fn = _method(tree, has.worker, "forward_batch_speculative_generation")
            arity = tuple_return_arity(ast.unparse(fn)) if fn else None
            checks.append(
                ProbeCheck(
                    "v1 entry tuple arity", has.worker_file, arity in (4, 5), f"arity {arity}"
                )
            )
    else:
        where_to = names.get("gbr_new_seq_lens") or names.get("di_new_seq_lens")
        checks.append(
            ProbeCheck(
                "v2 new_seq_lens carrier",
                has.worker_file,
                where_to is not None,
                "result"
                if names.get("gbr_new_seq_lens")
                else ("draft input" if where_to else "none"),
            )
        )
        if names.get("gbr_allocate_lens"):
            checks.append(
                ProbeCheck(
                    "v2 allocate_lens on EagleDraftInput",
                    has.worker_file,
                    names.get("di_allocate_lens") is not None,
                    "",
                )
            )
        sampler = names.get("vi_sample") or names.get("sample_fn")
        checks.append(
            ProbeCheck(
                "v2 sampler (EagleVerifyInput.sample | eagle_sample)",
                has.verify_module.relpath if has.verify_module else has.worker_file,
                sampler is not None,
                f"found {sampler}" if sampler else "neither",
            )
        )
        tp_mode = v2_draft_tp_mode(names)
        checks.append(
            ProbeCheck(
                "v2 draft TP context", has.worker_file, tp_mode is not None, tp_mode or "none"
            )
        )
        grammar = v2_grammar_mode(names)
        checks.append(
            ProbeCheck(
                "v2 grammar mask (optional)",
                has.worker_file,
                True,
                grammar or "none: grammar batches keep speculating",
            )
        )
    return checks


def probe_release(read: Reader, variants: tuple[str, ...] | None = None) -> ProbeReport:
    """Check an SGLang tree (``read(relpath)`` -> text relative to the ``sglang`` package).

    Probes every worker variant present (v1 ``EAGLEWorker``, v2 ``EAGLEWorkerV2``), or only
    ``variants``. A tree without any of them yields a report with no checks (not ok).
    """
    tree = _Tree(read)
    checks: list[ProbeCheck] = []
    eras: list[str] = []
    native = False
    for variant in variants or tuple(WORKER_FILES):
        relpath, cls = WORKER_FILES[variant]
        info = tree.class_in(relpath, cls)
        if info is None or info.file != relpath:
            eras.append(f"{variant}[absent]")
            continue
        if variant == "v2" and _method(tree, info, NATIVE_MARKER) is not None:
            native = True
        variant_checks, era = _probe_variant(tree, variant)
        checks.extend(variant_checks)
        eras.append(era)
    return ProbeReport(era="; ".join(eras), checks=checks, native=native)


def probe_directory(sglang_dir: Path, variants: tuple[str, ...] | None = None) -> ProbeReport:
    """``probe_release`` over an unpacked ``sglang`` package directory."""

    def read(relpath: str) -> str | None:
        path = sglang_dir / relpath
        return path.read_text(encoding="utf-8") if path.is_file() else None

    return probe_release(read, variants)


def resolve_static(read: Reader, variant: str) -> dict[str, str | None]:
    """The spelling of every need the adapter would pick for ``variant`` in this tree."""
    names, _ = resolve_needs(NEEDS_BY_VARIANT[variant], _StaticHas(_Tree(read), variant))
    return names
