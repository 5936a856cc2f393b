"""DynSpecController: threshold edge, hysteresis, dwell, rank-identical decisions."""

import random

import pytest

from dynspec_patch.transforms.runtime.dynspec_fallback import (
    DEFAULT_MIN_DWELL_STEPS,
    DynSpecController,
    default_resume_below,
    effective_batch_size,
)


def test_batch_equal_to_threshold_keeps_speculating() -> None:
    controller = DynSpecController(threshold=16)
    assert not any(controller.decide(16) for _ in range(100))
    assert controller.n_switches == 0


def test_batch_above_threshold_falls_back_at_once_from_start() -> None:
    controller = DynSpecController(threshold=16)
    assert controller.decide(17) is True
    assert (controller.n_fallback_steps, controller.n_spec_steps) == (1, 0)


def test_default_resume_below() -> None:
    assert default_resume_below(1) == 1  # a decode batch is never empty: 0 would never resume
    assert default_resume_below(2) == 1
    assert default_resume_below(8) == 7
    assert default_resume_below(16) == 14
    assert default_resume_below(64) == 56


def test_hysteresis_band_holds_fallback_until_resume_below() -> None:
    controller = DynSpecController(threshold=16, min_dwell_steps=1, resume_steps=1)
    controller.decide(40)
    # Anything above resume_below (14) keeps the fallback, even at or below T.
    assert all(controller.decide(bs) for bs in (16, 15, 15, 16))
    assert controller.decide(14) is False
    # ... and back in spec mode, anything up to T keeps speculating.
    assert not any(controller.decide(bs) for bs in (15, 16, 15))


def test_band_absorbs_noise_around_threshold() -> None:
    rng = random.Random(7)
    controller = DynSpecController(threshold=32)
    controller.decide(60)
    for _ in range(10_000):
        controller.decide(32 + rng.randint(-2, 2))  # never reaches resume_below = 28
    assert controller.n_switches == 1


def test_dwell_bounds_switch_rate() -> None:
    dwell = DEFAULT_MIN_DWELL_STEPS
    controller = DynSpecController(threshold=4)
    steps = 2_000
    for i in range(steps):
        controller.decide(100 if i % 2 else 1)  # the worst case: flips every step
    assert controller.n_switches <= steps // dwell + 1
    assert controller.n_switches > 0


def test_minimum_dwell_is_respected_after_a_switch() -> None:
    controller = DynSpecController(threshold=4, min_dwell_steps=8, resume_steps=1)
    controller.decide(100)
    decisions = [controller.decide(1) for _ in range(8)]
    assert decisions == [True] * 7 + [False]


def test_counters_add_up() -> None:
    controller = DynSpecController(threshold=4, min_dwell_steps=2)
    sizes = [1, 9, 9, 9, 1, 1, 1, 9, 9]
    decisions = [controller.decide(bs) for bs in sizes]
    assert controller.n_fallback_steps == sum(decisions)
    assert controller.n_spec_steps == len(sizes) - sum(decisions)


def test_one_log_line_per_switch() -> None:
    lines: list[str] = []
    controller = DynSpecController(threshold=4, min_dwell_steps=1, log=lines.append, resume_steps=1)
    for bs in (1, 9, 9, 2, 2, 9):
        controller.decide(bs)
    assert len(lines) == controller.n_switches == 3
    assert lines[0].startswith("[dynspec] spec -> fallback at decode bs=9")
    assert "threshold=4" in lines[0] and "resume_below=3" in lines[0]
    assert lines[1].startswith("[dynspec] fallback -> spec at decode bs=2")


def test_identical_decisions_on_simulated_dp_ranks() -> None:
    rng = random.Random(3)
    ranks = [DynSpecController(threshold=8) for _ in range(4)]
    for _ in range(3_000):
        local = [rng.randint(0, 20) for _ in ranks]  # per-rank decode batch sizes differ
        decisions = {c.decide(effective_batch_size(local[i], local)) for i, c in enumerate(ranks)}
        assert len(decisions) == 1
    assert ranks[0].n_switches > 0


