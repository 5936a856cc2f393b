"""Shared machinery for codemods that insert marked statements into existing blocks.

A codemod names *where* its statements go (``Insertion``: a block, given as a path of
statement indices from the module, and an index in that block) and *what* they are (source
text). This module does the rest, touching only statement nodes so that large files
cost one parse and one code generation:

- ``strip_marked`` removes every statement that carries a dynspec-patch marker (revert);
- ``insert`` adds statements, each stamped with the marker of a given tool version;
- ``MarkedInsertionCodemod.analyse`` decides the file's state by stripping our statements and
  re-inserting them: only if that reproduces the file byte for byte is it ``Patched``.
"""

from __future__ import annotations

import textwrap
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import libcst as cst

from dynspec_patch.transforms.markers import (
    MARKER_RE,
    TOOL_VERSION,
    FileState,
    Patched,
    Unknown,
    Unpatched,
    marker_comment,
)

# A block is reached from the module by following compound statements' bodies:
# () is the module itself, (3,) the body of module.body[3], (3, 5) the body of its 6th statement.
BlockPath = tuple[int, ...]
BOM = "\ufeff"
Block = cst.Module | cst.IndentedBlock


class AnchorMissing(Exception):
    """The code the codemod hooks into is not there (or not in a shape it understands)."""


@dataclass(frozen=True)
class Insertion:
    path: BlockPath
    index: int
    code: str  # one statement, written at column 0, without the marker


@dataclass
class Analysis:
    """One parse of one file, with the state decided from it."""

    source: str | None
    state: FileState
    refusal: str | None = None  # why this file must not be written (set for every Unknown)
    facts: dict[str, object] = field(default_factory=dict)
    unpatched_module: cst.Module | None = None  # the file with our statements removed


def _rebuild(block: Block, path: BlockPath, change: _BodyChange) -> Block:
    if not path:
        return block.with_changes(body=change(list(block.body)))
    head, rest = path[0], path[1:]
    statement = block.body[head]
    new_statement = statement.with_changes(body=_rebuild(statement.body, rest, change))
    body = list(block.body)
    body[head] = new_statement
    return block.with_changes(body=body)


