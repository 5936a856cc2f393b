"""Read-only facts about a host: the running SGLang server, its package, its effective args.

Gathering is one request to the remote agent (``patcher.remote_agent.op_facts``): it lists the
server processes (pid, argv, environment, cwd, ``/proc/PID/exe``, ports), asks the server
itself for ``/server_info`` then ``/get_server_info`` on the host, finds the sglang package
with the server's own python (``importlib.util.find_spec``, which does not import it), and
reads every file planning needs. Everything else here is a pure function of that answer:
which source wins for the effective server args, and which speculative worker is live.

Precedence of evidence: the server's reported args (post-processed by SGLang itself) >
the ``server_args=`` start-up log line > the command line and environment re-evaluated with
each release's own rule (``sglang-releases.md``, Addendum).
"""

from __future__ import annotations

import ast
import base64
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynspec_patch.patcher.engine import SNAPSHOT_PATHS, release_version
from dynspec_patch.patcher.errors import DynspecError
from dynspec_patch.patcher.manifest import Manifest

EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
REDACT_FLAGS = ("--api-key", "--admin-api-key", "--hf-token")


# --------------------------------------------------------------------------- versions


def version_key(version: str | None) -> tuple[int, ...]:
    """``0.5.3.post1`` -> (0, 5, 3, 1, 0); rc/dev sort before the final release."""
    if not version:
        return (0,)
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?(?:\.?post(\d+))?(?:\.?(rc|dev)(\d+))?", version)
    if not m:
        return (0,)
    major, minor, patch, post, pre, pre_n = m.groups()
    return (int(major), int(minor), int(patch or 0), int(post or 0),
            -1 if pre else 0, int(pre_n or 0))


def at_least(version: str | None, floor: str) -> bool:
    return version_key(version) >= version_key(floor)


def at_most(version: str | None, ceiling: str) -> bool:
    return version_key(version) <= version_key(ceiling)


# --------------------------------------------------------------------------- parsers


_LOG_VALUE = r"('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|True|False|None|-?\d+(?:\.\d+)?|\[[^\]]*\])"


def parse_server_args_line(line: str) -> dict[str, Any]:
    """The ``server_args=ServerArgs(k=v, ...)`` (≤0.5.18) or ``server_args={...}`` line."""
    text = line[line.find("server_args=") + len("server_args="):].strip()
    if text.startswith("{"):
        try:
            value = ast.literal_eval(text)
            if isinstance(value, dict):
                return value
        except (ValueError, SyntaxError):
            pass
        pattern = re.compile(r"'(\w+)':\s*" + _LOG_VALUE)
    else:
        pattern = re.compile(r"\b(\w+)=" + _LOG_VALUE)
    out: dict[str, Any] = {}
    for key, raw in pattern.findall(text):
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def env_bool(env: Mapping[str, str] | None, name: str, default: bool) -> bool:
    """SGLang's ``EnvBool``: true/1/yes/y, false/0/no/n, anything else is the default."""
    value = (env or {}).get(name, "").strip().lower()
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    return default


