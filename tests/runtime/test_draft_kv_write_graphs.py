"""The draft KV write replayed as one CUDA graph per batch size, on the stand-in workers.

On a CPU there are no CUDA graphs, so ``graph_capture`` is replaced by ``standins.FakeCapture``,
a capturer with a CUDA graph's semantics. What is tested is what the runtime
does around a graph: which size a batch replays, what the padding rows store, the tensors the
replay reads, and when it stays eager.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn

pytestmark = pytest.mark.torch

SIZES = [2, 4]  # the stand-in target's DECODE graph sizes (its req pool holds 8)


@pytest.fixture(autouse=True)
def _kv_write_and_its_graphs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "1")
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_GRAPHS_ENV, "1")


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> Any:
    from tests.runtime.standins import FakeCapture

    fake = FakeCapture()
    # Only for the draft model's device (the stand-in's is the CPU).
    monkeypatch.setattr(dyn, "graph_capture", lambda device: fake if device.type == "cpu" else None)
    return fake


def pretend_decode_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The target captures DECODE graphs for SIZES (the stand-in runner cannot capture)."""
    graphs = dyn.DecodeGraphs(runner="decode-graphs", attn_backend="decode", batch_sizes=SIZES)
    monkeypatch.setattr(dyn, "capture_decode_graphs", lambda *args, **kwargs: (graphs, ""))
    monkeypatch.setenv(dyn.WARMUP_ENV, "0")  # nothing to replay on a CPU


@pytest.fixture
def decode_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_decode_graphs(monkeypatch)


def make_world(variant: str, release: str = "0.5.12.post1", **kwargs: Any) -> Any:
    from tests.runtime.standins import read_shape, world_with_draft_model

    world = world_with_draft_model(read_shape(release, variant), **kwargs)
    world.worker.target_worker.model_runner.attn_backend = "verify"
    return world


def step(world: Any, bs: int, seq_len: int) -> Any:
    from tests.runtime.standins import new_decode_batch

    batch = new_decode_batch(world, bs, seq_len)
    if world.shape.variant == "v1":
        return dyn.maybe_fallback_v1(world.worker, batch)
    return dyn.maybe_fallback_v2(world.worker, batch)


def adapter_of(world: Any) -> dyn.Adapter:
    return dyn._adapters[type(world.worker)]


def pool_of(world: Any) -> Any:
    from tests.runtime.standins import draft_runner

    return draft_runner(world).token_to_kv_pool


def assert_stored_as_the_draft_extend_would(world: Any, bs: int, seq_len: int) -> Any:
    import torch

    from tests.runtime.standins import reference_draft_kv, stored_draft_kv

    slots, k, v = reference_draft_kv(world, seq_len, bs)
    got_k, got_v = stored_draft_kv(world, slots)
    assert torch.allclose(got_k, k) and torch.allclose(got_v, v)
    assert k.abs().sum() > 0
    return slots


