"""Stand-in SGLang workers shaped like one pinned release, for CPU behaviour tests.

The shape (dataclass field names and which are required, method parameters, the target
worker's keyword, the graph attribute, which globals the worker module binds, which members
the worker has) is read from that release's own source with the static probe's parser, so a
stand-in cannot silently drift from the real classes. The methods are small CPU reference
implementations of SGLang's one-node semantics that record what they were given.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import itertools
import linecache
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dynspec_patch.patcher.releases import find_pin, release_dir
from dynspec_patch.transforms.runtime_probe import (
    MODEL_RUNNER,
    SCHEDULE_BATCH,
    TARGET_WORKER,
    _method,
    _params,
    _StaticHas,
    _Tree,
)

# The helper functions the v2 fallback may call, looked up where the release binds them.
V2_HELPERS = (
    "eagle_sample",
    "generate_token_bitmask",
    "build_grammar_vocab_mask",
    "GrammarTree",
    "compute_spec_v2_logprobs",
    "compute_spec_logprobs",
)

VOCAB = 16
HIDDEN = 4
_counter = itertools.count()

# Concept -> the spellings SGLang used (independent of the runtime's table on purpose).
VERIFY_OUTPUT_NEXT = ("draft_input", "draft_extend_input")
VERIFY_OUTPUT_TOKENS = ("verified_id", "accept_tokens")
VERIFY_OUTPUT_PER_REQ = (
    "accept_length_per_req_cpu",
    "num_accepted_drafts_per_req_cpu",
    "num_correct_drafts_per_req_cpu",
)
VERIFY_OUTPUT_INDICES = ("accepted_indices", "accept_indices", "accepeted_indices")
ROOT = ("verified_id", "bonus_tokens")
INDEX = ("retrive_index", "retrieve_index")


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0
    LAST = 1
    FULL = 2


class ForwardMode(enum.IntEnum):
    EXTEND = 0
    DECODE = 1
    IDLE = 2
    TARGET_VERIFY = 3

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND


@dataclass
class Shape:
    """What one release's worker world looks like, read from its source."""

    version: str
    variant: str
    module_names: set[str]
    worker_members: set[str]
    draft_worker_members: set[str]
    batch_members: set[str]
    fields: dict[str, dict[str, bool]]
    params: dict[str, set[str]]
    target_kwarg: str
    graph_attr: str
    # v2: the verify module's globals (None: the worker module holds the verify body), and
    # the signatures (``def f(<these>)``, annotations dropped) of the functions the fallback
    # calls, cloned from the release so that a wrong call fails as it would in SGLang.
    verify_module_names: set[str] | None = None
    signatures: dict[str, str] = field(default_factory=dict)
    # EagleVerifyInput.verify as the release has it (``ast.unparse``), which the stand-in
    # verify shows to ``inspect.getsource`` (the runtime reads the request attributes it uses).
    verify_source: str | None = None

    def has_field(self, cls: str, name: str) -> bool:
        return name in self.fields.get(cls, {})

    def pick(self, cls: str, spellings: tuple[str, ...]) -> str:
        return next(s for s in spellings if self.has_field(cls, s))


def read_shape(version: str, variant: str) -> Shape:
    """Read the shape of ``variant``'s worker world from pinned release ``version``."""
    root = release_dir(find_pin(version))
    tree = _Tree(lambda rel: (root / rel).read_text() if (root / rel).is_file() else None)
    has = _StaticHas(tree, variant)
    assert has.worker is not None, f"{version} has no {variant} worker"
    classes = (
        "EagleVerifyInput",
        "EagleDraftInput",
        "EagleVerifyOutput",
        "EagleDraftExtendInput",
        "GenerationBatchResult",
    )
    fields = {c: has.fields(c) for c in classes if c in has.worker_module.bindings}
    params: dict[str, set[str]] = {}
    signatures: dict[str, str] = {}
    vi = has._global_class("EagleVerifyInput")
    for method in ("prepare_for_verify", "verify", "sample"):
        fn = _method(tree, vi, method)
        if fn is not None:
            params[f"EagleVerifyInput.{method}"] = _params(fn)
            signatures[f"EagleVerifyInput.{method}"] = _signature(fn)
    verify_fn = _method(tree, vi, "verify")
    relpath, cls, method = TARGET_WORKER
    target_fn = _method(tree, tree.class_in(relpath, cls), method)
    target_params = _params(target_fn)
    runner = has._members(tree.class_in(*MODEL_RUNNER))
    signatures["target.forward_batch_generation"] = _signature(target_fn, drop_first=True)
    entry = _method(tree, has.worker, "forward_batch_generation") if has.worker else None
    if entry is not None:
        signatures["worker.forward_batch_generation"] = _signature(entry)
    verify_names = None
    if variant == "v2":
        if has.verify_module is not has.worker_module and has.verify_module is not None:
            verify_names = set(has.verify_module.bindings)
        for name in (*V2_HELPERS, "draft_tp_context"):
            found = None
            for module in (has.verify_module, has.worker_module):
                if module is not None and name in module.bindings:
                    found = tree.find_definition(module, name)
                    break
            if found is not None and isinstance(found[1], ast.FunctionDef):
                signatures[name] = _signature(found[1])
        extend = _method(tree, has.draft_worker, "_draft_extend_for_decode")
        signatures["draft._draft_extend_for_decode"] = _signature(extend)
        prefill = _method(tree, has.draft_worker, "_draft_extend_for_prefill")
        if prefill is not None:
            signatures["draft._draft_extend_for_prefill"] = _signature(prefill)
    return Shape(
        version=version,
        variant=variant,
        module_names=set(has.worker_module.bindings),
        worker_members=has._members(has.worker),
        draft_worker_members=has._members(has.draft_worker),
        batch_members=has._members(tree.class_in(*SCHEDULE_BATCH)),
        fields=fields,
        params=params,
        target_kwarg=next(k for k in ("is_verify", "skip_sample") if k in target_params),
        graph_attr=next(
            a
            for a in ("graph_runner", "cuda_graph_runner", "decode_cuda_graph_runner")
            if a in runner
        ),
        verify_module_names=verify_names,
        signatures=signatures,
        verify_source=ast.unparse(verify_fn) if verify_fn is not None else None,
    )


def _signature(fn: ast.FunctionDef, drop_first: bool = False) -> str:
    """The parameter list of ``fn`` as source, annotations dropped, defaults kept if literal."""
    args = ast.fix_missing_locations(ast.parse(f"def f({ast.unparse(fn.args)}): pass")).body[0]
    arguments = args.args  # type: ignore[attr-defined]
    for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
        arg.annotation = None
    for holder in (arguments.vararg, arguments.kwarg):
        if holder is not None:
            holder.annotation = None
    arguments.defaults = [
        d if isinstance(d, ast.Constant) else ast.Constant(None) for d in arguments.defaults
    ]
    arguments.kw_defaults = [
        d if d is None or isinstance(d, ast.Constant) else ast.Constant(None)
        for d in arguments.kw_defaults
    ]
    if drop_first and arguments.args and arguments.args[0].arg == "self":
        arguments.args = arguments.args[1:]
    return ast.unparse(arguments)


_clone_ids = itertools.count()


