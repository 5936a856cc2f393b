"""POST JSON over one HTTP/1.1 connection per thread, kept open across requests (stdlib only).

The kit's load clients (client.py, envelope.py) send every request of a client thread on that
thread's connection, as serving clients do. With a TCP connection per request, plain
decoding's c = 64 level on an H200 ran 4 % below this client's on another H200 the same day
(2026-12-04: 8 140 against 8 488 tok/s, TPOT 7.84-7.89 against 7.51-7.56 ms), while its
steady decode steps differed by 1 %.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import urllib.error
import urllib.parse
from typing import Any

_connections = threading.local()  # each thread's open connection, by base URL


def post_json(base_url: str, path: str, body: Any, timeout: float) -> Any:
    """POST ``body`` as JSON to ``base_url + path`` on this thread's connection to that server;
    the decoded answer. A connection the server closed while it idled (its keep-alive timeout)
    is opened again at once; any other error closes it and propagates; a status other than
    200 raises urllib's HTTPError."""
    reused = base_url in _open()
    try:
        return _post_once(base_url, path, body, timeout)
    except (http.client.RemoteDisconnected, BrokenPipeError):
        if not reused:
            raise
        return _post_once(base_url, path, body, timeout)


def _open() -> dict[str, http.client.HTTPConnection]:
    if not hasattr(_connections, "by_url"):
        _connections.by_url = {}
    return _connections.by_url


def _post_once(base_url: str, path: str, body: Any, timeout: float) -> Any:
    conns = _open()
    conn = conns.get(base_url)
    if conn is None:
        conn = conns[base_url] = _connection(base_url, timeout)
    try:
        conn.request(
            "POST", path, body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        r = conn.getresponse()
        data = r.read()
    except Exception:
        conn.close()
        del conns[base_url]
        raise
    if r.status != 200:
        raise urllib.error.HTTPError(base_url + path, r.status, r.reason, r.headers, None)
    return json.loads(data)


def connect(base_url: str, timeout: float) -> None:
    """Open this thread's connection to ``base_url`` now, before its first request needs it
    (a closed loop opens every client's connection before its clock starts: together.py). A
    server that does not answer is left to the first request to report."""
    conns = _open()
    if base_url not in conns:
        conns[base_url] = _connection(base_url, timeout)
        with contextlib.suppress(OSError):  # http.client connects again on the first request
            conns[base_url].connect()


def _connection(base_url: str, timeout: float) -> http.client.HTTPConnection:
    url = urllib.parse.urlsplit(base_url)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
