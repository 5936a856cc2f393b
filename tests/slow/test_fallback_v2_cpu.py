"""Fallback decode steps through the PATCHED EAGLEWorkerV2 entry of real releases, on CPU.

Per step the driver runs the scheduler's own ``ScheduleBatch.prepare_for_decode`` (spec v2
over-allocation) and ``get_model_worker_batch``, then the real ``EAGLEWorkerV2`` entry (made
without ``__init__``) at T=1, so the installed runtime's v2 path runs: target DECODE forward
(toy model), one-node ``EagleVerifyInput.sample``, padding to the stride, and the draft
worker's own ``_draft_extend_for_decode`` (DRAFT_EXTEND_V2 over N tokens per request). The
scheduler's output processing (tokens at ``i * stride``, ``kv_committed_len``, finish,
release, filter) is re-done in the driver (harness/drive.py ``check_v2_steps``).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytestmark = pytest.mark.slow

TARGET_TAG = 1.0
DRAFT_TAG = 2.0
NUM_DRAFT_TOKENS = 4  # harness/world.py server_args: speculative_num_draft_tokens


def _steps(drive: Any, case: Any) -> list[dict[str, Any]]:
    release, variant = case
    steps = drive(release, variant)["steps"]["steps"]
    assert len(steps) >= 3
    return steps


def test_target_decode_uses_the_slot_at_L(v2_case, drive):
    for step in _steps(drive, v2_case):
        before = step["before"]
        (call,) = step["target_calls"]
        assert call["forward_mode"] == "DECODE"
        assert call["spec_info_is_none"]
        assert call["capture_hidden_mode"] == "FULL"
        assert call["input_dtype"] == "torch.int64"
        assert call["input_ids"] == before["root"]
        assert call["seq_lens"] == [n + 1 for n in before["seq_lens"]]
        expected_slots = [before["allocated_rows"][rid][length]
                          for rid, length in zip(before["rids"], before["seq_lens"], strict=True)]
        assert call["out_cache_loc"] == expected_slots  # read, never allocated
        assert call["graph_attr_during_call"] == "None"
        assert "GraphRunnerSentinel" in step["graph_attr_after"]
        assert step["seq_lens_tensor_untouched"]


def test_outputs_padded_to_the_stride_the_scheduler_reads(v2_case, drive, toy):
    for step in _steps(drive, v2_case):
        before = step["before"]
        n = step["stride"]
        assert n == NUM_DRAFT_TOKENS
        expected = [toy.next_token(root)
                    for root, length in zip(before["root"], before["seq_lens"], strict=True)]
        padded = [0] * (len(expected) * n)
        padded[::n] = expected
        assert step["next_token_ids"] == padded
        assert step["accept_lens"] == [1] * len(expected)
        assert step["new_seq_lens"] == [length + 1 for length in before["seq_lens"]]
        emitted = {r["rid"]: r["output_ids"][-1] for r in step["reqs"]}
        assert [emitted[rid] for rid in before["rids"]] == expected


def test_next_draft_input_for_the_future_map(v2_case, drive, toy):
    for step in _steps(drive, v2_case):
        before = step["before"]
        new = [toy.next_token(root)
               for root, length in zip(before["root"], before["seq_lens"], strict=True)]
        assert step["next_root"] == new
        assert step["next_root_dtype"] == "torch.int32"
        assert step["next_topk_index"] == [[toy.draft_next_token(t)] for t in new]
        assert step["next_hidden"] == [
            [t, length, DRAFT_TAG] for t, length in zip(new, before["seq_lens"], strict=True)
        ]


def test_draft_extend_gets_n_tokens_per_request_with_one_real_row(v2_case, drive):
    for step in _steps(drive, v2_case):
        before = step["before"]
        n = step["stride"]
        (call,) = step["draft_calls"]
        assert call["forward_mode"] == "DRAFT_EXTEND_V2"
        assert call["input_ids"] == step["next_token_ids"]
        positions, slots, hidden = [], [], []
        for rid, root, length in zip(before["rids"], before["root"], before["seq_lens"],
                                     strict=True):
            positions += list(range(length, length + n))
            slots += before["allocated_rows"][rid][length:length + n]
            hidden += [[root, length, TARGET_TAG]] + [[0.0, 0.0, 0.0]] * (n - 1)
        assert call["positions"] == positions
        assert call["out_cache_loc"] == slots
        assert call["hidden_in"] == hidden


def test_request_finishing_and_kv_conservation(v2_case, drive):
    release, variant = v2_case
    report = drive(release, variant)["steps"]
    finished = [i for i, step in enumerate(report["steps"])
                if any(r["rid"] == "r0" and r["finished"] for r in step["reqs"])]
    assert finished, "r0 (max_new_tokens=3) never finished"
    step = report["steps"][finished[0]]
    assert len(next(r for r in step["reqs"] if r["rid"] == "r0")["output_ids"]) == 3
    assert "r0" not in step["rids_after_filter"]
    for step in report["steps"]:
        assert step["release_kv_cache"], "no release_kv_cache: over-allocation is not freed here"
        assert step["free_after_release"] + step["live_allocated"] == report["total_slots"]


def test_batch_at_threshold_runs_the_real_speculative_path(v2_case, drive):
    release, variant = v2_case
    report = drive(release, variant)["at_threshold"]
    assert report["spec_path_entered"]  # the hook returned None; the worker's body went on
    assert report["draft_batch_sizes"] == [report["threshold"]]
    assert report["target_calls"] == 0
    assert report["controller_spec_steps"] == 1


def test_spec_fallback_spec_cycle_through_the_real_speculative_path(v2_case, drive, toy):
    """T=2: r2 speculates alone through EAGLEWorkerV2's REAL speculative path (draft worker's
    draft, tree from the reference kernel, prepare_for_v2_verify, TARGET_VERIFY, sample,
    fill of the next root, _draft_extend_for_decode); r0 and r1 join through merge_batch and
    the batch of 3 runs fallback steps; then r2 speculates again from the FutureMap fields
    the fallback steps produced. Accepted drafts, streams and KV must come out exact."""
    release, variant = v2_case
    report = drive(release, variant)["cycle"]
    steps = report["steps"]
    modes = "".join("S" if s["mode"] == "TARGET_VERIFY" else "F" for s in steps)
    match = re.fullmatch(r"(S+)(F+)(S+)", modes)
    assert match, modes
    spec_before, fallback, spec_after = (len(g) for g in match.groups())
    assert fallback >= report["controller"]["min_dwell_steps"]
    assert report["controller"]["switches"] == 2
    assert report["controller"]["fallback_steps"] == fallback
    assert report["controller"]["spec_steps"] == spec_before + spec_after
    assert steps[spec_before]["before"]["rids"] == ["r2", "r0", "r1"]
    for i, step in enumerate(steps):
        if step["mode"] != "TARGET_VERIFY":
            assert step["accept_lens"] == [1] * len(step["before"]["rids"])
            continue
        (root,) = step["before"]["root"]
        accepted = toy.accepted_drafts(root, report["num_steps"])
        assert step["accept_lens"] == [accepted + 1]
        (emitted,) = step["emitted"].values()
        expected = toy.greedy_continuation(root, accepted + 1)
        assert emitted == (expected[: len(emitted)] if i == len(steps) - 1 else expected)
    assert any(s["accept_lens"][0] > 1 for s in steps[spec_before + fallback:])
    for rid, tokens in report["emitted_by_rid"].items():
        assert tokens == toy.greedy_continuation(report["first_tokens"][rid], len(tokens))
        assert len(tokens) + 1 == report["max_new_tokens"][rid]
    assert all(s["free_plus_allocated"] == report["total_slots"] for s in steps)
