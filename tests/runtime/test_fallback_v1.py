"""maybe_fallback_v1 against stand-in EAGLEWorkers shaped like each pinned v1 release."""

import logging

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
from tests.runtime.releases import V1_RELEASES

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def shapes():
    from tests.runtime.standins import read_shape

    return {v: read_shape(v, "v1") for v in V1_RELEASES}


def make_world(shapes, version, **kwargs):
    from tests.runtime.standins import World

    return World(shapes[version], **kwargs)


@pytest.mark.parametrize("version", V1_RELEASES)
def test_fallback_step_call_sequence_and_invariants(shapes, version):
    import torch

    from tests.runtime.standins import CaptureHiddenMode, ForwardMode, target_logits

    world = make_world(shapes, version, batch_size=4, seq_len=10)
    batch = world.batch
    roots = batch.spec_info.__dict__[
        world.shape.pick("EagleDraftInput", ("verified_id", "bonus_tokens"))
    ]
    roots = roots.clone()
    seq_lens_tensor = batch.seq_lens

    result = dyn.maybe_fallback_v1(world.worker, batch)

    assert result is not None
    names = world.recorder.names()
    order = [
        n for n in names if n in ("prepare_for_verify", "target_forward", "verify", "draft_extend")
    ]
    assert order == ["prepare_for_verify", "target_forward", "verify", "draft_extend"]
    # One-node verify input rooted at the last verified token, as int64.
    vi = world.recorder.get("prepare_for_verify")["vi"]
    assert vi.draft_token.dtype == torch.int64
    assert torch.equal(vi.draft_token, roots.long())
    index = getattr(vi, world.shape.pick("EagleVerifyInput", ("retrive_index", "retrieve_index")))
    assert index.tolist() == [[0], [1], [2], [3]]
    assert (vi.draft_token_num, vi.spec_steps) == (1, 0)
    assert world.recorder.get("prepare_for_verify")["page_size"] == 1
    # Target: plain DECODE, no spec metadata, FULL capture, new L+1 tensors, graph bypassed.
    call = world.recorder.get("target_forward")
    assert call["flag"] is True
    assert call["mode"] == ForwardMode.DECODE
    assert call["spec_info"] is None
    assert call["capture"] == CaptureHiddenMode.FULL
    assert call["seq_lens"].tolist() == [11] * 4
    assert call["seq_lens_cpu"].tolist() == [11] * 4
    assert call["seq_lens_sum"] == 44
    assert not call["seq_lens_is_batch_tensor"]
    assert call["batch_seq_lens"].tolist() == [10] * 4  # the batch itself was not advanced
    assert torch.equal(call["input_ids"], roots.long())
    assert call["graph"] is None
    assert getattr(world.worker.target_worker.model_runner, world.shape.graph_attr) is (
        world.graph_sentinel
    )
    # SGLang's own verify did the bookkeeping, on the same seq_lens tensor.
    verify = world.recorder.get("verify")
    assert verify["spec_info_is_self"]
    assert batch.seq_lens is seq_lens_tensor
    assert batch.seq_lens.tolist() == [11] * 4
    expected_tokens = target_logits(roots).argmax(-1).tolist()
    assert [req.output_ids for req in batch.reqs] == [[t] for t in expected_tokens]
    # Draft-extend ran inside the draft TP context with the new root.
    assert names.index("draft_tp_enter") < names.index("draft_extend")
    assert "cumulate_output_tokens" not in names  # penalties not required in this batch


@pytest.mark.parametrize("version", V1_RELEASES)
def test_return_contract_per_release(shapes, version):
    world = make_world(shapes, version, batch_size=3)
    result = dyn.maybe_fallback_v1(world.worker, world.batch)
    if version.startswith("0.4."):
        assert isinstance(result, tuple) and len(result) == 5
        logits_output, tokens, bid, n_accepted, can_run_graph = result
        assert (bid, n_accepted, can_run_graph) == (77, 0, True)
        assert tokens.tolist() == [r.output_ids[0] for r in world.batch.reqs]
        assert logits_output.next_token_logits.shape[0] == 3
        return
    assert type(result).__name__ == "GenerationBatchResult"
    fields = world.shape.fields["GenerationBatchResult"]
    count = next(
        f
        for f in ("num_accepted_tokens", "num_accepted_drafts", "num_correct_drafts")
        if f in fields
    )
    assert getattr(result, count) == 0
    per_req = [
        f for f in ("accept_length_per_req_cpu", "num_correct_drafts_per_req_cpu") if f in fields
    ]
    for name in per_req:
        assert getattr(result, name) == [0, 0, 0]
    assert result.next_token_ids.tolist() == [r.output_ids[0] for r in world.batch.reqs]
    assert result.can_run_cuda_graph is True


