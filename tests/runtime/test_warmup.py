"""Warm-up replays at start-up: each graph a fallback step uses is replayed once, bounded.

The DECODE graph runner stand-in records its replays (and what the target model runner held
during each); the width-1 draft-extend runner stand-in records its replays and the draft
worker's width during each. SGLang's ``clamp_position`` is a stand-in in a stand-in
``forward_batch_info`` module.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
from tests.runtime.test_decode_graphs import RecordingGraphRunner, graph_world

pytestmark = pytest.mark.torch

DECODE_BS = [1, 2, 4, 8, 16, 24, 32, 48, 64]  # test_decode_graphs.make_runner's sizes
BATCH_FIELDS = (  # of the stand-in ForwardBatch dataclass, besides forward_mode / batch_size
    "input_ids",
    "req_pool_indices",
    "seq_lens",
    "seq_lens_cpu",
    "seq_lens_sum",
    "out_cache_loc",
    "positions",
    "num_token_non_padded",
    "capture_hidden_mode",
    "spec_info",
    "mrope_positions",
)


class ReplayingGraphRunner(RecordingGraphRunner):
    """A DECODE graph runner whose replays are recorded (``fail_replay`` makes them raise)."""

    fail_replay: Exception | None = None

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        self.model_runner = model_runner
        self.replays: list[dict[str, Any]] = []

    def replay(self, forward_batch: Any) -> None:
        if self.fail_replay is not None:
            raise self.fail_replay
        runner = self.model_runner
        self.replays.append(
            {
                "batch": forward_batch,
                "graph_attr": getattr(runner, "graph_runner", None)
                or getattr(runner, "cuda_graph_runner", None),
                "attn_backend": runner.attn_backend,
            }
        )


@pytest.fixture
def forward_batch_info(monkeypatch):
    """A stand-in sglang forward_batch_info module: ForwardMode and a recording clamp_position."""
    from tests.runtime.standins import ForwardMode

    calls: list[Any] = []
    module = types.ModuleType(dyn.FORWARD_BATCH_MODULE)
    module.ForwardMode = ForwardMode
    module.ForwardBatch = dataclasses.make_dataclass(
        "ForwardBatch",
        [
            ("forward_mode", Any),
            ("batch_size", int),
            *((name, Any, dataclasses.field(default=None)) for name in BATCH_FIELDS),
            ("lora_ids", list, dataclasses.field(default_factory=list)),
        ],
    )
    module.clamp_position = lambda seq_lens: calls.append(seq_lens.clone()) or seq_lens - 1
    monkeypatch.setitem(sys.modules, dyn.FORWARD_BATCH_MODULE, module)
    return calls


def warm_world(version: str, variant: str, **kwargs: Any) -> Any:
    """DECODE graphs for the target and, for v2, SGLang's N-token draft-extend graphs."""
    world = graph_world(
        version,
        variant,
        speculative_num_steps=3,
        speculative_num_draft_tokens=4,
        cuda_graph_bs=[2, 8, 16, 24],
        **kwargs,
    )
    runner = world.worker.target_worker.model_runner
    runner.device = "cpu"
    setattr(runner, world.shape.graph_attr, ReplayingGraphRunner.__new__(ReplayingGraphRunner))
    if variant == "v2":
        draft = world.worker.draft_worker
        draft.cuda_graph_runner_for_draft_extend = "n-token-graphs"
        draft.draft_extend_attn_backend = "n-token-backend"
    return world


def step(world: Any, variant: str) -> Any:
    if variant == "v1":
        return dyn.maybe_fallback_v1(world.worker, world.batch)
    return dyn.maybe_fallback_v2(world.worker, world.batch)


def warmup_lines(caplog: Any) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "warm-up replays at start-up" in r.getMessage()]


# -- order and bounds -----------------------------------------------------------------------


