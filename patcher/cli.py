"""The ``dynspec-patch`` command line: a thin shell over ``patcher.engine`` and the file layers.

Exit codes: 0 success (also when nothing had to change), 1 error, 2 usage error,
3 refused (nothing written), 4 rolled back after a failure. An expected failure is one
line on stderr (``--debug`` adds the traceback); with ``--json`` every exit prints one
object on stdout, failures as ``{"error": ..., "exit_code": ...}``.
"""

from __future__ import annotations

import datetime
import difflib
import json
import os
import shlex
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dynspec_patch.patcher import checks, local
from dynspec_patch.patcher.engine import (
    DEFAULT_ROUTE,
    ROUTES,
    FileChange,
    Plan,
    parse_threshold,
    plan_apply,
    plan_revert,
    plan_status,
    tree_state,
    validate_options,
)
from dynspec_patch.patcher.errors import DynspecError, RefusedError, UsageError
from dynspec_patch.patcher.manifest import sha256_or_none
from dynspec_patch.patcher.releases import copy_release, find_pin, load_pins
from dynspec_patch.transforms import (
    AddDisableThresholdArgCommand,
    HookEagleWorkerCommand,
    HookEagleWorkerV2Command,
    InstallRuntimeModuleCommand,
)
from dynspec_patch.transforms.markers import TOOL_VERSION
from dynspec_patch.transforms.runtime_probe import probe_directory

EXAMPLES = """Examples:

\b
  dynspec-patch detect-path --sglang-root /opt/venv/lib/python3.11/site-packages
  dynspec-patch apply --sglang-root ./sglang --dry-run
  dynspec-patch apply --host ubuntu@gpu-box-1 --threshold 8
  dynspec-patch status --host gpu-box-1 --json
  dynspec-patch revert --host gpu-box-1

Exit codes: 0 ok, 1 error, 2 usage, 3 refused (nothing written), 4 rolled back.
"""



