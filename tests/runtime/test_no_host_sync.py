"""No device-to-host synchronisation inside a v2 fallback step.

The batch's device tensors are ``HostSyncTrap`` tensors: every tensor computed from them is
one too, and reading one on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``int()``,
``bool()``, ``.to("cpu")``...) raises while the trap is armed. SGLang's CPU copies
(``seq_lens_cpu``) are plain tensors, as on a GPU server, so reading those is allowed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn

pytestmark = pytest.mark.torch


def _trap_class() -> Any:
    import torch

    class HostSyncTrap(torch.Tensor):
        armed = False
        SYNCS = frozenset(
            {
                torch.Tensor.item,
                torch.Tensor.tolist,
                torch.Tensor.cpu,
                torch.Tensor.numpy,
                torch.Tensor.__int__,
                torch.Tensor.__float__,
                torch.Tensor.__bool__,
                torch.Tensor.__index__,
            }
        )

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if cls.armed and (func in cls.SYNCS or _to_host(func, args, kwargs)):
                raise AssertionError(f"device-to-host sync in the step: Tensor.{func.__name__}")
            return super().__torch_function__(func, types, args, kwargs)

    return HostSyncTrap


def _to_host(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    import torch

    if func is not torch.Tensor.to:
        return False
    targets = [*args[1:], kwargs.get("device")]
    return any(str(t) == "cpu" or getattr(t, "type", None) == "cpu" for t in targets)


@pytest.fixture(scope="module")
def trap():
    return _trap_class()


@contextlib.contextmanager
def armed(trap: Any):
    trap.armed = True
    try:
        yield
    finally:
        trap.armed = False


def on_device(world: Any, trap: Any) -> None:
    """Make the batch's and the pools' tensors device tensors (HostSyncTrap)."""
    batch = world.batch
    for name in ("seq_lens", "req_pool_indices", "input_ids", "out_cache_loc"):
        setattr(batch, name, getattr(batch, name).as_subclass(trap))
    spec = batch.spec_info
    for name in ("verified_id", "bonus_tokens", "hidden_states", "allocate_lens"):
        if getattr(spec, name, None) is not None:
            setattr(spec, name, getattr(spec, name).as_subclass(trap))
    pool = world.worker.req_to_token_pool
    pool.req_to_token = pool.req_to_token.as_subclass(trap)


def test_the_trap_catches_host_reads(trap):
    import torch

    device = torch.arange(4).as_subclass(trap)
    derived = (device + 1)[:, None] * torch.arange(2)
    with armed(trap):
        for read in (
            lambda: int(derived.sum()),
            derived.tolist,
            derived.cpu,
            lambda: bool(derived[0, 0]),
            lambda: derived.to("cpu"),
        ):
            with pytest.raises(AssertionError, match="device-to-host sync"):
                read()
        assert derived.shape == (4, 2) and len(device) == 4  # shapes are host metadata
        torch.arange(3).sum().item()  # a plain (host) tensor is fine


def graphs_world(version: str, **kwargs: Any) -> Any:
    from tests.runtime.standins import World, read_shape

    world = World(
        read_shape(version, "v2"),
        threshold=1,
        batch_size=3,
        speculative_num_steps=3,
        speculative_num_draft_tokens=4,
        cuda_graph_bs=[1, 2, 4],
        **kwargs,
    )
    draft = world.worker.draft_worker
    draft.cuda_graph_runner_for_draft_extend = "n-token-graphs"  # width-1 graphs get captured
    draft.draft_extend_attn_backend = "n-token-backend"
    return world


@pytest.mark.parametrize(
    ("version", "host_copies", "expected_sum"),
    [
        ("0.5.10.post1", "cpu", 33),  # N-token draft-extend (no stride on the result)
        ("0.5.12.post1", "cpu", 33),  # width-1, stride-1 result
        ("0.5.13.post1", "cpu", 33),
        ("0.5.13.post1", "int_sum", 33),  # no CPU seq_lens, an int sum
        ("0.5.13.post1", "none", None),  # 0.5.13's sync-free decode: neither
    ],
)
def test_fallback_step_reads_nothing_back_from_the_device(trap, version, host_copies, expected_sum):
    world = graphs_world(version)
    assert dyn._adapter_for(world.worker, "v2") is not None  # start-up (captures) first
    on_device(world, trap)
    batch = world.batch
    if host_copies != "cpu":
        batch.seq_lens_cpu = None
        batch.seq_lens_sum = 30 if host_copies == "int_sum" else None

    with armed(trap):
        result = dyn.maybe_fallback_v2(world.worker, batch)

    assert result is not None
    assert world.recorder.get("target_forward")["seq_lens_sum"] == expected_sum
    vi = world.recorder.get("sample")["vi"]
    if hasattr(vi, "seq_lens_sum"):
        assert vi.seq_lens_sum == (None if expected_sum is None else expected_sum - 3)


@pytest.mark.parametrize("version", ["0.5.12.post1", "0.5.17"])
def test_a_draft_kv_write_step_reads_nothing_back_from_the_device(trap, version, monkeypatch):
    """Only the one step that checks the write reads the KV pool back; every later one is
    sync-free."""
    import torch

    from tests.runtime.standins import give_draft_model

    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "1")
    world = graphs_world(version)
    give_draft_model(world)

    def with_draft_state(seq_len: int) -> Any:
        world.batch = world._make_batch(3, seq_len, 100)
        spec = world.batch.spec_info
        spec.topk_p, spec.topk_index = torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int64)
        spec.hidden_states = torch.zeros(3, 2)
        return world.batch

    assert dyn.maybe_fallback_v2(world.worker, with_draft_state(10)) is not None  # the check
    assert dyn._adapters[type(world.worker)].draft_kv_write.checked
    batch = with_draft_state(11)
    on_device(world, trap)
    with armed(trap):
        result = dyn.maybe_fallback_v2(world.worker, batch)
    assert result is not None
    assert len([n for n in world.recorder.names() if n == "draft_extend_v2"]) == 1
