"""A prefill's draft pass as K and V only while fallback steps run (``DraftPrefillWrite``).

The stand-in worker runs a prefill the way SGLang's v2 worker does (``World._prefill_v2``):
the target's forward, then the draft model over the shifted tokens, which stores their draft
KV through its attention. With ``DYNSPEC_DRAFT_PREFILL_WRITE=1`` and fallback steps running,
the runtime re-enters that prefill with the draft model's ``forward`` replaced: the first such
prefill runs both and compares them, later ones store K and V alone and leave the draft state
stale, so the step before speculation resumes runs SGLang's draft-extend.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn

pytestmark = pytest.mark.torch

N = 4  # speculative_num_draft_tokens of the stand-in server
RELEASES = ["0.5.12.post1", "0.5.13.post1", "0.5.17", "0.5.23"]


@pytest.fixture(scope="module")
def shapes():
    from tests.runtime.standins import read_shape

    return {v: read_shape(v, "v2") for v in RELEASES}


@pytest.fixture(autouse=True)
def _levers_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "1")
    monkeypatch.setenv(dyn.DRAFT_PREFILL_WRITE_ENV, "1")


def make_world(shapes: Any, version: str = "0.5.17", **server_args: Any) -> Any:
    from tests.runtime.standins import world_with_draft_model

    return world_with_draft_model(
        shapes[version], speculative_num_steps=3, speculative_num_draft_tokens=N, **server_args
    )


def step(world: Any, bs: int, seq_len: int) -> Any:
    from tests.runtime.standins import new_decode_batch

    return dyn.maybe_fallback_v2(world.worker, new_decode_batch(world, bs, seq_len))


def prefill(world: Any, extend_lens: list[int], first_slot: int, **batch_fields: Any) -> Any:
    from tests.runtime.standins import new_prefill_batch

    batch = new_prefill_batch(extend_lens, first_slot)
    for name, value in batch_fields.items():
        setattr(batch, name, value)
    return dyn.maybe_fallback_v2(world.worker, batch)


def in_fallback_and_checked(world: Any) -> None:
    """One fallback step: the server runs fallback steps, its draft KV write checked."""
    step(world, 3, 10)
    assert adapter_of(world).draft_kv_write.checked


def adapter_of(world: Any) -> Any:
    return dyn._adapters[type(world.worker)]


def inner_model(world: Any) -> Any:
    from tests.runtime.standins import draft_runner

    return draft_runner(world).model.model


def sglang_pass_kv(shapes: Any, version: str, extend_lens: list[int], first_slot: int) -> Any:
    """(K, V) SGLang's own draft pass stores for this prefill, on a server without the lever."""
    from tests.runtime.standins import new_prefill_batch, stored_draft_kv

    reference = make_world(shapes, version)
    batch = new_prefill_batch(extend_lens, first_slot)
    reference._prefill_v2(batch)
    return stored_draft_kv(reference, batch.out_cache_loc)


def prefill_lines(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if "draft prefill write" in r.getMessage()]


@pytest.mark.parametrize("version", RELEASES)
def test_in_fallback_a_prefill_stores_the_draft_kv_alone_once_checked(shapes, version, caplog):
    import torch

    from tests.runtime.standins import new_prefill_batch, stored_draft_kv

    world = make_world(shapes, version)
    in_fallback_and_checked(world)
    model = inner_model(world)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        checking = prefill(world, [3, 5], 6000)  # both passes, compared
        assert model.passes == 1 and not adapter_of(world).draft_state_stale
        result = prefill(world, [4, 2], 7000)  # K and V alone

    assert model.passes == 1  # SGLang's pass did not run for the second prefill
    detail = (f"max |dK| 0 of {_largest(world, 6000, 8, 'k')}, "
              f"max |dV| 0 of {_largest(world, 6000, 8, 'v')}")
    assert prefill_lines(caplog) == [
        f"[dynspec] draft prefill write matches SGLang's draft pass over 8 tokens ({detail}): "
        "prefills while fallback steps run now store the draft KV only"
    ]
    assert adapter_of(world).draft_prefill_write_note == (
        f"prefills in fallback store the draft KV only (checked over 8 tokens: {detail})"
    )
    slots = new_prefill_batch([4, 2], 7000).out_cache_loc
    k, v = stored_draft_kv(world, slots)
    want_k, want_v = sglang_pass_kv(shapes, version, [4, 2], 7000)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert k.abs().sum() > 0  # written, not left at zero
    # The prefill's result is the worker's own, its draft state made from zeros: stale.
    assert checking is not None and result is not None
    assert result.next_token_ids.shape == (2,)
    assert torch.equal(result.next_draft_input.hidden_states, torch.zeros(2, 2))
    assert adapter_of(world).draft_state_stale
    assert "forward" not in vars(model) and not adapter_of(world).reentered