def test_effective_batch_size() -> None:
    assert effective_batch_size(3, None) == 3
    assert effective_batch_size(3, []) == 3
    assert effective_batch_size(3, [1, 7, 2]) == 7


def test_threshold_one_still_resumes_when_load_drops() -> None:
    controller = DynSpecController(1, min_dwell_steps=2, resume_steps=2)
    assert [controller.decide(bs) for bs in (1, 4, 4, 4, 1, 1, 1)] == [
        False,
        True,
        True,
        True,
        True,  # the first small batch: it has to last 2 steps
        False,
        False,
    ]


def test_a_short_dip_under_load_does_not_resume_speculation() -> None:
    """Between two waves of 64 requests one decode step ran at bs 10 (SGLang 0.5.17, 2026-12-04):
    resuming there cost a draft-extend and the dwell's speculative steps at bs 64."""
    controller = DynSpecController(threshold=16, min_dwell_steps=8)
    wave = [64] * 50 + [10] * 7 + [64] * 50
    assert all(controller.decide(bs) for bs in wave * 3)
    assert controller.n_switches == 1


def test_a_wave_whose_first_requests_decode_alone_for_a_while_stays_in_fallback() -> None:
    """2026-12-05, an H100, SGLang 0.5.12.post1, c = 128 waves: the first 5 requests of a wave
    decoded alone for 8 steps before the other 123 arrived. With the dwell's 8 small steps
    speculation resumed there (that level: 0.943 of plain decoding); by default it waits 32."""
    controller = DynSpecController(threshold=16)
    assert controller.resume_steps == 32
    wave = [128] * 300 + [1] * 2 + [5] * 14 + [37, 69, 101] + [128] * 300
    assert all(controller.decide(bs) for bs in wave * 3)
    assert controller.n_switches == 1


def test_a_load_that_really_dropped_resumes_after_32_small_batches() -> None:
    controller = DynSpecController(threshold=16)
    controller.decide(64)
    assert [controller.decide(1) for _ in range(33)] == [True] * 31 + [False, False]
    # a dwell longer than that is waited for as well
    longer = DynSpecController(threshold=16, min_dwell_steps=40)
    longer.decide(64)
    assert sum(longer.decide(1) for _ in range(60)) == 39


def test_resuming_needs_small_batches_in_a_row() -> None:
    controller = DynSpecController(threshold=16, min_dwell_steps=3, resume_steps=3)
    controller.decide(64)
    # 2 small, 1 in the band (above resume_below = 14): the count starts again
    assert all(controller.decide(bs) for bs in (10, 10, 15, 10, 10))
    assert controller.decide(10) is False
    assert controller.n_switches == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"threshold": 0},
        {"threshold": -3},
        {"threshold": 2.5},
        {"threshold": True},
        {"threshold": "8"},
        {"threshold": 8, "resume_below": 9},
        {"threshold": 8, "resume_below": 0},
        {"threshold": 8, "resume_below": -1},
        {"threshold": 8, "min_dwell_steps": 0},
        {"threshold": 8, "min_dwell_steps": 1.5},
        {"threshold": 8, "resume_steps": 0},
        {"threshold": 8, "resume_steps": 2.0},
        {"threshold": 8, "resume_steps": True},
    ],
)
def test_argument_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DynSpecController(**kwargs)


def test_each_fallback_stretch_counts_its_own_small_batches() -> None:
    controller = DynSpecController(threshold=16, min_dwell_steps=2, resume_steps=2)
    decisions = [controller.decide(bs) for bs in (64, 10, 10, 64, 64, 64, 10, 10)]
    # resumed at the second 10; back in fallback after 2 speculative steps; the next 10 is the
    # first small batch of this fallback stretch, not the third
    assert decisions == [True, True, False, False, True, True, True, False]