@pytest.mark.parametrize(
    ("variant", "release"), [("v2", "0.5.12.post1"), ("v2", "0.5.17"), ("v1", "0.5.12.post1")]
)
@pytest.mark.usefixtures("decode_graphs")
def test_fallback_steps_replay_the_graph_of_the_padded_size(capture, variant, release):
    import torch

    world = make_world(variant, release)
    step(world, 3, 10)  # the checking step: its write already replays the size-4 graph
    assert capture.captured == [4]
    assert adapter_of(world).draft_kv_write.checked
    before = pool_of(world).k_buffer[0].clone()
    step(world, 3, 11)  # the write alone
    assert capture.captured == [4] and capture.replays == 2
    slots = assert_stored_as_the_draft_extend_would(world, 3, 11)
    # Nothing else in the pool changed but slot 0, where the padding row stores.
    after = pool_of(world).k_buffer[0]
    changed = (after != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {*slots.tolist(), 0}
    assert set(slots.tolist()) <= set(changed)
    assert "CUDA graphs for bs [2, 4]" in adapter_of(world).draft_kv_write_note
    step(world, 2, 12)  # another size: captured once, at its first use
    assert capture.captured == [4, 2] and capture.replays == 3
    assert_stored_as_the_draft_extend_would(world, 2, 12)
    assert torch.count_nonzero(pool_of(world).k_buffer[0][slots]) > 0


@pytest.mark.usefixtures("decode_graphs")
def test_padding_rows_store_into_slot_0_not_into_an_earlier_steps_slots(capture):
    import torch

    world = make_world("v2")
    step(world, 4, 10)
    step(world, 4, 11)
    # The slot the fourth request wrote goes to someone else, who stores there.
    fourth = int(world.req_to_token[world.batch.req_pool_indices[3], 11])
    pool_of(world).k_buffer[0][fourth] = 42.0
    slot_0 = pool_of(world).k_buffer[0][0].clone()
    step(world, 3, 12)  # the size-4 graph again, with one padding row now
    assert capture.captured == [4]
    assert torch.all(pool_of(world).k_buffer[0][fourth] == 42.0)
    assert not torch.equal(pool_of(world).k_buffer[0][0], slot_0)
    assert_stored_as_the_draft_extend_would(world, 3, 12)


@pytest.mark.usefixtures("decode_graphs")
def test_a_batch_above_the_largest_size_writes_eagerly(capture):
    world = make_world("v2")
    step(world, 3, 10)
    step(world, 6, 11)
    assert capture.captured == [4]
    assert_stored_as_the_draft_extend_would(world, 6, 11)


@pytest.mark.usefixtures("decode_graphs")
def test_a_hidden_state_of_another_width_writes_eagerly(capture):
    import torch

    world = make_world("v2")
    step(world, 3, 10)
    kv_write = adapter_of(world).draft_kv_write
    tokens = torch.tensor([5, 6, 7])
    positions = torch.tensor([3, 4, 5])
    loc = torch.tensor([101, 102, 103])
    wide = torch.ones(3, 2)  # an EAGLE draft's: the embedding's width, no fc
    k, v = kv_write.write(tokens, wide, positions, loc)
    ek, ev = kv_write.compute(tokens, wide, positions)
    assert torch.equal(k, ek) and torch.equal(v, ev)
    assert capture.replays == 1  # the checking step's only


@pytest.mark.usefixtures("decode_graphs")
def test_a_failed_capture_warns_once_and_writes_eagerly(monkeypatch, caplog):
    from tests.runtime.standins import FakeCapture

    fake = FakeCapture(fail=RuntimeError("capture refused"))
    monkeypatch.setattr(dyn, "graph_capture", lambda device: fake)
    world = make_world("v2")
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        step(world, 3, 10)
        step(world, 3, 11)
        step(world, 2, 12)
    lines = [r.getMessage() for r in caplog.records if "graph capture failed" in r.getMessage()]
    assert lines == [
        "[dynspec] draft KV write graph capture failed at bs 4 (RuntimeError: capture "
        "refused); the write runs eagerly from now on"
    ]
    assert adapter_of(world).draft_kv_write.checked
    assert_stored_as_the_draft_extend_would(world, 3, 11)
    assert_stored_as_the_draft_extend_would(world, 2, 12)


@pytest.mark.usefixtures("decode_graphs")
def test_a_later_rank_does_not_warn_of_a_failed_capture(monkeypatch, caplog):
    from tests.runtime.standins import FakeCapture

    fake = FakeCapture(fail=RuntimeError("capture refused"))
    monkeypatch.setattr(dyn, "graph_capture", lambda device: fake)
    world = make_world("v2")
    world.worker.tp_rank = 1
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        step(world, 3, 10)
    assert not [r for r in caplog.records if "graph capture failed" in r.getMessage()]
    assert_stored_as_the_draft_extend_would(world, 3, 10)


@pytest.mark.parametrize("case", ["env", "no_decode_graphs", "tp", "cpu"])
def test_where_the_write_stays_eager(monkeypatch, case):
    from tests.runtime.standins import FakeCapture

    fake = FakeCapture()
    monkeypatch.setattr(dyn, "graph_capture", lambda device: None if case == "cpu" else fake)
    if case != "no_decode_graphs":
        pretend_decode_graphs(monkeypatch)
    if case == "env":
        monkeypatch.setenv(dyn.DRAFT_KV_WRITE_GRAPHS_ENV, "0")
    world = make_world("v2")
    if case == "tp":  # two ranks that agree on everything
        world.worker.target_worker.model_runner.tp_group = types.SimpleNamespace(world_size=2)
        monkeypatch.setattr(dyn, "_all_ranks_agree", lambda group, ok: ok)
    step(world, 3, 10)
    step(world, 3, 11)
    assert fake.captured == []
    assert_stored_as_the_draft_extend_would(world, 3, 11)
    expected = {
        "env": f"eager, {dyn.DRAFT_KV_WRITE_GRAPHS_ENV}=0",
        "no_decode_graphs": "eager, as the target's fallback forwards",
        "tp": "eager: with TP its embedding all-reduces",
        "cpu": "eager: not on a CUDA device",
    }[case]
    assert adapter_of(world).draft_kv_write.runs == expected


def test_graph_capture_is_cuda_only():
    import torch

    assert dyn.graph_capture(torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("release", "graphs"), [("0.5.12.post1", True), ("0.5.17", False), (None, False)]
)
@pytest.mark.usefixtures("decode_graphs")
def test_by_default_graphs_only_on_a_release_they_ran_on(capture, monkeypatch, release, graphs):
    from tests.runtime.standins import package_says_release

    monkeypatch.delenv(dyn.DRAFT_KV_WRITE_GRAPHS_ENV)
    world = make_world("v2", release or "0.5.12.post1")
    if release is not None:
        package_says_release(monkeypatch, world, release)
    step(world, 3, 10)
    assert (capture.captured == [4]) is graphs
    runs = adapter_of(world).draft_kv_write.runs
    assert runs.startswith("CUDA graphs for bs") is graphs
    if not graphs:
        assert runs.startswith("eager: its CUDA graphs are on by default only on SGLang 0.5.12")