def _largest(world: Any, first_slot: int, tokens: int, which: str) -> str:
    """The largest magnitude of the K or V the pool holds at ``tokens`` slots from
    ``first_slot``, as the check's line writes it."""
    import torch

    from tests.runtime.standins import stored_draft_kv

    k, v = stored_draft_kv(world, torch.arange(tokens, dtype=torch.int64) + first_slot)
    return f"{float((k if which == 'k' else v).abs().max()):.3g}"


def test_under_auto_a_kv_only_prefill_in_fallback_is_timed_too(shapes):
    """``auto`` times every prefill batch (``PrefillCost``): in fallback that is the draft KV
    write's prefill, run from the hook, not SGLang's draft pass."""
    world = make_world(shapes, threshold="auto")
    controller = dyn._adapter_for(world.worker, "v2").controller
    assert isinstance(controller, dyn.AutoController)
    controller.policy.in_fallback = True  # as after a switch: the next steps run plain
    for _ in range(4):  # (the first may be an explore step: no speculative cost known yet)
        step(world, 3, 10)
    assert adapter_of(world).draft_kv_write.checked
    model = inner_model(world)
    prefill(world, [3, 5], 6000)  # both passes, compared
    result = prefill(world, [4, 2], 7000)  # K and V alone
    assert model.passes == 1 and result is not None and adapter_of(world).draft_state_stale
    timed = controller.measurements._pending_prefills
    assert [(p.requests, p.in_fallback) for p in timed] == [(2, True), (2, True)]
    assert controller.n_started == 4


@pytest.mark.parametrize("threshold", [2, "auto"])
def test_the_profile_times_the_prefills_run_from_the_hook_by_mode(
    shapes, monkeypatch, caplog, threshold
):
    """With ``DYNSPEC_PROFILE`` on, a prefill in fallback (the draft KV write's, run from the
    hook under a fixed T and ``auto`` alike) is timed and reported with the steps' lines; it
    counts in no step's period. Under ``auto`` each report adds the policy's counters."""
    monkeypatch.setenv(dyn.PROFILE_ENV, "2")
    world = make_world(shapes, threshold=threshold)
    controller = dyn._adapter_for(world.worker, "v2").controller
    if threshold == "auto":
        controller.policy.in_fallback = True  # as after a switch: the next steps run plain
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        for _ in range(4):  # (under auto the first may be an explore step)
            step(world, 3, 10)
        assert adapter_of(world).draft_kv_write.checked
        caplog.clear()
        prefill(world, [3, 5], 6000)
        prefill(world, [4, 2, 1], 7000)
        prefill(world, [2], 8000)
        assert not [r for r in caplog.records if "profile" in r.getMessage()]  # no period yet
        step(world, 3, 11)
        step(world, 3, 12)
    lines = [r.getMessage() for r in caplog.records if "[dynspec] profile" in r.getMessage()]
    (prefills,) = [line for line in lines if "profile prefill" in line]
    assert prefills.startswith(
        "[dynspec] profile prefill in fallback batches=3 requests/batch=2.0 gpu/host ms: prefill="
    )
    assert [line for line in lines if "profile bs=3 " in line]
    described = [line for line in lines if line.startswith("[dynspec] profile auto: ")]
    if threshold == "auto":  # reported at the 4th profiled (fallback) step, the 5th decided
        assert described == [
            "[dynspec] profile auto: fallback, steps=5, switches=0, fallback_steps=4, "
            "spec_steps=1, probes=0, explores=1"
        ]
    else:
        assert described == []


