"""Step decisions the release tests left unseen (mutants of the runtime that kept them green: see
tools/mutation.py): a v2 draft worker whose stride agrees, and the profiler's batch sizes."""

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
from tests.runtime.releases import V1_RELEASES, V2_RELEASES

pytestmark = pytest.mark.torch


def world(version: str, variant: str, **kwargs):
    from tests.runtime.standins import World, read_shape

    return World(read_shape(version, variant), **kwargs)


def test_a_v2_draft_worker_with_the_same_stride_takes_the_fallback_step():
    w = world(V2_RELEASES[-1], "v2", batch_size=2)
    w.worker.draft_worker.speculative_num_draft_tokens = w.worker.speculative_num_draft_tokens
    assert dyn.maybe_fallback_v2(w.worker, w.batch) is not None
    assert "target_forward" in w.recorder.names()


@pytest.mark.parametrize(("variant", "version", "run"), [
    ("v1", V1_RELEASES[-1], dyn.maybe_fallback_v1),
    ("v2", V2_RELEASES[-1], dyn.maybe_fallback_v2)])
def test_the_profiler_counts_each_fallback_step_under_its_batch_size(monkeypatch, variant,
                                                                     version, run):
    monkeypatch.setenv(dyn.PROFILE_ENV, "1")
    w = world(version, variant, batch_size=3)
    assert run(w.worker, w.batch) is not None
    profiler = dyn._adapter_for(w.worker, variant).profiler
    assert isinstance(profiler, dyn.StepProfiler)
    assert list(profiler.summary()) == [3]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"threshold": "8"}, "threshold must be an integer >= 1, got '8'"),
    ({"threshold": 8, "resume_below": "3"}, "resume_below must be an integer, got '3'"),
    ({"threshold": 8, "resume_below": True}, "resume_below must be an integer, got True"),
    ({"threshold": 8, "resume_below": 9}, "resume_below must be in [1, threshold], got 9 for 8"),
    ({"threshold": 8, "min_dwell_steps": 1.5}, "min_dwell_steps must be an integer, got 1.5"),
    ({"threshold": 8, "min_dwell_steps": 0}, "min_dwell_steps must be >= 1, got 0"),
])
def test_a_bad_controller_setting_says_which_and_what_it_got(kwargs, message):
    with pytest.raises(ValueError) as bad:
        dyn.DynSpecController(**kwargs)
    assert str(bad.value) == message


def test_a_switch_logs_the_steps_spent_in_the_mode_it_leaves():
    lines: list[str] = []
    controller = dyn.DynSpecController(threshold=4, min_dwell_steps=2, log=lines.append,
                                       resume_steps=2)
    for bs in (9, 9, 9, 1, 1):
        controller.decide(bs)
    assert lines == [
        "[dynspec] spec -> fallback at decode bs=9 (threshold=4, resume_below=3, "
        "steps_in_prev_mode=2, switches=1, fallback_steps=0, spec_steps=0)",
        "[dynspec] fallback -> spec at decode bs=1 (threshold=4, resume_below=3, "
        "steps_in_prev_mode=4, switches=2, fallback_steps=4, spec_steps=0)"]


def test_batches_without_the_optional_fields_are_judged_by_what_they_have():
    from types import SimpleNamespace

    from tests.runtime.standins import ForwardMode

    assert dyn._has_grammar(SimpleNamespace(sampling_info=SimpleNamespace())) is False
    assert dyn._is_pure_decode(SimpleNamespace(forward_mode=ForwardMode.DECODE)) is True
    mixed = SimpleNamespace(forward_mode=ForwardMode.DECODE, is_extend_in_batch=True)
    assert dyn._is_pure_decode(mixed) is False
