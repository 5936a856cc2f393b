"""A CPU-only SGLang decode world built from a release's REAL classes.

Real: ``ScheduleBatch``, ``Req``, ``SamplingParams``, ``SamplingBatchInfo``, ``ReqToTokenPool``,
``TokenToKVPoolAllocator``, ``EagleDraftInput`` / ``EagleVerifyInput`` and their methods,
``ForwardBatch.init_new``, ``LogitsProcessorOutput``, ``GenerationBatchResult``, the patched
``EAGLEWorker`` / ``EAGLEWorkerV2`` methods and the installed ``dynspec_fallback``.

Also real: the tree cache (SGLang's ``ChunkCache``) and the scheduler's release of finished
requests (``release_kv_cache`` / ``cache_finished_req``).

Replaced: the target and draft model forwards (``toy_model``), the attention backend's metadata
set-up (a no-op: it only feeds the attention kernels of a real forward), the KV buffers (no
model writes KV here) and the CUDA / Triton kernels (``ref_kernels``).
Workers are made with ``object.__new__`` and given the attributes their ``__init__`` would set,
because ``__init__`` loads models onto a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import gpu_stubs
import ref_kernels
import torch
import toy_model

SPEC = "sglang.srt.speculative"
POOL_SIZE = 4096  # KV slots
MAX_CONTEXT = 256


def construct(cls: Any, **candidates: Any) -> Any:
    """Call ``cls`` with the candidates its signature accepts (signatures drift by release)."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return cls(**candidates)
    return cls(**{k: v for k, v in candidates.items() if k in params})


def call(fn: Any, *args: Any, **candidates: Any) -> Any:
    params = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in candidates.items() if k in params})


# --------------------------------------------------------------------------------------------
# Import the patched release
# --------------------------------------------------------------------------------------------


@dataclass
class Release:
    """The imported modules of one release; everything else reads names from here."""

    worker_mod: Any
    worker_cls: Any
    variant: str
    fallback_mod: Any
    schedule_batch: Any
    spec_info_mod: Any  # eagle_info (0.5.x) or eagle_utils (0.4.x)
    kernel_placements: dict[str, list[str]] = field(default_factory=dict)

    def g(self, name: str) -> Any:
        """A global of the worker module (where the runtime's adapter looks names up)."""
        return vars(self.worker_mod)[name]


_IMPORTED: dict[str, Release] = {}


def import_release(variant: str) -> Release:
    """Import the patched worker module with fake CUDA, then drop the fake for execution.

    Once per process and variant: the reference kernels are swapped in on the first call."""
    if variant in _IMPORTED:
        return _IMPORTED[variant]
    gpu_stubs.fake_cuda()
    try:
        module_name = f"{SPEC}.eagle_worker" if variant == "v1" else f"{SPEC}.eagle_worker_v2"
        worker_mod = importlib.import_module(module_name)
        schedule_batch = importlib.import_module("sglang.srt.managers.schedule_batch")
        importlib.import_module("sglang.srt.managers.tp_worker")
        importlib.import_module("sglang.srt.mem_cache.memory_pool")
        importlib.import_module("sglang.srt.sampling.sampling_batch_info")
    finally:
        gpu_stubs.restore_cuda()
    cls_name = "EAGLEWorker" if variant == "v1" else "EAGLEWorkerV2"
    info_name = f"{SPEC}.eagle_info" if f"{SPEC}.eagle_info" in sys.modules else (
        f"{SPEC}.eagle_utils"
    )
    release = Release(
        worker_mod=worker_mod,
        worker_cls=getattr(worker_mod, cls_name),
        variant=variant,
        fallback_mod=sys.modules[f"{SPEC}.dynspec_fallback"],
        schedule_batch=schedule_batch,
        spec_info_mod=sys.modules[info_name],
    )
    release.kernel_placements = ref_kernels.install()
    release.kernel_placements["single_rank_groups"] = single_rank_groups()
    gpu_stubs.forbid_stub_calls()  # from here on, a stubbed kernel call is an error
    _IMPORTED[variant] = release
    return release


def single_rank_groups() -> list[str]:
    """Stand-ins for the process groups a one-GPU server would have created (world size 1).

    ForwardBatch.init_new asks e.g. the MoE expert-parallel world size; no collective runs.
    """
    state = importlib.import_module("sglang.srt.distributed.parallel_state")
    placed = []
    for name in ("_TP", "_MOE_EP", "_MOE_TP", "_PP", "_ATTN_TP", "_ATTN_CP", "_MOE_DP"):
        if hasattr(state, name) and getattr(state, name) is None:
            setattr(state, name, SimpleNamespace(world_size=1, rank_in_group=0, rank=0,
                                                 is_first_rank=True, is_last_rank=True))
            placed.append(name)
    return placed