@pytest.mark.usefixtures("resume_after_one_small_step")
def test_speculation_after_a_kv_only_prefill_waits_for_one_step_with_the_draft_extend(shapes):
    world = make_world(shapes)
    in_fallback_and_checked(world)
    prefill(world, [3], 6000)
    prefill(world, [3], 7000)
    assert adapter_of(world).draft_state_stale
    extends = len([n for n, _ in world.recorder.events if n == "draft_extend_v2"])
    result = step(world, 1, 12)  # the batch dropped: speculation would resume
    assert result is not None  # a fallback step ran first, with SGLang's draft-extend
    assert len([n for n, _ in world.recorder.events if n == "draft_extend_v2"]) == extends + 1
    assert not adapter_of(world).draft_state_stale


@pytest.mark.usefixtures("resume_after_one_small_step")
def test_while_speculating_a_prefill_keeps_sglangs_draft_pass(shapes):
    world = make_world(shapes)
    in_fallback_and_checked(world)
    step(world, 1, 11)  # one fallback step with the draft-extend, then speculation resumes
    step(world, 1, 12)
    assert not adapter_of(world).controller.in_fallback
    assert prefill(world, [3], 6000) is None  # SGLang's own prefill, the hook not involved
    assert not adapter_of(world).draft_state_stale


def test_before_the_draft_kv_write_is_checked_a_prefill_keeps_sglangs_pass(shapes):
    """In fallback, but the draft KV write not yet checked (the fallback steps so far came
    with a draft input it cannot hand on, so they ran SGLang's draft-extend alone)."""
    from tests.runtime.standins import new_decode_batch

    world = make_world(shapes)
    batch = new_decode_batch(world, 3, 10)
    batch.spec_info.topk_p = None
    assert dyn.maybe_fallback_v2(world.worker, batch) is not None  # a fallback step
    adapter = adapter_of(world)
    assert adapter.controller.in_fallback and not adapter.draft_kv_write.checked
    assert prefill(world, [3], 6000) is None
    assert inner_model(world).passes == 0  # the hook did not run the prefill
    assert not adapter.draft_prefill_write.checked
    assert adapter.draft_prefill_write_note == (
        "prefills in fallback store the draft KV only (checked at the first one)"
    )


@pytest.mark.parametrize("value", [None, "0", "yes"])
def test_off_unless_turned_on(shapes, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(dyn.DRAFT_PREFILL_WRITE_ENV)
    else:
        monkeypatch.setenv(dyn.DRAFT_PREFILL_WRITE_ENV, value)
    world = make_world(shapes)
    in_fallback_and_checked(world)
    assert prefill(world, [3], 6000) is None
    assert adapter_of(world).draft_prefill_write is None
    assert adapter_of(world).draft_prefill_write_note == (
        "off (DYNSPEC_DRAFT_PREFILL_WRITE=1 turns it on; on a GPU it has run with SGLang "
        "0.5.12.post1, 0.5.17 only)"
    )


@pytest.mark.parametrize(
    ("release", "value", "taken"),
    [("0.5.17", None, True), ("0.5.17", "0", False), ("0.5.23", None, False),
     ("0.5.23", "1", True), ("0.5.12.post1", None, True), ("0.5.12.post1", "0", False),
     ("0.5.13.post1", None, False)],
)
def test_on_by_default_where_it_ran_on_a_gpu(shapes, monkeypatch, release, value, taken):
    """Unset, the prefill write runs on the releases where it ran on a GPU
    (``DRAFT_PREFILL_WRITE_RELEASES``) and nowhere else; a value set wins everywhere."""
    from tests.runtime.standins import package_says_release

    if value is None:
        monkeypatch.delenv(dyn.DRAFT_PREFILL_WRITE_ENV)
    else:
        monkeypatch.setenv(dyn.DRAFT_PREFILL_WRITE_ENV, value)
    world = make_world(shapes, release)
    package_says_release(monkeypatch, world, release)
    in_fallback_and_checked(world)
    prefill(world, [3], 6000)
    assert (adapter_of(world).draft_prefill_write is not None) == taken


def test_on_by_default_without_the_draft_kv_write_says_nothing(shapes, monkeypatch, caplog):
    """Where the write is on by default and the draft KV write is off, prefills keep SGLang's
    draft pass quietly: the warning is for a user who asked for the prefill write."""
    from tests.runtime.standins import package_says_release

    monkeypatch.delenv(dyn.DRAFT_PREFILL_WRITE_ENV)
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "0")
    world = make_world(shapes, "0.5.17")
    package_says_release(monkeypatch, world, "0.5.17")
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
    assert adapter_of(world).draft_prefill_write_note == "SGLang's draft pass (no draft KV write)"
    assert not [r for r in caplog.records if "DRAFT_PREFILL_WRITE" in r.getMessage()]


