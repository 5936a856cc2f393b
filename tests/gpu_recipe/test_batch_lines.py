"""benchmarks/gpu/batch_lines.py: a closed-loop level's waves from SGLang's own batch lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))

import batch_lines  # noqa: E402

C = 4


def decode(second: int, bs: int, ms: float) -> str:
    """A decode line whose 40 steps of ``bs`` requests took ``ms``."""
    rate = 40 * bs / (ms / 1000)
    return (f"[2026-12-04 10:00:{second:02d}] Decode batch, #running-req: {bs}, #token: 99, "
            f"token usage: 0.00, cuda graph: True, gen throughput (token/s): {rate:.4f}, "
            "#queue-req: 0")


def prefill(second: int, new: int, running: int) -> str:
    return (f"[2026-12-04 10:00:{second:02d}] Prefill batch, #new-seq: {new}, #new-token: 9, "
            f"#cached-token: 0, token usage: 0.00, #running-req: {running}, #queue-req: 0")


def wave_in_step(second: int, boundary_ms: float, steady_ms: float, lines: int = 3) -> list[str]:
    """Two prefills on an empty batch, a boundary line, then ``lines - 1`` steady ones."""
    return [prefill(second, 1, 0), prefill(second, C - 1, 1),
            decode(second, C, steady_ms + boundary_ms),
            *[decode(second, C, steady_ms) for _ in range(lines - 1)]]


def log(tmp_path: Path, name: str, lines: list[str]) -> str:
    path = tmp_path / name
    path.write_text("\n".join(["server starting", *lines]) + "\n")
    return str(path)


def figures_of(tmp_path: Path, name: str, lines: list[str]) -> dict:
    return batch_lines.summary(batch_lines.waves(batch_lines.read_lines(log(tmp_path, name,
                                                                            lines)), C))


def test_waves_in_step_give_boundary_steady_time_and_rate(tmp_path):
    lines = [decode(0, C, 100.0)]
    for second in (1, 2, 3):
        lines += wave_in_step(second, boundary_ms=300.0, steady_ms=100.0)
    lines += [prefill(4, C, 0), decode(4, C, 400.0), decode(4, C, 100.0)]  # a 4th boundary
    found = batch_lines.waves(batch_lines.read_lines(log(tmp_path, "a.log", lines)), C)
    assert len(found) == 3 and all(w.in_step for w in found)
    assert [round(w.boundary_ms, 6) for w in found] == [300.0, 300.0, 300.0]
    figures = figures_of(tmp_path, "a.log", lines)
    assert figures["steady_ms"] == pytest.approx(100.0)
    assert figures["prefills"] == 2.0
    # each wave: 3 lines of 160 tokens in 600 ms
    assert figures["tok_s"] == pytest.approx(3 * 160 / 0.6)


def test_a_wave_whose_requests_fell_out_of_step_is_counted_apart(tmp_path):
    lines = [decode(0, C, 100.0), *wave_in_step(1, 300.0, 100.0)]
    # half the requests a step behind: their prefill comes while the other half still run
    lines += [prefill(2, 2, 2), decode(2, C, 500.0), decode(2, C, 100.0)]
    lines += [prefill(3, C, 0), decode(3, C, 400.0), decode(3, C, 100.0)]
    found = batch_lines.waves(batch_lines.read_lines(log(tmp_path, "b.log", lines)), C)
    assert [w.in_step for w in found] == [True, False]
    figures = figures_of(tmp_path, "b.log", lines)
    assert (figures["in_step"], figures["all"]) == (1, 2)


def test_the_window_keeps_only_its_lines(tmp_path):
    lines = [decode(0, C, 100.0), *wave_in_step(1, 300.0, 100.0), *wave_in_step(2, 300.0, 100.0),
             *wave_in_step(5, 900.0, 100.0), *wave_in_step(6, 900.0, 100.0),
             *wave_in_step(7, 900.0, 100.0)]
    path = log(tmp_path, "c.log", lines)
    assert batch_lines.split_window(f"{path}@10:00:00-10:00:02") == (path, "10:00:00", "10:00:02")
    assert batch_lines.split_window(path) == (path, None, None)
    assert batch_lines.split_window("dyn-v2@2.server.log") == ("dyn-v2@2.server.log", None, None)
    assert batch_lines.split_window("b@2.log@10:00:05-") == ("b@2.log", "10:00:05", None)
    early = batch_lines.waves(batch_lines.read_lines(path, "10:00:00", "10:00:02"), C)
    late = batch_lines.waves(batch_lines.read_lines(path, "10:00:04", None), C)
    assert [round(w.boundary_ms) for w in early] == [300]
    assert [round(w.boundary_ms) for w in late] == [900]  # the window's first has no line before


def test_the_table_compares_the_patched_log_with_the_plain_one(tmp_path):
    def level(boundary: float, steady: float) -> list[str]:
        lines = [decode(0, C, steady)]
        for second in (1, 2, 3):
            lines += wave_in_step(second, boundary, steady)
        return [*lines, prefill(4, C, 0), decode(4, C, steady + boundary), decode(4, C, steady)]

    patched = log(tmp_path, "dyn-v2.server.log", level(340.0, 102.0))
    plain = log(tmp_path, "base.server.log", level(300.0, 100.0))
    out = subprocess.run([sys.executable, str(GPU / "batch_lines.py"), patched, plain, "-c", "4"],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("level 1 (after the log's flush 1)")
    assert "| patched: dyn-v2.server.log | 3 / 3 | 2.0 | 340 | 102.0 |" in out
    assert "| plain: base.server.log | 3 / 3 | 2.0 | 300 | 100.0 |" in out
    ratio = (3 * 100 + 300) / (3 * 102 + 340)
    # the level as it ran: after the first wave's boundary, up to the last boundary
    level = (6 * 100 + 2 * 400) / (6 * 102 + 2 * 442)
    assert f"| patched ÷ plain | | | +40 | 0.980 (speed) | {ratio:.3f} | {level:.3f} |" in out


def test_a_log_without_waves_at_that_concurrency_prints_dashes(tmp_path):
    lines = [decode(0, 8, 100.0), *[line.replace("#running-req: 4", "#running-req: 8")
                                    for line in wave_in_step(1, 300.0, 100.0)]]
    figures = figures_of(tmp_path, "d.log", lines)
    assert figures["in_step"] == figures["all"] == 0
    table = batch_lines.table({"patched: d": figures, "plain: d": figures}, C)
    assert "| patched: d | 0 / 0 | – | – | – | – | – |" in table


@pytest.mark.parametrize(
    "second_wave",
    [
        [prefill(2, C, 1), decode(2, C, 400.0), decode(2, C, 100.0)],  # prefilled while one ran
        [prefill(2, 1, 0), prefill(2, 1, 1), decode(2, C, 400.0), decode(2, C, 100.0)],  # half
        [prefill(2, 1, 0), prefill(2, C - 1, 1), decode(2, C, 400.0), decode(2, C, 100.0),
         decode(2, 2, 100.0), decode(2, C, 100.0)],  # a line whose steps ran fewer requests
    ],
    ids=["batch-not-empty", "not-all-requests", "smaller-batch"],
)
def test_each_sign_of_a_wave_out_of_step(tmp_path, second_wave):
    lines = [decode(0, C, 100.0), *wave_in_step(1, 300.0, 100.0), *second_wave,
             *wave_in_step(3, 300.0, 100.0)]
    found = batch_lines.waves(batch_lines.read_lines(log(tmp_path, "e.log", lines)), C)
    assert [w.in_step for w in found] == [True, False]


def test_one_slow_boundary_does_not_move_the_median(tmp_path):
    lines = [decode(0, C, 100.0)]
    for second, boundary in ((1, 300.0), (2, 300.0), (3, 900.0)):
        lines += wave_in_step(second, boundary, 100.0)
    lines += [prefill(4, C, 0), decode(4, C, 400.0), decode(4, C, 100.0)]
    figures = figures_of(tmp_path, "f.log", lines)
    assert figures["boundary_ms"] == pytest.approx(300.0)


FLUSH = "[2026-12-04 10:00:{:02d}] Cache flushed successfully!"


def test_levels_split_at_the_cache_flush_and_pair_their_waves_in_order(tmp_path):
    """Lines before the first flush (warm-up, greedy checks) are dropped; each level's waves
    are compared in order, as many as both ran (the faster server fits more in a level)."""
    def level(second: int, boundaries: list[float], steady: float) -> list[str]:
        lines = [FLUSH.format(second), prefill(second, C, 0), decode(second, C, 900.0),
                 decode(second, C, steady)]
        for n, boundary in enumerate(boundaries):
            lines += wave_in_step(second + 1 + n, boundary, steady)
        return lines

    warmup = [decode(0, 1, 50.0), prefill(0, 1, 0), decode(0, 1, 60.0), decode(0, 1, 50.0)]
    # plain: 4 boundaries (3 whole waves) in each level, the 3rd a cheap one; patched: 3 (2)
    plain = log(tmp_path, "base.log", [*warmup, *level(10, [300.0, 300.0, 50.0, 300.0], 100.0),
                                       *level(30, [300.0] * 4, 100.0)])
    patched = log(tmp_path, "dyn.log", [*warmup, *level(10, [330.0, 330.0, 80.0], 102.0),
                                        *level(30, [330.0] * 3, 102.0)])
    assert [len(lv) for lv in batch_lines.read_levels(plain)] == [23, 23]
    assert batch_lines.concurrency_of(batch_lines.read_levels(plain)[0]) == C
    out = subprocess.run([sys.executable, str(GPU / "batch_lines.py"), patched, plain],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    # in step: the first two waves of each server (the plain server's cheap third left out);
    # the level as it ran: the first 7 lines after the level's start on both
    ratio = (3 * 100 + 300) / (3 * 102 + 330)
    level = (5 * 100 + 2 * 400) / (5 * 102 + 2 * 432)
    assert out.count(f"| +30 | 0.980 (speed) | {ratio:.3f} | {level:.3f} |") == 2
    assert "level 2 (after the log's flush 2)" in out
    assert out.count("| plain: base.log | 2 / 3 |") == 2


def test_only_waves_in_step_on_both_servers_count_as_in_step(tmp_path):
    """The patched server's second wave fell out of step: that wave is left out of both
    servers' in-step figures, so they cover the same prompts."""
    out_of_step = [prefill(2, 2, 2), decode(2, C, 500.0), decode(2, C, 100.0)]
    first = [decode(0, C, 100.0), *wave_in_step(1, 300.0, 100.0)]
    last = [*wave_in_step(3, 300.0, 100.0), prefill(4, C, 0), decode(4, C, 400.0),
            decode(4, C, 100.0)]
    patched = log(tmp_path, "dyn.log", [*first, *out_of_step, *last])
    plain = log(tmp_path, "base.log", [*first, *wave_in_step(2, 300.0, 100.0), *last])
    out = subprocess.run([sys.executable, str(GPU / "batch_lines.py"), patched, plain],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    assert "| patched: dyn.log | 2 / 3 |" in out
    assert "| plain: base.log | 2 / 3 |" in out


def test_with_several_ranks_only_rank_0s_lines_are_read(tmp_path):
    """With TP > 1 each line carries its scheduler's ranks ("[... TP0]"; SGLANG_LOG_MS adds
    milliseconds); every rank logs its own batches, so only rank 0's count."""
    lines = [decode(0, C, 100.0)]
    for second in (1, 2, 3):
        lines += wave_in_step(second, 300.0, 100.0)
    lines += [prefill(4, C, 0), decode(4, C, 400.0), decode(4, C, 100.0)]
    ranked = []
    for line in lines:
        stamp, rest = line.split("]", 1)
        ranked += [f"{stamp}.250 TP0]{rest}", f"{stamp}.250 TP1]{rest}"]
    read = batch_lines.read_lines(log(tmp_path, "tp.log", ranked))
    assert len(read) == len(lines)
    found = batch_lines.waves(read, C)
    assert [round(w.boundary_ms) for w in found] == [300, 300, 300]


def test_the_level_as_it_ran_counts_from_its_first_boundary_to_its_last(tmp_path):
    """The first boundary's lines hold the level's start and are left out, as is everything
    from the last boundary on (the drain); the rate over a number of tokens takes the line
    that reaches it in part."""
    lines = [prefill(0, C, 0), decode(0, C, 5000.0), decode(0, C, 100.0),  # the level's start
             *wave_in_step(1, 300.0, 100.0), *wave_in_step(2, 300.0, 100.0),
             prefill(3, C, 0), decode(3, C, 9000.0), decode(3, C, 100.0)]  # the last boundary
    span = batch_lines.between_boundaries(batch_lines.read_lines(log(tmp_path, "g.log", lines)))
    assert [round(line.ms) for line in span] == [100, 400, 100, 100, 400, 100, 100]
    assert batch_lines.rate_over(span, 160) == pytest.approx(160 / 0.1)
    assert batch_lines.rate_over(span, 240) == pytest.approx(240 / 0.3)  # half the 400 ms
    assert batch_lines.rate_over(span, 7 * 160 + 1) != batch_lines.rate_over(span, 7 * 160 + 1)


def test_a_level_out_of_step_is_compared_over_the_same_first_tokens(tmp_path):
    """Its waves do not pair, so the level as it ran is compared: both servers' rates over as
    many tokens as the shorter of the two holds."""
    def level(ms: float, waves: int) -> list[str]:
        lines = [prefill(0, 2, 0), decode(0, C, 5000.0), decode(0, C, ms)]
        for second in range(1, waves + 1):  # half the requests prefill while half run
            lines += [prefill(second, 2, 2), decode(second, C, ms), decode(second, C, ms)]
        return lines

    patched = log(tmp_path, "dyn.log", level(105.0, 3))
    plain = log(tmp_path, "base.log", level(100.0, 4))
    out = subprocess.run([sys.executable, str(GPU / "batch_lines.py"), patched, plain],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    assert "| patched: dyn.log | 0 / 2 | – | – | – | – | 1524 |" in out
    assert "| plain: base.log | 0 / 3 | – | – | – | – | 1600 |" in out
    assert out.rstrip().endswith("| – | – (speed) | – | 0.952 |")


def test_a_level_out_of_step_is_paired_by_the_batch_it_reached(tmp_path):
    """Out of step, one request finishes while the others run on: most decode lines of a
    level can run c - 1 requests. The level is still the level of c on both servers."""
    def level(second: int, sizes: list[int]) -> list[str]:
        return [FLUSH.format(second), prefill(second, C, 0), decode(second, C, 400.0),
                *[decode(second, size, 100.0) for size in sizes], prefill(second + 1, 1, C - 1),
                decode(second + 1, C, 150.0), decode(second + 1, C, 100.0)]

    patched = log(tmp_path, "dyn.log", level(10, [C, C, C]))
    plain = log(tmp_path, "base.log", level(10, [C - 1] * 5))
    assert batch_lines.concurrency_of(batch_lines.read_levels(plain)[0]) == C
    out = subprocess.run([sys.executable, str(GPU / "batch_lines.py"), patched, plain],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    assert "level 1 (after the log's flush 1)" in out
