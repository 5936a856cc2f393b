"""``auto`` in the stand-in workers: spec -> fallback -> spec as acceptance falls and rises,
each step's output what the unpatched worker (spec) or the fixed-threshold fallback gives."""

import logging
import types

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
from tests.runtime.releases import V1_RELEASES, V2_RELEASES

pytestmark = pytest.mark.torch

BS = 4
CASES = [
    ("v1", V1_RELEASES[0]),  # 0.4.x: tuple results
    ("v1", V1_RELEASES[-1]),
    ("v2", V2_RELEASES[0]),
    ("v2", V2_RELEASES[-1]),
]


def world(variant: str, version: str, **kwargs):
    from tests.runtime.standins import World, read_shape

    return World(read_shape(version, variant), batch_size=BS, seq_len=10, **kwargs)


def hook(variant: str):
    return dyn.maybe_fallback_v1 if variant == "v1" else dyn.maybe_fallback_v2


class SpecPath:
    """The worker's own speculative step, as the patched method runs it: the hook first
    (re-entered from the hook, it must answer None), then a result with this acceptance; a
    prefill batch's result is the batch's own marker."""

    def __init__(self, w, variant: str, adapter) -> None:
        self.w, self.variant, self.adapter = w, variant, adapter
        self.tokens_per_request = 3.0
        self.calls: list[tuple[object, object]] = []
        self.prefills: list[tuple[object, object]] = []
        self.ran: str | None = None

    def __call__(self, worker, batch, **kwargs):
        import torch

        assert hook(self.variant)(worker, batch, **kwargs) is None
        if batch.forward_mode.is_extend():
            result = ("prefilled", batch)
            self.prefills.append((batch, result))
            self.ran = "prefill"
            return result
        accepted = int((self.tokens_per_request - 1) * BS)
        if self.variant == "v2":
            lens = torch.full((BS,), int(self.tokens_per_request), dtype=torch.int32)
            result = types.SimpleNamespace(accept_lens=lens)
        elif self.adapter.tuple_arity is not None:
            result = ("logits", "tokens", 77, accepted, True)[: self.adapter.tuple_arity]
        else:
            fields = {self.adapter.name("gbr_count"): accepted}
            per_request = self.adapter.names["gbr_per_req"]
            if per_request is not None:  # the release's result says each request's drafts
                fields[per_request] = [int(self.tokens_per_request - 1)] * BS
            result = types.SimpleNamespace(**fields)
        self.calls.append((batch, result))
        self.ran = "spec"
        return result


class ModeCosts:
    """Step times by mode: a speculative step 20 ms, a fallback step 10 ms, a prefill 5 ms
    (the host clock is never read). Speculation then wins while it yields about 2.1 tokens
    per request or more (4 requests admitted every 16 steps: a prefill batch's 5 ms is
    spread over the 16 steps' tokens)."""

    def __init__(self, spec: SpecPath) -> None:
        self.spec = spec
        self.costs = {"spec": 20.0, "prefill": 5.0, None: 10.0}

    def start(self):
        self.spec.ran = None
        self.started = object()
        return self.started

    def stop(self, started):
        assert started is self.started  # the step's own start
        return self.costs[self.spec.ran]

    def elapsed_ms(self, handle):
        return handle


def tokens_of(result):
    """What the scheduler reads of a fallback step: its tokens and accepted counts."""
    if isinstance(result, tuple):
        return result[1].tolist(), result[3]
    count = getattr(result, "accept_lens", None)
    return result.next_token_ids.tolist(), None if count is None else count.tolist()


