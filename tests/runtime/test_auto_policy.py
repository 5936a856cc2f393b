"""The ``auto`` decision core (GoodputPolicy) on synthetic cost tables: no torch, no time."""

import dataclasses
import itertools
import math
import random
import statistics
import types

import pytest

from dynspec_patch.transforms.runtime.dynspec_fallback import (
    AutoConfig,
    AutoController,
    CostTable,
    GoodputPolicy,
    Measurements,
    PrefillCost,
    Snapshot,
    StepTokens,
    _Measured,
    _MeasuredPrefill,
    _same_load,
    _Verified,
    fit_prefill_cost,
    padded_batch_size,
    parse_threshold,
    speculating_tokens_per_step,
)

GRAPH_SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256]


def spec_ms(bs: int) -> float:
    """A speculative step: dearer than a plain one, and growing faster with the batch."""
    return 10.0 + 0.6 * bs


def plain_ms(bs: int) -> float:
    return 7.0 + 0.15 * bs


def table(spec=spec_ms, plain=plain_ms, sizes=GRAPH_SIZES) -> CostTable:
    return CostTable({bs: (spec(bs), plain(bs)) for bs in sizes})


def policy_with(tokens_per_step: float, cost_table: CostTable | None = None, **config):
    policy = GoodputPolicy(AutoConfig(**config), GRAPH_SIZES)
    policy.adopt(Snapshot(tokens_per_step, cost_table or table()))
    return policy


def modes_through(policy: GoodputPolicy, loads) -> list[bool]:
    """Whether the policy is in fallback after each decision, over the batch sizes ``loads``."""
    modes = []
    for bs in loads:
        policy.decide(bs)
        modes.append(policy.in_fallback)
    return modes


def settles_in_fallback(tokens_per_step: float, bs: int) -> bool:
    policy = policy_with(tokens_per_step)
    for _ in range(50):
        policy.decide(bs)
    return policy.in_fallback


def crossover(tokens_per_step: float) -> int | None:
    """The smallest graph size at which a steady load leaves speculation."""
    return next((bs for bs in GRAPH_SIZES if settles_in_fallback(tokens_per_step, bs)), None)


def test_the_crossover_batch_moves_with_acceptance():
    # tokens/step E: speculation keeps winning while 1.02 * E * plain_ms > spec_ms (the 2 %
    # margin): E = 2.0 up to bs 14.6, E = 2.5 up to 36.1, E = 3.0 up to 81 (graph sizes next).
    assert crossover(2.0) == 16
    assert crossover(2.5) == 40
    assert crossover(3.0) == 96
    assert crossover(4.5) is None  # speculation wins at every size
    assert crossover(1.0) == 1  # nothing accepted: plain steps at every size


def test_it_speculates_while_any_input_is_unknown():
    policy = GoodputPolicy(AutoConfig(), GRAPH_SIZES)
    policy.adopt(Snapshot(None, table()))  # no verify step read yet
    assert not any(policy.decide(128) for _ in range(100))
    # No cost known at 128, and the one size known (speculation wins there) bounds nothing
    # above it (CostTable.deciding_size).
    policy.adopt(Snapshot(3.0, CostTable({1: (10.0, 5.0)})))
    decisions = [policy.decide(128) for _ in range(100)]
    assert policy.n_switches == 0
    # ... but it measures the unknown plain cost there: one plain step per explore gap.
    assert sum(decisions) == policy.n_explores == len(range(0, 100, AutoConfig().explore_gap))


def test_a_snapshot_crosses_the_wire_unchanged_unknowns_included():
    """What rank 0 broadcasts is what every rank adopts: floats only, NaN for an unknown."""
    entries = {16: (19.5, 9.25), 1: (11.0, None), 8: (None, 8.5)}
    snapshot = Snapshot(2.5, CostTable(entries), 64, 320, tokens_of_stretch=True,
                        admitted_per_token=1 / 128, prefill_spec=PrefillCost(8.7, 0.6))
    wire = snapshot.to_wire()
    assert all(isinstance(x, float) for x in wire)
    # tokens, their load, their requests, a stretch's or not, the admission rate, the two
    # prefill costs (speculating, in fallback), then the sizes in order
    assert wire[:9] == [2.5, 64.0, 320.0, 1.0, 1 / 128, 8.7, 0.6, wire[7], wire[8]]
    assert math.isnan(wire[7]) and math.isnan(wire[8])
    assert wire[9:13] == [1.0, 11.0, wire[11], 8.0] and math.isnan(wire[11])
    assert Snapshot.from_wire(wire) == snapshot
    assert Snapshot.from_wire(dataclasses.replace(snapshot, tokens_of_stretch=False).to_wire())\
        .tokens_of_stretch is False
    plain_only = dataclasses.replace(snapshot, prefill_spec=None,
                                     prefill_plain=PrefillCost(7.9, 0.55))
    assert Snapshot.from_wire(plain_only.to_wire()) == plain_only
    cold = Snapshot()  # nothing measured yet
    tokens, load, requests, of_stretch, admitted, *costs = cold.to_wire()
    assert math.isnan(tokens) and load == requests == of_stretch == admitted == 0.0
    assert len(costs) == 4 and all(math.isnan(x) for x in costs)
    assert Snapshot.from_wire(cold.to_wire()) == cold


def test_in_fallback_only_an_acceptance_read_at_about_this_load_switches_back():
    """A probe's acceptance read at another load (one request, another mix) does not decide
    for this batch; the probe due at this load does."""
    policy = policy_with(1.0)
    modes_through(policy, [64] * 20)
    assert policy.in_fallback
    # 3.0 tokens per step wins at bs 16 (the crossover is past 81), but was read at bs 1
    policy.adopt(Snapshot(3.0, table(), 1))
    assert modes_through(policy, [16] * 40) == [True] * 40
    policy.adopt(Snapshot(3.0, table(), 24))  # within 2x of 16 (padded 16): it counts
    assert not modes_through(policy, [16] * 40)[-1]
    # speculating, every reading counts (the stretch reads its own acceptance)
    policy.adopt(Snapshot(1.0, table(), 1))
    assert modes_through(policy, [16] * 40)[-1]


def test_costs_between_graph_sizes_are_interpolated_and_unknown_outside():
    costs = CostTable({8: (20.0, None), 16: (30.0, 10.0), 32: (None, 14.0)})
    assert costs.step_ms(True, 12) == pytest.approx(25.0)
    assert costs.step_ms(False, 24) == pytest.approx(12.0)
    assert costs.step_ms(True, 16) == 30.0
    assert costs.step_ms(True, 32) is None  # above the largest measured speculative size
    assert costs.step_ms(False, 8) is None  # below the smallest measured plain size
    assert padded_batch_size(13, GRAPH_SIZES) == 16
    assert padded_batch_size(300, GRAPH_SIZES) == 300  # beyond the graphs: eager, unpadded


def test_a_measured_size_decides_beyond_itself_only_where_the_cost_ratio_bounds_it():
    """The speculative step's cost relative to a plain one does not fall as the batch grows:
    plain steps that win at the largest measured size win above it, speculation that wins at
    the smallest wins below it; the other two cases stay unknown."""
    costs = CostTable({16: (20.0, 10.0), 64: (60.0, 15.0), 8: (14.0, None), 128: (None, 25.0)})
    # At 64 plain wins for 3.0 tokens per step (3 / 60 < 1 / 15), speculation for 4.5.
    assert costs.deciding_size(96, 3.0) == 64  # above 64, the largest size with both costs
    assert costs.deciding_size(256, 3.0) == 64
    assert costs.deciding_size(96, 4.5) is None
    assert costs.deciding_size(96, 4.0) is None  # a tie at 64 (4 / 60 = 1 / 15) decides nothing
    assert costs.deciding_size(64, 3.0) is None  # measured there: its own costs decide
    # At 16 speculation wins for 2.5 tokens per step (2.5 / 20 > 1 / 10), plain steps for 1.5.
    assert costs.deciding_size(4, 2.5) == 16  # below 16, the smallest size with both costs
    assert costs.deciding_size(4, 1.5) is None
    assert costs.deciding_size(4, 2.0) is None  # a tie at 16 (2 / 20 = 1 / 10)
    assert costs.deciding_size(32, 3.0) is None  # between measured sizes: interpolated instead
    assert costs.deciding_size(16, 3.0) is None
    assert CostTable({8: (14.0, None)}).deciding_size(96, 1.0) is None  # no size has both


def test_a_load_bigger_than_any_measured_goes_plain_within_the_dwell_steps():
    """A sudden load above every measured size switches to plain steps where they win at the
    largest one, within confirm_steps, not after its own costs are measured; the switch line
    says whose costs decided."""
    lines: list[str] = []
    confirm = AutoConfig().confirm_steps
    policy = GoodputPolicy(AutoConfig(), GRAPH_SIZES, log=lines.append)
    policy.adopt(Snapshot(2.0, table(sizes=[1, 8, 16, 32, 64])))  # plain wins at 64
    modes = modes_through(policy, [128] * (2 * confirm))
    assert modes.index(True) == confirm - 1
    assert policy.n_switches == 1
    assert lines[0].startswith(
        "[dynspec] auto: spec -> fallback at decode bs=128 (padded 128, step costs of bs 64): "
        "spec 2645 tok/s (2.00 tokens/step, 48.40 ms/step) vs plain 3855 tok/s (16.60 ms/step)"
    )
    assert policy.last is not None and policy.last.costs_of == 64


def test_a_load_smaller_than_any_measured_speculates_where_it_wins_at_the_smallest():
    confirm = AutoConfig().confirm_steps
    costs = table(sizes=[32, 64, 128])  # nothing measured below 32
    policy = policy_with(1.0, costs)
    for _ in range(confirm):
        policy.decide(64)
    assert policy.in_fallback  # nothing accepted: plain steps
    policy.adopt(Snapshot(2.0, costs))  # at 32 plain still wins (2 / 29.2 < 1 / 11.8)
    for _ in range(4 * confirm):
        policy.decide(4)
    assert policy.in_fallback and policy.n_switches == 1
    policy.adopt(Snapshot(4.5, costs))  # at 32 speculation wins (4.5 / 29.2 > 1 / 11.8)
    modes = modes_through(policy, [4] * (2 * confirm))
    assert modes.index(False) == confirm - 1
    assert policy.n_switches == 2


