"""v1 fallback steps that do SGLang's verify() bookkeeping for their one token themselves.

On a write-only fallback step (the draft KV write, checked) of a plain greedy batch, SGLang's
v1 verify() of the one-node tree only takes the argmax and books one token per request; the
runtime does that without verify()'s tree kernels, its host synchronisations and its Python
loop per token (``_v1_one_token_verify``). It must leave every request, the batch and the
step's result exactly as verify() does; every other step keeps verify(). Which releases qualify
is read from verify()'s own source: the request attributes its loop touches.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
from tests.runtime.releases import V1_RELEASES

pytestmark = pytest.mark.torch

RELEASE = "0.5.12.post1"  # the only v1 layout whose verify() the bookkeeping repeats

REQUEST_FIELDS = (
    "output_ids",
    "finished_reason",
    "kv_committed_len",
    "kv_allocated_len",
    "spec_verify_ct",
    "spec_num_correct_drafts",
    "spec_correct_drafts_histogram",
    "reasoning_tokens",
)


@pytest.fixture(scope="module")
def shapes():
    from tests.runtime.standins import read_shape

    return {v: read_shape(v, "v1") for v in V1_RELEASES}


@pytest.fixture(autouse=True)
def _levers_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "1")
    monkeypatch.setenv(dyn.ONE_TOKEN_VERIFY_ENV, "1")


def make_world(shape: Any) -> Any:
    from tests.runtime.standins import World, give_draft_model

    world = World(shape, threshold=2, speculative_disable_min_dwell_steps=1)
    give_draft_model(world)
    return world


def step(world: Any, bs: int, seq_len: int, finishing: tuple[int, ...] = (), **batch: Any):
    """One decode step of ``bs`` requests of length ``seq_len``; ``finishing``: the rows whose
    request finishes with this step's token; ``batch``: sampling_info / batch fields to set.
    Row 1 reasons (think_end_id 5)."""
    from tests.runtime.standins import new_decode_batch

    new_decode_batch(world, bs, seq_len)
    world.batch.model_config.think_end_id = 5
    for row, req in enumerate(world.batch.reqs):
        req.require_reasoning = row == 1
        req.max_new_tokens = 1 if row in finishing else 100
        req.kv_committed_len, req.kv_allocated_len = seq_len, seq_len + 4
        req.spec_verify_ct = 7  # the speculative steps before this one
    for name, value in batch.items():
        holder = world.batch if name == "return_logprob" else world.batch.sampling_info
        setattr(holder, name, value)
    return dyn.maybe_fallback_v1(world.worker, world.batch)


def verifies(world: Any) -> int:
    return world.recorder.names().count("verify")


def note_when_refused(world: Any) -> str:
    """Run a checking step and a write-only step; both must keep SGLang's verify(). The note."""
    step(world, 3, 10)
    step(world, 3, 11)
    assert verifies(world) == 2
    return dyn._adapters[type(world.worker)].one_token_verify_note


def state(world: Any, result: Any) -> dict[str, Any]:
    """Everything a step leaves that the scheduler or the next step reads."""
    import torch

    from tests.runtime.standins import draft_runner

    batch = world.batch
    info = batch.spec_info
    pool = draft_runner(world).token_to_kv_pool
    out = {
        "reqs": [{f: getattr(r, f) for f in REQUEST_FIELDS} for r in batch.reqs],
        "seq_lens": batch.seq_lens.tolist(),
        "seq_lens_cpu": batch.seq_lens_cpu.tolist(),
        "out_cache_loc": batch.out_cache_loc.tolist(),
        "input_ids": batch.input_ids.tolist(),
        "next_token_ids": (result.next_token_ids.tolist(), result.next_token_ids.dtype),
        "accepted": [getattr(result, f) for f in ("num_correct_drafts", "accept_length_per_req")
                     if hasattr(result, f)],
        "per_req": [
            getattr(result, f)
            for f in ("num_correct_drafts_per_req_cpu", "accept_length_per_req_cpu")
            if hasattr(result, f)
        ],
        "draft_k": pool.k_buffer[0].clone(),
        "draft_v": pool.v_buffer[0].clone(),
        "next_slot": world.next_slot,
    }
    if isinstance(info, str):
        out["spec_info"] = info
    else:
        out["spec_info"] = {
            f: (v.tolist() if isinstance(v, torch.Tensor) else v)
            for f, v in dataclasses.asdict(info).items()
            if v is not None
        }
    return out