def test_without_the_draft_kv_write_it_is_not_taken_and_says_so(shapes, monkeypatch, caplog):
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "0")
    world = make_world(shapes)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
    assert prefill(world, [3], 6000) is None
    assert adapter_of(world).draft_prefill_write is None
    assert adapter_of(world).draft_prefill_write_note == "SGLang's draft pass (no draft KV write)"
    (record,) = [r for r in caplog.records if "DRAFT_PREFILL_WRITE" in r.getMessage()]
    line = record.getMessage()
    assert line.startswith("[dynspec] DYNSPEC_DRAFT_PREFILL_WRITE=1 not used: it needs the draft")
    assert line.endswith("; prefills keep SGLang's draft pass")
    assert record.levelno == logging.WARNING
    other_rank = make_world(shapes)
    other_rank.worker.tp_rank = 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(other_rank, 3, 10)
    assert not [r for r in caplog.records if "DRAFT_PREFILL_WRITE" in r.getMessage()]


def test_a_draft_pass_the_write_does_not_reproduce_is_refused_for_good(shapes, caplog):
    """SGLang's prefill pass here stores K and V of shifted embeddings (the decode steps'
    draft-extend does not): the check fails, and every later prefill runs SGLang's pass."""
    world = make_world(shapes)
    in_fallback_and_checked(world)
    model = inner_model(world)
    real = model.forward_draft_extend

    def shifted(input_ids, positions, hidden_states, pool, out_cache_loc, embeds=None):
        embeds = model.embed_tokens(input_ids.long()) + 0.3
        return real(input_ids, positions, hidden_states, pool, out_cache_loc, embeds=embeds)

    model.forward_draft_extend = shifted  # (the model's forward calls it)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert prefill(world, [3, 5], 6000) is not None  # both passes, compared
        assert prefill(world, [2], 7000) is None  # SGLang's own prefill
    assert model.passes == 1
    prefill_write = adapter_of(world).draft_prefill_write
    assert prefill_write.broken.startswith("max |dK| ")
    (line,) = prefill_lines(caplog)
    assert line.startswith("[dynspec] draft prefill write differs from SGLang's draft pass over 8")
    assert line.endswith("; prefills keep SGLang's draft pass")
    assert not adapter_of(world).draft_state_stale
    assert adapter_of(world).draft_prefill_write_note == (
        f"SGLang's draft pass (the prefill write differed: {prefill_write.broken})"
    )


