"""Operations on a host: apply, revert, status, detect-path over one SSH connection.

Order of an ``apply`` (each step is one request to the remote agent, which holds a ``flock``
on ``<site-packages>/.dynspec-patch/lock`` for the whole command):

1. ``facts``   read processes, server info, package files, manifest (one round trip);
   the engine plans locally (libcst never runs on the host);
2. ``stage``   every new file is written beside its target and compiled with the server's
   own python; the current bytes must still be the ones planned from;
3. ``commit``  undo copies + originals + manifest + journal, then ``rename`` into place;
4. ``restart`` on the host, autonomously: stop the tree, wait for the port (and GPU),
   relaunch with the new flag, gate on /health and a tiny generation, prove the flag in
   /server_info; on any failure undo step 3 and relaunch the original command.

Everything that can be verified is verified before the server is stopped.
"""

from __future__ import annotations

import base64
import json
import posixpath
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from dynspec_patch.patcher import container, plan_cache
from dynspec_patch.patcher.container import DockerOptions
from dynspec_patch.patcher.engine import (
    SNAPSHOT_PATHS,
    THRESHOLD_FLAG,
    FileChange,
    Plan,
    Threshold,
    next_manifest,
    plan_revert,
    plan_status,
    tree_state,
)
from dynspec_patch.patcher.errors import DynspecError, RefusedError, RollbackError, UsageError
from dynspec_patch.patcher.facts import HostFacts, ServerProcess, gather, has_flag, redact_argv
from dynspec_patch.patcher.manifest import FileRecord, Manifest, sha256_or_none
from dynspec_patch.patcher.ssh import (
    AgentSession,
    Connection,
    ConnectionLost,
    RemoteError,
    SshTarget,
)
from dynspec_patch.transforms.native_adaptive import CONFIG_FILE_NAME

PENDING_NAME = "restart-pending.json"
# a server taken out of an sglang-router and not yet put back (patcher.router writes it first)
ROTATION_NAME = "router-rotation.json"
ORIGINALS_DIR = "originals"  # <state>/originals/<path>: the files as they were before apply
FIELD = "speculative_disable_batch_threshold"
ADAPTIVE_BARE = "--speculative-adaptive"
ADAPTIVE_CONFIG = "--speculative-adaptive-config"


# called just before the server is stopped, with the facts the command read
BeforeRestart = Callable[["Session", ServerProcess, HostFacts], None]


@dataclass(frozen=True)
class Faults:
    """Test hooks: drop the connection after a step, or make the agent die mid-commit."""

    # facts | stage-sent | staged | commit-sent | committed | restart-sent
    drop_connection_after: str | None = None
    agent: str | None = None  # die-mid-commit


@dataclass
class Session:
    conn: Connection
    agent: AgentSession
    faults: Faults
    docker: DockerOptions = field(default_factory=DockerOptions)

    def step(self, name: str) -> None:
        if self.faults.drop_connection_after == name:
            self.conn.abort()


@contextmanager
def session(target: SshTarget, *, accept_new_host_key: bool, faults: Faults | None = None,
            on_progress: Callable[[str], None] | None = None,
            docker: DockerOptions | None = None) -> Iterator[Session]:
    conn = Connection(target, accept_new_host_key=accept_new_host_key)
    try:
        conn.open()
        agent = conn.agent(on_progress=on_progress)
        yield Session(conn, agent, faults or Faults(), docker or DockerOptions())
    finally:
        conn.close()


# --------------------------------------------------------------------------- pure helpers