def flag(argv: Sequence[str], name: str) -> str | None:
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def has_flag(argv: Sequence[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in argv)


def effective_from_argv(
    version: str | None, argv: Sequence[str], env: Mapping[str, str] | None
) -> tuple[dict[str, Any], list[str]]:
    """Re-derive ``disable_overlap_schedule`` from the command line and environment with the
    release's own post-init rule. Only used when the server cannot tell us itself."""
    algo = flag(argv, "--speculative-algorithm")
    if algo == "NEXTN":
        algo = "EAGLE"
    flag_on = has_flag(argv, "--disable-overlap-schedule")
    topk_s = flag(argv, "--speculative-eagle-topk")
    topk = int(topk_s) if topk_s and topk_s.isdigit() else None
    evidence = [f"--disable-overlap-schedule {'given' if flag_on else 'not given'}"]
    value = flag_on
    if env is None:
        evidence.append("environment unreadable: SGLANG_ENABLE_SPEC_V2 assumed unset")
    spec_v2_raw = (env or {}).get("SGLANG_ENABLE_SPEC_V2")
    if algo in ("EAGLE", "EAGLE3", "STANDALONE"):
        if at_most(version, "0.5.3.post1"):
            value, rule = True, "≤0.5.3.post1 always disables overlap for EAGLE"
        elif at_most(version, "0.5.4"):
            beta = has_flag(argv, "--enable-beta-spec")
            value = False if (algo == "EAGLE" and beta) else (flag_on if beta else True)
            rule = f"0.5.3.post2–0.5.4: --enable-beta-spec {'given' if beta else 'not given'}"
        elif at_most(version, "0.5.6.post2"):
            v2 = env_bool(env, "SGLANG_ENABLE_SPEC_V2", False)
            value = False if (algo == "EAGLE" and v2) else (flag_on if v2 else True)
            rule = f"0.5.4.post1–0.5.6.post2: SGLANG_ENABLE_SPEC_V2={spec_v2_raw!r} (default off)"
        elif at_most(version, "0.5.10.post1"):
            v2 = env_bool(env, "SGLANG_ENABLE_SPEC_V2", False)
            value = not v2
            rule = f"0.5.7–0.5.10.post1: SGLANG_ENABLE_SPEC_V2={spec_v2_raw!r} (default off)"
        elif at_most(version, "0.5.12.post1"):
            v2 = env_bool(env, "SGLANG_ENABLE_SPEC_V2", True)
            value = flag_on or bool(topk and topk > 1) or not v2
            rule = (f"0.5.11–0.5.12.post1: SGLANG_ENABLE_SPEC_V2={spec_v2_raw!r} (default on), "
                    f"topk={topk}")
        elif at_most(version, "0.5.13.post1"):
            value = flag_on or not env_bool(env, "SGLANG_ENABLE_SPEC_V2", True)
            rule = f"0.5.13: SGLANG_ENABLE_SPEC_V2={spec_v2_raw!r} (default on)"
        else:
            rule = "0.5.14+: only --disable-overlap-schedule"
        evidence.append(rule)
    values: dict[str, Any] = {
        "speculative_algorithm": algo,
        "disable_overlap_schedule": value,
        "speculative_eagle_topk": topk,
        "enable_multi_layer_eagle": has_flag(argv, "--enable-multi-layer-eagle"),
    }
    steps = flag(argv, "--speculative-num-steps")
    if steps and steps.isdigit():
        values["speculative_num_steps"] = int(steps)
    threshold = flag(argv, "--speculative-disable-batch-threshold")
    if threshold is not None:  # an integer, or a word ("auto") shown as written
        values["speculative_disable_batch_threshold"] = (
            int(threshold) if threshold.isdigit() else threshold)
    return values, evidence


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv for printing: the values of --api-key and friends become ``***``."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append("***")
            hide = False
            continue
        name = arg.split("=", 1)[0]
        if name in REDACT_FLAGS:
            out.append(f"{name}=***" if "=" in arg else arg)
            hide = "=" not in arg
            continue
        out.append(arg)
    return out


# --------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class EffectiveArgs:
    values: Mapping[str, Any]
    source: str  # "/server_info" | "/get_server_info" | "log:<path>" | "argv+env"
    evidence: tuple[str, ...] = ()


@dataclass(frozen=True)
class LiveWorker:
    worker: str  # v1 | v2 | none
    evidence: tuple[str, ...]
    source: str


def decide_live_worker(version: str | None, effective: EffectiveArgs | None) -> LiveWorker:
    """Which EAGLE worker class the running server uses (``sglang-releases.md`` §2 rule)."""
    if effective is None:
        return LiveWorker("none", ("no running server was read",), "none")
    values = effective.values
    src = effective.source
    algo = values.get("speculative_algorithm")
    if algo == "NEXTN":
        algo = "EAGLE"
    dos = values.get("disable_overlap_schedule")
    ev = [f"sglang {version}", f"speculative_algorithm={algo!r}",
          f"disable_overlap_schedule={dos!r} ({src})", *effective.evidence]
    if algo not in ("EAGLE", "EAGLE3", "STANDALONE"):
        return LiveWorker("none", (*ev, "no EAGLE-family speculative decoding"), src)
    if version is None:
        return LiveWorker("none", (*ev, "release unknown"), src)
    if not at_least(version, "0.4.1.post4"):
        return LiveWorker("none", (*ev, "EAGLE arrived in 0.4.1.post4"), src)
    if at_least(version, "0.5.13"):
        return LiveWorker("v2", (*ev, "0.5.13+: EAGLEWorkerV2 always"), src)
    if at_most(version, "0.5.3.post1"):
        return LiveWorker("v1", (*ev, "≤0.5.3.post1: EAGLEWorker only"), src)
    if values.get("enable_multi_layer_eagle"):
        return LiveWorker("none", (*ev, "multi-layer EAGLE worker: not covered by the patch"), src)
    if algo == "STANDALONE" and at_most(version, "0.5.7"):
        return LiveWorker("v1", (*ev, "STANDALONE ≤0.5.7: StandaloneWorker (v1 subclass)"), src)
    if dos is None:
        return LiveWorker("none", (*ev, "disable_overlap_schedule unknown"), src)
    worker = "v1" if dos else "v2"
    return LiveWorker(worker, (*ev, f"0.5.3.post2–0.5.12.post1: EAGLEWorkerV2 iff overlap is on "
                                    f"-> {'EAGLEWorker' if dos else 'EAGLEWorkerV2'}"), src)


# --------------------------------------------------------------------------- the facts


@dataclass(frozen=True)
class ServerProcess:
    pid: int
    argv: tuple[str, ...]
    env: Mapping[str, str] | None
    env_error: str | None
    cwd: str | None
    exe: str | None
    uid: int | None
    user: str | None
    port: int
    host: str | None
    listening: tuple[int, ...]
    stdout: str | None
    raw: Mapping[str, Any]
    info: Mapping[str, Any] | None = None
    info_endpoint: str | None = None
    info_tried: tuple[Mapping[str, Any], ...] = ()
    log_line: str | None = None
    container: Mapping[str, Any] | None = None  # docker inspect summary; None on the bare host
    address: str = "127.0.0.1"  # where it is reached on the host (its --host; any -> loopback)

    @classmethod
    def from_agent(cls, raw: Mapping[str, Any]) -> ServerProcess:
        info = raw.get("server_info") or {}
        port = raw.get("port") or (raw.get("listening") or [30000])[0]
        return cls(
            pid=raw["pid"], argv=tuple(raw["argv"]), env=raw.get("env"),
            env_error=raw.get("env_error"), cwd=raw.get("cwd"), exe=raw.get("exe"),
            uid=raw.get("uid"), user=raw.get("user"), port=port, host=raw.get("host"),
            listening=tuple(raw.get("listening") or ()), stdout=raw.get("stdout"), raw=raw,
            info=info.get("body"), info_endpoint=info.get("endpoint"),
            info_tried=tuple(info.get("tried") or ()), log_line=raw.get("log_line"),
            container=raw.get("container"), address=raw.get("address") or "127.0.0.1",
        )

    def redacted_argv(self) -> list[str]:
        return redact_argv(self.argv)

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid, "argv": self.redacted_argv(), "cwd": self.cwd, "exe": self.exe,
            "user": self.user, "port": self.port, "listening": list(self.listening),
            "environment": "unreadable: " + self.env_error if self.env is None and self.env_error
            else {k: v for k, v in (self.env or {}).items() if k.startswith(("SGLANG_", "SGL_"))},
            "server_info_endpoint": self.info_endpoint,
            "container_id": self.raw.get("container_id"),
        }


