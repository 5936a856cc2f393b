"""Add ``speculative_disable_batch_threshold`` (and its hysteresis knobs) to SGLang's ServerArgs.

The layouts (``sglang-releases.md`` §1, "Where the speculative fields and flags sit"):

- S1 (≤ 0.5.13.post1): plain dataclass fields, explicit ``parser.add_argument`` flags;
- S2/S3 (0.5.14 – 0.5.19): ``name: A[T, "help"(, NS("spec"))] = default`` fields in
  ``server_args.py``, flags generated from the annotations (``add_cli_args_from_dataclass``);
- S4 (0.5.20+): the fields live in ``arg_groups/fields/spec.py`` (``class Spec``), which
  ``server_args.py`` assembles into a msgspec ``ServerArgs``; flags generated as in S2.

The checks always open ``ServerArgs._handle_speculative_decoding`` (0.5.3 – 0.5.12.post1) or
``ServerArgs.__post_init__``: they validate the raw input, before any resolution.

The threshold takes an integer 1..65536 or the word ``auto`` (the field then holds the string
``"auto"``): its flag parses with ``THRESHOLD_PARSER``, a function inserted after the leading
imports of the module holding the fields (an explicit ``type=`` in S1, ``Arg(type_parser=)``
in S2+). With ``auto``, ``--speculative-disable-resume-below`` is refused (it only means
something for a fixed T); ``--speculative-disable-min-dwell-steps`` is the number of
consecutive decisions the other mode must win before ``auto`` switches.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from dynspec_patch.transforms.statements import (
    AnchorMissing,
    Block,
    Insertion,
    MarkedInsertionCodemod,
    after_leading_imports,
    find_class,
    find_method,
    first_statement_index,
)

FIELD_ANCHOR = "speculative_num_draft_tokens"
FLAG_ANCHOR = "--speculative-num-draft-tokens"
GENERATED_FLAGS = "add_cli_args_from_dataclass"  # S2+: flags come from the field annotations
NAMESPACES_LIST = "_INPUT_NAMESPACES"  # S4: the namespace classes ServerArgs is built from
SPEC_NAMESPACE = "Spec"


@dataclass(frozen=True)
class ServerArg:
    """One new ``ServerArgs`` field, its flag, and the conditions that make it invalid.

    ``checks_before``: (condition, requirement) pairs checked before ``invalid_if``;
    ``type_parser``: the flag's ``type=`` (a function ``THRESHOLD_PARSER`` inserts), else int.
    """

    field: str
    annotation: str
    default: str
    help: str
    invalid_if: str
    requirement: str
    checks_before: tuple[tuple[str, str], ...] = ()
    type_parser: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


THRESHOLD = "speculative_disable_batch_threshold"
MAX_THRESHOLD = 65536
THRESHOLD_PARSER_NAME = "_dynspec_threshold_arg"
# The flag's parser: "auto", or an int in range (argparse prints the error as one line).
THRESHOLD_PARSER = f'''def {THRESHOLD_PARSER_NAME}(value):
    """--speculative-disable-batch-threshold: an integer 1..{MAX_THRESHOLD}, or auto."""
    import argparse

    word = value.strip().lower()
    if word == "auto":
        return word
    if word.isdigit() and 1 <= int(word) <= {MAX_THRESHOLD}:
        return int(word)
    raise argparse.ArgumentTypeError(
        f"expected an integer 1..{MAX_THRESHOLD} or auto, got {{value!r}}"
    )'''
SERVER_ARGS = (
    ServerArg(
        THRESHOLD,
        "Optional[int]",
        "None",
        "Run plain (non-speculative) decode steps while the decode batch is larger than this; "
        "speculation resumes when it drops. auto: choose each decode step by expected "
        "throughput. Default: off.",
        f'self.{THRESHOLD} is not None and self.{THRESHOLD} != "auto" and '
        f"(not isinstance(self.{THRESHOLD}, int) or self.{THRESHOLD} < 1 "
        f"or self.{THRESHOLD} > {MAX_THRESHOLD})",
        f"must be an integer 1..{MAX_THRESHOLD} or auto",
        type_parser=THRESHOLD_PARSER_NAME,
    ),
    ServerArg(
        "speculative_disable_resume_below",
        "Optional[int]",
        "None",
        "Resume speculation once the decode batch is at most this "
        "(default: T - max(1, T // 8), at least 1).",
        "self.speculative_disable_resume_below is not None and not "
        f"1 <= self.speculative_disable_resume_below <= (self.{THRESHOLD} or 0)",
        "must be between 1 and --speculative-disable-batch-threshold",
        checks_before=(
            (
                f'self.speculative_disable_resume_below is not None and self.{THRESHOLD} == "auto"',
                "applies to a fixed --speculative-disable-batch-threshold, not auto",
            ),
        ),
    ),
    ServerArg(
        "speculative_disable_min_dwell_steps",
        "int",
        "8",
        "Decode steps to stay in one mode (speculative or plain) before switching again.",
        "self.speculative_disable_min_dwell_steps < 1",
        "must be >= 1",
    ),
)


def _is_field(statement: cst.BaseStatement, name: str) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and isinstance(statement.body[0], cst.AnnAssign)
        and isinstance(statement.body[0].target, cst.Name)
        and statement.body[0].target.value == name
    )


@dataclass(frozen=True)
class _FieldStyle:
    """How the anchor field is declared: plain, or ``A[T, "help"(, NS(...))]``."""

    annotated: bool
    namespace: str | None = None  # the anchor's ``NS("spec")`` element, as source

    @classmethod
    def of(cls, module: cst.Module, anchor: cst.SimpleStatementLine) -> _FieldStyle:
        annotation = anchor.body[0].annotation.annotation  # type: ignore[attr-defined]
        if not (
            isinstance(annotation, cst.Subscript)
            and isinstance(annotation.value, cst.Name)
            and annotation.value.value == "A"
        ):
            return cls(annotated=False)
        for element in annotation.slice:
            value = getattr(element.slice, "value", None)
            if (
                isinstance(value, cst.Call)
                and isinstance(value.func, cst.Name)
                and value.func.value == "NS"
            ):
                return cls(annotated=True, namespace=module.code_for_node(value))
        return cls(annotated=True)

    def declaration(self, arg: ServerArg) -> str:
        if not self.annotated:
            return f"{arg.field}: {arg.annotation} = {arg.default}"
        namespace = f"    {self.namespace},\n" if self.namespace else ""
        help_text = f'"{arg.help}"'
        if arg.type_parser is not None:
            help_text = f"Arg(help={help_text}, type_parser={arg.type_parser})"
        return (
            f"{arg.field}: A[\n"
            f"    {arg.annotation},\n"
            f"    {help_text},\n"
            f"{namespace}"
            f"] = {arg.default}"
        )


def field_insertions(module: cst.Module, class_name: str) -> tuple[list[Insertion], _FieldStyle]:
    """The threshold's flag parser after the leading imports, and the three fields after the
    anchor field of ``class_name``, in the anchor's style."""
    class_index, cls = find_class(module, class_name)
    if not _has_optional(module):
        raise AnchorMissing(f"{class_name}'s module does not import typing.Optional")
    field_index = next(
        (i for i, stmt in enumerate(cls.body.body) if _is_field(stmt, FIELD_ANCHOR)), None
    )
    if field_index is None:
        raise AnchorMissing(f"{class_name} has no field {FIELD_ANCHOR}")
    style = _FieldStyle.of(module, cls.body.body[field_index])  # type: ignore[arg-type]
    if style.annotated and not _imports_name(module, "Arg"):
        raise AnchorMissing(f"{class_name}'s module does not import Arg (the flag parser's)")
    insertions = [Insertion((), after_leading_imports(module), THRESHOLD_PARSER)]
    insertions += [
        Insertion((class_index,), field_index + 1, style.declaration(arg)) for arg in SERVER_ARGS
    ]
    return insertions, style


