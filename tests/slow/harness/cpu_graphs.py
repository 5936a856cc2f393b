"""Draft-extend "graphs" on CPU around the release's REAL ``EAGLEDraftExtendCudaGraphRunner``.

``cpu_graph_runner_class`` subclasses the release's own graph runner class. Its real
``__init__`` runs (the batch sizes, the per-request width it captures at, its input buffers),
and so does its real ``replay()`` (padding to a graph size, copies into the width-sized
buffers, the attention-metadata call, unpadding). Only ``capture()`` differs: there are no
CUDA graphs on CPU, so each "graph" is a ``CpuGraph`` whose ``replay()`` runs the toy draft
model on what the real ``replay()`` copied into the buffers, and writes the output buffer the
real ``replay()`` then slices.

``CpuDraftBackendFactory`` stands in for ``DraftBackendFactory``: its draft-extend backend only
records the widths it was built with, read from the server args as the triton backend reads
them in its ``__init__``; attention metadata feeds attention kernels only (none run here).
"""

from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from cpu_device import CudaAsCpu

METADATA_CALLS: list[str] = []  # the label of each backend's replay-metadata call, in order


class MetadataOnlyBackend:
    """An attention backend without kernels: what it was built with, and its replay-metadata
    calls (``METADATA_CALLS``), recorded."""

    def __init__(self, server_args: Any, label: str) -> None:
        self.label = label
        self.speculative_num_steps = server_args.speculative_num_steps
        self.num_draft_tokens = server_args.speculative_num_draft_tokens
        self.replay_metadata_calls = 0

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.cuda_graph_state = (max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_forward_metadata(self, forward_batch: Any) -> None:
        pass

    def get_verify_buffers_to_fill_after_draft(self) -> tuple[None, None]:
        return None, None  # SGLang then allocates fresh verify buffers (as without graphs)

    def init_forward_metadata_capture_cuda_graph(self, *args: Any, **kwargs: Any) -> None:
        pass

    def init_forward_metadata_replay_cuda_graph(self, *args: Any, **kwargs: Any) -> None:
        self.replay_metadata_calls += 1
        METADATA_CALLS.append(self.label)


class CpuDraftBackendFactory:
    """Stands where the worker module's ``DraftBackendFactory`` is (same constructor)."""

    made: ClassVar[list[MetadataOnlyBackend]] = []

    def __init__(self, server_args: Any, draft_runner: Any, topk: int, num_steps: int) -> None:
        self.server_args = server_args

    def create_draft_extend_backend(self) -> MetadataOnlyBackend:
        backend = MetadataOnlyBackend(self.server_args, f"draft-extend-{len(self.made)}")
        CpuDraftBackendFactory.made.append(backend)
        return backend


def captured_width(runner: Any) -> int:
    return int(getattr(runner, "captured_req_width", None) or runner.num_tokens_per_bs)


class CpuGraph:
    """One captured batch size: replaying it runs the toy draft on the graph's input buffers."""

    def __init__(self, runner: Any, bs: int) -> None:
        self.runner = runner
        self.bs = bs

    def replay(self) -> None:
        runner, bs = self.runner, self.bs
        buffers = runner.buffers
        n = bs * captured_width(runner)
        batch = SimpleNamespace(
            forward_mode=runner.forward_mode,
            input_ids=buffers.input_ids[:n],
            positions=buffers.positions[:n],
            out_cache_loc=buffers.out_cache_loc[:n],
            seq_lens=buffers.seq_lens[:bs],
            extend_seq_lens=buffers.extend_seq_lens[:bs],
            spec_info=SimpleNamespace(hidden_states=buffers.hidden_states[:n]),
        )
        out = runner.model_runner.forward(batch).logits_output
        probs = torch.softmax(out.next_token_logits, dim=-1)
        out.topk_p, out.topk_index = probs.topk(runner.topk, dim=-1)
        runner.output_buffers[bs] = out
        runner.replayed.append(
            {
                "bs": bs,
                "raw_bs": runner.raw_bs,
                "width": captured_width(runner),
                "attn_metadata_of": METADATA_CALLS[-1] if METADATA_CALLS else None,
            }
        )


def cpu_graph_runner_class(real_cls: Any) -> Any:
    """The release's draft-extend graph runner with CPU "graphs" instead of CUDA graphs."""

    class CpuDraftExtendGraphRunner(real_cls):
        def capture(self) -> None:
            self.replayed: list[dict[str, int]] = []
            for bs in self.capture_bs:
                self.graphs[bs] = CpuGraph(self, bs)

    CpuDraftExtendGraphRunner.__name__ = real_cls.__name__
    return CpuDraftExtendGraphRunner


class DecodeCpuGraph:
    """One captured DECODE batch size: replaying it records what the real replay() put into
    the graph's input buffers and writes the output buffer the real replay() slices."""

    def __init__(self, runner: Any, bs: int, key: Any) -> None:
        self.runner = runner
        self.bs = bs
        self.key = key

    def replay(self) -> None:
        runner, bs = self.runner, self.bs
        buffers = runner.buffers
        runner.replayed.append({
            "bs": bs,
            "raw_bs": runner.raw_bs,
            "input_ids": buffers.input_ids[:bs].tolist(),
            "req_pool_indices": buffers.req_pool_indices[:bs].tolist(),
            "seq_lens": buffers.seq_lens[:bs].tolist(),
            "out_cache_loc": buffers.out_cache_loc[:bs].tolist(),
            "positions": buffers.positions[:bs].tolist(),
            # 0.5.12+ keep the backend they were built with; older ones read the runner's.
            "attn_metadata_of": METADATA_CALLS[-1] if METADATA_CALLS else None,
            "attn_metadata_calls": len(METADATA_CALLS),
        })
        logits_cls = sys.modules["sglang.srt.layers.logits_processor"].LogitsProcessorOutput
        config = runner.model_runner.model_config
        runner.output_buffers[self.key] = logits_cls(
            next_token_logits=torch.zeros((bs, config.vocab_size)),
            hidden_states=torch.zeros((bs, config.hidden_size)),
        )


def cpu_decode_graph_runner_class(real_cls: Any) -> Any:
    """The release's CudaGraphRunner with CPU "graphs". An instance made by ``verify_stand_in``
    stands where SGLang's TARGET_VERIFY graphs are: speculative steps ask it (``can_run``
    False, they run eagerly) and it is never replayed. Constructing the class runs the real
    ``__init__``: that is how the runtime captures its DECODE graphs."""

    class CpuCudaGraphRunner(real_cls):
        stands_for_verify_graphs = False

        def capture(self) -> None:  # the real __init__ calls it, and so does a recapture
            self.captures = getattr(self, "captures", 0) + 1
            self.replayed: list[dict[str, Any]] = getattr(self, "replayed", [])
            for bs in self.capture_bs:
                key = self._make_graph_key(bs) if hasattr(self, "_make_graph_key") else bs
                self.graphs[key] = DecodeCpuGraph(self, bs, key)

        def can_run(self, forward_batch: Any) -> bool:
            return False if self.stands_for_verify_graphs else super().can_run(forward_batch)

        def replay(self, *args: Any, **kwargs: Any) -> Any:
            assert not self.stands_for_verify_graphs, "a replay of the TARGET_VERIFY graphs"
            return super().replay(*args, **kwargs)

    CpuCudaGraphRunner.__name__ = real_cls.__name__
    return CpuCudaGraphRunner


def verify_stand_in(runner_cls: Any) -> Any:
    verify = object.__new__(runner_cls)
    verify.stands_for_verify_graphs = True
    return verify


def install(release: Any, worker: Any, cuda_graph_bs: list[int]) -> dict[str, Any]:
    """Give the target the CUDA-graph state a GPU server has (TARGET_VERIFY graphs, a way to
    make a second attention backend) and the draft worker the N-token draft-extend graphs
    SGLang captures; give the worker module CPU versions of the graph runner class and
    backend factory the runtime's width-1 capture uses; make ``clamp_position`` the release's
    own native (CPU) one. Returns what to restore (``uninstall``)."""
    module = release.worker_mod
    saved: dict[str, Any] = {name: vars(module)[name] for name in (
        "EAGLEDraftExtendCudaGraphRunner", "DraftBackendFactory")}
    forward_info = sys.modules["sglang.srt.model_executor.forward_batch_info"]
    saved["clamp_position"] = forward_info.clamp_position
    clamp_calls: list[list[int]] = []

    def clamp_position(seq_lens: Any) -> Any:
        clamp_calls.append(seq_lens.tolist())
        return forward_info._clamp_position_native(seq_lens)

    forward_info.clamp_position = clamp_position
    saved["clamp_calls"] = clamp_calls
    target = worker.target_worker
    runner = target.model_runner
    graphs_mod = sys.modules["sglang.srt.model_executor.cuda_graph_runner"]
    decode_cls = cpu_decode_graph_runner_class(graphs_mod.CudaGraphRunner)
    setattr(runner, target.graph_attr, verify_stand_in(decode_cls))
    runner.attn_backend = MetadataOnlyBackend(worker.server_args, "target-verify")
    runner.init_new_workspace = False
    runner.hisparse_coordinator = None  # what ModelRunner.__init__ sets without HiSparse
    runner.device_timer = None

    def new_backend(init_new_workspace: bool = False) -> MetadataOnlyBackend:
        runner.init_new_workspace = init_new_workspace  # SGLang's side effect
        return MetadataOnlyBackend(worker.server_args, "target-decode")

    runner._get_attention_backend = new_backend
    runner_cls = cpu_graph_runner_class(saved["EAGLEDraftExtendCudaGraphRunner"])
    module.EAGLEDraftExtendCudaGraphRunner = runner_cls
    module.DraftBackendFactory = CpuDraftBackendFactory
    CpuDraftBackendFactory.made = []
    METADATA_CALLS.clear()
    args = worker.server_args
    args.cuda_graph_bs = list(cuda_graph_bs)
    draft = worker.draft_worker
    draft_runner = draft.draft_runner
    # What EagleDraftWorker.__init__ sets and the real runner's __init__ reads.
    spec_info = sys.modules["sglang.srt.speculative.spec_info"]
    draft.speculative_algorithm = spec_info.SpeculativeAlgorithm.EAGLE
    draft.eagle_use_aux_hidden_state = False
    draft_runner.attn_backend.get_cuda_graph_seq_len_fill_value = lambda: 1
    draft_runner.tp_size = draft_runner.dp_size = 1
    draft_runner.model_config.hf_config = SimpleNamespace()
    draft_runner.device_timer = None
    draft_runner.dtype = torch.float32
    n_token_backend = CpuDraftBackendFactory(args, draft_runner, 1, args.speculative_num_steps)
    draft.draft_extend_attn_backend = n_token_backend.create_draft_extend_backend()
    kwargs = {}
    if "draft_extend_attn_backend" in inspect.signature(runner_cls).parameters:
        kwargs["draft_extend_attn_backend"] = draft.draft_extend_attn_backend
    with CudaAsCpu():  # 0.5.5.post2 makes its buffers under torch.device("cuda")
        draft.cuda_graph_runner_for_draft_extend = runner_cls(draft, **kwargs)
    return saved


def uninstall(release: Any, saved: dict[str, Any]) -> None:
    for name in ("EAGLEDraftExtendCudaGraphRunner", "DraftBackendFactory"):
        setattr(release.worker_mod, name, saved[name])
    sys.modules["sglang.srt.model_executor.forward_batch_info"].clamp_position = saved[
        "clamp_position"]
