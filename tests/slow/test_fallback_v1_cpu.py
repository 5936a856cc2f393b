"""Fallback decode steps through the PATCHED EAGLEWorker entry of real releases, on CPU.

The driver calls the real entry method of a real ``EAGLEWorker`` (made without ``__init__``)
on a real ``ScheduleBatch`` of three requests at threshold T=1, for up to six steps; request r1
reaches max_new_tokens inside a fallback step. Everything between the hook and the model
forwards is SGLang's and the installed runtime's own code; the forwards are a toy model whose
greedy output is known (harness/toy_model.py), and the CUDA/Triton kernels are CPU references.
Between steps the test side does what the v1 scheduler does: release finished requests
(SGLang's ChunkCache + release_kv_cache) and ``filter_batch(v1_spec_info_filtered=True)``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytestmark = pytest.mark.slow

TARGET_TAG = 1.0  # harness/world.py: column 2 of a hidden state names its producer
DRAFT_TAG = 2.0


def _steps(drive: Any, case: Any) -> list[dict[str, Any]]:
    release, variant = case
    steps = drive(release, variant)["steps"]["steps"]
    assert len(steps) >= 3, "the scenario needs several fallback steps"
    return steps


def _new_tokens(step: dict[str, Any]) -> dict[str, int]:
    return {r["rid"]: r["output_ids"][-1] for r in step["reqs"]}


def test_target_runs_one_decode_token_per_request(v1_case, drive):
    for step in _steps(drive, v1_case):
        before = step["before"]
        (call,) = step["target_calls"]
        assert call["forward_mode"] == "DECODE"
        assert call["spec_info_is_none"]
        assert call["capture_hidden_mode"] == "FULL"
        assert call["input_dtype"] == "torch.int64"
        assert call["input_ids"] == before["root"]  # the last verified token of each request
        assert call["seq_lens"] == [n + 1 for n in before["seq_lens"]]
        assert not call["seq_lens_is_batch_tensor"]  # a new tensor, never the batch's
        assert len(call["out_cache_loc"]) == len(before["rids"])
        assert set(call["kwargs"]) & {"is_verify", "skip_sample"}


def test_target_verify_graph_bypassed_and_restored(v1_case, drive):
    for step in _steps(drive, v1_case):
        assert step["target_calls"][0]["graph_attr_during_call"] == "None"
        assert "GraphRunnerSentinel" in step["graph_attr_after"]


def test_greedy_tokens_are_the_targets_argmax(v1_case, drive, toy):
    for step in _steps(drive, v1_case):
        before = step["before"]
        expected = {
            rid: toy.next_token(root)
            for rid, root, length in zip(before["rids"], before["root"], before["seq_lens"],
                                         strict=True)
        }
        assert _new_tokens(step) == expected
        assert step["result"]["tokens"] == [expected[rid] for rid in before["rids"]]


def test_kv_slot_allocated_and_mapped_at_position_L(v1_case, drive):
    for step in _steps(drive, v1_case):
        before = step["before"]
        slots = step["target_calls"][0]["out_cache_loc"]
        assert step["free_after_step"] == before["free"] - len(slots)  # one slot each, no frees
        for rid, length, slot in zip(before["rids"], before["seq_lens"], slots, strict=True):
            row = step["req_to_token_rows"][rid]
            assert len(row) == length + 1
            assert row[length] == slot
        assert step["seq_lens_after"] == [n + 1 for n in before["seq_lens"]]


def test_result_contract_has_zero_accepted_drafts(v1_case, drive):
    release, _ = v1_case
    for step in _steps(drive, v1_case):
        result = step["result"]
        n = len(step["before"]["rids"])
        if release.version.startswith("0.4."):
            assert result["kind"] == "tuple"
            assert result["arity"] == 5  # (logits, ids, bid, n_accepted, can_run_cuda_graph)
            assert result["count"] == 0
            continue
        assert result["kind"] == "GenerationBatchResult"
        counts = [result[k] for k in ("num_accepted_tokens", "num_accepted_drafts",
                                      "num_correct_drafts") if k in result]
        assert counts == [0]
        per_req = [result[k] for k in result if k.endswith("_per_req_cpu")]
        # GenerationBatchResult gained a per-request count in 0.5.7 (sglang-releases.md §5).
        assert per_req == ([] if release.version == "0.5.5.post2" else [[0] * n])


def test_draft_extend_pairs_target_hidden_with_new_token(v1_case, drive):
    """EAGLE shift: draft position L gets (target hidden of the token at L, the new token),
    written into the same KV slot the target just used; finished requests are left out."""
    for step in _steps(drive, v1_case):
        before = step["before"]
        slots = dict(zip(before["rids"], step["target_calls"][0]["out_cache_loc"], strict=True))
        lengths = dict(zip(before["rids"], before["seq_lens"], strict=True))
        roots = dict(zip(before["rids"], before["root"], strict=True))
        live = [r["rid"] for r in step["reqs"] if not r["finished"]]
        new = _new_tokens(step)
        (call,) = step["draft_calls"]
        assert call["forward_mode"] == "DRAFT_EXTEND"
        assert call["input_ids"] == [new[rid] for rid in live]
        assert call["positions"] == [lengths[rid] for rid in live]
        assert call["out_cache_loc"] == [slots[rid] for rid in live]
        assert call["hidden_in"] == [[roots[rid], lengths[rid], TARGET_TAG] for rid in live]


def test_next_draft_state_is_fresh_and_only_for_unfinished(v1_case, drive, toy):
    for step in _steps(drive, v1_case):
        lengths = dict(zip(step["before"]["rids"], step["before"]["seq_lens"], strict=True))
        live = [r["rid"] for r in step["reqs"] if not r["finished"]]
        new = _new_tokens(step)
        assert step["spec_info_type"] == "EagleDraftInput"
        assert step["forward_mode_after"] == "DECODE"
        assert step["spec_root_after"] == [new[rid] for rid in live]
        assert step["topk_index_after"] == [
            [toy.draft_next_token(new[rid])] for rid in live
        ]
        assert step["hidden_after"] == [[new[rid], lengths[rid], DRAFT_TAG] for rid in live]
        # after the scheduler's filter the draft state still lines up with the requests
        assert step["rids_after_filter"] == live
        assert step["spec_root_after_filter"] == [new[rid] for rid in live]


def test_request_finishing_inside_a_fallback_step(v1_case, drive):
    steps = _steps(drive, v1_case)
    finished_at = [
        i for i, step in enumerate(steps)
        if any(r["rid"] == "r1" and r["finished"] for r in step["reqs"])
    ]
    assert finished_at, "r1 (max_new_tokens=3) never finished"
    step = steps[finished_at[0]]
    r1 = next(r for r in step["reqs"] if r["rid"] == "r1")
    assert len(r1["output_ids"]) == 3
    assert "r1" not in step["rids_after_filter"]


def test_no_kv_leak(v1_case, drive):
    release, variant = v1_case
    report = drive(release, variant)["steps"]
    for step in report["steps"]:
        live = sum(step["seq_lens_after_filter"])
        assert step["free_after_release"] + live == report["total_slots"]


def test_controller_and_adaptive_controller(v1_case, drive):
    release, variant = v1_case
    report = drive(release, variant)["steps"]
    assert report["controller"] == {
        "fallback_steps": len(report["steps"]), "spec_steps": 0, "switches": 1,
    }
    assert all(step["adaptive_calls"] == [] for step in report["steps"])


def test_batch_at_threshold_runs_the_real_speculative_path(v1_case, drive):
    release, variant = v1_case
    report = drive(release, variant)["at_threshold"]
    assert report["spec_path_entered"]  # the hook returned None; the worker's body went on
    assert report["draft_batch_sizes"] == [report["threshold"]]
    assert report["target_calls"] == 0
    assert report["controller_spec_steps"] == 1


def test_spec_fallback_spec_cycle_through_the_real_speculative_path(v1_case, drive, toy):
    """T=2 (resume at bs <= 1): r2 speculates alone on the worker's REAL speculative path
    (multi-step draft, tree from the reference kernel, TARGET_VERIFY, verify, draft-extend with
    real accept lengths); r0 and r1 join through the scheduler's merge_batch, so the batch of 3
    switches to fallback steps; when both have finished and r2 has run 32 steps alone, r2
    speculates again from the draft state the fallback steps left. Every speculative step must
    accept exactly the drafts the toy draft gets right from its root, and every request's
    output must be the plain greedy sequence."""
    release, variant = v1_case
    report = drive(release, variant)["cycle"]
    steps = report["steps"]
    modes = "".join("S" if s["mode"] == "TARGET_VERIFY" else "F" for s in steps)
    match = re.fullmatch(r"(S+)(F+)(S+)", modes)
    assert match, modes
    spec_before, fallback, spec_after = (len(g) for g in match.groups())
    assert fallback >= report["controller"]["min_dwell_steps"]
    assert report["controller"] == {
        "fallback_steps": fallback, "spec_steps": spec_before + spec_after, "switches": 2,
        "min_dwell_steps": report["controller"]["min_dwell_steps"],
    }
    first_fallback = steps[spec_before]
    assert first_fallback["before"]["rids"] == ["r2", "r0", "r1"]  # the merged batch
    assert steps[spec_before + fallback]["before"]["rids"] == ["r2"]
    for i, step in enumerate(steps):
        if step["mode"] != "TARGET_VERIFY":
            continue
        (root,) = step["before"]["root"]
        accepted = toy.accepted_drafts(root, report["num_steps"])
        (emitted,) = step["emitted"].values()
        expected = toy.greedy_continuation(root, accepted + 1)
        if i == len(steps) - 1:  # r2 reaches max_new_tokens here: the tail is cut
            assert emitted == expected[: len(emitted)]
        else:
            assert emitted == expected
        count = step["result"].get("count", step["result"].get(
            "num_accepted_tokens", step["result"].get("num_correct_drafts")))
        assert count == len(emitted) - 1
    assert any(len(next(iter(s["emitted"].values()))) > 1
               for s in steps[spec_before + fallback:]), "no draft accepted after resume"
    for rid, tokens in report["emitted_by_rid"].items():
        first = report["first_tokens"][rid]
        assert tokens == toy.greedy_continuation(first, len(tokens))
        assert len(tokens) + 1 == report["max_new_tokens"][rid]  # ran to its limit
    assert all(s["free_plus_live"] == report["total_slots"] for s in steps)
