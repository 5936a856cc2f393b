"""Keep a server out of an ``sglang-router`` while it restarts, so no request is dropped.

Who talks to whom:

- the router's control API (``GET /workers``, ``POST /workers``, ``DELETE /workers/{id}`` of
  sglang-router 0.3+, tested with 0.3.2) is called from the **controller**, the machine that
  runs dynspec-patch or ansible-playbook, at the URL given with ``--router`` / ``router:``;
- the server's in-flight requests (``/v1/loads`` on SGLang 0.5.10+, ``/get_load`` on
  0.4.10+) are read on the **host**, through the command's SSH connection (direct-tcpip),
  like ``/server_info``: the server's port need not be reachable from the controller.

The worker leaves the router only when the server really restarts; a run that changes nothing
(or a dry run) leaves the router alone. Order:

1. before anything is written: the worker must be listed by the router, and another healthy
   worker must remain to take the traffic (else refused);
2. just before the server is stopped (after checking again that another healthy worker
   remains): record the rotation on the host (``deploy.ROTATION_NAME``), then
   ``DELETE /workers/{id}``; wait until it is unlisted;
3. wait until the server has had no request in flight for ``settle`` seconds
   (at most ``drain_timeout``; a server without a load endpoint gets ``settle`` plus a fixed
   ``grace`` instead). If it does not drain, it is put back and nothing is restarted;
4. patch, restart, health gate and proof (``patcher.deploy``);
5. ``POST /workers {url}``; wait until the router lists it healthy; drop the record.

If anything fails after step 2 the worker stays out of the router and the error says so; the
record stays on the host, and the next ``apply``, ``revert`` or ``status`` there finishes the
rotation (``Rotation.resume``).
"""

from __future__ import annotations

import base64
import contextlib
import getpass
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynspec_patch.patcher import deploy
from dynspec_patch.patcher.deploy import ROTATION_NAME, BeforeRestart, rotation_journal
from dynspec_patch.patcher.errors import DynspecError, RefusedError
from dynspec_patch.patcher.facts import ServerProcess
from dynspec_patch.patcher.ssh import Connection, ConnectionLost, RemoteError

Operation = Callable[..., dict[str, Any]]


class RouterError(DynspecError):
    """The router could not be reached or did not do what was asked (exit 1)."""


def _same_url(a: str | None, b: str | None) -> bool:
    return bool(a and b) and a.rstrip("/").lower() == b.rstrip("/").lower()


@dataclass(frozen=True)
class RouterClient:
    """sglang-router's worker API, seen from the controller."""

    url: str
    api_key: str | None = None
    timeout: float = 10.0
    poll: float = 0.1

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            self.url.rstrip("/") + path, method=method, headers=headers,
            data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RouterError(f"cannot reach the router at {self.url}: {reason}") from exc
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode("utf-8", "replace")[:200]

    def workers(self) -> list[dict[str, Any]]:
        status, body = self._call("GET", "/workers")
        if status != 200 or not isinstance(body, dict):
            raise RouterError(f"GET {self.url}/workers answered {status}: {body}; the router "
                              "needs the /workers API (sglang-router 0.3 or later)")
        return list(body.get("workers") or [])

    def find(self, worker_url: str) -> dict[str, Any] | None:
        return next((w for w in self.workers() if _same_url(w.get("url"), worker_url)), None)

    def remove(self, worker: dict[str, Any], timeout: float) -> float:
        """Unregister ``worker``; return the seconds until the router stopped listing it."""
        started = time.monotonic()
        key = urllib.parse.quote(str(worker.get("id") or worker["url"]), safe="")
        status, body = self._call("DELETE", f"/workers/{key}")
        if status not in (200, 202, 204):
            raise RouterError(f"the router refused to remove {worker['url']}: {status} {body}")
        while self.find(worker["url"]) is not None:
            if time.monotonic() - started > timeout:
                raise RouterError(f"the router still lists {worker['url']} {timeout:.0f}s "
                                  "after removing it")
            time.sleep(self.poll)
        return time.monotonic() - started

    def add(self, worker_url: str, timeout: float,
            like: dict[str, Any] | None = None) -> dict[str, Any]:
        """Register ``worker_url`` (with the priority and cost it had) and wait until the
        router lists it healthy."""
        body: dict[str, Any] = {"url": worker_url}
        for key in ("priority", "cost"):
            if like and like.get(key) is not None:
                body[key] = like[key]
        started = time.monotonic()
        status, answer = self._call("POST", "/workers", body)
        if status not in (200, 201, 202):
            raise RouterError(f"the router refused to add {worker_url}: {status} {answer}")
        while True:
            worker = self.find(worker_url)
            if worker is not None and worker.get("is_healthy", True):
                return worker
            if time.monotonic() - started > timeout:
                raise RouterError(f"the router did not list {worker_url} as healthy within "
                                  f"{timeout:.0f}s of adding it back")
            time.sleep(self.poll)