# --------------------------------------------------------------------------------------------
# Server args without __post_init__ (it would look for a model and a GPU)
# --------------------------------------------------------------------------------------------


def server_args(threshold: int | None, **overrides: Any) -> Any:
    mod = importlib.import_module("sglang.srt.server_args")
    cls = mod.ServerArgs
    args = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        object.__setattr__(args, f.name, value)
    values = {
        "model_path": "toy",
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": toy_model.TOPK,
        "speculative_num_draft_tokens": 4,
        "speculative_disable_batch_threshold": threshold,
        "page_size": 1,
        "device": "cpu",
        **overrides,
    }
    for key, value in values.items():
        object.__setattr__(args, key, value)
    if hasattr(mod, "set_global_server_args_for_scheduler"):
        mod.set_global_server_args_for_scheduler(args)
    legacy = getattr(importlib.import_module("sglang.srt.managers.schedule_batch"),
                     "global_server_args_dict", None)
    if isinstance(legacy, dict):  # 0.4.x keeps a dict copy of some server args
        legacy.update({k: getattr(args, k) for k in legacy if hasattr(args, k)})
        # Keys the 0.4.x ModelRunner.__init__ adds for the attention backend it picked.
        legacy.update(use_mla_backend=False, attention_backend="flashinfer",
                      decode_attention_backend="flashinfer",
                      prefill_attention_backend="flashinfer")
    return args


# --------------------------------------------------------------------------------------------
# Fake forwards (the only model code in the world)
# --------------------------------------------------------------------------------------------


def toy_logits(tokens: torch.Tensor, guess: Any) -> torch.Tensor:
    """Logits whose argmax is ``guess(token)``, with a clear margin."""
    logits = torch.zeros((tokens.shape[0], toy_model.VOCAB), dtype=torch.float32)
    for row, tok in enumerate(tokens.tolist()):
        logits[row, guess(int(tok))] = 10.0
    return logits


def toy_hidden(tokens: torch.Tensor, positions: torch.Tensor, tag: float) -> torch.Tensor:
    """Hidden states that identify (token, position, producer) in their first three columns."""
    hidden = torch.zeros((tokens.shape[0], toy_model.HIDDEN), dtype=torch.float32)
    hidden[:, 0] = tokens.to(torch.float32)
    hidden[:, 1] = positions.to(torch.float32)
    hidden[:, 2] = tag
    return hidden


TARGET_TAG = 1.0
DRAFT_TAG = 2.0


class GraphRunnerSentinel:
    """Stands where the target's captured TARGET_VERIFY graph runner is. A speculative step
    asks it and runs eagerly (can_run False); replaying it is an error. The fallback must
    not see it at all: the fake forward records the attribute's value during the call."""

    def __init__(self) -> None:
        self.consulted = 0

    def can_run(self, *_: Any) -> bool:
        self.consulted += 1
        return False

    def replay(self, *_: Any, **__: Any) -> Any:
        raise AssertionError("a CUDA graph replay on CPU")


@dataclass
class TargetCall:
    forward_mode: str
    spec_info_is_none: bool
    capture_hidden_mode: str
    input_ids: list[int]
    input_dtype: str
    seq_lens: list[int]
    seq_lens_is_batch_tensor: bool
    positions: list[int]
    out_cache_loc: list[int]
    graph_attr_during_call: str
    kwargs: dict[str, Any]


