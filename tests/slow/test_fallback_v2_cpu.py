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


# -- with CUDA-graph state: the width-1 draft-extend, the DECODE graphs, the warm-up ----------
# The *_graphs parts give the worlds what a GPU server has captured (harness/cpu_graphs.py):
# the release's REAL CudaGraphRunner / EAGLEDraftExtendCudaGraphRunner classes, constructed
# for real, with CPU "graphs" that run the toy model on the buffers the real replay() fills.

GRAPH_BS = [1, 2, 4]  # harness/drive.py GRAPH_BS: a batch of 3 replays the size-4 graph
GRAPHS_REPLAYED = ("0.5.10.post1", "0.5.12.post1")  # 0.5.5.post2: its draft-extend is eager
STRIDE_ON_RESULT = {"0.5.10.post1": False, "0.5.12.post1": True}
N_TOKEN_BACKEND, WIDTH1_BACKEND = "draft-extend-0", "draft-extend-1"  # cpu_graphs labels


def _graphs(drive: Any, case: Any, part: str) -> dict[str, Any]:
    release, variant = case
    return drive(release, variant)[part]


def test_graphs_are_captured_with_the_releases_own_runner_classes(v2_case, drive):
    release, _ = v2_case
    graphs = _graphs(drive, v2_case, "steps_graphs")["graphs"]
    log = "\n".join(graphs["log"])
    if release.version not in GRAPHS_REPLAYED:
        assert graphs["width1"] is None
        assert "never replays a graph" in graphs["note"]
        assert "width-1 draft-extend graphs not used" in log
        return
    width1 = graphs["width1"]
    assert width1["captured_width"] == 1  # the real runner's own width attribute
    assert width1["batch_sizes"] == GRAPH_BS
    assert width1["backend_widths"] == [0, 1] and width1["backend_is_new"]
    assert width1["cuda_graph_state"] == [4, 4]  # buffers for 4 requests x 1 token
    assert graphs["n_token_width"] == NUM_DRAFT_TOKENS
    decode = graphs["decode"]
    assert decode["capture_forward_mode"] == "DECODE" and decode["num_tokens_per_bs"] == 1
    assert decode["capture_hidden_mode"] == "FULL"  # no recapture at the first fallback step
    assert decode["captures"] == 1 and decode["backend"] == "target-decode"
    assert "captured target DECODE graphs for bs [1, 2, 4]" in log
    assert "captured width-1 draft-extend graphs for bs [1, 2, 4]" in log


def test_warmup_replays_padding_rows_through_the_real_replay(v2_case, drive):
    release, _ = v2_case
    graphs = _graphs(drive, v2_case, "steps_graphs")["graphs"]
    if release.version not in GRAPHS_REPLAYED:
        # 0.5.5.post2: neither graph kind exists on its CPU world (the real CudaGraphRunner
        # needs dp attention set up; its draft-extend is eager), so there is nothing to warm.
        assert graphs["decode"] is None and graphs["width1"] is None
        assert not any("warm-up replays" in entry for entry in graphs["log"])
        return
    (line,) = [entry for entry in graphs["log"] if "warm-up replays at start-up" in entry]
    # SGLang's own assign_req_to_token_pool_func (the reference kernel in place of Triton's) at
    # bs 1, 2, 4 with int32 and int64 offsets, the slots aligned and 8 bytes off, every range
    # empty; its write_req_to_token_pool_triton (the reference too) with the slots aligned and
    # 8 bytes off, writing nothing
    assert (
        "21/21 ok (clamp_position 1, DECODE 3, width-1 draft-extend 3, slot assignment 12, "
        "prefill slot write 2)"
    ) in line
    assert "raised" not in line and "stopped" not in line
    assert graphs["clamp_position_calls"] == [[2, 2, 2, 2]]  # int64 rows of the largest size
    decode_replays = graphs["decode"]["replays"]
    assert [(r["bs"], r["raw_bs"]) for r in decode_replays] == [(1, 1), (2, 2), (4, 4)]
    # The replays that compile first (DECODE 1 and 2, width-1 1 and 2: one of each Triton
    # specialisation), then the other sizes: the attention metadata count runs over both.
    for n, replay in zip((1, 2, 5), decode_replays, strict=True):
        bs = replay["bs"]
        # What the real replay_prepare put into the graph's buffers: padding rows only.
        assert replay["req_pool_indices"] == [0] * bs and replay["seq_lens"] == [1] * bs
        assert replay["out_cache_loc"] == [0] * bs and replay["input_ids"] == [0] * bs
        assert replay["attn_metadata_of"] == "target-decode"  # the DECODE graphs' own backend
        assert replay["attn_metadata_calls"] == n
    warmups = graphs["width1"]["replays"][:3]
    assert [(r["bs"], r["raw_bs"], r["width"]) for r in warmups] == [(1, 1, 1), (2, 2, 1),
                                                                     (4, 4, 1)]
    assert {r["attn_metadata_of"] for r in warmups} == {WIDTH1_BACKEND}
    (first_step,) = _graphs(drive, v2_case, "steps_graphs")["steps"][:1]
    for call in first_step["draft_calls"][:3]:  # the warm-up's draft forwards: slot 0 only
        assert set(call["out_cache_loc"]) == {0} and set(call["seq_lens"]) == {1}


