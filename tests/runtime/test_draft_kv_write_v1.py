"""The draft KV write of v1 fallback steps (``EAGLEWorker``), against the one-layer EAGLE-3
stand-in draft model.

v1's verify() hands the worker a draft-extend input of the requests still running; the
worker's draft-extend stores their draft KV and returns the next draft input. Once a step
showed that the write stores what that draft-extend stores, a fallback step writes the draft
KV alone and hands on the incoming draft state of the running requests, and the step before
speculation resumes runs the draft-extend, as on v2 (test_draft_kv_write.py).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn

pytestmark = pytest.mark.torch

RELEASE = "0.5.12.post1"  # the v1 layout with a separate draft-extend input


@pytest.fixture(scope="module")
def shapes():
    from tests.runtime.standins import read_shape

    return {v: read_shape(v, "v1") for v in (RELEASE, "0.5.10.post1")}


@pytest.fixture(autouse=True)
def _kv_write_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "1")


def draft_state(batch: Any) -> None:
    """The draft state a decode batch carries (a prefill's or the last step's draft-extend)."""
    import torch

    bs = len(batch.seq_lens)
    batch.spec_info.topk_p = torch.arange(bs, dtype=torch.float32)[:, None] / 10
    batch.spec_info.topk_index = torch.arange(bs)[:, None] + 7
    batch.spec_info.hidden_states = torch.arange(bs, dtype=torch.float32)[:, None].repeat(1, 2)


def make_world(shapes: Any, version: str = RELEASE, **kwargs: Any) -> Any:
    from tests.runtime.standins import World, give_draft_model

    kwargs.setdefault("threshold", 2)
    world = World(shapes[version], speculative_disable_min_dwell_steps=1, **kwargs)
    give_draft_model(world)
    draft_state(world.batch)
    return world


def step(world: Any, bs: int, seq_len: int, finishing: tuple[int, ...] = ()) -> Any:
    """One decode step at ``bs`` requests of length ``seq_len``; ``finishing``: the rows whose
    request finishes with this step's token."""
    world.batch = world._make_batch(bs, seq_len, 100)
    draft_state(world.batch)
    for row in finishing:
        world.batch.reqs[row].max_new_tokens = 1
    return dyn.maybe_fallback_v1(world.worker, world.batch)


def extends(world: Any) -> list[dict[str, Any]]:
    return [data for name, data in world.recorder.events if name == "draft_extend"]


def adapter_of(world: Any) -> dyn.Adapter:
    return dyn._adapters[type(world.worker)]


def test_after_one_checked_step_fallback_steps_write_only_the_draft_kv(shapes, caplog):
    import torch

    from tests.runtime.standins import reference_draft_kv, stored_draft_kv

    world = make_world(shapes)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)  # checks the write against the worker's draft-extend
        result = step(world, 3, 11)  # writes the KV alone

    assert len(extends(world)) == 1
    assert "draft KV write matches SGLang's draft-extend at bs=3" in caplog.text
    slots, k, v = reference_draft_kv(world, 11, 3)
    got_k, got_v = stored_draft_kv(world, slots)
    assert torch.allclose(got_k, k) and torch.allclose(got_v, v)
    assert k.abs().sum() > 0  # the rows were written, not left at zero
    # The next draft input: rooted at this step's tokens, with the incoming draft state.
    next_input = world.batch.spec_info
    assert type(next_input).__name__ == "EagleDraftInput"
    assert next_input.bonus_tokens.tolist() == result.next_token_ids.tolist()
    assert next_input.topk_p.flatten().tolist() == pytest.approx([0.0, 0.1, 0.2])
    assert next_input.topk_index.flatten().tolist() == [7, 8, 9]
    assert next_input.hidden_states[:, 0].tolist() == [0.0, 1.0, 2.0]
    assert next_input.capture_hidden_mode.name == "LAST"
    assert world.batch.input_ids.tolist() == result.next_token_ids.tolist()
    assert adapter_of(world).draft_state_stale


def test_a_request_that_finishes_is_dropped_from_the_next_draft_input(shapes):
    """As verify() drops it from the draft-extend input: the rows left are the running
    requests', in order, with their own incoming draft state."""
    import torch

    from tests.runtime.standins import reference_draft_kv, stored_draft_kv

    world = make_world(shapes)
    step(world, 3, 10)
    result = step(world, 3, 11, finishing=(1,))

    assert len(extends(world)) == 1
    next_input = world.batch.spec_info
    tokens = result.next_token_ids.tolist()
    assert next_input.bonus_tokens.tolist() == [tokens[0], tokens[2]]
    assert next_input.topk_index.flatten().tolist() == [7, 9]
    assert next_input.hidden_states[:, 0].tolist() == [0.0, 2.0]
    slots, k, _ = reference_draft_kv(world, 11, 3)
    got_k, _ = stored_draft_kv(world, slots[[0, 2]])
    assert torch.allclose(got_k, k[[0, 2]])