def assert_same(mine: dict[str, Any], sglang: dict[str, Any]) -> None:
    import torch

    for key in sglang:
        if key.startswith("draft_"):
            assert torch.equal(mine[key], sglang[key]), key
        else:
            assert mine[key] == sglang[key], key


def test_only_the_release_whose_verify_loop_it_repeats_qualifies(shapes):
    """From each pinned release's own verify() source: the request attributes its loop uses."""
    assert shapes[RELEASE].verify_source is not None
    qualifies = {
        v: dyn.verify_request_attributes(shape.verify_source) == dyn.VERIFY_REQUEST_ATTRIBUTES
        for v, shape in shapes.items()
    }
    assert qualifies == {v: v == RELEASE for v in V1_RELEASES}
    older = dyn.verify_request_attributes(shapes["0.5.10.post1"].verify_source)
    assert {"spec_accepted_tokens", "output_ids"} <= older


@pytest.mark.parametrize(
    "finishing",
    [(), (1,), (0, 2), (0, 1, 2)],
    ids=["none-finish", "the-reasoning-one-finishes", "two-finish", "all-finish"],
)
def test_a_write_only_step_leaves_what_sglang_verify_leaves(shapes, monkeypatch, finishing):
    """The same steps with the bookkeeping and with SGLang's verify(): the same requests,
    lengths, slots, next draft input, result and draft KV. Where every request finishes,
    verify()'s step stores no draft KV, and the bookkeeping's has already written the
    step's slots, which the scheduler frees with the requests: the draft KV is the same
    everywhere else."""
    states = {}
    for lever in ("1", "0"):
        monkeypatch.setenv(dyn.ONE_TOKEN_VERIFY_ENV, lever)
        dyn.reset_for_tests()
        world = make_world(shapes[RELEASE])
        step(world, 3, 10)  # the checking step: verify() and the draft-extend
        assert verifies(world) == 1
        result = step(world, 3, 11, finishing)  # write-only
        states[lever] = state(world, result)
        assert verifies(world) == (1 if lever == "1" else 2)
        assert dyn._adapters[type(world.worker)].one_token_verify is (lever == "1")
        slots = [d for n, d in world.recorder.events if n == "target_forward"][-1]["out_cache_loc"]
    if len(finishing) == 3:
        for key in ("draft_k", "draft_v"):
            assert not states["1"][key][slots].eq(0).all() and states["0"][key][slots].eq(0).all()
            for lever in ("1", "0"):
                states[lever][key][slots] = 0
    assert_same(states["1"], states["0"])
    reqs = states["1"]["reqs"]
    assert [len(r["output_ids"]) for r in reqs] == [1, 1, 1]
    assert [r["finished_reason"] is not None for r in reqs] == [i in finishing for i in range(3)]
    assert reqs[1]["reasoning_tokens"] == [(reqs[1]["output_ids"][0], 5)]
    assert [r["spec_verify_ct"] for r in reqs] == [8, 8, 8]
    assert [(r["kv_committed_len"], r["kv_allocated_len"]) for r in reqs] == [(12, 12)] * 3
    assert states["1"]["seq_lens"] == [12, 12, 12]  # verify() advanced L + 1 by one


@pytest.mark.usefixtures("resume_after_one_small_step")
def test_several_write_only_steps_and_the_resume_match_sglang_verify(shapes, monkeypatch):
    """A fallback stretch, then the step before speculation resumes (verify() and the
    draft-extend again), then the worker's own speculative step."""
    states, calls = {}, {}
    for lever in ("1", "0"):
        monkeypatch.setenv(dyn.ONE_TOKEN_VERIFY_ENV, lever)
        dyn.reset_for_tests()
        world = make_world(shapes[RELEASE])
        got = [state(world, step(world, 3, length)) for length in (10, 11, 12, 13)]
        got.append(state(world, step(world, 1, 14)))  # the controller says speculate
        assert step(world, 1, 15) is None  # the worker's own speculative step
        states[lever], calls[lever] = got, verifies(world)
    for mine, sglang in zip(states["1"], states["0"], strict=True):
        assert_same(mine, sglang)
    assert calls == {"1": 2, "0": 5}  # the checking step and the resume step keep verify()