@pytest.mark.parametrize(("variant", "version"), CASES)
def test_auto_runs_spec_then_fallback_then_spec_with_unchanged_outputs(variant, version):
    from tests.runtime.standins import new_prefill_batch

    w = world(variant, version, speculative_disable_batch_threshold="auto",
              speculative_num_steps=3)
    adapter = dyn._adapter_for(w.worker, variant)
    assert isinstance(adapter.controller, dyn.AutoController)
    # the most a speculative step gives a request: speculative_num_steps (3) + 1
    assert adapter.controller.policy.config.max_tokens_per_step == 4.0
    spec = SpecPath(w, variant, adapter)
    entry = adapter.names.get("entry") or "forward_batch_generation"
    setattr(type(w.worker), entry, lambda self, batch, **kwargs: spec(self, batch, **kwargs))
    adapter.controller.measurements.clock = ModeCosts(spec)
    # The same release with a fixed T = 1: its fallback step is the reference output.
    fixed = world(variant, version, speculative_disable_batch_threshold=1)

    modes, spec_steps, fallback_steps = [], 0, 0
    for step in range(2200):
        spec.tokens_per_request = 1.0 if 100 <= step < 400 else 3.0
        if step % 16 == 0:  # 4 new requests every 16 steps, prefilled through the hook:
            prefill = new_prefill_batch([5] * BS)  # the worker's own prefill, run and timed
            assert hook(variant)(w.worker, prefill) == ("prefilled", prefill)
            assert spec.prefills[-1][0] is prefill
        w.batch = w._make_batch(BS, 10, 100)
        calls_before = len(spec.calls)
        forwards_before = w.recorder.names().count("target_forward")
        result = hook(variant)(w.worker, w.batch)
        if len(spec.calls) > calls_before:  # a speculative step: the worker's own result
            spec_steps += 1
            assert len(spec.calls) == calls_before + 1
            assert spec.calls[-1][0] is w.batch and result is spec.calls[-1][1]
            assert w.recorder.names().count("target_forward") == forwards_before
        else:  # a fallback step: one DECODE forward, the fixed-T fallback's output
            fallback_steps += 1
            assert w.recorder.names().count("target_forward") == forwards_before + 1
            fixed.batch = fixed._make_batch(BS, 10, 100)
            reference = hook(variant)(fixed.worker, fixed.batch)
            assert tokens_of(result) == tokens_of(reference)
        modes.append(adapter.controller.in_fallback)

    assert not any(modes[:100])
    into_fallback = modes.index(True)
    # the drop is seen once half the acceptance window (256 requests: 64 steps of 4, which
    # hold 20 different requests) holds it, at the next sync (every 16 steps, reading steps 2
    # old), then 8 wins
    assert 100 < into_fallback <= 100 + 32 + 16 + 2 + 8
    back = modes.index(False, into_fallback)
    assert 400 < back <= 400 + 1024 + 16 + 8  # a probe re-measures the rise
    assert not any(modes[back:])
    assert adapter.controller.policy.n_switches == 2
    assert adapter.controller.n_started == BS * len(range(0, 2200, 16))  # prefilled requests
    assert len(spec.prefills) == len(range(0, 2200, 16))
    snapshot = adapter.controller.measurements.snapshot()
    assert snapshot.prefill_spec == snapshot.prefill_plain == dyn.PrefillCost(5.0, 0.0)
    # 4 requests per 16 steps of 4 requests at 3 tokens each (1 in fallback), over the
    # newest 16384 tokens (to within a batch at the window's edge)
    assert 0.98 * 4 / (16 * 4 * 3) <= snapshot.admitted_per_token <= 4 / (16 * 4)
    policy = adapter.controller.policy
    assert (policy.n_spec_steps, policy.n_fallback_steps) == (spec_steps, fallback_steps)


@pytest.mark.parametrize(("variant", "version"), CASES[1:2] + CASES[3:])
def test_a_fixed_threshold_never_enters_the_spec_step_itself(variant, version):
    w = world(variant, version, speculative_disable_batch_threshold=64)
    adapter = dyn._adapter_for(w.worker, variant)
    entry = adapter.names.get("entry") or "forward_batch_generation"
    calls = []
    setattr(type(w.worker), entry, lambda self, batch, **kw: calls.append(batch))
    assert hook(variant)(w.worker, w.batch) is None  # None: the worker speculates itself
    assert calls == []


def test_auto_refuses_resume_below_with_one_warning(caplog):
    w = world(
        "v2",
        V2_RELEASES[-1],
        speculative_disable_batch_threshold="auto",
        speculative_disable_resume_below=3,
    )
    with caplog.at_level(logging.WARNING):
        assert dyn.maybe_fallback_v2(w.worker, w.batch) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "[dynspec] speculation-disable fallback is OFF: "
        "--speculative-disable-resume-below applies to a fixed threshold, not auto"
    ]