def test_a_load_near_the_crossover_never_flaps():
    rng = random.Random(3)
    # Equal goodput at bs 32 (E = 2.5): the noise (+-1 %) stays inside the 2 % margin.
    policy = policy_with(2.5)
    for step in range(20_000):
        if step % 16 == 0:
            noisy = CostTable(
                {
                    bs: (spec * rng.uniform(0.99, 1.01), plain * rng.uniform(0.99, 1.01))
                    for bs, (spec, plain) in table().entries.items()
                }
            )
            policy.adopt(Snapshot(2.5 * rng.uniform(0.995, 1.005), noisy))
        policy.decide(rng.choice([30, 31, 32]))
    assert policy.n_switches == 0


def test_a_steady_load_past_the_crossover_switches_once():
    rng = random.Random(5)
    policy = policy_with(2.5)
    for step in range(20_000):
        if step % 16 == 0:  # +-1.5 % noise around a 6 % lead of plain steps at bs 48
            noisy = CostTable(
                {
                    bs: (spec * rng.uniform(0.985, 1.015), plain * rng.uniform(0.985, 1.015))
                    for bs, (spec, plain) in table().entries.items()
                }
            )
            policy.adopt(Snapshot(2.5, noisy))
        policy.decide(rng.choice([47, 48]))
    assert policy.n_switches == 1
    assert policy.in_fallback


def test_probes_in_fallback_are_bounded_and_back_off():
    confirm = AutoConfig().confirm_steps
    policy = policy_with(1.2)
    decisions = [policy.decide(64) for _ in range(20_000)]
    assert policy.in_fallback
    spec_steps = [i for i, fallback in enumerate(decisions) if not fallback]
    # confirm_steps - 1 speculative steps, the switch, then a probe (2 steps of 64 requests)
    # after 16, 32, ... 1024 fallback steps, and every 1024 from then on.
    assert spec_steps[: confirm - 1] == list(range(confirm - 1))
    probes = [i for i in spec_steps[confirm - 1 :] if decisions[i - 1]]
    assert all(i + 1 in spec_steps and i + 2 not in spec_steps for i in probes)
    gaps = [b - a for a, b in zip([confirm - 2 - 1, *probes], probes, strict=False)]
    assert [gap - 1 for gap in gaps[:7]] == [16, 32, 64, 128, 256, 512, 1024]
    assert set(gaps[7:]) == {1024 + 1}
    assert policy.n_probes == len(probes) <= 7 + 20_000 // 1024


def test_no_probe_where_plain_steps_win_even_if_every_draft_token_were_accepted():
    # at bs 128: 3 tokens / 86.8 ms < 1 / 26.2 ms; at bs 32: 3 / 29.2 > 1 / 11.8
    def probes(bs: int, **config) -> int:
        policy = policy_with(1.2, **config)
        decisions = [policy.decide(bs) for _ in range(20_000)]
        assert policy.in_fallback
        speculative = sum(not fallback for fallback in decisions)
        assert speculative >= AutoConfig().confirm_steps - 1 + policy.n_probes
        return policy.n_probes

    assert probes(128, max_tokens_per_step=3.0) == 0
    assert probes(128) >= 7 + 16  # no bound given: 16, 32, ... 1024, then every 1024 steps
    assert probes(32, max_tokens_per_step=3.0) == probes(32) > 0  # it could win there


def test_no_explore_step_speculates_above_a_size_where_even_full_acceptance_loses():
    measured = CostTable({bs: (spec_ms(bs), plain_ms(bs)) for bs in (8, 64)})
    for most, explores in ((2.5, 0), (4.0, 1)):  # bs 64: 2.5 / 48.4 < 1 / 16.6 < 4 / 48.4
        policy = GoodputPolicy(AutoConfig(max_tokens_per_step=most), GRAPH_SIZES)
        # no acceptance read yet (so no bound from it): the bound of full acceptance alone
        policy.adopt(Snapshot(None, measured))
        policy.in_fallback = True
        policy.decide(128)  # 128: never measured, so its speculative cost is unknown
        assert policy.n_explores == explores, most


def test_while_speculating_a_plain_probe_every_1024_steps_refreshes_the_plain_cost():
    policy = policy_with(2.5)
    decisions = [policy.decide(8) for _ in range(5000)]
    assert not policy.in_fallback and policy.n_switches == 0
    assert [i for i, fallback in enumerate(decisions) if fallback] == [1023, 2047, 3071, 4095]


def test_a_burst_switches_within_the_confirm_steps_each_way():
    confirm = AutoConfig().confirm_steps
    policy = policy_with(2.5)
    modes = modes_through(policy, [1] * 300 + [64] * 300 + [1] * 300)
    assert modes.index(True) == 300 + confirm - 1
    assert all(modes[300 + confirm - 1 : 600])
    assert modes.index(False, 600) == 600 + confirm - 1
    assert not any(modes[600 + confirm - 1 :])
    assert policy.n_switches == 2


def swinging(policy: GoodputPolicy, steps: int, bs: int = 32, stretch: int = 600) -> list[int]:
    """Acceptance that swings every ``stretch`` steps at a load near the crossover (bs 32: plain
    wins at 2.0 tokens/step, speculation at 3.0); the steps at which the policy switched."""
    switched_at = []
    for step in range(steps):
        if step % stretch == 0:
            tokens = 2.0 if step // stretch % 2 == 0 else 3.0
            policy.adopt(Snapshot(tokens, table(), tokens_requests=256))  # 4 probes' worth
        before = policy.n_switches
        policy.decide(bs)
        if policy.n_switches > before:
            switched_at.append(step)
    return switched_at