def test_the_write_is_launched_once_before_the_bookkeeping_reads_the_tokens(shapes):
    """The draft KV write needs only the tokens, so it goes to the GPU before the one host
    sync (and the host loop after it), not behind them; and only once."""
    world = make_world(shapes[RELEASE])
    step(world, 3, 10)  # the checking step
    kv_write = dyn._adapters[type(world.worker)].draft_kv_write
    write, seen = kv_write.write, []

    def spy(tokens: Any, hidden: Any, positions: Any, loc: Any) -> Any:
        seen.append(([len(r.output_ids) for r in world.batch.reqs], positions.tolist()))
        return write(tokens, hidden, positions, loc)

    kv_write.write = spy
    step(world, 3, 11)
    assert verifies(world) == 1
    assert seen == [([0, 0, 0], [11, 11, 11])]  # nothing booked yet; the token's positions


def test_the_profile_names_the_draft_phase_each_step_ran(shapes, monkeypatch):
    """DYNSPEC_PROFILE's phases: a step that cannot check the write (a request finished) and
    the checking step ran the draft-extend, the next one the write."""
    monkeypatch.setenv(dyn.PROFILE_ENV, "1")
    world = make_world(shapes[RELEASE])
    step(world, 4, 9, finishing=(0,))
    profiler = dyn._adapters[type(world.worker)].profiler
    assert list(profiler.summary()[4]) == ["prepare", "target", "verify", "draft_extend", "end"]
    step(world, 3, 10)
    assert list(profiler.summary()[3]) == ["prepare", "target", "verify", "draft_extend", "end"]
    step(world, 3, 11)
    assert "draft_kv_write" in profiler.summary()[3]


@pytest.mark.parametrize(
    "batch",
    [
        {"is_all_greedy": False},
        {"logit_bias": "bias"},
        {"has_custom_logit_processor": True},
        {"return_logprob": True},
    ],
    ids=["sampling", "logit-bias", "custom-logit-processor", "logprobs"],
)
def test_a_batch_that_verify_does_more_for_keeps_sglang_verify(shapes, batch):
    world = make_world(shapes[RELEASE])
    step(world, 3, 10)
    step(world, 3, 11, **batch)
    assert verifies(world) == 2


@pytest.mark.parametrize("missing", ["logit_bias", "has_custom_logit_processor"])
def test_a_sampling_info_without_a_field_it_reads_keeps_sglang_verify(shapes, missing):
    """Fail closed: a field it cannot read counts as set."""
    from tests.runtime.standins import new_decode_batch

    world = make_world(shapes[RELEASE])
    step(world, 3, 10)
    new_decode_batch(world, 3, 11)
    delattr(world.batch.sampling_info, missing)
    dyn.maybe_fallback_v1(world.worker, world.batch)
    assert verifies(world) == 2


def test_a_draft_input_it_cannot_hand_on_keeps_sglang_verify(shapes):
    """Rejection sampling's draft_probs: the step runs SGLang's draft-extend, which needs
    verify()'s draft-extend input."""
    import torch

    from tests.runtime.standins import new_decode_batch

    world = make_world(shapes[RELEASE])
    step(world, 3, 10)
    new_decode_batch(world, 3, 11)
    world.batch.spec_info.draft_probs = torch.ones(3, 4)
    dyn.maybe_fallback_v1(world.worker, world.batch)
    assert verifies(world) == 2
    assert world.recorder.names().count("draft_extend") == 2


def test_penalties_keep_sglang_verify(shapes):
    world = make_world(shapes[RELEASE])
    step(world, 3, 10)
    from tests.runtime.standins import new_decode_batch

    new_decode_batch(world, 3, 11)
    world.batch.sampling_info.penalizer_orchestrator.is_required = True
    dyn.maybe_fallback_v1(world.worker, world.batch)
    assert verifies(world) == 2