def test_auto_with_tp_but_no_cpu_group_fails_closed(caplog):
    w = world("v1", V1_RELEASES[-1], speculative_disable_batch_threshold="auto")
    w.worker.target_worker.model_runner.tp_group = types.SimpleNamespace(world_size=2)
    with caplog.at_level(logging.WARNING):
        assert dyn.maybe_fallback_v1(w.worker, w.batch) is None
    assert dyn._adapter_for(w.worker, "v1") is None
    assert any("auto needs the TP group's CPU group" in r.getMessage() for r in caplog.records)


def test_auto_finds_the_tp_group_where_the_model_runner_has_none(caplog):
    """0.5.22+: the model runner has no tp_group; the TP group is get_parallel().tp_group.
    Under TP 2 without a CPU group to share rank 0's costs over, auto fails closed there too
    (it used to see no TP group and let every rank decide on its own measurements)."""
    w = world("v2", "0.5.23", speculative_disable_batch_threshold="auto")
    assert not hasattr(w.worker.target_worker.model_runner, "tp_group")
    w.parallel_config.tp_group = types.SimpleNamespace(world_size=2)
    with caplog.at_level(logging.WARNING):
        assert dyn.maybe_fallback_v2(w.worker, w.batch) is None
    assert dyn._adapter_for(w.worker, "v2") is None
    assert any("auto needs the TP group's CPU group" in r.getMessage() for r in caplog.records)


def test_tp_group_of_prefers_the_model_runners_group():
    runner_group, context_group = object(), object()
    worker = types.SimpleNamespace(
        target_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace())
    )
    context = types.SimpleNamespace(tp_group=context_group)
    module = {"get_parallel": lambda: context}
    names = {"parallel_config": "get_parallel"}
    assert dyn.tp_group_of(worker, names, module) is context_group
    assert dyn.tp_group_of(worker, {"parallel_config": None}, module) is None
    bare = {"get_parallel": types.SimpleNamespace}  # a context that names no TP group
    assert dyn.tp_group_of(worker, names, bare) is None
    worker.target_worker.model_runner.tp_group = runner_group
    assert dyn.tp_group_of(worker, names, module) is runner_group


@pytest.mark.parametrize("word", ["fast", "0", "65537"])
def test_a_bad_threshold_word_turns_the_feature_off_with_one_warning(caplog, word):
    w = world("v2", V2_RELEASES[-1], speculative_disable_batch_threshold=word)
    with caplog.at_level(logging.WARNING):
        assert dyn.maybe_fallback_v2(w.worker, w.batch) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "[dynspec] speculation-disable fallback is OFF: "
        f"threshold must be an integer 1..65536 or auto, got {word!r}"
    ]


def test_auto_logs_how_it_decides_once_at_start_up(caplog):
    w = world("v2", V2_RELEASES[-1], speculative_disable_batch_threshold="auto")
    with caplog.at_level(logging.INFO):
        dyn._adapter_for(w.worker, "v2")
    lines = [r.getMessage() for r in caplog.records if "auto:" in r.getMessage()]
    assert len(lines) == 1
    assert "no start-up cost measurement" in lines[0] and "metrics off" in lines[0]


def test_dynspec_auto_config_overrides_the_controllers_numbers_and_says_so(caplog, monkeypatch):
    monkeypatch.setenv("DYNSPEC_AUTO_CONFIG", "probe_confidence=3, probe_gap=32")
    w = world("v2", V2_RELEASES[-1], speculative_disable_batch_threshold="auto")
    with caplog.at_level(logging.INFO):
        adapter = dyn._adapter_for(w.worker, "v2")
    config = adapter.controller.policy.config
    assert (config.probe_confidence, config.probe_gap) == (3.0, 32)
    assert type(config.probe_gap) is int
    assert config.probe_change == dyn.AutoConfig().probe_change  # the others keep defaults
    [line] = [r.getMessage() for r in caplog.records if "auto:" in r.getMessage()]
    assert line.endswith("; DYNSPEC_AUTO_CONFIG: {'probe_confidence': 3.0, 'probe_gap': 32}")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("probe_confidence=3,nonsense=1", "'nonsense' is not one of"),
        ("probe_gap=1.5", "probe_gap takes a positive int, not '1.5'"),
        ("probe_gap=0", "probe_gap takes a positive int, not '0'"),
        ("probe_confidence=-1", "probe_confidence takes a non-negative number, not '-1'"),
        ("composition_bounds=1", "'composition_bounds' is not one of"),
    ],
)
def test_a_bad_dynspec_auto_config_warns_once_and_changes_nothing(caplog, monkeypatch, value, why):
    monkeypatch.setenv("DYNSPEC_AUTO_CONFIG", value)
    w = world("v2", V2_RELEASES[-1], speculative_disable_batch_threshold="auto")
    with caplog.at_level(logging.INFO):
        adapter = dyn._adapter_for(w.worker, "v2")
    config = adapter.controller.policy.config
    assert (config.probe_confidence, config.probe_gap) == (2.0, 16)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "DYNSPEC_AUTO_CONFIG" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"[dynspec] DYNSPEC_AUTO_CONFIG={value!r} not used: ")
    assert why in warnings[0]