def _examples(*commands: str) -> str:
    """A help epilog listing example commands, one per line (``\\b``: no rewrapping)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {command}" for command in commands)


app = typer.Typer(
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, pwsh)
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # never print locals (paths, keys) in a traceback
    rich_markup_mode=None,  # help texts contain brackets ([user@]host) that are not markup
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Add dynamic speculation disable (--speculative-disable-batch-threshold) to SGLang.",
    epilog=EXAMPLES,
)
# Tables and diffs are read in CI logs too: never squeeze them below 120 columns.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, highlight=False)

ACTION_STYLES = {
    "refused": "red",
    "patched": "green",
    "added": "green",
    "reverted": "yellow",
    "removed": "yellow",
}

SglangRoot = Annotated[
    Path | None,
    typer.Option("--sglang-root", help="An sglang package dir, or a checkout with python/sglang."),
]
Host = Annotated[
    str | None,
    typer.Option(
        "--host", help="Work on this SSH host instead: [user@]host[:port] or an ssh_config alias."
    ),
]
IdentityFile = Annotated[Path | None, typer.Option(help="(--host) Private key to log in with.")]
KnownHosts = Annotated[
    Path | None, typer.Option(help="(--host) known_hosts file (default: ~/.ssh/known_hosts).")
]
SshConfig = Annotated[
    Path | None, typer.Option(help="(--host) ssh_config file (default: ~/.ssh/config).")
]
AcceptNewHostKey = Annotated[
    bool,
    typer.Option(
        "--accept-new-host-key",
        help="(--host) Trust and record a host key seen for the first time; a changed key is "
        "still refused.",
    ),
]
ConnectTimeout = Annotated[float, typer.Option(help="(--host) Seconds to wait for SSH.")]
NoRestart = Annotated[
    bool, typer.Option("--no-restart", help="(--host) Leave the restart pending.")
]
RestartCmd = Annotated[str | None, typer.Option(help="(--host) Restart with this command.")]
ServerPid = Annotated[int | None, typer.Option("--pid", help="(--host) The server process.")]
ServerPort = Annotated[int | None, typer.Option("--port", help="(--host) The server port.")]
HealthTimeout = Annotated[
    float, typer.Option(help="(--host) Seconds to wait for the restarted server's health.")
]
RouterUrl = Annotated[
    str | None,
    typer.Option("--router", help="(--host) sglang-router URL, as this machine reaches it: the "
                 "server leaves it while it restarts (drained first) and comes back healthy."),
]
RouterWorkerUrl = Annotated[
    str | None,
    typer.Option(help="(--router) The server's URL as the router lists it "
                 "(default: http://HOST:PORT)."),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
RouteOption = Annotated[
    str | None,
    typer.Option(
        "--route",
        help=f"{' | '.join(ROUTES)}: SGLang 0.5.14+ offer both (default {DEFAULT_ROUTE}); "
        "native writes an --speculative-adaptive config instead of patching.",
    ),
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Show the diff; write nothing.")]
FullDiff = Annotated[
    bool,
    typer.Option(
        "--full-diff",
        help="(--dry-run) Show the runtime module's whole diff too, not its one-line summary.",
    ),
]


def _show_version(value: bool) -> None:
    if value:
        out.print(Text(f"dynspec-patch {TOOL_VERSION}"))
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option("--debug", "-v", help="Show a failure's traceback (anywhere on the line)."),
    ] = False,
) -> None:
    """Add dynamic speculation disable (--speculative-disable-batch-threshold) to SGLang."""


# Options that only mean something with --host; given without it they are a usage error.
HOST_ONLY = (
    "identity_file",
    "known_hosts",
    "ssh_config",
    "accept_new_host_key",
    "connect_timeout",
    "no_restart",
    "restart_cmd",
    "pid",
    "port",
    "health_timeout",
    "commit_image",
    "router",
    "router_worker_url",
)
LOCAL_ONLY = ("num_steps",)


def _given(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def _check_scope(ctx: typer.Context, host: str | None, sglang_root: Path | None) -> None:
    """Reject what cannot apply: both targets, neither, or options of the other mode."""
    if host is not None and sglang_root is not None:
        raise UsageError("give --host or --sglang-root, not both")
    for name in HOST_ONLY if host is None else LOCAL_ONLY:
        if name in ctx.params and _given(ctx, name):
            flag = "--" + name.replace("_", "-")
            where = "--host" if host is None else "--sglang-root (a host's is read from its server)"
            raise UsageError(f"{flag} applies only with {where}")
    if ctx.params.get("full_diff") and not ctx.params.get("dry_run"):
        raise UsageError("--full-diff applies only with --dry-run")
    identity = ctx.params.get("identity_file")
    if identity is not None and not (Path(identity).is_file() and os.access(identity, os.R_OK)):
        raise UsageError(f"--identity-file {identity}: not a readable file")
    for name in ("connect_timeout", "health_timeout"):
        value = ctx.params.get(name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {value}")


def _package(sglang_root: Path | None) -> Path:
    if sglang_root is None:
        raise UsageError("give --sglang-root DIR (or --host H)")
    return local.resolve_sglang_dir(sglang_root)


def _print_json(data: Mapping[str, Any]) -> None:
    out.print_json(json.dumps(data, default=str), highlight=False)


def _progress(as_json: bool) -> Any:
    """Where long steps report: one dim line each on stderr (never with --json)."""
    if as_json:
        return None
    return lambda message: err.print(Text(f"... {message}", style="dim"), soft_wrap=True)


def _change_diff(change: FileChange) -> Text:
    """One file's unified diff, coloured."""
    text = Text()
    before = (change.before or b"").decode("utf-8", "replace").splitlines(keepends=True)
    after = (change.after or b"").decode("utf-8", "replace").splitlines(keepends=True)
    old = f"a/{change.path}" if change.before is not None else "/dev/null"
    new = f"b/{change.path}" if change.after is not None else "/dev/null"
    for line in difflib.unified_diff(before, after, old, new):
        style = {"+": "green", "-": "red", "@": "cyan"}.get(line[:1], "")
        if line.startswith(("+++", "---")):
            style = "bold"
        text.append(line if line.endswith("\n") else line + "\n", style=style)
    return text


def _diff(plan: Plan) -> Text:
    """Every change's full diff, in plan order (``--json``'s ``diff``)."""
    text = Text()
    for change in plan.changes:
        text.append_text(_change_diff(change))
    return text


