"""The offline GPU kit's CPU-checkable parts: the crafted models' arithmetic and check.py.

mkweights.verify replays the crafted target and draft on every crafted token, so building tiny
weights here proves the construction (margins, draft acceptance per region) before a GPU sees
it. check.py is run against a stdlib server on 127.0.0.1 that continues prompts exactly as the
crafted target would, and against one that drops a token mid-stream.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

KIT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "kit"
sys.path.insert(0, str(KIT / "scripts"))

import crafted  # noqa: E402
from stub_http import JsonHandler, serving  # noqa: E402


def test_regions_are_cycles_and_pred_inverts_succ():
    for token in crafted.all_tokens():
        assert crafted.pred(crafted.succ(token)) == token
        assert crafted.region_of(crafted.succ(token)) == crafted.region_of(token)
    start = crafted.region_start(1)
    assert crafted.succ(start + crafted.REGION_SIZE - 1) == start
    with pytest.raises(ValueError):
        crafted.region_of(crafted.BASE - 1)


def test_good_token_fraction_matches_each_region():
    for index, (_, fraction) in enumerate(crafted.REGIONS):
        start = crafted.region_start(index)
        tokens = range(start, start + crafted.REGION_SIZE)
        share = sum(crafted.good(t) for t in tokens) / crafted.REGION_SIZE
        assert abs(share - fraction) < 0.03, (index, share)
        assert all(
            crafted.draft_next(t)
            == (crafted.succ(t) if crafted.good(t) else crafted.succ(crafted.succ(t)))
            for t in tokens
        )


def test_crafted_weights_compute_the_successor_and_the_draft(monkeypatch):
    import mkmodels
    import mkweights

    monkeypatch.setattr(crafted, "VOCAB", 8192)
    shape = dict(
        mkmodels.SHAPES["1b"],
        hidden_size=512,
        intermediate_size=6144,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=64,
    )
    target, draft = mkweights.make_tensors(shape, "cpu")
    mkweights.verify(target, draft, 512)  # exits on any wrong prediction
    assert not target["model.layers.0.mlp.down_proj.weight"].any()
    assert not target["model.layers.1.self_attn.o_proj.weight"].any()
    # A draft that always guesses right must fail the check: verify is not a rubber stamp.
    broken = dict(draft)
    broken["midlayer.mlp.down_proj.weight"] = broken["midlayer.mlp.down_proj.weight"] * 0
    with pytest.raises(SystemExit, match="do not compute"):
        mkweights.verify(target, broken, 512)


class SuccessorServer(JsonHandler):
    """Continues every prompt as the crafted target would; optionally drops one token."""

    drop_at: int | None = None

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        out = crafted.expected_continuation(ids, n + 1)
        if self.drop_at is not None and n > self.drop_at:
            del out[self.drop_at]  # the stream skips a token, as a lost fallback step would
        self._reply({"output_ids": out[:n], "meta_info": {"spec_accept_length": 1.0}})


@pytest.fixture
def successor_url() -> Iterator[str]:
    with serving(SuccessorServer) as url:
        yield url
    SuccessorServer.drop_at = None


def run_check(url: str, tmp_path: Path) -> dict:
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, str(KIT / "scripts" / "check.py"), url, str(out), "t"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_check_passes_a_faithful_server(successor_url, tmp_path):
    report = run_check(successor_url, tmp_path)
    assert report["total_failed"] == 0
    assert report["total_mismatched"] == 0
    assert report["total_requests"] == 6 * 3 + 64 + 48 + 56
    late = report["phases"]["late48"]
    assert late["requests"] == 56 and late["tokens"] == 48 * 192 + 8 * 384
    assert set(late["late_by_region"]) == {"accept0", "accept50", "accept90"}


def test_check_catches_a_skipped_token(successor_url, tmp_path):
    SuccessorServer.drop_at = 100
    report = run_check(successor_url, tmp_path)
    burst = report["phases"]["burst64"]
    assert burst["mismatched"] == 64 and set(burst["first_mismatches"]) == {100}
    assert report["phases"]["c1"]["mismatched"] == 6  # 128 new tokens each: all cross 100


def test_kit_talks_only_to_loopback():
    addresses = set()
    version_lists = {"pins.txt", "host-packages.txt"}  # package==version lines only
    for path in KIT.rglob("*"):
        if path.suffix in {".py", ".sh", ".md", ".txt"} and path.name not in version_lists:
            addresses |= set(re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", path.read_text()))
    assert addresses <= {"127.0.0.1"}, addresses


def test_run_sh_parses():
    subprocess.run(["bash", "-n", str(KIT / "scripts" / "run.sh")], check=True)


def server_that_exits(tmp_path: Path) -> Path:
    """A ``python`` for run.sh whose server prints its arguments and exits at once (no GPU);
    the health check finds nothing listening; everything else is this Python."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(
        "#!/bin/bash\n"
        'if [ "$1 $2" = "-m sglang.launch_server" ]; then echo "stub server: $*"; exit 1; fi\n'
        'if [ "$1" = "-c" ]; then exit 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    stub.chmod(0o755)
    return stub