def test_a_check_that_cannot_read_the_pool_back_keeps_sglangs_pass_for_good(shapes, caplog):
    world = make_world(shapes)
    in_fallback_and_checked(world)
    prefill_write = adapter_of(world).draft_prefill_write

    def unreadable(*args: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access")

    prefill_write.kv_write.matches = unreadable
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert prefill(world, [3, 5], 6000) is not None  # both passes; no comparison
        assert prefill(world, [2], 7000) is None  # SGLang's own prefill from then on
    assert not prefill_write.checked
    assert prefill_write.broken == (
        "reading the KV pool back raised RuntimeError: CUDA error: an illegal memory access"
    )
    (line,) = prefill_lines(caplog)
    assert line.startswith("[dynspec] draft prefill write differs from SGLang's draft pass over 8")
    assert not adapter_of(world).draft_state_stale


@pytest.mark.parametrize("by", ["position", "keyword"])
def test_a_draft_pass_given_embeddings_runs_sglangs_pass_with_them(shapes, by):
    """Embeddings handed to the draft model in place of its tokens' (``input_embeds``, as
    SGLang passes them positionally or by name) are not what the write computes from: that
    pass is SGLang's, with those embeddings."""
    import torch

    from tests.runtime.standins import draft_runner, new_prefill_batch, stored_draft_kv

    world = make_world(shapes)
    in_fallback_and_checked(world)
    prefill(world, [3], 6000)  # the check
    lm, model = draft_runner(world).model, inner_model(world)

    def forward_with_embeds(input_ids: Any, positions: Any, forward_batch: Any) -> Any:
        embeds = model.embed_tokens(input_ids.long()) + 0.5
        args, kw = ((embeds,), {}) if by == "position" else ((), {"input_embeds": embeds})
        return lm.head(model(input_ids, positions, forward_batch, *args, **kw), forward_batch)

    lm.forward = forward_with_embeds
    passes = model.passes
    assert prefill(world, [2], 7000) is not None
    assert model.passes == passes + 1  # SGLang's pass ran
    k, _ = stored_draft_kv(world, new_prefill_batch([2], 7000).out_cache_loc)
    plain_k, _ = sglang_pass_kv(shapes, "0.5.17", [2], 7000)
    assert not torch.equal(k, plain_k)  # from the embeddings given, not the tokens'


@pytest.mark.parametrize("matches", [True, False], ids=["matches", "differs"])
def test_the_check_logs_once_on_tp_rank_0_a_difference_as_a_warning(shapes, caplog, matches):
    def check_logs(rank: int) -> list[logging.LogRecord]:
        world = make_world(shapes)
        in_fallback_and_checked(world)
        world.worker.tp_rank = rank
        if not matches:
            adapter_of(world).draft_prefill_write.kv_write.matches = lambda *args: (False, "d")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=dyn.__name__):
            prefill(world, [3, 5], 6000)
        assert adapter_of(world).draft_prefill_write.checked == matches
        return [r for r in caplog.records if "draft prefill write" in r.getMessage()]

    assert check_logs(1) == []
    (record,) = check_logs(0)
    assert record.levelno == (logging.INFO if matches else logging.WARNING)


@pytest.mark.parametrize(
    "fields",
    [{"mm_input_embeds": True}, {"contains_mm_inputs": lambda: True}],
    ids=["mm-embeds", "mm-inputs"],
)
def test_a_multimodal_prefill_runs_sglangs_pass(shapes, monkeypatch, fields):
    import torch

    world = make_world(shapes)
    in_fallback_and_checked(world)
    prefill(world, [3], 6000)  # checked
    model = inner_model(world)
    original = world._prefill_v2

    def with_fields(batch):  # SGLang copies these onto the draft's forward batch
        real_forward = world.worker.draft_worker.draft_runner.model.forward

        def forward(input_ids, positions, forward_batch):
            if "mm_input_embeds" in fields:
                forward_batch.mm_input_embeds = torch.zeros(len(input_ids), 2)
            else:
                forward_batch.contains_mm_inputs = fields["contains_mm_inputs"]
            return real_forward(input_ids, positions, forward_batch)

        world.worker.draft_worker.draft_runner.model.forward = forward
        try:
            return original(batch)
        finally:
            world.worker.draft_worker.draft_runner.model.forward = real_forward

    monkeypatch.setattr(world, "_prefill_v2", with_fields)
    assert prefill(world, [2], 7000) is not None  # re-entered, but SGLang's pass ran
    assert model.passes == 2
    assert not adapter_of(world).draft_state_stale