def edit_argv(argv: Sequence[str], *, remove_valued: Sequence[str] = (),
              remove_bare: Sequence[str] = (), add: Sequence[str] = ()) -> list[str]:
    """Drop every ``--flag value`` / ``--flag=value`` in ``remove_valued`` and every bare flag
    in ``remove_bare``, then append ``add``. argv[0] and the module stay untouched."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if i > 0 and name in remove_valued:
            skip = "=" not in arg
            continue
        if i > 0 and arg in remove_bare:
            continue
        out.append(arg)
    return out + list(add)


def desired_argv(argv: Sequence[str], plan: Plan) -> list[str]:
    if plan.route == "native":
        return edit_argv(argv, remove_valued=(ADAPTIVE_CONFIG,), remove_bare=(ADAPTIVE_BARE,),
                         add=plan.server_flags)
    if not plan.server_flags:
        return list(argv)  # no --threshold: keep whatever the command line says
    return edit_argv(argv, remove_valued=(THRESHOLD_FLAG,), add=plan.server_flags)


def expectations(plan: Plan, threshold: Threshold | None, config_path: str) -> dict[str, Any]:
    """What /server_info must report once the patched server runs."""
    if plan.route == "native":
        return {"speculative_adaptive": True, "speculative_adaptive_config": config_path}
    return {FIELD: threshold if threshold is not None else "<present>"}


def proof_holds(info: Mapping[str, Any] | None, expect: Mapping[str, Any]) -> bool:
    if info is None:
        return False
    for key, value in expect.items():
        if value == "<present>" and key not in info:
            return False
        if value == "<absent>" and key in info:
            return False
        if value not in ("<present>", "<absent>") and info.get(key) != value:
            return False
    return True


def _recorded(facts: HostFacts) -> dict[str, FileRecord]:
    """What the host's manifest recorded of each file (empty without one)."""
    return facts.manifest.by_path() if facts.manifest else {}


def host_state(facts: HostFacts, plan: Plan) -> str:
    """original | patched | mixed | unknown — the same judgement as a local ``status``."""
    return tree_state(plan, facts.manifest, facts.snapshot).state


def rotation_journal(facts: HostFacts) -> dict[str, Any] | None:
    """The router rotation an earlier run started on this host and did not finish (its
    worker is out of the router), as ``patcher.router`` recorded it; None if there is none."""
    raw = facts.state_files.get(ROTATION_NAME)
    if raw is None:
        return None
    try:
        journal = json.loads(raw.decode())
    except ValueError:
        return None
    return journal if isinstance(journal, dict) and journal.get("worker") else None


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _pending_mark(reason: str, argv: Sequence[str] | None) -> dict[str, Any]:
    import time

    return {"reason": reason, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "argv": list(argv) if argv is not None else None}


# --------------------------------------------------------------------------- facts → result


def why_no_server(facts: HostFacts) -> str | None:
    """Where the host's server went, when none runs: another run is restarting it, a restart
    was cut short, or its container is stopped (None: no trace of one)."""
    if facts.servers:
        return None
    for mark in facts.restarts:
        if mark.get("in_progress"):
            return (f"no SGLang server runs on the host right now: another dynspec-patch run "
                    f"(agent pid {mark.get('agent_pid')}, user {mark.get('user')}, since "
                    f"{mark.get('since')}) is restarting the one on port {mark.get('port')}; "
                    "wait until it is done (status shows when), then run this again")
    for c in facts.stopped_containers:
        name = c.get("name") or str(c.get("id", ""))[:12]
        if c.get("busy"):
            return (f"no SGLang server runs on the host right now: its container {name} is "
                    f"{c.get('status')} while another dynspec-patch run works on it "
                    f"({c.get('busy')}); wait until it is done, then run this again")
    for c in facts.stopped_containers:
        name = c.get("name") or str(c.get("id", ""))[:12]
        return (f"no SGLang server runs on the host: its container {name} (image "
                f"{c.get('image')}) is {c.get('status')} (exit code {c.get('exit_code')}, "
                f"since {c.get('finished_at')}); start it (docker start {name}) and run this "
                "again: a stopped container's files are patched through the container")
    for mark in facts.restarts:
        return (f"no SGLang server runs on the host: a dynspec-patch restart stopped the one "
                f"on port {mark.get('port')} at {mark.get('since')} and did not finish (its "
                f"agent was killed); status shows what its files hold, the server's output "
                f"is in {mark.get('log')}: start it again, then run this again")
    return None


