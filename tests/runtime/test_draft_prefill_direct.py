"""A v2 prefill in fallback without SGLang's draft pass (``DraftPrefillDirect``).

With ``DYNSPEC_DRAFT_PREFILL_DIRECT=1`` (and the prefill write on) the runtime re-enters the
worker's prefill with its draft worker's ``_draft_extend_for_prefill`` replaced: the first
prefill in fallback runs both that pass and the write of the tokens and positions built here,
and compares them (K and V, the tokens, the draft state's make); later ones store K and V
alone and hand on zeros shaped like SGLang's draft state, its root the target's next tokens.
The stand-in draft worker's pass (``World._draft_pass_for_prefill``) records a "prefill" event
each time it runs; the direct prefill never calls it.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn

pytestmark = pytest.mark.torch

N = 4  # speculative_num_draft_tokens of the stand-in server
WITH_HELPER = ["0.5.13.post1", "0.5.17", "0.5.23"]  # their pass takes _eagle_prefill_tail_tokens


@pytest.fixture(scope="module")
def shapes():
    from tests.runtime.standins import read_shape

    return {v: read_shape(v, "v2") for v in [*WITH_HELPER, "0.5.12.post1"]}


@pytest.fixture(autouse=True)
def _levers_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "1")
    monkeypatch.setenv(dyn.DRAFT_PREFILL_WRITE_ENV, "1")
    monkeypatch.setenv(dyn.DRAFT_PREFILL_DIRECT_ENV, "1")


def make_world(shapes: Any, version: str = "0.5.17") -> Any:
    from tests.runtime.standins import new_decode_batch, world_with_draft_model

    world = world_with_draft_model(
        shapes[version], speculative_num_steps=3, speculative_num_draft_tokens=N
    )
    dyn.maybe_fallback_v2(world.worker, new_decode_batch(world, 3, 10))  # a fallback step
    assert adapter_of(world).draft_kv_write.checked
    return world


def adapter_of(world: Any) -> Any:
    return dyn._adapters[type(world.worker)]


def prefill_batch(extend_lens: list[int], first_slot: int, **fields: Any) -> Any:
    from tests.runtime.standins import new_prefill_batch

    batch = new_prefill_batch(extend_lens, first_slot, fields.pop("prefix_lens", None))
    for name, value in fields.items():
        setattr(batch, name, value)
    return batch


def sglang_passes(world: Any) -> int:
    """How many times the draft worker's own pass ran."""
    return len([n for n, _ in world.recorder.events if n == "prefill"])


def sglang_pass(shapes: Any, version: str, batch: Any) -> tuple[Any, Any, Any]:
    """(K, V, the tokens of the draft's pass) SGLang's pass leaves for ``batch`` on a server
    without the levers."""
    from tests.runtime.standins import stored_draft_kv

    reference = make_world(shapes, version)
    reference._prefill_v2(batch)
    return (*stored_draft_kv(reference, batch.out_cache_loc), batch.input_ids)