class _BodyChange:
    def __init__(self, index: int, statements: Sequence[cst.BaseStatement]) -> None:
        self.index = index
        self.statements = statements

    def __call__(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        return [*body[: self.index], *self.statements, *body[self.index :]]


def statement_marker_version(statement: cst.BaseStatement) -> str | None:
    """The tool version in the marker comment ending ``statement``'s first line, if any."""
    if isinstance(statement, cst.SimpleStatementLine):
        comment = statement.trailing_whitespace.comment
    elif isinstance(getattr(statement, "body", None), cst.IndentedBlock):
        comment = statement.body.header.comment
    else:
        return None
    if comment is None:
        return None
    match = MARKER_RE.search(comment.value)
    return match["version"] if match else None


def strip_marked(block: Block, found: list[tuple[str, cst.BaseStatement]]) -> Block:
    """Return ``block`` without marked statements, appending each to ``found``.

    Only bodies are searched (module, class, function, and the first block of compound
    statements): that is everywhere we insert. A marker anywhere else is still caught,
    because the caller then fails to reproduce the file byte for byte.
    """
    changed = False
    body: list[cst.BaseStatement] = []
    for statement in block.body:
        version = statement_marker_version(statement)
        if version is not None:
            found.append((version, statement))
            changed = True
            continue
        child = getattr(statement, "body", None)
        if isinstance(child, cst.IndentedBlock):
            new_child = strip_marked(child, found)
            if new_child is not child:
                statement = statement.with_changes(body=new_child)
                changed = True
        body.append(statement)
    return block.with_changes(body=body) if changed else block


def parse_statement_at(code: str, depth: int, module: cst.Module) -> cst.BaseStatement:
    """Parse ``code`` as if it stood ``depth`` blocks deep in ``module``.

    Parsing it in place (inside ``depth`` dummy blocks) keeps continuation lines inside
    brackets aligned with the surrounding code, exactly as a human would have written it.
    """
    indent = module.default_indent
    wrapper = "".join(f"{indent * level}if True:{module.default_newline}" for level in range(depth))
    body = textwrap.indent(code.replace("\n", module.default_newline), indent * depth)
    parsed = cst.parse_module(wrapper + body, config=module.config_for_parsing)
    statement: cst.BaseStatement = parsed.body[0]
    for _ in range(depth):
        statement = statement.body.body[0]
    return statement


def with_marker(statement: cst.BaseStatement, version: str) -> cst.BaseStatement:
    comment = cst.Comment(marker_comment(version))
    if isinstance(statement, cst.SimpleStatementLine):
        trailing = statement.trailing_whitespace.with_changes(
            whitespace=cst.SimpleWhitespace("  "), comment=comment
        )
        return statement.with_changes(trailing_whitespace=trailing)
    header = statement.body.header.with_changes(
        whitespace=cst.SimpleWhitespace("  "), comment=comment
    )
    return statement.with_changes(body=statement.body.with_changes(header=header))


def insert(module: cst.Module, insertions: Sequence[Insertion], version: str) -> cst.Module:
    """Insert every statement, marked with ``version``, in the order given per position."""
    grouped: dict[tuple[BlockPath, int], list[cst.BaseStatement]] = {}
    for ins in insertions:
        statement = with_marker(parse_statement_at(ins.code, len(ins.path), module), version)
        grouped.setdefault((ins.path, ins.index), []).append(statement)
    # Bottom-up, so the indices computed on the original module stay valid.
    result = module
    for (path, index), statements in sorted(grouped.items(), reverse=True):
        result = _rebuild(result, path, _BodyChange(index, statements))
    return result


def first_statement_index(block: Block) -> int:
    """Index of the first statement after a docstring (the place for a hook)."""
    if block.body:
        first = block.body[0]
        if (
            isinstance(first, cst.SimpleStatementLine)
            and len(first.body) == 1
            and isinstance(first.body[0], cst.Expr)
            and isinstance(first.body[0].value, cst.SimpleString | cst.ConcatenatedString)
        ):
            return 1
    return 0


def after_leading_imports(module: cst.Module) -> int:
    """Index just after the module's leading run of import statements."""
    index = first_statement_index(module)
    position = index
    for offset, statement in enumerate(module.body[index:], start=index):
        if isinstance(statement, cst.SimpleStatementLine) and all(
            isinstance(small, cst.Import | cst.ImportFrom) for small in statement.body
        ):
            position = offset + 1
        else:
            break
    return position


def find_class(module: cst.Module, name: str) -> tuple[int, cst.ClassDef]:
    for index, statement in enumerate(module.body):
        if isinstance(statement, cst.ClassDef) and statement.name.value == name:
            return index, statement
    raise AnchorMissing(f"class {name} not found at module level")


def find_method(cls: cst.ClassDef, names: Sequence[str]) -> tuple[int, cst.FunctionDef]:
    for wanted in names:
        for index, statement in enumerate(cls.body.body):
            if isinstance(statement, cst.FunctionDef) and statement.name.value == wanted:
                return index, statement
    raise AnchorMissing(f"{cls.name.value} has no method {' or '.join(names)}")


def _syntax_error(source: str, exc: cst.ParserSyntaxError) -> str:
    """Describe a syntax error the way Python does (libcst reports where it gave up)."""
    try:
        compile(source, "<target>", "exec", dont_inherit=True)
    except SyntaxError as error:
        return f"syntax error at line {error.lineno}: {error.msg}"
    return f"syntax error at line {exc.raw_line}: {exc.message}"


class MarkedInsertionCodemod(ABC):
    """Base for codemods made only of marked statement insertions."""

    NAME: str
    DESCRIPTION: str
    PATH: str  # relative to the sglang package directory

    @abstractmethod
    def insertions(self, module: cst.Module) -> list[Insertion]:
        """Where and what to insert into the unpatched ``module``; raises ``AnchorMissing``."""

    def facts(self, module: cst.Module) -> dict[str, object]:
        """Structural facts about the unpatched module, for routing (none by default)."""
        return {}

    def refusal(self, module: cst.Module, facts: dict[str, object]) -> str | None:
        """Why an otherwise well-formed file must not be patched (None: it may)."""
        return None

    def analyse(self, source: str | None) -> Analysis:
        if source is None:
            reason = f"{self.PATH} is missing"
            return Analysis(source, Unknown(reason), reason)
        if source.startswith(BOM):
            reason = "starts with a UTF-8 byte-order mark, which dynspec-patch does not rewrite"
            return Analysis(source, Unknown(reason), reason)
        try:
            module = cst.parse_module(source)
        except cst.ParserSyntaxError as exc:
            reason = _syntax_error(source, exc)
            return Analysis(source, Unknown(reason), reason)
        if module.code != source:
            reason = "libcst cannot reproduce this file byte for byte; refused"
            return Analysis(source, Unknown(reason), reason)
        if "dynspec" not in source:
            return self._analyse_unpatched(source, module)
        return self._analyse_marked(source, module)

    def _analyse_unpatched(self, source: str, module: cst.Module) -> Analysis:
        facts = self.facts(module)
        try:
            self.insertions(module)
        except AnchorMissing as exc:
            reason = f"anchor missing: {exc}"
            return Analysis(source, Unknown(reason), reason, facts)
        return Analysis(source, Unpatched(), self.refusal(module, facts), facts, module)

    def _analyse_marked(self, source: str, module: cst.Module) -> Analysis:
        found: list[tuple[str, cst.BaseStatement]] = []
        stripped = strip_marked(module, found)
        versions = {version for version, _ in found}
        if not found:
            reason = "mentions dynspec but carries no dynspec-patch marker (edited by hand?)"
            return Analysis(source, Unknown(reason), reason)
        if len(versions) > 1:
            reason = f"markers of several tool versions: {', '.join(sorted(versions))}"
            return Analysis(source, Unknown(reason), reason)
        (version,) = versions
        facts = self.facts(stripped)
        try:
            reapplied = insert(stripped, self.insertions(stripped), version)
        except AnchorMissing as exc:
            reason = f"marked statements present but {exc}"
            return Analysis(source, Unknown(reason), reason, facts)
        if reapplied.code != source:
            reason = (
                f"differs from what dynspec-patch {version} writes "
                "(partly patched, or edited after patching)"
            )
            return Analysis(source, Unknown(reason), reason, facts)
        ours = sum(stripped.code_for_node(stmt).count("dynspec") for _, stmt in found)
        if source.count("dynspec") != ours:
            reason = "mentions dynspec outside the statements dynspec-patch inserted"
            return Analysis(source, Unknown(reason), reason, facts)
        refusal = self.refusal(stripped, facts)
        return Analysis(source, Patched(version), refusal, facts, stripped)

    def apply(self, analysis: Analysis, version: str = TOOL_VERSION) -> str:
        """The patched source; the unchanged source if already patched by ``version``."""
        if analysis.refusal is not None or analysis.unpatched_module is None:
            raise ValueError(f"{self.PATH}: refused: {analysis.refusal}")
        if analysis.state == Patched(version):
            return analysis.source  # type: ignore[return-value]
        module = analysis.unpatched_module
        return insert(module, self.insertions(module), version).code

    def revert(self, analysis: Analysis) -> str:
        """The source without anything dynspec-patch inserted."""
        if isinstance(analysis.state, Unknown) or analysis.unpatched_module is None:
            raise ValueError(f"{self.PATH}: refused: {analysis.refusal}")
        if isinstance(analysis.state, Unpatched):
            return analysis.source  # type: ignore[return-value]
        return analysis.unpatched_module.code
