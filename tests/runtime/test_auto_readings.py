"""What `auto` reads before it decides, at the edges: the survivors of the first mutation run
over these functions (`tools/mutation.py auto_readings`), each pinned by its documented rule."""

import pytest

from dynspec_patch.transforms.runtime.dynspec_fallback import (
    AUTO_CONFIG_ENV,
    AutoConfig,
    CostTable,
    GoodputPolicy,
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