@pytest.mark.parametrize(
    ("edits", "difference"),
    [
        ({"req.spec_verify_ct": "req.spec_verify_count"}, "spec_verify_count; not: spec_verify_ct"),
        (
            {"req.check_finished()": "req.check_finished() or req.alpha or req.beta"},
            "alpha, beta; not: -",
        ),
        (
            {"req.spec_verify_ct": "other.spec_verify_ct", "req.grammar": "other.grammar"},
            "-; not: grammar, spec_verify_ct",
        ),
    ],
    ids=["renamed", "two-more", "two-fewer"],
)
def test_a_release_field_it_does_not_know_keeps_sglang_verify(shapes, caplog, edits, difference):
    """A verify() whose loop touches another request attribute, or not one it repeats, is
    refused with one warning naming the difference."""
    source = shapes[RELEASE].verify_source
    for old, new in edits.items():
        assert old in source
        source = source.replace(old, new)
    world = make_world(dataclasses.replace(shapes[RELEASE], verify_source=source))
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
        step(world, 3, 11)
    assert verifies(world) == 2
    records = [r for r in caplog.records if "one-token bookkeeping" in r.getMessage()]
    why = f"verify()'s request loop is not the one it repeats (it also touches: {difference})"
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (
            logging.WARNING,
            f"[dynspec] v1 one-token bookkeeping not used: {why}; fallback steps run SGLang's "
            "verify()",
        )
    ]
    assert dyn._adapters[type(world.worker)].one_token_verify_note == f"SGLang's verify() ({why})"


def test_a_later_tp_rank_does_not_warn(shapes, caplog):
    source = shapes[RELEASE].verify_source.replace("req.spec_verify_ct", "req.spec_verify_count")
    world = make_world(dataclasses.replace(shapes[RELEASE], verify_source=source))
    world.worker.tp_rank = 1
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
        step(world, 3, 11)
    assert verifies(world) == 2
    assert not [r for r in caplog.records if "one-token bookkeeping" in r.getMessage()]


def test_a_verify_without_readable_source_keeps_sglang_verify(shapes):
    """As a release installed without its .py files: nothing to read, nothing replaced."""
    import linecache

    world = make_world(shapes[RELEASE])
    linecache.cache.pop(world.module.EagleVerifyInput.verify.__code__.co_filename)
    assert note_when_refused(world) == (
        "SGLang's verify() (cannot read verify()'s source (OSError))"
    )


def test_simulated_acceptance_keeps_sglang_verify(shapes, monkeypatch):
    world = make_world(shapes[RELEASE])
    verify_module = sys.modules[world.module.EagleVerifyInput.__module__]
    monkeypatch.setattr(verify_module, "SIMULATE_ACC_LEN", 1.0, raising=False)
    assert note_when_refused(world) == (
        "SGLang's verify() (SGLang simulates acceptance (SIMULATE_ACC_LEN))"
    )


def test_without_the_draft_kv_write_it_is_not_used(shapes, monkeypatch):
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "0")
    world = make_world(shapes[RELEASE])
    assert note_when_refused(world) == (
        "SGLang's verify() (it runs only on steps of the draft KV write, which is off)"
    )


@pytest.mark.parametrize(("release", "on"), [(RELEASE, True), ("0.5.11", False), (None, False)])
def test_on_by_default_only_on_a_release_it_ran_on(shapes, monkeypatch, release, on):
    from tests.runtime.standins import package_says_release

    monkeypatch.delenv(dyn.ONE_TOKEN_VERIFY_ENV)
    world = make_world(shapes[RELEASE])
    if release is not None:
        package_says_release(monkeypatch, world, release)
    step(world, 3, 10)
    step(world, 3, 11)
    assert verifies(world) == (1 if on else 2)
    assert dyn._adapters[type(world.worker)].one_token_verify_note == (
        "one-token bookkeeping on write-only steps of greedy batches"
        if on
        else "SGLang's verify() (DYNSPEC_V1_ONE_TOKEN_VERIFY=1 turns the one-token bookkeeping "
        "on; by default only on SGLang 0.5.12.post1, where it has run on a GPU)"
    )


def test_zero_turns_it_off_where_it_ran(shapes, monkeypatch):
    from tests.runtime.standins import package_says_release

    monkeypatch.setenv(dyn.ONE_TOKEN_VERIFY_ENV, "0")
    world = make_world(shapes[RELEASE])
    package_says_release(monkeypatch, world, RELEASE)
    step(world, 3, 10)
    step(world, 3, 11)
    assert verifies(world) == 2