def in_flight(conn: Connection, server: ServerProcess) -> tuple[int | None, str]:
    """Requests the server is working on (running + waiting), read on the host; ``None``
    when the release has no load endpoint."""
    for path in ("/v1/loads", "/get_load"):
        try:
            resp = conn.http_get(server.port, path, host=server.address, timeout=5.0)
        except (RemoteError, ConnectionLost) as exc:
            raise RouterError(f"cannot read the load of the server on port {server.port}: "
                              f"{exc}") from exc
        if resp.status != 200:
            continue
        try:
            body = resp.json()
        except ValueError:
            continue
        if isinstance(body, dict) and isinstance(body.get("loads"), list):  # /v1/loads
            return sum(int(x.get("num_total_reqs", x.get("num_running_reqs", 0)
                                 + x.get("num_waiting_reqs", 0))) for x in body["loads"]), path
        rows = body if isinstance(body, list) else [body]  # /get_load: one row per DP rank
        if all(isinstance(r, dict) and "num_reqs" in r for r in rows):
            return sum(int(r["num_reqs"]) for r in rows), path
    return None, "no load endpoint"


def drain(conn: Connection, server: ServerProcess, *, timeout: float, settle: float,
          grace: float, poll: float = 0.1) -> dict[str, Any]:
    """Wait until the server has had nothing in flight for ``settle`` seconds."""
    started = time.monotonic()
    count, source = in_flight(conn, server)
    first = count
    if count is None:
        time.sleep(settle + grace)
        return {"method": f"fixed wait of {settle + grace:.1f}s ({source})",
                "in_flight_at_removal": None, "seconds": round(time.monotonic() - started, 3)}
    quiet_since: float | None = None
    while True:
        now = time.monotonic()
        if count == 0:
            quiet_since = quiet_since if quiet_since is not None else now
            if now - quiet_since >= settle:
                return {"method": f"{source} at 0 for {settle:.1f}s",
                        "in_flight_at_removal": first,
                        "seconds": round(now - started, 3)}
        else:
            quiet_since = None
        if now - started > timeout:
            raise RouterError(f"{count} request(s) still in flight on port {server.port} after "
                              f"{timeout:.0f}s")
        time.sleep(poll)
        count, _ = in_flight(conn, server)
        count = count or 0


def _journal_line(left: dict[str, Any]) -> str:
    return (f"an earlier run ({left.get('by')}, since {left.get('since')}) left "
            f"{left.get('worker')} out of the router {left.get('router')}")