def lines(caplog: Any, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


@pytest.mark.parametrize("version", WITH_HELPER)
def test_once_checked_a_prefill_in_fallback_skips_sglangs_draft_pass(shapes, version, caplog):
    import torch

    from tests.runtime.standins import stored_draft_kv

    world = make_world(shapes, version)
    adapter = adapter_of(world)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        checking = dyn.maybe_fallback_v2(world.worker, prefill_batch([3, 5], 6000))
    assert sglang_passes(world) == 1  # the check: SGLang's pass ran too, and gave the state
    assert not adapter.draft_state_stale and checking.next_draft_input.topk_p.abs().sum() > 0
    (line,) = lines(caplog, "draft prefill write")
    assert line.startswith("[dynspec] draft prefill write matches SGLang's draft pass over 8 ")
    assert line.endswith(
        "prefills while fallback steps run now store the draft KV only, without SGLang's "
        "draft pass"
    )
    assert adapter.draft_prefill_direct_note == (
        "prefills in fallback skip SGLang's draft pass (checked over 8 tokens)"
    )

    batch = prefill_batch([4, 2], 7000, prefix_lens=[5, 0])  # one request has a cached prefix
    result = dyn.maybe_fallback_v2(world.worker, batch)
    assert sglang_passes(world) == 1  # not again
    want_k, want_v, want_tokens = sglang_pass(shapes, version, prefill_batch(
        [4, 2], 7000, prefix_lens=[5, 0]))
    k, v = stored_draft_kv(world, batch.out_cache_loc)
    assert torch.equal(k, want_k) and torch.equal(v, want_v) and k.abs().sum() > 0
    assert torch.equal(batch.input_ids, want_tokens)  # the pass's tokens, as SGLang leaves them
    state = result.next_draft_input
    assert type(state) is type(checking.next_draft_input)
    root = adapter.names["root_field"]
    assert torch.equal(getattr(state, root), result.next_token_ids)
    assert getattr(state, root) is result.next_token_ids
    for name in ("topk_p", "topk_index", "hidden_states"):
        made, checked = getattr(state, name), getattr(checking.next_draft_input, name)
        assert made.shape == (2, *checked.shape[1:]) and made.dtype == checked.dtype
        assert not made.any()
    assert adapter.draft_state_stale  # zeros: the step before speculation resumes redrafts
    assert "_draft_extend_for_prefill" not in vars(world.worker.draft_worker)
    assert not adapter.reentered


def test_a_chunked_requests_last_token_is_its_next_prompt_token(shapes):
    """SGLang's helper gives the request still being chunked its next prompt token as the
    last token of the draft's pass, not the target's sample: the direct prefill uses it."""
    import torch

    from tests.runtime.standins import VOCAB, Req, stored_draft_kv

    next_prompt_token = VOCAB - 2
    world = make_world(shapes)
    dyn.maybe_fallback_v2(world.worker, prefill_batch([3], 6000))  # the check

    def chunked() -> Any:
        reqs = [Req(max_new_tokens=8), Req(max_new_tokens=8)]
        return prefill_batch(
            [4, 3], 7000, reqs=reqs, chunked_req=reqs[1],
            chunked_req_next_prompt_token=next_prompt_token,
        )

    batch = chunked()
    dyn.maybe_fallback_v2(world.worker, batch)
    assert sglang_passes(world) == 1
    assert int(batch.input_ids[-1]) == next_prompt_token
    assert int(batch.input_ids[3]) != next_prompt_token
    want_k, want_v, want_tokens = sglang_pass(shapes, "0.5.17", chunked())
    k, v = stored_draft_kv(world, batch.out_cache_loc)
    assert torch.equal(batch.input_ids, want_tokens)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_a_release_whose_pass_takes_no_tail_helper_keeps_the_write_inside_it(shapes, caplog):
    """0.5.12.post1's pass ends each request with the target's next token by its own loop
    (no ``_eagle_prefill_tail_tokens``): not reproduced here, the prefill write inside it
    runs as before, with one warning where the direct prefill was asked for."""
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        world = make_world(shapes, "0.5.12.post1")
    adapter = adapter_of(world)
    why = "_draft_extend_for_prefill takes no last tokens from _eagle_prefill_tail_tokens"
    assert adapter.draft_prefill_direct is None
    assert adapter.draft_prefill_direct_note == f"SGLang's draft pass ({why})"
    (line,) = lines(caplog, "DRAFT_PREFILL_DIRECT")
    assert line == f"[dynspec] DYNSPEC_DRAFT_PREFILL_DIRECT=1 not used: {why}"
    dyn.maybe_fallback_v2(world.worker, prefill_batch([3], 6000))
    dyn.maybe_fallback_v2(world.worker, prefill_batch([2], 7000))
    assert sglang_passes(world) == 2  # the write inside SGLang's pass, both times
    assert adapter.draft_prefill_write.checked


@pytest.mark.parametrize("value", [None, "0"])
def test_off_unless_turned_on(shapes, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(dyn.DRAFT_PREFILL_DIRECT_ENV)
    else:
        monkeypatch.setenv(dyn.DRAFT_PREFILL_DIRECT_ENV, value)
    world = make_world(shapes)
    dyn.maybe_fallback_v2(world.worker, prefill_batch([3], 6000))
    dyn.maybe_fallback_v2(world.worker, prefill_batch([2], 7000))
    assert sglang_passes(world) == 2
    assert adapter_of(world).draft_prefill_direct is None
    assert adapter_of(world).draft_prefill_direct_note == (
        "off (DYNSPEC_DRAFT_PREFILL_DIRECT=1 turns it on; on a GPU it has run with SGLang "
        "0.5.17 only)"
    )


@pytest.mark.parametrize(
    ("release", "value", "taken"),
    [("0.5.17", None, True), ("0.5.17", "0", False), ("0.5.23", None, False),
     ("0.5.23", "1", True), ("0.5.13.post1", None, False)],
)
def test_on_by_default_where_it_ran_on_a_gpu(shapes, monkeypatch, release, value, taken):
    """Unset, the direct prefill runs on the releases where it ran on a GPU
    (``DRAFT_PREFILL_DIRECT_RELEASES``) and nowhere else; a value set wins everywhere."""
    from tests.runtime.standins import (
        new_decode_batch,
        package_says_release,
        world_with_draft_model,
    )

    if value is None:
        monkeypatch.delenv(dyn.DRAFT_PREFILL_DIRECT_ENV)
    else:
        monkeypatch.setenv(dyn.DRAFT_PREFILL_DIRECT_ENV, value)
    world = world_with_draft_model(
        shapes[release], speculative_num_steps=3, speculative_num_draft_tokens=N
    )
    package_says_release(monkeypatch, world, release)
    dyn.maybe_fallback_v2(world.worker, new_decode_batch(world, 3, 10))
    dyn.maybe_fallback_v2(world.worker, prefill_batch([3], 6000))
    dyn.maybe_fallback_v2(world.worker, prefill_batch([2], 7000))
    assert (adapter_of(world).draft_prefill_direct is not None) == taken
    assert sglang_passes(world) == (1 if taken else 2)


def test_it_needs_the_prefill_write(shapes, monkeypatch):
    monkeypatch.setenv(dyn.DRAFT_PREFILL_WRITE_ENV, "0")
    world = make_world(shapes)
    assert adapter_of(world).draft_prefill_direct is None
    assert adapter_of(world).draft_prefill_direct_note.startswith(
        "SGLang's draft pass (it needs the prefill write (off (DYNSPEC_DRAFT_PREFILL_WRITE=1"
    )


def test_tokens_built_unlike_sglangs_drop_both_levers_for_good(shapes, monkeypatch, caplog):
    """Tokens shifted wrongly give K and V unlike SGLang's: the check fails, and every later
    prefill runs SGLang's own pass."""
    real = dyn.DraftPrefillDirect.inputs

    def off_by_one(self: Any, batch: Any, next_token_ids: Any) -> tuple[Any, Any]:
        tokens, positions = real(self, batch, next_token_ids)
        return tokens.roll(1), positions

    monkeypatch.setattr(dyn.DraftPrefillDirect, "inputs", off_by_one)
    world = make_world(shapes)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        dyn.maybe_fallback_v2(world.worker, prefill_batch([3, 5], 6000))
        assert dyn.maybe_fallback_v2(world.worker, prefill_batch([2], 7000)) is None
    adapter = adapter_of(world)
    assert adapter.draft_prefill_direct.broken == (
        "the tokens built for the draft differ from SGLang's"
    )
    assert adapter.draft_prefill_write.broken.startswith("max |dK| ")
    assert adapter.draft_prefill_direct_note == (
        "SGLang's draft pass (the tokens built for the draft differ from SGLang's)"
    )
    (line,) = lines(caplog, "draft prefill write")
    assert line.startswith("[dynspec] draft prefill write differs from SGLang's draft pass")
    assert not adapter.draft_state_stale


def test_a_draft_state_it_cannot_make_keeps_the_write_inside_sglangs_pass(shapes, monkeypatch):
    """K and V match but the draft state is not one it can make (here: a field of another
    length than the requests): the write stays, inside SGLang's pass."""
    import torch

    world = make_world(shapes)
    draft = world.worker.draft_worker
    real = draft._draft_extend_for_prefill

    def odd_state(*args: Any) -> Any:
        state = real(*args)
        state.hidden_states = torch.zeros(7, 2)
        return state

    monkeypatch.setattr(draft, "_draft_extend_for_prefill", odd_state)
    dyn.maybe_fallback_v2(world.worker, prefill_batch([3, 5], 6000))
    adapter = adapter_of(world)
    assert adapter.draft_prefill_direct.broken == "its hidden_states is not one row per request"
    assert adapter.draft_prefill_write.checked
    dyn.maybe_fallback_v2(world.worker, prefill_batch([2], 7000))
    assert sglang_passes(world) == 2  # the write inside SGLang's pass
    assert adapter.draft_state_stale


def test_a_multimodal_prefill_runs_sglangs_pass(shapes):
    import torch

    world = make_world(shapes)
    dyn.maybe_fallback_v2(world.worker, prefill_batch([3], 6000))  # the check
    batch = prefill_batch([2], 7000, mm_input_embeds=torch.ones(2, 2))
    dyn.maybe_fallback_v2(world.worker, batch)
    assert sglang_passes(world) == 2


def test_a_write_that_raises_runs_sglangs_pass_and_gives_the_method_back(shapes, caplog):
    world = make_world(shapes)
    dyn.maybe_fallback_v2(world.worker, prefill_batch([3], 6000))  # the check
    adapter = adapter_of(world)

    def raises(*args: Any) -> Any:
        raise RuntimeError("out of memory")

    adapter.draft_prefill_write.kv_write.write = raises
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert dyn.maybe_fallback_v2(world.worker, prefill_batch([2], 7000)) is not None
    assert sglang_passes(world) == 2
    assert adapter.draft_prefill_direct.broken == "it raised RuntimeError: out of memory"
    assert lines(caplog, "direct draft prefill") == [
        "[dynspec] direct draft prefill raised RuntimeError: out of memory; prefills run "
        "SGLang's draft pass"
    ]
    assert "_draft_extend_for_prefill" not in vars(world.worker.draft_worker)


def test_an_instance_method_set_on_the_draft_worker_is_given_back(shapes):
    world = make_world(shapes)
    draft = world.worker.draft_worker
    own = draft._draft_extend_for_prefill  # bound: set on the instance, as a wrapper would
    draft._draft_extend_for_prefill = own
    dyn.maybe_fallback_v2(world.worker, prefill_batch([3], 6000))
    dyn.maybe_fallback_v2(world.worker, prefill_batch([2], 7000))
    assert vars(draft)["_draft_extend_for_prefill"] is own


def test_another_tp_ranks_refusal_drops_it_on_every_rank(shapes, monkeypatch):
    world = make_world(shapes)
    agreed = []

    def agree(group: Any, ok: bool) -> bool:
        agreed.append(ok)
        return ok and len(agreed) == 1  # the write agreed on; the direct prefill not

    monkeypatch.setattr(dyn, "_all_ranks_agree", agree)
    dyn.maybe_fallback_v2(world.worker, prefill_batch([3], 6000))
    adapter = adapter_of(world)
    assert agreed == [True, True]
    assert adapter.draft_prefill_write.checked
    assert adapter.draft_prefill_direct.broken == "another TP rank's draft state differed"


def test_the_direct_inputs_are_shifted_tokens_and_positions_from_each_prefix(shapes):
    import torch

    from tests.runtime.standins import eagle_prefill_tail_tokens

    direct = dyn.DraftPrefillDirect(eagle_prefill_tail_tokens, "bonus_tokens")
    batch = prefill_batch([3, 1, 2], 100, prefix_lens=[0, 9, 4])
    batch.input_ids = torch.tensor([10, 11, 12, 20, 30, 31])
    tokens, positions = direct.inputs(batch, torch.tensor([13, 21, 32]))
    assert tokens.tolist() == [11, 12, 13, 21, 31, 32]
    assert positions.tolist() == [0, 1, 2, 9, 4, 5]


def test_a_draft_state_whose_root_is_not_the_next_token_is_not_made_here(shapes, monkeypatch):
    """The state made here takes the target's next tokens as its root, as SGLang's pass
    does: a pass that hands on another root keeps the write inside it."""
    world = make_world(shapes)
    draft = world.worker.draft_worker
    real = draft._draft_extend_for_prefill
    root = adapter_of(world).names["root_field"]

    def other_root(*args: Any) -> Any:
        state = real(*args)
        setattr(state, root, getattr(state, root) + 1)
        return state

    monkeypatch.setattr(draft, "_draft_extend_for_prefill", other_root)
    dyn.maybe_fallback_v2(world.worker, prefill_batch([3, 5], 6000))
    adapter = adapter_of(world)
    assert adapter.draft_prefill_direct.broken == f"its {root} is not the target's next tokens"
    assert adapter.draft_prefill_write.checked


def test_v1_keeps_the_write_inside_its_own_draft_pass(caplog):
    """v1's prefill (``forward_draft_extend``) is not one built here: asked for, the direct
    prefill says so once and the prefill write runs inside SGLang's pass."""
    from tests.runtime.standins import World, give_draft_model, read_shape
    from tests.runtime.test_draft_kv_write_v1 import draft_state

    world = World(read_shape("0.5.12.post1", "v1"), threshold=2,
                  speculative_disable_min_dwell_steps=1)
    give_draft_model(world)
    world.batch = world._make_batch(3, 10, 100)
    draft_state(world.batch)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        dyn.maybe_fallback_v1(world.worker, world.batch)
        assert dyn.maybe_fallback_v1(world.worker, prefill_batch([3, 5], 6000)) is not None
    adapter = adapter_of(world)
    why = "only v2's draft pass (_draft_extend_for_prefill) is built here, not v1's"
    assert adapter.draft_prefill_direct is None
    assert adapter.draft_prefill_direct_note == f"SGLang's draft pass ({why})"
    assert lines(caplog, "DRAFT_PREFILL_DIRECT") == [
        f"[dynspec] DYNSPEC_DRAFT_PREFILL_DIRECT=1 not used: {why}"
    ]
    assert adapter.draft_prefill_write.checked