def test_warmup_order_replays_one_size_of_each_specialisation_first():
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 128, 256, 512]
    assert dyn.warmup_order(sizes) == ([1, 2, 16, 512], [4, 8, 24, 32, 40, 48, 64, 128, 256])
    assert dyn.warmup_order([24, 16, 24]) == ([16, 24], [])
    # 2 opens the class of 3 (1 is a class of its own), 257 the one above 256 (512's block)
    assert dyn.warmup_order([2, 3, 16, 257, 512]) == ([2, 16, 257, 512], [3])


def test_run_warmup_stops_at_the_budget_before_the_next_replay():
    now = [0.0]
    ran: list[int] = []

    def replay(i: int) -> None:
        ran.append(i)
        now[0] += 4.0  # each replay takes 4 s of the clock

    flags: list[bool] = []

    def stop_together(flag: bool) -> bool:
        flags.append(flag)
        return flag

    replays = [("DECODE", lambda i=i: replay(i)) for i in range(5)]
    done, errors, why = dyn.run_warmup(replays, 10.0, stop_together, clock=lambda: now[0])
    assert (done, ran, errors) == (3, [0, 1, 2], [])  # 12 s > 10 s: the fourth never starts
    assert why == "the 10s budget ran out"
    assert flags == [False, False, False, True]  # every rank is asked before each replay


def test_run_warmup_reports_a_replay_that_raises_and_goes_on():
    def boom() -> None:
        raise RuntimeError("no kernel image")

    ran: list[str] = []
    replays = [("a", lambda: ran.append("a")), ("DECODE", boom), ("c", lambda: ran.append("c"))]
    done, errors, why = dyn.run_warmup(replays, 10.0, lambda flag: flag, clock=lambda: 0.0)
    assert (done, ran, why) == (2, ["a", "c"], "")
    assert errors == ["a DECODE replay raised RuntimeError: no kernel image"]


def test_run_warmup_stops_where_another_rank_stops():
    answers = iter([False, True])  # this rank would go on; another one stops
    replays = [("a", lambda: None)] * 3
    done, errors, why = dyn.run_warmup(replays, 10.0, lambda _: next(answers), lambda: 0.0)
    assert (done, errors, why) == (1, [], "another TP rank stopped")


# -- at start-up ----------------------------------------------------------------------------


def test_start_up_replays_every_fallback_graph_once_and_logs_one_line(forward_batch_info, caplog):
    import torch

    from tests.runtime.standins import CaptureHiddenMode

    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    runner = world.worker.target_worker.model_runner
    verify_graphs, verify_backend = runner.graph_runner, runner.attn_backend

    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v2") is not None
        world.batch = world._make_batch(4, 20, 100)
        assert step(world, "v2") is not None  # no second warm-up: once per process

    adapter = dyn._adapters[type(world.worker)]
    decode = adapter.decode_graphs.runner
    # clamp_position (the DECODE ForwardBatch's positions): once, int64, more than one row.
    (seq_lens,) = forward_batch_info
    assert seq_lens.dtype == torch.int64 and seq_lens.shape == (max(DECODE_BS),)
    # One replay per captured DECODE size, in warm-up order, padding rows only.
    firsts, rest = dyn.warmup_order(DECODE_BS)
    assert [r["batch"].batch_size for r in decode.replays] == firsts + rest
    for replay in decode.replays:
        batch = replay["batch"]
        bs = batch.batch_size
        assert batch.forward_mode.is_decode() and batch.spec_info is None
        assert batch.capture_hidden_mode == CaptureHiddenMode.FULL
        assert batch.out_cache_loc.tolist() == [0] * bs  # SGLang's padding slot
        assert batch.req_pool_indices.tolist() == [0] * bs
        assert batch.seq_lens.tolist() == [1] * bs and batch.seq_lens_sum == bs
        assert batch.seq_lens_cpu.device.type == "cpu"
        assert type(batch).__name__ == "ForwardBatch"  # SGLang's own class
        assert batch.mrope_positions is None and batch.lora_ids == []  # fields left at defaults
        assert replay["graph_attr"] is decode  # replayed as a fallback step would
        assert replay["attn_backend"] is adapter.decode_graphs.attn_backend
    assert runner.graph_runner is verify_graphs and runner.attn_backend is verify_backend
    # The width-1 draft-extend graphs (bs >= resume floor 1: every size), at width 1.
    width1 = adapter.draft_extend_width1.runner
    firsts, rest = dyn.warmup_order([2, 8, 16, 24])
    assert [b.batch_size for b, _ in width1.replays] == firsts + rest
    for batch, width in width1.replays:
        assert width == 1
        assert batch.forward_mode == "DRAFT_EXTEND_V2"
        assert batch.out_cache_loc.tolist() == [0] * batch.batch_size
        assert batch.spec_info.hidden_states is None
    assert world.worker.draft_worker.speculative_num_draft_tokens == 4
    (line,) = warmup_lines(caplog)
    assert line.levelno == logging.INFO
    total = 1 + len(DECODE_BS) + 4
    assert f"warm-up replays at start-up: {total}/{total} ok (clamp_position 1, DECODE 9, " in (
        line.getMessage()
    )
    assert "width-1 draft-extend 4) in " in line.getMessage()


