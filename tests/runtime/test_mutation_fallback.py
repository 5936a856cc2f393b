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
