"""The GPU acceptance scripts parse their arguments, talk HTTP and render their tables.

No GPU and no SGLang here: a stdlib fake server on 127.0.0.1 answers /generate and
/server_info, and the table renderers get canned bench_serving records.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
SCRIPTS = ("greedy_compare", "bursty_accept", "stress_mem_check", "sweep")
sys.path.insert(0, str(RECIPE))

import bursty_accept  # noqa: E402
import greedy_compare  # noqa: E402
import sweep  # noqa: E402


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs(script):
    proc = subprocess.run([sys.executable, str(RECIPE / f"{script}.py"), "--help"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_no_address_but_loopback_anywhere():
    addresses = set()
    for path in RECIPE.iterdir():
        if path.suffix in {".py", ".md", ".sh"}:
            addresses |= set(re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", path.read_text()))
    assert addresses <= {"127.0.0.1"}, addresses


def test_first_divergence():
    assert greedy_compare.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert greedy_compare.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert greedy_compare.first_divergence([1, 2], [1, 2, 3]) == 2
    summary = greedy_compare.summarize([None, 4, None, 1])
    assert summary == {"prompts": 4, "identical": 2, "diverged": 2,
                       "earliest_divergence": 1, "median_divergence": 4}


class FakeSGLang(BaseHTTPRequestHandler):
    """Answers like SGLang: output ids derived from the prompt; max_running_requests fixed."""

    diverge_on: str = ""
    max_running: int = 256

    def log_message(self, *args: Any) -> None:
        return None

    def _send(self, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/server_info":
            self._send({"max_running_requests": self.max_running, "internal_states": [{}]})
        elif self.path == "/health":
            self._send(None)
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        ids = [(len(body["text"]) * 31 + i) % 1000 for i in range(n)]
        if self.diverge_on and self.diverge_on in body["text"]:
            ids[3] += 1
        self._send({"text": "x", "meta_info": {
            "output_token_logprobs": [[-0.1, t, None] for t in ids]}})


@pytest.fixture
def fake_servers() -> Iterator[list[int]]:
    servers = []
    for diverge, max_running in (("", 256), ("binary search", 48)):
        handler = type("H", (FakeSGLang,), {"diverge_on": diverge, "max_running": max_running})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield [s.server_address[1] for s in servers]
    for server in servers:
        server.shutdown()


def test_greedy_compare_reports_divergences(fake_servers, tmp_path, capsys):
    base, patched = fake_servers
    out = tmp_path / "per_prompt.jsonl"
    rc = greedy_compare.main(["--baseline-port", str(base), "--patched-port", str(patched),
                              "--num-prompts", "40", "--max-new-tokens", "8",
                              "--concurrency", "4", "--output", str(out)])
    summary = json.loads(capsys.readouterr().out)
    diverged = [json.loads(line) for line in out.read_text().splitlines()]
    binary = [d for d in diverged if "binary search" in d["prompt"]]
    assert summary["diverged"] == len(binary) > 0
    assert all(d["first_divergence"] == 3 for d in binary)
    assert rc == (1 if len(binary) > 0.05 * 40 else 0)


def test_sweep_refuses_servers_with_different_max_running(fake_servers):
    base, patched = fake_servers
    problems = sweep.check_max_running("127.0.0.1", [("baseline", base), ("patched", patched)],
                                       256)
    assert len(problems) == 1 and "patched" in problems[0] and "48" in problems[0]


def test_sweep_table_from_canned_results(tmp_path, capsys):
    canned = {
        ("baseline", 1): {"output_throughput": 101.4, "median_tpot_ms": 9.87, "p99_tpot_ms": 12.0,
                          "median_ttft_ms": 40.2, "accept_length": None},
        ("patched", 1): {"output_throughput": 250.6, "median_tpot_ms": 4.0, "p99_tpot_ms": 5.55,
                         "median_ttft_ms": 41.0, "accept_length": 2.71},
    }
    for (label, c), record in canned.items():
        path = sweep.result_path(tmp_path, label, c)
        # bench_serving appends; a stale first line must be ignored
        path.write_text(json.dumps({"output_throughput": 1}) + "\n" + json.dumps(record) + "\n")
    rc = sweep.main(["--table-only", "--max-running-requests", "256", "--concurrency", "1,2",
                     "--server", "baseline=1", "--server", "patched=2",
                     "--out-dir", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert lines[0].split()[:3] == ["conc", "baseline", "tok/s"]
    assert lines[1].split() == ["1", "101", "9.9", "12.0", "40", "-", "251", "4.0", "5.5", "41",
                                "2.71"]
    assert lines[2].split() == ["2"] + ["-"] * 10  # nothing measured at c=2


def test_sweep_server_spec_and_command():
    assert sweep.parse_servers(["a=1", "b=22"]) == [("a", 1), ("b", 22)]
    with pytest.raises(Exception, match="LABEL=PORT"):
        sweep.parse_servers(["nolabel"])
    ns = sweep.argparse.Namespace(input_len=1024, output_len=512)
    cmd = sweep.bench_command("127.0.0.1", 30001, 16, ns, Path("o.jsonl"))
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--max-concurrency") + 1] == "16"
    assert cmd[cmd.index("--num-prompts") + 1] == "128"


def test_bursty_window_accept_length_and_judgement():
    survivor = bursty_accept.Timeline()
    # quiet 0-10: 30 tokens / 10 verifies; burst 10-20: 10 tokens / 10 verifies (fallback);
    # quiet 20-30: 28 tokens / 10 verifies
    for t, tokens, verifies in ((0, 0, 0), (10, 30, 10), (20, 40, 20), (30, 68, 30)):
        survivor.add(t, tokens, verifies)
    windows = [bursty_accept.Window("quiet-0", 0, 10, None),
               bursty_accept.Window("burst-1", 10, 20, None),
               bursty_accept.Window("quiet-1", 20, 30, None)]
    stream = [bursty_accept.window_accept_length([survivor], w.start, w.end) for w in windows]
    assert stream == [3.0, 1.0, 2.8]
    assert bursty_accept.judge(windows, stream, tolerance=0.15, burst_ceiling=1.15) == []
    assert bursty_accept.judge(windows, [3.0, 1.0, 2.0], 0.15, 1.15)  # no recovery
    assert bursty_accept.judge(windows, [3.0, 2.5, 3.0], 0.15, 1.15)  # fallback never engaged
    assert "quiet-0" in bursty_accept.render(windows, stream)
