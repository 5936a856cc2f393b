"""The width-1 draft-extend of v2 fallback steps, against stand-ins shaped like each release.

The stand-in graph runner and backend factory (``standins.DraftExtendGraphRunner`` /
``DraftBackendFactory``) record what SGLang's own classes would see while they capture; the
stand-in ``_draft_extend_for_decode`` reads its width from the draft worker's attributes, as
SGLang's does, and rebinds the batch fields SGLang's prepare step rebinds.
"""

from __future__ import annotations

import copy
import logging
import types
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
from tests.runtime.gloo_ranks import last_lines_of_ranks

pytestmark = pytest.mark.torch

N = 4  # speculative_num_draft_tokens of the stand-in server
WIDTH1_RELEASES = ["0.5.10.post1", "0.5.12.post1", "0.5.13.post1"]
STRIDE_ON_RESULT = {"0.5.10.post1": False, "0.5.12.post1": True, "0.5.13.post1": True}
GRAPH_BS = [1, 2, 4, 8, 16, 24, 32]


@pytest.fixture(scope="module")
def shapes():
    from tests.runtime.standins import read_shape

    return {v: read_shape(v, "v2") for v in WIDTH1_RELEASES}


def world_with_graphs(shapes: Any, version: str, threshold: int = 2, **kwargs: Any) -> Any:
    """A v2 world whose draft worker has SGLang's N-token draft-extend graphs captured."""
    from tests.runtime.standins import World

    world = World(
        shapes[version],
        threshold=threshold,
        speculative_num_steps=3,
        speculative_num_draft_tokens=N,
        cuda_graph_bs=list(GRAPH_BS),
        **kwargs,
    )
    draft = world.worker.draft_worker
    draft.cuda_graph_runner_for_draft_extend = "n-token-graphs"
    draft.draft_extend_attn_backend = "n-token-backend"
    return world


def run(world: Any) -> Any:
    return dyn.maybe_fallback_v2(world.worker, world.batch)


def extends(world: Any) -> list[dict[str, Any]]:
    return [data for name, data in world.recorder.events if name == "draft_extend_v2"]


def assert_draft_worker_restored(world: Any) -> None:
    draft = world.worker.draft_worker
    assert draft.speculative_num_draft_tokens == N
    assert draft.speculative_num_steps == 3
    assert draft.cuda_graph_runner_for_draft_extend == "n-token-graphs"
    assert draft.draft_extend_attn_backend == "n-token-backend"


# -- capture --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", WIDTH1_RELEASES)
def test_capture_sees_the_width1_state_on_a_new_backend(shapes, version, caplog):
    world = world_with_graphs(shapes, version, threshold=20, batch_size=3)  # resume at 18
    draft = world.worker.draft_worker
    # A draft runner with server args of its own: both objects must say width 1.
    draft.draft_runner.server_args = copy.copy(world.server_args)

    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        run(world)

    (runner,) = world.extend_captures
    (backend,) = world.draft_backends_made
    seen = runner.seen
    assert (seen["worker_width"], seen["worker_steps"]) == (1, 0)
    assert (seen["args_width"], seen["args_steps"]) == (1, 0)
    assert seen["steps_kwarg"] == 0
    # A second backend, built while the server args said width 1, handed to the runner both
    # ways (0.5.12+ keyword; older runners read the worker's attribute).
    assert seen["backend"] is backend and seen["worker_backend"] is backend
    assert (backend.speculative_num_steps, backend.num_draft_tokens) == (0, 1)
    assert seen["cuda_graph_bs"] == [24, 32]  # only the sizes a fallback step can have
    adapter = dyn._adapters[type(world.worker)]
    assert adapter.draft_extend_width1.runner is runner
    assert adapter.draft_extend_width1.batch_sizes == [24, 32]
    assert "captured width-1 draft-extend graphs for bs [24, 32]" in caplog.text
    assert_draft_worker_restored(world)
    for args in (world.server_args, draft.draft_runner.server_args):
        assert (args.speculative_num_draft_tokens, args.speculative_num_steps) == (N, 3)
        assert args.cuda_graph_bs == GRAPH_BS


