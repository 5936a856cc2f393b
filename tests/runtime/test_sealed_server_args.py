"""SGLang 0.5.17+ seal ServerArgs after resolution: a bare assignment raises, and
``ServerArgs.override(source, **fields)`` is the one mutation point. The runtime's graph
captures change a few fields for the capture only; on such a release they must go through
``override`` (and be restored through it), else the DECODE graphs are captured without
hidden states and the width-1 draft-extend capture fails (both seen on an H200 with 0.5.17).
"""

from __future__ import annotations

import enum
import types
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn


class SealedArgs:
    """The 0.5.17 ServerArgs behaviour the runtime meets (``__setattr__`` / ``override``)."""

    def __init__(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "overrides", [])
        object.__setattr__(self, "_in_override", False)
        object.__setattr__(self, "_declarations_materialized", True)

    def override(self, source: str, **fields: Any) -> None:
        self.overrides.append((source, dict(fields)))
        object.__setattr__(self, "_in_override", True)
        try:
            for name, value in fields.items():
                setattr(self, name, value)
        finally:
            object.__setattr__(self, "_in_override", False)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and self._declarations_materialized and not self._in_override:
            raise AttributeError(f"server_args.{name} assigned after resolution")
        object.__setattr__(self, name, value)


def test_sealed_args_are_set_through_override_and_restored():
    args = SealedArgs(speculative_num_steps=3, speculative_num_draft_tokens=4)
    with dyn._server_args_set(args, dict(dyn.WIDTH1_STATE)):
        assert (args.speculative_num_steps, args.speculative_num_draft_tokens) == (0, 1)
    assert (args.speculative_num_steps, args.speculative_num_draft_tokens) == (3, 4)
    sources = [source for source, _ in args.overrides]
    assert sources == [dyn.ARGS_OVERRIDE_SOURCE, dyn.ARGS_OVERRIDE_SOURCE + ".restore"]


def test_sealed_args_are_restored_when_the_block_raises():
    args = SealedArgs(enable_return_hidden_states=False)
    with (
        pytest.raises(RuntimeError),
        dyn._server_args_set(args, {"enable_return_hidden_states": True}),
    ):
        raise RuntimeError("capture failed")
    assert args.enable_return_hidden_states is False


def test_plain_args_are_assigned_without_override():
    args = types.SimpleNamespace(speculative_num_steps=3)
    with dyn._server_args_set(args, {"speculative_num_steps": 0}):
        assert args.speculative_num_steps == 0
    assert args.speculative_num_steps == 3


class Mode(enum.Enum):
    NULL = 0
    FULL = 1


class Algorithm(enum.Enum):
    NONE = 0
    EAGLE3 = 1


class GraphRunner:
    """Reads what 0.5.17's DecodeCudaGraphRunner reads at construction (it captures there)."""

    def __init__(self, model_runner: Any) -> None:
        args = model_runner.server_args
        full = args.return_hidden_states_mode == "full" or args.enable_return_hidden_states
        self.capture_hidden_mode = Mode.FULL if full else Mode.NULL
        self.capture_bs = list(args.cuda_graph_config.decode.bs)
        self.spec_algorithm = model_runner.spec_algorithm


def test_decode_graphs_capture_full_hidden_states_on_sealed_args():
    decode = types.SimpleNamespace(bs=[1, 8, 16, 32, 64])
    args = SealedArgs(
        enable_return_hidden_states=False,
        return_hidden_states_mode=None,
        cuda_graph_config=types.SimpleNamespace(decode=decode),
    )
    runner = types.SimpleNamespace(
        server_args=args,
        spec_algorithm=Algorithm.EAGLE3,
        attn_backend="verify-backend",
        _get_attention_backend=lambda: "decode-backend",
    )
    runner.cuda_graph_runner = GraphRunner.__new__(GraphRunner)

    graphs, why = dyn.capture_decode_graphs(runner, "cuda_graph_runner", 14)

    assert why == ""
    assert graphs.runner.capture_hidden_mode is Mode.FULL
    assert graphs.runner.spec_algorithm is Algorithm.NONE
    assert graphs.batch_sizes == [16, 32, 64]
    # everything restored, through override
    assert (args.enable_return_hidden_states, args.return_hidden_states_mode) == (False, None)
    assert decode.bs == [1, 8, 16, 32, 64]
    assert runner.spec_algorithm is Algorithm.EAGLE3
    assert [source for source, _ in args.overrides][-1].endswith(".restore")