def choose_server(facts: HostFacts, *, required: bool,
                  writing: bool = True) -> ServerProcess | None:
    """The server to act on; ``None`` only when none runs and none is ``required``.
    When ``writing`` and none runs, a known reason (``why_no_server``) is a refusal: the
    python3 on PATH is not the server's."""
    if facts.selected is not None:
        return facts.selected
    if len(facts.servers) > 1:
        listing = ", ".join(f"pid {s.pid} (port {s.port})" for s in facts.servers)
        raise UsageError(f"several SGLang servers run on the host: {listing}; "
                         "choose one with --pid or --port")
    if facts.servers:  # one server, but --pid/--port matched nothing
        raise UsageError(f"no SGLang server matches --pid/--port (running: pid "
                         f"{facts.servers[0].pid}, port {facts.servers[0].port})")
    why = why_no_server(facts)
    if writing and why is not None:
        raise RefusedError(f"{why}; nothing was written")
    if required:
        raise RefusedError("no running SGLang server found on the host (python -m "
                           "sglang.launch_server / sglang serve); use --no-restart to patch the "
                           "files of the python3 on PATH only")
    return None


def _require_package(facts: HostFacts) -> str:
    if facts.package_dir is None:
        why = "; ".join(facts.errors) or "not found"
        raise RefusedError(f"cannot locate the sglang package on the host: {why}")
    return facts.package_dir


def describe(facts: HostFacts, conn: Connection) -> dict[str, Any]:
    eff = facts.effective.values if facts.effective else {}
    return {
        "host": conn.target.alias,
        "login": f"{conn.target.user}@{conn.target.hostname}:{conn.target.port}",
        "remote_user": facts.hello.get("user"),
        "sudo": bool(facts.hello.get("sudo_user")),
        "package_dir": facts.package_dir,
        "package_found_with": "the server's python" if not facts.package_from_fallback
        else "python3 on PATH (no server selected)",
        "state_dir": facts.state_dir,
        "release": facts.release,
        "servers": [s.to_json() for s in facts.servers],
        "server_pid": facts.selected.pid if facts.selected else None,
        "live_worker": facts.live.worker,
        "live_worker_evidence": list(facts.live.evidence),
        "live_worker_source": facts.live.source,
        "disable_overlap_schedule": eff.get("disable_overlap_schedule"),
        "speculative_algorithm": eff.get("speculative_algorithm"),
        "speculative_eagle_topk": eff.get("speculative_eagle_topk"),
        "running_threshold": eff.get(FIELD, "absent (unpatched server_args)")
        if facts.effective else None,
        "restart_pending": facts.pending,
        "router_rotation": rotation_journal(facts),
        "no_server_because": why_no_server(facts),
        "container": facts.selected.container if facts.selected else None,
        "recovered_interrupted_commit": facts.recovered,
        "interrupted_commit": facts.interrupted,
        "run_in_progress": facts.busy,
    }


def recommendation(facts: HostFacts, plan: Plan, state: str) -> str:
    if plan.route == "unsupported":
        return "none: this release cannot be patched (" + plan.reason + ")"
    if facts.busy:
        return f"another dynspec-patch run is in progress ({facts.busy}); wait for it"
    if (why := why_no_server(facts)) is not None:
        return why.split(": ", 1)[1]
    if facts.interrupted:
        return "a commit was interrupted: run apply or revert to finish it (both recover first)"
    if plan.route == "native":
        return ("dynspec-patch apply --host H --route native --threshold N "
                "(native --speculative-adaptive config)")
    if state in ("unknown", "mixed"):
        return "inspect the files marked unknown; dynspec-patch refuses to guess"
    if state == "patched" and facts.pending:
        return "restart pending: dynspec-patch apply --host H (restarts) or restart it yourself"
    if state == "patched":
        return "patched; nothing to do"
    worker = facts.live.worker
    if worker in ("v1", "v2"):
        return f"dynspec-patch apply --host H --threshold N (patches the live {worker} worker)"
    return "dynspec-patch apply --host H --threshold N --worker both (no live EAGLE worker seen)"