def clone(
    signature: str,
    name: str,
    impl: Callable[[dict[str, Any]], Any],
    note: str = "",
    shown_source: str | None = None,
    module_globals: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    """A function with exactly ``signature``'s parameters that calls ``impl(bound_args)``.

    ``note`` becomes a comment in its source, which ``inspect.getsource`` can read (the
    runtime reads some SGLang methods' source); ``shown_source``, where given, is what
    ``inspect.getsource`` reads instead (the release's own method); ``module_globals`` are
    names its ``__globals__`` hold beside the call (the globals of the release's module,
    which the runtime reads).
    """
    namespace: dict[str, Any] = {}
    comment = f"    # {note}\n" if note else ""
    source = f"def {name}({signature}):\n{comment}    return _impl(dict(locals()))\n"
    filename = f"<standin {name} {next(_clone_ids)}>"
    shown = source if shown_source is None else shown_source + "\n"
    linecache.cache[filename] = (len(shown), None, shown.splitlines(True), filename)
    exec(compile(source, filename, "exec"), {**(module_globals or {}), "_impl": impl}, namespace)
    return namespace[name]


def _dataclass(name: str, spec: dict[str, bool], namespace: dict[str, Any]) -> type:
    items = [
        (f, Any, field(default=None)) if has_default else (f, Any)
        for f, has_default in spec.items()
    ]
    return dataclasses.make_dataclass(name, items, kw_only=True, namespace=namespace)


class Recorder:
    """Ordered log of what the stand-ins were called with."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def add(self, name: str, **data: Any) -> None:
        self.events.append((name, data))

    def names(self) -> list[str]:
        return [name for name, _ in self.events]

    def get(self, name: str) -> dict[str, Any]:
        matches = [data for n, data in self.events if n == name]
        assert len(matches) == 1, (name, self.names())
        return matches[0]


_REQUEST_IDS = itertools.count()


@dataclass
class Req:
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    rid: str = field(default_factory=lambda: f"req-{next(_REQUEST_IDS)}")  # SGLang's request id
    finished_reason: str | None = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    decode_batch_idx: int = 0
    grammar: Any = None
    # 0.5.12.post1's reasoning and speculative counters, which its v1 verify() updates.
    require_reasoning: bool = False
    reasoning_tokens: list[tuple[int, int]] = field(default_factory=list)
    spec_verify_ct: int = 0
    spec_num_correct_drafts: int = 0
    spec_correct_drafts_histogram: list[int] = field(default_factory=list)

    def check_finished(self) -> None:
        if len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = "length"

    def update_reasoning_tokens(self, token: int, think_end_id: int) -> None:
        self.reasoning_tokens.append((token, think_end_id))

    def update_spec_correct_drafts_histogram(self, num_correct_drafts: int) -> None:
        self.spec_correct_drafts_histogram.append(num_correct_drafts)

    def finished(self) -> bool:
        return self.finished_reason is not None


class Orchestrator:
    def __init__(self, required: bool, recorder: Recorder) -> None:
        self.is_required = required
        self._recorder = recorder

    def cumulate_output_tokens(self, tokens: torch.Tensor) -> None:
        self._recorder.add("cumulate_output_tokens", tokens=tokens.clone())


def target_logits(input_ids: torch.Tensor) -> torch.Tensor:
    """The stand-in target model's next-token distribution: argmax is (token + 3) % V."""
    logits = torch.zeros((input_ids.shape[0], VOCAB))
    logits[torch.arange(input_ids.shape[0]), (input_ids.long() + 3) % VOCAB] = 10.0
    return logits


def target_hidden(input_ids: torch.Tensor) -> torch.Tensor:
    return input_ids.float()[:, None].repeat(1, HIDDEN) + 0.5


class World:
    """A stand-in worker module, worker and decode batch for one release shape."""

    def __init__(
        self,
        shape: Shape,
        *,
        threshold: int | None = 1,
        batch_size: int = 4,
        seq_len: int = 10,
        max_new_tokens: int = 100,
        **server_args: Any,
    ) -> None:
        self.shape = shape
        self.recorder = Recorder()
        self.module = types.ModuleType(f"dynspec_standin_{next(_counter)}")
        sys.modules[self.module.__name__] = self.module
        self.server_args = types.SimpleNamespace(
            **{
                "speculative_disable_batch_threshold": threshold,
                "speculative_algorithm": "EAGLE3",
                "enable_dp_attention": False,
                "pp_size": 1,
                "speculative_eagle_topk": 1,
                "max_running_requests": 48,
                **server_args,
            }
        )
        self.graph_sentinel = object()
        self.req_to_token = torch.arange(8 * 64, dtype=torch.int32).reshape(8, 64) + 1000
        self.next_slot = 5000
        self.verify_module: types.ModuleType | None = None
        # 0.5.17+'s get_exec(): read-only config bags (graph sizes, hidden-state capture).
        self.exec_config = ConfigBag(
            "exec",
            features=ConfigBag(
                "exec.features", enable_return_hidden_states=False, return_hidden_states_mode=None
            ),
            graph=ConfigBag(
                "exec.graph",
                cuda_graph_config=types.SimpleNamespace(
                    decode=types.SimpleNamespace(bs=[1, 2, 4, 8, 16, 32, 64])
                ),
            ),
        )
        # 0.5.17+'s get_spec(), on releases whose worker module has it: where the triton
        # backend reads its speculative widths when it is built, as a read-only config bag.
        self.spec_config = ConfigBag(
            "spec",
            speculative_num_steps=getattr(self.server_args, "speculative_num_steps", None),
            speculative_num_draft_tokens=getattr(
                self.server_args, "speculative_num_draft_tokens", None
            ),
        )
        # 0.5.16+'s get_parallel(): the TP group (0.5.22+'s model runners have none).
        self.parallel_config = types.SimpleNamespace(tp_group=None)
        self.fail_draft_extend_at_width: int | None = None
        self.fail_extend_capture: Exception | None = None
        self.extend_captures: list[Any] = []
        self.draft_backends_made: list[Any] = []
        self._install_globals()
        if shape.variant == "v2":
            self._install_v2_helpers()
        self.worker = self._make_worker()
        self.batch = self._make_batch(batch_size, seq_len, max_new_tokens)

    # -- module globals ---------------------------------------------------------------------

    def _install_globals(self) -> None:
        shape, rec, world = self.shape, self.recorder, self
        available: dict[str, Any] = {
            "CaptureHiddenMode": CaptureHiddenMode,
            "ForwardMode": ForwardMode,
            "generate_token_bitmask": world._bitmask,
        }
        verify_params = shape.params.get("EagleVerifyInput.verify", set())
        sample_params = shape.params.get("EagleVerifyInput.sample", set())

        def prepare_for_verify(self, batch, page_size):
            rec.add("prepare_for_verify", page_size=page_size, vi=self)
            batch.input_ids = self.draft_token
            n = len(self.draft_token)
            slots = torch.arange(world.next_slot, world.next_slot + n, dtype=torch.int64)
            world.next_slot += n
            batch.out_cache_loc = slots
            rows = batch.req_pool_indices.long()
            world.req_to_token[rows, batch.seq_lens.long()] = slots.to(torch.int32)

        def verify(
            self, batch, logits_output, token_to_kv_pool_allocator, page_size, vocab_mask=None
        ):
            rec.add(
                "verify",
                vi=self,
                spec_info_is_self=batch.spec_info is self,
                seq_lens=batch.seq_lens.clone(),
                vocab_mask=vocab_mask,
                allocator=token_to_kv_pool_allocator,
                page_size=page_size,
            )
            return world._verify_one_node(self, batch, logits_output)

        def sample(self, batch, logits_output, vocab_mask=None):
            rec.add("sample", vi=self, vocab_mask=vocab_mask, input_ids=batch.input_ids)
            predict = logits_output.next_token_logits.argmax(-1).to(torch.int32)
            bs = predict.shape[0]
            accept_index = torch.arange(bs, dtype=torch.int32)[:, None]
            return predict, torch.ones(bs, dtype=torch.int32), accept_index

        namespace: dict[str, Any] = {}
        if "EagleVerifyInput.prepare_for_verify" in shape.params:
            namespace["prepare_for_verify"] = prepare_for_verify
        if verify_params:
            namespace["verify"] = clone(
                shape.signatures["EagleVerifyInput.verify"],
                "verify",
                lambda args: verify(*args.values()),
                shown_source=shape.verify_source,
            )
        if sample_params:
            namespace["sample"] = (
                sample
                if "vocab_mask" in sample_params
                else (lambda self, b, lo: sample(self, b, lo))
            )
        for cls_name, spec in shape.fields.items():
            available[cls_name] = _dataclass(
                cls_name, spec, namespace if cls_name == "EagleVerifyInput" else {}
            )

        @contextlib.contextmanager
        def moe_context():
            rec.add("moe_enter")
            yield

        available["get_exec"] = lambda: world.exec_config
        available["get_spec"] = lambda: world.spec_config
        available["get_parallel"] = lambda: world.parallel_config
        available["EAGLEDraftExtendCudaGraphRunner"] = type(
            "EAGLEDraftExtendCudaGraphRunner", (DraftExtendGraphRunner,), {"world": world}
        )
        available["DraftBackendFactory"] = type(
            "DraftBackendFactory", (DraftBackendFactory,), {"world": world}
        )
        available["speculative_moe_backend_context"] = moe_context
        available["speculative_moe_a2a_backend_context"] = moe_context
        available["add_output_logprobs_for_spec_v1"] = lambda batch, res, lo: rec.add(
            "logprobs_v1", res=res
        )
        available["compute_spec_v2_logprobs"] = lambda batch, lo, predict, accept_index, steps: (
            rec.add("logprobs_v2", accept_index=accept_index.clone(), predict=predict.clone())
        )
        available["ScheduleBatch"] = type(
            "ScheduleBatch",
            (_BatchBase,),
            {"maybe_evict_swa": _BatchBase._evict}
            if "maybe_evict_swa" in shape.batch_members
            else {},
        )
        for name, value in available.items():
            if name in shape.module_names:
                setattr(self.module, name, value)

    def _bitmask(
        self, reqs, verify_input, next_token_cpu, next_sibling_cpu, draft_cpu, vocab_size
    ):
        self.recorder.add(
            "bitmask", vi=verify_input, draft_cpu=draft_cpu, next_token_cpu=next_token_cpu
        )
        return torch.ones((len(reqs), 1), dtype=torch.int32)

    # -- v2 helpers of 0.5.14+ (eagle_sample & co.), with each release's own signatures -------

    def _install_v2_helpers(self) -> None:
        """Bind the 0.5.14+ helpers where the release binds them (the verify module: 0.5.16+)."""
        shape, rec, world = self.shape, self.recorder, self
        target = self.module
        if shape.verify_module_names is not None:
            self.verify_module = types.ModuleType(f"{self.module.__name__}_common")
            sys.modules[self.verify_module.__name__] = self.verify_module
            target = self.verify_module

            def run_eagle_verify(*args, **kwargs):
                raise AssertionError("the fallback must not run SGLang's verify")

            run_eagle_verify.__module__ = self.verify_module.__name__
            self.module.run_eagle_verify = run_eagle_verify
        names = shape.verify_module_names or shape.module_names
        sig = shape.signatures

        def sample(args: dict[str, Any]) -> Any:
            mask = args.get("grammar_mask", args.get("vocab_mask"))
            batch, logits_output = args["batch"], args["logits_output"]
            rec.add("sample", vi=args["verify_input"], vocab_mask=mask, input_ids=batch.input_ids)
            predict = logits_output.next_token_logits.argmax(-1).to(torch.int32)
            bs = predict.shape[0]
            accept_index = torch.arange(bs, dtype=torch.int32)[:, None]
            return predict, torch.ones(bs, dtype=torch.int32), accept_index

        def build_mask(args: dict[str, Any]) -> Any:
            if args["barrier"] is not None:
                args["barrier"]()
            rec.add("grammar_mask", tree=args["tree"].resolve(), reqs=args["reqs"])
            args["sampling_info"].grammar_mask = None
            return types.SimpleNamespace(kind="GrammarMask", device=args["device"])

        def logprobs(args: dict[str, Any]) -> None:
            rec.add(
                "logprobs_v2",
                accept_index=args["accept_index"].clone(),
                predict=args["predict"].clone(),
                args=sorted(args),
            )

        impls: dict[str, Callable[[dict[str, Any]], Any]] = {
            "eagle_sample": sample,
            "build_grammar_vocab_mask": build_mask,
            "compute_spec_v2_logprobs": logprobs,
            "compute_spec_logprobs": logprobs,
        }
        if "verify_input" in sig.get("generate_token_bitmask", ""):
            impls["generate_token_bitmask"] = lambda a: world._bitmask(
                a["reqs"],
                a["verify_input"],
                a["retrieve_next_token_cpu"],
                a["retrieve_next_sibling_cpu"],
                a["draft_tokens_cpu"],
                a["vocab_size"],
            )
        for name, impl in impls.items():
            if name in names and name in sig:
                setattr(target, name, clone(sig[name], name, impl))
        if "GrammarTree" in names:
            target.GrammarTree = GrammarTree
        if "draft_tp_context" in sig and "draft_tp_context" in shape.module_names:
            self.module.draft_tp_context = clone(
                sig["draft_tp_context"], "draft_tp_context", self._tp_enter
            )

    @contextlib.contextmanager
    def _tp_enter(self, args: dict[str, Any]) -> Any:
        self.recorder.add("draft_tp_enter", **args)
        yield

    def _verify_one_node(self, vi, batch, logits_output):
        """CPU reference of EagleVerifyInput.verify for a one-node tree (greedy)."""
        shape = self.shape
        predict = logits_output.next_token_logits.argmax(-1).to(torch.int32)
        bs = predict.shape[0]
        unfinished = []
        think_end_id = batch.model_config.think_end_id
        for i, req in enumerate(batch.reqs):  # 0.5.12.post1's loop, for one accepted token
            token = int(predict[i])
            req.output_ids.append(token)
            if req.require_reasoning and think_end_id is not None:
                req.update_reasoning_tokens(token, think_end_id)
            req.check_finished()
            req.kv_committed_len += 1
            req.kv_allocated_len = req.kv_committed_len
            if not req.finished():
                unfinished.append(i)
            req.spec_verify_ct += 1
            req.spec_num_correct_drafts += 0
            req.update_spec_correct_drafts_histogram(0)
        batch.seq_lens.add_(1)
        if getattr(batch, "seq_lens_cpu", None) is not None:
            batch.seq_lens_cpu.add_(1)
        keep = torch.tensor(unfinished, dtype=torch.int64)
        self.v1_running = keep
        if len(unfinished) < bs:  # as SGLang's: the slots of the requests still running
            batch.out_cache_loc = batch.out_cache_loc[keep]
        next_name = shape.pick("EagleVerifyOutput", VERIFY_OUTPUT_NEXT)
        root = shape.pick("EagleDraftInput", ROOT)
        if next_name == "draft_extend_input":
            next_input = self.module.EagleDraftExtendInput(
                input_ids=predict[keep], hidden_states=vi.hidden_states[keep]
            )
        else:
            next_input = self.module.EagleDraftInput(
                **{root: predict[keep]},
                hidden_states=vi.hidden_states[keep],
                accept_length=torch.zeros(len(unfinished), dtype=torch.int32),
                accept_length_cpu=[0] * len(unfinished),
            )
        out = self.module.EagleVerifyOutput(
            **{
                next_name: next_input,
                "logits_output": logits_output,
                shape.pick("EagleVerifyOutput", VERIFY_OUTPUT_TOKENS): predict,
                shape.pick("EagleVerifyOutput", VERIFY_OUTPUT_PER_REQ): [0] * bs,
                shape.pick("EagleVerifyOutput", VERIFY_OUTPUT_INDICES): torch.arange(bs),
            }
        )
        return out

    # -- worker -----------------------------------------------------------------------------

    def _make_worker(self) -> Any:
        shape, rec, world = self.shape, self.recorder, self
        target = _TargetWorker(world)

        @contextlib.contextmanager
        def draft_tp_context(group):
            rec.add("draft_tp_enter", group=group)
            yield

        if shape.variant == "v1":
            base = (
                _TupleEntry
                if "forward_batch_speculative_generation" in (shape.worker_members)
                else _ResultEntry
            )
            members: dict[str, Any] = {}
            if "add_logprob_values" in shape.worker_members:
                members["add_logprob_values"] = lambda self, batch, res, lo: rec.add(
                    "add_logprob_values", res=res
                )
            if "_draft_preprocess_idle" in shape.worker_members:
                members["_draft_preprocess_idle"] = lambda self, batch: world._preprocess_idle(
                    batch
                )
            members["forward_draft_extend_after_decode"] = lambda self, batch: (
                world._draft_extend_v1(batch)
            )
            if base is _ResultEntry:  # a prefill as SGLang's; a decode step: None
                members["forward_batch_generation"] = lambda self, batch: (
                    world._prefill_v1(batch) if batch.forward_mode.is_extend() else None
                )
            cls = type("EAGLEWorker", (base,), {**members, "__module__": self.module.__name__})
            worker = cls()
            worker.draft_model_runner = types.SimpleNamespace(tp_group="draft-tp")
            worker.token_to_kv_pool_allocator = "allocator"
            worker.page_size = 1
        else:
            entry = clone(
                shape.signatures["worker.forward_batch_generation"],
                "forward_batch_generation",
                self._entry_v2,
                note="a prefill runs the target, then the draft's pass; a decode step: None",
            )
            cls = type(
                "EAGLEWorkerV2",
                (),
                {"__module__": self.module.__name__, "forward_batch_generation": entry},
            )
            if "_compute_spec_v2_logprobs" in shape.worker_members:
                cls._compute_spec_v2_logprobs = lambda self, batch, lo, predict, accept_index: (
                    rec.add(
                        "logprobs_v2", accept_index=accept_index.clone(), predict=predict.clone()
                    )
                )
            worker = cls()
            worker.speculative_num_draft_tokens = 4
            worker.speculative_num_steps = 3
            worker.req_to_token_pool = types.SimpleNamespace(req_to_token=self.req_to_token)
            if "topk" in shape.worker_members:  # 0.5.14+: the resolved topk
                worker.topk = self.server_args.speculative_eagle_topk
            worker.draft_worker = self._make_draft_worker()
        worker.server_args = self.server_args
        worker.target_worker = target
        worker.draft_tp_context = draft_tp_context
        worker.tp_rank = 0
        # v1: the fallback must not touch it; v2: a present one is refused (see the tests).
        worker.adaptive_controller = _ForbiddenController() if shape.variant == "v1" else None
        self.module.__dict__[type(worker).__name__] = type(worker)
        return worker

    def _make_draft_worker(self) -> Any:
        """EagleDraftWorker stand-in: the members that release's draft worker has.

        Its draft-extend runs without a CUDA graph unless a test gives it one
        (``cuda_graph_runner_for_draft_extend``), as on a server with CUDA graphs off.
        """
        shape = self.shape
        extend = shape.signatures["draft._draft_extend_for_decode"].split(", ", 1)[1]
        members: dict[str, Any] = {}
        prefill = shape.signatures.get("draft._draft_extend_for_prefill")
        if prefill is not None:  # a method of the class, as SGLang's: the runtime replaces it
            helpers = {PREFILL_TAIL_HELPER: eagle_prefill_tail_tokens}
            members["_draft_extend_for_prefill"] = clone(
                prefill,
                "_draft_extend_for_prefill",
                self._draft_pass_for_prefill,
                note="the draft's pass over a prefill's shifted tokens, as SGLang's",
                module_globals=helpers if PREFILL_TAIL_HELPER in shape.module_names else None,
            )
        draft = type("EagleDraftWorker", (), members)()
        draft.draft_runner = types.SimpleNamespace(
            tp_group="draft-tp", server_args=self.server_args
        )
        draft._draft_extend_for_decode = clone(
            extend,
            "_draft_extend_for_decode",
            self._draft_extend_v2,
            note="replays self.cuda_graph_runner_for_draft_extend where it can, as SGLang's",
        )
        draft_members = shape.draft_worker_members
        if "draft_tp_context" in draft_members:
            signature = shape.signatures.get("draft_tp_context", "tp_group")
            draft.draft_tp_context = clone(signature, "draft_tp_context", self._tp_enter)
        if "draft_owns_attention" in draft_members:
            draft.draft_owns_attention = "owns-attention"
        if "parallel_layout" in draft_members:
            draft.parallel_layout = "draft-layout"
        optional = {
            "speculative_num_steps": 3,
            "speculative_num_draft_tokens": 4,
            "topk": 1,
            "server_args": self.server_args,
            "cuda_graph_runner_for_draft_extend": None,
            "draft_extend_attn_backend": None,
        }
        for name, value in optional.items():
            if name in shape.draft_worker_members:
                setattr(draft, name, value)
        return draft

    def _draft_extend_v1(self, batch: Any) -> Any:
        """Records the input; with a draft model, stores its KV for the requests still
        running (their token at position L, slot L: what verify() left in the batch) and,
        where verify() returns a draft-extend input, returns a draft state as SGLang's."""
        info = batch.spec_info
        self.recorder.add("draft_extend", spec_info=info, seq_lens=batch.seq_lens.clone())
        runner = self.worker.draft_model_runner
        tokens = getattr(info, "input_ids", None)
        if tokens is None:
            tokens = getattr(info, self.shape.pick("EagleDraftInput", ROOT))
        if getattr(runner, "model", None) is not None:
            positions = batch.seq_lens[self.v1_running] - 1
            runner.model.model.forward_draft_extend(
                tokens, positions, info.hidden_states, runner.token_to_kv_pool, batch.out_cache_loc
            )
        if self.shape.has_field("EagleVerifyOutput", "draft_extend_input"):
            root = self.shape.pick("EagleDraftInput", ROOT)
            return self.module.EagleDraftInput(
                **{root: info.input_ids},
                hidden_states=info.hidden_states,
                topk_p=torch.ones(len(tokens), 1),
                topk_index=tokens.to(torch.int64)[:, None] + 3,
            )
        return None

    def _preprocess_idle(self, batch: Any) -> None:
        self.recorder.add("preprocess_idle")
        batch.spec_info = "idle-draft-input"

    def _draft_extend_v2(self, args: dict[str, Any]) -> None:
        """Records the inputs and emulates _draft_extend_for_decode: the draft worker's own
        width (its ``speculative_num_draft_tokens``, as SGLang reads it), the select_index,
        and the rebinding of batch fields its prepare_for_extend_to_fill_draft_kvcache does."""
        batch, result = args["batch"], args["batch_result"]
        draft = self.worker.draft_worker
        width = getattr(
            draft, "speculative_num_draft_tokens", self.worker.speculative_num_draft_tokens
        )
        bs = len(batch.seq_lens)
        select = torch.arange(bs) * width + result.accept_lens - 1
        self.recorder.add(
            "draft_extend_v2",
            width=width,
            steps=getattr(draft, "speculative_num_steps", None),
            graph=getattr(draft, "cuda_graph_runner_for_draft_extend", None),
            backend=getattr(draft, "draft_extend_attn_backend", None),
            out_cache_loc=batch.out_cache_loc.clone(),
            seq_lens=batch.seq_lens.clone(),
            input_ids=result.next_token_ids.clone(),
            hidden=result.logits_output.hidden_states.clone(),
            selected_hidden=result.logits_output.hidden_states[select].clone(),
            selected_tokens=result.next_token_ids[select].clone(),
            kwargs={k: v for k, v in args.items() if k not in ("self", "batch", "batch_result")},
        )
        runner = draft.draft_runner
        if getattr(runner, "model", None) is not None:  # a draft model: its KV goes to the pool
            positions = (batch.seq_lens[:, None] + torch.arange(width)).reshape(-1)
            runner.model.model.forward_draft_extend(
                result.next_token_ids,
                positions,
                result.logits_output.hidden_states,
                runner.token_to_kv_pool,
                batch.out_cache_loc,
            )
        batch.input_ids = result.next_token_ids
        batch.seq_lens = batch.seq_lens + width
        batch.forward_mode = "DRAFT_EXTEND_V2"
        if self.fail_draft_extend_at_width == width:
            raise RuntimeError(f"draft-extend failed at width {width}")
        draft_input = result.next_draft_input
        draft_input.hidden_states = result.logits_output.hidden_states[select]

    def _entry_v2(self, args: dict[str, Any]) -> Any:
        """EAGLEWorkerV2.forward_batch_generation: a prefill as SGLang's (``_prefill_v2``);
        for a decode step (SGLang's speculative step, not modelled here) None."""
        batch = next(v for k, v in args.items() if k in ("batch", "model_worker_batch"))
        if not batch.forward_mode.is_extend():
            return None
        return self._prefill_v2(batch)

    def _prefill_v2(self, batch: Any) -> Any:
        """SGLang's v2 prefill: the target's forward (FULL hidden states), then the draft
        worker's ``_draft_extend_for_prefill`` (``_draft_pass_for_prefill``)."""
        next_ids, hidden = self._target_prefill(batch)
        draft_input = self.worker.draft_worker._draft_extend_for_prefill(
            batch, hidden, next_ids, getattr(batch, "mm_input_embeds", None)
        )
        return types.SimpleNamespace(
            next_token_ids=next_ids,
            logits_output=types.SimpleNamespace(hidden_states=hidden),
            next_draft_input=draft_input,
        )

    def _draft_pass_for_prefill(self, args: dict[str, Any]) -> Any:
        """SGLang's ``_draft_extend_for_prefill``: each request's tokens shifted by one, its
        last the target's next token (where the release has the helper, the helper's: a
        chunk's next prompt token), left in ``batch.input_ids``; through the draft model (which
        stores their draft KV); the next draft state from the draft's logits, its root the
        target's next tokens. Recorded as "prefill"."""
        batch, next_ids = args["batch"], args["next_token_ids"]
        tail = next_ids
        if PREFILL_TAIL_HELPER in self.shape.module_names:
            tail = eagle_prefill_tail_tokens(batch, next_ids)
        shifted = _shifted(batch.input_ids, batch.extend_lens, tail)
        batch.input_ids = shifted
        runner = self.worker.draft_worker.draft_runner
        topk_p, topk_index, draft_hidden = self._draft_prefill_forward(
            batch, runner, args["target_hidden_states"], shifted
        )
        root = self.shape.pick("EagleDraftInput", ROOT)
        return self.module.EagleDraftInput(
            **{root: next_ids}, topk_p=topk_p, topk_index=topk_index, hidden_states=draft_hidden
        )

    def _prefill_v1(self, batch: Any) -> Any:
        """SGLang's v1 prefill (0.5.12.post1's ``forward_target_extend`` then
        ``forward_draft_extend``): as v2's, the next draft state left on ``batch.spec_info``."""
        next_ids, hidden, draft_input = self._prefill(batch, self.worker.draft_model_runner)
        batch.spec_info = draft_input
        return types.SimpleNamespace(
            logits_output=types.SimpleNamespace(hidden_states=hidden),
            next_token_ids=next_ids,
            num_correct_drafts=0,
            can_run_cuda_graph=True,
        )

    def _prefill(self, batch: Any, runner: Any) -> tuple[Any, Any, Any]:
        """(next token ids, the target's hidden states, the next draft state) of a prefill."""
        next_ids, hidden = self._target_prefill(batch)
        shifted = _shifted(batch.input_ids, batch.extend_lens, next_ids)
        topk_p, topk_index, draft_hidden = self._draft_prefill_forward(
            batch, runner, hidden, shifted
        )
        draft_input = types.SimpleNamespace(
            topk_p=topk_p, topk_index=topk_index, hidden_states=draft_hidden
        )
        return next_ids, hidden, draft_input

    def _target_prefill(self, batch: Any) -> tuple[Any, Any]:
        """(next token ids, the target's hidden states) of a prefill."""
        hidden = target_hidden(batch.input_ids)
        lens = torch.tensor(batch.extend_lens)
        last = torch.cumsum(lens, 0) - 1
        return target_logits(batch.input_ids[last]).argmax(-1), hidden

    def _draft_prefill_forward(
        self, batch: Any, runner: Any, hidden: Any, shifted: Any
    ) -> tuple[Any, Any, Any]:
        """The draft model's pass over a prefill's shifted tokens (its prefill graph where the
        runner has one): (top-k probabilities, top-k tokens, the draft's hidden states)."""
        lens = torch.tensor(batch.extend_lens)
        starts = torch.cumsum(lens, 0) - lens
        forward_batch = types.SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            spec_info=types.SimpleNamespace(hidden_states=hidden),
            out_cache_loc=batch.out_cache_loc,
            positions=batch.positions,
            token_to_kv_pool=runner.token_to_kv_pool,
            extend_start_loc=starts,
            extend_seq_lens=lens,
            mm_input_embeds=getattr(batch, "mm_input_embeds", None),
        )
        graph = getattr(runner, "prefill_cuda_graph_runner", None)
        if graph is not None:  # 0.5.17+: ModelRunner._forward_raw replays the prefill graph
            draft_out = graph.execute(shifted, batch.positions, forward_batch)
        else:
            draft_out = runner.model.forward(shifted, batch.positions, forward_batch)
        probs = torch.softmax(draft_out.next_token_logits, dim=-1)
        topk_p, topk_index = probs.topk(1, dim=-1)
        self.recorder.add("prefill", shifted=shifted, slots=batch.out_cache_loc.clone())
        return topk_p, topk_index, draft_out.hidden_states

    # -- batch ------------------------------------------------------------------------------

    def _make_batch(self, bs: int, seq_len: int, max_new_tokens: int) -> Any:
        root_name = self.shape.pick("EagleDraftInput", ROOT)
        roots = torch.arange(bs, dtype=torch.int32) + 1
        spec_info = self.module.EagleDraftInput(
            **{root_name: roots}, hidden_states=torch.zeros(bs, HIDDEN)
        )
        batch = self.module.ScheduleBatch() if self.shape.variant == "v1" else _V2Batch()
        batch.reqs = [Req(max_new_tokens=max_new_tokens) for _ in range(bs)]
        batch.seq_lens = torch.full((bs,), seq_len, dtype=torch.int64)
        batch.seq_lens_cpu = batch.seq_lens.clone()
        batch.seq_lens_sum = seq_len * bs
        batch.req_pool_indices = torch.arange(bs, dtype=torch.int64) + 2
        batch.forward_mode = ForwardMode.DECODE
        batch.is_extend_in_batch = False
        batch.has_grammar = False
        batch.return_logprob = False
        batch.return_hidden_states = False
        batch.global_num_tokens = None
        batch.input_ids = torch.zeros(bs, dtype=torch.int32)
        batch.out_cache_loc = torch.zeros(bs, dtype=torch.int64)
        batch.capture_hidden_mode = CaptureHiddenMode.LAST
        batch.sampling_info = types.SimpleNamespace(
            penalizer_orchestrator=Orchestrator(False, self.recorder),
            vocab_size=VOCAB,
            vocab_mask="stale-mask",
            is_all_greedy=True,
            logit_bias=None,
            has_custom_logit_processor=False,
        )
        batch.model_config = types.SimpleNamespace(think_end_id=None)
        if self.shape.has_field("EagleDraftInput", "allocate_lens"):
            spec_info.allocate_lens = batch.seq_lens + 8
        batch.spec_info = spec_info
        return batch


