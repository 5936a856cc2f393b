"""maybe_fallback_v2 against stand-in EAGLEWorkerV2s shaped like each pinned v2 release."""

import logging

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
from tests.runtime.releases import V2_RELEASES

pytestmark = pytest.mark.torch

STRIDE = 4  # the stand-in worker's speculative_num_draft_tokens


@pytest.fixture(scope="module")
def shapes():
    from tests.runtime.standins import read_shape

    return {v: read_shape(v, "v2") for v in V2_RELEASES}


def make_world(shapes, version, **kwargs):
    from tests.runtime.standins import World

    return World(shapes[version], **kwargs)


def run(world, **kwargs):
    return dyn.maybe_fallback_v2(world.worker, world.batch, **kwargs)


@pytest.mark.parametrize("version", V2_RELEASES)
def test_fallback_step_pads_to_the_stride_and_keeps_invariants(shapes, version):
    import torch

    from tests.runtime.standins import (
        CaptureHiddenMode,
        ForwardMode,
        target_hidden,
        target_logits,
    )

    world = make_world(shapes, version, batch_size=3, seq_len=10)
    batch = world.batch
    root_name = world.shape.pick("EagleDraftInput", ("verified_id", "bonus_tokens"))
    roots = getattr(batch.spec_info, root_name).clone()
    seq_lens = batch.seq_lens
    rows = batch.req_pool_indices

    result = run(world)

    names = world.recorder.names()
    assert [n for n in names if n in ("target_forward", "sample", "draft_extend_v2")] == [
        "target_forward",
        "sample",
        "draft_extend_v2",
    ]
    call = world.recorder.get("target_forward")
    assert call["mode"] == ForwardMode.DECODE
    assert call["spec_info"] is None
    assert call["capture"] == CaptureHiddenMode.FULL
    assert call["seq_lens"].tolist() == [11, 11, 11]
    assert not call["seq_lens_is_batch_tensor"]
    assert call["graph"] is None
    assert torch.equal(call["input_ids"], roots.long())
    # sample() sees the one-node tree as the batch input, as in SGLang's own verify.
    assert torch.equal(world.recorder.get("sample")["input_ids"], roots.long())
    # The decode writes the slot the scheduler already reserved at position L.
    assert call["out_cache_loc"].tolist() == world.req_to_token[rows, 10].tolist()
    # The scheduler's tensors were not changed in place (the draft-extend rebinds the batch's
    # seq_lens to L + N, as SGLang's prepare_for_extend_to_fill_draft_kvcache does).
    assert seq_lens.tolist() == [10, 10, 10]
    assert world.recorder.get("draft_extend_v2")["seq_lens"].tolist() == [10, 10, 10]
    # Tokens padded to the stride, accept length 1 (the bonus token only).
    predicted = target_logits(roots).argmax(-1).to(torch.int32)
    tokens = result.next_token_ids
    assert tokens.shape == (3 * STRIDE,)
    assert torch.equal(tokens[::STRIDE], predicted)
    assert tokens.reshape(3, STRIDE)[:, 1:].eq(0).all()
    assert result.accept_lens.tolist() == [1, 1, 1]
    # The N-token draft-extend sees the N reserved slots and picks the real rows.
    extend = world.recorder.get("draft_extend_v2")
    expected_slots = world.req_to_token[rows[:, None], 10 + torch.arange(STRIDE)].reshape(-1)
    assert extend["out_cache_loc"].tolist() == expected_slots.tolist()
    assert torch.equal(extend["selected_hidden"], target_hidden(roots))
    assert torch.equal(extend["selected_tokens"], predicted)
    assert extend["hidden"].shape == (3 * STRIDE, 4)
    # The next draft input (what the FutureMap stores) has the usual shapes and dtypes.
    next_input = result.next_draft_input
    assert getattr(next_input, root_name).dtype == torch.int32
    assert torch.equal(getattr(next_input, root_name), predicted)
    assert next_input.hidden_states.shape == (3, 4)
    assert names.index("draft_tp_enter") < names.index("draft_extend_v2")


def test_stride_and_new_seq_lens_travel_where_each_release_reads_them(shapes):
    import torch

    expectations = {
        "0.5.5.post2": {"stride_on_result": False, "new_seq_lens_on": "draft", "done": True},
        "0.5.10.post1": {"stride_on_result": False, "new_seq_lens_on": "draft", "done": True},
        "0.5.12.post1": {"stride_on_result": True, "new_seq_lens_on": "draft", "done": True},
        "0.5.13.post1": {"stride_on_result": True, "new_seq_lens_on": "result", "done": False},
    }
    for version, expected in expectations.items():
        dyn.reset_for_tests()
        world = make_world(shapes, version, batch_size=2, seq_len=7)
        result = run(world)
        stride = getattr(result, "speculative_num_draft_tokens", None)
        assert (stride == STRIDE) is expected["stride_on_result"], version
        carrier = result if expected["new_seq_lens_on"] == "result" else result.next_draft_input
        assert carrier.new_seq_lens.tolist() == [8, 8], version
        done = getattr(result.next_draft_input, "verify_done", None)
        assert (done is not None) is expected["done"], version
        if version == "0.5.5.post2":
            allocate = world.batch.spec_info.allocate_lens
            assert torch.equal(result.allocate_lens, allocate)
            assert torch.equal(result.next_draft_input.allocate_lens, allocate)


