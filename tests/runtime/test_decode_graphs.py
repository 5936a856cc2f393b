"""Target DECODE graphs for fallback steps, and the step profiler.

The graph runner here is a stand-in class that records what SGLang's own ``CudaGraphRunner``
would see while it captures: a non-speculative runner (so it captures DECODE, one token per
request, and no verify spec-info), a new attention backend (the verify graphs' buffers stay
untouched), hidden-state capture on, and only the batch sizes a fallback can see.
"""

from __future__ import annotations

import enum
import logging
import types
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
from tests.runtime.releases import V1_RELEASES, V2_RELEASES


class SpeculativeAlgorithm(enum.Enum):
    NONE = enum.auto()
    EAGLE3 = enum.auto()


class RecordingGraphRunner:
    """Stands in for SGLang's CudaGraphRunner: constructing it is capturing."""

    def __init__(self, model_runner: Any) -> None:
        args = model_runner.server_args
        self.seen = {
            "spec_algorithm": model_runner.spec_algorithm,
            "attn_backend": model_runner.attn_backend,
            "return_hidden": args.enable_return_hidden_states,
            "cuda_graph_bs": list(args.cuda_graph_bs) if args.cuda_graph_bs else None,
        }
        if model_runner.fail_capture is not None:
            raise model_runner.fail_capture
        self.capture_bs = self.seen["cuda_graph_bs"] or [1, 2, 4, 8]
        model_runner.captures.append(self)


class Backend:
    def __init__(self, label: str) -> None:
        self.label = label


def make_runner(*, era: str = "0.5", cuda_graph_bs: list[int] | None = None) -> Any:
    """A target model runner with a (TARGET_VERIFY) graph runner already captured."""
    runner = types.SimpleNamespace(
        spec_algorithm=SpeculativeAlgorithm.EAGLE3,
        server_args=types.SimpleNamespace(
            enable_return_hidden_states=False,
            cuda_graph_bs=[1, 2, 4, 8, 16, 24, 32, 48, 64] if cuda_graph_bs is None else None,
        ),
        fail_capture=None,
        captures=[],
        made=[],
    )
    if cuda_graph_bs is not None:
        runner.server_args.cuda_graph_bs = cuda_graph_bs
    runner.attn_backend = Backend("verify")
    runner.graph_runner = RecordingGraphRunner.__new__(RecordingGraphRunner)
    if era == "0.5":
        runner.init_new_workspace = False

        def get_backend(init_new_workspace: bool = False) -> Backend:
            runner.init_new_workspace = init_new_workspace  # SGLang's side effect
            backend = Backend(f"new(ws={init_new_workspace})")
            runner.made.append(backend)
            return backend

        runner._get_attention_backend = get_backend
    else:  # 0.4.x: init_attention_backend() stores the new backend on the runner

        def init_backend() -> None:
            runner.attn_backend = Backend("new")
            runner.made.append(runner.attn_backend)

        runner.init_attention_backend = init_backend
    return runner


# -- capture_decode_graphs ------------------------------------------------------------------


@pytest.mark.parametrize("era", ["0.5", "0.4"])
def test_capture_sees_a_non_speculative_runner_on_a_new_backend(era):
    runner = make_runner(era=era)
    verify_graphs, verify_backend = runner.graph_runner, runner.attn_backend

    graphs, why = dyn.capture_decode_graphs(runner, "graph_runner", min_batch_size=14)

    assert why == ""
    assert graphs is not None
    (captured,) = runner.captures
    assert graphs.runner is captured
    assert captured.seen["spec_algorithm"] is SpeculativeAlgorithm.NONE
    assert captured.seen["attn_backend"] is graphs.attn_backend is runner.made[0]
    assert captured.seen["attn_backend"] is not verify_backend
    assert captured.seen["return_hidden"] is True
    assert captured.seen["cuda_graph_bs"] == [16, 24, 32, 48, 64]
    assert graphs.batch_sizes == [16, 24, 32, 48, 64]
    # Everything the runner had is back as it was.
    assert runner.spec_algorithm is SpeculativeAlgorithm.EAGLE3
    assert runner.attn_backend is verify_backend
    assert runner.graph_runner is verify_graphs
    assert runner.server_args.enable_return_hidden_states is False
    assert runner.server_args.cuda_graph_bs == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    if era == "0.5":
        assert graphs.attn_backend.label == "new(ws=True)"
        assert runner.init_new_workspace is False