class DraftAttentionBackend:
    """A draft-extend attention backend: the widths it read from the server args (as the
    triton backend does in its __init__)."""

    def __init__(self, server_args: Any, label: str, spec_config: Any = None) -> None:
        self.label = label
        widths = server_args if spec_config is None else spec_config  # 0.5.17+: get_spec()
        self.speculative_num_steps = widths.speculative_num_steps
        self.num_draft_tokens = widths.speculative_num_draft_tokens


class DraftBackendFactory:
    """SGLang's DraftBackendFactory: builds the draft-extend backend from the server args.

    World binds a subclass per world (``world``), which records what it made.
    """

    world: Any = None

    def __init__(self, server_args: Any, draft_runner: Any, topk: int, num_steps: int) -> None:
        self.server_args = server_args

    def create_draft_extend_backend(self) -> DraftAttentionBackend:
        made = self.world.draft_backends_made
        get_spec = getattr(self.world.module, "get_spec", None)
        spec_config = get_spec() if get_spec is not None else None
        backend = DraftAttentionBackend(self.server_args, f"extend-{len(made)}", spec_config)
        made.append(backend)
        return backend


class DraftExtendGraphRunner:
    """SGLang's EAGLEDraftExtendCudaGraphRunner: constructing it is capturing (recorded).

    Its width is the server args' ``speculative_num_draft_tokens`` (0.5.13.post1's rule).
    World binds a subclass per world: ``world.fail_extend_capture`` makes a construction
    raise, ``world.extend_captures`` records what each one saw, ``replays`` the replays.
    """

    world: Any = None

    def __init__(
        self,
        eagle_worker: Any,
        *,
        draft_extend_attn_backend: Any = None,
        speculative_num_steps: int | None = None,
    ) -> None:
        args = eagle_worker.draft_runner.server_args
        self.seen = {
            "worker_width": eagle_worker.speculative_num_draft_tokens,
            "worker_steps": eagle_worker.speculative_num_steps,
            "args_width": args.speculative_num_draft_tokens,
            "args_steps": args.speculative_num_steps,
            "steps_kwarg": speculative_num_steps,
            "backend": draft_extend_attn_backend,
            "worker_backend": eagle_worker.draft_extend_attn_backend,
            "cuda_graph_bs": list(getattr(args, "cuda_graph_bs", None) or []),
        }
        if self.world.fail_extend_capture is not None:
            raise self.world.fail_extend_capture
        self.num_tokens_per_bs = args.speculative_num_draft_tokens
        self.capture_bs = self.seen["cuda_graph_bs"] or [1, 2, 4, 8]
        self.disable_padding = False
        self.forward_mode = "DRAFT_EXTEND_V2"
        self.seq_len_fill_value = 1
        self.replays: list[Any] = []
        self.world.extend_captures.append(self)

    def replay(self, forward_batch: Any) -> None:
        draft = self.world.worker.draft_worker
        self.replays.append((forward_batch, draft.speculative_num_draft_tokens))