def test_capture_on_0517_sets_the_widths_its_backends_read_from_get_spec(shapes, caplog):
    """0.5.17's triton backend reads its widths from ``get_spec()``, not from the server args:
    a width-1 graph on a backend still sized for N tokens made an illegal memory access on an
    H200. The config bag says width 1 while the backend is built and is restored after."""
    from tests.runtime.standins import read_shape

    release = {"0.5.17": read_shape("0.5.17", "v2")}
    world = world_with_graphs(release, "0.5.17", threshold=20, batch_size=3)
    assert world.module.get_spec() is world.spec_config  # 0.5.17 has it

    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        run(world)

    (backend,) = world.draft_backends_made
    assert (backend.speculative_num_steps, backend.num_draft_tokens) == (0, 1)
    (runner,) = world.extend_captures
    assert dyn._adapters[type(world.worker)].draft_extend_width1.runner is runner
    spec = world.spec_config
    assert (spec.speculative_num_steps, spec.speculative_num_draft_tokens) == (3, N)
    assert "captured width-1 draft-extend graphs" in caplog.text


def test_a_backend_sized_for_n_tokens_is_refused_before_anything_is_captured(shapes, caplog):
    world = world_with_graphs(shapes, "0.5.12.post1", batch_size=3)
    real_factory = world.module.DraftBackendFactory

    class StaleWidths(real_factory):  # reads its widths from somewhere the capture did not set
        def create_draft_extend_backend(self):
            backend = super().create_draft_extend_backend()
            backend.num_draft_tokens = N
            return backend

    world.module.DraftBackendFactory = StaleWidths

    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        run(world)

    assert world.extend_captures == []  # no graph was captured on the N-token backend
    assert "the new attention backend has num_draft_tokens=4" in caplog.text
    assert [e["width"] for e in extends(world)] == [N]
    assert_draft_worker_restored(world)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("capture_raises", "capture failed: RuntimeError: CUDA out of memory"),
        ("wrong_width", "the graph runner captured 4 tokens per request, not 1"),
        ("no_graphs", "without a CUDA graph"),
        ("backend_shows_no_width", "Opaque shows no draft-extend width to check"),
        ("another_rank_failed", "another TP rank could not capture them"),
    ],
)
def test_no_width1_graphs_keeps_the_n_token_draft_extend(shapes, change, reason, caplog):
    from tests.runtime.standins import DraftExtendGraphRunner

    world = world_with_graphs(shapes, "0.5.12.post1", batch_size=3)
    if change == "capture_raises":
        world.fail_extend_capture = RuntimeError("CUDA out of memory")
    elif change == "wrong_width":

        class FixedWidth(DraftExtendGraphRunner):
            def __init__(self, eagle_worker: Any, **kwargs: Any) -> None:
                super().__init__(eagle_worker, **kwargs)
                self.num_tokens_per_bs = N

        FixedWidth.world = world
        world.module.EAGLEDraftExtendCudaGraphRunner = FixedWidth
    elif change == "backend_shows_no_width":

        class Opaque:  # a backend that keeps its widths to itself: nothing to check
            pass

        world.module.DraftBackendFactory.create_draft_extend_backend = lambda self: Opaque()
    elif change == "another_rank_failed":
        # TP 2 without a CPU group to agree over: no rank may use what it cannot agree on.
        world.worker.target_worker.model_runner.tp_group = types.SimpleNamespace(world_size=2)
    else:
        world.worker.draft_worker.cuda_graph_runner_for_draft_extend = None

    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        result = run(world)
        world.batch = world._make_batch(3, 10, 100)
        run(world)

    assert [e["width"] for e in extends(world)] == [N, N]
    assert result.next_token_ids.shape == (3 * N,)
    assert result.speculative_num_draft_tokens == N
    warnings = [r.getMessage() for r in caplog.records if "width-1" in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0], warnings
    if change != "no_graphs":
        assert_draft_worker_restored(world)
    assert world.server_args.speculative_num_draft_tokens == N
    assert world.server_args.cuda_graph_bs == GRAPH_BS


def test_0523_captures_through_its_module_draft_tp_context_without_a_runner_tp_group(caplog):
    """0.5.22+ model runners have no tp_group: the capture enters the draft TP context as that
    release does (a module function of the layout) and agrees over get_parallel()'s group."""
    from tests.runtime.standins import read_shape

    world = world_with_graphs({"0.5.23": read_shape("0.5.23", "v2")}, "0.5.23", batch_size=3)
    del world.worker.draft_worker.draft_runner.tp_group
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        run(world)
    assert dyn._adapters[type(world.worker)].draft_extend_width1 is not None
    assert "captured width-1 draft-extend graphs" in caplog.text


def test_0523_agrees_over_get_parallels_tp_group(caplog):
    from tests.runtime.standins import read_shape

    world = world_with_graphs({"0.5.23": read_shape("0.5.23", "v2")}, "0.5.23", batch_size=3)
    world.parallel_config.tp_group = types.SimpleNamespace(world_size=2)  # no CPU group
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        run(world)
    assert dyn._adapters[type(world.worker)].draft_extend_width1 is None
    assert "another TP rank could not capture them" in caplog.text


