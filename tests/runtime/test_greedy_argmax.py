"""v2 fallback steps of greedy batches that sample by one argmax (``GreedyArgmax``).

For a one-node tree of an all-greedy batch with nothing that changes the logits, SGLang's
sampler returns the argmax and one accept length for every request; the runtime takes the
argmax itself, as plain decoding's sampler does, once a real step has shown that the release's
sampler agrees. Every other step, and every step after a disagreement, runs the sampler.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
from tests.runtime.releases import V2_RELEASES

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def shapes():
    from tests.runtime.standins import read_shape

    return {v: read_shape(v, "v2") for v in V2_RELEASES}


def make_world(shape: Any) -> Any:
    from tests.runtime.standins import World

    return World(shape, threshold=2)


def step(world: Any, bs: int = 3, seq_len: int = 10, **sampling: Any) -> Any:
    """One fallback step of a fresh decode batch; ``sampling``: sampling_info fields to set."""
    from tests.runtime.standins import new_decode_batch

    batch = new_decode_batch(world, bs, seq_len)
    for name, value in sampling.items():
        setattr(batch.sampling_info, name, value)
    result = dyn.maybe_fallback_v2(world.worker, batch)
    assert result is not None
    return result


def samples(world: Any) -> int:
    return world.recorder.names().count("sample")


def outcome(result: Any) -> tuple[Any, ...]:
    """What the scheduler reads of a step's sampling."""
    tokens, lens = result.next_token_ids, result.accept_lens
    return tokens.tolist(), tokens.dtype, lens.tolist(), lens.dtype


def adapter_of(world: Any) -> Any:
    return dyn._adapters[type(world.worker)]


@pytest.mark.parametrize("version", V2_RELEASES)
def test_after_one_checked_step_greedy_steps_take_the_argmax_alone(shapes, version, caplog):
    mine = make_world(shapes[version])
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(mine, seq_len=10)
        assert samples(mine) == 1  # the checking step runs the sampler
        fast = [outcome(step(mine, seq_len=n)) for n in (11, 12)]
    assert samples(mine) == 1
    assert "greedy fallback steps sample by one argmax" in caplog.text
    assert "3 tokens equal, accept length 1" in adapter_of(mine).greedy_argmax_note

    dyn.reset_for_tests()
    sampler = make_world(shapes[version])
    sampler_steps = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(dyn.GREEDY_ARGMAX_ENV, "0")
        step(sampler, seq_len=10)
        sampler_steps = [outcome(step(sampler, seq_len=n)) for n in (11, 12)]
    assert samples(sampler) == 3
    assert fast == sampler_steps


def penalized() -> Any:
    import types

    return types.SimpleNamespace(is_required=True)


NOT_ARGMAX = {
    "sampling": {"is_all_greedy": False},
    "logit_bias": {"logit_bias": "bias"},
    "penalties": {"penalizer_orchestrator": None},  # replaced by a required one below
    "accumulated additive penalties": {"acc_additive_penalties": "penalties"},
    "accumulated scaling penalties": {"acc_scaling_penalties": "penalties"},
    "accumulated linear penalties (<= 0.5.5.post2)": {"acc_linear_penalties": "penalties"},
    "custom logit processor": {"has_custom_logit_processor": True},
}


@pytest.mark.parametrize("case", sorted(NOT_ARGMAX))
def test_a_batch_whose_logits_change_or_that_samples_keeps_the_sampler(shapes, case):
    world = make_world(shapes["0.5.17"])
    step(world)  # checked
    fields = dict(NOT_ARGMAX[case])
    if case == "penalties":
        fields["penalizer_orchestrator"] = penalized()
    step(world, **fields)
    step(world, **fields)
    assert samples(world) == 3
    step(world)
    assert samples(world) == 3  # the next plain greedy batch takes the argmax again


@pytest.mark.parametrize(
    "field", ["logit_bias", "has_custom_logit_processor", "penalizer_orchestrator"]
)
def test_a_release_without_a_sampling_field_never_takes_the_argmax(shapes, field):
    from tests.runtime.standins import new_decode_batch

    world = make_world(shapes["0.5.17"])
    step(world)  # checked
    batch = new_decode_batch(world, 3, 10)
    delattr(batch.sampling_info, field)
    dyn.maybe_fallback_v2(world.worker, batch)
    assert samples(world) == 2


def test_a_sampler_that_differs_keeps_the_sampler_for_good(shapes, monkeypatch, caplog):
    world = make_world(shapes["0.5.17"])
    real = dyn._v2_sample

    def shifted(*args: Any) -> Any:
        predict, lens = real(*args)
        return predict + 1, lens

    monkeypatch.setattr(dyn, "_v2_sample", shifted)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world)
    assert "one argmax differs from SGLang's sampler at bs=3 (3 of 3 tokens differ" in caplog.text
    monkeypatch.setattr(dyn, "_v2_sample", real)
    step(world)
    step(world)
    assert samples(world) == 3
    assert adapter_of(world).greedy_argmax.broken