# A dry run is read by a person: the hooks first, then server_args.py, and the runtime module
# (some 1,300 new lines nobody reviews in a terminal) as one line unless --full-diff.
READING_ORDER = (HookEagleWorkerCommand.PATH, HookEagleWorkerV2Command.PATH,
                 AddDisableThresholdArgCommand.PATH)
RUNTIME_PATH = InstallRuntimeModuleCommand.PATH


def _line_count(data: bytes) -> str:
    return f"{len(data.splitlines()):,} lines"


def _runtime_line(change: FileChange) -> Text:
    """The runtime module's change in one line: path, lines, sha256."""
    if change.after is None:
        assert change.before is not None
        what = f"removed ({_line_count(change.before)}, sha256 {sha256_or_none(change.before)})"
    else:
        was = "new file" if change.before is None else (
            f"replaced ({_line_count(change.before)} before)")
        what = f"{was}, {_line_count(change.after)}, sha256 {sha256_or_none(change.after)}"
    return Text(f"{change.path}: {what} — the runtime module; --full-diff shows it\n",
                style="bold")


def _readable_diff(plan: Plan, full: bool) -> Text:
    """A dry run's diff for a person (see ``READING_ORDER``)."""
    def rank(change: FileChange) -> int:
        if change.path == RUNTIME_PATH:
            return len(READING_ORDER) + 1
        return READING_ORDER.index(change.path) if change.path in READING_ORDER else len(
            READING_ORDER)

    text = Text()
    for change in sorted(plan.changes, key=rank):
        if change.path == RUNTIME_PATH and not full:
            text.append_text(_runtime_line(change))
        else:
            text.append_text(_change_diff(change))
    return text


def _files_table(plan: Plan) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    if plan.operation == "status":
        for column in ("file", "state", "detail"):
            table.add_column(column)
        for change in plan.files:
            style = "red" if change.state_before == "unknown" else ""
            table.add_row(change.path, Text(change.state_before, style=style), Text(change.reason))
        return table
    for column in ("file", "before", "after", "action", "detail"):
        table.add_column(column)
    for change in plan.files:
        style = ACTION_STYLES.get(change.action, "")
        table.add_row(
            change.path,
            change.state_before,
            change.state_after,
            Text(change.action, style=style),
            Text(change.reason),
        )
    return table


def _when(value: object) -> str:
    """An epoch (manifest ``created``) as a readable UTC time."""
    if isinstance(value, int | float):
        moment = datetime.datetime.fromtimestamp(value, tz=datetime.UTC)
        return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
    return str(value)


def _readable(key: str, value: object) -> str:
    """One value of a report as a person reads it: no Python reprs, no epoch floats."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key in ("created", "since"):
        return _when(value)
    if isinstance(value, Mapping):
        lines = []
        for k, v in value.items():
            shown = ", ".join(map(str, v)) if isinstance(v, list | tuple) else _readable(k, v)
            lines.append(f"{k}: {shown or '-'}")
        return "\n".join(lines) or "-"
    if isinstance(value, list | tuple):
        if not value:
            return "-"
        return "\n".join(_readable(key, item) for item in value)
    return str(value)


# Printed after the table, each on its own unwrapped line: a sentence to read whole, and a
# command that can be pasted.
OWN_LINES = ("resumed_rotation", "recommended")
# Remote reports carry these for --json; a person does not need them in the table.
HIDDEN_IN_TABLE = ("ssh", "servers", "live_worker_evidence", *OWN_LINES)


def _details_table(details: Mapping[str, Any]) -> Table:
    table = Table(show_header=False, show_edge=False, pad_edge=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for key, value in details.items():
        if key in HIDDEN_IN_TABLE:
            continue
        table.add_row(key.replace("_", " "), Text(_readable(key, value)))
    return table


def _print_details(details: Mapping[str, Any]) -> None:
    out.print(_details_table(details))
    for key in OWN_LINES:
        if details.get(key):
            label = key.replace("_", " ")
            out.print(Text(f"{label}: {details[key]}", style="bold"), soft_wrap=True)


def _summary(plan: Plan) -> None:
    offered = f" (this release offers: {', '.join(plan.routes)})" if len(plan.routes) > 1 else ""
    out.print(
        Text(
            f"sglang {plan.sglang_version or '(version unknown)'}  route: {plan.route}{offered}",
            style="bold",
        )
    )
    out.print(Text(plan.reason))
    if plan.files:
        out.print(_files_table(plan))
    if plan.native:
        out.print(Text("launch flags: " + shlex.join(plan.native.flags), style="bold"))
        out.print(Text(json.dumps(plan.native.config)))
        for note in plan.native.notes:
            out.print(Text(f"note: {note}"))
    elif plan.server_flags and not plan.refused:
        out.print(Text("launch flag: " + " ".join(plan.server_flags), style="bold"))


def _finish(
    plan: Plan,
    as_json: bool,
    dry_run: bool = False,
    extra: dict[str, Any] | None = None,
    *,
    full_diff: bool = False,
) -> None:
    if as_json:
        data = plan.to_json() | (extra or {})
        if dry_run:
            data["diff"] = _diff(plan).plain
        if plan.refused:
            data |= {"error": plan.refusal_reason, "exit_code": RefusedError.exit_code}
        _print_json(data)
    else:
        if dry_run and plan.changes:
            out.print(_readable_diff(plan, full_diff), soft_wrap=True)
        _summary(plan)
        if extra:
            _print_details(extra)
    if plan.refused:
        raise RefusedError(plan.refusal_reason, reported=as_json)


def _remote() -> Any:
    from dynspec_patch.patcher import remote_commands  # paramiko is only loaded for --host

    return remote_commands


def _local_state(package: Path, plan: Plan) -> dict[str, Any]:
    """The tree's one judgement (same as apply/revert use), the lock and any interrupted commit."""
    judged = tree_state(plan, local.read_manifest(package), local.read_snapshot(package))
    report: dict[str, Any] = {"tree_state": judged.state, "problems": list(judged.problems)}
    holder = local.lock_holder(package)
    if holder:
        report["run_in_progress"] = holder
    if local.interrupted(package) and not holder:
        report["interrupted_commit"] = "yes: the next apply or revert finishes or undoes it"
    return report