def test_env_switch_keeps_the_n_token_draft_extend(shapes, monkeypatch, caplog):
    monkeypatch.setenv(dyn.DRAFT_EXTEND_WIDTH1_ENV, "0")
    world = world_with_graphs(shapes, "0.5.12.post1", batch_size=3)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        result = run(world)
    assert world.extend_captures == []
    assert [e["width"] for e in extends(world)] == [N]
    assert result.next_token_ids.shape == (3 * N,)
    assert "width-1" not in caplog.text


def test_releases_whose_draft_extend_never_replays_a_graph_capture_none(shapes, caplog):
    world = world_with_graphs(shapes, "0.5.12.post1", batch_size=3)

    def eager_draft_extend(batch: Any, result: Any) -> None:  # 0.5.5.post2's kind
        world._draft_extend_v2({"batch": batch, "batch_result": result})

    world.worker.draft_worker._draft_extend_for_decode = eager_draft_extend
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        run(world)
    assert world.extend_captures == []
    assert "never replays a graph" in caplog.text


# -- the fallback step ----------------------------------------------------------------------


@pytest.mark.parametrize("version", WIDTH1_RELEASES)
def test_fallback_step_runs_the_draft_extend_at_width_1(shapes, version, monkeypatch, caplog):
    import torch

    from tests.runtime.standins import target_hidden, target_logits

    monkeypatch.setenv(dyn.PROFILE_ENV, "1")  # one profile line per fallback step
    world = world_with_graphs(shapes, version, batch_size=3, seq_len=10)
    batch = world.batch
    root_name = world.shape.pick("EagleDraftInput", ("verified_id", "bonus_tokens"))
    roots = getattr(batch.spec_info, root_name).clone()
    rows = batch.req_pool_indices.clone()

    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        result = run(world)

    predicted = target_logits(roots).argmax(-1).to(torch.int32)
    (extend,) = extends(world)
    width1 = dyn._adapters[type(world.worker)].draft_extend_width1
    # The draft worker looked width-1 during its own draft-extend, on the width-1 graphs.
    assert (extend["width"], extend["steps"]) == (1, 0)
    assert extend["graph"] is width1.runner
    assert extend["backend"] is width1.attn_backend
    # One row per request: the new token at position L, in slot L, with the target's h_L.
    assert extend["out_cache_loc"].tolist() == world.req_to_token[rows, 10].tolist()
    assert torch.equal(extend["input_ids"], predicted)
    assert torch.equal(extend["hidden"], target_hidden(roots))
    assert torch.equal(extend["selected_hidden"], target_hidden(roots))
    assert torch.equal(result.next_draft_input.hidden_states, target_hidden(roots))
    assert torch.equal(getattr(result.next_draft_input, root_name), predicted)
    assert result.accept_lens.tolist() == [1, 1, 1]
    if STRIDE_ON_RESULT[version]:  # the scheduler reads the stride off the result: no padding
        assert result.speculative_num_draft_tokens == 1
        assert torch.equal(result.next_token_ids, predicted)
    else:  # it reads the worker's stride: still padded to N
        assert result.next_token_ids.shape == (3 * N,)
        assert torch.equal(result.next_token_ids[::N], predicted)
    assert_draft_worker_restored(world)
    profile = next(r.getMessage() for r in caplog.records if "profile bs=3" in r.getMessage())
    assert " draft_extend_w1=" in profile and " draft_extend=" not in profile


def test_failed_width1_call_redoes_the_step_with_n_tokens_and_stays_there(shapes, caplog):
    import torch

    from tests.runtime.standins import target_hidden, target_logits

    world = world_with_graphs(shapes, "0.5.12.post1", batch_size=3, seq_len=10)
    world.fail_draft_extend_at_width = 1
    batch = world.batch
    roots = batch.spec_info.bonus_tokens.clone()
    rows = batch.req_pool_indices.clone()
    forward_mode = batch.forward_mode

    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        result = run(world)
        world.batch = world._make_batch(3, 10, 100)
        run(world)

    first, wide, second = extends(world)
    assert (first["width"], wide["width"], second["width"]) == (1, N, N)
    # The N-token redo sees the batch as it was before the failed call (seq_lens L, not L+1).
    assert wide["seq_lens"].tolist() == [10, 10, 10]
    expected_slots = world.req_to_token[rows[:, None], 10 + torch.arange(N)].reshape(-1)
    assert wide["out_cache_loc"].tolist() == expected_slots.tolist()
    predicted = target_logits(roots).argmax(-1).to(torch.int32)
    assert torch.equal(wide["selected_tokens"], predicted)
    assert torch.equal(wide["selected_hidden"], target_hidden(roots))
    assert wide["hidden"].shape == (3 * N, 4)
    # The result the scheduler gets is still exact (stride 1 on this release).
    assert result.speculative_num_draft_tokens == 1
    assert torch.equal(result.next_token_ids, predicted)
    assert torch.equal(result.next_draft_input.hidden_states, target_hidden(roots))
    assert batch.forward_mode == "DRAFT_EXTEND_V2" != forward_mode  # the N-token call's own
    assert_draft_worker_restored(world)
    failures = [r for r in caplog.records if "width-1 draft-extend failed" in r.getMessage()]
    assert len(failures) == 1 and "draft-extend failed at width 1" in failures[0].getMessage()