class _BatchBase:
    """ScheduleBatch stand-in (attributes are set by World)."""

    def batch_size(self) -> int:
        return len(self.reqs)

    def _evict(self) -> None:
        self._evicted = True

    def get_model_worker_batch(self) -> Any:
        spec = self.spec_info
        return types.SimpleNamespace(
            bid=77,
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens_cpu,
            seq_lens_sum=self.seq_lens_sum,
            out_cache_loc=self.out_cache_loc,
            spec_info=spec,
            capture_hidden_mode=getattr(spec, "capture_hidden_mode", CaptureHiddenMode.NULL),
        )


class _V2Batch:
    """ModelWorkerBatch (<= 0.5.12) / ScheduleBatch (0.5.13) stand-in."""


class _ForbiddenController:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the fallback touched adaptive_controller.{name}")


class _TargetWorker:
    def __init__(self, world: World) -> None:
        self.world = world
        self.model_runner = types.SimpleNamespace()
        setattr(self.model_runner, world.shape.graph_attr, world.graph_sentinel)
        self.fail_with: Exception | None = None
        # The release's own parameters, so inspect.signature and the call see them.
        signature = world.shape.signatures["target.forward_batch_generation"]
        self._batch_param = signature.split(",")[0].split("=")[0].strip()
        self.forward_batch_generation = clone(signature, "forward_batch_generation", self._call)

    def _call(self, args: dict[str, Any]) -> Any:
        mwb = args[self._batch_param]
        flag = bool(args[self.world.shape.target_kwarg])
        # 0.5.16+ read the capture mode from this keyword only (None: derived, so NULL for a
        # batch without spec info); older releases read the batch's attribute.
        if "capture_hidden_mode" in args:
            capture = args["capture_hidden_mode"] or CaptureHiddenMode.NULL
        else:
            capture = mwb.capture_hidden_mode
        return self._forward(mwb, flag, capture)

    def _forward(self, mwb: Any, flag: bool, capture: Any) -> Any:
        world = self.world
        world.recorder.add(
            "target_forward",
            flag=flag,
            mode=mwb.forward_mode,
            spec_info=mwb.spec_info,
            capture=mwb.capture_hidden_mode,
            capture_effective=capture,
            seq_lens=mwb.seq_lens.clone(),
            seq_lens_is_batch_tensor=mwb.seq_lens is world.batch.seq_lens,
            seq_lens_cpu=None if mwb.seq_lens_cpu is None else mwb.seq_lens_cpu.clone(),
            seq_lens_sum=mwb.seq_lens_sum,
            batch_seq_lens=world.batch.seq_lens.clone(),
            input_ids=mwb.input_ids.clone(),
            out_cache_loc=mwb.out_cache_loc.clone(),
            graph=getattr(self.model_runner, world.shape.graph_attr),
            attn_backend=getattr(self.model_runner, "attn_backend", None),
        )
        if self.fail_with is not None:
            raise self.fail_with
        full = capture == CaptureHiddenMode.FULL
        logits_output = types.SimpleNamespace(
            next_token_logits=target_logits(mwb.input_ids),
            hidden_states=target_hidden(mwb.input_ids) if full else None,
        )
        if world.shape.target_kwarg == "skip_sample":
            return logits_output, None, True
        return types.SimpleNamespace(logits_output=logits_output, can_run_cuda_graph=True)


