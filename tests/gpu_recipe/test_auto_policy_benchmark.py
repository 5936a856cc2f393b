"""benchmarks/auto_policy.py: the simulated envelope drives the installed runtime's own
controllers; its server model must give the orderings any real server gives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import auto_policy  # noqa: E402
import pytest  # noqa: E402


def level(kind: str, region: str, conc: int) -> auto_policy.LevelResult:
    return auto_policy.Simulation(kind, seed=1).level(region, conc, 1.0, 64, 0.5)


def test_speculation_pays_only_where_the_draft_is_accepted_and_the_batch_is_small():
    assert level("eagle", "accept90", 1).tok_s > 2 * level("plain", "accept90", 1).tok_s
    assert level("eagle", "accept0", 1).tok_s < level("plain", "accept0", 1).tok_s
    assert level("eagle", "accept50", 128).tok_s < level("plain", "accept50", 128).tok_s
    # a fixed T runs plain steps above T: at c = 128 about what plain decoding gives
    fixed, plain = level("T16", "accept90", 128), level("plain", "accept90", 128)
    assert 0.9 < fixed.tok_s / plain.tok_s <= 1.0
    assert fixed.switches >= 1


def test_auto_leaves_speculation_under_load_and_keeps_it_where_it_wins():
    def steps(region: str, conc: int) -> tuple[int, int]:
        """(speculative, plain) decode steps of auto's second level, at c, after c = 1."""
        sim = auto_policy.Simulation("auto", seed=1)
        sim.level(region, 1, 1.0, 64, 0.5)
        policy = sim.server.controller.policy
        before = policy.n_spec_steps, policy.n_fallback_steps
        sim.level(region, conc, 2.0, 64, 0.5)
        return policy.n_spec_steps - before[0], policy.n_fallback_steps - before[1]

    spec, plain = steps("accept50", 128)
    assert plain > 5 * spec  # under load: plain steps, but for the ramp, probes and the tail
    spec, plain = steps("accept90", 4)
    assert spec > 5 * plain  # 90 % acceptance at c = 4: speculation


def test_the_benchmark_prints_its_tables_and_worst_ratios():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "auto_policy.py"), "--levels", "1,32", "--regions",
         "accept50", "--duration", "0.5", "--thresholds", "16"],
        capture_output=True, text=True, check=True, timeout=120,
    )
    assert "accept50: simulated output tok/s" in done.stdout
    assert "worst auto ÷ best fixed T" in done.stdout.splitlines()[-1]


def test_at_a_steady_load_of_mixed_requests_auto_switches_once():
    """Mixed traffic (0 / 50 / 90 % acceptance) at c = 16 after c = 1, where plain steps win:
    auto leaves speculation once and stays (it switched three times in the first seconds
    on every H100 server of 2026-12-06, a probe's plain mean calling speculation back)."""
    sim = auto_policy.Simulation("auto", seed=1)
    lines: list[str] = []
    sim.server.controller.policy._log = lines.append
    sim.level("mix", 1, 10.0, 128, 0.5)
    lines.clear()
    sim.level("mix", 16, 30.0, 128, 0.5)
    at_16 = [line for line in lines if "at decode bs=16 " in line]
    assert len(at_16) == 1 and "spec -> fallback" in at_16[0]


def switches_in_a_minute_at_16(seed: int) -> int:
    """The switches auto logs at bs 16 in a 60-s level at c = 16 of the mix, after a 10-s
    level at c = 1."""
    sim = auto_policy.Simulation("auto", seed=seed)
    lines: list[str] = []
    sim.server.controller.policy._log = lines.append
    sim.level("mix", 1, 10.0, 128, 0.5)
    lines.clear()
    sim.level("mix", 16, 60.0, 128, 0.5)
    return len([line for line in lines if "at decode bs=16 " in line])


def test_a_minute_of_mixed_requests_at_a_steady_load_switches_once_at_most():
    """A minute at c = 16 of mixed traffic, five seeds: a probe of 16 requests reads within
    ~17 %, so one read on its estimate alone called speculation back in three of the five
    minutes (three switches each); read at its bound (two standard errors off), none does."""
    for seed in range(1, 6):
        assert switches_in_a_minute_at_16(seed) <= 1, seed