def test_batches_above_the_width1_graphs_run_the_n_token_draft_extend(shapes):
    world = world_with_graphs(shapes, "0.5.12.post1", batch_size=3)
    world.server_args.cuda_graph_bs = [1, 2]
    result = run(world)
    assert [e["width"] for e in extends(world)] == [N]
    assert result.speculative_num_draft_tokens == N
    assert not dyn._adapters[type(world.worker)].draft_extend_width1.broken


def test_width1_covers_only_what_replays_a_graph():
    graphs = dyn.Width1DraftExtend(runner=None, attn_backend=None, batch_sizes=[16, 32])
    assert [graphs.covers(bs) for bs in (1, 16, 17, 32, 33)] == [True] * 4 + [False]
    exact = dyn.Width1DraftExtend(None, None, [16, 32], pads_to_graph=False)
    assert [exact.covers(bs) for bs in (16, 17, 32)] == [True, False, True]
    graphs.broken = "RuntimeError: boom"
    assert not graphs.covers(16)


# -- TP ranks agree on using the graphs -----------------------------------------------------


def test_all_ranks_agree_without_a_group():
    assert dyn._all_ranks_agree(None, True) is True
    assert dyn._all_ranks_agree(types.SimpleNamespace(world_size=1), False) is False
    # TP > 1 but no CPU group to ask: no rank uses what it cannot agree on.
    assert dyn._all_ranks_agree(types.SimpleNamespace(world_size=2, cpu_group=None), True) is False


AGREE_ON_RANK = """
import os, sys, types
import torch.distributed as dist
from dynspec_patch.transforms.runtime import dynspec_fallback as dyn

rank, world, port, ok = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
group = types.SimpleNamespace(world_size=world, cpu_group=dist.group.WORLD)
print(dyn._all_ranks_agree(group, ok), flush=True)
dist.barrier()  # neither rank tears the group down while the other still uses it
# gloo's threads can abort the process as it exits ('terminate called without an
# active exception', once in a CI run even after the barrier): leave without
# running teardown; the answer is printed and flushed, and both ranks are done
os._exit(0)
"""


AGREE_IN_TWO_TP_GROUPS = """
import os, sys, types
import torch.distributed as dist
from dynspec_patch.transforms.runtime import dynspec_fallback as dyn

rank, world, port, ok = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
# two servers' TP groups in one world (as data parallelism lays them out): ranks 0-1 and 2-3
groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
group = types.SimpleNamespace(world_size=2, cpu_group=groups[rank // 2])
print(dyn._all_ranks_agree(group, ok), flush=True)
dist.barrier()
os._exit(0)  # as AGREE_ON_RANK: no gloo teardown
"""


def answers_of_ranks(script: str, oks: list[bool]) -> list[str]:
    """Each rank's printed answer, rank r holding ``oks[r]``."""
    return last_lines_of_ranks(
        script, len(oks), lambda rank, port: [str(rank), str(len(oks)), port,
                                              "1" if oks[rank] else "0"]
    )


@pytest.mark.parametrize(("oks", "expected"), [([True, True], "True"), ([True, False], "False")])
def test_all_ranks_agree_over_a_real_gloo_group(oks, expected):
    assert answers_of_ranks(AGREE_ON_RANK, oks) == [expected, expected]


def test_ranks_agree_within_their_own_tp_group_only():
    """Rank 3 cannot: its TP group (2, 3) goes without, the other server's (0, 1) keeps it."""
    answers = answers_of_ranks(AGREE_IN_TWO_TP_GROUPS, [True, True, True, False])
    assert answers == ["True", "True", "False", "False"]
