"""The ``dynspec-patch`` command line: a thin shell over ``patcher.engine`` and the file layers.

Exit codes: 0 success (also when nothing had to change), 1 error, 2 usage error,
3 refused (nothing written), 4 rolled back after a failure.
"""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from patcher import checks, local
from patcher.engine import Plan, plan_apply, plan_revert, plan_status
from patcher.errors import DynspecError, RefusedError, UsageError
from patcher.releases import copy_release, find_pin, load_pins
from transforms.markers import TOOL_VERSION
from transforms.runtime_probe import probe_directory

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # never print locals (paths, keys) in a traceback
    rich_markup_mode=None,  # help texts contain brackets ([user@]host) that are not markup
    help="Add dynamic speculation disable (--speculative-disable-batch-threshold) to SGLang.",
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
DryRun = Annotated[bool, typer.Option("--dry-run", help="Show the diff; write nothing.")]


def _package(sglang_root: Path | None) -> Path:
    if sglang_root is None:
        raise UsageError("give --sglang-root DIR (or --host H)")
    return local.resolve_sglang_dir(sglang_root)


def _print_json(data: dict[str, Any]) -> None:
    out.print_json(json.dumps(data), highlight=False)


def _diff(plan: Plan) -> Text:
    text = Text()
    for change in plan.changes:
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


def _summary(plan: Plan) -> None:
    out.print(
        Text(
            f"sglang {plan.sglang_version or '(version unknown)'}  route: {plan.route}",
            style="bold",
        )
    )
    out.print(Text(plan.reason))
    if plan.files:
        out.print(_files_table(plan))
    if plan.native:
        out.print(Text("launch flags: " + " ".join(plan.native.flags), style="bold"))
        out.print(Text(json.dumps(plan.native.config)))
        for note in plan.native.notes:
            out.print(Text(f"note: {note}"))
    elif plan.server_flags and not plan.refused:
        out.print(Text("launch flag: " + " ".join(plan.server_flags), style="bold"))


def _finish(
    plan: Plan, as_json: bool, dry_run: bool = False, extra: dict[str, Any] | None = None
) -> None:
    if as_json:
        data = plan.to_json() | (extra or {})
        if dry_run:
            data["diff"] = _diff(plan).plain
        _print_json(data)
    else:
        if dry_run and plan.changes:
            out.print(_diff(plan), soft_wrap=True)
        _summary(plan)
        for key, value in (extra or {}).items():
            out.print(Text(f"{key}: {value}"))
    if plan.refused:
        raise RefusedError(plan.refusal_reason)


def _write_and_finish(
    package: Path, plan: Plan, as_json: bool, dry_run: bool, extra: dict[str, Any] | None = None
) -> None:
    """Write a local plan (unless a dry run or refused), then report it."""
    if not dry_run and not plan.refused:
        local.write_plan(package, plan)
        if plan.native:
            local.write_native_config(package, plan.native.config)
    report = {"sglang_dir": str(package), "dry_run": dry_run} | (extra or {})
    _finish(plan, as_json, dry_run, report)


def _remote() -> Any:
    from patcher import remote_commands  # paramiko is only loaded for --host

    return remote_commands