def _without_package(facts: HostFacts) -> str:
    """What to do when no sglang package was found (no server, none on PATH's python3)."""
    why = why_no_server(facts)
    return why.split(": ", 1)[1] if why else "sglang not found on the host"


# --------------------------------------------------------------------------- commands


def _status_plan(facts: HostFacts) -> Plan:
    """``plan_status`` of the host's tree; native counts as applied where our config is."""
    native = facts.state_files.get(CONFIG_FILE_NAME) is not None
    return plan_status(facts.snapshot, _recorded(facts), native_applied=native)


def detect_path(s: Session, *, pid: int | None, port: int | None) -> dict[str, Any]:
    facts = gather(s.agent, pid=pid, port=port, lock=False,
                   state_files=[CONFIG_FILE_NAME, ROTATION_NAME], docker=s.docker.to_args())
    choose_server(facts, required=False, writing=False)
    if facts.package_dir is None:
        return {**describe(facts, s.conn), "errors": list(facts.errors),
                "recommended": _without_package(facts)}
    plan = _status_plan(facts)
    state = host_state(facts, plan)
    return {**describe(facts, s.conn), "host_state": state,
            "recommended": recommendation(facts, plan, state), "plan": plan}


def status(s: Session) -> dict[str, Any]:
    facts = gather(s.agent, pid=None, port=None, lock=False,
                   state_files=[CONFIG_FILE_NAME, ROTATION_NAME], docker=s.docker.to_args())
    if facts.package_dir is None:
        return {**describe(facts, s.conn), "host_state": "no sglang package found",
                "errors": list(facts.errors), "recommended": _without_package(facts)}
    plan = _status_plan(facts)
    judged = tree_state(plan, facts.manifest, facts.snapshot)
    state = judged.state
    info = facts.selected.info if facts.selected else None
    running = None
    if info is not None:
        running = "patched code" if FIELD in info or info.get("speculative_adaptive") else \
            "original code"
    manifest = facts.manifest
    server = facts.selected
    return {
        **describe(facts, s.conn),
        "host_state": state,
        "problems": list(judged.problems),
        "server_runs": running,
        "durability": container.durability(
            server.container, facts.package_dir,
            [r.path for r in manifest.files] if manifest and state != "original" else [])
        if server is not None and server.container is not None else None,
        "manifest": None if manifest is None else {
            "tool_version": manifest.tool_version, "created": manifest.created,
            "user": manifest.user, "sglang_version": manifest.sglang_version,
            "files": [r.path for r in manifest.files]},
        "recommended": recommendation(facts, plan, state),
        "plan": plan,
    }


def precheck_writes(facts: HostFacts, server: ServerProcess | None, *, restart: bool,
                    restart_cmd: str | None) -> None:
    """Refuse before anything is written when we could not finish the job."""
    if not facts.hello.get("euid") == 0 and not facts.writable:
        raise RefusedError(
            f"{facts.package_dir} is not writable by {facts.hello.get('user')} and sudo -n is "
            "not available: nothing was written")
    if restart and server is not None and not restart_cmd and (
            server.env is None or server.cwd is None):
        raise RefusedError(
            f"cannot read the environment/cwd of pid {server.pid} ({server.env_error}); "
            "restarting it without them would change how it runs: use sudo, --restart-cmd, "
            "or --no-restart (nothing was written)")