def test_the_model_gets_its_forward_back_when_the_prefill_raises(shapes, monkeypatch):
    world = make_world(shapes)
    in_fallback_and_checked(world)
    prefill(world, [3], 6000)

    def fails(batch):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(world, "_prefill_v2", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        prefill(world, [2], 7000)
    assert "forward" not in vars(inner_model(world))
    assert not adapter_of(world).reentered


def test_kept_fallback_writes_are_stored_before_a_kv_only_prefill(shapes, monkeypatch):
    """With batched writes, the kept rows go to the pool before the prefill's own."""
    from tests.runtime.standins import draft_runner

    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_STEPS_ENV, "8")
    world = make_world(shapes)
    in_fallback_and_checked(world)
    prefill(world, [3], 6000)  # checked
    step(world, 3, 11)  # kept
    pool = draft_runner(world).token_to_kv_pool
    stores = len(pool.writes)
    prefill(world, [2], 7000)
    assert [loc.shape[0] for loc in pool.writes[stores:]] == [3, 2]
    assert not adapter_of(world).draft_kv_write.kept


def test_with_tp_the_check_must_pass_on_every_rank(shapes, caplog):
    import types

    world = make_world(shapes)
    in_fallback_and_checked(world)
    world.worker.target_worker.model_runner.tp_group = types.SimpleNamespace(world_size=2)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        prefill(world, [3], 6000)
    assert adapter_of(world).draft_prefill_write.broken.endswith("; another TP rank's differed")
    assert prefill(world, [2], 7000) is None


def test_the_prefill_it_runs_passes_through_the_patched_entrys_hook(shapes, monkeypatch):
    """The patched worker's entry calls the hook first: re-entered from ``_v2_prefill``, the
    hook answers None and the worker's own prefill runs (once), with the arguments the
    scheduler gave (0.5.14+: ``on_publish``)."""
    world = make_world(shapes)
    worker_cls = type(world.worker)
    own_entry = worker_cls.forward_batch_generation
    hook_answers: list[Any] = []
    entry_kwargs: list[dict[str, Any]] = []

    def patched_entry(self, batch, *args, **kwargs):
        entry_kwargs.append(kwargs)
        answer = dyn.maybe_fallback_v2(self, batch, **kwargs)
        hook_answers.append(answer)
        if answer is not None:
            return answer
        return own_entry(self, batch, *args, **kwargs)

    monkeypatch.setattr(worker_cls, "forward_batch_generation", patched_entry)
    in_fallback_and_checked(world)
    hook_answers.clear()
    entry_kwargs.clear()
    from tests.runtime.standins import new_prefill_batch

    def on_publish(new_seq_lens: Any) -> None:
        pass

    for first_slot in (6000, 7000):  # the checking prefill, then one with K and V alone
        batch = new_prefill_batch([3], first_slot)
        assert world.worker.forward_batch_generation(batch, on_publish=on_publish) is not None
    assert [a is None for a in hook_answers] == [True, False, True, False]
    assert entry_kwargs == [{"on_publish": on_publish}] * 4
    assert len([n for n, _ in world.recorder.events if n == "prefill"]) == 2


def test_v1_in_fallback_a_prefill_stores_the_draft_kv_alone_once_checked(caplog):
    """v1 (0.5.12.post1, where its draft KV write runs): the worker's prefill
    (``forward_target_extend`` then ``forward_draft_extend``) re-entered the same way."""
    import torch

    from tests.runtime.standins import (
        World,
        give_draft_model,
        new_prefill_batch,
        read_shape,
        stored_draft_kv,
    )
    from tests.runtime.test_draft_kv_write_v1 import draft_state

    def v1_world() -> Any:
        world = World(read_shape("0.5.12.post1", "v1"), threshold=2,
                      speculative_disable_min_dwell_steps=1)
        give_draft_model(world)
        return world

    world = v1_world()
    world.batch = world._make_batch(3, 10, 100)
    draft_state(world.batch)
    dyn.maybe_fallback_v1(world.worker, world.batch)  # a fallback step: the write checked
    adapter = adapter_of(world)
    assert adapter.controller.in_fallback and adapter.draft_kv_write.checked
    model = inner_model(world)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert dyn.maybe_fallback_v1(world.worker, new_prefill_batch([3, 5], 6000))
        result = dyn.maybe_fallback_v1(world.worker, new_prefill_batch([4, 2], 7000))
    assert model.passes == 1
    assert len(prefill_lines(caplog)) == 1
    assert result.next_token_ids.shape == (2,)
    assert adapter.draft_state_stale

    reference = v1_world()
    batch = new_prefill_batch([4, 2], 7000)
    reference._prefill_v1(batch)
    want_k, want_v = stored_draft_kv(reference, batch.out_cache_loc)
    k, v = stored_draft_kv(world, batch.out_cache_loc)
    assert torch.equal(k, want_k) and torch.equal(v, want_v) and k.abs().sum() > 0


