"""maybe_fallback_v2 on the 0.5.14+ layout (stand-ins cloned from 0.5.16, 0.5.17 and 0.5.23).

What changed there: sampling is ``eagle_sample(vi, ...)`` in the verify module
(``eagle_worker_common``, 0.5.16+), grammar goes through ``build_grammar_vocab_mask`` after the
scheduler's ``grammar_barrier`` (0.5.17+), logprobs through ``compute_spec_logprobs`` (0.5.19+),
the target forward takes ``capture_hidden_mode`` as a keyword (0.5.16+), the draft TP context is
a module function (0.5.22+), the draft-extend takes ``kv_loc_plan`` (0.5.22+), and the scheduler
may send no CPU sequence lengths at all (0.5.17+ with a backend that needs none).
"""

import ast
import logging

import pytest

from dynspec_patch.patcher.releases import find_pin, release_dir
from dynspec_patch.transforms.runtime import dynspec_fallback as dyn

pytestmark = pytest.mark.torch

NEW = ["0.5.16", "0.5.17", "0.5.23"]
STRIDE = 4


@pytest.fixture(scope="module")
def shapes():
    from tests.runtime.standins import read_shape

    return {v: read_shape(v, "v2") for v in NEW}


def make_world(shapes, version, **kwargs):
    from tests.runtime.standins import World

    return World(shapes[version], **kwargs)


def run(world, **kwargs):
    return dyn.maybe_fallback_v2(world.worker, world.batch, **kwargs)


def _verify_result_keywords(version: str) -> set[str]:
    """The fields the release's own verify sets on its GenerationBatchResult (from source)."""
    root = release_dir(find_pin(version))
    path = root / "srt/speculative/eagle_worker_common.py"
    function = "run_eagle_verify"
    if not path.is_file():  # 0.5.14: verify is a method of the worker
        path, function = root / "srt/speculative/eagle_worker_v2.py", "verify"
    tree = ast.parse(path.read_text())
    (fn,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function
    ]
    calls = [
        node
        for node in ast.walk(fn)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "GenerationBatchResult"
    ]
    return {kw.arg for call in calls for kw in call.keywords if kw.arg}


# Fields verify sets that a fallback step leaves at their default, and why.
LEFT_AT_DEFAULT = {
    "routed_experts_output": "refused configuration (--enable-return-routed-experts)",
    "indexer_topk_output": "None unless the target has a DSA indexer capture",
    "accept_index": "0.5.23: read by pipeline parallelism only (refused)",
    "prepared_draft_extend_inputs": "0.5.22+: optional precomputation; the draft-extend "
    "computes the same from accept_lens",
}


@pytest.mark.parametrize("version", NEW)
def test_result_carries_every_field_the_release_verify_sets(shapes, version):
    import torch

    world = make_world(shapes, version, batch_size=3, seq_len=10)
    roots = world.batch.spec_info.bonus_tokens.clone()
    result = run(world)

    expected = _verify_result_keywords(version) - set(LEFT_AT_DEFAULT)
    assert {"next_draft_input", "new_seq_lens", "speculative_num_draft_tokens"} <= expected
    for name in sorted(expected):
        assert getattr(result, name) is not None, name
    assert result.speculative_num_draft_tokens == STRIDE
    assert result.new_seq_lens.tolist() == [11, 11, 11]
    assert result.accept_lens.tolist() == [1, 1, 1]
    assert result.next_token_ids.shape == (3 * STRIDE,)
    from tests.runtime.standins import target_logits

    predicted = target_logits(roots).argmax(-1).to(torch.int32)
    assert result.next_draft_input.bonus_tokens.dtype == torch.int32
    assert torch.equal(result.next_draft_input.bonus_tokens, predicted)
    # The decode batch's tensors outlive the schedule stream's rebinds, as verify's do.
    (kept,) = result.extra_keep_alive_refs
    assert kept.seq_lens.tolist() == [11, 11, 11]
    assert getattr(result.next_draft_input, "verify_done", None) is None


@pytest.mark.parametrize("version", NEW)
def test_target_forward_gets_full_hidden_capture_the_way_the_release_reads_it(shapes, version):
    from tests.runtime.standins import CaptureHiddenMode

    world = make_world(shapes, version, batch_size=2)
    run(world)
    call = world.recorder.get("target_forward")
    assert call["capture_effective"] == CaptureHiddenMode.FULL
    assert call["spec_info"] is None and call["flag"] is True


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_on_publish_once_with_the_new_seq_lens_before_the_target_forward(shapes, version):
    world = make_world(shapes, version, batch_size=2, seq_len=5)
    published = []

    def on_publish(new_seq_lens):
        published.append((new_seq_lens.tolist(), list(world.recorder.names())))

    run(world, on_publish=on_publish, grammar_barrier=None)
    assert len(published) == 1
    lens, seen_before = published[0]
    assert lens == [6, 6]
    assert "target_forward" not in seen_before and "sample" not in seen_before
    assert {"target_forward", "sample"} <= set(world.recorder.names())


@pytest.mark.parametrize(
    ("version", "tp_args", "extend_kwargs"),
    [
        ("0.5.16", {"tp_group": "draft-tp"}, {}),
        ("0.5.17", {"tp_group": "draft-tp"}, {}),
        # 0.5.23: the module function draft_tp_context(layout); the draft-extend's keyword-only
        # kv_loc_plan stays None (a plain KV pool: virtual and physical ids coincide).
        ("0.5.23", {"layout": "draft-layout"}, {"kv_loc_plan": None}),
    ],
)
def test_draft_extend_runs_in_the_release_tp_context_with_its_signature(
    shapes, version, tp_args, extend_kwargs
):
    world = make_world(shapes, version, batch_size=2)
    run(world)
    names = world.recorder.names()
    assert names.index("draft_tp_enter") < names.index("draft_extend_v2")
    assert world.recorder.get("draft_tp_enter") == tp_args
    assert world.recorder.get("draft_extend_v2")["kwargs"] == extend_kwargs