def test_a_minute_at_an_h100s_thinner_margin_switches_once_at_most(monkeypatch):
    """The same minute with an H100's step costs (spec 8.78 / 11.13 ms, plain 6.11 / 6.51 ms
    at bs 1 / 16, 2026-12-06), where speculation loses at c = 16 by ~5 % instead of ~10 %:
    over ten seeds, one probe of 16 requests short of low-acceptance ones read a rise and
    alone called speculation back (three switches); held until the next probe agrees, none."""
    monkeypatch.setattr(auto_policy, "MEASURED", auto_policy.h100_costs(auto_policy.MEASURED))
    assert auto_policy.cost_ms(False, 16) == pytest.approx(6.50, abs=0.01)
    assert auto_policy.cost_ms(True, 16) == pytest.approx(11.12, abs=0.01)
    for seed in range(1, 11):
        assert switches_in_a_minute_at_16(seed) <= 1, seed


def sequence_rows(*args: str) -> list[list[str]]:
    """The table rows ``auto_policy.py --sequence`` prints, as cells."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "auto_policy.py"), *args],
                          capture_output=True, text=True, check=True, timeout=120)
    rows = [line.split("│")[1:-1] for line in done.stdout.splitlines() if line.count("│") == 10]
    return [[cell.strip() for cell in row] for row in rows]


def test_a_sequence_runs_its_levels_in_order_on_the_costs_asked_for():
    """A GPU hold's replay: the levels in the order given, one server each kind through all
    of them; the H100's costs give slower plain steps than the H200's measured ones."""
    levels = "accept90:1:1,accept0:1:2"
    h200, h100 = sequence_rows("--sequence", levels), sequence_rows("--costs", "h100",
                                                                   "--sequence", levels)
    assert [row[:4] for row in h200] == [["1", "accept90", "1", "1"], ["2", "accept0", "1", "2"]]
    assert [row[:4] for row in h100] == [row[:4] for row in h200]
    plain_h200, plain_h100 = float(h200[1][4]), float(h100[1][4])
    assert plain_h100 == pytest.approx(plain_h200 / 1.27, rel=0.05)
    eagle_90, auto_90 = float(h100[0][5]), float(h100[0][6])
    assert auto_90 > 0.9 * eagle_90  # 90 % at one request: auto speculates


def test_a_bad_sequence_level_is_refused_before_anything_runs():
    for bad in ("mix:x:1", "accept70:1:1", "mix:0:1", "mix:1", "mix:1:1:1"):
        done = subprocess.run(
            [sys.executable, str(BENCHMARKS / "auto_policy.py"), "--sequence", bad],
            capture_output=True, text=True, timeout=60,
        )
        assert done.returncode == 2, bad
        assert done.stdout == "" and f"argument --sequence: {bad!r}" in done.stderr


def test_a_round_trip_leaves_the_batch_short_and_restarts_auto_s_probe_gap():
    """A finished request's successor that arrives 12 ms later (two to three plain steps at
    c = 4) leaves the batch one short for a while: plain decoding makes fewer tokens a second,
    and where two requests end close together the batch of 4 halves, which restarts auto's
    probe gap in fallback (the seventeenth hold: 11 probes where the doubling gives 6)."""
    def probes_at_accept0_4(round_trip_ms: float) -> int:
        simulation = auto_policy.Simulation("auto", seed=1, round_trip_ms=round_trip_ms)
        simulation.level("accept0", 4, 10.0, 128, 0.5)
        return simulation.server.controller.policy.n_probes

    plain = [auto_policy.Simulation("plain", seed=1, round_trip_ms=ms).level(
        "accept0", 4, 2.0, 128, 0.5) for ms in (0.0, 12.0)]
    assert plain[1].tok_s < 0.99 * plain[0].tok_s
    probes = [probes_at_accept0_4(ms) for ms in (0.0, 12.0)]
    assert probes[1] > probes[0] + 2, probes
    # One request at a time: the server idles a whole round trip before each successor.
    alone = auto_policy.Simulation("plain", seed=1, round_trip_ms=12.0).level(
        "accept0", 1, 2.0, 64, 0.5)
    idle_ms = 1000.0 * alone.wall_s - sum(alone.extra.values())
    assert round(idle_ms / 12.0) >= 4  # 64-token requests, about 0.35 s each
    assert idle_ms == pytest.approx(12.0 * round(idle_ms / 12.0), abs=1e-6)