def _calls(node: cst.CSTNode, name: str) -> bool:
    """Whether ``node`` contains a call to the plain name ``name``."""
    return bool(m.findall(node, m.Call(func=m.Name(name))))


def _lists_spec_namespace(module: cst.Module) -> bool:
    """S4: ``_INPUT_NAMESPACES = [..., Spec, ...]`` at module level."""
    for statement in module.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if (
                isinstance(small, cst.Assign)
                and any(
                    isinstance(t.target, cst.Name) and t.target.value == NAMESPACES_LIST
                    for t in small.targets
                )
                and isinstance(small.value, cst.List)
                and any(
                    isinstance(e.value, cst.Name) and e.value.value == SPEC_NAMESPACE
                    for e in small.value.elements
                )
            ):
                return True
    return False


def _add_argument_receiver(statement: cst.BaseStatement, flag: str) -> str | None:
    """``parser`` if ``statement`` is ``parser.add_argument("<flag>", ...)``, else None."""
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return None
    expr = statement.body[0]
    if not (isinstance(expr, cst.Expr) and isinstance(expr.value, cst.Call)):
        return None
    call = expr.value
    func = call.func
    if not (
        isinstance(func, cst.Attribute)
        and func.attr.value == "add_argument"
        and isinstance(func.value, cst.Name)
        and call.args
        and isinstance(call.args[0].value, cst.SimpleString)
        and call.args[0].value.evaluated_value == flag
    ):
        return None
    return func.value.value


def _find_flag(block: Block, path: tuple[int, ...]) -> tuple[tuple[int, ...], int, str] | None:
    """Search ``block`` and its nested bodies for the anchor flag's ``add_argument`` call."""
    for index, statement in enumerate(block.body):
        receiver = _add_argument_receiver(statement, FLAG_ANCHOR)
        if receiver is not None:
            return path, index, receiver
        child = getattr(statement, "body", None)
        if isinstance(child, cst.IndentedBlock):
            found = _find_flag(child, (*path, index))
            if found is not None:
                return found
    return None