@app.command("detect-path")
def detect_path(
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
    if host is not None:
        _render_remote(
            _remote().detect_path(
                _host_options(
                    host,
                    identity_file,
                    known_hosts,
                    ssh_config,
                    accept_new_host_key,
                    connect_timeout,
                ),
                pid=pid,
                port=port,
            ),
            as_json,
        )
        return
    package = _package(sglang_root)
    plan = plan_status(local.read_snapshot(package))
    extra = {
        "sglang_dir": str(package),
        "live_worker": "unknown (no running server is read locally; use --host)",
        "runtime": _runtime_fit(package, plan) if plan.route == "patch" else "n/a",
        "recommended": _recommendation(plan),
    }
    _finish(plan, as_json, extra=extra)


def _runtime_fit(package: Path, plan: Plan) -> str:
    """Whether the runtime module finds every SGLang name it needs here (else it stays off)."""
    report = probe_directory(package, plan.patchable_workers)
    missing = [check.name for check in report.checks if not check.found]
    if not missing:
        return f"all {len(report.checks)} names the runtime needs are present"
    return f"the runtime would stay off here; missing: {', '.join(missing[:3])} (see probe)"


def _recommendation(plan: Plan) -> str:
    if plan.route == "unsupported":
        return "none: this release cannot be patched"
    if plan.route == "native":
        return "dynspec-patch apply --threshold N (writes the adaptive config; no source change)"
    if any(f.state_before == "unknown" for f in plan.files):
        return "inspect the unknown files; dynspec-patch refuses to touch them"
    if all(f.state_before == "patched" for f in plan.files):
        return "already patched; launch with --speculative-disable-batch-threshold N"
    return "dynspec-patch apply (choose --worker to match the live worker)"


@app.command()
def apply(
    sglang_root: SglangRoot = None,
    host: Host = None,
    identity_file: IdentityFile = None,
    known_hosts: KnownHosts = None,
    ssh_config: SshConfig = None,
    accept_new_host_key: AcceptNewHostKey = False,
    connect_timeout: ConnectTimeout = 15.0,
    threshold: Annotated[
        int | None, typer.Option(help="Batch size above which to stop speculating.")
    ] = None,
    worker: Annotated[str, typer.Option(help="auto | v1 | v2 | both")] = "auto",
    num_steps: Annotated[
        int | None, typer.Option(help="--speculative-num-steps of the server (native route).")
    ] = None,
    dry_run: DryRun = False,
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
    as_json: JsonFlag = False,
) -> None:
    """Patch the release (or write the native config), idempotently."""
    if host is None and (router or router_worker_url):
        raise UsageError("--router works with --host only (a local tree has no server)")
    if host is not None:
        result = _remote().apply(
            _host_options(
                host, identity_file, known_hosts, ssh_config, accept_new_host_key, connect_timeout
            ),
            threshold=threshold,
            worker=worker,
            dry_run=dry_run,
            no_restart=no_restart,
            restart_cmd=restart_cmd,
            pid=pid,
            port=port,
            health_timeout=health_timeout,
            commit_image=commit_image,
            rotation=_rotation(host, router, router_worker_url),
        )
        _render_remote(result, as_json, dry_run)
        return
    if commit_image is not None:
        raise UsageError("--commit-image works with --host (a server in a Docker container)")
    package = _package(sglang_root)
    config_path = str(local.native_config_path(package))
    plan = plan_apply(
        local.read_snapshot(package),
        worker=worker,
        threshold=threshold,
        num_steps=num_steps,
        native_config_path=config_path,
        recorded=local.recorded_files(package),
    )
    extra: dict[str, Any] = {}
    if plan.route == "patch" and not plan.refused:
        # The patch is harmless where the runtime lacks a name (it stays off), but useless.
        extra["runtime"] = _runtime_fit(package, plan)
    _write_and_finish(package, plan, as_json, dry_run, extra)


@app.command()
def revert(
    sglang_root: SglangRoot = None,
    host: Host = None,
    identity_file: IdentityFile = None,
    known_hosts: KnownHosts = None,
    ssh_config: SshConfig = None,
    accept_new_host_key: AcceptNewHostKey = False,
    connect_timeout: ConnectTimeout = 15.0,
    dry_run: DryRun = False,
    force: Annotated[
        bool, typer.Option("--force", help="Revert even if a file changed since apply.")
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
    """Put every patched file back to its original bytes."""
    if host is None and (router or router_worker_url):
        raise UsageError("--router works with --host only (a local tree has no server)")
    if host is not None:
        result = _remote().revert(
            _host_options(
                host, identity_file, known_hosts, ssh_config, accept_new_host_key, connect_timeout
            ),
            dry_run=dry_run,
            force=force,
            no_restart=no_restart,
            restart_cmd=restart_cmd,
            pid=pid,
            port=port,
            health_timeout=health_timeout,
            rotation=_rotation(host, router, router_worker_url),
        )
        _render_remote(result, as_json, dry_run)
        return
    package = _package(sglang_root)
    plan = plan_revert(
        local.read_snapshot(package), recorded=local.recorded_files(package), force=force
    )
    _write_and_finish(package, plan, as_json, dry_run)


@app.command()
def status(
    sglang_root: SglangRoot = None,
    host: Host = None,
    identity_file: IdentityFile = None,
    known_hosts: KnownHosts = None,
    ssh_config: SshConfig = None,
    accept_new_host_key: AcceptNewHostKey = False,
    connect_timeout: ConnectTimeout = 15.0,
    as_json: JsonFlag = False,
) -> None:
    """The patch state of every file, and what the manifest recorded."""
    if host is not None:
        _render_remote(
            _remote().status(
                _host_options(
                    host,
                    identity_file,
                    known_hosts,
                    ssh_config,
                    accept_new_host_key,
                    connect_timeout,
                )
            ),
            as_json,
        )
        return
    package = _package(sglang_root)
    plan = plan_status(local.read_snapshot(package))
    manifest = local.read_manifest(package)
    extra = {
        "sglang_dir": str(package),
        "manifest": None
        if manifest is None
        else {
            "tool_version": manifest.tool_version,
            "created": manifest.created,
            "user": manifest.user,
            "files": len(manifest.files),
        },
    }
    _finish(plan, as_json, extra=extra)


@app.command("check-pins")
def check_pins(
    pins: Annotated[Path | None, typer.Option(help="Pins file (default: the bundled one).")] = None,
    sglang_root: Annotated[
        list[Path] | None,
        typer.Option("--sglang-root", help="Check these trees (e.g. a fork) instead of the pins."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Apply, re-apply and revert every codemod on each pinned release, in scratch copies."""
    rows = checks.check_roots(sglang_root) if sglang_root else checks.check_pins(load_pins(pins))
    if as_json:
        _print_json({"rows": [row.to_json() for row in rows]})
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
    if failed:
        raise DynspecError(f"check-pins failed for {', '.join(failed)}")


@app.command()
def probe(sglang_root: SglangRoot = None, as_json: JsonFlag = False) -> None:
    """List every name the runtime module needs in this tree, and whether it is there."""
    package = _package(sglang_root)
    status_plan = plan_status(local.read_snapshot(package))
    if status_plan.route != "patch":
        raise RefusedError(f"not a patchable release ({status_plan.route}): {status_plan.reason}")
    report = probe_directory(package, status_plan.patchable_workers)
    if as_json:
        _print_json({"sglang_version": status_plan.sglang_version} | report.to_json())
    else:
        table = Table(title=f"sglang {status_plan.sglang_version}: {report.era}")
        for column in ("name", "file", "found", "detail"):
            table.add_column(column)
        for check in report.checks:
            found = Text("yes", style="green") if check.found else Text("NO", style="red")
            table.add_row(Text(check.name), Text(check.file), found, Text(check.detail))
        out.print(table)
    if not report.ok:
        missing = [c.name for c in report.checks if not c.found]
        raise DynspecError(f"{len(missing)} name(s) the runtime needs are missing: {missing[:5]}")


@app.command()
def fetch(
    version: Annotated[str, typer.Argument(help="A pinned SGLang version, e.g. 0.5.10.post1.")],
    dest: Annotated[Path, typer.Option(help="Copy the release under this directory.")],
) -> None:
    """Download a pinned release (sha256-checked), copy it into DEST, print its sglang dir."""
    target = copy_release(find_pin(version), dest)
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
    if not host or (port is not None and not port.isdigit()):
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
    from patcher.router import Rotation, RouterClient

    if not router.startswith(("http://", "https://")):
        raise UsageError(f"--router must be an http(s) URL, got {router!r}")
    return Rotation(RouterClient(router), worker_url=worker_url)


def _render_remote(result: dict[str, Any], as_json: bool, dry_run: bool = False) -> None:
    plan = result.pop("plan", None)
    if plan is None:
        if as_json:
            _print_json(result)
        else:
            for key, value in result.items():
                out.print(Text(f"{key}: {value}"))
        return
    _finish(plan, as_json, dry_run, result)


def run(argv: list[str]) -> int:
    """Run the CLI on ``argv``; return the exit code instead of exiting."""
    try:
        app(argv, prog_name="dynspec-patch")  # typer itself exits 2 on usage errors
    except DynspecError as exc:
        err.print(Text(f"dynspec-patch: {exc}"), soft_wrap=True)
        return exc.exit_code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