@app.command(
    "detect-path",
    epilog=_examples(
        "dynspec-patch detect-path --sglang-root ./venv/lib/python3.11/site-packages",
        "dynspec-patch detect-path --host ubuntu@gpu-box-1 --json",
    ),
)
def detect_path(
    ctx: typer.Context,
    sglang_root: SglangRoot = None,
    host: Host = None,
    identity_file: IdentityFile = None,
    known_hosts: KnownHosts = None,
    ssh_config: SshConfig = None,
    accept_new_host_key: AcceptNewHostKey = False,
    connect_timeout: ConnectTimeout = 15.0,
    pid: ServerPid = None,
    port: ServerPort = None,
    as_json: JsonFlag = False,
) -> None:
    """Which release is installed, which worker runs, and the patch state of every file."""
    _check_scope(ctx, host, sglang_root)
    if host is not None:
        options = _host_options(
            host, identity_file, known_hosts, ssh_config, accept_new_host_key, connect_timeout
        )
        _render_remote(_remote().detect_path(options, pid=pid, port=port), as_json, host=host)
        return
    package = _package(sglang_root)
    plan = _local_status(package)
    extra = {
        "sglang_dir": str(package),
        "live_worker": "unknown (no running server is read locally; use --host)",
        "runtime": _runtime_fit(package, plan) if plan.route == "patch" else "n/a",
        **_local_state(package, plan),
        "recommended": _recommendation(plan, package),
    }
    _finish(plan, as_json, extra=extra)


def _local_status(package: Path) -> Plan:
    """``plan_status`` of a local tree; the native route counts as applied where its config is."""
    native = local.native_config_path(package).exists()
    return plan_status(
        local.read_snapshot(package), local.recorded_files(package), native_applied=native
    )


def _runtime_fit(package: Path, plan: Plan) -> str:
    """Whether the runtime module finds every SGLang name it needs here (else it stays off)."""
    report = probe_directory(package, plan.patchable_workers)
    missing = [check.name for check in report.checks if not check.found]
    if not missing:
        return f"all {len(report.checks)} names the runtime needs are present"
    return f"the runtime would stay off here; missing: {', '.join(missing[:3])} (see probe)"