def test_verify_done_is_recorded_before_the_target_forward_after_new_seq_lens(
    shapes, monkeypatch
):
    # <= 0.5.12.post1's scheduler waits on verify_done before it prepares the next batch; an
    # event recorded after the target forward would keep the GPU idle while it prepares.
    import torch
    from torch.overrides import TorchFunctionMode

    world = make_world(shapes, "0.5.12.post1", batch_size=2, seq_len=7)
    timeline: list[object] = []

    class RecordedEvent:
        def record(self) -> None:
            timeline.append("verify_done")
            world.recorder.add("verify_done")

    class Ops(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            timeline.append(out)
            return out

    device_module = torch.get_device_module(world.batch.seq_lens.device)
    monkeypatch.setattr(device_module, "Event", RecordedEvent)
    with Ops():
        result = run(world)

    new_seq_lens = result.next_draft_input.new_seq_lens
    assert new_seq_lens.tolist() == [8, 8]
    assert result.next_draft_input.verify_done is not None
    made_at = next(i for i, x in enumerate(timeline) if x is new_seq_lens)
    assert made_at < timeline.index("verify_done")
    names = world.recorder.names()
    assert names.count("verify_done") == 1
    assert names.index("verify_done") < names.index("target_forward")


def test_on_publish_gets_new_seq_lens_before_the_target_forward(shapes):
    """0.5.13+'s scheduler waits on the event on_publish records before it prepares the next
    batch: published before the target forward, that wait overlaps this step's GPU work."""
    world = make_world(shapes, "0.5.13.post1", batch_size=2, seq_len=5)
    published = []

    def on_publish(new_seq_lens):
        published.append((new_seq_lens.tolist(), list(world.recorder.names())))

    run(world, on_publish=on_publish)
    assert len(published) == 1
    lens, seen_before = published[0]
    assert lens == [6, 6]
    assert "target_forward" not in seen_before and "draft_extend_v2" not in seen_before
    assert "target_forward" in world.recorder.names()


@pytest.mark.parametrize(
    ("version", "event"),
    [
        ("0.5.5.post2", None),
        ("0.5.10.post1", "logprobs_v2"),
        ("0.5.12.post1", "logprobs_v2"),
        ("0.5.13.post1", "logprobs_v2"),
    ],
)
def test_logprobs_in_the_spec_v2_layout(shapes, version, event):
    world = make_world(shapes, version, batch_size=2)
    world.batch.return_logprob = True
    run(world)
    if event is None:  # 0.5.5's spec v2 path returns no logprobs either
        assert "logprobs_v2" not in world.recorder.names()
        return
    accept_index = world.recorder.get(event)["accept_index"]
    assert accept_index.tolist() == [[0, -1, -1, -1], [1, -1, -1, -1]]


def test_grammar_uses_the_mask_where_sample_takes_one(shapes):
    world = make_world(shapes, "0.5.10.post1", batch_size=2)
    world.batch.has_grammar = True
    run(world)
    assert world.recorder.get("sample")["vocab_mask"].shape == (2, 1)
    assert world.batch.sampling_info.vocab_mask is None


def test_grammar_keeps_speculating_where_sample_has_no_mask(shapes):
    world = make_world(shapes, "0.5.5.post2", batch_size=2)
    world.batch.has_grammar = True
    assert run(world) is None
    assert world.recorder.names() == []


def test_graph_attribute_restored_after_an_exception(shapes):
    world = make_world(shapes, "0.5.12.post1")
    world.worker.target_worker.fail_with = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        run(world)
    assert world.worker.target_worker.model_runner.graph_runner is world.graph_sentinel


def test_adaptive_v2_is_refused(shapes, caplog):
    # The 0.5.12+ scheduler feeds every v2 result into the adaptive EMA itself.
    world = make_world(shapes, "0.5.13.post1")
    world.worker.adaptive_controller = object()
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert run(world) is None
    assert "adaptive" in caplog.text
    assert world.recorder.names() == []


def test_stride_disagreement_keeps_speculating(shapes):
    world = make_world(shapes, "0.5.12.post1")
    world.worker.draft_worker.speculative_num_draft_tokens = STRIDE + 1
    assert run(world) is None
    assert world.recorder.names() == []


@pytest.mark.parametrize("case", ["extend", "extend_in_batch", "no_spec_info", "small"])
def test_speculates_when_not_a_fallback_step(shapes, case):
    from tests.runtime.standins import ForwardMode

    world = make_world(shapes, "0.5.10.post1", threshold=8 if case == "small" else 1)
    if case == "extend":
        world.batch.forward_mode = ForwardMode.EXTEND
    elif case == "extend_in_batch":
        world.batch.is_extend_in_batch = True
    elif case == "no_spec_info":
        world.batch.spec_info = None
    assert run(world) is None
    assert world.recorder.names() == []


def test_topk_above_one_is_refused(shapes, caplog):
    world = make_world(shapes, "0.5.10.post1", speculative_eagle_topk=4)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert run(world) is None
    assert "topk" in caplog.text


def test_missing_draft_worker_method_fails_closed(shapes, caplog):
    world = make_world(shapes, "0.5.13.post1")
    del world.worker.draft_worker._draft_extend_for_decode
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert run(world) is None
        assert run(world) is None
    assert caplog.text.count("fallback is OFF") == 1
    assert "_draft_extend_for_decode" in caplog.text