class _TupleEntry:
    def forward_batch_speculative_generation(self, batch):
        if batch.forward_mode.is_decode():
            return (1, 2, 3, 4, 5)
        return (1, 2, 3, 0, False)


class _ResultEntry:
    def forward_batch_generation(self, batch):
        return None


class ConfigBag:
    """SGLang 0.5.17+'s ``_ConfigBag``: read-only leaves, a scoped ``override``."""

    def __init__(self, path: str, **leaves: Any) -> None:
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_fields", dict(leaves))
        for name, value in leaves.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"config namespace {self._path!r} is read-only")

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    @contextlib.contextmanager
    def override(self, **kwargs: Any) -> Any:
        unknown = set(kwargs) - set(self._fields)
        if unknown:
            raise ValueError(f"unknown config leaf for {self._path!r}: {sorted(unknown)}")
        saved = {name: self._fields[name] for name in kwargs}
        for name, value in kwargs.items():
            self._fields[name] = value
            object.__setattr__(self, name, value)
        try:
            yield self
        finally:
            for name, value in saved.items():
                self._fields[name] = value
                object.__setattr__(self, name, value)


class GrammarTree:
    """0.5.17+'s GrammarTree: the tree's links and tokens, copied to the host."""

    def __init__(self, host: tuple[torch.Tensor, ...]) -> None:
        self._host = host

    @classmethod
    def from_device(cls, retrieve_next_token, retrieve_next_sibling, draft_token):
        return cls((retrieve_next_token.cpu(), retrieve_next_sibling.cpu(), draft_token.cpu()))

    def resolve(self) -> tuple[torch.Tensor, ...]:
        return self._host