def test_a_forward_set_on_the_model_instance_is_put_back(shapes):
    """Where something set the draft model's ``forward`` on the instance (a compiled one),
    that one is back after the prefill, and was the one SGLang's pass ran."""
    world = make_world(shapes)
    in_fallback_and_checked(world)
    model = inner_model(world)
    calls = []
    class_forward = type(model).forward

    def instance_forward(*args, **kwargs):
        calls.append(len(args))
        return class_forward(model, *args, **kwargs)

    model.forward = instance_forward
    prefill(world, [3], 6000)  # the checking prefill runs SGLang's pass: the instance's
    prefill(world, [2], 7000)  # K and V alone
    assert calls == [4] and model.passes == 1  # (input_ids, positions, batch, embeds)
    assert vars(model)["forward"] is instance_forward


def test_only_a_pass_with_a_hidden_state_and_a_slot_per_token_is_taken():
    import types

    import torch

    from tests.runtime.standins import ForwardMode

    def forward_batch(hidden_rows: int, slots: int, mode: Any = ForwardMode.EXTEND) -> Any:
        return types.SimpleNamespace(
            forward_mode=mode,
            spec_info=types.SimpleNamespace(hidden_states=torch.zeros(hidden_rows, 4)),
            out_cache_loc=torch.arange(slots),
        )

    takes = dyn.DraftPrefillWrite(kv_write=None).takes  # type: ignore[arg-type]
    tokens = torch.arange(3)
    assert takes(tokens, forward_batch(3, 3), None)
    assert not takes(tokens, forward_batch(2, 3), None)  # a hidden state missing
    assert not takes(tokens, forward_batch(3, 4), None)  # slots of other tokens
    assert not takes(tokens[:0], forward_batch(0, 0), None)  # nothing to store
    assert not takes(tokens, forward_batch(3, 3, ForwardMode.IDLE), None)
    assert not takes(tokens, forward_batch(3, 3), torch.zeros(3, 2))  # embeddings given
    assert not takes(tokens, forward_batch(3, 3, None), None)  # no mode: not ours to judge
    no_mode = forward_batch(3, 3)
    del no_mode.forward_mode
    assert not takes(tokens, no_mode, None)
    no_hidden = forward_batch(3, 3)
    del no_hidden.spec_info.hidden_states
    assert not takes(tokens, no_hidden, None)
    del no_hidden.spec_info
    assert not takes(tokens, no_hidden, None)
    no_slots = forward_batch(3, 3)
    del no_slots.out_cache_loc
    assert not takes(tokens, no_slots, None)


@pytest.mark.parametrize("checked", [False, True], ids=["checking", "checked"])
def test_a_write_that_raises_keeps_sglangs_pass_for_good(shapes, caplog, checked):
    """The prefill still runs (SGLang's pass stores the draft KV), with one warning, and no
    later prefill tries the write again."""
    world = make_world(shapes)
    in_fallback_and_checked(world)
    if checked:
        prefill(world, [3], 6000)
    write = adapter_of(world).draft_kv_write.write
    calls = []

    def raising(*args: Any) -> Any:
        calls.append(1)
        raise RuntimeError("shape [5, 4] is invalid")

    adapter_of(world).draft_kv_write.write = raising
    model = inner_model(world)
    passes = model.passes
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert prefill(world, [2], 7000) is not None
        assert prefill(world, [2], 8000) is None  # SGLang's own, outside the hook
    assert model.passes == passes + 1 and calls == [1]
    assert adapter_of(world).draft_prefill_write.broken == (
        "the write raised RuntimeError: shape [5, 4] is invalid"
    )
    (record,) = [r for r in caplog.records if "draft prefill write" in r.getMessage()]
    assert record.getMessage() == (
        "[dynspec] draft prefill write raised RuntimeError: shape [5, 4] is invalid; prefills "
        "keep SGLang's draft pass"
    )
    assert record.levelno == logging.WARNING
    assert not adapter_of(world).draft_state_stale
    adapter_of(world).draft_kv_write.write = write