class FakeTargetWorker:
    """The target TpModelWorker: its forward is the toy model; everything is recorded."""

    def __init__(self, release: Release, graph_attr: str, batch_ref: list[Any]) -> None:
        tp_worker = sys.modules["sglang.srt.managers.tp_worker"].TpModelWorker
        real = tp_worker.forward_batch_generation
        # A plain (non-hybrid) target: the hybrid configs are None, as in a Llama server.
        self.model_runner = SimpleNamespace(
            **{graph_attr: GraphRunnerSentinel()},
            hybrid_gdn_config=None, mamba2_config=None, hybrid_lightning_config=None,
        )
        self.model_config = model_config()
        self.graph_attr = graph_attr
        self.calls: list[TargetCall] = []
        self._release = release
        self._batch_ref = batch_ref  # [ScheduleBatch]: to tell a new tensor from the batch's
        self._arity = release.fallback_mod.tuple_return_arity(inspect.getsource(real))

        def forward_batch_generation(model_worker_batch: Any = None, *args: Any,
                                     **kwargs: Any) -> Any:
            # v2 verify passes a prepared ForwardBatch instead (model_worker_batch=None)
            batch = model_worker_batch if model_worker_batch is not None else kwargs.get(
                "forward_batch")
            return self._forward(batch, kwargs)

        params = list(inspect.signature(real).parameters.values())[1:]  # drop self
        forward_batch_generation.__signature__ = inspect.Signature(params)
        self.forward_batch_generation = forward_batch_generation

    def _forward(self, mwb: Any, kwargs: dict[str, Any]) -> Any:
        batch = self._batch_ref[0]
        if mwb.forward_mode.name == "TARGET_VERIFY":  # a speculative step: the tree's positions
            positions = mwb.spec_info.positions.to(torch.int64)
        else:  # DECODE: what ForwardBatch.init_new computes, clamp_position(seq_lens)
            positions = mwb.seq_lens.to(torch.int64) - 1
        self.calls.append(
            TargetCall(
                forward_mode=str(mwb.forward_mode.name),
                spec_info_is_none=mwb.spec_info is None,
                capture_hidden_mode=str(mwb.capture_hidden_mode.name),
                input_ids=mwb.input_ids.tolist(),
                input_dtype=str(mwb.input_ids.dtype),
                seq_lens=mwb.seq_lens.tolist(),
                seq_lens_is_batch_tensor=mwb.seq_lens is getattr(batch, "seq_lens", None),
                positions=positions.tolist(),
                out_cache_loc=mwb.out_cache_loc.tolist(),
                graph_attr_during_call=repr(getattr(self.model_runner, self.graph_attr)),
                kwargs={k: repr(v) for k, v in kwargs.items() if k != "forward_batch"},
            )
        )
        logits = toy_logits(mwb.input_ids, toy_model.next_token)
        hidden = toy_hidden(mwb.input_ids, positions, TARGET_TAG)
        logits_cls = sys.modules["sglang.srt.layers.logits_processor"].LogitsProcessorOutput
        out = construct(logits_cls, next_token_logits=logits, hidden_states=hidden)
        if self._arity is not None:  # 0.4.x: a tuple
            return (out, None, False)[: self._arity]
        result_cls = self._release.g("GenerationBatchResult")
        return construct(result_cls, logits_output=out, can_run_cuda_graph=False)


@dataclass
class DraftCall:
    forward_mode: str
    input_ids: list[int]
    positions: list[int]
    out_cache_loc: list[int]
    hidden_in: list[list[float]]
    seq_lens: list[int]