@dataclass
class Rotation:
    """Takes one host's server out of the router around its restart, then puts it back.

    The rotation is recorded on the host (``deploy.ROTATION_NAME`` in its state directory)
    before the worker leaves the router, and removed once it is back: a run cut short in
    between (a killed CLI, a lost controller) leaves the record, and the next ``apply``,
    ``revert`` or ``status`` on that host finishes the rotation (``resume``)."""

    router: RouterClient
    worker_url: str | None = None  # default: http://<SSH hostname>:<server port>
    drain_timeout: float = 600.0
    settle: float = 1.0
    grace: float = 5.0
    add_timeout: float = 300.0
    report: dict[str, Any] = field(default_factory=dict)
    _worker: dict[str, Any] | None = None
    _state_dir: str | None = None
    resumed: dict[str, Any] | None = None  # the record of the earlier run this one finishes

    @property
    def left_out(self) -> bool:
        return bool(self.report.get("removed")) and not self.report.get("added_back")

    def resolve(self, preview: dict[str, Any], hostname: str) -> None:
        """Find the worker in the router before anything is written (or, where an earlier
        run left it out, take over that rotation)."""
        if self.take_over(preview):
            return
        if self.worker_url is None:
            port = next((s["port"] for s in preview.get("servers", [])
                         if s["pid"] == preview.get("server_pid")), None)
            if port is None:
                raise RefusedError("no running server, so no router worker to take out; "
                                   "nothing was written")
            self.worker_url = f"http://{hostname}:{port}"
        self.report.update(url=self.router.url, worker=self.worker_url)
        workers = self.router.workers()
        self._worker = next((w for w in workers if _same_url(w.get("url"), self.worker_url)),
                            None)
        if self._worker is None:
            listed = ", ".join(w.get("url", "?") for w in workers) or "none"
            raise RefusedError(
                f"{self.worker_url} is not a worker of the router {self.router.url} (it lists: "
                f"{listed}); give the URL the router knows it by (--router-worker-url / "
                "router_worker_url); nothing was written")
        self._require_another(workers, "nothing was written")

    def take_over(self, preview: dict[str, Any]) -> bool:
        """``resume`` the rotation an earlier run left on the host, if it used this router
        (another router is refused: nothing was written). True while its worker is out."""
        self._state_dir = preview.get("state_dir")
        left = preview.get("router_rotation")
        if left is None:
            return False
        if not _same_url(left.get("router"), self.router.url):
            raise RefusedError(
                f"{_journal_line(left)}; finish that first: the same command with --router "
                f"{left.get('router')} (or without --router); nothing was written")
        return self.resume(left, self._state_dir)

    def resume(self, left: dict[str, Any], state_dir: str | None) -> bool:
        """Take over the rotation ``left`` (read from the host): True while its worker is
        still out of the router; False when it is back already (the record is stale)."""
        self._state_dir = state_dir
        self.worker_url = left["worker"]
        self.report.update(url=self.router.url, worker=self.worker_url)
        try:
            listed = self.router.find(self.worker_url)
        except RouterError as exc:
            raise RouterError(f"{_journal_line(left)} (recorded in {state_dir}/{ROTATION_NAME})"
                              f", and {exc}") from exc
        if listed is not None:
            self._worker = listed
            self.report["stale_record"] = f"{_journal_line(left)}; it is back in the router"
            return False
        self._worker = {"url": self.worker_url, **(left.get("like") or {})}
        self.resumed = left
        self.report.update(removed=True, resumed=dict(left))
        return True

    def _require_another(self, workers: list[dict[str, Any]], consequence: str) -> None:
        """Taking the router's last healthy worker out would fail every request: refuse."""
        others = [w for w in workers if w.get("is_healthy", True)
                  and not _same_url(w.get("url"), self.worker_url)]
        if not others:
            raise RefusedError(
                f"{self.worker_url} is the only healthy worker of the router {self.router.url}: "
                f"taking it out would fail every request; {consequence} (roll one server at a "
                "time, serial: 1, or run without the router)")

    def _record(self, s: Any) -> None:
        """Write the rotation on the host before the worker leaves the router."""
        assert self._state_dir is not None
        record = {"router": self.router.url, "worker": self.worker_url,
                  "like": {k: self._worker.get(k) for k in ("priority", "cost")
                           if self._worker and self._worker.get(k) is not None},
                  "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "by": f"{getpass.getuser()}@{socket.gethostname()}"}
        s.agent.request("write_file", {"state_dir": self._state_dir, "name": ROTATION_NAME,
                                       "data": base64.b64encode(json.dumps(record).encode())
                                       .decode()})

    def forget(self, s: Any) -> None:
        """Drop the host's record of the rotation (the worker is back in the router)."""
        if self._state_dir is not None:
            s.agent.request("remove_file", {"state_dir": self._state_dir, "name": ROTATION_NAME})

    def before_restart(self, s: Any, server: ServerProcess, _facts: Any = None) -> None:
        assert self._worker is not None, "resolve() first"
        if not self.report.get("removed"):
            self._require_another(self.router.workers(),
                                  "the files are patched, the restart is pending")
            self._record(s)
            self.report["removed_seconds"] = round(self.router.remove(self._worker,
                                                                      self.add_timeout), 3)
            self.report["removed"] = True
        try:
            self.report["drain"] = drain(s.conn, server, timeout=self.drain_timeout,
                                         settle=self.settle, grace=self.grace)
        except RouterError:
            self.add_back(s)  # the old server still runs: back into rotation, no restart
            raise

    def add_back(self, s: Any) -> None:
        """Put the worker back (once the router lists it healthy), then drop the record."""
        assert self.worker_url is not None
        started = time.monotonic()
        self.router.add(self.worker_url, self.add_timeout, like=self._worker)
        self.report["added_back"] = True
        self.report["add_seconds"] = round(time.monotonic() - started, 3)
        self.forget(s)

    def finished_line(self) -> str | None:
        """One line saying that this run finished an earlier run's rotation."""
        if self.resumed is None:
            return None
        done = "put it back" if self.report.get("added_back") else "it is still OUT"
        return f"{_journal_line(self.resumed)}: this run finished that rotation ({done})"


def _left_rotation(result: dict[str, Any]) -> Rotation | None:
    """The rotation an earlier run left unfinished on this host, taken over (None: none)."""
    left = result.get("router_rotation")
    if left is None:
        return None
    rotation = Rotation(RouterClient(left["router"]))
    return rotation if rotation.resume(left, result.get("state_dir")) else None


def rolling(s: Any, *, operation: Operation, rotation: Rotation | None,
            observe_restart: BeforeRestart | None = None, **kwargs: Any) -> dict[str, Any]:
    """Run ``deploy.apply`` / ``deploy.revert`` on session ``s``; with a ``rotation``, the
    server is out of the router only while it restarts (see the module docstring). A rotation
    an earlier run left unfinished on the host is finished, with or without ``rotation``.
    ``observe_restart`` is told which server is about to be stopped."""
    if rotation is None:
        return _without_router(s, operation, observe_restart, kwargs)

    def before_restart(s: Any, server: ServerProcess, facts: Any) -> None:
        if observe_restart is not None:
            observe_restart(s, server, facts)
        rotation.before_restart(s, server)

    dry_run = kwargs.pop("dry_run")
    preview = operation(s, dry_run=True, **kwargs)
    restart = str(preview.get("restart", ""))
    restarts = not preview["plan"].refused and restart.startswith("would restart")
    if restarts:
        rotation.resolve(preview, s.conn.target.hostname)
    elif not preview["plan"].refused:
        rotation.take_over(preview)  # no restart, but an earlier run's worker to put back
    if dry_run:
        if restarts:
            rotation.report["would"] = "take the worker out, drain, restart, put it back"
        elif rotation.resumed:
            rotation.report["would"] = "put the worker back (an earlier run left it out)"
        else:
            rotation.report.update(url=rotation.router.url, untouched="no restart")
        preview["router"] = rotation.report
        return preview
    if not restarts:
        result = operation(s, dry_run=False, before_restart=observe_restart, **kwargs)
        if rotation.resumed:
            _put_back(s, rotation, result)
        else:
            if rotation.report.get("stale_record"):
                rotation.forget(s)
            rotation.report.update(url=rotation.router.url, untouched="no restart")
        result["router"] = rotation.report
        return result
    try:
        result = operation(s, dry_run=False, before_restart=before_restart, **kwargs)
    except DynspecError as exc:
        if rotation.left_out:
            raise type(exc)(f"{exc}; {rotation.worker_url} is left OUT of the router "
                            f"{rotation.router.url}") from exc
        raise
    if rotation.report.get("removed"):
        _put_back(s, rotation, result)
    result["router"] = rotation.report
    return result


def _put_back(s: Any, rotation: Rotation, result: dict[str, Any]) -> None:
    try:
        rotation.add_back(s)
    except RouterError as exc:
        raise RouterError(f"the server runs, but {exc}; {rotation.worker_url} is left OUT of "
                          f"the router {rotation.router.url}") from exc
    if rotation.resumed:
        result["resumed_rotation"] = rotation.finished_line()


def _without_router(s: Any, operation: Operation, observe_restart: BeforeRestart | None,
                    kwargs: dict[str, Any]) -> dict[str, Any]:
    """No ``--router``: only a rotation an earlier run left unfinished involves a router (its
    server drains before the restart, and goes back once healthy)."""
    taken: list[Rotation] = []

    def before_restart(s: Any, server: ServerProcess, facts: Any) -> None:
        if observe_restart is not None:
            observe_restart(s, server, facts)
        left = rotation_journal(facts)
        if left is not None:
            rotation = Rotation(RouterClient(left["router"]))
            if rotation.resume(left, facts.state_dir):
                taken.append(rotation)
                rotation.before_restart(s, server)

    try:
        result = operation(s, before_restart=before_restart, **kwargs)
    except DynspecError as exc:
        if taken:
            raise type(exc)(f"{exc}; {taken[0].worker_url} is left OUT of the router "
                            f"{taken[0].router.url}") from exc
        raise
    rotation = taken[0] if taken else None
    if rotation is None and not kwargs["dry_run"] and not result["plan"].refused:
        rotation = _left_rotation(result)  # left out, and no restart this time
    if rotation is not None:
        _put_back(s, rotation, result)
        result["router"] = rotation.report
    elif kwargs["dry_run"] and result.get("router_rotation"):
        result["router"] = {"would": "put the worker back (an earlier run left it out)",
                            "resumed": result["router_rotation"]}
    return result


def status(s: Any) -> dict[str, Any]:
    """``deploy.status``; a rotation an earlier run left unfinished is finished where its
    server runs and answers: the worker goes back into the router (a pending restart stays
    pending, for ``apply`` to do through the router)."""
    result = deploy.status(s)
    left = result.get("router_rotation")
    if left is None:
        return result
    rotation = Rotation(RouterClient(left["router"]))
    try:
        out = rotation.resume(left, result.get("state_dir"))
    except RouterError as exc:  # status reports; it does not fail on the router
        result["router"] = {**rotation.report, "error": str(exc)}
        return result
    if not out:
        with contextlib.suppress(DynspecError):
            rotation.forget(s)  # stale: it is back already
        result["router"] = rotation.report
        return result
    if result.get("run_in_progress"):
        rotation.report["untouched"] = "another run is in progress on the host"
    elif result.get("server_runs") is None:
        rotation.report["untouched"] = "the server does not answer: apply puts it back"
    else:
        try:
            rotation.add_back(s)
        except DynspecError as exc:
            rotation.report["error"] = str(exc)
        result["resumed_rotation"] = rotation.finished_line()
    result["router"] = rotation.report
    return result
