"""The envelope benchmark's CPU-checkable parts (issue 16): envelope.py against a stdlib stand-in
for a server of the crafted models on 127.0.0.1, and envelope_report.py's arithmetic and plot."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU / "kit" / "scripts"))
sys.path.insert(0, str(GPU))

import crafted  # noqa: E402
import envelope_report  # noqa: E402
import server_info  # noqa: E402
from stub_http import JsonHandler, serving  # noqa: E402

ACCEPT = {"accept0": 1.0, "accept50": 2.0, "accept90": 3.5}  # the stand-in's accept lengths


class CraftedStub(JsonHandler):
    """Continues prompts as the crafted target does (optionally dropping a token), reports the
    region's accept length, and records the regions in flight at each request's start; empties
    its "cache" on /flush_cache (refusing while a request runs, and the first ``refusals``
    times, as SGLang answers while requests are still running)."""

    drop_at: int | None = None
    refusals = 0
    flushes: ClassVar[list[float]] = []  # when each flush succeeded (time.time())
    lock = threading.Lock()
    lengths: ClassVar[list[int]] = []  # max_new_tokens of each request, in arrival order
    in_flight: ClassVar[list[int]] = []
    seen: ClassVar[list[tuple[str, frozenset[str]]]] = []  # (region, regions in flight then)

    def do_GET(self) -> None:
        self._reply({"speculative_algorithm": "EAGLE3", "version": "stub",
                     "speculative_disable_batch_threshold": "auto"})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/flush_cache":
            with self.lock:
                refuse = bool(self.in_flight) or CraftedStub.refusals > 0
                CraftedStub.refusals = max(0, CraftedStub.refusals - 1)
                if not refuse:
                    self.flushes.append(time.time())
            if refuse:
                self.send_response(400)
                self.send_header("Content-Length", "20")
                self.end_headers()
                self.wfile.write(b"requests are running")
            else:
                self._reply({})
            return
        body = json.loads(body)
        ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        region = crafted.REGIONS[crafted.region_of(ids[0])][0]
        with self.lock:
            self.lengths.append(n)
            self.in_flight.append(crafted.region_of(ids[0]))
            names = frozenset(crafted.REGIONS[i][0] for i in self.in_flight)
            self.seen.append((region, names))
        time.sleep(0.01)
        out = crafted.expected_continuation(ids, n + 1)
        if self.drop_at is not None:
            del out[self.drop_at]
        with self.lock:
            self.in_flight.remove(crafted.region_of(ids[0]))
        self._reply({"output_ids": out[:n],
                     "meta_info": {"completion_tokens": n, "spec_accept_length": ACCEPT[region],
                                   "e2e_latency": 0.01}})


@pytest.fixture
def crafted_url() -> Iterator[str]:
    with serving(CraftedStub) as url:
        yield url
    CraftedStub.drop_at = None
    CraftedStub.refusals = 0
    CraftedStub.flushes.clear()
    CraftedStub.seen.clear()
    CraftedStub.lengths.clear()


def run_envelope(url: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(GPU / "kit" / "scripts" / "envelope.py"), url, str(out), "env-auto",
           "--olen", "8", "--plen", "16", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)


def test_every_region_and_level_is_a_closed_loop_with_checked_outputs(crafted_url, tmp_path):
    out = tmp_path / "env.json"
    done = run_envelope(crafted_url, out, "--levels", "1,4", "--regions", "accept0,accept90,mix",
                        "--duration", "0.3", "--repeats", "2")
    assert "about" in done.stdout.splitlines()[0]  # the estimate is printed before the sweep
    result = json.loads(out.read_text())
    assert result["effective_args"]["speculative_disable_batch_threshold"] == "auto"
    assert result["regions"] == ["accept0", "accept90", "mix"] and result["errors"] == []
    assert [(d["region"], d["concurrency"], d["repeat"]) for d in result["levels"]] == [
        (r, c, rep) for r in ("accept0", "accept90", "mix") for c in (1, 4) for rep in (0, 1)]
    for d in result["levels"]:
        assert d["wall_s"] >= 0.3 and d["failed"] == 0 and d["mismatched"] == 0, d
        # a closed loop: some client sent its next request after its last one returned (how
        # many fit in 0.3 s depends on the machine's load, so no count is asserted)
        assert d["requests"] > d["concurrency"], d
        assert d["output_tokens"] == 8 * d["requests"]
        assert 0 < d["mean_outside_server_ms"] < 1000 * d["mean_latency_s"]  # beyond e2e
        assert 0 <= d["first_sends_span_ms"] < 1000 * d["wall_s"]  # together.py
    by_region = {d["region"]: d["mean_spec_accept_length"] for d in result["levels"]}
    assert by_region["accept0"] == 1.0 and by_region["accept90"] == 3.5
    assert 1.0 < by_region["mix"] < 3.5  # the mix's requests come from every region
    mixed = [names for region, names in CraftedStub.seen[-200:] if len(names) > 1]
    assert any(names == frozenset(ACCEPT) for names in mixed)  # all three in flight at once


def test_burst_levels_run_back_to_back_after_the_sweep_with_their_clock_times(crafted_url,
                                                                           tmp_path):
    out = tmp_path / "env.json"
    run_envelope(crafted_url, out, "--levels", "2", "--regions", "accept0", "--duration", "0.2",
                 "--repeats", "1", "--burst", "1,4,1")
    levels = json.loads(out.read_text())["levels"]
    assert [(d["phase"], d["region"], d["concurrency"]) for d in levels] == [
        ("sweep", "accept0", 2), ("burst", "accept50", 1), ("burst", "accept50", 4),
        ("burst", "accept50", 1)]
    for before, after in itertools.pairwise(levels):
        assert before["started_unix"] < before["ended_unix"] <= after["started_unix"]
        assert after["started_unix"] - before["ended_unix"] < 0.5  # back to back
    # the cache is emptied before each sweep level and before the burst, not inside the burst
    assert [d["cache_flushed"] for d in levels] == [True, True, False, False]
    flushes = CraftedStub.flushes
    assert len(flushes) == 2
    assert flushes[0] <= levels[0]["started_unix"] + 0.01
    assert levels[0]["ended_unix"] <= flushes[1] <= levels[1]["started_unix"] + 0.01
    # the burst measures switching: the envelope table leaves it out
    sweep_only = envelope_report.tok_s({"levels": levels})
    assert sweep_only == {"accept0": {2: levels[0]["output_tok_per_s"]}}


def test_a_refused_flush_is_retried_and_one_that_never_succeeds_is_reported(crafted_url,
                                                                            tmp_path):
    CraftedStub.refusals = 3
    out = tmp_path / "env.json"
    run_envelope(crafted_url, out, "--levels", "1,2", "--regions", "accept0", "--duration",
                 "0.1", "--repeats", "1")
    result = json.loads(out.read_text())
    assert result["flush_cache"] is True and result["errors"] == []
    assert [d["cache_flushed"] for d in result["levels"]] == [True, True]
    assert len(CraftedStub.flushes) == 2

    CraftedStub.refusals = 10
    assert server_info.flush_cache(crafted_url, tries=2) == "HTTP 400: requests are running"
    assert server_info.flush_cache("http://127.0.0.1:9", tries=2).startswith("URLError(")


def test_keep_cache_sends_no_flush(crafted_url, tmp_path):
    out = tmp_path / "env.json"
    run_envelope(crafted_url, out, "--levels", "1", "--regions", "accept0", "--duration", "0.1",
                 "--repeats", "1", "--keep-cache")
    result = json.loads(out.read_text())
    assert result["flush_cache"] is False and CraftedStub.flushes == []
    assert [d["cache_flushed"] for d in result["levels"]] == [False]


def test_a_stream_that_skips_a_token_counts_as_mismatched(crafted_url, tmp_path):
    CraftedStub.drop_at = 3
    out = tmp_path / "env.json"
    run_envelope(crafted_url, out, "--levels", "2", "--regions", "accept50", "--duration", "0.2",
                 "--repeats", "1")
    (level,) = json.loads(out.read_text())["levels"]
    assert level["requests"] > 0 and level["mismatched"] == level["requests"]


def test_a_length_spread_gives_each_request_its_own_checked_length_the_same_on_every_run(
    crafted_url, tmp_path
):
    def lengths_of_one_client(*more: str) -> list[int]:
        CraftedStub.lengths.clear()
        out = tmp_path / "env.json"
        run_envelope(crafted_url, out, "--levels", "1", "--regions", "accept50", "--duration",
                     "0.3", "--repeats", "1", "--olen", "20", "--olen-spread", "0.5", *more)
        result = json.loads(out.read_text())
        assert result["seed"] == (int(more[-1]) if more else 0)  # the draws, recorded
        (level,) = result["levels"]
        assert level["mismatched"] == 0 and level["failed"] == 0  # each checked at its length
        assert level["output_tokens"] == sum(CraftedStub.lengths[-level["requests"]:])
        return CraftedStub.lengths[8:]  # after the 8 warm-up requests (OLEN each)

    first = lengths_of_one_client()
    assert len(first) >= 3 and all(10 <= n <= 30 for n in first) and len(set(first)) > 1
    second = lengths_of_one_client()
    shared = min(len(first), len(second))
    assert first[:shared] == second[:shared]  # one client: the same requests on every server
    reseeded = lengths_of_one_client("--seed", "3")
    assert reseeded[:3] != first[:3]  # another seed: other draws
    assert reseeded[:3] == lengths_of_one_client("--seed", "3")[:3]  # the same on every server
    unspread = subprocess.run(
        [sys.executable, str(GPU / "kit" / "scripts" / "envelope.py"), "-", "-", "-",
         "--olen-spread", "1.0", "--estimate"], capture_output=True, text=True)
    assert unspread.returncode == 2 and "--olen-spread in [0, 1)" in unspread.stderr


def test_the_estimate_counts_levels_regions_repeats_and_the_tail():
    cmd = [sys.executable, str(GPU / "kit" / "scripts" / "envelope.py"), "-", "-", "-",
           "--levels", "1,4,16", "--regions", "accept0,mix", "--duration", "5", "--repeats", "2",
           "--olen", "100", "--estimate"]
    seconds = int(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    assert seconds == round(15 + 3 * 2 * 2 * (5 + 100 * 0.02))
    with_burst = subprocess.run([*cmd, "--burst", "1,64,1"], check=True, capture_output=True,
                                text=True).stdout
    assert int(with_burst) == round(15 + (3 * 2 * 2 + 3) * (5 + 100 * 0.02))
    bad = subprocess.run([*cmd[:5], "--regions", "accept42", "--estimate"], capture_output=True)
    assert bad.returncode == 2
    spread = subprocess.run([*cmd, "--olen-spread", "0.5"], check=True, capture_output=True,
                            text=True).stdout
    assert int(spread) == round(15 + 3 * 2 * 2 * (5 + 150 * 0.02))  # the longest request


def level(region: str, c: int, tok_s: float, repeat: int = 0) -> dict:
    return {"region": region, "concurrency": c, "repeat": repeat, "output_tok_per_s": tok_s,
            "requests": 4, "failed": 0, "mismatched": 0}


RESULTS = {
    # plain decoding measured on one region only: it stands for every region
    "env-base": {"levels": [level("accept90", 1, 200), level("accept90", 64, 7900),
                            level("accept90", 64, 8100, 1)]},
    "env-eagle": {"levels": [level("accept0", 1, 130), level("accept0", 64, 2400),
                             level("accept90", 1, 300), level("accept90", 64, 3000)]},
    "env-fixed-T16": {"levels": [level("accept0", 1, 131), level("accept0", 64, 6800)]},
    "env-fixed-T4": {"levels": [level("accept0", 1, 128), level("accept0", 64, 7000)]},
    "env-auto": {"regions": ["accept0", "accept90"],
                 "effective_args": {"speculative_disable_batch_threshold": "auto"},
                 "levels": [level("accept0", 1, 135), level("accept0", 64, 7600),
                            level("accept90", 1, 290), level("accept90", 64, 7800)]},
}


def test_the_envelope_table_takes_means_the_best_fixed_t_and_both_ratios():
    table = envelope_report.envelope(RESULTS)
    assert list(table) == ["accept0", "accept90"]
    c1, c64 = table["accept0"]
    assert (c64.plain, c64.eagle, c64.auto) == (8000, 2400, 7600)  # plain: mean of 2 repeats
    assert c1.best_fixed == (16, 131) and c64.best_fixed == (4, 7000)
    assert c1.vs_max == pytest.approx(135 / 200) and c64.vs_max == pytest.approx(0.95)
    assert c64.vs_fixed == pytest.approx(7600 / 7000)
    hi1, _ = table["accept90"]
    assert hi1.vs_max == pytest.approx(290 / 300) and hi1.best_fixed is None
    text = envelope_report.markdown(table)
    assert "| 64 | 8000.0 | 2400.0 | 7000.0 (T4) | 7600.0 | 0.950 | 1.086 |" in text
    assert "| 1 | 200.0 | 300.0 | – | 290.0 | 0.967 | – |" in text
    goals = envelope_report.goals(table)
    assert "| accept0 | 0.675 (c = 1) | **not met** | 1.031 (c = 1) | met |" in goals
    assert "| accept90 | 0.967 (c = 1) | met | – | not measured |" in goals


def test_plain_decoding_of_several_regions_stands_for_an_unmeasured_one_by_their_mean():
    results = {
        "env-base": {"levels": [level("accept50", 64, 7000), level("mix", 64, 6000),
                                level("mix", 128, 11000)]},
        "env-auto": {"regions": ["accept50", "accept90"],
                     "levels": [level("accept50", 64, 6800), level("accept90", 64, 9100),
                                level("accept90", 128, 11000)]},
    }
    table = envelope_report.envelope(results)
    (own,) = table["accept50"]
    assert own.plain == 7000  # a region plain decoding ran keeps its own figure
    c64, c128 = table["accept90"]
    assert c64.plain == 6500 and c64.vs_max == pytest.approx(9100 / 6500)
    assert c128.plain == 11000  # the one region that has the level


def test_the_plot_has_a_panel_per_region_and_a_line_per_server(tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps(RESULTS))
    envelope_report.main([str(results)])
    root = ET.fromstring((tmp_path / "envelope.svg").read_text())
    lines = [e.get("data-server") for e in root.iter("{http://www.w3.org/2000/svg}polyline")]
    assert sorted(lines) == sorted(["env-auto", "env-base", "env-eagle", "env-fixed-T4",
                                    "env-fixed-T16", "env-auto", "env-base", "env-eagle"])


def test_a_results_file_that_cannot_be_read_is_one_line_and_exit_2(tmp_path, capsys):
    broken = tmp_path / "results.json"
    broken.write_text("{not json")
    for path in (broken, tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as stop:
            envelope_report.main([str(path)])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"cannot read {path}" in err
    assert not (tmp_path / "envelope.svg").exists()


def test_big_weights_go_out_in_shards_with_an_index(tmp_path, monkeypatch):
    """The 8b target (~16 GB) is written shard by shard; safetensors itself is only on the GPU
    host, so a stand-in save_file records what each shard holds."""
    import types

    import mkweights
    import torch

    written: dict[str, list[str]] = {}
    fake = types.ModuleType("safetensors.torch")
    fake.save_file = lambda part, path, metadata: written.__setitem__(  # type: ignore[attr-defined]
        Path(path).name, [k for k, v in part.items() if v.device.type == "cpu"])
    monkeypatch.setitem(sys.modules, "safetensors", types.ModuleType("safetensors"))
    monkeypatch.setitem(sys.modules, "safetensors.torch", fake)
    tensors = {f"w{i}": torch.zeros(256, dtype=torch.bfloat16) for i in range(5)}  # 512 B each
    monkeypatch.setattr(mkweights, "SHARD_BYTES", 1024)
    assert mkweights.save_sharded(tensors, str(tmp_path)) == 5 * 512
    assert written == {"model-00001-of-00003.safetensors": ["w0", "w1"],
                       "model-00002-of-00003.safetensors": ["w2", "w3"],
                       "model-00003-of-00003.safetensors": ["w4"]}
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 512
    assert index["weight_map"]["w3"] == "model-00002-of-00003.safetensors"

    written.clear()
    monkeypatch.setattr(mkweights, "SHARD_BYTES", 4 << 30)
    mkweights.save_sharded(tensors, str(tmp_path / "one"))
    assert written == {"model.safetensors": list(tensors)}  # the 1b layout, as before


def test_switch_lines_are_laid_against_the_levels_they_happened_in():
    log = "\n".join([
        "[2026-12-01 18:08:51] [dynspec] auto: spec -> fallback at decode bs=64 (padded 64): x",
        "[2026-12-01 18:08:52] Decode batch, #running-req: 64",
        "[2026-12-01 18:09:01] [dynspec] auto: fallback -> spec at decode bs=1 (padded 1): x",
        "[2026-12-01 18:09:02] [dynspec] spec -> fallback at decode bs=32 (threshold=16, ...)",
    ])
    start = 1796148530.4  # 2026-12-01 18:08:50.4 UTC
    result = {"levels": [
        {**level("accept50", 64, 1.0), "phase": "burst", "started_unix": start,
         "ended_unix": start + 4.2},
        {**level("accept50", 1, 1.0), "phase": "burst", "started_unix": start + 10.2,
         "ended_unix": start + 14.3},
    ]}
    rows = envelope_report.switches_per_level(result, log).splitlines()[2:]
    assert rows == [
        "| burst | accept50 | 64 | 1 | 2 s or less (to fallback at bs 64) |",
        "| burst | accept50 | 1 | 1 | 2 s or less (to spec at bs 1) |",  # a fixed T's line: none
    ]


def test_further_servers_of_one_kind_pool_as_repeats_and_show_side_by_side():
    results = {
        "env-auto": {"regions": ["accept50"], "levels": [level("accept50", 64, 7000)]},
        "env-base": {"levels": [level("accept50", 64, 6600)]},
        "env-auto@2": {"levels": [level("accept50", 64, 6000), level("accept50", 128, 11000)]},
        "env-base@2": {"levels": [level("accept50", 64, 7400)]},
    }
    pooled = envelope_report.pooled(results)
    assert list(pooled) == ["env-auto", "env-base"]
    assert pooled["env-auto"]["regions"] == ["accept50"]
    assert len(results["env-auto"]["levels"]) == 1  # the input is left as it was
    c64, c128 = envelope_report.envelope(pooled)["accept50"]
    assert (c64.auto, c64.plain) == (6500, 7000) and c128.auto == 11000
    spread = envelope_report.server_spread(results)
    assert "| env-auto | accept50 | 64 | 7000.0 / 6000.0 | 1.167 |" in spread
    assert "| env-base | accept50 | 64 | 6600.0 / 7400.0 | 1.121 |" in spread
    assert "| 128 |" not in spread  # one server only: nothing to compare
    assert envelope_report.server_spread({"env-auto": results["env-auto"]}) == ""


def test_the_gpu_each_server_ran_on_is_summarised_where_recorded():
    def gpu(mean: float, low: float, hot: float, reasons: list[str]) -> dict:
        return {"samples": 10, "sm_mhz_mean": mean, "sm_mhz_min": low, "mem_mhz_mean": 2619.0,
                "temperature_c_max": hot, "power_w_mean": 600.0, "throttle_reasons": reasons}

    results = {
        "env-auto": {"levels": [{**level("accept50", 64, 7000), "gpu": gpu(1980, 1960, 50, [])},
                                {**level("accept50", 128, 11000),
                                 "gpu": gpu(1900, 1700, 61, ["sw_power_cap"])}]},
        "env-base": {"levels": [{**level("accept50", 64, 6600), "gpu": None}]},
    }
    table = envelope_report.gpu_clocks(results)
    assert "| env-auto | 2 | 1940 | 1700 | 61 | 600 | sw_power_cap |" in table
    assert "env-base" not in table  # nothing recorded there
    assert envelope_report.gpu_clocks({"env-base": results["env-base"]}) == ""


def test_each_auto_servers_log_is_laid_against_its_own_levels(tmp_path, capsys):
    start = 1796148530.4  # 2026-12-01 18:08:50.4 UTC
    results = {
        "env-auto": {"levels": [{**level("accept0", 1, 150.0), "started_unix": start,
                                 "ended_unix": start + 10.0}]},
        "env-auto@2": {"levels": [{**level("accept50", 32, 3600.0),
                                   "started_unix": start + 100.0,
                                   "ended_unix": start + 110.0}]},
        "env-base": {"levels": [level("accept0", 1, 160.0)]},
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    first, second = tmp_path / "first.log", tmp_path / "second=run.log"  # "=" in a path
    first.write_text("[2026-12-01 18:08:53] [dynspec] auto: spec -> fallback at decode bs=1 "
                     "(padded 1): x\n")
    second.write_text("[2026-12-01 18:10:33] [dynspec] auto: spec -> fallback at decode bs=32 "
                      "(padded 32): x\n")
    envelope_report.main([str(path), "--log", str(first), "--log", f"env-auto@2={second}"])
    out = capsys.readouterr().out
    bare = out.split("## auto's switches per level (env-auto)\n")[1].split("##")[0]
    named = out.split("## auto's switches per level (env-auto@2)\n")[1]
    assert "| sweep | accept0 | 1 | 1 | 4 s or less (to fallback at bs 1) |" in bare
    assert "accept50" not in bare
    assert "| sweep | accept50 | 32 | 1 | 4 s or less (to fallback at bs 32) |" in named
    assert "accept0" not in named


def test_a_log_for_a_server_the_results_lack_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"env-auto": {"levels": [level("accept0", 1, 150.0)]}}))
    log = tmp_path / "auto.log"
    log.write_text("")
    for given in (f"env-auto@2={log}", str(tmp_path / "missing.log")):
        with pytest.raises(SystemExit) as stop:
            envelope_report.main([str(path), "--log", given])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "envelope_report.py: " in err
    assert not (tmp_path / "envelope.svg").exists()