def test_steps_are_timed_by_cuda_events_on_a_gpu_and_by_the_host_clock_elsewhere():
    import torch

    for device in ("cuda:0", "cuda", torch.device("cuda", 1)):
        assert isinstance(dyn.step_clock(device), dyn.CudaEventClock), device
    for device in ("cpu", torch.device("cpu"), "meta"):
        assert isinstance(dyn.step_clock(device), dyn.HostClock), device


@pytest.mark.parametrize(("device", "clock"), [("cuda:0", "CudaEventClock"), ("cpu", "HostClock")])
def test_auto_times_steps_by_the_clock_of_the_target_runners_device(caplog, device, clock):
    """The host clock on a GPU times launches, not steps (an H200 read 2-4 ms at every batch
    size, steps took 7-20 ms): a GPU runner's controller must use CUDA events."""
    w = world("v2", V2_RELEASES[-1], speculative_disable_batch_threshold="auto")
    w.worker.target_worker.model_runner.device = device
    with caplog.at_level(logging.INFO):
        adapter = dyn._adapter_for(w.worker, "v2")
    assert type(adapter.controller.measurements.clock).__name__ == clock
    [line] = [r.getMessage() for r in caplog.records if "auto:" in r.getMessage()]
    assert f"measured online ({clock})" in line


@pytest.mark.parametrize(("variant", "version"), CASES)
def test_a_speculative_steps_reading_says_each_requests_tokens_where_the_worker_does(
    variant, version
):
    """v2's ``accept_lens`` and v1's per-request drafts (0.5.x) give each request's tokens;
    0.4.x's tuple gives the step's count alone: the mean, each unknown."""
    import torch

    w = world(variant, version, speculative_disable_batch_threshold="auto")
    adapter = dyn._adapter_for(w.worker, variant)
    drafts = [0, 1, 3, 3]
    if variant == "v2":
        result = types.SimpleNamespace(accept_lens=torch.tensor([1 + d for d in drafts]))
    elif adapter.tuple_arity is not None:
        result = ("logits", "tokens", 77, sum(drafts), True)[: adapter.tuple_arity]
    else:
        result = types.SimpleNamespace(**{adapter.name("gbr_count"): sum(drafts),
                                          adapter.names["gbr_per_req"]: drafts})
    reading = dyn._tokens_per_request_reader(adapter, result, len(drafts))()
    assert reading.mean == pytest.approx(1 + sum(drafts) / len(drafts))
    expected_each = None if adapter.tuple_arity is not None else (1.0, 2.0, 4.0, 4.0)
    assert reading.each == expected_each


def test_a_probe_step_keeps_its_requests_ids_and_a_speculating_step_does_not():
    w = world("v2", V2_RELEASES[-1], speculative_disable_batch_threshold="auto")
    controller = dyn._adapter_for(w.worker, "v2").controller
    reqs = w.batch.reqs
    controller.finish_step(controller.start_step(), True, len(reqs), dyn._no_acceptance, reqs)
    controller.policy.in_fallback = True
    controller.finish_step(controller.start_step(), True, len(reqs), dyn._no_acceptance, reqs)
    controller.finish_step(controller.start_step(), False, len(reqs), None, reqs)
    keys = [m.request_keys for m in controller.measurements._pending]
    assert keys == [None, tuple(req.rid for req in reqs), None]
    assert len(set(keys[1])) == len(reqs)