def test_the_draft_kv_write_warms_up_at_the_smallest_and_largest_size(
    forward_batch_info, monkeypatch, caplog
):
    """Its eager kernels (a JIT KV store on some releases) compile at start-up, on SGLang's
    padding slot."""
    from tests.runtime.standins import give_draft_model

    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "1")
    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    pool = give_draft_model(world).token_to_kv_pool
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v2") is not None
    assert [loc.tolist() for loc in pool.writes[:2]] == [[0], [0] * max(DECODE_BS)]
    (line,) = warmup_lines(caplog)
    assert "width-1 draft-extend 4, draft KV write 2) in " in line.getMessage()


def test_with_its_graphs_the_draft_kv_write_captures_every_size_at_start_up(
    forward_batch_info, monkeypatch, caplog
):
    """So no fallback step is held up by a capture; each writes SGLang's padding slot."""
    from tests.runtime.standins import FakeCapture, give_draft_model

    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "1")
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_GRAPHS_ENV, "1")
    capture = FakeCapture()
    monkeypatch.setattr(dyn, "graph_capture", lambda device: capture)
    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    pool = give_draft_model(world).token_to_kv_pool
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v2") is not None
    assert capture.captured == DECODE_BS
    warm_up_writes = pool.writes[: 2 * len(DECODE_BS)]  # each capture's run, then its replay
    assert all(loc.tolist() == [0] * len(loc) for loc in warm_up_writes)
    (line,) = warmup_lines(caplog)
    assert f"draft KV write {len(DECODE_BS)}) in " in line.getMessage()


def test_the_draft_kv_write_captures_come_before_the_sizes_already_compiled(
    forward_batch_info, monkeypatch
):
    """One size of each specialisation compiles the kernels; then every capture of the write
    (a size left out would be captured inside a fallback step); then the other sizes, which a
    budget that runs out skips at the least cost."""
    from tests.runtime.standins import FakeCapture, give_draft_model

    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "1")
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_GRAPHS_ENV, "1")
    monkeypatch.setattr(dyn, "graph_capture", lambda device: FakeCapture())
    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    give_draft_model(world)
    assert step(world, "v2") is not None
    adapter = dyn._adapters[type(world.worker)]
    kinds = [kind for kind, _ in dyn._warmup_replays(adapter, world.worker)]
    assert kinds == [
        "clamp_position",
        *["DECODE"] * 3,  # 1, 2, 16
        *["width-1 draft-extend"] * 2,  # 2, 16 of [2, 8, 16, 24]
        *["draft KV write"] * len(DECODE_BS),
        *["DECODE"] * (len(DECODE_BS) - 3),
        *["width-1 draft-extend"] * 2,
    ]