def test_renamed_fields_of_0_5_12_are_used(shapes):
    world = make_world(shapes, "0.5.12.post1", batch_size=2)
    result = dyn.maybe_fallback_v1(world.worker, world.batch)
    assert result.num_correct_drafts == 0
    assert result.num_correct_drafts_per_req_cpu == [0, 0]
    # The draft-extend got the EagleDraftExtendInput and its return became the spec_info.
    extend = world.recorder.get("draft_extend")
    assert type(extend["spec_info"]).__name__ == "EagleDraftExtendInput"
    assert type(world.batch.spec_info).__name__ == "EagleDraftInput"
    assert world.batch.spec_info.bonus_tokens.tolist() == result.next_token_ids.tolist()


@pytest.mark.parametrize("version", ["0.4.10.post2", "0.5.10.post1", "0.5.12.post1"])
def test_finished_requests_are_dropped_from_the_draft_extend(shapes, version):
    world = make_world(shapes, version, batch_size=3, max_new_tokens=5)
    world.batch.reqs[1].output_ids = [0, 0, 0, 0]  # finishes with this step
    dyn.maybe_fallback_v1(world.worker, world.batch)
    info = world.recorder.get("draft_extend")["spec_info"]
    kept = info.input_ids if version == "0.5.12.post1" else info.verified_id
    assert kept.shape[0] == 2
    assert world.batch.reqs[1].finished()


@pytest.mark.parametrize(
    ("version", "idle_call"), [("0.5.10.post1", None), ("0.5.12.post1", "preprocess_idle")]
)
def test_all_finished_skips_the_draft_extend(shapes, version, idle_call):
    world = make_world(shapes, version, batch_size=2, max_new_tokens=1)
    dyn.maybe_fallback_v1(world.worker, world.batch)
    names = world.recorder.names()
    assert "draft_extend" not in names
    assert (idle_call in names) if idle_call else True


def test_graph_attribute_restored_after_an_exception(shapes):
    world = make_world(shapes, "0.5.10.post1")
    world.worker.target_worker.fail_with = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        dyn.maybe_fallback_v1(world.worker, world.batch)
    assert world.recorder.get("target_forward")["graph"] is None
    runner = world.worker.target_worker.model_runner
    assert runner.graph_runner is world.graph_sentinel


def test_never_touches_the_adaptive_controller(shapes):
    # The stand-in controller raises on any attribute access: a call would fail the step.
    world = make_world(shapes, "0.5.12.post1")
    assert dyn.maybe_fallback_v1(world.worker, world.batch) is not None


def test_penalties_are_accumulated_with_the_int64_root(shapes):
    import torch

    world = make_world(shapes, "0.5.10.post1", batch_size=2)
    world.batch.sampling_info.penalizer_orchestrator.is_required = True
    dyn.maybe_fallback_v1(world.worker, world.batch)
    tokens = world.recorder.get("cumulate_output_tokens")["tokens"]
    assert tokens.dtype == torch.int64 and tokens.tolist() == [1, 2]


def test_logprobs_use_the_release_helper(shapes):
    for version, event in (("0.4.10.post2", "add_logprob_values"), ("0.5.10.post1", "logprobs_v1")):
        dyn.reset_for_tests()
        world = make_world(shapes, version, batch_size=2)
        world.batch.return_logprob = True
        dyn.maybe_fallback_v1(world.worker, world.batch)
        assert event in world.recorder.names()


def test_grammar_mask_is_built_and_the_stale_mask_dropped(shapes):
    world = make_world(shapes, "0.5.10.post1", batch_size=2)
    world.batch.has_grammar = True
    dyn.maybe_fallback_v1(world.worker, world.batch)
    bitmask = world.recorder.get("bitmask")
    assert bitmask["draft_cpu"].tolist() == [[1], [2]]  # the one-node tree: just the roots
    assert bitmask["next_token_cpu"].tolist() == [[-1], [-1]]
    assert world.recorder.get("verify")["vocab_mask"].shape == (2, 1)
    assert world.batch.sampling_info.vocab_mask is None


# -- when the fallback must NOT run --------------------------------------------------------


def test_below_threshold_speculates(shapes):
    world = make_world(shapes, "0.5.10.post1", threshold=8, batch_size=8)
    assert dyn.maybe_fallback_v1(world.worker, world.batch) is None
    assert world.recorder.names() == []


def test_feature_off_without_threshold(shapes):
    world = make_world(shapes, "0.5.10.post1", threshold=None)
    assert dyn.maybe_fallback_v1(world.worker, world.batch) is None


@pytest.mark.parametrize("attr", ["extend", "extend_in_batch", "idle", "no_spec_info"])
def test_non_decode_batches_speculate(shapes, attr):
    from tests.runtime.standins import ForwardMode

    world = make_world(shapes, "0.5.10.post1")
    if attr == "extend":
        world.batch.forward_mode = ForwardMode.EXTEND
    elif attr == "idle":
        world.batch.forward_mode = ForwardMode.IDLE
    elif attr == "no_spec_info":
        world.batch.spec_info = None
    else:
        world.batch.is_extend_in_batch = True
    assert dyn.maybe_fallback_v1(world.worker, world.batch) is None
    assert world.recorder.names() == []


