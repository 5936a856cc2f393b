"""Minimal stdlib client for a running SGLang server (no third-party packages).

Used by the GPU acceptance scripts in this directory. Every address comes from the command
line; the default host is 127.0.0.1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Server:
    host: str
    port: int
    timeout: float = 600.0

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=self.timeout) as resp:
            return json.loads(resp.read() or b"null")

    def post_json(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as resp:
            return json.loads(resp.read() or b"null")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=10) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def server_info(self) -> dict[str, Any]:
        """/server_info (0.5.x) or the older /get_server_info."""
        for path in ("/server_info", "/get_server_info"):
            try:
                return self.get_json(path)
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    raise
        raise RuntimeError(f"{self.base}: neither /server_info nor /get_server_info answers")

    def avg_spec_accept_length(self) -> float | None:
        states = self.server_info().get("internal_states") or [{}]
        value = states[0].get("avg_spec_accept_length")
        return float(value) if value is not None else None

    def reset_spec_counters(self) -> bool:
        """Zero the scheduler's accept-length counters: a successful /set_internal_state does
        that. Re-set speculative_accept_threshold_single to its current value (no behaviour
        change). Returns False when this release does not accept that key."""
        info = self.server_info()
        current = info.get("speculative_accept_threshold_single", 1.0)
        body = {"server_args": {"speculative_accept_threshold_single": current}}
        try:
            result = self.post_json("/set_internal_state", body)
        except urllib.error.HTTPError:
            return False
        return bool(isinstance(result, dict) and result.get("updated"))

    def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self.post_json("/generate", payload)

    def generate_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Yield each streamed chunk of /generate (SSE ``data:`` lines) until [DONE]."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/generate", body=json.dumps({**payload, "stream": True}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"/generate answered {resp.status}: {resp.read()[:200]!r}")
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)
        finally:
            conn.close()


def output_token_ids(response: dict[str, Any]) -> list[int] | None:
    """The generated token ids of a /generate response, whatever the release calls them."""
    if isinstance(response.get("output_ids"), list):
        return [int(t) for t in response["output_ids"]]
    logprobs = (response.get("meta_info") or {}).get("output_token_logprobs")
    if isinstance(logprobs, list) and logprobs:
        return [int(entry[1]) for entry in logprobs]  # (logprob, token_id, text)
    return None


def greedy_payload(prompt: str, max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "text": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, **extra},
        # Token ids come back as output_token_logprobs on releases without output_ids.
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def add_server_args(parser: argparse.ArgumentParser, name: str, default_port: int,
                    what: str) -> None:
    parser.add_argument(f"--{name}-host", default=DEFAULT_HOST, help=f"host of the {what}")
    parser.add_argument(f"--{name}-port", type=int, default=default_port,
                        help=f"port of the {what} (default {default_port})")


def server_from(ns: argparse.Namespace, name: str) -> Server:
    return Server(getattr(ns, f"{name}_host"), getattr(ns, f"{name}_port"))


def wait_healthy(server: Server, timeout: float = 600.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
    deadline = time.monotonic() + timeout
    while not server.healthy():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.base} did not become healthy in {timeout:.0f}s")
        sleep(2.0)