def _stage_and_commit(s: Session, facts: HostFacts, base_dir: str, changes: Sequence[FileChange],
                      *, manifest: Manifest | None, keep_manifest: bool, action: str,
                      argv: Sequence[str] | None) -> None:
    files = [{"path": c.path, "before_sha": sha256_or_none(c.before),
              "after_sha": sha256_or_none(c.after), "after": _b64(c.after)} for c in changes]
    s.agent.send("stage", {"package_dir": base_dir, "python": facts.python, "files": files})
    s.step("stage-sent")
    staged = s.agent.receive()["staged"]
    s.step("staged")
    args: dict[str, Any] = {
        "package_dir": base_dir, "state_dir": facts.state_dir, "files": staged,
        "backup": action == "apply", "action": action, "fault": s.faults.agent,
        "pending": _pending_mark(f"{action}: files changed, server not restarted yet", argv),
    }
    if not keep_manifest:
        args["manifest"] = _b64(manifest.to_bytes()) if manifest else None
        args["clear_backup"] = manifest is None
    s.agent.send("commit", args)
    s.step("commit-sent")
    s.agent.receive()
    s.step("committed")


def _short(text: object, limit: int = 160) -> str:
    """The first line of a failure, cut at ``limit``: the whole log stays in a file."""
    line = str(text).split(" | ")[0].splitlines()[0] if text else "no reason given"
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _restart(s: Session, facts: HostFacts, server: ServerProcess, argv: Sequence[str], *,
             restart_cmd: str | None, health_timeout: float, expect: Mapping[str, Any],
             base_dir: str, stop_timeout: float) -> dict[str, Any]:
    if not restart_cmd and (server.env is None or server.cwd is None):
        raise RefusedError(
            f"cannot read the environment/cwd of pid {server.pid} ({server.env_error}); "
            "restarting it without them would change how it runs: use sudo, --restart-cmd, "
            "or --no-restart")
    args = {"state_dir": facts.state_dir, "package_dir": base_dir, "server": dict(server.raw),
            "argv": list(argv), "restart_cmd": restart_cmd, "health_timeout": health_timeout,
            "expect": dict(expect), "undo": True, "stop_timeout": stop_timeout}
    s.agent.send("restart", args)
    s.step("restart-sent")
    answer = s.agent.receive(timeout=health_timeout * 2 + 900)
    if not answer.get("ok_restart"):
        healthy = answer.get("original_healthy")
        tail = (f"original files restored ({', '.join(answer.get('restored') or []) or 'none'})"
                f" and the original command relaunched: "
                + (f"healthy again, pid {answer.get('pid')}" if healthy
                   else "NOT healthy: " + str(answer.get("rollback_error"))))
        raise RollbackError(f"restart failed: {_short(answer.get('reason'))}; {tail}; "
                            f"the server's output is in {answer.get('log')} on the host")
    verified = None
    try:
        path = (answer.get("proof") or {}).get("endpoint") or "/server_info"
        resp = s.conn.http_get(server.port, path, host=server.address)
        verified = resp.status == 200 and proof_holds(resp.json(), expect)
    except (RemoteError, ConnectionLost, ValueError):
        verified = None
    return {"restarted": True, "pid": answer.get("pid"), "log": answer.get("log"),
            "proof": answer.get("proof"), "gpu_memory": answer.get("gpu"),
            "verified_through_ssh_tunnel": verified}


def restart_reasons(facts: HostFacts, server: ServerProcess | None, argv: list[str] | None,
                    expect: Mapping[str, Any], *, changed: bool, stale: str,
                    restart_cmd: str | None) -> list[str]:
    """Why the server must restart (empty: it need not)."""
    reasons = []
    if changed:
        reasons.append("files changed")
    if facts.pending:
        reasons.append("a restart was pending")
    if server is not None and not proof_holds(server.info, expect):
        reasons.append(stale)
    if server is not None and argv != list(server.argv) and not restart_cmd:
        reasons.append("the launch flags change")
    return reasons


