"""Plan each distinct set of files once per controller: a fleet runs one release everywhere.

``plan_apply`` here is ``patcher.engine.plan_apply`` memoised on disk, in
``<cache>/plans/`` (``$DYNSPEC_CACHE``, see ``patcher.releases``). The key is the sha256 of
the code that plans (``patcher/engine.py``, ``patcher/manifest.py`` and every module of
``transforms``), the parameters and the sha256 of every file of the snapshot, so a plan is
reused only for byte-identical inputs to byte-identical code. Native-route plans (SGLang
0.5.14+: no source is parsed, and the config path is per host) are not stored. Ansible runs
hosts in separate processes (forks): the first one to need a key holds its ``flock`` while it
plans, the others wait and read the result, so a fleet of N identical hosts parses the
sources once, not N times. Entries are JSON (no code is loaded from the cache); an
unreadable entry is planned
again.
"""

from __future__ import annotations

import base64
import fcntl
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from dynspec_patch import transforms
from dynspec_patch.patcher import engine, manifest
from dynspec_patch.patcher.engine import FileChange, Plan, Snapshot, Threshold
from dynspec_patch.patcher.manifest import FileRecord, sha256_or_none
from dynspec_patch.patcher.releases import cache_dir
from dynspec_patch.transforms.native_adaptive import CONFIG_FILE_NAME


@functools.cache
def _code_digest() -> str:
    """sha256 of the code that plans, as this process runs it: ``patcher/engine.py``,
    ``patcher/manifest.py`` and every module of ``transforms``, found from the imported modules
    themselves (never from module names spelled as strings). Files are named relative to the
    package, so two installs of the same code share their plans."""
    transforms_dir = Path(str(resources.files(transforms)))
    named = [("patcher/engine.py", Path(engine.__file__)),
             ("patcher/manifest.py", Path(manifest.__file__)),
             *((f"transforms/{path.relative_to(transforms_dir).as_posix()}", path)
               for path in sorted(transforms_dir.glob("**/*.py")))]
    digest = hashlib.sha256()
    for name, path in named:
        digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _key(params: Mapping[str, Any], snapshot: Snapshot,
         recorded: Mapping[str, FileRecord]) -> str:
    material = {
        "code": _code_digest(),
        "params": params,
        "snapshot": sorted((p, sha256_or_none(d)) for p, d in snapshot.items()),
        "recorded": sorted((r.path, r.sha256_before, r.sha256_after)
                           for r in recorded.values()),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _encode(plan: Plan) -> dict[str, Any]:
    return {
        "operation": plan.operation, "sglang_version": plan.sglang_version,
        "route": plan.route, "reason": plan.reason,
        "files": [{"path": f.path, "after": None if not f.changed else _b64(f.after),
                   "changed": f.changed, "state_before": f.state_before,
                   "state_after": f.state_after, "action": f.action, "reason": f.reason,
                   "original": None if f.original is None else _b64(f.original)}
                  for f in plan.files],
        "server_flags": list(plan.server_flags),
        "patchable_workers": list(plan.patchable_workers),
        "refusal": plan.refusal,
        "routes": list(plan.routes),
    }


def _decode(data: Mapping[str, Any], snapshot: Snapshot) -> Plan:
    files = []
    for f in data["files"]:
        before = snapshot.get(f["path"])
        after = (None if f["after"] is None else base64.b64decode(f["after"])) \
            if f["changed"] else before
        original = None if f["original"] is None else base64.b64decode(f["original"])
        files.append(FileChange(f["path"], before, after, f["state_before"], f["state_after"],
                                f["action"], f["reason"], original))
    return Plan(data["operation"], data["sglang_version"], data["route"], data["reason"],
                tuple(files), None, tuple(data["server_flags"]),
                tuple(data["patchable_workers"]), data["refusal"], tuple(data["routes"]))


def plan_apply(snapshot: Snapshot, *, worker: str = "auto", live_worker: str | None = None,
               threshold: Threshold | None = None, num_steps: int | None = None,
               cuda_graph_bs: Sequence[int] | None = None,
               native_config_path: str = CONFIG_FILE_NAME,
               recorded: Mapping[str, FileRecord] | None = None,
               server_args: Mapping[str, object] | None = None,
               server_argv: Sequence[str] = (), route: str | None = None) -> Plan:
    """``engine.plan_apply``, planned once per key on this machine (same arguments).

    Of ``server_args``/``server_argv`` a patch-route plan depends only on whether the server
    runs SGLang's own adaptive speculation (the key holds that); the rest decides native-route
    refusals, and native plans are never stored."""
    recorded = recorded or {}
    # native_config_path differs per host and only the native route (cheap, never stored)
    # uses it, like num_steps and cuda_graph_bs
    params = {"op": "apply", "worker": worker, "live_worker": live_worker,
              "threshold": threshold, "route": route,
              "sglang_adaptive": engine.runs_sglang_adaptive(server_args or {}, server_argv)}

    def plan() -> Plan:
        return engine.plan_apply(snapshot, worker=worker, live_worker=live_worker,
                                 threshold=threshold, num_steps=num_steps,
                                 cuda_graph_bs=cuda_graph_bs,
                                 native_config_path=native_config_path, recorded=recorded,
                                 server_args=server_args, server_argv=server_argv,
                                 route=route)

    directory = cache_dir() / "plans"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return plan()  # no cache dir: plan as usual
    key = _key(params, snapshot, recorded)
    entry = directory / f"{key}.json"
    with open(directory / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first fork plans, the others wait for it
        try:
            return _decode(json.loads(entry.read_bytes()), snapshot)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        result = plan()
        if result.route == "native":
            return result
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as out:
            out.write(json.dumps(_encode(result)).encode())
        os.replace(tmp, entry)
        return result