def slot_assignment_module(monkeypatch: Any, name: str) -> list[tuple[Any, ...]]:
    """A stand-in SGLang module ``name`` whose ``assign_req_to_token_pool_func`` runs the slow
    tier's CPU reference of the kernel (row i's slots start..end of its request-pool row take
    the next end - start entries of out_cache_loc). It records each call's arguments."""
    from tests.slow.harness.ref_kernels import assign_req_to_token_pool

    calls: list[tuple[Any, ...]] = []

    def assign(req_pool_indices, req_to_token, start, end, out_cache_loc, batch_size):
        calls.append((req_pool_indices, req_to_token, start, end, out_cache_loc, batch_size))
        assign_req_to_token_pool[(batch_size,)](
            req_pool_indices, req_to_token, start, end, out_cache_loc
        )

    module = types.ModuleType(name)
    module.assign_req_to_token_pool_func = assign
    monkeypatch.setitem(sys.modules, name, module)
    return calls


@pytest.mark.parametrize(
    "module", dyn.SLOT_ASSIGN_MODULES, ids=["0.5.16+", "0.5.13-0.5.15", "<=0.5.12"]
)
def test_sglangs_slot_assignment_compiles_at_every_power_of_two_and_assigns_nothing(
    forward_batch_info, monkeypatch, caplog, module
):
    """Its Triton kernel's block constant is the batch size's next power of two (a compile at
    the first batch of each after a fresh start): each power up to the largest batch, for
    int32 offsets (v2's allocation) and int64 (v1's seq_lens), with the slots 16-byte aligned
    and 8 bytes off (a view into the allocator's free list), every row's range empty."""
    import torch

    calls = slot_assignment_module(monkeypatch, module)
    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    before = world.req_to_token.clone()
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v2") is not None
    # graphs up to 64, max_running_requests 48: the largest batch is 64
    powers = [1, 2, 4, 8, 16, 32, 64]
    assert [(c[5], c[2].dtype, c[4].data_ptr() % 16) for c in calls] == [
        (bs, dtype, misaligned)
        for misaligned in (0, 8)
        for dtype in (torch.int32, torch.int64)
        for bs in powers
    ]
    for rows, req_to_token, start, end, out_cache_loc, bs in calls:
        assert req_to_token is world.worker.req_to_token_pool.req_to_token
        assert rows.tolist() == [0] * bs and rows.dtype == torch.int64
        assert start.tolist() == end.tolist() == [0] * bs
        assert out_cache_loc.dtype == torch.int64 and len(out_cache_loc) == bs
    assert torch.equal(world.req_to_token, before)  # nothing assigned
    (line,) = warmup_lines(caplog)
    assert f"slot assignment {4 * len(powers)}) in " in line.getMessage()


def test_v1_warms_up_the_slot_assignment_too(forward_batch_info, monkeypatch, caplog):
    """SGLang's EAGLEWorker holds the pool as its own model runner does (stand-in: neither)."""
    calls = slot_assignment_module(monkeypatch, dyn.SLOT_ASSIGN_MODULES[2])
    world = warm_world("0.5.12.post1", "v1", batch_size=4)
    world.worker.target_worker.model_runner.req_to_token_pool = types.SimpleNamespace(
        req_to_token=world.req_to_token
    )
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v1") is not None
    assert len(calls) == 28 and all(c[1] is world.req_to_token for c in calls)
    (line,) = warmup_lines(caplog)
    assert "38/38 ok (clamp_position 1, DECODE 9, slot assignment 28)" in line.getMessage()


def test_without_a_request_pool_to_hand_it_the_rest_warms_up(
    forward_batch_info, monkeypatch, caplog
):
    calls = slot_assignment_module(monkeypatch, dyn.SLOT_ASSIGN_MODULES[2])
    world = warm_world("0.5.12.post1", "v1", batch_size=4)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v1") is not None
    assert calls == []
    (line,) = warmup_lines(caplog)
    assert "10/10 ok (clamp_position 1, DECODE 9) in " in line.getMessage()