def _recommendation(plan: Plan, package: Path) -> str:
    """A command that can be pasted as it is (or why there is none)."""
    root = f"--sglang-root {shlex.quote(str(package))}"
    if plan.route == "unsupported":
        return "none: this release cannot be patched"
    if plan.route == "native":
        return f"dynspec-patch apply {root} --route native --threshold 8  (8: stop above bs 8)"
    if any(f.state_before == "unknown" for f in plan.files):
        return "none: inspect the unknown files; dynspec-patch refuses to touch them"
    if all(f.state_before == "patched" for f in plan.files):
        return "none: already patched; launch with --speculative-disable-batch-threshold 8"
    return f"dynspec-patch apply {root} --dry-run"


def _locked_write(
    package: Path,
    make_plan: Any,
    as_json: bool,
    dry_run: bool,
    extra: dict[str, Any],
    *,
    full_diff: bool = False,
) -> None:
    """Plan and write under the tree's lock (a dry run reads without it), then report."""
    report = {"sglang_dir": str(package), "dry_run": dry_run}
    plan = make_plan()
    interrupted = local.interrupted(package)
    would_write = bool(plan.changes or plan.native) or local.state_dir(package).exists()
    if dry_run or not (interrupted or (would_write and not plan.refused)):
        # nothing to write (or refused): no lock, so not even the state directory is created
        if interrupted:
            report["interrupted_commit"] = "yes: the next apply or revert finishes or undoes it"
        _finish(plan, as_json, dry_run, report | extra, full_diff=full_diff)
        return
    with local.locked(package) as tree:
        plan = make_plan()
        if not plan.refused:
            local.write_plan(package, plan)
            if plan.native:
                local.write_native_config(package, plan.native.config)
        housekeeping = {k: v for k, v in tree.report().items() if v}
    _finish(plan, as_json, dry_run, report | housekeeping | extra)