def _preview(result: dict[str, Any], plan: Plan, facts: HostFacts,
             server: ServerProcess | None, argv: list[str] | None, expect: Mapping[str, Any],
             *, stale: str, no_restart: bool, restart_cmd: str | None) -> dict[str, Any]:
    """A dry run's (or a refused plan's) answer: the command a real run would start and, unless
    refused, what it would do about the restart."""
    if argv is not None:
        result["would_run"] = redact_argv(argv)
    if not plan.refused:
        result["restart"] = _restart_preview(
            facts, server, argv, expect, changed=bool(plan.changes), stale=stale,
            no_restart=no_restart, restart_cmd=restart_cmd)
    return result


def _restart_preview(facts: HostFacts, server: ServerProcess | None, argv: list[str] | None,
                     expect: Mapping[str, Any], *, changed: bool, stale: str,
                     no_restart: bool, restart_cmd: str | None) -> str:
    """What a real run would do about the restart (for a dry run)."""
    reasons = restart_reasons(facts, server, argv, expect, changed=changed, stale=stale,
                              restart_cmd=restart_cmd)
    if not reasons:
        return "not needed"
    if no_restart or server is None:
        return "would leave a restart pending: " + "; ".join(reasons)
    return "would restart: " + "; ".join(reasons)


def _restart_if_needed(s: Session, facts: HostFacts, server: ServerProcess | None,
                       argv: list[str] | None, expect: Mapping[str, Any], *, changed: bool,
                       stale: str, not_needed: str, no_restart: bool, restart_cmd: str | None,
                       health_timeout: float, base_dir: str | None, stop_timeout: float,
                       before_restart: BeforeRestart | None = None) -> dict[str, Any] | str:
    """Restart when files changed, a restart was pending, or the server does not prove
    ``expect`` (``stale``); with ``--no-restart`` (or no server) leave a pending mark.
    ``before_restart`` runs just before the server is stopped (e.g. take it out of a router)."""
    reasons = restart_reasons(facts, server, argv, expect, changed=changed, stale=stale,
                              restart_cmd=restart_cmd)
    if not reasons:
        return "not needed: " + not_needed
    if no_restart or server is None:
        if not changed and not facts.pending:
            s.agent.request("write_file", {"state_dir": facts.state_dir, "name": PENDING_NAME,
                                           "data": _b64(json.dumps(_pending_mark(
                                               "; ".join(reasons), argv)).encode())})
        return "pending (--no-restart): " + "; ".join(reasons)
    assert argv is not None
    if before_restart is not None:
        before_restart(s, server, facts)
    done = _restart(s, facts, server, argv, restart_cmd=restart_cmd,
                    health_timeout=health_timeout, expect=expect, base_dir=base_dir,
                    stop_timeout=stop_timeout)
    done["why"] = "; ".join(reasons)
    return done


def _read_host(s: Session, pid: int | None, port: int | None, dry_run: bool,
               no_restart: bool, originals: bool = False,
               ) -> tuple[HostFacts, ServerProcess | None, str, str]:
    """Facts (locked unless a dry run), the server to act on, the package and config path;
    with ``originals`` the copies saved at apply come along (as ``originals/<path>``)."""
    state_files = [CONFIG_FILE_NAME, ROTATION_NAME]
    if originals:
        state_files += [posixpath.join(ORIGINALS_DIR, path) for path in SNAPSHOT_PATHS]
    facts = gather(s.agent, pid=pid, port=port, lock=not dry_run, state_files=state_files,
                   docker=s.docker.to_args())
    s.step("facts")
    server = choose_server(facts, required=not (dry_run or no_restart))
    package = _require_package(facts)
    assert facts.state_dir is not None
    return facts, server, package, posixpath.join(facts.state_dir, CONFIG_FILE_NAME)