@dataclass(frozen=True)
class HostFacts:
    hello: Mapping[str, Any]
    servers: tuple[ServerProcess, ...]
    selected: ServerProcess | None
    package_dir: str | None
    python: Mapping[str, Any] | None
    state_dir: str | None
    snapshot: Mapping[str, bytes | None]
    manifest: Manifest | None
    pending: Mapping[str, Any] | None
    state_files: Mapping[str, bytes | None]
    errors: tuple[str, ...]
    recovered: Mapping[str, Any] | None = None
    interrupted: bool = False
    package_from_fallback: bool = False
    writable: bool = False
    busy: str | None = None
    effective: EffectiveArgs | None = None
    live: LiveWorker = field(default_factory=lambda: LiveWorker("none", (), "none"))
    # read only when no server runs: restarts of this host's servers (their markers), and
    # Docker containers whose command is a server but that are stopped
    restarts: tuple[Mapping[str, Any], ...] = ()
    stopped_containers: tuple[Mapping[str, Any], ...] = ()

    @property
    def release(self) -> str | None:
        return release_version(self.snapshot)


def effective_args(server: ServerProcess, version: str | None) -> EffectiveArgs:
    if server.info is not None:
        return EffectiveArgs(server.info, server.info_endpoint or "server_info",
                             ("reported by the server itself (post-processed args)",))
    tried = "; ".join(f"{t.get('endpoint')}: {t.get('status')}" for t in server.info_tried)
    if server.log_line:
        return EffectiveArgs(parse_server_args_line(server.log_line), f"log:{server.stdout}",
                             (f"server info unavailable ({tried})",
                              "the server_args= start-up log line"))
    values, evidence = effective_from_argv(version, server.argv, server.env)
    return EffectiveArgs(values, "argv+env", (f"server info unavailable ({tried})",
                                              "no server_args= log line", *evidence))


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def from_agent(raw: Mapping[str, Any], hello: Mapping[str, Any]) -> HostFacts:
    """Turn the agent's ``facts`` answer into ``HostFacts`` (pure)."""
    servers = tuple(ServerProcess.from_agent(s) for s in raw.get("servers", ()))
    selected = next((s for s in servers if s.pid == raw.get("selected")), None)
    pkg = raw.get("package") or {}
    snapshot = {path: _unb64(data) for path, data in (raw.get("snapshot") or {}).items()}
    manifest = None
    if raw.get("manifest"):
        try:
            manifest = Manifest.from_bytes(_unb64(raw["manifest"]) or b"")
        except (ValueError, TypeError, KeyError) as exc:
            raise DynspecError(f"the manifest on the host is unreadable: {exc}") from exc
    version = release_version(snapshot) or (pkg.get("release"))
    effective = effective_args(selected, version) if selected else None
    return HostFacts(
        hello=hello, servers=servers, selected=selected,
        package_dir=pkg.get("package_dir"), python=pkg.get("python"),
        state_dir=raw.get("state_dir"), snapshot=snapshot, manifest=manifest,
        pending=raw.get("pending"),
        state_files={k: _unb64(v) for k, v in (raw.get("state_files") or {}).items()},
        errors=tuple(e for e in raw.get("errors", ()) if e),
        recovered=raw.get("recovered"), interrupted=bool(raw.get("interrupted")),
        package_from_fallback=bool(pkg.get("fallback_python")),
        writable=bool(raw.get("writable")),
        busy=raw.get("busy"),
        effective=effective, live=decide_live_worker(version, effective),
        restarts=tuple(raw.get("restarts") or ()),
        stopped_containers=tuple(raw.get("stopped_containers") or ()),
    )


def gather(agent: Any, *, pid: int | None, port: int | None, lock: bool,
           state_files: Sequence[str] = (), docker: Mapping[str, Any] | None = None) -> HostFacts:
    """One round trip: processes, server info, package, snapshot, manifest, restart mark
    (for a server in a container: the package inside it, see ``patcher.container``)."""
    raw = agent.request("facts", {"pid": pid, "port": port, "lock": lock,
                                  "paths": list(SNAPSHOT_PATHS), "state_files": list(state_files),
                                  **(docker or {})})
    return from_agent(raw, agent.hello)