def test_slot_assignment_covers_max_running_requests_above_the_largest_graph(
    forward_batch_info, monkeypatch
):
    calls = slot_assignment_module(monkeypatch, dyn.SLOT_ASSIGN_MODULES[0])
    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    world.worker.server_args.max_running_requests = 100  # next power of two: 128
    assert step(world, "v2") is not None
    assert sorted({c[5] for c in calls}) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_a_release_without_the_slot_assignment_kernel_warms_up_the_rest(
    forward_batch_info, monkeypatch
):
    monkeypatch.setitem(sys.modules, dyn.SLOT_ASSIGN_MODULES[0], types.ModuleType("allocation"))
    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    assert step(world, "v2") is not None
    adapter = dyn._adapters[type(world.worker)]
    kinds = {kind for kind, _ in dyn._warmup_replays(adapter, world.worker)}
    assert kinds == {"clamp_position", "DECODE", "width-1 draft-extend"}


def prefill_slot_write_module(
    monkeypatch: Any, name: str, params: list[str] | None = None
) -> list[tuple[Any, ...]]:
    """A stand-in SGLang module ``name`` whose ``write_req_to_token_pool_triton`` runs the slow
    tier's CPU reference of the kernel (with its parameter names, or ``params``). It records
    each launch's grid and arguments."""
    from tests.slow.harness.ref_kernels import NamedGridKernel, _write_req_to_token_pool

    calls: list[tuple[Any, ...]] = []

    def record(grid: tuple[int, ...], **named: Any) -> None:
        calls.append((grid, *named.values()))
        _write_req_to_token_pool(grid, **named)

    kernel = NamedGridKernel(record, params or list(dyn.PREFILL_SLOT_WRITE_PARAMS))
    module = types.ModuleType(name)
    module.write_req_to_token_pool_triton = kernel
    monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_the_reference_prefill_slot_write_records_prefixes_and_new_slots():
    """The reference the warm-up tests run: request 0 takes its 2 prefix slots (read at the
    prefix tensor's address) and 3 new ones; request 1 no prefix and the next 2."""
    import torch

    from tests.slow.harness.ref_kernels import NamedGridKernel, _write_req_to_token_pool

    write_req_to_token_pool_triton = NamedGridKernel(
        _write_req_to_token_pool, list(dyn.PREFILL_SLOT_WRITE_PARAMS)
    )
    req_to_token = torch.zeros((4, 8), dtype=torch.int32)
    prefix = torch.tensor([40, 41], dtype=torch.int64)
    pointers = torch.tensor([prefix.data_ptr(), 0], dtype=torch.uint64)
    locs = torch.tensor([7, 8, 9, 5, 6], dtype=torch.int64)
    longs = {"dtype": torch.int64}
    write_req_to_token_pool_triton[(2,)](
        req_to_token, torch.tensor([2, 3], **longs), pointers, torch.tensor([2, 0], **longs),
        torch.tensor([5, 2], **longs), torch.tensor([3, 2], **longs), locs, 8,
    )
    assert req_to_token[2].tolist() == [40, 41, 7, 8, 9, 0, 0, 0]
    assert req_to_token[3].tolist() == [5, 6, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    "module",
    dyn.PREFILL_SLOT_WRITE_MODULES,
    ids=["0.5.16+", "0.5.13-0.5.15", "0.5.3.post3-0.5.12", "<=0.5.3.post1"],
)
def test_sglangs_prefill_slot_write_compiles_for_both_alignments_and_writes_nothing(
    forward_batch_info, monkeypatch, caplog, module
):
    """Every prefill runs it; Triton compiles one variant per pointer alignment, and the slots
    are a view into the allocator's free list: one call with the slots 16-byte aligned, one
    8 bytes off, each for one request with no prefix and no new token, with the dtypes SGLang's
    prefill passes and its request pool's row stride."""
    import torch

    calls = prefill_slot_write_module(monkeypatch, module)
    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    before = world.req_to_token.clone()
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v2") is not None
    assert [c[7].data_ptr() % 16 for c in calls] == [0, 8]
    for grid, req_to_token, rows, prefixes, pre, seq, extend, slots, stride in calls:
        assert grid == (1,)
        assert req_to_token is world.worker.req_to_token_pool.req_to_token
        assert stride == req_to_token.shape[1]
        assert prefixes.dtype == torch.uint64
        for t in (rows, pre, seq, extend, slots):
            assert t.dtype == torch.int64 and t.tolist() == [0]
    assert torch.equal(world.req_to_token, before)  # nothing written
    (line,) = warmup_lines(caplog)
    assert ", prefill slot write 2) in " in line.getMessage()
    assert "raised" not in line.getMessage()