# -- a one-layer EAGLE-3 draft model and its KV pool ----------------------------------------
#
# Written the way SGLang's llama_eagle3.LlamaModel / LlamaDecoderLayer / LlamaAttention and
# its triton backend run a draft-extend: the attention backend stores K and V (after rotary)
# at out_cache_loc, then attends. The runtime's draft KV write computes K and V from the same
# modules on its own path; these forwards are what it must agree with.

DRAFT_HIDDEN = 2  # the draft's width; the target's hidden states (HIDDEN) are 2 aux x 2
DRAFT_HEADS, DRAFT_KV_HEADS, HEAD_DIM = 2, 1, 2


class RMSNorm(torch.nn.Module):
    def __init__(self, width: int, scale: float) -> None:
        super().__init__()
        # Uneven weights: a norm that only rescaled a row would vanish in the next norm.
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width) * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class VocabParallelEmbedding(torch.nn.Embedding):
    """Token ids arrive as int64, as in every forward batch SGLang builds (its draft-extend
    casts the sampled ids, which are int32, before it)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert input_ids.dtype == torch.int64, input_ids.dtype
        return super().forward(input_ids)


class RotaryEmbedding(torch.nn.Module):
    """Rotates each (even, odd) pair of q and k by ``position`` radians."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Any:
        def rotate(x: torch.Tensor) -> torch.Tensor:
            pairs = x.reshape(x.shape[0], -1, 2)
            cos = positions.float().cos()[:, None]
            sin = positions.float().sin()[:, None]
            even, odd = pairs[..., 0], pairs[..., 1]
            return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).reshape(
                x.shape
            )

        return rotate(q), rotate(k)