def test_switching_back_and_forth_at_one_load_needs_4x_the_wins_each_time():
    switched_at = swinging(policy_with(2.0), 60_000)
    # 8, 8, 32, 128, 512 wins, each in its 600-step stretch; 2048 no longer fit in one
    assert [step % 600 for step in switched_at[:5]] == [7, 7, 31, 127, 511]
    assert [step // 600 for step in switched_at[:5]] == [0, 1, 2, 3, 4]
    # from then on one flap is forgiven per 8192 quiet steps: 512 wins fit again, then 2048
    # do not: one switch per more than 8192 steps
    later = switched_at[4:]
    assert len(later) > 2
    assert all(b - a > 8192 for a, b in itertools.pairwise(later))
    assert all(step % 600 == 511 for step in later)


def test_the_flap_back_off_stops_at_1024x_the_dwell_steps():
    """With one dwell step and 3000-step stretches, wins needed grow 1, 1, 4, ... 1024 and stay
    there: 1024 fits a stretch, so it keeps switching once a stretch (4096 would not)."""
    policy = policy_with(2.0, confirm_steps=1)
    switched_at = swinging(policy, 30_000, stretch=3000)
    assert [step % 3000 for step in switched_at] == [0, 0, 3, 15, 63, 255, 1023, 1023, 1023, 1023]


def test_at_the_load_speculation_was_just_left_4_probes_worth_switch_back_there():
    """One probe of 16 requests reads the fallback batch's mix of the moment. At the load of
    the last switch, within ``flap_window`` steps of it, switching back needs 4 probes'
    requests (at most 256; probes that agree pool): at 8 requests or more from the first time
    on, where a probe reads the batch's composition; below 8, where each request's acceptance
    is its own and probes of other requests would not agree to pool, one probe's requests do,
    after a flap too (with the flap's 4x the wins)."""
    config = AutoConfig()
    confirm = config.confirm_steps
    for bs, needed in ((32, 256), (16, 256), (8, 256)):
        policy = policy_with(1.0)
        modes_through(policy, [bs] * confirm)  # plain wins: into fallback at bs
        policy.adopt(Snapshot(4.0, table(), bs, needed - 1))  # speculation ahead
        assert all(modes_through(policy, [bs] * 200)), bs
        policy.adopt(Snapshot(4.0, table(), bs, needed))
        assert modes_through(policy, [bs] * confirm)[-1] is False, bs
    for bs in (4, 1):
        policy = policy_with(1.0)
        modes_through(policy, [bs] * confirm)
        policy.adopt(Snapshot(4.0, table(), bs, 1))  # the first time: any probe
        assert modes_through(policy, [bs] * confirm)[-1] is False, bs
        policy.adopt(Snapshot(1.0, table(), bs, 256))
        assert modes_through(policy, [bs] * 4 * confirm)[-1] is True, bs  # a flap: 4x
        assert policy._recent_flaps() == 2
        policy.adopt(Snapshot(4.0, table(), bs, 1))  # one probe of one request
        modes_through(policy, [bs] * (16 * confirm - 1))
        assert policy.in_fallback, bs  # two flaps: 16x the wins
        modes_through(policy, [bs])
        assert not policy.in_fallback, bs
    # flap_window steps after the switch, one probe's requests switch back there again
    policy = policy_with(1.0)
    modes_through(policy, [16] * confirm)
    policy.adopt(Snapshot(1.0, table(), 16, 256))
    modes_through(policy, [16] * config.flap_window)
    policy.adopt(Snapshot(4.0, table(), 16, 16))
    assert modes_through(policy, [16] * confirm)[-1] is False
    # at another load (2x off) one probe's requests switch back
    policy = policy_with(1.0)
    modes_through(policy, [32] * confirm)
    policy.adopt(Snapshot(4.0, table(), 32, 256))
    modes_through(policy, [32] * confirm)
    policy.adopt(Snapshot(1.0, table(), 32, 256))
    assert modes_through(policy, [32] * 4 * confirm)[-1] is True
    policy.adopt(Snapshot(4.0, table(), 8, 64))
    assert modes_through(policy, [8] * confirm)[-1] is False


def test_a_snapshot_says_how_many_requests_its_acceptance_holds():
    measurements = Measurements(WINDOW_64, StepCosts())
    verified(measurements, [(16, 2.0)] * 3, probe=True)
    assert measurements.snapshot().tokens_requests == 48
    verified(measurements, [(16, 2.0)] * 3, probe=True, first_step=3)  # 64 newest: 4 steps
    assert measurements.snapshot().tokens_requests == 64


def test_the_same_load_is_within_2x_either_way():
    assert _same_load(32, 32) and _same_load(33, 17) and _same_load(17, 33)
    assert not _same_load(64, 32) and not _same_load(32, 64)
    assert not _same_load(1, 0)  # nothing to compare with: not the same load


def test_after_flapping_a_load_that_moves_2x_still_switches_within_the_dwell_steps():
    confirm = AutoConfig().confirm_steps
    policy = policy_with(2.0)
    assert len(swinging(policy, 6000)) >= 5
    for bs, fallback in ((4, False), (64, True), (4, False)):  # 8x, 16x, 16x the load
        policy.adopt(Snapshot(2.0, table(), tokens_requests=256))
        if policy.in_fallback == fallback:  # already there: move the other way first
            continue
        modes = modes_through(policy, [bs] * 100)
        # within the dwell steps (wins the other mode had at the old load count too)
        assert modes.index(fallback) <= confirm - 1, bs


def test_a_probe_runs_until_it_has_verified_64_requests_in_2_steps_or_more_at_most_8():
    """Two steps at least: a request's own tokens per step is read over its steps
    (``speculating_tokens_per_step``), and one step's 1 / tokens is biased."""
    for bs, steps in ((128, 2), (64, 2), (32, 2), (16, 4), (8, 8), (4, 8), (1, 8)):
        policy = policy_with(1.0)  # plain wins everywhere: into fallback, then probes
        decisions = [policy.decide(bs) for _ in range(2000)]
        spec = [i for i, fallback in enumerate(decisions) if not fallback]
        first_probe = spec[AutoConfig().confirm_steps - 1]
        assert spec[AutoConfig().confirm_steps - 1 :][:steps] == list(
            range(first_probe, first_probe + steps)
        ), bs
        assert first_probe + steps not in spec, bs  # then fallback steps again


def test_a_probe_stops_when_the_load_moves_2x_and_one_at_the_new_load_follows():
    """A probe began at bs 8 (8 steps due) when a wave's first requests decoded alone; the rest
    arrive after 2 of its steps: it stops, and the probe at the new load comes 16 steps on."""
    policy = policy_with(1.0)
    for _ in range(2000):
        policy.decide(128)  # into fallback; the gap grows
    first = [policy.decide(8) for _ in range(17)]
    assert first[-2:] == [False, False] and all(first[:15])  # the probe at bs 8 began
    after = [policy.decide(128) for _ in range(40)]
    spec = [i for i, fallback in enumerate(after) if not fallback]
    assert spec == [15, 16]  # two steps of 128 requests, 16 steps after the move


def test_in_fallback_the_probe_gap_starts_again_when_the_load_moves_2x():
    policy = policy_with(1.0)
    for _ in range(5000):
        policy.decide(64)  # the gap has grown to 1024
    assert policy.in_fallback
    decisions = [policy.decide(16) for _ in range(2060)]
    starts = [i for i, fallback in enumerate(decisions) if not fallback and decisions[i - 1]]
    # a probe (4 steps of 16 requests) 16 steps after the move, then gaps of 32, 64, ... again
    assert starts == [15, 50, 117, 248, 507, 1022, 2049]
    assert all(not decisions[i + 1] for i in starts[:-1])


def test_a_switch_logs_the_estimates_that_decided_it():
    lines: list[str] = []
    policy = GoodputPolicy(AutoConfig(confirm_steps=2), GRAPH_SIZES, log=lines.append)
    policy.adopt(Snapshot(2.0, table()))
    for bs in (60, 64, 64):
        policy.decide(bs)
    assert lines == [
        "[dynspec] auto: spec -> fallback at decode bs=64 (padded 64): spec 2645 tok/s "
        "(2.00 tokens/step, 48.40 ms/step) vs plain 3855 tok/s (16.60 ms/step); switches=1, "
        "fallback_steps=0, spec_steps=1, probes=0"
    ]


def test_describe_says_where_the_policy_stands_and_what_prefills_cost():
    """The step profiler's ``auto`` line (``DYNSPEC_PROFILE``): mode, counters, and the
    prefill costs once timed, with the admission rate once read."""
    policy = policy_with(1.0)  # plain wins everywhere
    assert policy.describe() == (
        "speculating, steps=0, switches=0, fallback_steps=0, spec_steps=0, probes=0, explores=0"
    )
    for _ in range(40):
        policy.decide(64)
    assert policy.in_fallback and policy.n_fallback_steps > 0
    head = (
        f"fallback, steps=40, switches=1, fallback_steps={policy.n_fallback_steps}, "
        f"spec_steps={policy.n_spec_steps}, probes={policy.n_probes}, explores=0"
    )
    assert policy.describe() == head
    timed = dataclasses.replace(
        policy.snapshot, prefill_spec=PrefillCost(8.5, 0.9), prefill_plain=PrefillCost(7.25, 0.5)
    )
    policy.adopt(timed)
    prefills = (
        "; prefill batches speculating 8.50 + 0.90 ms a request, in fallback 7.25 + 0.50 ms a "
        "request; "
    )
    assert policy.describe() == head + prefills + "no admission read yet"
    policy.adopt(dataclasses.replace(timed, admitted_per_token=0.02))
    assert policy.describe() == head + prefills + "1 request admitted per 50 tokens"
    policy.adopt(dataclasses.replace(timed, prefill_spec=None, admitted_per_token=0.02))
    assert policy.describe() == (
        head + "; prefill batches in fallback 7.25 + 0.50 ms a request; 1 request admitted per "
        "50 tokens"
    )


class StepCosts:
    """A clock that times a step as the cost model says, whatever the host clock reads."""

    def __init__(self) -> None:
        self.next_ms = 0.0

    def start(self):
        return None

    def stop(self, started):
        return self.next_ms

    def elapsed_ms(self, handle):
        return handle


def constant(value: float):
    return lambda: StepTokens(value)


def drive(controller: AutoController, clock: StepCosts, loads, tokens_per_step):
    """Run ``loads`` through the controller, timing each step by the cost model; the modes."""
    modes, decisions = [], []
    for step, bs in enumerate(loads):
        fallback = controller.decide(bs)
        padded = padded_batch_size(bs, GRAPH_SIZES)
        clock.next_ms = plain_ms(padded) if fallback else spec_ms(padded)
        started = controller.start_step()
        reader = None if fallback else constant(tokens_per_step(step))
        controller.finish_step(started, not fallback, bs, reader)
        modes.append(controller.in_fallback)
        decisions.append(fallback)
    return modes, decisions


def test_from_a_cold_start_a_burst_switches_within_a_bounded_number_of_steps():
    confirm = AutoConfig().confirm_steps
    clock = StepCosts()
    controller = AutoController(GoodputPolicy(AutoConfig(), GRAPH_SIZES), source=True, clock=clock)
    modes, decisions = drive(controller, clock, [1] * 400 + [64] * 400 + [1] * 400, lambda s: 2.5)
    assert not any(modes[:400])
    assert sum(decisions[:400]) == 2  # two explore steps measured the plain cost at bs 1
    # bs 64 is new: two explore steps measure its plain cost (the first time is dropped), the
    # next sync shares it, then confirm_steps decisions.
    into_fallback = modes.index(True, 400)
    assert into_fallback - 400 <= 2 * 16 + confirm
    assert all(modes[into_fallback:800])
    # Back at bs 1 the acceptance read at bs 64 does not decide: the probe due once the load
    # moved (after probe_gap steps, at most probe_steps_max long) reads it at bs 1, the next
    # sync shares it, then confirm_steps decisions (costs at bs 1 are known by now).
    config = AutoConfig()
    back = modes.index(False, 800) - 800
    most = config.probe_gap + config.probe_steps_max + config.sync_every + config.lag_steps
    assert config.probe_gap < back <= most + confirm
    assert not any(modes[800 + back :])
    assert controller.policy.n_switches == 2


def test_probes_notice_that_acceptance_rose_while_in_fallback():
    clock = StepCosts()
    controller = AutoController(GoodputPolicy(AutoConfig(), GRAPH_SIZES), source=True, clock=clock)
    # bs 64: plain wins at 2 tokens/step, speculation at 4 (4 * 16.6 > 48.4 * 1.02).
    modes, _ = drive(controller, clock, [64] * 3000, lambda step: 2.0 if step < 1000 else 4.0)
    assert all(modes[100:1000])
    back = modes.index(False, 1000)
    # The first probe after the rise re-measures it and the next agrees (speculation was
    # left at this load within flap_window steps: 256 requests, two probes of 128); probe
    # gaps are capped at 1024 steps.
    assert back - 1000 <= 2 * 1024 + 16 + AutoConfig().confirm_steps
    assert not any(modes[back:])
    assert controller.policy.n_switches == 2


WINDOW_64 = AutoConfig(acceptance_requests=64)  # acceptance over the newest 64 requests


def verified(measurements: Measurements, steps, *, probe=False, first_step=0, started=None):
    """Feed ``measurements`` resolved speculative steps: ``(requests, tokens per request)``;
    ``started``: the requests begun by each step (default: each step's requests are new)."""
    for i, (requests, tokens) in enumerate(steps):
        begun = (first_step + i) * 1000 if started is None else started[i]
        measurements.add(_Measured(first_step + i, True, requests, requests, 5.0,
                                   constant(tokens), in_fallback=probe, started=begun))
    measurements.resolve(first_step + len(steps))


def test_acceptance_is_the_mean_over_the_newest_steps_that_hold_64_requests():
    one_request = Measurements(WINDOW_64, StepCosts())
    verified(one_request, [(1, 2.0)] * 100)
    verified(one_request, [(1, 4.0)], first_step=100)  # one step of one request: a nudge
    assert one_request.tokens_per_step == pytest.approx((63 * 2.0 + 4.0) / 64)
    big_batch = Measurements(WINDOW_64, StepCosts())
    verified(big_batch, [(64, 2.0)] * 10)
    verified(big_batch, [(64, 4.0)], first_step=10)  # one step of 64 requests: all of it
    assert big_batch.tokens_per_step == 4.0
    mixed = Measurements(WINDOW_64, StepCosts())
    verified(mixed, [(48, 1.0), (16, 4.0), (32, 2.0)])  # 48 newest requests: all three
    assert mixed.tokens_per_step == pytest.approx((48 * 1.0 + 16 * 4.0 + 32 * 2.0) / 96)
    verified(mixed, [(32, 3.0)], first_step=3)  # 64 newest requests: the oldest two go
    assert mixed.tokens_per_step == pytest.approx((32 * 2.0 + 32 * 3.0) / 64)


def test_by_default_acceptance_is_the_mean_of_the_newest_256_requests():
    measurements = Measurements(AutoConfig(), StepCosts())
    verified(measurements, [(1, 2.0)] * 300)
    verified(measurements, [(1, 4.0)] * 128, first_step=300)
    assert measurements.tokens_per_step == pytest.approx(3.0)
    verified(measurements, [(64, 1.0)] * 4, first_step=428)  # four steps of 64: all of it
    assert measurements.tokens_per_step == pytest.approx(1.0)


def test_one_request_at_a_time_the_window_holds_16_different_requests():
    """At bs 1 the 256 newest requests are two or three requests; on mixed traffic each has
    its own acceptance, so the window also holds the 16 newest requests."""
    acceptance = {j: 1.0 + j / 10 for j in range(1, 21)}  # request j: 50 steps of its own
    steps = [(1, acceptance[j]) for j in range(1, 21) for _ in range(50)]
    begun = [j for j in range(1, 21) for _ in range(50)]
    measurements = Measurements(AutoConfig(), StepCosts())
    verified(measurements, steps, started=begun)
    # requests 6..20 and the last step of request 5: 16 different requests
    newest_16 = (acceptance[5] + sum(50 * acceptance[j] for j in range(6, 21))) / 751
    assert measurements.tokens_per_step == pytest.approx(newest_16)
    requests_alone = Measurements(AutoConfig(acceptance_distinct=1), StepCosts())
    verified(requests_alone, steps, started=begun)
    newest_256 = (6 * acceptance[15] + sum(50 * acceptance[j] for j in range(16, 21))) / 256
    assert requests_alone.tokens_per_step == pytest.approx(newest_256)


def test_long_requests_keep_the_window_to_1024_steps():
    measurements = Measurements(AutoConfig(), StepCosts())
    four_requests = [4] * 3000  # the same 4 requests all along: 4 different ones
    verified(measurements, [(4, 2.0)] * 2000 + [(4, 3.0)] * 1000, started=four_requests)
    assert measurements.tokens_per_step == pytest.approx((24 * 2.0 + 1000 * 3.0) / 1024)


def test_a_controller_stamps_each_step_with_the_requests_prefilled_by_then():
    clock = StepCosts()
    controller = AutoController(GoodputPolicy(AutoConfig(), GRAPH_SIZES), source=True, clock=clock)
    controller.finish_prefill(controller.start_step(), 3)
    controller.decide(3)
    controller.finish_step(controller.start_step(), True, 3, constant(2.0))
    controller.finish_prefill(controller.start_step(), 2)
    controller.decide(5)
    controller.finish_step(controller.start_step(), True, 5, constant(2.0))
    assert [m.started for m in controller.measurements._pending] == [3, 5]
    other_rank = AutoController(GoodputPolicy(AutoConfig(), GRAPH_SIZES), source=False,
                                share=lambda mine: Snapshot())
    other_rank.finish_prefill(other_rank.start_step(), 3)
    assert other_rank.n_started == 0  # only the source rank measures


def test_a_probe_replaces_what_the_speculative_stretch_left():
    measurements = Measurements(WINDOW_64, StepCosts())
    verified(measurements, [(8, 1.2)] * 20)
    # a probe of 4 steps at bs 8 (32 requests) after the acceptance rose: all 4 count
    rose = [(8, 2.0), (8, 3.0), (8, 2.0), (8, 3.0)]
    verified(measurements, rose, probe=True, first_step=20)
    assert measurements.tokens_per_step == pytest.approx(2.5)
    verified(measurements, [(8, 0.0)], first_step=24)  # unreadable (0): left out
    assert measurements.tokens_per_step == pytest.approx(2.5)
    # the same 4 steps while speculating only move the mean of the newest 64 requests
    speculating = Measurements(WINDOW_64, StepCosts())
    verified(speculating, [(8, 1.2)] * 20)
    verified(speculating, rose, first_step=20)
    assert speculating.tokens_per_step == pytest.approx((4 * 1.2 + 4 * 2.5) / 8)
    # a fallback step ends the probe: the next probe starts afresh
    measurements.add(_Measured(25, False, 8, 8, 5.0, None, in_fallback=True))
    verified(measurements, [(8, 3.0)] * 4, probe=True, first_step=26)
    assert measurements.tokens_per_step == pytest.approx(3.0)


def fallback_step(measurements: Measurements, step: int, requests: int = 32) -> None:
    measurements.add(_Measured(step, False, requests, requests, 5.0, None, in_fallback=True))
    measurements.resolve(step)


def test_a_probe_counts_at_what_the_last_stretch_it_started_settled_to():
    """Mixed traffic: a probe samples the plain batch (2.1 tokens per step); speculating
    finishes the good requests first and settles lower (1.6); the next probe reads 1.6."""
    measurements = Measurements(WINDOW_64, StepCosts())
    verified(measurements, [(32, 2.0)] * 4)  # the start-up stretch: no probe began it
    fallback_step(measurements, 4)
    assert measurements.composition == 1.0
    verified(measurements, [(32, 2.1)] * 2, probe=True, first_step=5)
    assert measurements.tokens_per_step == pytest.approx(2.1)
    verified(measurements, [(32, 2.0), (32, 1.8), (32, 1.6), (32, 1.6)], first_step=7)
    assert measurements.tokens_per_step == pytest.approx(1.6)  # speculating: what it reads
    fallback_step(measurements, 11)
    assert measurements.composition == pytest.approx(1.6 / 2.1)
    verified(measurements, [(32, 2.1)] * 2, probe=True, first_step=12)
    assert measurements.tokens_per_step == pytest.approx(1.6)
    # the traffic turns good: the probe's raw 3.0 still counts less until a stretch shows it
    verified(measurements, [(32, 3.0)] * 2, probe=True, first_step=14)
    assert measurements.tokens_per_step == pytest.approx(3.0 * 1.6 / 2.1)
    verified(measurements, [(32, 3.0)] * 4, first_step=16)
    fallback_step(measurements, 20)
    assert measurements.composition == pytest.approx(1.0)
    verified(measurements, [(32, 3.0)] * 2, probe=True, first_step=21)
    assert measurements.tokens_per_step == pytest.approx(3.0)


def test_the_composition_is_learned_on_batches_of_8_or_more_and_kept_in_its_bounds():
    def settled(entry: float, end: float, requests: int) -> float:
        measurements = Measurements(WINDOW_64, StepCosts())
        verified(measurements, [(requests, entry)] * 8, probe=True)
        verified(measurements, [(requests, end)] * 8, first_step=8)  # 64+ requests: all end
        fallback_step(measurements, 16, requests)
        return measurements.composition

    assert settled(2.0, 1.5, 8) == pytest.approx(0.75)
    assert settled(2.0, 1.5, 7) == 1.0  # one request's own acceptance, not a composition
    assert settled(2.0, 2.5, 16) == 1.0  # never above 1: a probe is not raised
    assert settled(3.0, 1.0, 16) == 0.5
    assert settled(2.0, 0.9, 16) == 0.5


def test_a_stretch_not_begun_by_a_probe_teaches_no_composition():
    """A switch back that the cost table decided (the load fell), not a probe: what the
    window held then is an older stretch's acceptance, not a fallback batch's."""
    measurements = Measurements(WINDOW_64, StepCosts())
    verified(measurements, [(32, 2.0)] * 4)
    fallback_step(measurements, 4)
    verified(measurements, [(32, 2.0), (32, 1.0), (32, 1.0), (32, 1.0)], first_step=5)
    fallback_step(measurements, 9)
    assert measurements.composition == 1.0


def test_the_composition_counts_on_batches_of_8_or_more_and_at_the_load_it_was_learned_at():
    """It is the traffic's (how its requests' acceptances differ), not the load's: a mixed
    load of 16 that rises to 32 keeps it; one that turns into a few requests does not (their
    own acceptance is what a probe reads), except at about the load it was learned at."""
    measurements = Measurements(WINDOW_64, StepCosts())
    verified(measurements, [(32, 2.1)] * 2, probe=True)
    verified(measurements, [(32, 1.6)] * 4, first_step=2)
    fallback_step(measurements, 6)
    assert measurements.composition == pytest.approx(1.6 / 2.1)
    for step, (requests, counted) in enumerate(
        ((1, 1.0), (48, 1.6 / 2.1), (16, 1.6 / 2.1), (128, 1.6 / 2.1), (4, 1.0), (7, 1.0),
         (20, 1.6 / 2.1)), start=7
    ):
        first = 7 + 10 * (step - 7)
        verified(measurements, [(requests, 2.1)] * 8, probe=True, first_step=first)
        assert measurements.tokens_per_step == pytest.approx(2.1 * counted), requests
        fallback_step(measurements, first + 8, requests)


def test_fewer_than_8_requests_count_the_composition_learned_at_about_their_load():
    measurements = Measurements(WINDOW_64, StepCosts())
    verified(measurements, [(8, 2.0)] * 8, probe=True)
    verified(measurements, [(8, 1.5)] * 8, first_step=8)
    fallback_step(measurements, 16, requests=8)
    assert measurements.composition == pytest.approx(0.75)
    verified(measurements, [(5, 2.0)] * 8, probe=True, first_step=17)
    assert measurements.tokens_per_step == pytest.approx(1.5)
    fallback_step(measurements, 25, requests=5)
    verified(measurements, [(3, 2.0)] * 8, probe=True, first_step=26)
    assert measurements.tokens_per_step == pytest.approx(2.0)


def test_probes_that_agree_at_one_load_pool_and_others_replace():
    """In fallback a 64-request probe alone is noisy: one that agrees (within 30 %) with the
    probes before it at about their load joins them in the 256-request window; one at another
    load, or one that reads a change of traffic, starts afresh."""
    measurements = Measurements(AutoConfig(), StepCosts())
    verified(measurements, [(64, 2.0)], probe=True)
    fallback_step(measurements, 1, requests=64)
    verified(measurements, [(64, 2.4)], probe=True, first_step=2)  # +20 %: it joins
    assert measurements.tokens_per_step == pytest.approx(2.2)
    fallback_step(measurements, 3, requests=64)
    verified(measurements, [(48, 2.5)], probe=True, first_step=4)  # bs 48: about the load
    assert measurements.tokens_per_step == pytest.approx((128 + 153.6 + 120) / 176)
    fallback_step(measurements, 5, requests=64)
    verified(measurements, [(64, 3.5)], probe=True, first_step=6)  # +52 %: traffic changed
    assert measurements.tokens_per_step == 3.5
    fallback_step(measurements, 7, requests=64)
    verified(measurements, [(16, 3.6)] * 4, probe=True, first_step=8)  # another load
    assert measurements.tokens_per_step == 3.6
    # a speculative stretch between two probes: the next probe replaces what it left (and
    # counts times the composition that stretch taught)
    verified(measurements, [(16, 2.0)] * 16, first_step=12)
    fallback_step(measurements, 28, requests=16)
    assert measurements.composition == pytest.approx(2.0 / 3.6)
    verified(measurements, [(16, 2.1)] * 4, probe=True, first_step=29)
    assert measurements.tokens_per_step == pytest.approx(2.1 * 2.0 / 3.6)


def test_a_rise_read_by_one_probe_of_8_to_63_requests_counts_once_the_next_agrees():
    """16 mixed requests are a noisy sample of the traffic: one probe in ten reads a quarter
    high or more. One that reads a rise beyond 30 % of the probes before it at this load
    replaces them but counts at most what they did; the next probe that agrees with it
    releases it. A fall counts at once, as do rises at 64 requests or more and below 8."""
    measurements = Measurements(AutoConfig(), StepCosts())
    verified(measurements, [(16, 1.5)] * 4, probe=True)
    fallback_step(measurements, 4, requests=16)
    assert measurements.tokens_per_step == 1.5
    verified(measurements, [(16, 2.2)] * 4, probe=True, first_step=5)  # +47 %: held at 1.5
    assert measurements.tokens_per_step == 1.5
    assert measurements.snapshot().tokens_per_step == 1.5
    fallback_step(measurements, 9, requests=16)
    verified(measurements, [(16, 2.0)] * 4, probe=True, first_step=10)  # agrees: both count
    assert measurements.tokens_per_step == pytest.approx(2.1)
    fallback_step(measurements, 14, requests=16)
    verified(measurements, [(16, 1.2)] * 4, probe=True, first_step=15)  # a fall: at once
    assert measurements.tokens_per_step == 1.2
    fallback_step(measurements, 19, requests=16)
    verified(measurements, [(16, 2.0)] * 4, probe=True, first_step=20)  # a rise again: held
    assert measurements.tokens_per_step == 1.2
    fallback_step(measurements, 24, requests=16)
    verified(measurements, [(16, 3.0)] * 4, probe=True, first_step=25)  # a rise on a rise
    assert measurements.tokens_per_step == 1.2  # still at what the last agreed probes read
    for requests in (4, 64):
        trusted = Measurements(AutoConfig(), StepCosts())
        steps = max(2, 64 // requests)
        verified(trusted, [(requests, 1.5)] * steps, probe=True)
        fallback_step(trusted, steps, requests=requests)
        verified(trusted, [(requests, 2.2)] * steps, probe=True, first_step=steps + 1)
        assert trusted.tokens_per_step == pytest.approx(2.2), requests


def test_a_probe_of_one_request_joins_or_replaces_by_all_its_steps_not_its_first():
    """At bs 1 a probe's step is one request's one verify: at 50 % acceptance it reads 1 token
    half the time. Mixed traffic at c = 1 (on an H100, 2026-12-05): probes of a 0 % request
    read 1.0; the next request's probe began with a 1-token step and, judged on that step, joined
    them, so its 2.0 counted as 1.25 and speculation (1.0 / 8.8 ms against 1 / 6.1 ms at 1.25
    tokens) never won back."""
    probe_of_50 = [(1, 1.0), (1, 3.0), (1, 1.0), (1, 2.0), (1, 4.0), (1, 1.0), (1, 2.0), (1, 2.0)]
    measurements = Measurements(AutoConfig(), StepCosts())
    verified(measurements, [(1, 1.0)] * 8, probe=True)  # two probes of a 0 % request
    fallback_step(measurements, 8, requests=1)
    verified(measurements, [(1, 1.0)] * 8, probe=True, first_step=9)
    fallback_step(measurements, 17, requests=1)
    assert measurements.tokens_per_step == 1.0
    verified(measurements, probe_of_50, probe=True, first_step=18)
    assert measurements.tokens_per_step == pytest.approx(2.0)  # it replaced them
    fallback_step(measurements, 26, requests=1)
    # a probe whose first step is far off but whose steps agree joins: 2.0 and 2.25
    verified(measurements, [(1, 4.0), (1, 1.0), (1, 2.0), (1, 2.0)], probe=True, first_step=27)
    assert measurements.tokens_per_step == pytest.approx((16 + 9) / 12)


def test_a_probe_is_judged_as_it_goes():
    """Its steps so far decide at every read: the window follows the probe while it runs."""
    measurements = Measurements(AutoConfig(), StepCosts())
    verified(measurements, [(1, 2.0)] * 8, probe=True)
    fallback_step(measurements, 8, requests=1)
    verified(measurements, [(1, 2.2)], probe=True, first_step=9)  # agrees so far: joins
    assert measurements.tokens_per_step == pytest.approx((16 + 2.2) / 9)
    verified(measurements, [(1, 4.0)] * 3, first_step=10, probe=True)  # mean 3.55: replaces
    assert measurements.tokens_per_step == pytest.approx((2.2 + 12) / 4)


def test_the_snapshot_says_at_which_load_its_acceptance_was_read():
    measurements = Measurements(WINDOW_64, StepCosts())
    assert measurements.snapshot().tokens_load == 0  # nothing read yet
    verified(measurements, [(32, 2.0)] * 2, probe=True)
    assert measurements.snapshot().tokens_load == 32
    fallback_step(measurements, 2, requests=64)  # a fallback step reads no acceptance
    assert measurements.snapshot().tokens_load == 32
    verified(measurements, [(1, 3.0)] * 8, probe=True, first_step=3)
    assert measurements.snapshot().tokens_load == 1


def test_plain_steps_while_speculating_neither_end_the_stretch_nor_a_probe():
    measurements = Measurements(WINDOW_64, StepCosts())
    verified(measurements, [(32, 2.1)] * 2, probe=True)
    verified(measurements, [(32, 1.6)] * 2, first_step=2)
    # a plain probe / explore step while speculating: the stretch goes on
    measurements.add(_Measured(4, False, 32, 32, 5.0, None, in_fallback=False))
    verified(measurements, [(32, 1.6)] * 2, first_step=5)
    assert measurements.composition == 1.0
    fallback_step(measurements, 7)
    assert measurements.composition == pytest.approx(1.6 / 2.1)


@pytest.mark.parametrize(
    ("raw", "parsed"), [("auto", "auto"), ("AUTO", "auto"), (12, 12), ("12", 12), (65536, 65536)]
)
def test_the_threshold_parses_to_an_int_or_auto(raw, parsed):
    assert parse_threshold(raw) == parsed


@pytest.mark.parametrize("raw", ["fast", "", 0, 65537, True, 2.5, None])
def test_a_bad_threshold_is_refused_with_one_line(raw):
    with pytest.raises(ValueError) as bad:
        parse_threshold(raw)
    assert str(bad.value).startswith("threshold must be an integer 1..65536 or auto, got ")
    assert "\n" not in str(bad.value)


def test_a_new_policy_speculates_with_nothing_known_and_needs_one_dwell_step_at_least():
    policy = GoodputPolicy(AutoConfig(confirm_steps=1), [4, 1, 2, 2])
    assert policy.graph_sizes == [1, 2, 4]
    assert policy.last is None and policy.last_out_of_mode is False
    assert policy.in_fallback is False
    with pytest.raises(ValueError, match=r"^min_dwell_steps must be >= 1, got 0$"):
        GoodputPolicy(AutoConfig(confirm_steps=0))


def test_a_switch_back_logs_fallback_to_spec():
    lines: list[str] = []
    policy = GoodputPolicy(AutoConfig(confirm_steps=1), GRAPH_SIZES, log=lines.append)
    policy.adopt(Snapshot(2.0, table()))
    policy.decide(64)  # plain wins at 64
    policy.decide(1)  # speculation at 1
    assert [line.split(" at ")[0] for line in lines] == [
        "[dynspec] auto: spec -> fallback", "[dynspec] auto: fallback -> spec"]


def test_in_fallback_speculation_must_win_by_the_margin_too():
    # bs 64: 48.4 ms speculative, 16.6 ms plain: equal goodput at 48.4 / 16.6 tokens/step
    even = 48.4 / 16.6
    policy = policy_with(1.0)
    for _ in range(8):
        policy.decide(64)
    assert policy.in_fallback
    policy.adopt(Snapshot(even * 1.01, table(), tokens_requests=256))  # 1 % ahead: not enough
    for _ in range(100):
        policy.decide(64)
    assert policy.in_fallback
    policy.adopt(Snapshot(even * 1.03, table(), tokens_requests=256))
    for _ in range(8):
        policy.decide(64)
    assert not policy.in_fallback


def test_after_switching_back_a_plain_probe_comes_after_1024_steps():
    policy = policy_with(2.0)
    for _ in range(8):
        policy.decide(64)
    assert policy.in_fallback
    decisions = [policy.decide(1) for _ in range(1100)]
    back = decisions.index(False)
    assert not any(decisions[back + 8 : back + 1000])  # speculating: no plain step for 1024


def test_in_fallback_an_unknown_speculative_cost_is_explored_per_size_where_undecided():
    costs = CostTable({64: (30.0, 10.0), 96: (None, 12.0), 128: (None, 14.0)})
    policy = policy_with(3.5, costs)
    policy.in_fallback = True  # bs 64 measured: 3.5 tokens in 30 ms beat 1 in 10, barely
    # above 64 that bound decides nothing: one speculative step at each new size (their own
    # explore gaps), then plain steps
    assert [policy.decide(bs) for bs in (128, 96, 128, 96)] == [False, False, True, True]


def test_in_fallback_no_explore_step_where_a_measured_size_already_decides():
    """Plain steps win at bs 64 at today's acceptance, so they win above it: a speculative
    step at 96 or 128 would only cost (2026-12-05, an H100, mix c = 128: auto 0.97 of a fixed
    T, its extra speculative steps the difference)."""
    costs = CostTable({64: (30.0, 10.0), 96: (None, 12.0), 128: (None, 14.0)})
    policy = policy_with(1.0, costs)
    for _ in range(8):
        policy.decide(64)
    assert policy.in_fallback
    assert [policy.decide(bs) for bs in (128, 96, 128, 96)] == [True] * 4
    assert policy.n_explores == 0


def test_probe_steps_are_marked_out_of_mode_and_decisions_are_booleans():
    policy = policy_with(1.0)
    marks = [(policy.decide(4), policy.last_out_of_mode) for _ in range(300)]
    assert policy.in_fallback
    after = marks[8:]  # in fallback from the 8th decision on
    assert all(isinstance(fallback, bool) for fallback, _ in marks)
    assert all(out is (not fallback) for fallback, out in after)
    assert sum(out for _, out in after) >= 8  # the probes (8 steps each at bs 4)


def test_the_first_time_of_a_size_is_dropped_and_a_cost_is_the_median_of_the_last_16():
    measurements = Measurements(WINDOW_64, StepCosts())
    assert measurements.snapshot() == Snapshot(None, CostTable({}))

    def timed(step: int, ms: float, padded: int = 8) -> None:
        measurements.add(_Measured(step, False, padded, padded, ms, None))

    timed(0, 99.0)  # the first plain step at 8: compiles, dropped
    measurements.resolve(0)
    assert measurements.snapshot().table.entries == {}
    timed(1, 0.5)
    timed(2, 0.0)  # unreadable: left out
    timed(3, 0.7)
    measurements.resolve(3)
    assert measurements.snapshot().table.entries == {8: (None, 0.7)}  # median of 0.5, 0.7
    for i in range(30):
        timed(4 + i, 10.0)
    for i in range(16):
        timed(34 + i, 20.0 + i)
    measurements.resolve(49)
    assert measurements.snapshot().table.entries[8] == (None, 28.0)  # sorted 20..35, [8]
    for step, ms in ((50, 5.0), (51, 6.0), (52, 7.0), (53, 8.0), (54, 9.0)):
        timed(step, ms, 16)
    measurements.resolve(51)  # up to step 51 inclusive; 52, 53 and 54 stay pending
    assert measurements.snapshot().table.entries[16] == (None, 6.0)
    measurements.resolve(54)
    assert measurements.snapshot().table.entries[16] == (None, 8.0)  # sorted 6 .. 9, [2]


class TokenClock:
    """A clock whose timings name the start they were stopped from; records what is read."""

    def __init__(self) -> None:
        self.started = 0
        self.read: list[int] = []

    def start(self):
        self.started += 1
        return ("started", self.started)

    def stop(self, started):
        assert started[0] == "started"
        return started[1]

    def elapsed_ms(self, handle):
        self.read.append(handle)
        return 5.0


def test_a_sync_reads_only_steps_at_least_lag_steps_old_and_only_the_source_rank_times():
    clock = TokenClock()
    controller = AutoController(GoodputPolicy(AutoConfig(), GRAPH_SIZES), source=True,
                                clock=clock)
    for _ in range(17):  # the 17th decision is step 16: a sync, reading steps 0 .. 14
        controller.decide(8)
        if controller.policy.steps <= 16:
            controller.finish_step(controller.start_step(), True, 8, constant(2.0))
    assert clock.read == list(range(1, 16))
    assert [m.step for m in controller.measurements._pending] == [15]  # step 15 is left
    other = AutoController(GoodputPolicy(AutoConfig(), GRAPH_SIZES), source=False,
                           clock=TokenClock())
    other.decide(8)
    assert other.start_step() is None
    other.finish_step(None, True, 8, constant(2.0))
    assert other.measurements._pending == []


def test_each_step_records_the_mode_it_ran_in_a_speculative_one_in_fallback_is_a_probe():
    controller = AutoController(policy_with(1.0), source=True, clock=TokenClock())
    for _ in range(8):
        controller.decide(64)
    assert controller.in_fallback
    controller.finish_step(controller.start_step(), True, 64, constant(2.0))
    controller.finish_step(controller.start_step(), False, 64)
    speculating = AutoController(policy_with(2.0), source=True, clock=TokenClock())
    speculating.decide(8)
    speculating.finish_step(speculating.start_step(), True, 8, constant(2.0))
    steps = [(m.speculative, m.in_fallback) for m in (*controller.measurements._pending,
                                                      *speculating.measurements._pending)]
    assert steps == [(True, True), (False, True), (True, False)]  # a probe, fallback, spec


def test_a_deferred_probe_speculates_at_the_next_step_instead():
    """A probe whose step ran plain (the draft state was stale) is put off, not lost."""
    policy = policy_with(1.2)
    decisions = [policy.decide(64) for _ in range(40)]
    first_probe = decisions.index(False, AutoConfig().confirm_steps)
    policy = policy_with(1.2)
    for _ in range(first_probe + 1):
        policy.decide(64)
    policy.defer_speculation()
    probes = policy.n_probes
    # the probe's second step, then the one it owes, then fallback again
    assert [policy.decide(64) for _ in range(3)] == [False, False, True]
    assert policy.last_out_of_mode is False and policy.n_probes == probes
    # the probe gaps go on from the probe as decided: the next one 32 steps after its end
    later = [policy.decide(64) for _ in range(40)]
    assert later.index(False) == 32 - 3


def test_a_deferred_multi_step_probe_still_runs_all_its_steps():
    policy = policy_with(1.0)
    decisions = [policy.decide(4) for _ in range(40)]
    start = decisions.index(False, AutoConfig().confirm_steps)
    assert decisions[start : start + 9] == [False] * 8 + [True]  # 8 steps of 4 requests
    policy = policy_with(1.0)
    for _ in range(start + 1):
        policy.decide(4)
    policy.defer_speculation()
    assert [policy.decide(4) for _ in range(9)] == [False] * 8 + [True]


def test_a_deferred_explore_step_measures_at_the_next_step():
    costs = CostTable({64: (30.0, 10.0), 128: (None, 14.0)})
    policy = policy_with(3.5, costs)
    policy.in_fallback = True
    assert policy.decide(128) is False  # explore: the speculative cost at 128 is unknown
    policy.defer_speculation()
    assert [policy.decide(128) for _ in range(3)] == [False, True, True]


def test_nothing_is_owed_after_switching_back_to_speculation():
    policy = policy_with(2.5)
    policy.in_fallback = False
    policy.defer_speculation()  # a switch back whose first step ran plain
    decisions = [policy.decide(8) for _ in range(1100)]
    assert [i for i, fallback in enumerate(decisions) if fallback] == [1023]


# -- what a probe reads: each request's own tokens per step, their harmonic mean ---------------


def probe_steps(measurements: Measurements, readings, *, first_step=0, rids=None):
    """Feed ``measurements`` a probe: ``readings[s][r]`` the tokens request ``r`` gave at its
    step ``s`` (the batch's requests named ``rids``, default 0, 1, ...)."""
    for i, each in enumerate(readings):
        keys = tuple(rids or range(len(each)))
        tokens = StepTokens(sum(each) / len(each), tuple(float(x) for x in each))
        measurements.add(_Measured(first_step + i, True, len(each), len(each), 5.0,
                                   constant_reading(tokens), in_fallback=True,
                                   started=(first_step + i) * 1000, request_keys=keys))
    measurements.resolve(first_step + len(readings))


def constant_reading(tokens: StepTokens):
    return lambda: tokens


POINT_ESTIMATE = AutoConfig(probe_confidence=0.0, probe_confidence_few=0.0)


def test_a_probe_reads_the_harmonic_mean_of_its_requests_own_tokens_per_step():
    """A speculating batch holds a request for a time inversely proportional to its tokens per
    step: requests of 1, 2 and 4 tokens a step settle at 3 / (1 + 1/2 + 1/4), not their mean
    (the estimate itself: ``probe_confidence`` 0, no sampling error taken off)."""
    measurements = Measurements(POINT_ESTIMATE, StepCosts())
    probe_steps(measurements, [[1, 2, 4]] * 4)  # every reading alike: no variance to correct
    assert measurements.tokens_per_step == pytest.approx(3 / (1 + 1 / 2 + 1 / 4))
    assert speculating_tokens_per_step([_Verified(7.0, 3, 0, ((0, 1.0), (1, 2.0), (2, 4.0)))]) \
        == pytest.approx(12 / 7)


def test_without_each_requests_tokens_a_probe_reads_the_plain_mean():
    """A worker that reports only the step's mean (v1 on 0.4.x), or a step without its
    requests: the plain mean, as before."""
    measurements = Measurements(AutoConfig(), StepCosts())
    verified(measurements, [(3, 7 / 3)] * 4, probe=True)
    assert measurements.tokens_per_step == pytest.approx(7 / 3)


def test_a_requests_steps_pool_by_its_id_across_the_probes_steps():
    """Request "a" gives 1 then 3 tokens, "b" 2 and 2: each mean is 2, whatever the order the
    batch lists them in (a finished request leaves, the rest move up)."""
    measurements = Measurements(POINT_ESTIMATE, StepCosts())
    probe_steps(measurements, [[1, 2]], rids=["a", "b"])
    probe_steps(measurements, [[2, 3]], rids=["b", "a"], first_step=1)
    # "a": mean 2, variance 2 over 2 readings: 1/2 - 2 / (2 * 8); "b": 1/2
    assert measurements.tokens_per_step == pytest.approx(2 / (0.5 - 2 / 16 + 0.5))


def test_on_mixed_traffic_a_probe_reads_what_speculating_settles_at_not_the_plain_mean():
    """0 / 50 / 90 % acceptance, steps 3: tokens per step 1, 1.875 and 3.439; speculating
    settles at the harmonic mean (1.58 over this batch), the plain mean is 2.1. Probes of 16
    requests over 4 steps, and of 64 over 2 (their shortest), read it within 3 % on average
    and each within 15 %, where 1 / one step's tokens would read it 10 % low."""
    rng = random.Random(7)

    def verify(p: float) -> float:
        accepted = 0
        while accepted < 3 and rng.random() < p:
            accepted += 1
        return 1.0 + accepted

    def settles_at(ps) -> float:
        def mean(p):
            return sum((1 + n) * (p**n * (1 - p) if n < 3 else p**3) for n in range(4))
        return len(ps) / sum(1 / mean(p) for p in ps)

    for batch, steps in ((16, 4), (64, 2)):
        ps = [(0.0, 0.5, 0.9)[i % 3] for i in range(batch)]
        truth, reads = settles_at(ps), []
        for _ in range(200):
            measurements = Measurements(POINT_ESTIMATE, StepCosts())
            probe_steps(measurements, [[verify(p) for p in ps] for _ in range(steps)])
            reads.append(measurements.tokens_per_step)
        assert sum(reads) / len(reads) == pytest.approx(truth, rel=0.03), batch
        assert all(abs(r / truth - 1) < 0.15 for r in reads), batch
        plain_mean = sum(1 + p + p * p + p**3 for p in ps) / batch
        assert plain_mean > 1.25 * truth


def test_after_a_switch_to_fallback_the_stretchs_late_steps_do_not_switch_back():
    """Steps are read two or more steps late, so the stretch's last steps arrive after the
    switch; if they read better (noise) they are the stretch's, not news: only a probe's
    acceptance switches back (an H100, mixed traffic at c = 16: switched back 8 steps later)."""
    policy = policy_with(1.0)
    for _ in range(AutoConfig().confirm_steps):
        policy.decide(16)
    assert policy.in_fallback
    policy.adopt(Snapshot(4.0, table(), 16, 256, tokens_of_stretch=True))
    assert all(modes_through(policy, [16] * 12))  # in fallback: no probe due yet, no switch
    policy.adopt(Snapshot(4.0, table(), 16, 256, tokens_of_stretch=False))  # a probe's
    assert modes_through(policy, [16] * 12)[-1] is False  # back to speculation


def test_a_measurements_snapshot_says_whether_its_acceptance_is_a_stretchs():
    measurements = Measurements(AutoConfig(), StepCosts())
    assert not measurements.snapshot().tokens_of_stretch  # nothing read yet
    verified(measurements, [(16, 2.0)] * 4)
    assert measurements.snapshot().tokens_of_stretch
    verified(measurements, [(16, 2.0)] * 4, probe=True, first_step=4)
    assert not measurements.snapshot().tokens_of_stretch


def test_a_composition_is_learned_only_where_the_probe_and_the_stretchs_end_share_a_load():
    """A probe of one request at c = 1 that began a stretch ending at 16 requests: their ratio
    is the load's, not a composition (it taught 0.83 on uniform traffic in the simulator)."""
    measurements = Measurements(WINDOW_64, StepCosts())
    verified(measurements, [(1, 2.1)] * 8, probe=True)
    verified(measurements, [(16, 1.75)] * 8, first_step=8)
    fallback_step(measurements, 16, requests=16)
    assert measurements.composition == 1.0
    verified(measurements, [(16, 2.1)] * 4, probe=True, first_step=17)
    verified(measurements, [(16, 1.75)] * 8, first_step=21)
    fallback_step(measurements, 29, requests=16)
    assert measurements.composition == pytest.approx(1.75 / 2.1)


def test_a_requests_corrected_tokens_per_step_stays_within_its_readings():
    """The bias correction of 1 / mean, for readings far apart (a 7-step draft: 1 then 8
    tokens), would credit the request more than its best step; it is held at that."""
    one = [_Verified(9.0, 1, 0, (("a", 1.0),)), _Verified(9.0, 1, 0, (("a", 8.0),))]
    assert speculating_tokens_per_step(one) == pytest.approx(8.0)
    same = [_Verified(2.0, 1, 0, (("a", 2.0),))] * 3
    assert speculating_tokens_per_step(same) == pytest.approx(2.0)


def test_the_first_probe_read_by_request_is_logged_once_with_each_requests_readings():
    """On a real server the log shows how a probe read: each request's tokens per step (one
    digit a step), what they say speculating settles at, and the plain mean."""
    lines: list[str] = []
    measurements = Measurements(AutoConfig(), StepCosts(), lines.append)
    probe_steps(measurements, [[1] * 6 + [4]] * 2)  # 7 requests of two readings: too few
    fallback_step(measurements, 2, requests=8)
    assert lines == []
    probe_steps(measurements, [[1, 1, 1, 1, 2, 2, 4, 4]] * 2, first_step=3,
                rids=[f"r{i}" for i in range(8)])
    fallback_step(measurements, 5, requests=8)
    probe_steps(measurements, [[4] * 8] * 2, first_step=6)
    fallback_step(measurements, 8, requests=8)
    steps_per_token = [1.0] * 4 + [0.5] * 2 + [0.25] * 2
    harmonic = 8 / sum(steps_per_token)
    bound = 1 / (1 / harmonic + 2 * statistics.stdev(steps_per_token) / math.sqrt(8))
    assert lines == [
        "[dynspec] auto: the first probe read by request (8 requests, 2 steps; each request's "
        "tokens per step: 11 11 11 11 22 22 44 44): speculating would settle at "
        f"{harmonic:.2f} tokens per step, at least {bound:.2f} within 2 standard errors; the "
        "fallback batch's plain mean is 2.00"
    ]


def test_a_probe_counts_at_its_estimate_less_two_standard_errors_of_its_requests_mean():
    """A probe of 16 mixed requests over 4 steps reads what speculating settles at within ~17 %
    (the simulator), and a probe one standard deviation high called speculation back at c = 16
    every few probes where plain steps win by 5-9 %. So a probe counts at 1 / (its requests'
    mean steps per token + 2 standard errors of that mean): their spread over their number;
    requests alike, none; one request, the spread of its readings (the delta method)."""
    mixed = Measurements(AutoConfig(), StepCosts())
    probe_steps(mixed, [[1] * 6 + [2] * 5 + [4] * 5] * 4)
    steps_per_token = [1.0] * 6 + [0.5] * 5 + [0.25] * 5
    mean = sum(steps_per_token) / 16
    assert mixed.tokens_per_step == pytest.approx(
        1 / (mean + 2 * statistics.stdev(steps_per_token) / 4)
    )
    assert mixed.tokens_per_step < 0.8 / mean  # the estimate itself: 1 / mean

    alike = Measurements(AutoConfig(), StepCosts())
    probe_steps(alike, [[2] * 16] * 4)
    assert alike.tokens_per_step == pytest.approx(2.0)

    one = Measurements(AutoConfig(probe_confidence_few=2.0), StepCosts())
    probe_steps(one, [[1], [3], [1], [3]])
    variance = statistics.variance([1, 3, 1, 3])  # 4/3 about a mean of 2, over 4 readings
    steps = 1 / 2 - variance / (4 * 2**3)  # 1 / mean less its bias, as the estimate
    assert one.tokens_per_step == pytest.approx(1 / (steps + 2 * math.sqrt(variance / (4 * 2**4))))


def test_below_8_requests_a_probe_counts_less_one_standard_error_not_two():
    """One request's readings over a probe's steps spread wide (a 50 % request: 1 to 4 tokens
    a step); at 2 standard errors its bound fell below the break-even at bs 1 where
    speculating gives 1.3x plain steps, and a mixed load that fell to one request in fallback
    stayed there."""
    def bound(readings, z):
        steps = [r for r in zip(*readings, strict=True)]
        each = [1 / statistics.mean(r) - statistics.variance(r) / (len(r) * statistics.mean(r) ** 3)
                for r in steps]
        if len(each) == 1:
            [r] = steps
            error = math.sqrt(statistics.variance(r) / (len(r) * statistics.mean(r) ** 4))
        else:
            error = statistics.stdev(each) / math.sqrt(len(each))
        return 1 / (statistics.mean(each) + z * error)

    half = [[2], [1], [3], [1], [1], [2], [4], [1]]  # one 50 % request over 8 steps
    one = Measurements(AutoConfig(), StepCosts())
    probe_steps(one, half)
    assert one.tokens_per_step == pytest.approx(bound(half, 1.0))
    assert one.tokens_per_step > 6.86 / 4.82 * 1.02 > bound(half, 2.0)  # H200, bs 1: 1.45
    seven = [[1, 2, 4, 1, 2, 3, 1]] * 2 + [[2, 2, 3, 1, 1, 4, 1]] * 2
    probe_steps(few := Measurements(AutoConfig(), StepCosts()), seven)
    assert few.tokens_per_step == pytest.approx(bound(seven, 1.0))
    eight = [[1, 2, 4, 1, 2, 3, 1, 2]] * 2 + [[2, 2, 3, 1, 1, 4, 1, 1]] * 2
    probe_steps(batch := Measurements(AutoConfig(), StepCosts()), eight)
    assert batch.tokens_per_step == pytest.approx(bound(eight, 2.0))


def test_a_stretch_after_a_probe_counts_at_its_own_mean_with_no_error_taken_off():
    """The bound is a probe's: once speculating, the stretch's steps are read by their mean."""
    measurements = Measurements(WINDOW_64, StepCosts())
    probe_steps(measurements, [[1] * 6 + [2] * 5 + [4] * 5] * 4)
    verified(measurements, [(16, 1.75)] * 8, first_step=4)
    assert measurements.tokens_per_step == pytest.approx(1.75)


def test_a_switch_back_logs_the_probes_that_called_it_each_request_read_by_itself():
    """A switch back on a high probe is the decision a real server got wrong (an H100 at
    c = 16, 2026-12-06: back on a bound of 1.75 tokens per step, the stretch read 1.61), so
    the probes behind each switch back are logged by request, as the first probe is."""

    def switch_back(requests) -> list[str]:
        clock = StepCosts()
        policy = GoodputPolicy(AutoConfig(), GRAPH_SIZES)
        controller = AutoController(policy, source=True, clock=clock)
        lines: list[str] = []
        controller.measurements._log = lines.append
        for step in range(3000):  # bs 64: plain steps win at 2 tokens a step, speculation at 4
            tokens = 2.0 if step < 1000 else 4.0
            fallback = controller.decide(64)
            clock.next_ms = plain_ms(64) if fallback else spec_ms(64)
            started = controller.start_step()
            reading = StepTokens(tokens, (tokens,) * 64)
            reader = None if fallback else (lambda value=reading: value)
            controller.finish_step(started, not fallback, 64, reader, requests)
        assert policy.n_switches == 2  # to plain steps, and back on the rise
        return [line for line in lines if "called speculation back" in line]

    assert switch_back(()) == []  # probes read by their mean alone: nothing by request to show
    [back] = switch_back([types.SimpleNamespace(rid=f"r{i}") for i in range(64)])
    head, rows = back.split("each request's tokens per step: ")
    assert head.startswith(
        "[dynspec] auto: the probes that called speculation back read by request (64 requests, "
    )
    rows, tail = rows.split("): ")
    assert len(rows.split()) == 64 and set(rows.replace(" ", "")) == {"4"}
    assert tail == ("speculating would settle at 4.00 tokens per step, at least 4.00 within 2 "
                    "standard errors; the fallback batch's plain mean is 4.00")


# Prefills between decode steps (PrefillCost): an H100's figures, SGLang 0.5.17, 2026-12-06.
H100_128 = CostTable({64: (19.1, 7.1), 128: (31.75, 8.32)})
H100_PREFILL = PrefillCost(7.9, 0.55)


def test_a_prefill_cost_is_fitted_to_its_batches_a_stall_left_out():
    batches = [(n, 7.9 + 0.55 * n) for n in (1, 2, 3, 5, 8, 2, 1, 4)]
    fit = fit_prefill_cost([*batches, (2, 500.0)])  # a kernel compiled in one: left out
    assert fit == PrefillCost(pytest.approx(7.9), pytest.approx(0.55))
    assert fit_prefill_cost([]) is None
    assert fit_prefill_cost([(1, 8.0), (1, 9.0)]) == PrefillCost(8.5, 0.0)  # one size: fixed
    # both parts at least 0: a slope read below 0 is 0, one above the mean per request is that
    assert fit_prefill_cost([(1, 10.0), (4, 8.0)]) == PrefillCost(9.0, 0.0)
    assert fit_prefill_cost([(1, 0.5), (2, 9.0)]) == PrefillCost(0.0, pytest.approx(4.75 / 1.5))


def test_a_modes_prefills_per_step_follow_its_admissions():
    """About 1 - e^-r batches a step (SGLang runs one between two decode steps when any
    arrived) and r requests: the fixed part saturates, the part per request does not."""
    assert H100_PREFILL.per_step_ms(0.0) == 0.0
    few = H100_PREFILL.per_step_ms(0.01)  # one request every 100 steps: one batch each
    assert few == pytest.approx(0.01 * (7.9 + 0.55), rel=0.01)
    assert H100_PREFILL.per_step_ms(1.0) == pytest.approx(7.9 * (1 - math.exp(-1)) + 0.55)
    assert H100_PREFILL.per_step_ms(20.0) == pytest.approx(7.9 + 11.0, rel=1e-6)


def prefill_policy(tokens_per_step: float, admitted_per_token: float, **snapshot) -> GoodputPolicy:
    policy = GoodputPolicy(AutoConfig(), GRAPH_SIZES)
    policy.adopt(Snapshot(tokens_per_step, H100_128, admitted_per_token=admitted_per_token,
                          **snapshot))
    return policy


def test_prefills_turn_the_choice_where_outputs_are_short_and_the_batch_large():
    """At bs 128 on an H100 (accept90, outputs of 128 tokens): decode steps alone put plain
    steps ahead (3.35 / 31.75 < 1 / 8.32), but a speculative step finishes 3.35 times the
    requests, admitted in as many prefill batches as a plain step's: EAGLE-3 won by 13 %."""
    both = {"prefill_spec": H100_PREFILL, "prefill_plain": H100_PREFILL}
    decode_only = prefill_policy(3.35, 0.0, **both)  # no admission rate read yet
    assert decode_only.estimates(128).plain_tok_s > decode_only.estimates(128).spec_tok_s
    assert modes_through(decode_only, [128] * 16)[-1] is True
    with_prefills = prefill_policy(3.35, 1 / 128, **both)
    est = with_prefills.estimates(128)
    assert est.plain_prefill_ms == pytest.approx(H100_PREFILL.per_step_ms(1.0))
    assert est.spec_prefill_ms == pytest.approx(H100_PREFILL.per_step_ms(3.35))
    assert est.spec_tok_s / est.plain_tok_s == pytest.approx(1.12, abs=0.01)
    assert not any(modes_through(with_prefills, [128] * 16))
    # the crossover moves with acceptance: at 2.5 tokens per step plain steps still win
    assert modes_through(prefill_policy(2.5, 1 / 128, **both), [128] * 16)[-1] is True
    # and with the length: outputs of 1024 tokens admit too few requests to change it
    assert modes_through(prefill_policy(3.35, 1 / 1024, **both), [128] * 16)[-1] is True
    # no prefill timed: decode steps alone, whatever the admission rate
    assert modes_through(prefill_policy(3.35, 1 / 128), [128] * 16)[-1] is True


def test_a_mode_with_no_prefill_timed_borrows_the_other_modes_cost():
    spec_only = Snapshot(3.0, H100_128, admitted_per_token=1 / 128, prefill_spec=H100_PREFILL)
    assert spec_only.prefill_ms_per_step(False, 1.0) == H100_PREFILL.per_step_ms(1.0)
    cheaper = PrefillCost(6.0, 0.5)  # in fallback the direct prefill skips the draft's pass
    both = dataclasses.replace(spec_only, prefill_plain=cheaper)
    assert both.prefill_ms_per_step(False, 1.0) == cheaper.per_step_ms(1.0)
    assert both.prefill_ms_per_step(True, 1.0) == H100_PREFILL.per_step_ms(1.0)


def test_with_prefills_speculation_can_win_where_decode_steps_alone_say_it_cannot():
    """In fallback no probe speculates where speculation loses at every draft accepted; with
    prefills counted that bound is the prefills' too (else fallback entered at such a load
    would never probe its way back)."""
    config = {"max_tokens_per_step": 4.0}
    no_rate = GoodputPolicy(AutoConfig(**config), GRAPH_SIZES)
    no_rate.adopt(Snapshot(1.0, CostTable({128: (36.0, 8.32)}), prefill_spec=H100_PREFILL))
    assert no_rate._speculation_cannot_win(128)  # 4 / 36 < 1 / 8.32
    rate = GoodputPolicy(AutoConfig(**config), GRAPH_SIZES)
    rate.adopt(dataclasses.replace(no_rate.snapshot, admitted_per_token=1 / 128))
    assert not rate._speculation_cannot_win(128)


def test_a_switch_logs_each_modes_prefills_per_step():
    lines: list[str] = []
    policy = GoodputPolicy(AutoConfig(), GRAPH_SIZES, log=lines.append)
    policy.adopt(Snapshot(2.0, H100_128, admitted_per_token=1 / 128,
                          prefill_spec=H100_PREFILL, prefill_plain=H100_PREFILL))
    modes_through(policy, [128] * 8)
    assert policy.in_fallback
    est = policy.last
    assert (f"spec {est.spec_tok_s:.0f} tok/s (2.00 tokens/step, 31.75 ms/step + "
            f"{est.spec_prefill_ms:.2f} ms of prefills) vs plain {est.plain_tok_s:.0f} tok/s "
            f"(8.32 ms/step + {est.plain_prefill_ms:.2f} ms of prefills)") in lines[0]
    assert lines[0].endswith(
        "; prefill batches speculating 7.90 + 0.55 ms a request, in fallback 7.90 + 0.55 ms a "
        "request; 1 request admitted per 128 tokens"
    )
    no_prefills: list[str] = []
    policy = GoodputPolicy(AutoConfig(), GRAPH_SIZES, log=no_prefills.append)
    policy.adopt(Snapshot(2.0, H100_128))
    modes_through(policy, [128] * 8)
    assert "prefill" not in no_prefills[0] and no_prefills[0].endswith("probes=0")


def test_the_admission_rate_is_read_over_the_newest_admission_tokens():
    measurements = Measurements(AutoConfig(admission_tokens=16384), StepCosts())
    # 64 requests at 2 tokens a step (128 tokens), one admitted a step: 1 per 128 tokens
    verified(measurements, [(64, 2.0)] * 200, started=list(range(200)))
    assert measurements.admitted_per_token == pytest.approx(1 / 128)
    # then plain steps of 64 (64 tokens), one admitted every other step: 1 per 128 again,
    # and after 256 of them (16384 tokens) nothing of the first rate is left
    for step in range(200, 456):
        measurements.add(_Measured(step, False, 64, 64, 5.0, None, started=199 + (step - 199) // 2))
    measurements.resolve(455)
    assert measurements.admitted_per_token == pytest.approx(1 / 128, rel=0.01)
    for step in range(456, 712):  # none admitted: the rate falls to 0 once they fill it
        measurements.add(_Measured(step, False, 64, 64, 5.0, None, started=327))
    measurements.resolve(711)
    assert measurements.admitted_per_token == pytest.approx(0.0, abs=1 / 16384)
    assert measurements.snapshot().admitted_per_token == measurements.admitted_per_token


def test_prefills_are_timed_by_the_mode_they_ran_in_and_resolved_with_the_step_after():
    clock = StepCosts()
    controller = AutoController(GoodputPolicy(AutoConfig(), GRAPH_SIZES), source=True, clock=clock)
    for n in (1, 2, 3, 4):
        clock.next_ms = 7.9 + 0.55 * n
        controller.finish_prefill(controller.start_step(), n)
        controller.decide(8)
        clock.next_ms = 10.0
        controller.finish_step(controller.start_step(), True, 8, constant(2.0))
    measurements = controller.measurements
    assert [p.step for p in measurements._pending_prefills] == [0, 1, 2, 3]
    measurements.resolve(2)  # the prefills before steps 0-2
    timed = [(n, pytest.approx(7.9 + 0.55 * n)) for n in (1, 2, 3)]
    assert list(measurements._prefills[True]) == timed
    assert [p.step for p in measurements._pending_prefills] == [3]
    fitted = PrefillCost(pytest.approx(7.9), pytest.approx(0.55))
    assert measurements.snapshot().prefill_spec == fitted
    assert measurements.snapshot().prefill_plain is None
    measurements.add_prefill(_MeasuredPrefill(4, 2, 6.0, in_fallback=True))
    measurements.resolve(4)
    assert measurements.snapshot().prefill_plain == PrefillCost(6.0, 0.0)
    assert controller.n_started == 10