def test_grammar_on_0517_builds_the_mask_after_the_grammar_barrier(shapes):
    import torch

    world = make_world(shapes, "0.5.17", batch_size=2)
    world.batch.has_grammar = True
    world.batch.sampling_info.grammar_mask = "stale-mask"
    roots = world.batch.spec_info.bonus_tokens.clone()
    barrier_calls = []

    def barrier():
        barrier_calls.append(list(world.recorder.names()))

    assert run(world, on_publish=None, grammar_barrier=barrier) is not None
    assert len(barrier_calls) == 1
    assert "target_forward" in barrier_calls[0]  # overlapping the forward, as verify does
    assert "grammar_mask" not in barrier_calls[0]
    next_token, next_sibling, draft = world.recorder.get("grammar_mask")["tree"]
    assert next_token.tolist() == [[-1], [-1]] and next_sibling.tolist() == [[-1], [-1]]
    assert torch.equal(draft.reshape(-1), roots.long())
    mask = world.recorder.get("sample")["vocab_mask"]
    assert mask.kind == "GrammarMask"
    assert world.batch.sampling_info.grammar_mask is None


def test_grammar_on_0516_passes_the_bitmask_to_eagle_sample(shapes):
    world = make_world(shapes, "0.5.16", batch_size=2)
    world.batch.has_grammar = True
    assert run(world) is not None
    assert world.recorder.get("bitmask")["next_token_cpu"].tolist() == [[-1], [-1]]
    assert world.recorder.get("sample")["vocab_mask"].shape == (2, 1)


def test_no_grammar_means_no_barrier_and_no_mask(shapes):
    world = make_world(shapes, "0.5.17", batch_size=2)
    calls = []
    run(world, grammar_barrier=lambda: calls.append(1))
    assert calls == []
    assert world.recorder.get("sample")["vocab_mask"] is None


@pytest.mark.parametrize(
    ("version", "args"),
    [
        ("0.5.17", ["accept_index", "batch", "logits_output", "predict", "speculative_num_steps"]),
        ("0.5.23", ["accept_index", "batch", "chain_stride", "logits_output", "predict"]),
    ],
)
def test_logprobs_through_the_release_helper(shapes, version, args):
    world = make_world(shapes, version, batch_size=2)
    world.batch.return_logprob = True
    run(world)
    call = world.recorder.get("logprobs_v2")
    assert call["args"] == args
    assert call["accept_index"].tolist() == [[0, -1, -1, -1], [1, -1, -1, -1]]


def test_no_cpu_lengths_from_the_scheduler_stay_unknown(shapes):
    # 0.5.17 with Triton (needs_cpu_seq_lens False): neither seq_lens_cpu nor seq_lens_sum;
    # computing the sum would synchronise the device on every fallback step.
    world = make_world(shapes, "0.5.17", batch_size=3, seq_len=9)
    world.batch.seq_lens_cpu = None
    world.batch.seq_lens_sum = None
    assert run(world) is not None
    call = world.recorder.get("target_forward")
    assert call["seq_lens_sum"] is None and call["seq_lens_cpu"] is None
    assert call["seq_lens"].tolist() == [10, 10, 10]
    assert world.recorder.get("sample")["vi"].seq_lens_sum is None


def test_cpu_lengths_when_sent_are_advanced_by_one(shapes):
    world = make_world(shapes, "0.5.17", batch_size=3, seq_len=9)
    run(world)
    call = world.recorder.get("target_forward")
    assert call["seq_lens_cpu"].tolist() == [10, 10, 10]
    assert call["seq_lens_sum"] == 30


def test_sglang_adaptive_on_the_server_turns_the_fallback_off_once(shapes, caplog):
    world = make_world(shapes, "0.5.17")
    world.worker.adaptive_controller = object()
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert run(world) is None
        assert run(world) is None
    assert caplog.text.count("fallback is OFF") == 1
    assert "--speculative-adaptive" in caplog.text
    assert world.recorder.names() == []


@pytest.mark.parametrize(
    ("version", "break_it", "named"),
    [
        ("0.5.17", lambda w: delattr(w.verify_module, "eagle_sample"), "eagle_sample"),
        ("0.5.17", lambda w: delattr(w.module, "run_eagle_verify"), "eagle_sample"),
        ("0.5.23", lambda w: delattr(w.module, "draft_tp_context"), "draft TP context"),
        (
            "0.5.23",
            lambda w: delattr(w.worker.draft_worker, "parallel_layout"),
            "parallel_layout",
        ),
        ("0.5.23", lambda w: delattr(w.verify_module, "GrammarTree"), "GrammarTree"),
    ],
)
def test_a_missing_name_keeps_speculating_with_one_warning(
    shapes, caplog, version, break_it, named
):
    world = make_world(shapes, version)
    break_it(world)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert run(world) is None
        assert run(world) is None
    assert caplog.text.count("fallback is OFF") == 1
    assert named in caplog.text
    assert world.recorder.names() == []


@pytest.mark.parametrize(
    ("setup", "named"),
    [
        (lambda w: setattr(w.worker.target_worker.model_runner, "watermark_state", 1), "water"),
        (lambda w: setattr(w.server_args, "enable_return_routed_experts", True), "routed"),
        (lambda w: setattr(w.worker, "topk", 2), "topk"),
    ],
)
def test_configurations_the_fallback_cannot_serve_are_refused(shapes, caplog, setup, named):
    world = make_world(shapes, "0.5.23")
    setup(world)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert run(world) is None
    assert named in caplog.text
    assert world.recorder.names() == []
