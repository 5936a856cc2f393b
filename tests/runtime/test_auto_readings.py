"""What `auto` reads before it decides, at the edges: the survivors of the first mutation run
over these functions (`tools/mutation.py auto_readings`), each pinned by its documented rule."""

import pytest

from dynspec_patch.transforms.runtime.dynspec_fallback import (
    AUTO_CONFIG_ENV,
    AutoConfig,
    CostTable,
    GoodputPolicy,
    HostClock,
    Measurements,
    PrefillCost,
    Snapshot,
    _steps_per_token,
    _Verified,
    auto_config_overrides,
    fit_prefill_cost,
    speculating_tokens,
)


def _overrides(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(AUTO_CONFIG_ENV, raising=False)
    else:
        monkeypatch.setenv(AUTO_CONFIG_ENV, value)
    warnings: list[str] = []
    return auto_config_overrides(warnings.append), warnings


@pytest.mark.parametrize("value", [None, "", "  "])
def test_no_dynspec_auto_config_overrides_nothing_and_says_nothing(monkeypatch, value):
    assert _overrides(monkeypatch, value) == ({}, [])


def test_the_least_values_an_override_takes_an_int_of_1_and_a_float_of_0(monkeypatch):
    assert _overrides(monkeypatch, "probe_gap=1,probe_confidence=0") == (
        {"probe_gap": 1, "probe_confidence": 0.0},
        [],
    )


def test_an_override_splits_at_its_first_equals_sign(monkeypatch):
    overrides, [warning] = _overrides(monkeypatch, "probe_gap=2=3")
    assert overrides == {}
    assert warning.endswith("probe_gap takes a positive int, not '2=3'")


def test_a_prefill_batch_at_3x_the_median_counts_and_one_above_does_not():
    median = [(4, 10.0)] * 3
    # at the cap it is one of the fit's batches (all of 4 requests: their mean is fixed)
    assert fit_prefill_cost([*median, (4, 30.0), (4, 30.0)]).fixed_ms == pytest.approx(18.0)
    # 3.5x: a kernel compiled there, not the batch's cost
    assert fit_prefill_cost([*median, (4, 35.0)]).fixed_ms == pytest.approx(10.0)


def test_a_prefill_batch_of_no_requests_is_left_out_of_the_fit():
    # with the empty batch the sizes would differ and split the cost into two parts
    cost = fit_prefill_cost([(4, 10.0), (4, 10.0), (0, 4.0)])
    assert (cost.fixed_ms, cost.per_request_ms) == (pytest.approx(10.0), 0.0)


def _probe_step(*tokens_by_request: tuple[str, float]) -> _Verified:
    total = sum(tokens for _, tokens in tokens_by_request)
    return _Verified(total, len(tokens_by_request), 0, tuple(tokens_by_request))


def test_one_requests_bound_is_its_estimate_over_one_step_and_below_it_over_two():
    one = speculating_tokens([_probe_step(("a", 2.0))], 1.0)
    assert one.bound == one.estimate == pytest.approx(0.5 ** -1)
    two = speculating_tokens([_probe_step(("a", 1.0)), _probe_step(("a", 4.0))], 1.0)
    assert two.bound < two.estimate


def test_a_bound_never_reads_below_one_token_a_step():
    # requests at about one token a step, widely spread: the mean plus two errors passes 1
    steps = [_probe_step(("a", 1.0), ("b", 1.0), ("c", 4.0))]
    reading = speculating_tokens(steps, 2.0)
    assert reading.bound == 1.0
    assert reading.estimate > 1.0


def test_a_requests_steps_per_token_is_at_most_one():
    # a verify gives a request at least one token; a reading below that is clamped
    assert _steps_per_token([0.5]) == 1.0


def test_a_probe_runs_whole_steps_enough_for_its_requests():
    policy = GoodputPolicy(AutoConfig(), [1, 2, 4, 8, 16])
    assert policy._probe_steps(10) == 7  # 64 requests over 10 a step: 6.4, so 7 steps
    assert isinstance(policy._probe_steps(10), int)
    small = GoodputPolicy(AutoConfig(probe_requests=8, probe_steps_max=16), [1, 2, 4])
    assert small._probe_steps(1) == 8


def test_a_switch_is_recent_for_flap_window_steps_after_it():
    policy = GoodputPolicy(AutoConfig(flap_window=100), [1, 2, 4])
    policy._last_switch = (500, 4)
    for steps, recent in ((500, True), (599, True), (600, False)):
        policy.steps = steps
        assert policy._recent_switch() is recent, steps


def test_each_mode_pays_its_own_prefills_at_its_own_admissions():
    policy = GoodputPolicy(AutoConfig(), [1, 2, 4, 8, 16])
    spec_cost, plain_cost = PrefillCost(10.0, 1.0), PrefillCost(2.0, 0.5)
    policy.snapshot = Snapshot(admitted_per_token=0.01, prefill_spec=spec_cost,
                               prefill_plain=plain_cost)
    est = policy._with_prefills(16, 16, 2.0, 8.0, 6.0, 16)
    # a speculative step decodes 2 tokens a request, so it admits twice the requests
    assert est.spec_prefill_ms == pytest.approx(spec_cost.per_step_ms(16 * 0.01 * 2.0))
    assert est.plain_prefill_ms == pytest.approx(plain_cost.per_step_ms(16 * 0.01))
    assert est.spec_prefill_ms != pytest.approx(plain_cost.per_step_ms(16 * 0.01 * 2.0))


def _bounded_policy(entries):
    policy = GoodputPolicy(AutoConfig(max_tokens_per_step=2.0), [1, 2, 4, 8, 16, 32])
    policy.snapshot = Snapshot(table=CostTable(entries))
    return policy


def test_speculation_that_can_at_best_tie_with_plain_steps_is_not_ruled_out():
    # every draft accepted: 2 tokens a 12-ms step against 1 token a 6-ms step
    assert _bounded_policy({16: (12.0, 6.0)})._speculation_cannot_win(16) is False
    assert _bounded_policy({16: (12.5, 6.0)})._speculation_cannot_win(16) is True


def test_one_mode_timed_alone_at_a_size_rules_nothing_out_there():
    assert _bounded_policy({16: (30.0, None)})._speculation_cannot_win(16) is False
    assert _bounded_policy({16: (None, 6.0)})._speculation_cannot_win(16) is False


def _admissions(steps, admission_tokens=100):
    """The admission rate after these (requests started so far, tokens decoded) steps."""
    measurements = Measurements(AutoConfig(admission_tokens=admission_tokens), HostClock())
    for started, decoded in steps:
        measurements._add_admissions(started, decoded)
    return measurements.admitted_per_token


def test_the_admission_rate_is_read_over_the_newest_admission_tokens():
    # the first step's admissions are not known (no step before it); a step of no tokens
    # passes its admissions on; at exactly 100 tokens without the oldest step, it goes
    assert _admissions([(10, 50), (11, 0), (13, 50), (16, 50)]) == pytest.approx(6 / 100)
    # a long step leaves only itself once the others fall out
    assert _admissions([(10, 50), (13, 50), (16, 300)]) == pytest.approx(3 / 300)
    # 60 tokens without the oldest step: it stays
    assert _admissions([(10, 60), (13, 60)]) == pytest.approx(3 / 120)


def test_a_plain_step_at_one_request_decodes_one_token_and_counts():
    assert _admissions([(1, 1.0), (2, 1.0)]) == pytest.approx(1 / 2)


def test_an_empty_acceptance_window_holds_no_batch():
    assert Measurements(AutoConfig(), HostClock())._newest_is_a_batch() is False


def _probe_after(before_tokens: float, probe_tokens: float, probe_requests: int):
    """A probe of ``probe_requests`` requests reading ``probe_tokens`` a request after probes
    that read ``before_tokens`` (plain means: the steps say no request's own tokens), with a
    ``probe_change`` of 0.25 (exact in binary)."""
    measurements = Measurements(AutoConfig(probe_change=0.25), HostClock())
    measurements._before_probe = [_Verified(before_tokens * 8, 8, 0)]
    measurements._published_before_probe = before_tokens
    measurements._probe_steps = [_Verified(probe_tokens * probe_requests, probe_requests, 0)]
    window = measurements._probe_window()
    return len(window), measurements._change_cap


def test_a_probe_that_reads_exactly_probe_change_off_still_pools():
    assert _probe_after(2.0, 2.5, 16) == (2, None)  # 2.5 / 2.0 - 1 = 0.25
    assert _probe_after(2.0, 1.5, 16) == (2, None)  # a fall of 0.25
    assert _probe_after(2.0, 2.75, 16) == (1, 2.0)  # beyond: it replaces them, capped


def test_a_rise_on_exactly_composition_min_batch_requests_is_capped():
    assert _probe_after(2.0, 3.0, 8) == (1, 2.0)
    assert _probe_after(2.0, 3.0, 7) == (1, None)  # a few requests' own acceptance
    assert _probe_after(2.0, 3.0, 64) == (1, None)  # probe_requests: the traffic's


def test_one_flap_not_yet_forgiven_still_wants_several_probes_of_acceptance():
    policy = GoodputPolicy(AutoConfig(flap_window=100), [1, 2, 4, 8, 16, 32])
    policy._last_switch, policy._flaps, policy.steps = (0, 16), 2, 150  # one of two forgiven
    assert not policy._recent_switch() and policy._recent_flaps() == 1
    policy.snapshot = Snapshot(tokens_requests=64)  # one probe of 16 requests over 4 steps
    assert policy._acceptance_is_enough(16) is False
    policy.snapshot = Snapshot(tokens_requests=256)  # flap_factor (4) such probes
    assert policy._acceptance_is_enough(16) is True