def test_the_check_waits_for_a_step_in_which_no_request_finished(shapes, caplog):
    """A finished request's row is not in the worker's draft-extend: such a step runs the
    draft-extend unchecked, and the next step without one checks."""
    world = make_world(shapes)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10, finishing=(0,))
        assert not adapter_of(world).draft_kv_write.checked
        step(world, 3, 11)
        assert adapter_of(world).draft_kv_write.checked
        step(world, 3, 12)

    assert len(extends(world)) == 2
    assert caplog.text.count("draft KV write matches") == 1


def test_a_changed_model_fails_the_check_and_keeps_the_draft_extend(shapes, caplog):
    world = make_world(shapes)
    layer = world.worker.draft_model_runner.model.model.layers[0]
    real_forward = layer.forward

    def with_shifted_embeddings(positions, embeds, hidden_states, fb, residual):
        return real_forward(positions, embeds + 0.3, hidden_states, fb, residual)

    layer.forward = with_shifted_embeddings
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        for seq_len in (10, 11, 12):
            step(world, 3, seq_len)

    assert len(extends(world)) == 3
    assert "draft KV write differs from SGLang's draft-extend at bs=3" in caplog.text
    assert adapter_of(world).draft_kv_write.broken
    assert not adapter_of(world).draft_state_stale


@pytest.mark.usefixtures("resume_after_one_small_step")
def test_speculation_resumes_after_one_fallback_step_with_the_draft_extend(shapes, caplog):
    world = make_world(shapes)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)  # fallback: checked, draft-extend
        step(world, 3, 11)  # fallback: KV write
        resumed = step(world, 1, 12)  # the controller says speculate: one more fallback step
        resumed_input = world.batch.spec_info
        speculated = step(world, 1, 13)

    assert "fallback -> spec at decode bs=1" in caplog.text
    assert resumed is not None
    assert [len(e["seq_lens"]) for e in extends(world)] == [3, 1]
    assert resumed_input.topk_p.tolist() == [[1.0]]  # the draft-extend's state (incoming: 0)
    assert speculated is None  # the worker's own speculative step
    assert not adapter_of(world).draft_state_stale


@pytest.mark.usefixtures("resume_after_one_small_step")
def test_speculation_resumes_at_once_after_the_checked_step(shapes):
    world = make_world(shapes)
    step(world, 3, 10)
    assert adapter_of(world).draft_kv_write.checked
    assert step(world, 1, 11) is None
    assert len(extends(world)) == 1


def test_every_request_finishing_installs_the_idle_input(shapes):
    world = make_world(shapes)
    step(world, 3, 10)
    step(world, 2, 11, finishing=(0, 1))
    assert "preprocess_idle" in world.recorder.names()
    assert not adapter_of(world).draft_state_stale


@pytest.mark.parametrize(("release", "on"), [(RELEASE, True), ("0.5.11", False), (None, False)])
def test_on_by_default_only_on_a_release_it_ran_on(shapes, monkeypatch, release, on):
    from tests.runtime.standins import package_says_release

    monkeypatch.delenv(dyn.DRAFT_KV_WRITE_ENV)
    world = make_world(shapes)
    if release is not None:
        package_says_release(monkeypatch, world, release)
    step(world, 3, 10)
    step(world, 3, 11)
    assert len(extends(world)) == (1 if on else 2)
    assert (adapter_of(world).draft_kv_write is not None) is on
    if not on:
        assert adapter_of(world).draft_kv_write_note.startswith("off (DYNSPEC_DRAFT_KV_WRITE=1")


def test_zero_turns_it_off_where_it_ran(shapes, monkeypatch):
    from tests.runtime.standins import package_says_release

    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "0")
    world = make_world(shapes)
    package_says_release(monkeypatch, world, RELEASE)
    step(world, 3, 10)
    step(world, 3, 11)
    assert len(extends(world)) == 2


def test_a_release_whose_verify_returns_the_next_draft_input_keeps_the_draft_extend(
    shapes, caplog
):
    """Before 0.5.12 v1's verify() returns the draft input the draft-extend fills in place."""
    world = make_world(shapes, "0.5.10.post1")
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
        step(world, 3, 11)
    assert len(extends(world)) == 2
    adapter = adapter_of(world)
    assert adapter.draft_kv_write is None
    assert "hands the next draft input to the draft-extend" in adapter.draft_kv_write_note
    assert "draft KV write not used" in caplog.text


def test_the_profile_names_the_phase(shapes, monkeypatch, caplog):
    monkeypatch.setenv("DYNSPEC_PROFILE", "2")
    world = make_world(shapes)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
        step(world, 3, 11)
    assert "draft_kv_write=" in caplog.text and "draft_extend=" in caplog.text