def test_a_write_that_raises_is_logged_on_tp_rank_0_only(shapes, caplog):
    world = make_world(shapes)
    in_fallback_and_checked(world)
    world.worker.tp_rank = 1

    def raising(*args: Any) -> Any:
        raise RuntimeError("out of memory")

    adapter_of(world).draft_kv_write.write = raising
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        prefill(world, [2], 7000)
    assert adapter_of(world).draft_prefill_write.broken
    assert prefill_lines(caplog) == []


def with_prefill_graph(world: Any) -> Any:
    """SGLang 0.5.17+'s draft prefill CUDA graph on ``world``'s draft runner."""
    from tests.runtime.standins import PrefillCudaGraph, draft_runner

    runner = draft_runner(world)
    runner.prefill_cuda_graph_runner = PrefillCudaGraph(runner.model)
    return runner.prefill_cuda_graph_runner


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_with_sglangs_draft_prefill_graph_the_lever_runs_that_pass_eagerly(
    shapes, version, caplog
):
    """0.5.17 captures the draft's prefill as a CUDA graph, whose replay never calls a
    forward set on the model (on the H200 the lever was on and never ran): the runner goes
    without its graph for the lever's prefill, and gets it back."""
    import torch

    from tests.runtime.standins import draft_runner, new_prefill_batch, stored_draft_kv

    world = make_world(shapes, version)
    graph = with_prefill_graph(world)
    in_fallback_and_checked(world)
    model = inner_model(world)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        prefill(world, [3, 5], 6000)  # both passes (SGLang's eagerly), compared
        prefill(world, [4, 2], 7000)  # K and V alone

    assert graph.replays == 0 and model.passes == 1
    assert len(prefill_lines(caplog)) == 1 and "matches" in prefill_lines(caplog)[0]
    assert draft_runner(world).prefill_cuda_graph_runner is graph
    k, v = stored_draft_kv(world, new_prefill_batch([4, 2], 7000).out_cache_loc)
    want_k, want_v = sglang_pass_kv(shapes, version, [4, 2], 7000)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_the_draft_runner_gets_its_prefill_graph_back_when_the_prefill_raises(
    shapes, monkeypatch
):
    from tests.runtime.standins import draft_runner

    world = make_world(shapes)
    graph = with_prefill_graph(world)
    in_fallback_and_checked(world)

    def fails(batch):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(world, "_prefill_v2", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        prefill(world, [2], 7000)
    assert draft_runner(world).prefill_cuda_graph_runner is graph


def test_the_stand_ins_prefill_graph_never_calls_a_forward_set_on_the_model(shapes):
    """The tests above mean something only if the stand-in's prefill graph behaves as SGLang's:
    a replay of the forward captured at start-up, never one set on the instance later (so a
    lever that only replaces ``forward`` never runs, as on the H200)."""
    import torch

    from tests.runtime.standins import new_prefill_batch, stored_draft_kv

    world = make_world(shapes)
    graph = with_prefill_graph(world)
    model = inner_model(world)
    model.forward = lambda *args, **kwargs: pytest.fail("the instance forward was called")
    world._prefill_v2(new_prefill_batch([3], 6000))
    assert graph.replays == 1
    k, v = stored_draft_kv(world, new_prefill_batch([3], 6000).out_cache_loc)
    want_k, want_v = sglang_pass_kv(shapes, "0.5.17", [3], 6000)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)  # the captured forward stored them