def test_capture_keeps_the_largest_size_when_none_is_above_the_floor():
    runner = make_runner(cuda_graph_bs=[1, 2, 4, 8])
    graphs, _ = dyn.capture_decode_graphs(runner, "graph_runner", min_batch_size=100)
    assert graphs is not None and graphs.batch_sizes == [8]


def test_capture_without_a_size_list_leaves_the_default_sizes():
    runner = make_runner(cuda_graph_bs=[])
    runner.server_args.cuda_graph_bs = None  # 0.4.x: sizes come from cuda_graph_max_bs
    graphs, _ = dyn.capture_decode_graphs(runner, "graph_runner", min_batch_size=3)
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8]
    assert runner.server_args.cuda_graph_bs is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda r: setattr(r, "graph_runner", None), "CUDA graphs are off"),
        (lambda r: delattr(r.server_args, "enable_return_hidden_states"), "hidden states"),
        (lambda r: setattr(r, "spec_algorithm", "EAGLE3"), "no NONE"),
    ],
)
def test_capture_declines_with_a_reason(change, reason):
    runner = make_runner()
    change(runner)
    graphs, why = dyn.capture_decode_graphs(runner, "graph_runner", min_batch_size=1)
    assert graphs is None
    assert reason in why
    assert runner.made == []  # nothing was built


def test_failed_capture_restores_the_runner():
    runner = make_runner()
    runner.fail_capture = RuntimeError("out of memory")
    verify_backend = runner.attn_backend
    with pytest.raises(RuntimeError, match="out of memory"):
        dyn.capture_decode_graphs(runner, "graph_runner", min_batch_size=1)
    assert runner.spec_algorithm is SpeculativeAlgorithm.EAGLE3
    assert runner.attn_backend is verify_backend
    assert runner.server_args.enable_return_hidden_states is False


def test_target_decode_mode_swaps_and_restores_even_on_error():
    runner = make_runner()
    graphs, _ = dyn.capture_decode_graphs(runner, "graph_runner", min_batch_size=1)
    verify_graphs, verify_backend = runner.graph_runner, runner.attn_backend
    with pytest.raises(ValueError), dyn.target_decode_mode(runner, "graph_runner", graphs):
        assert runner.graph_runner is graphs.runner
        assert runner.attn_backend is graphs.attn_backend
        raise ValueError
    assert runner.graph_runner is verify_graphs
    assert runner.attn_backend is verify_backend
    with dyn.target_decode_mode(runner, "graph_runner", None):
        assert runner.graph_runner is None  # eager: never the TARGET_VERIFY graphs
        assert runner.attn_backend is verify_backend


# -- wired into the fallback step -----------------------------------------------------------


def graph_world(version: str, variant: str, **kwargs: Any) -> Any:
    """A stand-in world whose target runner can capture DECODE graphs."""
    from tests.runtime.standins import World, read_shape

    world = World(read_shape(version, variant), threshold=2, **kwargs)
    runner = world.worker.target_worker.model_runner
    template = make_runner()
    for name in ("spec_algorithm", "fail_capture", "captures", "made", "attn_backend"):
        setattr(runner, name, getattr(template, name))
    runner.server_args = template.server_args
    runner.init_new_workspace = False
    runner._get_attention_backend = template._get_attention_backend
    template.made = runner.made
    setattr(runner, world.shape.graph_attr, template.graph_runner)
    return world


def step(world: Any, variant: str) -> Any:
    if variant == "v1":
        return dyn.maybe_fallback_v1(world.worker, world.batch)
    return dyn.maybe_fallback_v2(world.worker, world.batch)


VARIANT_RELEASES = [("v1", v) for v in V1_RELEASES] + [("v2", v) for v in V2_RELEASES]