class FakeDraftRunner:
    """The draft ModelRunner: only what ForwardBatch.init_new and the draft-extend read."""

    def __init__(self, args: Any, req_to_token_pool: Any, allocator: Any, model_config: Any):
        self.server_args = args
        self.device = "cpu"
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = allocator
        self.token_to_kv_pool = allocator.get_kvcache()
        self.attn_backend = SimpleNamespace(init_forward_metadata=lambda forward_batch: None)
        self.model_config = model_config
        self.tp_group = SimpleNamespace(name="draft-tp-group")
        self.use_ngram_embedding = False
        self.model_is_mrope = False
        self.is_hybrid_swa = False
        self.is_hybrid = False
        self.is_draft_worker = True
        # 0.4.6's multi-step draft calls the model directly: model.forward(ids, positions, fb).
        self.model = SimpleNamespace(
            forward=lambda input_ids, positions, forward_batch: self.forward(forward_batch)[0]
        )
        spec_info = importlib.import_module(f"{SPEC}.spec_info")
        self.spec_algorithm = spec_info.SpeculativeAlgorithm.EAGLE
        self.calls: list[DraftCall] = []

    def forward(self, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        spec = forward_batch.spec_info
        positions = forward_batch.positions.to(torch.int64)
        hidden_in = getattr(spec, "hidden_states", None)
        self.calls.append(
            DraftCall(
                forward_mode=str(forward_batch.forward_mode.name),
                input_ids=forward_batch.input_ids.tolist(),
                positions=positions.tolist(),
                out_cache_loc=forward_batch.out_cache_loc.tolist(),
                hidden_in=hidden_in[:, :3].tolist() if hidden_in is not None else [],
                seq_lens=forward_batch.seq_lens.tolist(),
            )
        )
        logits = toy_logits(forward_batch.input_ids, toy_model.draft_next_token)
        hidden = toy_hidden(forward_batch.input_ids, positions, DRAFT_TAG)
        if forward_batch.forward_mode.name == "DRAFT_EXTEND":
            # The logits processor keeps the last token of each request in an extend (v1
            # draft-extend after decode; DRAFT_EXTEND_V2 keeps every token instead).
            last = torch.cumsum(torch.as_tensor(forward_batch.extend_seq_lens), 0) - 1
            logits, hidden = logits[last], hidden[last]
        logits_cls = sys.modules["sglang.srt.layers.logits_processor"].LogitsProcessorOutput
        out = construct(logits_cls, next_token_logits=logits, hidden_states=hidden)
        return ForwardOutput((out, False))


class ForwardOutput(tuple):
    """ModelRunner.forward's result in both shapes the releases read: ``logits, _ = out``
    (<= 0.5.5) and ``out.logits_output`` (0.5.10+)."""

    @property
    def logits_output(self) -> Any:
        return self[0]

    @property
    def can_run_graph(self) -> bool:
        return bool(self[1])


# --------------------------------------------------------------------------------------------
# Memory, requests, batch
# --------------------------------------------------------------------------------------------


def chunk_cache(req_to_token_pool: Any, allocator: Any) -> Any:
    """SGLang's real ChunkCache (no prefix sharing): its cache_finished_req frees a request."""
    cache_cls = importlib.import_module("sglang.srt.mem_cache.chunk_cache").ChunkCache
    pieces = {"req_to_token_pool": req_to_token_pool, "token_to_kv_pool_allocator": allocator,
              "page_size": 1}
    if "params" in inspect.signature(cache_cls).parameters:  # 0.5.10+: CacheInitParams
        params_mod = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
        return cache_cls(construct(params_mod.CacheInitParams, **pieces, disable=True))
    return construct(cache_cls, **pieces)


def release_finished(batch: Any) -> None:
    """What the scheduler does with a finished request: free its KV and its pool row."""
    common = sys.modules.get("sglang.srt.mem_cache.common")
    release = getattr(common, "release_kv_cache", None)
    for req in batch.reqs:
        if not req.finished() or getattr(req, "_dynspec_released", False):
            continue
        if release is not None:
            release(req, batch.tree_cache)
        else:
            batch.tree_cache.cache_finished_req(req)
            if getattr(req, "req_pool_idx", None) is not None and _pool_row_in_use(batch, req):
                batch.req_to_token_pool.free(req.req_pool_idx)
        req._dynspec_released = True


def _pool_row_in_use(batch: Any, req: Any) -> bool:
    free_slots = getattr(batch.req_to_token_pool, "free_slots", [])
    return req.req_pool_idx not in list(free_slots)


class KVCacheStandIn:
    """The KV buffers the allocator hands out slots of; the toy model keeps no KV."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the KV buffer was used: {name} (no model forward runs here)")


def memory() -> tuple[Any, Any]:
    pool_mod = sys.modules["sglang.srt.mem_cache.memory_pool"]
    try:
        alloc_mod = importlib.import_module("sglang.srt.mem_cache.allocator")
    except ImportError:
        alloc_mod = pool_mod  # 0.4.6: allocator lives in memory_pool
    req_to_token_pool = construct(
        pool_mod.ReqToTokenPool,
        size=64,
        max_context_len=MAX_CONTEXT,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = construct(
        alloc_mod.TokenToKVPoolAllocator,
        size=POOL_SIZE,
        dtype=torch.float32,
        device="cpu",
        kvcache=KVCacheStandIn(POOL_SIZE),
        need_sort=False,
    )
    return req_to_token_pool, allocator


def model_config() -> Any:
    return SimpleNamespace(
        hidden_size=toy_model.HIDDEN,
        dtype=torch.float32,
        vocab_size=toy_model.VOCAB,
        is_encoder_decoder=False,
        is_multimodal=False,
        is_hybrid=False,
        is_hybrid_swa=False,
        think_end_id=None,  # 0.5.12.post1 verify counts reasoning tokens
        spec_hidden_size=toy_model.HIDDEN,  # 0.5.12.post1 idle draft input width
    )


@dataclass
class RequestSpec:
    prompt: list[int]
    first_token: int  # emitted by the prefill; it has no KV yet
    max_new_tokens: int


def make_requests(release: Release, specs: list[RequestSpec],
                  rids: list[str] | None = None) -> list[Any]:
    sb = release.schedule_batch
    params_mod = importlib.import_module("sglang.srt.sampling.sampling_params")
    reqs = []
    for i, spec in enumerate(specs):
        params = construct(params_mod.SamplingParams, max_new_tokens=spec.max_new_tokens,
                           temperature=0.0, ignore_eos=True)
        call(params.normalize, None)
        rid = rids[i] if rids else f"r{i}"
        req = construct(sb.Req, rid=rid, origin_input_text="", origin_input_ids=spec.prompt,
                        sampling_params=params, vocab_size=toy_model.VOCAB)
        req.output_ids = [spec.first_token]
        reqs.append(req)
    return reqs


def prefilled_batch(
    release: Release, args: Any, specs: list[RequestSpec], req_to_token_pool: Any,
    allocator: Any, rids: list[str] | None = None,
) -> Any:
    """A DECODE batch in the state a prefill + draft-extend leaves (fallback-design.md §2.1)."""
    sb = release.schedule_batch
    reqs = make_requests(release, specs, rids)
    spec_algorithm = importlib.import_module(f"{SPEC}.spec_info").SpeculativeAlgorithm
    batch = call(
        sb.ScheduleBatch.init_new,
        reqs=reqs,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        tree_cache=chunk_cache(req_to_token_pool, allocator),
        model_config=model_config(),
        enable_overlap=False,
        spec_algorithm=spec_algorithm.EAGLE,
        enable_custom_logit_processor=False,
    )
    batch.device = "cpu"
    seq_lens = []
    for req, spec in zip(reqs, specs, strict=True):
        length = len(spec.prompt)
        if "reqs" in inspect.signature(req_to_token_pool.alloc).parameters:
            req_to_token_pool.alloc([req])  # 0.5.10+: sets req.req_pool_idx itself
        else:
            req.req_pool_idx = req_to_token_pool.alloc(1)[0]
        slots = allocator.alloc(length)
        req_to_token_pool.req_to_token[req.req_pool_idx, :length] = slots.to(torch.int32)
        for name in ("kv_committed_len", "kv_allocated_len"):
            if hasattr(req, name):
                setattr(req, name, length)
        seq_lens.append(length)
    forward_info = sys.modules["sglang.srt.model_executor.forward_batch_info"]
    batch.forward_mode = forward_info.ForwardMode.DECODE
    batch.seq_lens = torch.tensor(seq_lens, dtype=torch.int64)
    if hasattr(batch, "seq_lens_cpu"):
        batch.seq_lens_cpu = batch.seq_lens.clone()
    batch.seq_lens_sum = sum(seq_lens)
    if hasattr(batch, "orig_seq_lens"):
        batch.orig_seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    batch.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    batch.output_ids = torch.tensor([s.first_token for s in specs], dtype=torch.int64)
    # What the prefill's prepare_for_extend left (no prefix-cache hits); later extends read it.
    batch.prefix_lens = [0] * len(specs)
    batch.extend_lens = [len(s.prompt) for s in specs]
    batch.extend_logprob_start_lens = [0] * len(specs)
    batch.input_ids = torch.tensor([t for s in specs for t in s.prompt], dtype=torch.int64)
    sampling_mod = sys.modules["sglang.srt.sampling.sampling_batch_info"]
    batch.sampling_info = call(sampling_mod.SamplingBatchInfo.from_schedule_batch, batch,
                               toy_model.VOCAB)
    batch.spec_info = draft_state_after_prefill(release, specs)
    return batch


def draft_state_after_prefill(release: Release, specs: list[RequestSpec]) -> Any:
    """EagleDraftInput as capture_for_decode leaves it after the prefill's draft-extend."""
    n = len(specs)
    root_field = "bonus_tokens" if "bonus_tokens" in _fields(release.g("EagleDraftInput")) else (
        "verified_id"
    )
    firsts = torch.tensor([s.first_token for s in specs], dtype=torch.int32)
    positions = torch.tensor([len(s.prompt) - 1 for s in specs], dtype=torch.int64)
    hidden = toy_hidden(firsts, positions, DRAFT_TAG)
    topk_p = torch.ones((n, toy_model.TOPK), dtype=torch.float32)
    topk_index = torch.tensor(
        [[toy_model.draft_next_token(s.first_token)] for s in specs], dtype=torch.int64
    )
    return construct(
        release.g("EagleDraftInput"),
        hidden_states=hidden,
        topk_p=topk_p,
        topk_index=topk_index,
        **{root_field: firsts},
    )


def select_rows(draft_input: Any, keep: list[int], batch_size: int) -> Any:
    """Keep rows ``keep`` of every per-request tensor of a draft input (FutureMap semantics)."""
    index = torch.tensor(keep, dtype=torch.int64)
    for f in dataclasses.fields(draft_input):
        value = getattr(draft_input, f.name)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_size:
            setattr(draft_input, f.name, value[index])
    return draft_input


def _fields(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# --------------------------------------------------------------------------------------------
# The v1 worker
# --------------------------------------------------------------------------------------------


def graph_attr_name() -> str:
    """The target ModelRunner's graph attribute in this release (read from its source)."""
    src = inspect.getsource(importlib.import_module("sglang.srt.model_executor.model_runner"))
    for name in ("decode_cuda_graph_runner", "graph_runner", "cuda_graph_runner"):
        if f"self.{name} =" in src:
            return name
    raise AssertionError("no graph runner attribute in model_runner.py")


def v1_worker(release: Release, args: Any, req_to_token_pool: Any, allocator: Any,
              batch_ref: list[Any]) -> Any:
    """An EAGLEWorker with the attributes its __init__ sets (0.4.x - 0.5.12.post1)."""
    worker = object.__new__(release.worker_cls)
    spec_algorithm = importlib.import_module(f"{SPEC}.spec_info").SpeculativeAlgorithm
    config = model_config()
    draft_runner = FakeDraftRunner(args, req_to_token_pool, allocator, config)
    attrs = {
        "server_args": args,
        "page_size": 1,
        "topk": toy_model.TOPK,
        "speculative_num_steps": args.speculative_num_steps,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
        "speculative_algorithm": spec_algorithm.EAGLE,
        "device": "cpu",
        "gpu_id": 0,
        "tp_rank": 0,
        "enable_nan_detection": False,
        "padded_static_len": -1,
        "req_to_token_pool": req_to_token_pool,
        "token_to_kv_pool_allocator": allocator,
        "target_worker": FakeTargetWorker(release, graph_attr_name(), batch_ref),
        "draft_model_runner": draft_runner,
        "model_config": config,
        "cuda_graph_runner": None,
        "cuda_graph_runner_for_draft_extend": None,
        "draft_extend_attn_backend": None,  # 0.5.12.post1: None means the runner's backend
        # The multi-step draft's attention backends: metadata only feeds attention kernels.
        "draft_attn_backend": SimpleNamespace(
            init_forward_metadata=lambda forward_batch: None,
            attn_backends=[SimpleNamespace(name=f"draft-step-{i}")
                           for i in range(args.speculative_num_steps)],
        ),
        "hot_token_id": None,
        "extend_lens": None,  # paged top-k draft bookkeeping; None at page_size 1
        "num_new_pages_per_topk": None,
        "eagle_use_aux_hidden_state": False,
        "draft_tp_context": lambda group: contextlib.nullcontext(),
        "adaptive_controller": _AdaptiveControllerSpy(),
    }
    for name, value in attrs.items():
        # Some are read-only properties on the real class (e.g. draft_model_runner): skip those
        # whose class attribute is a property and set the backing attribute instead.
        prop = getattr(type(worker), name, None)
        if isinstance(prop, property):
            continue
        setattr(worker, name, value)
    # draft_model_runner is a property over model_runner, itself a property over _model_runner
    # from 0.5.x on (TpModelWorker): set whichever is a plain attribute.
    if isinstance(getattr(type(worker), "model_runner", None), property):
        worker._model_runner = draft_runner
    else:
        worker.model_runner = draft_runner
    return worker


class _AdaptiveControllerSpy:
    """Records any call: the fallback must never feed the adaptive controller (0.5.11+)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def record(*_: Any, **__: Any) -> None:
            self.calls.append(name)

        return record


# --------------------------------------------------------------------------------------------
# The v2 worker (0.5.4 - 0.5.13.post1): EAGLEWorkerV2 + EagleDraftWorker
# --------------------------------------------------------------------------------------------


def v2_worker(release: Release, args: Any, req_to_token_pool: Any, allocator: Any,
              batch_ref: list[Any]) -> Any:
    """An EAGLEWorkerV2 and its EagleDraftWorker with the attributes their __init__ set."""
    config = model_config()
    draft_runner = FakeDraftRunner(args, req_to_token_pool, allocator, config)
    common = {
        "server_args": args,
        "topk": toy_model.TOPK,
        "speculative_num_steps": args.speculative_num_steps,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
        "device": "cpu",
        "gpu_id": 0,
        "tp_rank": 0,
        "page_size": 1,
        "req_to_token_pool": req_to_token_pool,
        "token_to_kv_pool_allocator": allocator,
        "plan_stream": None,
        "plan_stream_ctx": contextlib.nullcontext(),
        "enable_nan_detection": False,
    }
    draft = object.__new__(release.g("EagleDraftWorker"))
    _set_attrs(draft, {
        **common,
        "draft_runner": draft_runner,
        "cuda_graph_runner": None,
        "cuda_graph_runner_for_draft_extend": None,
        "draft_extend_attn_backend": None,
        "draft_tp_context": lambda group: contextlib.nullcontext(),
        "hot_token_id": None,
    })
    draft.draft_attn_backend = SimpleNamespace(  # multi-step draft metadata: kernels only
        init_forward_metadata=lambda forward_batch: None,
        attn_backends=[SimpleNamespace(name=f"draft-step-{i}")
                       for i in range(args.speculative_num_steps)],
    )
    worker = object.__new__(release.worker_cls)
    target = FakeTargetWorker(release, graph_attr_name(), batch_ref)
    target.model_config = config
    # What ForwardBatch.init_new and the v2 verify read from the target ModelRunner.
    runner = target.model_runner
    runner.device = "cpu"
    runner.server_args = args
    runner.req_to_token_pool = req_to_token_pool
    runner.token_to_kv_pool = allocator.get_kvcache()
    runner.token_to_kv_pool_allocator = allocator
    runner.model_config = config
    runner.use_ngram_embedding = runner.model_is_mrope = runner.is_hybrid_swa = False
    runner.is_draft_worker = False
    runner.spec_algorithm = importlib.import_module(f"{SPEC}.spec_info").SpeculativeAlgorithm.EAGLE
    runner.attn_backend = SimpleNamespace(
        init_forward_metadata=lambda forward_batch: None,
        get_verify_buffers_to_fill_after_draft=lambda: (None, None),
    )
    _set_attrs(worker, {**common, "_target_worker": target, "_draft_worker": draft,
                        "model_config": config})
    tree_mask_mode = getattr(sys.modules.get(f"{SPEC}.eagle_utils"), "TreeMaskMode", None)
    _set_attrs(draft, {  # more of what EagleDraftWorker.__init__ sets
        "target_worker": target,
        "tree_mask_mode": tree_mask_mode.FULL_MASK if tree_mask_mode is not None else None,
    })
    return worker


def _set_attrs(obj: Any, attrs: dict[str, Any]) -> None:
    for name, value in attrs.items():
        if isinstance(getattr(type(obj), name, None), property):
            continue  # e.g. target_worker / draft_worker: properties over _target_worker
        setattr(obj, name, value)


def v2_decode_batch(release: Release, args: Any, specs: list[RequestSpec],
                    req_to_token_pool: Any, allocator: Any,
                    rids: list[str] | None = None) -> Any:
    """A v2 (overlap) ScheduleBatch after prefill, then the scheduler's own prepare_for_decode,
    which over-allocates KV slots ahead of each request (EagleDraftInputV2Mixin)."""
    batch = prefilled_batch(release, args, specs, req_to_token_pool, allocator, rids)
    batch.enable_overlap = True
    draft_cls = release.g("EagleDraftInput")
    if hasattr(draft_cls, "ALLOC_LEN_PER_DECODE"):  # 0.5.5: EAGLEWorkerV2.__init__ sets it
        draft_cls.ALLOC_LEN_PER_DECODE = max(
            args.speculative_num_steps * toy_model.TOPK, args.speculative_num_draft_tokens
        )
    if "allocate_lens" in _fields(draft_cls):  # 0.5.5: the prefill allocated exactly L
        batch.spec_info.allocate_lens = batch.seq_lens.clone()
    for req in batch.reqs:
        if hasattr(req, "decode_batch_idx") and req.decode_batch_idx is None:
            req.decode_batch_idx = 0
    return batch