def test_fallback_steps_replay_the_width1_draft_extend(v2_case, drive, toy):
    release, _ = v2_case
    report = _graphs(drive, v2_case, "steps_graphs")
    steps = report["steps"]
    assert len(steps) >= 3
    for step in steps:
        before = step["before"]
        bs = len(before["rids"])
        new = [toy.next_token(root) for root in before["root"]]
        call = step["draft_calls"][-1]  # step 0 begins with the warm-up's replays
        assert call["forward_mode"] == "DRAFT_EXTEND_V2"
        if release.version not in GRAPHS_REPLAYED:
            assert len(call["input_ids"]) == bs * NUM_DRAFT_TOKENS  # the N-token one
            continue
        rows = slice(0, bs)  # graph padding rows follow (3 requests replay the size-4 graph)
        assert call["input_ids"][rows] == new
        assert call["positions"][rows] == before["seq_lens"]
        assert call["seq_lens"][rows] == [n + 1 for n in before["seq_lens"]]
        assert call["out_cache_loc"][rows] == [
            before["allocated_rows"][rid][length]
            for rid, length in zip(before["rids"], before["seq_lens"], strict=True)
        ]
        assert call["hidden_in"][rows] == [
            [root, length, TARGET_TAG]
            for root, length in zip(before["root"], before["seq_lens"], strict=True)
        ]
        padded = len(call["input_ids"]) - bs
        assert call["out_cache_loc"][bs:] == [0] * padded  # padding writes slot 0 only
        # The next draft state is what the N-token draft-extend gives (its row i*N).
        assert step["next_topk_index"] == [[toy.draft_next_token(t)] for t in new]
        assert step["next_hidden"] == [
            [t, length, DRAFT_TAG] for t, length in zip(new, before["seq_lens"], strict=True)
        ]
        assert step["accept_lens"] == [1] * bs
        if STRIDE_ON_RESULT[release.version]:
            assert step["stride"] == 1 and step["next_token_ids"] == new
        else:
            assert step["stride"] == NUM_DRAFT_TOKENS
            assert step["next_token_ids"][::NUM_DRAFT_TOKENS] == new
        assert step["free_after_release"] + step["live_allocated"] == report["total_slots"]
    if release.version in GRAPHS_REPLAYED:
        replays = report["graphs"]["width1"]["replays"][3:]  # after the warm-up's three
        assert [r["raw_bs"] for r in replays] == [len(s["before"]["rids"]) for s in steps]
        # Its metadata went to the width-1 backend (0.5.10 reads the worker's attribute).
        assert {r["attn_metadata_of"] for r in replays} == {WIDTH1_BACKEND}
        assert report["graphs"]["n_token_replays"] == []
        assert report["graphs"]["width1"]["broken"] == ""


def test_cycle_resumes_exactly_after_width1_fallback_steps(v2_case, drive, toy):
    """The spec -> fallback -> spec cycle with graphs: fallback steps on the width-1
    draft-extend, speculative steps on the N-token one; acceptance after the fallback stretch
    must be exactly what the toy draft gets right (a stale draft state would show)."""
    release, _ = v2_case
    report = _graphs(drive, v2_case, "cycle_graphs")
    steps = report["steps"]
    modes = "".join("S" if s["mode"] == "TARGET_VERIFY" else "F" for s in steps)
    match = re.fullmatch(r"(S+)(F+)(S+)", modes)
    assert match, modes
    spec_before, fallback, spec_after = (len(g) for g in match.groups())
    for step in steps:
        if step["mode"] != "TARGET_VERIFY":
            assert step["accept_lens"] == [1] * len(step["before"]["rids"])
            continue
        (root,) = step["before"]["root"]
        assert step["accept_lens"] == [toy.accepted_drafts(root, report["num_steps"]) + 1]
    assert any(s["accept_lens"][0] > 1 for s in steps[spec_before + fallback:])
    for rid, tokens in report["emitted_by_rid"].items():
        assert tokens == toy.greedy_continuation(report["first_tokens"][rid], len(tokens))
        assert len(tokens) + 1 == report["max_new_tokens"][rid]
    assert all(s["free_plus_allocated"] == report["total_slots"] for s in steps)
    graphs = report["graphs"]
    if release.version not in GRAPHS_REPLAYED:
        assert graphs["width1"] is None
        return
    fallback_widths = {s["stride"] for s in steps if s["mode"] != "TARGET_VERIFY"}
    assert fallback_widths == ({1} if STRIDE_ON_RESULT[release.version] else {NUM_DRAFT_TOKENS})
    width1 = graphs["width1"]["replays"][3:]
    assert len(width1) == fallback and all(r["width"] == 1 for r in width1)
    n_token = graphs["n_token_replays"]
    assert len(n_token) == spec_before + spec_after
    assert all(r["width"] == NUM_DRAFT_TOKENS for r in n_token)
    assert {r["attn_metadata_of"] for r in n_token} == {N_TOKEN_BACKEND}
    assert {r["attn_metadata_of"] for r in width1} == {WIDTH1_BACKEND}