@pytest.mark.parametrize(("variant", "version"), VARIANT_RELEASES)
def test_fallback_target_forward_replays_the_decode_graphs(variant, version, caplog):
    world = graph_world(version, variant, batch_size=4)
    runner = world.worker.target_worker.model_runner
    verify_graphs = getattr(runner, world.shape.graph_attr)
    verify_backend = runner.attn_backend

    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, variant) is not None

    (decode_graphs,) = runner.captures
    # Captured once, above the resume floor (threshold 2 resumes at 1: every size).
    assert decode_graphs.seen["cuda_graph_bs"] == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    call = world.recorder.get("target_forward")
    assert call["graph"] is decode_graphs
    assert call["attn_backend"] is decode_graphs.seen["attn_backend"]
    assert getattr(runner, world.shape.graph_attr) is verify_graphs
    assert runner.attn_backend is verify_backend
    (line,) = [r.getMessage() for r in caplog.records if "captured target DECODE" in r.getMessage()]
    assert 0.0 <= float(line.rsplit(" in ", 1)[1].removesuffix("s")) < 60  # its own seconds


def test_decode_graphs_are_captured_once_per_process():
    world = graph_world("0.5.12.post1", "v1", batch_size=4)
    runner = world.worker.target_worker.model_runner
    step(world, "v1")
    world.batch = world._make_batch(4, 20, 100)
    step(world, "v1")
    assert len(runner.captures) == 1
    graphs = [d["graph"] for n, d in world.recorder.events if n == "target_forward"]
    assert len(graphs) == 2 and graphs[0] is graphs[1] is runner.captures[0]


def test_env_switch_keeps_eager_forwards(monkeypatch):
    monkeypatch.setenv(dyn.DECODE_GRAPHS_ENV, "0")
    world = graph_world("0.5.12.post1", "v2", batch_size=4)
    runner = world.worker.target_worker.model_runner
    assert step(world, "v2") is not None
    assert runner.captures == []
    assert world.recorder.get("target_forward")["graph"] is None
    note = dyn._adapters[type(world.worker)].decode_graphs_note
    assert note == f"off ({dyn.DECODE_GRAPHS_ENV}=0): eager target forwards"


@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_failed_capture_falls_back_to_eager_and_warns(variant, caplog):
    world = graph_world("0.5.12.post1", variant, batch_size=4)
    runner = world.worker.target_worker.model_runner
    runner.fail_capture = RuntimeError("CUDA out of memory")
    verify_graphs = runner.graph_runner
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        result = step(world, variant)
    assert result is not None  # still a correct fallback step, just eager
    assert world.recorder.get("target_forward")["graph"] is None
    assert runner.graph_runner is verify_graphs
    assert any(
        "DECODE graphs not used: capture failed: RuntimeError: CUDA out of memory"
        in r.getMessage()
        for r in caplog.records
    )


# -- TP ranks: every rank replays the graphs, or none ---------------------------------------