class RadixAttention:
    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id
        self.tp_q_head_num, self.tp_k_head_num, self.tp_v_head_num = (
            DRAFT_HEADS,
            DRAFT_KV_HEADS,
            DRAFT_KV_HEADS,
        )
        self.qk_head_dim = self.v_head_dim = HEAD_DIM
        self.k_scale = self.v_scale = None
        self.sliding_window_size = -1


class LlamaAttention(torch.nn.Module):
    def __init__(self, in_width: int) -> None:
        super().__init__()
        self.q_size, self.kv_size = DRAFT_HEADS * HEAD_DIM, DRAFT_KV_HEADS * HEAD_DIM
        self.qkv_proj = torch.nn.Linear(in_width, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = torch.nn.Linear(self.q_size, DRAFT_HIDDEN, bias=False)
        self.rotary_emb = RotaryEmbedding()
        self.attn = RadixAttention(layer_id=0)

    def forward_prepare_native(self, positions: torch.Tensor, hidden_states: torch.Tensor):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, fb: Any) -> Any:
        q, k, v = self.forward_prepare_native(positions, hidden_states)
        attn = self.attn
        fb.pool.set_kv_buffer(
            attn,
            fb.out_cache_loc,
            k.view(-1, attn.tp_k_head_num, attn.qk_head_dim),
            v.view(-1, attn.tp_v_head_num, attn.v_head_dim),
        )
        return self.o_proj(q)  # (not attention: what it returns is not what a KV write is about)


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.is_input_layer = True
        self.input_layernorm = RMSNorm(DRAFT_HIDDEN, 1.5)
        self.hidden_norm = RMSNorm(DRAFT_HIDDEN, 0.5)
        self.self_attn = LlamaAttention(2 * DRAFT_HIDDEN)

    def forward(self, positions, embeds, hidden_states, fb, residual):
        hidden_states = self.hidden_norm(hidden_states)
        embeds = self.input_layernorm(embeds)
        hidden_states = torch.cat([embeds, hidden_states], dim=-1)
        return self.self_attn(positions, hidden_states, fb), residual


class LlamaModel(torch.nn.Module):
    """llama_eagle3.LlamaModel; ``fc_norm`` / ``input_norm`` as 0.5.12+ / 0.5.17+ add them."""

    def __init__(self, *, fc_norm: bool = False, input_norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed_tokens = VocabParallelEmbedding(VOCAB, DRAFT_HIDDEN)
        self.num_aux_hidden_states = HIDDEN // DRAFT_HIDDEN
        self.fc = torch.nn.Linear(HIDDEN, DRAFT_HIDDEN, bias=False)
        self.fc_norm = (
            torch.nn.ModuleList(
                [RMSNorm(DRAFT_HIDDEN, 2.0) for _ in range(self.num_aux_hidden_states)]
            )
            if fc_norm
            else None
        )
        self.input_norm = RMSNorm(HIDDEN, 3.0) if input_norm else None
        self.layers = torch.nn.ModuleList([LlamaDecoderLayer()])
        self.is_mrope_enabled = False
        self.passes = 0

    def forward(
        self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None
    ):
        """llama_eagle3.LlamaModel.forward: the draft pass of a prefill, its K and V stored
        through the attention; (last hidden state, [auxiliary one]). Counted in ``passes``."""
        self.passes += 1
        if input_embeds is None:
            input_embeds = getattr(forward_batch, "mm_input_embeds", None)
        hidden = self.forward_draft_extend(
            input_ids,
            positions,
            forward_batch.spec_info.hidden_states,
            forward_batch.token_to_kv_pool,
            forward_batch.out_cache_loc,
            embeds=input_embeds,
        )
        return hidden, [hidden]

    def forward_draft_extend(
        self, input_ids, positions, hidden_states, pool, out_cache_loc, embeds=None
    ):
        fb = types.SimpleNamespace(pool=pool, out_cache_loc=out_cache_loc)
        if embeds is None:
            embeds = self.embed_tokens(input_ids.long())
        if hidden_states.shape[-1] != embeds.shape[-1]:  # (0.5.10 has neither norm)
            if getattr(self, "input_norm", None) is not None:
                hidden_states = self.input_norm(hidden_states)
            if getattr(self, "fc_norm", None) is not None:
                chunks = hidden_states.chunk(self.num_aux_hidden_states, dim=-1)
                hidden_states = torch.cat(
                    [norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)],
                    dim=-1,
                )
            hidden_states = self.fc(hidden_states)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, embeds, hidden_states, fb, residual)
        return hidden_states


class DraftCausalLM:
    """llama_eagle3.LlamaForCausalLMEagle3: its LlamaModel (``model``, called as a module, so
    an instance ``forward`` takes its place), then the LM head over each request's last token
    (LAST capture: those tokens' hidden states travel on)."""

    def __init__(self, **model_kwargs: Any) -> None:
        self.model = LlamaModel(**model_kwargs)
        self.lm_head = torch.nn.Linear(DRAFT_HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, positions, forward_batch) -> Any:
        return self.head(self.model(input_ids, positions, forward_batch, None), forward_batch)

    def head(self, model_out: tuple[Any, Any], forward_batch: Any) -> Any:
        """The LM head over each request's last token of the LlamaModel's output."""
        hidden, aux = model_out
        last = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
        return types.SimpleNamespace(
            next_token_logits=self.lm_head(hidden[last]), hidden_states=aux[0][last]
        )


class PrefillCudaGraph:
    """The draft's prefill CUDA graph of SGLang 0.5.17+ (``ModelRunner.prefill_cuda_graph_runner``,
    the "breakable" backend): it replays the kernels of the LlamaModel's own forward captured
    at start-up, so a ``forward`` set on the model instance later is never called. Counts its
    replays."""

    def __init__(self, model: DraftCausalLM) -> None:
        self.model = model
        self.replays = 0

    def execute(self, input_ids: Any, positions: Any, forward_batch: Any) -> Any:
        self.replays += 1
        inner = self.model.model
        captured = type(inner).forward(inner, input_ids, positions, forward_batch, None)
        return self.model.head(captured, forward_batch)


