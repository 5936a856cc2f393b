"""A fake SGLang HTTP server, run as ``python -m sglang.launch_server ...`` in a test venv.

``_dynspec_fake_hook`` (installed by a ``.pth`` in the venv) serves this file for
``sglang.launch_server`` while the *real* installed release stays the ``sglang`` package, so
discovery finds the real package dir and the real version. The server:

- parses ``--flag value`` / ``--flag=value`` / bare ``--flag`` into snake_case server args;
- refuses ``--speculative-disable-batch-threshold`` (like argparse) unless the installed
  ``srt/server_args.py`` really carries the field, i.e. the package is patched; its value is an
  integer or ``auto`` (reported as the string, as the patched ServerArgs holds it);
- computes the effective ``disable_overlap_schedule`` with the release's own rule (Addendum
  table), so it can differ from the command line, and reports it;
- serves ``/get_server_info`` (all releases) and ``/server_info`` (0.5.6+), ``/get_model_info``
  / ``/model_info`` (the same eras; sglang-router reads them), ``/health``,
  ``/health_generate``, ``/generate`` (``FAKE_SGLANG_GENERATE_SECONDS`` each), and the
  requests in flight at ``/get_load`` (0.4.10+) and ``/v1/loads`` (0.5.10+); logs the
  ``server_args=`` line at start.

Faults (environment): FAKE_SGLANG_FAIL_START, FAKE_SGLANG_FAIL_IF_PATCHED,
FAKE_SGLANG_UNHEALTHY_IF_PATCHED, FAKE_SGLANG_STARTUP_DELAY (s), FAKE_SGLANG_IGNORE_TERM,
FAKE_SGLANG_CHILD (spawn a child that ignores SIGTERM), FAKE_SGLANG_NO_INFO (info endpoints 404),
FAKE_SGLANG_MODEL_INFO_SECONDS (each model-info answer waits that long: sglang-router reads it
before it lists a worker it was asked to add).

On SIGTERM the server logs how many requests it still had in flight.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import sglang

PKG = next(iter(sglang.__path__))
ENV = os.environ
BOOL_FLAGS = {"disable_overlap_schedule", "enable_beta_spec", "speculative_adaptive",
              "enable_multi_layer_eagle", "trust_remote_code", "disable_cuda_graph",
              "enable_dp_attention", "enable_two_batch_overlap", "enable_pdmux"}
INT_FLAGS = {"port", "speculative_eagle_topk", "speculative_num_steps",
             "speculative_num_draft_tokens", "speculative_disable_batch_threshold", "tp_size"}
# the patched server's flag also takes the word auto (its own controller picks each step)
AUTO_WORD = {"speculative_disable_batch_threshold": "auto"}


def read(rel: str) -> str:
    try:
        with open(os.path.join(PKG, rel), encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return ""


def version() -> str:
    for rel in ("_version.py", "version.py"):
        m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", read(rel))
        if m:
            return m.group(1)
    return "unknown"


def vkey(v: str) -> tuple:
    nums = [int(p) for p in v.split(".post")[0].split(".") if p.isdigit()]
    post = int(v.split(".post")[1]) if ".post" in v else 0
    return (*(*nums, 0, 0)[:3], post)


def patched() -> bool:
    return "speculative_disable_batch_threshold" in read("srt/server_args.py")


def env_bool(name: str, default: bool) -> bool:
    value = ENV.get(name, "").strip().lower()
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    return default


def parse(argv: list[str]) -> dict:
    args: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            fail(2, f"launch_server.py: error: unrecognized arguments: {arg}")
        name, eq, value = arg[2:].partition("=")
        key = name.replace("-", "_")
        if key in BOOL_FLAGS and not eq:
            args[key] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                fail(2, f"launch_server.py: error: argument --{name}: expected one argument")
            value = argv[i + 1]
            i += 2
        else:
            i += 1
        args[key] = int(value) if key in INT_FLAGS and value != AUTO_WORD.get(key) else value
    return args


def fail(code: int, message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


def effective(args: dict, v: tuple) -> dict:
    algo = args.get("speculative_algorithm")
    if algo == "NEXTN":
        algo = args["speculative_algorithm"] = "EAGLE"
    flag = bool(args.get("disable_overlap_schedule"))
    topk = args.get("speculative_eagle_topk")
    value = flag
    if algo in ("EAGLE", "EAGLE3"):
        if v <= (0, 5, 3, 1):
            value = True
        elif v <= (0, 5, 4, 0):
            beta = bool(args.get("enable_beta_spec"))
            value = False if (algo == "EAGLE" and beta) else (flag if beta else True)
        elif v <= (0, 5, 6, 2):
            spec_v2 = env_bool("SGLANG_ENABLE_SPEC_V2", False)
            value = False if (algo == "EAGLE" and spec_v2) else (flag if spec_v2 else True)
        elif v <= (0, 5, 10, 1):
            if env_bool("SGLANG_ENABLE_SPEC_V2", False):
                if topk and topk > 1:
                    fail(1, "ValueError: spec v2 currently only supports topk = 1")
                value = False
            else:
                value = True
        elif v <= (0, 5, 12, 1):
            value = flag or bool(topk and topk > 1) or not env_bool("SGLANG_ENABLE_SPEC_V2", True)
        elif v < (0, 5, 14, 0):
            value = flag or not env_bool("SGLANG_ENABLE_SPEC_V2", True)
    args["disable_overlap_schedule"] = value
    return args


def main() -> None:
    v_text = version()
    v = vkey(v_text)
    is_patched = patched()
    if ENV.get("FAKE_SGLANG_FAIL_START"):
        fail(1, "RuntimeError: FAKE_SGLANG_FAIL_START is set")
    args = parse(sys.argv[1:])
    if "speculative_disable_batch_threshold" in args and not is_patched:
        fail(2, "launch_server.py: error: unrecognized arguments: "
                "--speculative-disable-batch-threshold")
    if any(k.startswith("speculative_adaptive") for k in args) and v < (0, 5, 11, 0):
        fail(2, "launch_server.py: error: unrecognized arguments: --speculative-adaptive")
    if is_patched and ENV.get("FAKE_SGLANG_FAIL_IF_PATCHED"):
        fail(1, "ImportError: FAKE_SGLANG_FAIL_IF_PATCHED (the patched worker does not import)")
    defaults = {"model_path": None, "host": "127.0.0.1", "port": 30000,
                "speculative_algorithm": None, "speculative_eagle_topk": None,
                "speculative_num_steps": None, "disable_overlap_schedule": False,
                "cuda_graph_bs": None}
    if v >= (0, 5, 7, 0):
        defaults["enable_multi_layer_eagle"] = False
    if v >= (0, 5, 11, 0):
        defaults["speculative_adaptive"] = False
        defaults["speculative_adaptive_config"] = None
    if is_patched:
        defaults["speculative_disable_batch_threshold"] = None
    server_args = effective({**defaults, **args}, v)
    if isinstance(server_args.get("cuda_graph_bs"), str):
        server_args["cuda_graph_bs"] = [int(x) for x in server_args["cuda_graph_bs"].split()]
    rendered = ", ".join(f"{k}={v!r}" for k, v in server_args.items())
    if ENV.get("FAKE_SGLANG_NO_LOG_LINE"):
        pass
    elif v >= (0, 5, 19, 0):
        print(f"[2026-11-29 12:00:00] server_args={server_args!r}", flush=True)
    else:
        print(f"[2026-11-29 12:00:00] server_args=ServerArgs({rendered})", flush=True)

    if ENV.get("FAKE_SGLANG_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = None
    if ENV.get("FAKE_SGLANG_CHILD"):
        code = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "while True: time.sleep(1)")
        child = subprocess.Popen([sys.executable, "-c", code])
    ready_at = time.time() + float(ENV.get("FAKE_SGLANG_STARTUP_DELAY", "0"))
    unhealthy = is_patched and bool(ENV.get("FAKE_SGLANG_UNHEALTHY_IF_PATCHED"))
    info = {**server_args, "version": v_text, "internal_states": [{}],
            "fake_cwd": os.getcwd(), "fake_argv": sys.argv[1:],
            "fake_env_tag": ENV.get("DYNSPEC_TEST_TAG"), "fake_pid": os.getpid()}
    endpoints = ["/get_server_info"] + (["/server_info"] if v >= (0, 5, 6, 0) else [])
    if ENV.get("FAKE_SGLANG_NO_INFO"):
        endpoints = []
    model_info = {"model_path": server_args.get("model_path"), "is_generation": True}
    model_endpoints = ["/model_info"] if v >= (0, 5, 6, 0) else ["/get_model_info"]
    generate_seconds = float(ENV.get("FAKE_SGLANG_GENERATE_SECONDS", "0"))
    model_info_seconds = float(ENV.get("FAKE_SGLANG_MODEL_INFO_SECONDS", "0"))
    in_flight = [0]
    lock = threading.Lock()

    def loads() -> dict:
        n = in_flight[0]
        return {"num_reqs": n, "num_running_reqs": n, "num_waiting_reqs": 0,
                "num_total_reqs": n, "dp_rank": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def _send(self, code: int, body: bytes = b"", ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            ready = time.time() >= ready_at and not unhealthy
            if self.path in ("/health", "/health_generate"):
                self._send(200 if ready else 503)
            elif self.path == "/fake_pid":  # for the tests (namespace PID), never for discovery
                self._send(200, str(os.getpid()).encode(), "text/plain")
            elif self.path in endpoints:
                self._send(200, json.dumps(info).encode())
            elif self.path in model_endpoints:
                time.sleep(model_info_seconds)
                self._send(200, json.dumps(model_info).encode())
            elif self.path == "/get_load" and v >= (0, 4, 10, 0):
                self._send(200, json.dumps([loads()]).encode())
            elif self.path == "/v1/loads" and v >= (0, 5, 10, 0):
                self._send(200, json.dumps({"loads": [loads()]}).encode())
            else:
                self._send(404, b'{"detail":"Not Found"}')

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            if self.path == "/generate":
                with lock:
                    in_flight[0] += 1
                try:
                    time.sleep(generate_seconds)
                    self._send(200, json.dumps({"text": " pong", "meta_info": {
                        "id": self.headers.get("x-request-id"), "fake_pid": os.getpid(),
                        "fake_port": server_args["port"]}})
                        .encode())
                finally:
                    with lock:
                        in_flight[0] -= 1
            else:
                self._send(404)

    httpd = ThreadingHTTPServer((server_args["host"], server_args["port"]), Handler)

    def stop(*_: object) -> None:
        with lock:
            print(f"SIGTERM with {in_flight[0]} request(s) in flight", flush=True)
        raise SystemExit(0)

    if not ENV.get("FAKE_SGLANG_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, stop)
    print(f"The server is fired up and ready to roll! pid={os.getpid()}", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.1)
    finally:
        httpd.server_close()
        if child is not None and not ENV.get("FAKE_SGLANG_CHILD"):
            child.kill()


if __name__ == "__main__":
    main()