def test_a_further_server_of_a_variant_runs_that_variant_under_its_own_name(tmp_path):
    """``VARIANT@N`` launches VARIANT's server (here one that exits at once: no GPU) and
    names its log and result VARIANT@N; a name already done is skipped."""
    stub = server_that_exits(tmp_path)
    home, out = tmp_path / "kit", tmp_path / "out"
    env = {**os.environ, "PY": str(stub), "KIT_HOME": str(home), "OUT": str(out),
           "HEALTH_TIMEOUT": "5", "DEADLINE": "600", "ENV_LEVELS": "64", "REGIONS": "accept50"}
    run_sh = [str(KIT / "scripts" / "run.sh"), "session", "env-fixed-T16@2", "env-auto@3"]
    first = subprocess.run(["bash", *run_sh], env=env, capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 0, first.stderr
    logs, results = home / "work" / "logs", home / "work" / "results"
    fixed = (logs / "env-fixed-T16@2.server.log").read_text()
    assert "stub server:" in fixed
    assert re.search(r"^\[env-fixed-T16@2\] host load: \d", fixed, re.M)  # /proc/loadavg
    assert re.search(r"^\[env-fixed-T16@2\] host: +PID +%CPU", fixed, re.M)  # ps, busiest first
    assert re.search(r"--speculative-disable-batch-threshold 16\s", fixed)
    auto = (logs / "env-auto@3.server.log").read_text()
    assert "--speculative-disable-batch-threshold auto" in auto
    assert json.loads((results / "env-auto@3.json").read_text())["name"] == "env-auto@3"
    assert set(json.loads((out / "results.json").read_text())) == {"env-fixed-T16@2",
                                                                   "env-auto@3"}
    again = subprocess.run(["bash", *run_sh[:3]], env=env, capture_output=True, text=True,
                           timeout=120)
    assert "[env-fixed-T16@2] already done" in again.stdout


def test_lever_variants_run_the_patched_server_with_their_settings(tmp_path):
    """``dyn-v2-write8``: the patched server with DYNSPEC_DRAFT_KV_WRITE_STEPS=8 (here one
    that exits at once: no GPU), a kind of its own beside ``dyn-v2``; ``-kvprefill`` adds
    DYNSPEC_DRAFT_PREFILL_WRITE=1, alone or after ``-writeN``."""
    stub = server_that_exits(tmp_path)
    home = tmp_path / "kit"
    env = {**os.environ, "PY": str(stub), "KIT_HOME": str(home), "OUT": str(tmp_path / "out"),
           "HEALTH_TIMEOUT": "5", "DEADLINE": "600"}
    kinds = ["dyn-v2-write8@2", "dyn-v2", "dyn-v2-kvprefill", "dyn-v2-write16-kvprefill",
             "dyn-v1-kvprefill"]
    done = subprocess.run(["bash", str(KIT / "scripts" / "run.sh"), "session", *kinds],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    logs = home / "work" / "logs"

    def first_line(kind: str) -> str:
        return (logs / f"{kind}.server.log").read_text().splitlines()[0]

    assert first_line("dyn-v2-write8@2").endswith("env: DYNSPEC_DRAFT_KV_WRITE_STEPS=8")
    assert "--speculative-disable-batch-threshold 16" in first_line("dyn-v2-write8@2")
    assert first_line("dyn-v2").rstrip().endswith("env:")
    assert first_line("dyn-v2-kvprefill").endswith("env: DYNSPEC_DRAFT_PREFILL_WRITE=1")
    assert first_line("dyn-v2-write16-kvprefill").endswith(
        "env: DYNSPEC_DRAFT_KV_WRITE_STEPS=16 DYNSPEC_DRAFT_PREFILL_WRITE=1"
    )
    v1 = first_line("dyn-v1-kvprefill")
    assert "--disable-overlap-schedule" in v1
    assert v1.endswith("env: DYNSPEC_DRAFT_PREFILL_WRITE=1")


def test_tp_runs_every_server_on_that_many_gpus_under_a_kind_of_its_own(tmp_path):
    """``TP=2``: ``--tp-size 2`` on each server (here one that exits at once: no GPU), its log
    and result named KIND-tp2[@N], so a report pools it apart from one-GPU servers; the
    variant's own settings stay. Without TP no server gets ``--tp-size``."""
    stub = server_that_exits(tmp_path)
    home = tmp_path / "kit"
    env = {**os.environ, "PY": str(stub), "KIT_HOME": str(home), "OUT": str(tmp_path / "out"),
           "HEALTH_TIMEOUT": "5", "DEADLINE": "600", "TP": "2",
           "VARIANT_ENV": "DYNSPEC_DECODE_GRAPHS_FAIL_ON_RANKS=1"}
    run_sh = ["bash", str(KIT / "scripts" / "run.sh"), "session"]
    done = subprocess.run([*run_sh, "dyn-v2@2", "base"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    logs, results = home / "work" / "logs", home / "work" / "results"
    assert sorted(p.name for p in results.glob("*.json")) == ["base-tp2.json",
                                                               "dyn-v2-tp2@2.json"]
    patched = (logs / "dyn-v2-tp2@2.server.log").read_text()
    assert re.search(r"stub server: .* --tp-size 2 .*--speculative-disable-batch-threshold 16",
                     patched)
    assert patched.splitlines()[0].endswith("env: DYNSPEC_DECODE_GRAPHS_FAIL_ON_RANKS=1")
    assert "--tp-size 2" in (logs / "base-tp2.server.log").read_text()
    one_gpu = subprocess.run([*run_sh, "dyn-v2@2"], env={**env, "TP": "1"},
                             capture_output=True, text=True, timeout=120)
    assert one_gpu.returncode == 0, one_gpu.stderr
    assert "--tp-size" not in (logs / "dyn-v2@2.server.log").read_text()


DEFAULT_KERNELS = (("gemm", 0.0, 10.0), ("gemm", 5.0, 15.0), ("attn", 20.0, 30.0))


class SweepStub(JsonHandler):
    """A stand-in SGLang server for client.py and profile_steps.py: /generate answers after a
    short delay with max_new_tokens ids, /start_profile writes a canned GPU trace (or none)."""

    protocol_version = "HTTP/1.1"  # keeps a connection open across requests, as uvicorn does
    timeout = 0.3  # and closes one that idles this long, as uvicorn's keep-alive timeout does
    disable_nagle_algorithm = True  # as asyncio's transports (uvicorn's) do
    write_trace = True
    trace_finishes_after: float | None = None  # s; None: the trace is written at once
    kernels = DEFAULT_KERNELS
    slow_parity: int | None = None  # prompts whose first id has this parity answer slowly
    flushes: ClassVar[list[float]] = []  # when each /flush_cache came (time.time())
    generate_ports: ClassVar[list[int]] = []  # the client port of each /generate
    opened: ClassVar[list[int]] = []  # the client port of each connection taken
    profile_calls: ClassVar[list[tuple[str, int]]] = []  # (path, /generate calls before it)
    new_tokens: ClassVar[list[int]] = []  # each /generate's max_new_tokens
    trace_dir = ""

    def setup(self) -> None:
        self.opened.append(self.client_address[1])
        super().setup()

    def do_GET(self) -> None:
        self._reply({"speculative_algorithm": None, "version": "stub"})

    def do_POST(self) -> None:
        if self.path == "/flush_cache":
            self.flushes.append(time.time())
            self._reply({})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path in ("/start_profile", "/stop_profile"):
            self.profile_calls.append((self.path, len(self.generate_ports)))
            if self.path == "/start_profile":
                SweepStub.trace_dir = body["output_dir"]
            # a trace of num_steps steps is written when they ran; an open-ended one at its stop
            done = self.path == "/stop_profile" or body.get("num_steps") is not None
            if self.write_trace and done:
                events = [
                    {"ph": "X", "cat": "kernel", "name": n, "ts": t0, "dur": t1 - t0}
                    for n, t0, t1 in self.kernels
                ]
                events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99})
                path = Path(self.trace_dir) / "stub-TP-0.trace.json.gz"
                whole = gzip.compress(json.dumps({"traceEvents": events}).encode())
                if self.trace_finishes_after is None:
                    path.write_bytes(whole)
                else:  # half of it now, the rest later: a trace still being written
                    path.write_bytes(whole[: len(whole) // 2])
                    threading.Timer(self.trace_finishes_after, path.write_bytes, [whole]).start()
            self._reply({"success": True})
            return
        self.generate_ports.append(self.client_address[1])
        self.new_tokens.append(body["sampling_params"]["max_new_tokens"])
        ids = body["input_ids"]
        delay = 0.06 if ids[0] % 2 == self.slow_parity else 0.02
        time.sleep(delay)
        n = body["sampling_params"]["max_new_tokens"]
        output = [ids[i % len(ids)] for i in range(n)] if self.slow_parity is not None else [5] * n
        meta = {"completion_tokens": n, "e2e_latency": delay}
        self._reply({"output_ids": output, "meta_info": meta})


@pytest.fixture
def stub_url() -> Iterator[str]:
    with serving(SweepStub) as url:
        yield url
    SweepStub.write_trace = True
    SweepStub.trace_finishes_after = None
    SweepStub.slow_parity = None
    SweepStub.flushes.clear()
    SweepStub.generate_ports.clear()
    SweepStub.opened.clear()
    SweepStub.profile_calls.clear()
    SweepStub.new_tokens.clear()
    SweepStub.kernels = DEFAULT_KERNELS


def test_waves_run_after_the_sweep_on_the_same_server_under_a_kind_of_their_own(
    stub_url, tmp_path
):
    """WAVES=A,B: after a server's sweep, one-wave levels at both lengths from that server,
    named VARIANT-waves@N so that further servers pool with the first (wave_fit.py)."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(
        "#!/bin/bash\n"  # the server: alive until killed; SweepStub answers on its port
        'if [ "$1 $2" = "-m sglang.launch_server" ]; then exec sleep 60; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    stub.chmod(0o755)
    home, out = tmp_path / "kit", tmp_path / "out"
    env = {**os.environ, "PY": str(stub), "KIT_HOME": str(home), "OUT": str(out),
           "PORT": stub_url.rsplit(":", 1)[1], "HEALTH_TIMEOUT": "20", "DEADLINE": "600",
           "LEVELS": "2", "DURATION": "0.2", "REPEATS": "1", "WAVES": "4,8",
           "WAVE_LEVELS": "2,3", "WAVE_REPEATS": "2"}
    done = subprocess.run(["bash", str(KIT / "scripts" / "run.sh"), "session", "base@2"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"base@2", "base-waves@2"}
    assert all("duration_s" in d for d in results["base@2"]["levels"])
    waves = results["base-waves@2"]["levels"]
    assert sorted((d["concurrency"], d["olen"], d["requests"]) for d in waves) == [
        (2, 4, 2), (2, 4, 2), (2, 8, 2), (2, 8, 2), (3, 4, 3), (3, 4, 3), (3, 8, 3), (3, 8, 3)]
    assert not any("duration_s" in d for d in waves)


def test_client_levels_run_for_their_duration_and_repeat(stub_url, tmp_path):
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, str(KIT / "scripts" / "client.py"), stub_url, str(out), "s",
           "--levels", "1,4", "--greedy", "1", "--olen", "8", "--duration", "0.5", "--repeats", "2"]
    (tmp_path / "triton").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TVM_FFI_CACHE_DIR"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # the server's, as run.sh exports it
    subprocess.run(cmd, check=True, capture_output=True, timeout=60, env=env)
    result = json.loads(out.read_text())
    assert result["server_info"]["version"] == "stub"  # the result names the server it measured
    assert result["effective_args"]["version"] == "stub"
    assert result["effective_args"]["speculative_algorithm"] is None
    levels = result["levels"]
    assert [(d["concurrency"], d["repeat"]) for d in levels] == [(1, 0), (1, 1), (4, 0), (4, 1)]
    for d in levels:
        assert d["wall_s"] >= 0.5
        # a closed loop: every client sent its next request until the time was up (20 ms each)
        assert d["requests"] >= 10 * d["concurrency"], d
        assert d["output_tokens"] == 8 * d["requests"]
        # each client's rate over its own requests (>= 20 ms each), summed
        assert d["output_tok_per_s"] <= d["loaded_tok_per_s"] <= d["concurrency"] * 8 / 0.02
        # by the server's own 20 ms per request, without HTTP and the client
        assert d["server_tok_per_s"] == pytest.approx(d["concurrency"] * 8 / 0.02)
        assert d["server_tok_per_s"] > d["loaded_tok_per_s"]
        # each client's first request alone and the rest: the same 20 ms stub either way
        for split in ("first_requests_tok_per_s", "after_first_tok_per_s"):
            assert 0 < d[split] <= d["concurrency"] * 8 / 0.02, (split, d)
        # every client's requests but those in flight when the first client stopped
        assert d["concurrency"] * 10 <= d["full_load_requests"] <= d["requests"], d
        assert 0 < d["full_load_tok_per_s"] <= d["concurrency"] * 8 / 0.02
        assert 0 < d["mean_outside_server_ms"] < 20
        assert set(d["client_gc"]) == {"collections", "total_ms", "longest_ms"}
        assert 0 <= d["first_sends_span_ms"] < 1000 * d["wall_s"]  # together.py
        assert d["cache_flushed"] is True
        assert "gpu" in d  # None where no nvidia-smi answers
        # the host as the level met it: no SGLang process here, the client itself sampled
        client = d["host"]["processes"]["client"]
        assert client["pid"] not in (os.getpid(), None) and client["cpu_pct"] >= 0
        assert d["jit_compiled"] == {"triton": {"new_files": 0, "kernels": []}}
    # the radix cache was emptied once before each level, before its first request
    assert len(SweepStub.flushes) == len(levels)


def test_a_closed_loop_with_a_length_spread_asks_each_prompt_for_its_own_length(
    stub_url, tmp_path
):
    """--olen-spread 0.5: each prompt of the pool its own length in olen * (1 +- 0.5), the
    same on every server (two runs agree), so the requests do not run in waves."""
    def closed_loop(name: str) -> dict:
        out = tmp_path / f"{name}.json"
        cmd = [sys.executable, str(KIT / "scripts" / "client.py"), stub_url, str(out), name,
               "--levels", "4", "--greedy", "1", "--olen", "40", "--duration", "0.3",
               "--olen-spread", "0.5"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        return json.loads(out.read_text())

    first, second = closed_loop("a"), closed_loop("b")
    (level,) = first["levels"]
    assert level["olen_spread"] == 0.5
    assert level["output_tokens"] != 40 * level["requests"]
    firsts = [len(ids) for ids in first["greedy_at_max_conc"]]
    assert all(20 <= n <= 60 for n in firsts) and len(set(firsts)) > 1
    assert firsts == [len(ids) for ids in second["greedy_at_max_conc"]]


def test_a_length_spread_outside_0_to_1_is_refused(stub_url, tmp_path):
    cmd = [sys.executable, str(KIT / "scripts" / "client.py"), stub_url,
           str(tmp_path / "x.json"), "x", "--olen-spread", "1.0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().endswith("--olen-spread must be in [0, 1), got 1.0")
    assert not (tmp_path / "x.json").exists()


def test_one_wave_levels_run_at_each_output_length(stub_url, tmp_path):
    out = tmp_path / "waves.json"
    cmd = [sys.executable, str(KIT / "scripts" / "client.py"), stub_url, str(out), "s",
           "--levels", "4", "--greedy", "1", "--min-reqs", "4", "--mult", "1",
           "--olens", "3,9", "--repeats", "2"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    levels = json.loads(out.read_text())["levels"]
    assert [(d["concurrency"], d["olen"], d["repeat"]) for d in levels] == [
        (4, 3, 0), (4, 3, 1), (4, 9, 0), (4, 9, 1)]
    for d in levels:
        assert d["requests"] == 4 and d["output_tokens"] == 4 * d["olen"]  # one wave each
        assert 0 <= d["first_sends_span_ms"] < 1000 * d["wall_s"]
        assert "duration_s" not in d


def test_the_loaded_rate_is_each_clients_tokens_over_its_busy_time():
    """Two clients: one finished two requests of 8 tokens in 0.1 s each, the other one request
    of 8 tokens that ran 0.35 s past the deadline (the drain). Each client's rate counts."""
    import client

    fast = [({"meta_info": {"completion_tokens": 8}}, 0.1)] * 2
    slow = [({"output_ids": [1] * 8}, 0.35)]
    assert client.loaded_rate([fast, slow, []]) == pytest.approx(16 / 0.2 + 8 / 0.35)


def test_the_loaded_rate_splits_into_each_clients_first_request_and_the_rest():
    import client

    fast = [({"meta_info": {"completion_tokens": 8}}, 0.1), ({"output_ids": [1] * 4}, 0.2)]
    slow = [({"output_ids": [1] * 8}, 0.35)]
    first, after = client.loaded_rate_split([fast, slow, []])
    assert first == pytest.approx(8 / 0.1 + 8 / 0.35)
    assert after == pytest.approx(4 / 0.2)  # the slow client ran no second request


def test_the_full_load_rate_leaves_out_a_partial_wave_after_the_first_client_stopped():
    """Three clients in step, waves of 1 s: the deadline fell inside the second wave's returns,
    so two clients ran a third request (at concurrency 2, in 0.8 s) and one stopped. The loaded
    rate counts the faster third wave; the full-load rate stops where the first client did."""
    import client

    def wave(end, lat=1.0):
        return ({"output_ids": [1] * 10}, lat, end)

    stopped = [wave(1.0), wave(2.0)]
    went_on = [wave(1.0), wave(2.004), wave(2.804, 0.8)]  # answers of one wave: ms apart
    parts = [stopped, went_on, list(went_on), []]
    assert client.loaded_rate(parts) == pytest.approx(10 + 2 * 30 / 2.8)
    assert client.full_load_rate(parts) == (pytest.approx(30.0), 6)
    # answers up to 5 % of the median latency (1 s) after the first client's last one count
    assert client.full_load_rate([stopped, [wave(1.0), wave(2.04)]])[1] == 4
    assert client.full_load_rate([stopped, [wave(1.0), wave(2.06)]])[1] == 3
    assert client.full_load_rate([[], []]) == (0.0, 0)


def test_the_server_rate_is_each_clients_tokens_over_the_servers_times():
    import client

    fast = [({"meta_info": {"completion_tokens": 8, "e2e_latency": 0.08}}, 0.1)] * 2
    slow = [({"meta_info": {"completion_tokens": 8, "e2e_latency": 0.3}}, 0.35)]
    assert client.server_rate([fast, slow, []]) == pytest.approx(16 / 0.16 + 8 / 0.3)
    assert client.server_rate([fast, [({"output_ids": [1]}, 0.1)]]) is None  # no server time


def test_gc_pauses_counts_the_collections_made_while_it_is_open():
    import gc

    from gc_pauses import GcPauses

    gc.disable()  # only the collections asked for below
    try:
        with GcPauses() as pauses:
            gc.collect()
            gc.collect(0)
        gc.collect()  # after the block: not counted
    finally:
        gc.enable()
    summary = pauses.summary()
    assert summary["collections"] == [1, 0, 1]
    assert 0 < summary["longest_ms"] <= summary["total_ms"]


def test_each_client_thread_keeps_one_connection(stub_url, tmp_path):
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, str(KIT / "scripts" / "client.py"), stub_url, str(out), "s",
           "--levels", "2", "--greedy", "1", "--olen", "8", "--duration", "0.5"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    ports = SweepStub.generate_ports
    assert len(ports) >= 4 + 1 + 2 * 10  # warm-up, greedy, a 0.5 s level of 2 clients
    assert len(set(ports)) <= 4 + 1 + 2  # one connection per thread


def test_a_levels_clients_are_released_together_once_every_connection_is_open(
    stub_url, monkeypatch
):
    """together.py: the c clients of a level open their connections, then run from one t0, so
    the level's first requests leave together (clients that connected on their first request
    sent them spread out, and an idle server prefilled them in two groups). The last client
    to connect is slow at it; none may start before it has."""
    import keepalive
    import together

    events: list[str] = []
    lock = threading.Lock()

    def slow_last_connect(url: str, timeout: float) -> None:
        with lock:
            last = sum(e == "connect" for e in events) == 15
        if last:
            time.sleep(0.1)
        keepalive.connect(url, timeout)
        with lock:
            events.append("connect")

    monkeypatch.setattr(together, "connect", slow_last_connect)
    body = {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 2}}

    def client(k: int, t0: float) -> tuple[int, float]:
        with lock:
            events.append("client")
        keepalive.post_json(stub_url, "/generate", body, 10)
        return k, t0

    results, t0, span_ms = together.run_together(16, client, stub_url, 10)
    assert events == ["connect"] * 16 + ["client"] * 16
    assert results == [(k, t0) for k in range(16)]
    assert 0 <= span_ms < 100  # released at once: not the slow connect's 100 ms
    # each request went over the connection its thread opened beforehand: 16 connections
    assert len(SweepStub.opened) == len(set(SweepStub.generate_ports)) == 16


def test_the_start_benchmark_prints_both_starts_side_by_side():
    done = subprocess.run(
        [sys.executable, str(KIT.parent / "client_start.py"), "--levels", "4,8", "--repeats", "1"],
        capture_output=True, text=True, timeout=120, check=True)
    rows = [line for line in done.stdout.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [row.split("|")[1].strip() for row in rows] == ["4", "8"]
    for row in rows:
        first, both, ratio = (float(x) for x in row.split("|")[2:5])
        assert first > 0.005 and both > 0
        # each figure is printed to 0.01, so within 0.005 of the value it was computed from
        # (CI once printed 0.32 / 0.10 / 0.33: 0.10 / 0.32 is 0.3125)
        low, high = (both - 0.005) / (first + 0.005), (both + 0.005) / (first - 0.005)
        assert low - 0.005 <= ratio <= high + 0.005


def test_a_server_that_refuses_the_early_connection_is_reported_by_the_first_request():
    import socket

    import keepalive

    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    keepalive.connect(url, 5)  # says nothing
    with pytest.raises(ConnectionRefusedError):
        keepalive.post_json(url, "/generate", {}, 5)


def test_a_connection_the_server_closed_while_idle_is_opened_again(stub_url):
    import client

    client.a = client.parse([stub_url, "unused.json", "s"])
    body = {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert client.post("/generate", body)["output_ids"] == [5, 5]
    time.sleep(3 * SweepStub.timeout)  # the stub has closed the connection by now
    assert client.post("/generate", body)["output_ids"] == [5, 5]
    assert len(set(SweepStub.generate_ports)) == 2


def test_greedy_outputs_under_load_are_kept_by_prompt(stub_url, tmp_path):
    """Two servers whose timings differ (which prompts answer slowly is swapped) finish
    different numbers of requests per client; the outputs kept for comparison are still
    those of the same 16 prompts, in prompt order."""
    kept = []
    for parity in (0, 1):
        SweepStub.slow_parity = parity
        out = tmp_path / f"sweep-{parity}.json"
        cmd = [sys.executable, str(KIT / "scripts" / "client.py"), stub_url, str(out), "s",
               "--levels", "16", "--greedy", "1", "--olen", "4", "--duration", "0.4"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        kept.append(json.loads(out.read_text())["greedy_at_max_conc"])
    assert len(kept[0]) == 16 and None not in kept[0]
    assert len({tuple(o) for o in kept[0]}) == 16  # 16 different prompts (their first ids)
    assert kept[0] == kept[1]


def run_profile(url: str, tmp_path: Path) -> dict:
    cmd = [sys.executable, str(KIT / "scripts" / "profile_steps.py"), url, str(tmp_path), "p",
           "--concurrency", "2", "--steps", "5", "--settle", "0.1"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return json.loads((tmp_path / "p.profile.json").read_text())


def test_profile_reads_gpu_busy_time_and_top_kernels(stub_url, tmp_path):
    report = run_profile(stub_url, tmp_path)
    # kernels [0,10] and [5,15] overlap: busy 15 + 10 = 25 us of a 30 us span; CPU ops ignored
    assert report["gpu_busy_fraction"] == round(25 / 30, 3)
    assert report["wall_ms_per_step"] == round(0.030 / 5, 3)
    assert [(k["name"], k["calls"]) for k in report["top_kernels"]] == [("gemm", 2), ("attn", 1)]


def test_a_trace_still_being_written_is_read_once_it_is_whole(stub_url, tmp_path):
    """The server writes its trace after the profiled steps; read half-written, a gzip ends
    mid-stream (two of four servers of an H100 hold, 2026-12-06): the profile waits until the
    file stops growing and reads to its end."""
    SweepStub.trace_finishes_after = 3.0  # longer than the 2 s the profile used to allow
    report = run_profile(stub_url, tmp_path)
    assert report["gpu_busy_fraction"] == round(25 / 30, 3)


def test_a_trace_that_never_becomes_whole_fails_the_profile_naming_the_wait(stub_url, tmp_path):
    SweepStub.trace_finishes_after = 60.0
    cmd = [sys.executable, str(KIT / "scripts" / "profile_steps.py"), stub_url, str(tmp_path),
           "p", "--concurrency", "2", "--steps", "5", "--settle", "0.1"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120,
                   env={**os.environ, "PROFILE_WAIT_S": "1.5"})
    report = json.loads((tmp_path / "p.profile.json").read_text())
    assert re.fullmatch(r"RuntimeError: no whole trace written under \S+ in 1.5 s",
                        report["error"])


def test_a_wave_profile_splits_prefill_from_decode_and_lists_idle_gaps(stub_url, tmp_path):
    """--wave: the cache emptied, the trace started, the wave's requests sent, then stopped;
    the window splits at the first decode-attention kernel, and the idle gaps over 200 us are
    counted where they lie."""
    SweepStub.kernels = (
        ("extend", 0.0, 100.0),
        ("gemm", 150.0, 300.0),  # 50 us idle before it: not a gap
        ("_fwd_grouped_kernel_stage1", 600.0, 650.0),  # 300 us idle: the prefill phase's gap
        ("gemm", 650.0, 700.0),
        ("gemm", 1000.0, 1100.0),  # 300 us idle in the decode phase
    )
    cmd = [sys.executable, str(KIT / "scripts" / "profile_steps.py"), stub_url, str(tmp_path),
           "w", "--concurrency", "3", "--wave", "4", "--plen", "8"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    report = json.loads((tmp_path / "w.profile.json").read_text())
    assert len(SweepStub.flushes) == 1
    assert SweepStub.profile_calls == [("/start_profile", 0), ("/stop_profile", 3)]
    assert (report["wall_ms"], report["gpu_busy_ms"]) == (1.1, 0.45)
    prefill, decode = report["prefill_phase"], report["decode_phase"]
    assert (prefill["wall_ms"], prefill["gpu_busy_ms"], prefill["kernels"]) == (0.3, 0.25, 2)
    assert (decode["wall_ms"], decode["gpu_busy_ms"], decode["decode_marker_calls"]) == (
        0.5, 0.2, 1)
    gaps = report["idle_gaps"]
    assert (gaps["count"], gaps["total_ms"], gaps["in_prefill_phase_ms"]) == (2, 0.6, 0.3)
    assert [(g["at_ms"], g["after"], g["before"]) for g in gaps["largest"]] == [
        (0.3, "gemm", "_fwd_grouped_kernel_stage1"), (0.7, "gemm", "gemm")]


def test_back_to_back_waves_trace_the_time_outside_the_steady_decode_steps(stub_url, tmp_path):
    """--waves 2: each client sends its second request when its first returns; every --layers
    decode-attention kernels start a step, and the time before the first step, each interval
    beyond the median step and the tail add up to the time outside the steady steps."""
    marker = "_fwd_grouped_kernel_stage1"
    steps = (100.0, 200.0, 300.0, 800.0, 900.0)  # 500 us between the third and the fourth
    SweepStub.kernels = (
        ("extend", 0.0, 100.0),
        *((marker, t + d, t + d + 5.0) for t in steps for d in (0.0, 10.0)),
        ("extend", 400.0, 700.0),  # the next wave's prefill
        ("gemm", 930.0, 950.0),
    )
    cmd = [sys.executable, str(KIT / "scripts" / "profile_steps.py"), stub_url, str(tmp_path),
           "w", "--concurrency", "3", "--wave", "4", "--plen", "8", "--waves", "2",
           "--layers", "2"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    report = json.loads((tmp_path / "w.profile.json").read_text())
    assert SweepStub.profile_calls == [("/start_profile", 0), ("/stop_profile", 6)]
    assert report["waves"] == 2
    assert (report["decode_steps"], report["step_ms_median"], report["long_step_intervals"]) == (
        5, 0.1, 1)
    # 100 us before the first step + (500 - 100) us of the long interval; the tail is shorter
    # than a step
    assert report["outside_steady_steps_ms"] == 0.5


def test_a_loaded_profile_splits_the_intervals_that_hold_a_prefill(stub_url, tmp_path):
    """Every --layers decode-attention kernels start a decode step; the intervals that hold a
    prefill-attention kernel are set against the decode-only ones: their extra wall, GPU busy
    and idle time, per interval and per prefill forward, and by kernel what they run beyond
    them. With --olen-spread each request asks for OLEN * (1 +- S) tokens."""
    marker = "_fwd_grouped_kernel_stage1"
    # the third and the fifth interval hold a prefill: 200 us each
    steps = (0.0, 100.0, 200.0, 400.0, 500.0, 700.0)
    SweepStub.kernels = tuple(
        sorted(
            [
                *((marker, t + d, t + d + 5.0) for t in steps for d in (0.0, 10.0)),
                *(("gemm", t + 25.0, t + 80.0) for t in steps),  # 10 us idle before each
                ("_fwd_kernel", 295.0, 300.0),  # the prefill's attention, 15 us idle before
                ("_fwd_kernel_stage2", 300.0, 340.0),  # not the prefill marker: matched exactly
                ("_fwd_kernel", 595.0, 600.0),  # the second prefill, 15 us idle before
            ],
            key=lambda k: k[1],
        )
    )
    cmd = [sys.executable, str(KIT / "scripts" / "profile_steps.py"), stub_url, str(tmp_path),
           "p", "--concurrency", "4", "--steps", "5", "--settle", "0.3", "--layers", "2",
           "--olen", "100", "--olen-spread", "0.5", "--gap-us", "8"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    intervals = json.loads((tmp_path / "p.profile.json").read_text())["intervals"]
    assert intervals["decode_only"] == {"count": 3, "wall_ms_median": 0.1,
                                        "gpu_busy_ms_mean": 0.065}
    prefill = intervals["with_prefill"]
    assert (prefill["count"], prefill["prefill_marker_calls"]) == (2, 2)
    assert (prefill["wall_ms_mean"], prefill["gpu_busy_ms_mean"]) == (0.2, 0.09)
    assert (prefill["extra_wall_ms"], prefill["extra_gpu_busy_ms"], prefill["extra_idle_ms"]) == (
        0.1, 0.025, 0.075)
    # two marker calls at --layers 2: one prefill forward in two intervals, so per forward
    # twice an interval's extra
    assert prefill["prefill_forwards"] == 1.0
    assert prefill["per_prefill_ms"] == {"wall": 0.2, "gpu_busy": 0.05, "idle": 0.15}
    beyond = [(k["name"], k["ms_per_interval"]) for k in prefill["kernels_beyond_decode"]]
    assert beyond[:2] == [("_fwd_kernel_stage2", 0.02), ("_fwd_kernel", 0.005)]
    # idle longer than 8 us inside them: 215-225, 280-295, 515-525, 580-595 (the 5 us gaps
    # between markers are shorter; the decode-only intervals' own 10 us gaps are not counted)
    gaps = prefill["idle_gaps"]
    assert (gaps["count"], gaps["ms_per_interval"]) == (4, 0.025)
    assert [(g["at_ms"], g["after"], g["before"]) for g in gaps["largest"]] == [
        (0.28, "gemm", "_fwd_kernel"), (0.58, "gemm", "_fwd_kernel"), (0.215, marker, "gemm"),
        (0.515, marker, "gemm")]
    assert all(50 <= n <= 150 for n in SweepStub.new_tokens), SweepStub.new_tokens
    assert len(set(SweepStub.new_tokens)) > 1


def test_profile_refuses_an_output_spread_of_one_or_more(stub_url, tmp_path):
    cmd = [sys.executable, str(KIT / "scripts" / "profile_steps.py"), stub_url, str(tmp_path),
           "p", "--olen-spread", "1.0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--olen-spread must be in [0, 1)" in done.stderr


def test_profile_without_a_trace_says_so(stub_url, tmp_path):
    SweepStub.write_trace = False
    cmd = [sys.executable, str(KIT / "scripts" / "profile_steps.py"), stub_url, str(tmp_path),
           "p", "--concurrency", "1", "--steps", "5", "--settle", "0.1"]
    env = dict(os.environ, PROFILE_WAIT_S="1")
    subprocess.run(cmd, check=True, capture_output=True, timeout=120, env=env)
    report = json.loads((tmp_path / "p.profile.json").read_text())
    assert "no trace written" in report["error"]


def test_env_seed_gives_the_envelope_client_its_seed(tmp_path):
    """``ENV_SEED=N``: every envelope call of the session (its estimate first) takes ``--seed
    N``, other draws than the default's, the same on each server; unset, none."""
    calls = tmp_path / "calls"
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(
        "#!/bin/bash\n"
        f'case "$1" in *envelope.py) echo "$*" >> {calls};; esac\n'
        'if [ "$1 $2" = "-m sglang.launch_server" ]; then exit 1; fi\n'
        'if [ "$1" = "-c" ]; then exit 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    stub.chmod(0o755)
    for seed, variant in (("5", "env-base"), (None, "env-base@2")):
        env = {**os.environ, "PY": str(stub), "KIT_HOME": str(tmp_path / "kit"),
               "OUT": str(tmp_path / "out"), "HEALTH_TIMEOUT": "2", "DEADLINE": "600",
               "ENV_LEVELS": "16", "REGIONS": "mix"}
        env.pop("ENV_SEED", None)
        if seed is not None:
            env["ENV_SEED"] = seed
        done = subprocess.run(["bash", str(KIT / "scripts" / "run.sh"), "session", variant],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    seeded, unseeded = calls.read_text().splitlines()
    assert " --seed 5 " in f"{seeded} " and "--estimate" in seeded
    assert "--seed" not in unseeded