class MHATokenToKVPool:
    """SGLang's plain KV pool: one K and one V buffer per layer, indexed by slot."""

    def __init__(self, slots: int = 8192) -> None:
        self.dtype = self.store_dtype = torch.float32
        self.k_buffer = [torch.zeros(slots, DRAFT_KV_HEADS, HEAD_DIM)]
        self.v_buffer = [torch.zeros(slots, DRAFT_KV_HEADS, HEAD_DIM)]
        self.writes: list[torch.Tensor] = []

    def set_kv_buffer(self, layer: Any, loc: torch.Tensor, cache_k, cache_v) -> None:
        self.writes.append(loc.clone())
        self.k_buffer[layer.layer_id][loc] = cache_k.detach().to(self.store_dtype)
        self.v_buffer[layer.layer_id][loc] = cache_v.detach().to(self.store_dtype)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]


class FakeCapture:
    """``dynspec_fallback.graph_capture``'s capturer with a CUDA graph's semantics on a CPU: the
    body runs once when captured, and each replay runs it again on the same tensors, refilling
    the outputs that capture returned. Counts captures (their row counts) and replays."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.captured: list[int] = []  # the rows of each captured body's outputs
        self.replays = 0

    def __call__(self, body: Any) -> tuple[Any, Any]:
        if self.fail is not None:
            raise self.fail
        outputs = body()
        self.captured.append(int(outputs[0].shape[0]))

        def replay() -> None:
            self.replays += 1
            for static, fresh in zip(outputs, body(), strict=True):
                static.copy_(fresh)

        return replay, outputs


def draft_state(batch: Any) -> None:
    """Give ``batch`` the draft state a decode batch carries (a prefill's or the last step's
    draft-extend)."""
    bs = len(batch.seq_lens)
    batch.spec_info.topk_p = torch.ones(bs, 1)
    batch.spec_info.topk_index = torch.arange(bs)[:, None] + 7
    batch.spec_info.hidden_states = torch.full((bs, 2), 0.25)



def new_decode_batch(world: World, bs: int, seq_len: int) -> Any:
    """A fresh decode batch of ``bs`` requests of length ``seq_len`` with its draft state, made
    ``world``'s batch."""
    world.batch = world._make_batch(bs, seq_len, 100)
    draft_state(world.batch)
    return world.batch


def new_prefill_batch(
    extend_lens: list[int], first_slot: int = 6000, prefix_lens: list[int] | None = None
) -> Any:
    """A prefill batch of requests adding ``extend_lens`` tokens to contexts of
    ``prefix_lens`` tokens (default: empty ones), into consecutive slots from
    ``first_slot``."""
    batch = _V2Batch()
    tokens = sum(extend_lens)
    prefixes = list(prefix_lens) if prefix_lens is not None else [0] * len(extend_lens)
    batch.forward_mode = ForwardMode.EXTEND
    batch.is_extend_in_batch = False
    batch.extend_lens = list(extend_lens)
    batch.prefix_lens = prefixes
    batch.chunked_req = None
    batch.chunked_req_next_prompt_token = None
    batch.input_ids = (torch.arange(tokens, dtype=torch.int64) * 5 + 3) % VOCAB
    spans = list(zip(prefixes, extend_lens, strict=True))
    batch.positions = torch.cat([torch.arange(p, p + n, dtype=torch.int64) for p, n in spans])
    batch.seq_lens = torch.tensor([p + n for p, n in spans], dtype=torch.int64)
    batch.out_cache_loc = torch.arange(tokens, dtype=torch.int64) + first_slot
    batch.spec_info = None
    return batch


# SGLang's helper (0.5.13+) that gives each request of a prefill its last token for the
# draft's pass; the stand-in draft worker's module has it where the release's has it.
PREFILL_TAIL_HELPER = "_eagle_prefill_tail_tokens"


def eagle_prefill_tail_tokens(batch: Any, next_token_ids: Any) -> Any:
    """As SGLang's ``_eagle_prefill_tail_tokens``: the target's next tokens, but for the
    request whose prompt is still being chunked its next prompt token."""
    tail = next_token_ids.to(batch.input_ids.dtype)
    if batch.chunked_req_next_prompt_token is not None:
        for i, req in enumerate(batch.reqs):
            if req is batch.chunked_req:
                tail = tail.clone()
                tail[i] = batch.chunked_req_next_prompt_token
                break
    return tail


def _shifted(input_ids: Any, extend_lens: list[int], tail: Any) -> Any:
    """Each request's tokens shifted left by one, its last ``tail[i]``."""
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    return torch.cat(
        [
            torch.cat([input_ids[s + 1 : s + n], tail[i : i + 1].to(input_ids.dtype)])
            for i, (s, n) in enumerate(zip(starts, extend_lens, strict=True))
        ]
    )


def draft_runner(world: World) -> Any:
    """The draft model runner of ``world``'s worker (v1: the worker's own, v2: its draft
    worker's)."""
    if world.shape.variant == "v1":
        return world.worker.draft_model_runner
    return world.worker.draft_worker.draft_runner


def world_with_draft_model(shape: Any, **server_args: Any) -> World:
    """A World on ``shape`` (threshold 2 and a minimum dwell of one step unless given) whose
    draft runner has a one-layer EAGLE-3 draft model, its batch holding draft state."""
    server_args.setdefault("threshold", 2)
    server_args.setdefault("speculative_disable_min_dwell_steps", 1)
    world = World(shape, **server_args)
    give_draft_model(world)
    draft_state(world.batch)
    return world


def give_draft_model(world: World, **model_kwargs: Any) -> Any:
    """Attach a one-layer EAGLE-3 draft model and a KV pool to ``world``'s draft runner."""
    runner = draft_runner(world)
    runner.model = DraftCausalLM(**model_kwargs)
    runner.token_to_kv_pool = MHATokenToKVPool()
    runner.attn_backend = types.SimpleNamespace(dcp_size=1)
    return runner


def package_says_release(monkeypatch: Any, world: World, release: str) -> None:
    """Make the stand-in worker module's package say it is ``release``, the way SGLang's
    ``sglang.version.__version__`` does (``dynspec_fallback.sglang_release`` reads it)."""
    version = types.ModuleType(f"{world.module.__name__}.version")
    version.__version__ = release  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, world.module.__name__, world.module)
    monkeypatch.setitem(sys.modules, version.__name__, version)


def reference_draft_kv(world: World, seq_len: int, bs: int) -> tuple[Any, Any, Any]:
    """(slots, K, V) the stand-in draft model's own draft-extend stores for the rows of a
    fallback step at ``bs`` requests of length ``seq_len``: the target's token after each
    root, at position L, in the slot the step took for L."""
    batch = world._make_batch(bs, seq_len, 100)
    roots = getattr(batch.spec_info, "bonus_tokens", None)
    if roots is None:
        roots = batch.spec_info.verified_id
    predicted = target_logits(roots).argmax(-1)
    slots = world.req_to_token[batch.req_pool_indices, seq_len].to(torch.int64)
    pool = MHATokenToKVPool()
    model = draft_runner(world).model.model
    model.forward_draft_extend(predicted, batch.seq_lens, target_hidden(roots), pool, slots)
    return slots, pool.k_buffer[0][slots], pool.v_buffer[0][slots]


def stored_draft_kv(world: World, slots: Any) -> tuple[Any, Any]:
    """(K, V) the draft runner's KV pool holds at ``slots``."""
    pool = draft_runner(world).token_to_kv_pool
    return pool.k_buffer[0][slots], pool.v_buffer[0][slots]