def test_a_prefill_slot_write_of_other_parameters_is_left_to_its_first_use(
    forward_batch_info, monkeypatch
):
    """0.4.x's kernel has no prefix pointers: the warm-up does not guess at its arguments."""
    params = ["req_to_token_ptr", "req_pool_indices", "pre_lens", "seq_lens", "extend_lens",
              "out_cache_loc", "req_to_token_ptr_stride"]
    calls = prefill_slot_write_module(monkeypatch, dyn.PREFILL_SLOT_WRITE_MODULES[3], params)
    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    assert step(world, "v2") is not None
    adapter = dyn._adapters[type(world.worker)]
    kinds = {kind for kind, _ in dyn._warmup_replays(adapter, world.worker)}
    assert "prefill slot write" not in kinds and calls == []


def test_v1_warms_up_its_decode_graphs(forward_batch_info, caplog):
    world = warm_world("0.5.12.post1", "v1", batch_size=4)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v1") is not None
    decode = dyn._adapters[type(world.worker)].decode_graphs.runner
    assert len(decode.replays) == len(DECODE_BS)
    (line,) = warmup_lines(caplog)
    assert "10/10 ok (clamp_position 1, DECODE 9)" in line.getMessage()


def test_env_switch_turns_the_warmup_off(forward_batch_info, monkeypatch, caplog):
    monkeypatch.setenv(dyn.WARMUP_ENV, "0")
    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v2") is not None
    adapter = dyn._adapters[type(world.worker)]
    assert adapter.decode_graphs.runner.replays == []
    assert adapter.draft_extend_width1.runner.replays == []
    assert forward_batch_info == [] and warmup_lines(caplog) == []


def test_spent_budget_stops_the_warmup_with_one_warning(forward_batch_info, monkeypatch, caplog):
    monkeypatch.setenv(dyn.WARMUP_BUDGET_ENV, "0")
    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v2") is not None
    (line,) = warmup_lines(caplog)
    assert line.levelno == logging.WARNING
    assert "0/14 ok" in line.getMessage()
    assert "stopped early: the 0s budget ran out" in line.getMessage()
    assert dyn._adapters[type(world.worker)].decode_graphs.runner.replays == []


def test_failing_replays_are_reported_and_the_server_goes_on(forward_batch_info, caplog):
    ReplayingGraphRunner.fail_replay = RuntimeError("illegal instruction")
    try:
        world = warm_world("0.5.12.post1", "v2", batch_size=4)
        with caplog.at_level(logging.INFO, logger=dyn.__name__):
            result = step(world, "v2")
    finally:
        ReplayingGraphRunner.fail_replay = None
    assert result is not None
    adapter = dyn._adapters[type(world.worker)]
    # The DECODE graphs stay in use for real steps; the other replays still ran.
    assert world.recorder.get("target_forward")["graph"] is adapter.decode_graphs.runner
    assert len(adapter.draft_extend_width1.runner.replays) == 4
    (line,) = warmup_lines(caplog)
    assert line.levelno == logging.WARNING
    assert "5/14 ok (clamp_position 1, DECODE 9, width-1 draft-extend 4)" in line.getMessage()
    assert "9 raised, the first: a DECODE replay raised RuntimeError: illegal instruction" in (
        line.getMessage()
    )


