"""The rotation's decisions in ``patcher.router``, one at a time (see tools/mutation.py; the
fleet tests run them end to end, minutes each).

The worker API is the real ``sglang-router`` where it can say what is checked (remove by id,
add back with the worker's priority and cost); a stub router in this process answers what
0.3.2 never does (200, 201, 204; a worker listed without an id; a listing that lags) and counts
the requests. The drain reads a scripted load through a stand-in for the SSH connection, and
the router module's clock is a fake one wherever a wait is measured, so waits and their
rounding are exact.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fleet_harness import TOKENIZER, Router

from dynspec_patch.patcher import router
from dynspec_patch.patcher.deploy import ROTATION_NAME
from dynspec_patch.patcher.errors import RefusedError
from dynspec_patch.patcher.router import Rotation, RouterClient, RouterError
from dynspec_patch.patcher.ssh import HttpResponse

ME, OTHER = "http://gpu1:8002", "http://gpu2:8002"


class FakeTime:
    """The router module's ``time``: sleeping moves the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    strftime, gmtime = staticmethod(time.strftime), staticmethod(time.gmtime)


@pytest.fixture
def clock(monkeypatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(router, "time", fake)
    return fake


class StubRouter:
    """``/workers`` as a script: each GET answers the next listing (the last one repeats);
    DELETE and POST answer ``status[method]`` and switch to ``then[method]``."""

    def __init__(self) -> None:
        self.listings: list[list[dict[str, Any]]] = [[]]
        self.status = {"DELETE": 202, "POST": 202}
        self.then: dict[str, list[list[dict[str, Any]]]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.gets = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, code: int, body: Any) -> None:
                data = b"" if code in (204, 205) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                stub.gets += 1
                listing = stub.listings.pop(0) if len(stub.listings) > 1 else stub.listings[0]
                self._answer(200, {"workers": listing})

            def _change(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                stub.requests.append((self.command, self.path, body))
                if self.command in stub.then:
                    stub.listings = stub.then.pop(self.command)
                self._answer(stub.status[self.command], {"status": "stub"})

            do_DELETE = do_POST = _change

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def client(self, **kw: Any) -> RouterClient:
        return RouterClient(self.url, **{"poll": 0.5, **kw})


@pytest.fixture
def stub() -> Iterator[StubRouter]:
    made = StubRouter()
    yield made
    made.server.shutdown()
    made.server.server_close()


# ------------------------------------------------------------------------------ _same_url


@pytest.mark.parametrize(("a", "b", "same"), [
    ("http://GPU1:8002/", "http://gpu1:8002", True),
    ("http://gpu1:8002", "HTTP://gpu1:8002//", True),
    ("http://gpu1:8002", "http://gpu1:8003", False),
    ("/http://gpu1:8002", "http://gpu1:8002", False),
    ("http://gpu1:8002", "/http://gpu1:8002", False),
    ("http://gpu1:8002X", "http://gpu1:8002", False),
    ("http://gpu1:8002", "http://gpu1:8002X", False),
    ("http://gpu1:8002 ", "http://gpu1:8002", False),
    (None, "http://gpu1:8002", False), ("http://gpu1:8002", None, False), (None, None, False),
    ("", "", False),
], ids=str)
def test_urls_are_the_same_up_to_case_and_trailing_slashes(a, b, same):
    assert router._same_url(a, b) is same


# ------------------------------------------------------------- RouterClient.remove / add


def test_remove_deletes_by_id_and_waits_until_the_worker_is_unlisted(stub, clock):
    me = {"id": "w-1", "url": ME}
    stub.listings = [[me]]
    stub.then["DELETE"] = [[me], [me], []]  # the router takes two more polls to drop it
    assert stub.client().remove(me, timeout=5) == 1.0
    assert stub.requests == [("DELETE", "/workers/w-1", None)]
    assert clock.sleeps == [0.5, 0.5] and stub.gets == 3


def test_remove_of_a_worker_listed_without_an_id_names_it_by_its_url(stub, clock):
    stub.then["DELETE"] = [[]]
    assert stub.client().remove({"url": ME}, timeout=5) == 0.0
    assert stub.requests == [("DELETE", "/workers/http%3A%2F%2Fgpu1%3A8002", None)]


@pytest.mark.parametrize("status", [200, 202, 204])
def test_remove_accepts_the_router_s_ok_answers(stub, clock, status):
    stub.status["DELETE"] = status
    stub.client().remove({"id": "w-1", "url": ME}, timeout=5)


@pytest.mark.parametrize("status", [201, 203, 205, 400])
def test_remove_refused_by_the_router_is_one_line(stub, clock, status):
    stub.status["DELETE"] = status
    with pytest.raises(RouterError) as refused:
        stub.client().remove({"id": "w-1", "url": ME}, timeout=5)
    assert str(refused.value) == (f"the router refused to remove {ME}: {status} "
                                  + ("{'status': 'stub'}" if status != 205 else "None"))


def test_remove_gives_up_when_the_router_still_lists_the_worker(stub, clock):
    me = {"id": "w-1", "url": ME}
    stub.listings = [[me]]
    with pytest.raises(RouterError) as stuck:
        stub.client().remove(me, timeout=1.0)
    assert str(stuck.value) == f"the router still lists {ME} 1s after removing it"
    assert clock.now == 1001.5  # polled at 0, 0.5, 1.0 (not past the timeout yet), 1.5


def test_add_posts_the_url_with_its_priority_and_cost_and_waits_until_healthy(stub, clock):
    back = {"id": "w-2", "url": ME, "is_healthy": True}
    stub.then["POST"] = [[], [{**back, "is_healthy": False}], [back]]
    like = {"url": "old", "priority": 7, "cost": 3, "load": 9}
    assert stub.client().add(ME, timeout=5, like=like) == back
    assert stub.requests == [("POST", "/workers", {"url": ME, "priority": 7, "cost": 3})]
    assert clock.sleeps == [0.5, 0.5]


def test_add_sends_only_what_the_worker_had(stub, clock):
    stub.then["POST"] = [[{"url": ME}]]  # no health field: healthy
    assert stub.client().add(ME, timeout=5, like={"priority": None, "cost": 2}) == {"url": ME}
    assert stub.client().add(ME, timeout=5) == {"url": ME}
    assert [body for _, _, body in stub.requests] == [{"url": ME, "cost": 2}, {"url": ME}]
    assert clock.sleeps == []


@pytest.mark.parametrize("status", [200, 201, 202])
def test_add_accepts_the_router_s_ok_answers(stub, clock, status):
    stub.status["POST"] = status
    stub.then["POST"] = [[{"url": ME}]]
    stub.client().add(ME, timeout=5)


@pytest.mark.parametrize("status", [203, 204, 409])
def test_add_refused_by_the_router_is_one_line(stub, clock, status):
    stub.status["POST"] = status
    with pytest.raises(RouterError) as refused:
        stub.client().add(ME, timeout=5)
    assert str(refused.value) == (f"the router refused to add {ME}: {status} "
                                  + ("None" if status == 204 else "{'status': 'stub'}"))


def test_add_gives_up_when_the_worker_never_turns_healthy(stub, clock):
    stub.then["POST"] = [[{"url": ME, "is_healthy": False}]]
    with pytest.raises(RouterError) as stuck:
        stub.client().add(ME, timeout=1.0)
    assert str(stuck.value) == (f"the router did not list {ME} as healthy within 1s of adding "
                                "it back")
    assert clock.now == 1001.5


# ------------------------------------------------------------------------------- drain


class Loads:
    """The SSH connection as ``in_flight`` uses it: ``/v1/loads`` answers the next count."""

    def __init__(self, *counts: int | None) -> None:
        self.counts = list(counts)
        self.asked: list[tuple[int, str, str]] = []

    def http_get(self, port: int, path: str, *, host: str, timeout: float) -> HttpResponse:
        self.asked.append((port, path, host))
        count = self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]
        if count is None:
            return HttpResponse(404, {}, b"")
        body = {"loads": [{"num_total_reqs": count}]}
        return HttpResponse(200, {}, json.dumps(body).encode())


SERVER = SimpleNamespace(port=8002, address="127.0.0.9")


def test_drain_waits_for_settle_seconds_at_zero(clock):
    loads = Loads(2, 1, 0, 1, 0)  # the quiet time starts again after a request comes in
    result = router.drain(loads, SERVER, timeout=60, settle=1.0, grace=5.0, poll=0.25)
    assert result == {"method": "/v1/loads at 0 for 1.0s", "in_flight_at_removal": 2,
                      "seconds": 2.0}
    assert clock.sleeps == [0.25] * 8
    assert loads.asked[0] == (8002, "/v1/loads", "127.0.0.9")


def test_drain_polls_every_tenth_of_a_second(clock):
    result = router.drain(Loads(1, 0), SERVER, timeout=60, settle=0.0, grace=5.0)
    assert clock.sleeps == [0.1] and result["seconds"] == 0.1


def test_drain_counts_settle_from_the_first_quiet_poll(clock):
    result = router.drain(Loads(3, 0), SERVER, timeout=60, settle=1.0, grace=5.0, poll=0.5)
    assert result["seconds"] == 1.5  # quiet from 0.5: done at 1.5, not before, not after


def test_drain_seconds_are_rounded_to_milliseconds(clock):
    clock.now = 1000.00001
    result = router.drain(Loads(0), SERVER, timeout=60, settle=0.00037, grace=0, poll=0.00012)
    assert result["seconds"] == 0.0  # 0.00048 s


def test_a_server_without_a_load_endpoint_gets_a_fixed_wait(clock):
    loads = Loads(None)
    result = router.drain(loads, SERVER, timeout=60, settle=1.5, grace=4.25)
    assert result == {"method": "fixed wait of 5.8s (no load endpoint)",
                      "in_flight_at_removal": None, "seconds": 5.75}
    assert clock.sleeps == [5.75]
    assert [path for _, path, _ in loads.asked] == ["/v1/loads", "/get_load"]


def test_a_fixed_wait_is_rounded_to_milliseconds(clock):
    result = router.drain(Loads(None), SERVER, timeout=60, settle=0.12345, grace=0.0)
    assert result["seconds"] == 0.123


def test_a_load_that_vanishes_while_draining_counts_as_idle(clock):
    result = router.drain(Loads(1, None), SERVER, timeout=60, settle=0.5, grace=5.0, poll=0.5)
    assert result == {"method": "/v1/loads at 0 for 0.5s", "in_flight_at_removal": 1,
                      "seconds": 1.0}


def test_a_server_that_does_not_drain_is_an_error_after_the_timeout(clock):
    with pytest.raises(RouterError) as stuck:
        router.drain(Loads(3), SERVER, timeout=1.0, settle=0.5, grace=5.0, poll=0.5)
    assert str(stuck.value) == "3 request(s) still in flight on port 8002 after 1s"
    assert clock.now == 1001.5


# ------------------------------------------------------------------ Rotation's decisions


def listed(url: str, **kw: Any) -> dict[str, Any]:
    return {"id": f"id-{url[-6:-5]}", "url": url, "is_healthy": True, **kw}


PREVIEW = {"servers": [{"pid": 11, "port": 8001}, {"pid": 12, "port": 8002}],
           "server_pid": 12, "state_dir": "/srv/state"}


def test_resolve_finds_the_running_server_s_worker(stub):
    stub.listings = [[listed("HTTP://gpu1:8002/"), listed(OTHER)]]
    rotation = Rotation(stub.client())
    rotation.resolve(PREVIEW, "gpu1")
    assert rotation.worker_url == ME
    assert rotation.report == {"url": stub.url, "worker": ME}


def test_resolve_keeps_a_worker_url_it_was_given(stub):
    stub.listings = [[listed("http://10.0.0.1:30000"), listed(OTHER)]]
    rotation = Rotation(stub.client(), worker_url="http://10.0.0.1:30000")
    rotation.resolve({}, "gpu1")
    assert rotation.report == {"url": stub.url, "worker": "http://10.0.0.1:30000"}


@pytest.mark.parametrize("preview", [{**PREVIEW, "server_pid": 13}, {"server_pid": 12}],
                         ids=["another pid", "no servers listed"])
def test_resolve_without_a_running_server_is_refused(stub, preview):
    with pytest.raises(RefusedError) as refused:
        Rotation(stub.client()).resolve(preview, "gpu1")
    assert str(refused.value) == ("no running server, so no router worker to take out; "
                                  "nothing was written")


@pytest.mark.parametrize(("workers", "names"), [
    ([], "none"), ([listed(OTHER), {"id": "x"}], f"{OTHER}, ?")])
def test_resolve_refuses_a_worker_the_router_does_not_list(stub, workers, names):
    stub.listings = [workers]
    with pytest.raises(RefusedError) as refused:
        Rotation(stub.client()).resolve(PREVIEW, "gpu1")
    assert str(refused.value) == (
        f"{ME} is not a worker of the router {stub.url} (it lists: {names}); give the URL the "
        "router knows it by (--router-worker-url / router_worker_url); nothing was written")


@pytest.mark.parametrize("others", [
    [], [listed(OTHER, is_healthy=False)], [listed(ME + "/")]], ids=["alone", "sick", "twice"])
def test_resolve_refuses_to_take_out_the_last_healthy_worker(stub, others):
    stub.listings = [[listed(ME), *others]]
    with pytest.raises(RefusedError) as refused:
        Rotation(stub.client()).resolve(PREVIEW, "gpu1")
    assert str(refused.value) == (
        f"{ME} is the only healthy worker of the router {stub.url}: taking it out would fail "
        "every request; nothing was written (roll one server at a time, serial: 1, or run "
        "without the router)")


def test_a_worker_without_a_health_field_counts_as_healthy(stub):
    stub.listings = [[listed(ME), {"url": OTHER}]]
    Rotation(stub.client()).resolve(PREVIEW, "gpu1")


class Session:
    """The remote session as the rotation uses it: its agent's requests are recorded."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.agent = SimpleNamespace(request=lambda name, args: self.requests.append(
            (name, args)))


def _resolved(stub: StubRouter, **kw: Any) -> Rotation:
    stub.listings = [[listed(ME, priority=7, cost=3), listed(OTHER)]]
    # polls that do not fall on a millisecond show the rounding of the seconds reported
    rotation = Rotation(stub.client(poll=0.50013), settle=0.0, grace=2.0, drain_timeout=1.0,
                        add_timeout=4.0, **kw)
    rotation.resolve(PREVIEW, "gpu1")
    return rotation


def test_before_restart_records_removes_and_drains_then_add_back_restores(stub, clock):
    rotation = _resolved(stub)
    stub.then["DELETE"] = [[listed(ME)], [listed(OTHER)]]
    session = Session(Loads(0))
    rotation.before_restart(session, SERVER)
    [(name, args)] = session.requests
    assert name == "write_file" and args["state_dir"] == "/srv/state"
    assert args["name"] == ROTATION_NAME
    record = json.loads(base64.b64decode(args["data"]))
    assert {k: record[k] for k in ("router", "worker", "like")} == {
        "router": stub.url, "worker": ME, "like": {"priority": 7, "cost": 3}}
    assert stub.requests == [("DELETE", "/workers/id-1", None)]
    assert rotation.report == {"url": stub.url, "worker": ME, "removed_seconds": 0.5,
                               "removed": True, "drain": {
                                   "method": "/v1/loads at 0 for 0.0s",
                                   "in_flight_at_removal": 0, "seconds": 0.0}}
    assert rotation.left_out
    stub.then["POST"] = [[listed(OTHER)], [listed(ME), listed(OTHER)]]
    rotation.add_back(session)
    assert stub.requests[1] == ("POST", "/workers", {"url": ME, "priority": 7, "cost": 3})
    assert session.requests[1] == ("remove_file", {"state_dir": "/srv/state",
                                                   "name": ROTATION_NAME})
    assert rotation.report["added_back"] is True and rotation.report["add_seconds"] == 0.5
    assert not rotation.left_out


def test_a_worker_already_out_is_only_drained(stub, clock):
    rotation = _resolved(stub)
    rotation.report["removed"] = True  # taken over from an earlier run
    session = Session(Loads(None))
    rotation.before_restart(session, SERVER)
    assert stub.requests == [] and session.requests == []
    assert rotation.report["drain"]["method"] == "fixed wait of 2.0s (no load endpoint)"


def test_before_restart_refuses_when_the_other_worker_fell_sick(stub, clock):
    rotation = _resolved(stub)
    stub.listings = [[listed(ME), listed(OTHER, is_healthy=False)]]
    session = Session(Loads(0))
    with pytest.raises(RefusedError) as refused:
        rotation.before_restart(session, SERVER)
    assert str(refused.value) == (
        f"{ME} is the only healthy worker of the router {stub.url}: taking it out would fail "
        "every request; the files are patched, the restart is pending (roll one server at a "
        "time, serial: 1, or run without the router)")
    assert stub.requests == [] and session.requests == [] and not rotation.left_out


def test_a_drain_that_times_out_puts_the_worker_back(stub, clock):
    rotation = _resolved(stub)
    stub.then["DELETE"] = [[listed(OTHER)]]
    stub.then["POST"] = [[listed(ME), listed(OTHER)]]
    session = Session(Loads(4))
    with pytest.raises(RouterError) as stuck:
        rotation.before_restart(session, SERVER)
    assert str(stuck.value) == "4 request(s) still in flight on port 8002 after 1s"
    assert [method for method, _, _ in stub.requests] == ["DELETE", "POST"]
    assert [name for name, _ in session.requests] == ["write_file", "remove_file"]
    assert rotation.report["added_back"] is True


def test_add_back_waits_the_rotation_s_add_timeout(stub, clock):
    rotation = _resolved(stub)
    stub.then["POST"] = [[listed(OTHER)]]
    with pytest.raises(RouterError, match=f"did not list {ME} as healthy within 4s"):
        rotation.add_back(Session(Loads(0)))
    assert len(clock.sleeps) == 8  # 4.001 s: past the add timeout


def test_before_restart_needs_resolve_first(stub):
    with pytest.raises(AssertionError, match=r"^resolve\(\) first$"):
        Rotation(stub.client()).before_restart(Session(Loads(0)), SERVER)


# ------------------------------------------------------------------- the real sglang-router


class Workers:
    """Servers that answer what sglang-router asks a worker for, in this process."""

    def __init__(self, model: Path, count: int) -> None:
        info = json.dumps({"model_path": str(model), "is_generation": True}).encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                known = self.path in ("/health", "/health_generate", "/get_server_info",
                                      "/server_info", "/model_info", "/get_model_info")
                body = info if known else b"{}"
                self.send_response(200 if known else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(count)]
        for server in self.servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        self.urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in self.servers]

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def real_router(tmp_path: Path) -> Iterator[tuple[Router, list[str]]]:
    """The real sglang-router in front of the first of two workers."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    workers = Workers(model, 2)
    started = Router.start(tmp_path, workers.urls[:1])
    yield started, workers.urls
    started.stop()
    workers.close()


def test_the_real_router_takes_a_worker_out_by_id_and_back_with_its_weights(real_router):
    real, (first, second) = real_router
    client = RouterClient(real.url)
    added = client.add(second, timeout=30, like={"priority": 9, "cost": 4.0})
    assert (added["priority"], added["cost"]) == (9, 4.0)
    session = Session(Loads(0))
    rotation = Rotation(client, worker_url=second, settle=0.2)
    rotation.resolve({"state_dir": "/srv/state"}, "unused")
    rotation.before_restart(session, SERVER)
    assert real.healthy_workers() == {first}
    rotation.add_back(session)
    assert real.healthy_workers() == {first, second}
    back = next(w for w in real.workers() if w["url"] == second)
    assert (back["priority"], back["cost"]) == (9, 4.0)