def apply(s: Session, *, threshold: Threshold | None, worker: str, dry_run: bool, no_restart: bool,
          restart_cmd: str | None, pid: int | None, port: int | None,
          health_timeout: float, stop_timeout: float = 60.0,
          commit_image: str | None = None,
          before_restart: BeforeRestart | None = None,
          route: str | None = None) -> dict[str, Any]:
    if commit_image is not None:
        container.check_tag(commit_image)
    facts, server, package, config_path = _read_host(s, pid, port, dry_run, no_restart)
    if commit_image is not None and (server is None or server.container is None):
        raise UsageError("--commit-image needs a server that runs in a Docker container")
    eff = facts.effective.values if facts.effective else {}
    live = facts.live.worker if facts.live.worker in ("v1", "v2") else None
    bs = eff.get("cuda_graph_bs")
    plan = plan_cache.plan_apply(  # a fleet of one release is planned once per controller
        facts.snapshot, worker=worker, live_worker=live, threshold=threshold,
        num_steps=eff.get("speculative_num_steps"),
        cuda_graph_bs=bs if isinstance(bs, list) else None,
        native_config_path=config_path,
        recorded=_recorded(facts),
        server_args=eff, server_argv=server.argv if server else (), route=route,
    )
    result: dict[str, Any] = {**describe(facts, s.conn), "dry_run": dry_run}
    native_change: FileChange | None = None
    if plan.route == "native" and plan.native is not None and not plan.refused:
        new = (json.dumps(plan.native.config, indent=2) + "\n").encode()
        old = facts.state_files.get(CONFIG_FILE_NAME)
        if old != new:
            native_change = FileChange(CONFIG_FILE_NAME, old, new,
                                       "absent" if old is None else "other", "written",
                                       "added" if old is None else "patched",
                                       f"adaptive config in {facts.state_dir}")
            plan = Plan(plan.operation, plan.sglang_version, plan.route, plan.reason,
                        (*plan.files, native_change), plan.native, plan.server_flags)
    result["plan"] = plan
    wanted = argv = desired_argv(server.argv, plan) if server else None
    expect = expectations(plan, threshold, config_path)
    stale = "the running server does not report " + json.dumps(expect)
    if plan.refused or dry_run:
        return _preview(result, plan, facts, server, argv, expect, stale=stale,
                        no_restart=no_restart, restart_cmd=restart_cmd)
    if server is not None and server.container is not None and argv is not None:
        argv = container.restart_argv(server.container, server.argv, argv,
                                      restart_cmd=restart_cmd, no_restart=no_restart,
                                      commit_image=commit_image)
    precheck_writes(facts, server, restart=not no_restart, restart_cmd=restart_cmd)
    changed = False
    if native_change is not None:
        assert facts.state_dir is not None
        _stage_and_commit(s, facts, facts.state_dir, [native_change], manifest=None,
                          keep_manifest=True, action="apply-native", argv=argv)
        changed = True
    elif plan.changes:
        manifest = next_manifest(facts.manifest, plan)
        _stage_and_commit(s, facts, package, plan.changes, manifest=manifest,
                          keep_manifest=False, action="apply", argv=argv)
        changed = True
    result["files_changed"] = [c.path for c in plan.changes]
    if argv != wanted:  # a container keeps its command: prove the patched code, not the flags
        expect = {} if plan.route == "native" else expectations(plan, None, config_path)
        stale = "the running server does not report " + json.dumps(expect)
    result["restart"] = _restart_if_needed(
        s, facts, server, argv, expect, changed=changed, stale=stale,
        not_needed="files already patched and the server reports " + json.dumps(expect),
        no_restart=no_restart, restart_cmd=restart_cmd, health_timeout=health_timeout,
        base_dir=facts.state_dir if plan.route == "native" else package,
        stop_timeout=stop_timeout, before_restart=before_restart)
    if commit_image is not None and server is not None and wanted is not None:
        result["image"] = _commit_image(s, server, commit_image, wanted)
    return result