@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_a_rank_whose_peer_has_no_graphs_runs_eagerly_too(variant, monkeypatch, caplog):
    asked: list[bool] = []
    monkeypatch.setattr(dyn, "_all_ranks_agree", lambda group, ok: asked.append(ok) or False)
    world = graph_world("0.5.12.post1", variant, batch_size=4)
    runner = world.worker.target_worker.model_runner
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert step(world, variant) is not None
    assert len(runner.captures) == 1 and asked[0] is True  # this rank captured them
    assert world.recorder.get("target_forward")["graph"] is None
    assert any(
        "DECODE graphs not used: another TP rank could not capture them" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize(
    ("ranks", "tp_rank", "replays"),
    [("1", 1, False), ("0,1", 1, False), (" 2, x,1", 1, False), ("1", 0, True), ("", 1, True),
     ("1", None, True), ("0", None, False)],  # None: a worker without tp_rank is rank 0
)
def test_fail_on_ranks_discards_the_graphs_on_the_ranks_it_names(
    ranks, tp_rank, replays, monkeypatch, caplog
):
    monkeypatch.setenv(dyn.DECODE_GRAPHS_FAIL_RANKS_ENV, ranks)
    world = graph_world("0.5.12.post1", "v2", batch_size=4)
    if tp_rank is None:
        del world.worker.tp_rank
    else:
        world.worker.tp_rank = tp_rank
    runner = world.worker.target_worker.model_runner
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        assert step(world, "v2") is not None
    if tp_rank:  # only rank 0 logs, what it captured as what it could not
        assert [r.getMessage() for r in caplog.records if "DECODE" in r.getMessage()] == []
    tp_rank = tp_rank or 0
    assert len(runner.captures) == 1  # captured either way: the capture's collectives run
    graph = world.recorder.get("target_forward")["graph"]
    assert (graph is runner.captures[0]) if replays else (graph is None)
    note = dyn._adapters[type(world.worker)].decode_graphs_note
    forced = f"{dyn.DECODE_GRAPHS_FAIL_RANKS_ENV} names TP rank {tp_rank}"
    assert (forced in note) is not replays, note


# -- StepProfiler -----------------------------------------------------------------------------


def test_profiler_reports_per_phase_means_by_batch_size():
    lines: list[str] = []
    profiler = dyn.StepProfiler(every=3, log=lines.append)
    cpu = types.SimpleNamespace(type="cpu")
    for bs in (8, 8, 4):
        profiler.start(bs, cpu)
        profiler.mark("target")
        profiler.mark("verify")
        profiler.finish()
    summary = profiler.summary()
    assert sorted(summary) == [4, 8]
    assert list(summary[8]) == ["target", "verify", "end"]
    assert all(gpu == 0.0 and host >= 0.0 for gpu, host in summary[8].values())
    assert [line.split()[2] for line in lines] == ["bs=4", "bs=8"]
    assert "steps=2" in lines[1] and "target=" in lines[1] and "total=" in lines[1]


def test_profiler_total_is_the_mean_step_when_steps_run_different_phases(monkeypatch):
    """The step that checks the draft KV write runs the draft-extend, the others the write:
    the total is their mean step, not the sum of each phase's mean."""
    lines: list[str] = []
    profiler = dyn.StepProfiler(every=2, log=lines.append)
    now = [0.0]
    monkeypatch.setattr(dyn.time, "perf_counter", lambda: now[0])
    cpu = types.SimpleNamespace(type="cpu")
    for phase, ms in (("draft_extend", 3.0), ("draft_kv_write", 0.5)):
        profiler.start(8, cpu)
        now[0] += 0.001
        profiler.mark("prepare")
        now[0] += ms / 1000
        profiler.mark(phase)
        profiler.finish()
    (line,) = lines
    assert "steps=2 " in line
    assert "prepare=0.000/1.000 draft_extend=0.000/3.000 " in line
    assert "draft_kv_write=0.000/0.500 " in line
    assert line.endswith("total=0.000/2.750")


def test_profiler_reports_prefill_batches_by_mode_beside_the_steps(monkeypatch):
    """Prefill batches run from the hook are timed by mode (their requests counted), count in
    no step's period, and never mix into a batch size's step phases."""
    lines: list[str] = []
    profiler = dyn.StepProfiler(every=2, log=lines.append, describe=lambda: "state")
    now = [0.0]
    monkeypatch.setattr(dyn.time, "perf_counter", lambda: now[0])
    cpu = types.SimpleNamespace(type="cpu")
    for requests, in_fallback, ms in ((3, True, 4.0), (1, False, 9.0), (5, True, 6.0)):
        profiler.start_prefill(requests, in_fallback, cpu)
        now[0] += ms / 1000
        profiler.finish()
    profiler.start(8, cpu)
    profiler.finish()
    assert lines == []  # three prefills and one step: no period yet
    profiler.start(8, cpu)
    now[0] += 0.002
    profiler.finish()
    assert lines == [
        "[dynspec] profile bs=8 steps=2 gpu/host ms: end=0.000/1.000 total=0.000/1.000",
        "[dynspec] profile prefill in fallback batches=2 requests/batch=4.0 gpu/host ms: "
        "prefill=0.000/5.000",
        "[dynspec] profile prefill speculating batches=1 requests/batch=1.0 gpu/host ms: "
        "prefill=0.000/9.000",
        "[dynspec] profile auto: state",
    ]
    assert list(profiler.summary()) == [8]
    assert list(profiler.prefill_summary()) == ["in fallback", "speculating"]


def test_profiler_is_silent_until_its_period():
    lines: list[str] = []
    profiler = dyn.StepProfiler(every=5, log=lines.append)
    for _ in range(4):
        profiler.start(2, types.SimpleNamespace(type="cpu"))
        profiler.finish()
    assert lines == [] and profiler.summary() == {}


class _GpuClock:
    """CUDA events on a CPU: each records the fake GPU clock's time; ``elapsed_time`` is the
    difference in ms; ``synchronize`` is recorded."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.synchronized: list[Any] = []
        self.made: list[Any] = []
        clock = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.enable_timing = enable_timing
                self.at: float | None = None
                clock.made.append(self)

            def record(self) -> None:
                self.at = clock.now_ms

            def elapsed_time(self, other: Any) -> float:
                assert self.enable_timing and other.enable_timing
                return other.at - self.at

            def synchronize(self) -> None:
                clock.synchronized.append(self)

        self.Event = Event


@pytest.fixture
def gpu_clock(monkeypatch):
    import torch

    clock = _GpuClock()
    monkeypatch.setattr(torch.cuda, "Event", clock.Event)
    monkeypatch.setattr(dyn.time, "perf_counter", lambda: 0.0)  # host times all 0
    return clock


def test_on_a_gpu_the_profiler_reports_event_times_after_one_sync_per_step(gpu_clock):
    lines: list[str] = []
    profiler = dyn.StepProfiler(every=2, log=lines.append)
    cuda = types.SimpleNamespace(type="cuda")
    for target_ms, verify_ms in ((1.5, 0.5), (2.5, 1.5)):
        profiler.start(8, cuda)
        gpu_clock.now_ms += target_ms
        profiler.mark("target")
        gpu_clock.now_ms += verify_ms
        profiler.mark("verify")
        profiler.finish()
    profiler.start_prefill(3, True, cuda)
    gpu_clock.now_ms += 4.0
    profiler.finish()
    assert len(lines) == 1  # the two steps'; the prefill is read with the next report
    profiler.start(8, cuda)
    gpu_clock.now_ms += 3.0
    profiler.mark("target")
    profiler.finish()
    profiler.start(8, cuda)
    profiler.finish()
    assert lines == [
        "[dynspec] profile bs=8 steps=2 gpu/host ms: target=2.000/0.000 verify=1.000/0.000 "
        "end=0.000/0.000 total=3.000/0.000",
        "[dynspec] profile bs=8 steps=4 gpu/host ms: target=2.333/0.000 verify=1.000/0.000 "
        "end=0.000/0.000 total=2.250/0.000",
        "[dynspec] profile prefill in fallback batches=1 requests/batch=3.0 gpu/host ms: "
        "prefill=4.000/0.000",
    ]
    assert all(event.enable_timing for event in gpu_clock.made)
    # one sync per step or prefill read, on its last event (marks are never waited for)
    ends = [event for event in gpu_clock.made if event.at is not None][3::4]
    assert len(gpu_clock.synchronized) == 5 and gpu_clock.synchronized[:2] == ends[:2]


def test_a_prefill_run_from_the_hook_is_timed_on_its_batchs_device(gpu_clock):
    lines: list[str] = []
    profiler = dyn.StepProfiler(every=1, log=lines.append)
    adapter = types.SimpleNamespace(profiler=profiler,
                                    controller=types.SimpleNamespace(in_fallback=False))

    class SeqLens(list):
        device = types.SimpleNamespace(type="cuda")

    batch = types.SimpleNamespace(seq_lens=SeqLens([5, 7]))
    ran: list[Any] = []

    def run(worker: Any, adapter_: Any, batch_: Any, kwargs: dict[str, Any]) -> str:
        ran.append((worker, adapter_, batch_, kwargs))
        gpu_clock.now_ms += 6.0
        return "result"

    assert dyn._profiled_prefill(run, "worker", adapter, batch, {"k": 1}) == "result"
    assert ran == [("worker", adapter, batch, {"k": 1})]
    profiler.start(2, batch.seq_lens.device)
    profiler.finish()
    assert lines[-1] == (
        "[dynspec] profile prefill speculating batches=1 requests/batch=2.0 gpu/host ms: "
        "prefill=6.000/0.000"
    )


def test_marks_outside_a_step_are_ignored():
    """A step that was not started (one the profiler does not time) still marks its phases."""
    lines: list[str] = []
    profiler = dyn.StepProfiler(every=1, log=lines.append)
    cpu = types.SimpleNamespace(type="cpu")
    profiler.mark("target")  # before any start
    profiler.finish()
    profiler.start(4, cpu)
    profiler.finish()
    profiler.mark("target")  # after a finish
    profiler.finish()
    assert [line.split()[2:4] for line in lines] == [["bs=4", "steps=1"]]


def test_only_tp_rank_0_reports(monkeypatch, caplog):
    monkeypatch.setenv(dyn.PROFILE_ENV, "1")
    cpu = types.SimpleNamespace(type="cpu")
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        for rank in (1, 0):
            profiler = dyn._make_profiler(types.SimpleNamespace(tp_rank=rank))
            profiler.start(rank + 5, cpu)
            profiler.finish()
    assert [r.getMessage().split()[2] for r in caplog.records] == ["bs=5"]


def test_profiler_env(monkeypatch):
    worker = types.SimpleNamespace(tp_rank=0)
    monkeypatch.delenv(dyn.PROFILE_ENV, raising=False)
    assert not isinstance(dyn._make_profiler(worker), dyn.StepProfiler)
    monkeypatch.setenv(dyn.PROFILE_ENV, "200")
    profiler = dyn._make_profiler(worker)
    assert isinstance(profiler, dyn.StepProfiler) and profiler.every == 200
    monkeypatch.setenv(dyn.PROFILE_ENV, "yes")
    assert not isinstance(dyn._make_profiler(worker), dyn.StepProfiler)


# -- capture on the 0.5.14+ layout ------------------------------------------------------------


class PhaseGraphRunner:
    """0.5.14+'s DecodeCudaGraphRunner: sizes from ``cuda_graph_config.decode.bs``, the hidden
    mode from the server args (<= 0.5.18) or from ``get_exec().features`` (0.5.19+)."""

    def __init__(self, model_runner: Any) -> None:
        exec_config = model_runner.exec_config
        if exec_config is None:
            args = model_runner.server_args
            mode, enabled = args.return_hidden_states_mode, args.enable_return_hidden_states
            sizes = list(args.cuda_graph_config.decode.bs)
        else:
            features = exec_config.features
            mode = features.return_hidden_states_mode
            enabled = features.enable_return_hidden_states
            sizes = list(exec_config.graph.cuda_graph_config.decode.bs)
        self.capture_hidden_mode = CaptureHiddenMode.NULL
        if mode == "last":
            self.capture_hidden_mode = CaptureHiddenMode.LAST
        elif mode == "full" or enabled:
            self.capture_hidden_mode = CaptureHiddenMode.FULL
        self.spec_algorithm = model_runner.spec_algorithm
        self.capture_bs = sizes
        model_runner.captures.append(self)


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0
    LAST = 1
    FULL = 2


class SealedArgs(types.SimpleNamespace):
    """0.5.19+: ServerArgs refuses assignment once resolved."""

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_sealed", False):
            raise AttributeError(f"server_args.{name} assigned after resolution")
        super().__setattr__(name, value)


def phase_runner(*, sealed: bool, mode: str | None = None) -> tuple[Any, Any]:
    from tests.runtime.standins import ConfigBag

    sizes = [1, 2, 4, 8, 16, 32, 64]
    args = SealedArgs(
        enable_return_hidden_states=False,
        return_hidden_states_mode=mode,
        cuda_graph_config=types.SimpleNamespace(decode=types.SimpleNamespace(bs=list(sizes))),
    )
    exec_config = None
    if sealed:
        exec_config = ConfigBag(
            "exec",
            features=ConfigBag(
                "exec.features", enable_return_hidden_states=False, return_hidden_states_mode=mode
            ),
            graph=ConfigBag(
                "exec.graph",
                cuda_graph_config=types.SimpleNamespace(
                    decode=types.SimpleNamespace(bs=list(sizes))
                ),
            ),
        )
        args._sealed = True
    runner = make_runner()
    runner.server_args = args
    runner.exec_config = exec_config
    runner.decode_cuda_graph_runner = PhaseGraphRunner.__new__(PhaseGraphRunner)
    return runner, exec_config


@pytest.mark.parametrize("sealed", [False, True], ids=["0.5.17-server-args", "0.5.19-get-exec"])
@pytest.mark.parametrize("mode", [None, "last"])
def test_capture_on_the_phase_config_layout(sealed, mode):
    runner, exec_config = phase_runner(sealed=sealed, mode=mode)
    graphs, why = dyn.capture_decode_graphs(
        runner, "decode_cuda_graph_runner", min_batch_size=10, exec_config=exec_config
    )
    assert why == "" and graphs is not None
    (captured,) = runner.captures
    assert captured.capture_hidden_mode == CaptureHiddenMode.FULL
    assert captured.capture_bs == graphs.batch_sizes == [16, 32, 64]
    assert captured.spec_algorithm is SpeculativeAlgorithm.NONE
    # Everything is back as it was.
    holder = exec_config.graph if sealed else runner.server_args
    assert holder.cuda_graph_config.decode.bs == [1, 2, 4, 8, 16, 32, 64]
    if sealed:
        assert exec_config.features.enable_return_hidden_states is False
        assert exec_config.features.return_hidden_states_mode == mode
    else:
        assert runner.server_args.enable_return_hidden_states is False
        assert runner.server_args.return_hidden_states_mode == mode


def test_sealed_args_without_the_config_bag_decline():
    runner, _ = phase_runner(sealed=True)
    graphs, why = dyn.capture_decode_graphs(runner, "decode_cuda_graph_runner", min_batch_size=1)
    assert graphs is None and "hidden states" in why
    assert runner.made == []


def test_graphs_captured_without_full_hidden_states_are_not_used():
    # A release whose runner reads the hidden mode from a place the runtime was not told of
    # (here: a config bag it was not given) captures LAST; those graphs must not be replayed.
    runner, _ = phase_runner(sealed=False)
    _, bag = phase_runner(sealed=True, mode="last")
    runner.exec_config = bag
    graphs, why = dyn.capture_decode_graphs(runner, "decode_cuda_graph_runner", min_batch_size=1)
    assert graphs is None and "LAST, not FULL" in why


def test_the_adapter_hands_get_exec_to_the_capture_on_0523():
    # 0.5.19+: ServerArgs is sealed and the graph settings live in get_exec(); the adapter
    # must pass the worker module's get_exec() to the capture, or there are no graphs.
    from tests.runtime.standins import World, read_shape

    world = World(read_shape("0.5.23", "v2"), threshold=2, batch_size=4)
    runner = world.worker.target_worker.model_runner
    template, _ = phase_runner(sealed=True)
    for name in ("spec_algorithm", "captures", "made", "attn_backend", "server_args"):
        setattr(runner, name, getattr(template, name))
    runner.init_new_workspace = False
    runner._get_attention_backend = template._get_attention_backend
    template.made = runner.made
    runner.exec_config = world.exec_config
    runner.decode_cuda_graph_runner = template.decode_cuda_graph_runner

    assert step(world, "v2") is not None
    (decode_graphs,) = runner.captures
    assert decode_graphs.capture_hidden_mode == CaptureHiddenMode.FULL
    assert world.recorder.get("target_forward")["graph"] is decode_graphs