@app.command(
    epilog=_examples(
        "dynspec-patch apply --sglang-root ./sglang --dry-run",
        "dynspec-patch apply --host ubuntu@gpu-box-1 --threshold 8",
        "dynspec-patch apply --host gpu-box-1 --threshold 8 --no-restart",
        "dynspec-patch apply --host gpu-box-1 --threshold auto",
    )
)
def apply(
    ctx: typer.Context,
    sglang_root: SglangRoot = None,
    host: Host = None,
    identity_file: IdentityFile = None,
    known_hosts: KnownHosts = None,
    ssh_config: SshConfig = None,
    accept_new_host_key: AcceptNewHostKey = False,
    connect_timeout: ConnectTimeout = 15.0,
    threshold: Annotated[
        str | None,
        typer.Option(
            metavar="N|auto",
            help="Batch size above which to stop speculating (1-65536), or auto: the patched "
            "server picks plain or speculative steps by expected tokens/s at each batch size.",
        ),
    ] = None,
    worker: Annotated[str, typer.Option(help="auto | v1 | v2 | both")] = "auto",
    num_steps: Annotated[
        int | None,
        typer.Option(help="--speculative-num-steps of the server (native route, local only)."),
    ] = None,
    dry_run: DryRun = False,
    full_diff: FullDiff = False,
    no_restart: NoRestart = False,
    restart_cmd: RestartCmd = None,
    pid: ServerPid = None,
    port: ServerPort = None,
    health_timeout: HealthTimeout = 1200.0,
    commit_image: Annotated[
        str | None,
        typer.Option(help="(--host, server in a container) docker commit it as this image."),
    ] = None,
    router: RouterUrl = None,
    router_worker_url: RouterWorkerUrl = None,
    route: RouteOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Patch the release (or write the native config), idempotently."""
    _check_scope(ctx, host, sglang_root)
    threshold_value = parse_threshold(threshold)
    validate_options(threshold=threshold_value, num_steps=num_steps, worker=worker, route=route)
    if host is not None:
        result = _remote().apply(
            _host_options(
                host, identity_file, known_hosts, ssh_config, accept_new_host_key, connect_timeout
            ),
            threshold=threshold_value,
            worker=worker,
            dry_run=dry_run,
            no_restart=no_restart,
            restart_cmd=restart_cmd,
            pid=pid,
            port=port,
            health_timeout=health_timeout,
            commit_image=commit_image,
            rotation=_rotation(host, router, router_worker_url),
            on_progress=_progress(as_json),
            route=route,
        )
        _render_remote(result, as_json, dry_run, host=host, full_diff=full_diff)
        return
    package = _package(sglang_root)
    config_path = str(local.native_config_path(package))

    def make_plan() -> Plan:
        return plan_apply(
            local.read_snapshot(package),
            worker=worker,
            threshold=threshold_value,
            num_steps=num_steps,
            native_config_path=config_path,
            recorded=local.recorded_files(package),
            route=route,
        )

    extra: dict[str, Any] = {}
    preview = plan_status(local.read_snapshot(package))
    if preview.route == "patch" and route != "native":
        # The patch is harmless where the runtime lacks a name (it stays off), but useless.
        extra["runtime"] = _runtime_fit(package, preview)
    _locked_write(package, make_plan, as_json, dry_run, extra, full_diff=full_diff)


@app.command(
    epilog=_examples(
        "dynspec-patch revert --sglang-root ./sglang --dry-run",
        "dynspec-patch revert --host gpu-box-1",
        "dynspec-patch revert --host gpu-box-1 --restore-originals",
    )
)
def revert(
    ctx: typer.Context,
    sglang_root: SglangRoot = None,
    host: Host = None,
    identity_file: IdentityFile = None,
    known_hosts: KnownHosts = None,
    ssh_config: SshConfig = None,
    accept_new_host_key: AcceptNewHostKey = False,
    connect_timeout: ConnectTimeout = 15.0,
    dry_run: DryRun = False,
    full_diff: FullDiff = False,
    force: Annotated[
        bool, typer.Option("--force", help="Revert even if a file changed since apply.")
    ] = False,
    restore_originals: Annotated[
        bool,
        typer.Option(
            "--restore-originals",
            help="Where a file was edited since apply, put back the original saved at apply.",
        ),
    ] = False,
    no_restart: NoRestart = False,
    restart_cmd: RestartCmd = None,
    pid: ServerPid = None,
    port: ServerPort = None,
    health_timeout: HealthTimeout = 1200.0,
    router: RouterUrl = None,
    router_worker_url: RouterWorkerUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Put every patched file back to its original bytes (native route: drop the config)."""
    _check_scope(ctx, host, sglang_root)
    if host is not None:
        result = _remote().revert(
            _host_options(
                host, identity_file, known_hosts, ssh_config, accept_new_host_key, connect_timeout
            ),
            dry_run=dry_run,
            force=force,
            restore_originals=restore_originals,
            no_restart=no_restart,
            restart_cmd=restart_cmd,
            pid=pid,
            port=port,
            health_timeout=health_timeout,
            rotation=_rotation(host, router, router_worker_url),
            on_progress=_progress(as_json),
        )
        _render_remote(result, as_json, dry_run, host=host, full_diff=full_diff)
        return
    package = _package(sglang_root)
    if _local_status(package).route == "native":
        _revert_native(package, as_json, dry_run)
        return

    def make_plan() -> Plan:
        return plan_revert(
            local.read_snapshot(package),
            recorded=local.recorded_files(package),
            force=force,
            originals=local.read_originals(package) if restore_originals else None,
        )

    _locked_write(package, make_plan, as_json, dry_run, {}, full_diff=full_diff)


def _revert_native(package: Path, as_json: bool, dry_run: bool) -> None:
    """Native route: no source changed; remove the config apply wrote, name the flags to drop."""
    plan = plan_revert(local.read_snapshot(package))
    config = local.native_config_path(package)
    extra: dict[str, Any] = {"sglang_dir": str(package), "dry_run": dry_run}
    if dry_run:
        extra["would_remove"] = str(config) if config.exists() else None
    else:
        with local.locked(package):
            extra["removed"] = str(local.remove_native_config(package) or "") or None
    extra["relaunch_without"] = shlex.join(
        ["--speculative-adaptive", "--speculative-adaptive-config", str(config)]
    )
    _finish(plan, as_json, dry_run, extra)


@app.command(
    epilog=_examples(
        "dynspec-patch status --sglang-root ./sglang", "dynspec-patch status --host gpu-box-1"
    )
)
def status(
    ctx: typer.Context,
    sglang_root: SglangRoot = None,
    host: Host = None,
    identity_file: IdentityFile = None,
    known_hosts: KnownHosts = None,
    ssh_config: SshConfig = None,
    accept_new_host_key: AcceptNewHostKey = False,
    connect_timeout: ConnectTimeout = 15.0,
    as_json: JsonFlag = False,
) -> None:
    """The state of the tree (original, patched, mixed, unknown), per file and as recorded."""
    _check_scope(ctx, host, sglang_root)
    if host is not None:
        options = _host_options(
            host, identity_file, known_hosts, ssh_config, accept_new_host_key, connect_timeout
        )
        _render_remote(_remote().status(options), as_json, host=host)
        return
    package = _package(sglang_root)
    manifest = local.read_manifest(package)
    plan = _local_status(package)
    extra = {
        "sglang_dir": str(package),
        **_local_state(package, plan),
        "manifest": None
        if manifest is None
        else {
            "tool_version": manifest.tool_version,
            "created": manifest.created,
            "user": manifest.user,
            "files": [record.path for record in manifest.files],
        },
    }
    _finish(plan, as_json, extra=extra)


@app.command(
    "check-pins",
    epilog=_examples("dynspec-patch check-pins", "dynspec-patch check-pins --sglang-root ./fork"),
)
def check_pins(
    pins: Annotated[Path | None, typer.Option(help="Pins file (default: the bundled one).")] = None,
    sglang_root: Annotated[
        list[Path] | None,
        typer.Option("--sglang-root", help="Check these trees (e.g. a fork) instead of the pins."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Apply, re-apply and revert every codemod on each pinned release, in scratch copies."""
    progress = _progress(as_json)
    if sglang_root:
        rows = checks.check_roots(sglang_root, on_progress=progress)
    else:
        rows = checks.check_pins(load_pins(pins), on_progress=progress)
    if as_json:
        data: dict[str, Any] = {"rows": [row.to_json() for row in rows]}
    else:
        table = Table(title=f"dynspec-patch {TOOL_VERSION}: codemod dry-run per release")
        for column in (
            "release",
            "route",
            "files touched",
            "idempotent",
            "revert exact",
            "time (s)",
            "result",
        ):
            table.add_column(column)
        for row in rows:
            table.add_row(
                row.release,
                row.route,
                str(row.files_touched),
                row.idempotent,
                row.revert_exact,
                f"{row.seconds:.2f}",
                Text(
                    "ok" if row.ok else f"FAIL: {row.problem}", style="green" if row.ok else "red"
                ),
            )
        out.print(table)
    failed = [row.release for row in rows if not row.ok]
    if as_json:
        if failed:
            data |= {"error": f"check-pins failed for {', '.join(failed)}", "exit_code": 1}
        _print_json(data)
    if failed:
        raise DynspecError(f"check-pins failed for {', '.join(failed)}", reported=as_json)


@app.command(epilog=_examples("dynspec-patch probe --sglang-root ./sglang"))
def probe(sglang_root: SglangRoot = None, as_json: JsonFlag = False) -> None:
    """List every name the runtime module needs in this tree, and whether it is there."""
    package = _package(sglang_root)
    status_plan = plan_status(local.read_snapshot(package))
    if status_plan.route != "patch":
        raise RefusedError(f"not a patchable release ({status_plan.route}): {status_plan.reason}")
    report = probe_directory(package, status_plan.patchable_workers)
    missing = [c.name for c in report.checks if not c.found]
    problem = f"{len(missing)} name(s) the runtime needs are missing: {missing[:5]}"
    if as_json:
        data = {"sglang_version": status_plan.sglang_version} | report.to_json()
        if not report.ok:
            data |= {"error": problem, "exit_code": 1}
        _print_json(data)
    else:
        table = Table(title=f"sglang {status_plan.sglang_version}: {report.era}")
        for column in ("name", "file", "found", "detail"):
            table.add_column(column)
        for check in report.checks:
            found = Text("yes", style="green") if check.found else Text("NO", style="red")
            table.add_row(Text(check.name), Text(check.file), found, Text(check.detail))
        out.print(table)
    if not report.ok:
        raise DynspecError(problem, reported=as_json)


@app.command(epilog=_examples("dynspec-patch fetch 0.5.10.post1 --dest /tmp/demo"))
def fetch(
    version: Annotated[str, typer.Argument(help="A pinned SGLang version, e.g. 0.5.10.post1.")],
    dest: Annotated[Path, typer.Option(help="Copy the release under this directory.")],
    as_json: JsonFlag = False,
) -> None:
    """Download a pinned release (sha256-checked), copy it into DEST, print its sglang dir."""
    target = copy_release(find_pin(version), dest, on_progress=_progress(as_json))
    if as_json:
        _print_json({"version": version, "sglang_dir": str(target)})
    else:
        out.print(Text(str(target)), soft_wrap=True)


def _host_options(
    spec: str,
    identity_file: Path | None,
    known_hosts: Path | None,
    ssh_config: Path | None,
    accept_new_host_key: bool,
    connect_timeout: float,
) -> Any:
    """``[user@]host[:port]`` (IPv6 as ``[addr]:port``) plus the connection options."""
    user, _, hostport = spec.rpartition("@")
    host, port = hostport, None
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
    elif hostport.count(":") == 1:
        host, port = hostport.split(":")
    bad_port = port is not None and not (port.isdigit() and 0 < int(port) < 65536)
    if not host or bad_port or (user == "" and "@" in spec) or any(c.isspace() for c in spec):
        raise UsageError(f"--host must be [user@]host[:port], got {spec!r}")
    return _remote().HostOptions(
        host=host,
        port=int(port) if port else None,
        user=user or None,
        identity_file=str(identity_file) if identity_file else None,
        known_hosts=str(known_hosts) if known_hosts else None,
        ssh_config=str(ssh_config) if ssh_config else None,
        accept_new_host_key=accept_new_host_key,
        connect_timeout=connect_timeout,
    )


def _rotation(host: str, router: str | None, worker_url: str | None) -> Any:
    """``--router``: take the server out of that sglang-router around its restart."""
    if router is None:
        if worker_url is not None:
            raise UsageError("--router-worker-url needs --router URL")
        return None
    from dynspec_patch.patcher.router import Rotation, RouterClient

    if not router.startswith(("http://", "https://")):
        raise UsageError(f"--router must be an http(s) URL, got {router!r}")
    return Rotation(RouterClient(router), worker_url=worker_url)


def _pasteable(text: object, host: str) -> object:
    if isinstance(text, str):
        return text.replace("--host H", f"--host {shlex.quote(host)}").replace(
            "--threshold N", "--threshold 8"
        )
    return text


def _render_remote(
    result: dict[str, Any],
    as_json: bool,
    dry_run: bool = False,
    *,
    host: str,
    full_diff: bool = False,
) -> None:
    if "recommended" in result:
        result["recommended"] = _pasteable(result["recommended"], host)
    plan = result.pop("plan", None)
    if plan is None:
        if as_json:
            _print_json(result)
        else:
            _print_details(result)
        return
    _finish(plan, as_json, dry_run, result, full_diff=full_diff)


def _command_error(exc: BaseException) -> tuple[str, int] | None:
    """(one line, exit code) for a failure we expect and explain; None for a bug."""
    usage_error = typer.BadParameter.__mro__[1]  # click's UsageError, wherever typer keeps it
    if isinstance(exc, DynspecError):
        return str(exc), exc.exit_code
    if isinstance(exc, usage_error):
        return exc.format_message(), 2  # type: ignore[attr-defined]
    if isinstance(exc, typer.Abort | KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(exc, OSError):
        where = f" {exc.filename}" if exc.filename else ""
        return f"{exc.strerror or exc}{where and ':' + where}", 1
    return None


def run(argv: list[str]) -> int:
    """Run the CLI on ``argv``; return the exit code instead of exiting."""
    as_json = "--json" in argv
    debug = "--debug" in argv or "-v" in argv or os.environ.get("DYNSPEC_DEBUG") == "1"
    argv = [a for a in argv if a not in ("--debug", "-v")]  # accepted anywhere on the line
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="dynspec-patch", standalone_mode=False)
    except SystemExit as exc:  # a callback that exits (completion scripts)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        known = _command_error(exc)
        if known is None:
            message, code = f"internal error: {exc.__class__.__name__}: {exc}", 1
        else:
            message, code = known
        if debug or known is None:
            err.print(Text("".join(traceback.format_exception(exc)), style="dim"))
        if as_json and not getattr(exc, "reported", False):
            _print_json({"error": message, "exit_code": code})
        err.print(Text(f"dynspec-patch: {message}"), soft_wrap=True)
        return code
    return code if isinstance(code, int) else 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