def _commit_image(s: Session, server: ServerProcess, tag: str,
                  wanted: Sequence[str]) -> dict[str, Any]:
    """``docker commit`` the patched container as ``tag``, with the wanted server command."""
    assert server.container is not None
    changes, how = container.image_changes(server.container, server.argv, wanted)
    done = s.agent.request("commit_image", {
        "container": server.container["id"], "tag": tag, "changes": changes,
        "message": "dynspec-patch: " + " ".join(redact_argv(wanted))})
    return {**done, "command": how, "changes": changes,
            "recreate_with": container.run_hint(server.container, tag)}


def revert(s: Session, *, dry_run: bool, force: bool, no_restart: bool,
           restart_cmd: str | None, pid: int | None, port: int | None,
           health_timeout: float, stop_timeout: float = 60.0,
           before_restart: BeforeRestart | None = None,
           restore_originals: bool = False) -> dict[str, Any]:
    facts, server, package, config_path = _read_host(s, pid, port, dry_run, no_restart,
                                                     originals=restore_originals)
    route = _status_plan(facts).route
    if route == "native":
        old = facts.state_files.get(CONFIG_FILE_NAME)
        files: tuple[FileChange, ...] = ()
        if old is not None:
            files = (FileChange(CONFIG_FILE_NAME, old, None, "written", "absent", "removed",
                                f"adaptive config in {facts.state_dir}"),)
        plan = Plan("revert", facts.release, "native",
                    "remove the adaptive config and its launch flags", files)
        argv = None
        if server is not None:
            argv = list(server.argv)
            if any(a == config_path or a == f"{ADAPTIVE_CONFIG}={config_path}" for a in argv):
                argv = edit_argv(argv, remove_valued=(ADAPTIVE_CONFIG,),
                                 remove_bare=(ADAPTIVE_BARE,))
        expect: dict[str, Any] = {"speculative_adaptive_config": None} if argv != (
            list(server.argv) if server else None) else {}
    else:
        saved = {path: data for path in SNAPSHOT_PATHS
                 if (data := facts.state_files.get(posixpath.join(ORIGINALS_DIR, path)))
                 is not None}
        plan = plan_revert(facts.snapshot,
                           recorded=_recorded(facts),
                           force=force, originals=saved if restore_originals else None)
        argv = edit_argv(server.argv, remove_valued=(THRESHOLD_FLAG,)) if server else None
        expect = {FIELD: "<absent>"}
    if server is not None and server.container is not None and argv is not None:
        argv = container.restart_argv(server.container, server.argv, argv,
                                      restart_cmd=restart_cmd, no_restart=no_restart,
                                      commit_image=None)
    result: dict[str, Any] = {**describe(facts, s.conn), "dry_run": dry_run, "plan": plan}
    stale = "the running server still runs the patch"
    if plan.refused or dry_run:
        return _preview(result, plan, facts, server, argv, expect, stale=stale,
                        no_restart=no_restart, restart_cmd=restart_cmd)
    precheck_writes(facts, server, restart=not no_restart, restart_cmd=restart_cmd)
    changed = bool(plan.changes)
    if changed:
        base = facts.state_dir if route == "native" else package
        manifest = None if route == "native" else next_manifest(facts.manifest, plan)
        _stage_and_commit(s, facts, base, plan.changes, manifest=manifest,
                          keep_manifest=route == "native", action="revert", argv=argv)
    result["files_changed"] = [c.path for c in plan.changes]
    result["restart"] = _restart_if_needed(
        s, facts, server, argv, expect, changed=changed, stale=stale,
        not_needed="nothing was patched",
        no_restart=no_restart, restart_cmd=restart_cmd, health_timeout=health_timeout,
        base_dir=facts.state_dir if route == "native" else package,
        stop_timeout=stop_timeout, before_restart=before_restart)
    return result


__all__ = ["DynspecError", "Faults", "Session", "apply", "detect_path", "edit_argv",
           "has_flag", "revert", "session", "status"]