def test_uneven_accept_lengths_keep_the_sampler(shapes, monkeypatch):
    world = make_world(shapes["0.5.17"])
    real = dyn._v2_sample

    def uneven(*args: Any) -> Any:
        predict, lens = real(*args)
        lens = lens.clone()
        lens[0] = 2
        return predict, lens

    monkeypatch.setattr(dyn, "_v2_sample", uneven)
    step(world)
    assert "accept lengths [1, 2]" in adapter_of(world).greedy_argmax.broken


def test_the_accept_length_is_the_one_the_release_reports(shapes, monkeypatch):
    """A release whose sampler counts accepted drafts only (0 for a one-node tree)."""
    import torch

    world = make_world(shapes["0.5.12.post1"])
    real = dyn._v2_sample

    def drafts_only(*args: Any) -> Any:
        predict, lens = real(*args)
        return predict, torch.zeros_like(lens)

    monkeypatch.setattr(dyn, "_v2_sample", drafts_only)
    step(world)
    monkeypatch.setattr(dyn, "_v2_sample", real)
    result = step(world)
    assert result.accept_lens.tolist() == [0, 0, 0]
    assert samples(world) == 1


def test_every_rank_must_agree(shapes, monkeypatch):
    world = make_world(shapes["0.5.17"])
    monkeypatch.setattr(dyn, "_all_ranks_agree", lambda group, ok: False)
    step(world)
    step(world)
    assert samples(world) == 2
    assert adapter_of(world).greedy_argmax.broken.endswith("another TP rank's differed")


@pytest.mark.parametrize("env", dyn.GREEDY_ARGMAX_REFUSING_ENVS)
def test_an_env_that_makes_the_sampler_do_more_refuses_it(shapes, monkeypatch, env):
    monkeypatch.setenv(env, "1")
    world = make_world(shapes["0.5.17"])
    step(world)
    step(world)
    assert samples(world) == 2
    assert adapter_of(world).greedy_argmax_note == f"SGLang's sampler ({env}=1)"


def test_off_by_default_where_it_has_not_run_on_a_gpu(shapes, monkeypatch):
    monkeypatch.delenv(dyn.GREEDY_ARGMAX_ENV)
    monkeypatch.setattr(dyn, "GREEDY_ARGMAX_RELEASES", ("9.9.9",))
    world = make_world(shapes["0.5.17"])
    step(world)
    step(world)
    assert samples(world) == 2
    assert "only where it has run on a GPU: 9.9.9" in adapter_of(world).greedy_argmax_note


def test_on_by_default_where_it_has_run_on_a_gpu(shapes, monkeypatch):
    monkeypatch.delenv(dyn.GREEDY_ARGMAX_ENV)
    monkeypatch.setattr(dyn, "GREEDY_ARGMAX_RELEASES", ("0.5.17",))
    monkeypatch.setattr(dyn, "sglang_release", lambda module_globals: "0.5.17")
    world = make_world(shapes["0.5.17"])
    step(world)
    step(world)
    assert samples(world) == 1


@pytest.mark.parametrize(
    ("release", "argmax"), [("0.5.17", True), ("0.5.12.post1", True), ("0.5.13.post1", False)]
)
def test_the_releases_it_ran_on_a_gpu_take_it_unset(shapes, monkeypatch, release, argmax):
    """Unset, one-argmax sampling runs on the releases where it ran on a GPU (0.5.17 on an
    H200, 0.5.12.post1 on an H100, RESULTS.md) and nowhere else."""
    monkeypatch.delenv(dyn.GREEDY_ARGMAX_ENV)
    monkeypatch.setattr(dyn, "sglang_release", lambda module_globals: release)
    world = make_world(shapes["0.5.17"])
    step(world)
    step(world)
    assert samples(world) == (1 if argmax else 2)


def test_the_overlap_schedulers_copy_has_no_orchestrator_and_its_penalties_in_acc(shapes):
    """SamplingBatchInfo.copy_for_forward (the overlap scheduler's) sets the orchestrator to
    None and accumulates penalties into acc_*; an H200 run crashed reading None.is_required."""
    world = make_world(shapes["0.5.17"])
    step(world, penalizer_orchestrator=None)  # checked
    step(world, penalizer_orchestrator=None)
    assert samples(world) == 1
    step(world, penalizer_orchestrator=None, acc_additive_penalties="penalties")
    assert samples(world) == 2