@pytest.mark.parametrize(
    ("value", "proven", "on"),
    [("1", False, True), ("0", True, False), (None, True, True), (None, False, False),
     (" 1 ", False, True), ("yes", False, False)],
)
def test_a_lever_runs_where_it_is_proven_unless_the_variable_says(monkeypatch, value, proven, on):
    if value is None:
        monkeypatch.delenv("DYNSPEC_SOME_LEVER", raising=False)
    else:
        monkeypatch.setenv("DYNSPEC_SOME_LEVER", value)
    assert dyn.lever_on("DYNSPEC_SOME_LEVER", proven) is on


class _ExecuteLayout(ReplayingGraphRunner):
    """A DECODE graph runner of SGLang 0.5.14+'s layout: execute(), no replay()."""

    replay = None  # type: ignore[assignment]

    def execute(self, forward_batch: Any) -> None:
        ReplayingGraphRunner.replay(self, forward_batch)


@pytest.mark.parametrize(
    ("layout", "release", "warms_up"),
    [
        ("replay", None, True),
        ("execute", None, False),
        ("execute", "0.5.16", False),
        ("execute", "0.5.19", False),
        ("execute", "0.5.17", True),
    ],
)
def test_by_default_the_levers_run_only_where_they_ran_on_a_gpu(
    forward_batch_info, monkeypatch, caplog, layout, release, warms_up
):
    """Unset, both levers run on SGLang <= 0.5.13 (replay(): run on an H200 with 0.5.12.post1,
    greedy outputs checked) and, of 0.5.14+'s execute() layout, only on 0.5.17 (run there)."""
    from tests.runtime.standins import DraftExtendGraphRunner, package_says_release

    monkeypatch.delenv(dyn.DRAFT_EXTEND_WIDTH1_ENV)
    monkeypatch.delenv(dyn.WARMUP_ENV)
    world = warm_world("0.5.12.post1", "v2", batch_size=4)
    if release is not None:
        package_says_release(monkeypatch, world, release)
    if layout == "execute":
        runner = world.worker.target_worker.model_runner
        setattr(runner, world.shape.graph_attr, _ExecuteLayout.__new__(_ExecuteLayout))

        class ExecuteExtend(DraftExtendGraphRunner):
            replay = None  # type: ignore[assignment]

        ExecuteExtend.world = world
        world.module.EAGLEDraftExtendCudaGraphRunner = ExecuteExtend

    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v2") is not None

    adapter = dyn._adapters[type(world.worker)]
    assert (adapter.draft_extend_width1 is not None) is warms_up
    assert (len(adapter.decode_graphs.runner.replays) > 0) is warms_up
    assert (len(warmup_lines(caplog)) == 1) is warms_up
    if not warms_up:
        assert adapter.draft_extend_width1_note.startswith(f"off ({dyn.DRAFT_EXTEND_WIDTH1_ENV}=1")


# -- the replay method of each release ------------------------------------------------------


class _ReplayRunner:  # <= 0.5.13
    def replay(self, forward_batch: Any) -> str:
        return f"replay {forward_batch.batch_size}"


class _ExecuteRunner:  # 0.5.14+
    def execute(self, forward_batch: Any) -> str:
        return f"execute {forward_batch.batch_size}"


class _SelectIndexRunner:  # 0.5.23's draft-extend runner
    def execute(self, forward_batch: Any, select_index: Any) -> tuple[str, list[int]]:
        return "execute", select_index.tolist()


@pytest.mark.parametrize(
    ("runner", "expected"),
    [
        (_ReplayRunner(), "replay 3"),
        (_ExecuteRunner(), "execute 3"),
        (_SelectIndexRunner(), ("execute", [0, 1, 2])),  # one token per request: row i
    ],
)
def test_warmup_replays_through_the_method_the_release_has(runner, expected):
    import torch

    batch = types.SimpleNamespace(batch_size=3, seq_lens=torch.ones(3, dtype=torch.int64))
    assert dyn.replay_graph(runner, batch, 3) == expected