def _has_optional(module: cst.Module) -> bool:
    return _imports_name(module, "Optional", from_module="typing")


def _imports_name(module: cst.Module, name: str, from_module: str | None = None) -> bool:
    """Whether a module-level ``from <from_module> import ..., name`` is there."""
    for statement in module.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if (
                isinstance(small, cst.ImportFrom)
                and small.module is not None
                and (from_module is None or module.code_for_node(small.module) == from_module)
                and not isinstance(small.names, cst.ImportStar)
                and any(alias.evaluated_name == name for alias in small.names)
            ):
                return True
    return False


class AddDisableThresholdArgCommand(MarkedInsertionCodemod):
    """Add the threshold (and its hysteresis knobs) as ServerArgs fields, flags and checks.

    S1: the fields go after ``speculative_num_draft_tokens``, the flags after
    ``--speculative-num-draft-tokens`` in ``add_cli_args`` (up to 0.5.12.post1 ``from_cli_args``
    reads every field from argparse, so field and flag always go together). S2/S3: the fields in
    the anchor's ``A[...]`` style, and no flags (they are generated). S4: only the checks here;
    ``AddDisableThresholdSpecFieldsCommand`` adds the fields to ``arg_groups/fields/spec.py``.
    The checks open ``_handle_speculative_decoding`` (0.5.3 – 0.5.12.post1) or
    ``__post_init__``.
    """

    NAME = "server_args"
    DESCRIPTION = "ServerArgs fields, CLI flags and checks speculative_disable_*"
    PATH = "srt/server_args.py"

    def facts(self, module: cst.Module) -> dict[str, object]:
        return {"fields_in_spec_namespace": _lists_spec_namespace(module)}

    def insertions(self, module: cst.Module) -> list[Insertion]:
        class_index, cls = find_class(module, "ServerArgs")
        cli_index, cli = find_method(cls, ["add_cli_args"])
        generated = _calls(cli, GENERATED_FLAGS)
        has_field = any(_is_field(stmt, FIELD_ANCHOR) for stmt in cls.body.body)
        insertions: list[Insertion] = []
        if has_field:
            insertions, style = field_insertions(module, "ServerArgs")
            flag = _find_flag(cli.body, (class_index, cli_index))
            if flag is not None and style.annotated:
                raise AnchorMissing(f"annotated fields and an explicit {FLAG_ANCHOR} flag")
            if flag is None and not (style.annotated and generated):
                raise AnchorMissing(
                    f"add_cli_args has no parser.add_argument({FLAG_ANCHOR!r}, ...)"
                )
            if flag is not None:
                insertions += self._flags(*flag)
        elif not (generated and _lists_spec_namespace(module)):
            raise AnchorMissing(f"ServerArgs has no field {FIELD_ANCHOR}")
        check_index, check = find_method(cls, ["_handle_speculative_decoding", "__post_init__"])
        check_block, check_at = (class_index, check_index), first_statement_index(check.body)
        for arg in SERVER_ARGS:
            for condition, requirement in (*arg.checks_before, (arg.invalid_if, arg.requirement)):
                message = f"{arg.flag} {requirement}, got {{self.{arg.field}}}"
                insertions.append(
                    Insertion(
                        check_block,
                        check_at,
                        f"if {condition}:\n"
                        f'    raise ValueError(f"{message}")',
                    )
                )
        return insertions

    @staticmethod
    def _flags(flag_path: tuple[int, ...], flag_index: int, parser: str) -> list[Insertion]:
        return [
            Insertion(
                flag_path,
                flag_index + 1,
                f"{parser}.add_argument(\n"
                f'    "{arg.flag}",\n'
                f"    type={arg.type_parser or 'int'},\n"
                f"    default=ServerArgs.{arg.field},\n"
                f'    help="{arg.help}",\n'
                ")",
            )
            for arg in SERVER_ARGS
        ]


class AddDisableThresholdSpecFieldsCommand(MarkedInsertionCodemod):
    """S4 (0.5.20+): the three fields in ``class Spec`` of ``arg_groups/fields/spec.py``.

    ``server_args.py`` builds ``ServerArgs`` from the namespace classes, so the fields (and
    their generated flags) come from here; ``AddDisableThresholdArgCommand`` adds the checks.
    """

    NAME = "spec_fields"
    DESCRIPTION = "Spec namespace fields speculative_disable_* (SGLang 0.5.20+)"
    PATH = "srt/arg_groups/fields/spec.py"

    def insertions(self, module: cst.Module) -> list[Insertion]:
        insertions, style = field_insertions(module, SPEC_NAMESPACE)
        if not style.annotated:
            raise AnchorMissing(f"{SPEC_NAMESPACE}.{FIELD_ANCHOR} is not declared as A[...]")
        return insertions