@pytest.mark.parametrize(
    ("server_args", "reason"),
    [
        ({"enable_dp_attention": True}, "DP attention"),
        ({"enable_sp_layernorm": True}, "DeepEP MoE on 0.4.x"),
        ({"enable_multi_layer_eagle": True}, "multi-layer EAGLE"),
        ({"enable_two_batch_overlap": True}, "two-batch overlap"),
        ({"enable_pdmux": True}, "pdmux"),
        ({"pp_size": 2}, "pipeline parallelism"),
        ({"speculative_algorithm": "NGRAM"}, "NGRAM"),
        ({"speculative_algorithm": "STANDALONE"}, "STANDALONE"),
    ],
)
def test_refused_configurations_warn_once_and_stay_off(shapes, caplog, server_args, reason):
    world = make_world(shapes, "0.5.10.post1")
    vars(world.server_args).update(server_args)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert dyn.maybe_fallback_v1(world.worker, world.batch) is None
        assert dyn.maybe_fallback_v1(world.worker, world.batch) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0]
    assert world.recorder.names() == []


def test_hybrid_target_is_refused(shapes, caplog):
    world = make_world(shapes, "0.5.10.post1")
    world.worker.target_worker.model_runner.mamba2_config = object()
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert dyn.maybe_fallback_v1(world.worker, world.batch) is None
    assert "hybrid" in caplog.text


@pytest.mark.parametrize(
    "missing", ["EagleVerifyOutput", "GenerationBatchResult", "CaptureHiddenMode"]
)
def test_missing_global_fails_closed_for_the_process(shapes, caplog, missing):
    world = make_world(shapes, "0.5.10.post1")
    saved = world.module.__dict__.pop(missing)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert dyn.maybe_fallback_v1(world.worker, world.batch) is None
        setattr(world.module, missing, saved)  # resolved once: stays off for the process
        assert dyn.maybe_fallback_v1(world.worker, world.batch) is None
    assert caplog.text.count("fallback is OFF") == 1 and missing in caplog.text
    assert world.recorder.names() == []


def test_unknown_required_verify_input_field_fails_closed(shapes, caplog):
    import dataclasses

    from tests.runtime.standins import World

    shape = shapes["0.5.10.post1"]
    changed = dataclasses.replace(
        shape,
        fields={
            **shape.fields,
            "EagleVerifyInput": {**shape.fields["EagleVerifyInput"], "kv_loc_plan": False},
        },
    )
    world = World(changed)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert dyn.maybe_fallback_v1(world.worker, world.batch) is None
    assert "kv_loc_plan" in caplog.text


def test_warns_when_max_running_requests_cannot_exceed_threshold(shapes, caplog):
    world = make_world(shapes, "0.5.10.post1", threshold=64)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        dyn.maybe_fallback_v1(world.worker, world.batch)
    assert "max_running_requests=48 <= threshold=64" in caplog.text


@pytest.mark.parametrize(("threshold", "warned"), [(8, False), (40, True)])
def test_warns_about_the_default_cap_when_unset(shapes, caplog, threshold, warned):
    world = make_world(shapes, "0.5.10.post1", threshold=threshold, max_running_requests=None)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        dyn.maybe_fallback_v1(world.worker, world.batch)
    assert ("--max-running-requests is unset" in caplog.text) is warned


def test_switch_is_logged_on_rank0_only(shapes, caplog):
    world = make_world(shapes, "0.5.10.post1")
    world.worker.tp_rank = 1
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert dyn.maybe_fallback_v1(world.worker, world.batch) is not None
    assert "spec -> fallback" not in caplog.text
    dyn.reset_for_tests()
    world = make_world(shapes, "0.5.10.post1")
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        dyn.maybe_fallback_v1(world.worker, world.batch)
    assert caplog.text.count("spec -> fallback at decode bs=4") == 1


def test_invalid_hysteresis_arguments_fail_closed(shapes, caplog):
    world = make_world(shapes, "0.5.10.post1", threshold=4, speculative_disable_resume_below=9)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert dyn.maybe_fallback_v1(world.worker, world.batch) is None
    assert "resume_below" in caplog.text


@pytest.mark.parametrize(
    ("version", "moe_contexts"), [("0.4.10.post2", 0), ("0.5.5.post2", 1), ("0.5.10.post1", 2)]
)
def test_draft_extend_runs_inside_the_worker_contexts(shapes, version, moe_contexts):
    world = make_world(shapes, version)
    dyn.maybe_fallback_v1(world.worker, world.batch)
    names = world.recorder.names()
    before_extend = names[: names.index("draft_extend")]
    assert before_extend.count("moe_enter") == moe_contexts
    assert before_extend.count("draft_tp_enter") == 1
