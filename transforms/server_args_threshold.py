"""Add ``speculative_disable_batch_threshold`` to ``ServerArgs`` (layout S1, ≤ 0.5.13.post1)."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from dynspec_patch.transforms.statements import (
    AnchorMissing,
    Block,
    Insertion,
    MarkedInsertionCodemod,
    find_class,
    find_method,
    first_statement_index,
)

FIELD_ANCHOR = "speculative_num_draft_tokens"
FLAG_ANCHOR = "--speculative-num-draft-tokens"


@dataclass(frozen=True)
class ServerArg:
    """One new ``ServerArgs`` field, its flag, and the condition that makes it invalid."""

    field: str
    annotation: str
    default: str
    help: str
    invalid_if: str
    requirement: str

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


THRESHOLD = "speculative_disable_batch_threshold"
SERVER_ARGS = (
    ServerArg(
        THRESHOLD,
        "Optional[int]",
        "None",
        "Run plain (non-speculative) decode steps while the decode batch is larger than this; "
        "speculation resumes when it drops. Default: off.",
        f"self.{THRESHOLD} is not None and self.{THRESHOLD} < 1",
        "must be >= 1",
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
    for statement in module.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if (
                isinstance(small, cst.ImportFrom)
                and isinstance(small.module, cst.Name)
                and small.module.value == "typing"
                and not isinstance(small.names, cst.ImportStar)
                and any(alias.evaluated_name == "Optional" for alias in small.names)
            ):
                return True
    return False


class AddDisableThresholdArgCommand(MarkedInsertionCodemod):
    """Add the threshold (and its hysteresis knobs) as fields, CLI flags and checks.

    The fields go after ``speculative_num_draft_tokens``, the flags after
    ``--speculative-num-draft-tokens`` in ``add_cli_args``; the checks open
    ``_handle_speculative_decoding`` (0.5.3+) or ``__post_init__`` (older). Up to 0.5.12.post1
    ``from_cli_args`` reads every field from argparse, so field and flag always go together.
    Refuses layouts where flags are generated from annotations (0.5.14+, S2–S4).
    """

    NAME = "server_args"
    DESCRIPTION = "ServerArgs fields and CLI flags speculative_disable_*"
    PATH = "srt/server_args.py"

    def insertions(self, module: cst.Module) -> list[Insertion]:
        class_index, cls = find_class(module, "ServerArgs")
        if not _has_optional(module):
            raise AnchorMissing("server_args.py does not import typing.Optional")
        field_index = next(
            (i for i, stmt in enumerate(cls.body.body) if _is_field(stmt, FIELD_ANCHOR)), None
        )
        if field_index is None:
            raise AnchorMissing(f"ServerArgs has no plain field {FIELD_ANCHOR}")
        cli_index, cli = find_method(cls, ["add_cli_args"])
        flag = _find_flag(cli.body, (class_index, cli_index))
        if flag is None:
            raise AnchorMissing(f"add_cli_args has no parser.add_argument({FLAG_ANCHOR!r}, ...)")
        flag_path, flag_index, parser = flag
        check_index, check = find_method(cls, ["_handle_speculative_decoding", "__post_init__"])
        check_block, check_at = (class_index, check_index), first_statement_index(check.body)
        insertions = []
        for arg in SERVER_ARGS:
            message = f"{arg.flag} {arg.requirement}, got {{self.{arg.field}}}"
            insertions += [
                Insertion(
                    (class_index,),
                    field_index + 1,
                    f"{arg.field}: {arg.annotation} = {arg.default}",
                ),
                Insertion(
                    flag_path,
                    flag_index + 1,
                    f"{parser}.add_argument(\n"
                    f'    "{arg.flag}",\n'
                    "    type=int,\n"
                    f"    default=ServerArgs.{arg.field},\n"
                    f'    help="{arg.help}",\n'
                    ")",
                ),
                Insertion(
                    check_block,
                    check_at,
                    f"if {arg.invalid_if}:\n"
                    f'    raise ValueError(f"{message}")',
                ),
            ]
        return insertions
