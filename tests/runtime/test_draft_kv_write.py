"""The draft KV write of v2 fallback steps, against a one-layer EAGLE-3 stand-in draft model.

The stand-in model (``standins.LlamaModel``) runs a draft-extend the way SGLang's
``llama_eagle3`` does and stores K and V through its KV pool; the runtime's write computes them
from the same modules on its own path. A fallback step may write the draft KV alone only once a
real step showed both agree, and the step before speculation resumes runs the draft-extend.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Callable
from typing import Any

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn

pytestmark = pytest.mark.torch

N = 4  # speculative_num_draft_tokens of the stand-in server
RELEASES = ["0.5.12.post1", "0.5.13.post1", "0.5.17", "0.5.23"]


@pytest.fixture(scope="module")
def shapes():
    from tests.runtime.standins import read_shape

    return {v: read_shape(v, "v2") for v in RELEASES}


@pytest.fixture(autouse=True)
def _kv_write_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "1")


def make_world(shapes: Any, version: str, *, width1: bool = False, **kwargs: Any) -> Any:
    from tests.runtime.standins import world_with_draft_model

    world = world_with_draft_model(
        shapes[version], speculative_num_steps=3, speculative_num_draft_tokens=N, **kwargs
    )
    if width1:
        draft = world.worker.draft_worker
        draft.cuda_graph_runner_for_draft_extend = "n-token-graphs"
        draft.draft_extend_attn_backend = "n-token-backend"
        world.server_args.cuda_graph_bs = [1, 2, 4, 8]
    return world


def step(world: Any, bs: int, seq_len: int) -> Any:
    from tests.runtime.standins import new_decode_batch

    return dyn.maybe_fallback_v2(world.worker, new_decode_batch(world, bs, seq_len))


def extends(world: Any) -> list[dict[str, Any]]:
    return [data for name, data in world.recorder.events if name == "draft_extend_v2"]


def assert_the_second_step_wrote_the_kv_alone(world: Any) -> None:
    """Step 1 checks the write (SGLang's draft-extend runs); step 2 stores the draft KV alone,
    what the stand-in model's own draft-extend would have stored."""
    import torch

    from tests.runtime.standins import reference_draft_kv, stored_draft_kv

    step(world, 3, 10)
    step(world, 3, 11)
    assert len(extends(world)) == 1
    slots, k, v = reference_draft_kv(world, 11, 3)
    got_k, got_v = stored_draft_kv(world, slots)
    assert torch.allclose(got_k, k) and torch.allclose(got_v, v)
    assert k.abs().sum() > 0  # the rows were written, not left at zero


def second_step_runs_the_draft_extend(world: Any, change: Callable[[Any], None]) -> bool:
    """After the checking step, whether a step whose draft input ``change`` altered still ran
    SGLang's draft-extend."""
    from tests.runtime.standins import new_decode_batch

    step(world, 3, 10)
    change(new_decode_batch(world, 3, 11))
    dyn.maybe_fallback_v2(world.worker, world.batch)
    return len(extends(world)) == 2


# -- the fallback steps ---------------------------------------------------------------------


@pytest.mark.parametrize("version", RELEASES)
def test_after_one_checked_step_fallback_steps_write_only_the_draft_kv(shapes, version, caplog):
    import torch

    from tests.runtime.standins import reference_draft_kv, stored_draft_kv

    world = make_world(shapes, version)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)  # checks the write against SGLang's draft-extend
        result = step(world, 3, 11)  # writes the KV alone

    assert len(extends(world)) == 1
    assert "draft KV write matches SGLang's draft-extend at bs=3" in caplog.text
    slots, k, v = reference_draft_kv(world, 11, 3)
    got_k, got_v = stored_draft_kv(world, slots)
    assert torch.allclose(got_k, k) and torch.allclose(got_v, v)
    assert k.abs().sum() > 0  # the row was written, not left at zero
    # The draft state handed on is the incoming one (never drafted from).
    next_input = result.next_draft_input
    assert next_input.topk_p is world.batch.spec_info.topk_p
    assert next_input.topk_index is world.batch.spec_info.topk_index
    assert next_input.hidden_states is world.batch.spec_info.hidden_states
    adapter = dyn._adapters[type(world.worker)]
    assert adapter.draft_state_stale
    assert world.batch.out_cache_loc.tolist() == slots.tolist()


def test_the_checked_step_matches_and_a_changed_model_is_refused_at_once(shapes, caplog):
    """The check compares the write with what the release's own draft-extend stored: a model
    whose KV depends on something the write leaves out (here: a shift of the embeddings) fails
    it, and every later step keeps SGLang's draft-extend."""
    world = make_world(shapes, "0.5.17")
    layer = world.worker.draft_worker.draft_runner.model.model.layers[0]
    real_forward = layer.forward

    def with_shifted_embeddings(positions, embeds, hidden_states, fb, residual):
        return real_forward(positions, embeds + 0.3, hidden_states, fb, residual)

    layer.forward = with_shifted_embeddings
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
        step(world, 3, 11)
        step(world, 3, 12)

    assert len(extends(world)) == 3
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "draft KV write" in r.getMessage()
    ]
    assert len(warnings) == 1 and "draft KV write differs" in warnings[0], warnings
    adapter = dyn._adapters[type(world.worker)]
    assert adapter.draft_kv_write.broken and not adapter.draft_kv_write.checked
    assert not adapter.draft_state_stale


@pytest.mark.parametrize(("fc_norm", "input_norm"), [(True, False), (False, True), (True, True)])
def test_the_write_follows_the_draft_models_own_norms(shapes, fc_norm, input_norm):
    from tests.runtime.standins import LlamaModel

    world = make_world(shapes, "0.5.23")
    runner = world.worker.draft_worker.draft_runner
    runner.model.model = LlamaModel(fc_norm=fc_norm, input_norm=input_norm)
    assert_the_second_step_wrote_the_kv_alone(world)


@pytest.mark.usefixtures("resume_after_one_small_step")
def test_speculation_resumes_after_one_fallback_step_with_the_draft_extend(shapes, caplog):
    world = make_world(shapes, "0.5.17")
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)  # fallback: checked, draft-extend
        step(world, 3, 11)  # fallback: KV write
        resumed = step(world, 1, 12)  # the controller says speculate: one more fallback step
        speculated = step(world, 1, 13)

    assert "fallback -> spec at decode bs=1" in caplog.text
    assert resumed is not None  # a fallback step ran, with the draft-extend
    assert [len(e["seq_lens"]) for e in extends(world)] == [3, 1]
    assert torch_equal_tokens(resumed, world)
    assert speculated is None  # the worker's own speculative step
    assert not dyn._adapters[type(world.worker)].draft_state_stale


@pytest.mark.usefixtures("resume_after_one_small_step")
def test_speculation_resumes_at_once_after_the_checked_step(shapes):
    """The step that checks the write ran SGLang's draft-extend: its draft state is fresh, so
    a switch back right after it speculates at once (no extra fallback step)."""
    world = make_world(shapes, "0.5.17")
    step(world, 3, 10)  # fallback: checked, draft-extend
    assert dyn._adapters[type(world.worker)].draft_kv_write.checked
    assert step(world, 1, 11) is None  # the worker's own speculative step
    assert len(extends(world)) == 1


def torch_equal_tokens(result: Any, world: Any) -> bool:
    """The resumed step's draft input is the one its draft-extend filled (not a stub)."""
    (_, last) = extends(world)
    import torch

    return torch.equal(result.next_draft_input.hidden_states, last["selected_hidden"])


def test_a_width1_server_also_writes_the_kv_alone_once_checked(shapes):
    import torch

    from tests.runtime.standins import reference_draft_kv, stored_draft_kv

    world = make_world(shapes, "0.5.12.post1", width1=True)
    step(world, 3, 10)
    result = step(world, 3, 11)
    assert [e["width"] for e in extends(world)] == [1]
    assert result.speculative_num_draft_tokens == 1  # unpadded: nothing reads row i * N
    slots, k, v = reference_draft_kv(world, 11, 3)
    got_k, got_v = stored_draft_kv(world, slots)
    assert torch.allclose(got_k, k) and torch.allclose(got_v, v)


def test_a_draft_input_without_draft_state_keeps_the_draft_extend(shapes):
    world = make_world(shapes, "0.5.17")

    def no_topk_p(batch: Any) -> None:
        batch.spec_info.topk_p = None

    assert second_step_runs_the_draft_extend(world, no_topk_p)
    assert not dyn._adapters[type(world.worker)].draft_state_stale


def test_rejection_sampling_draft_probs_keep_the_draft_extend(shapes):
    import torch

    def draft_probs(batch: Any) -> None:
        batch.spec_info.draft_probs = torch.ones(3, 16)

    assert second_step_runs_the_draft_extend(make_world(shapes, "0.5.17"), draft_probs)


@pytest.mark.parametrize(
    ("value", "release"),
    [("0", "0.5.17"), (None, None), (None, "0.5.16"), (None, "0.5.19"), (None, "0.5.17.post1")],
)
def test_off_unless_turned_on_or_on_a_release_it_ran_on(shapes, monkeypatch, value, release):
    """Unset, the write runs only where its package says a release it has run on with a GPU
    (``GPU_PROVEN_RELEASES``); "0" turns it off there too."""
    from tests.runtime.standins import package_says_release

    if value is None:
        monkeypatch.delenv(dyn.DRAFT_KV_WRITE_ENV)
    else:
        monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, value)
    world = make_world(shapes, "0.5.17")
    if release is not None:
        package_says_release(monkeypatch, world, release)
    step(world, 3, 10)
    step(world, 3, 11)
    assert len(extends(world)) == 2
    adapter = dyn._adapters[type(world.worker)]
    assert adapter.draft_kv_write is None
    assert adapter.draft_kv_write_note.startswith("off (DYNSPEC_DRAFT_KV_WRITE=1")
    assert "only on SGLang 0.5.12.post1, 0.5.17," in adapter.draft_kv_write_note


def test_on_by_default_on_a_release_it_ran_on(shapes, monkeypatch):
    from tests.runtime.standins import package_says_release

    monkeypatch.delenv(dyn.DRAFT_KV_WRITE_ENV)
    world = make_world(shapes, "0.5.17")
    package_says_release(monkeypatch, world, "0.5.17")
    step(world, 3, 10)  # checked against the draft-extend
    step(world, 3, 11)  # the write alone
    assert len(extends(world)) == 1
    assert dyn._adapters[type(world.worker)].draft_kv_write is not None


def test_the_release_is_read_from_the_worker_package(tmp_path, monkeypatch):
    """``sglang_release`` imports ``<package>.version`` as SGLang lays it out; a package
    without one (or without ``__version__``) is no release."""
    for name, body in [("withversion", '__version__ = "0.5.17"\n'), ("noattr", "")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "version.py").write_text(body)
    (tmp_path / "noversion").mkdir()
    (tmp_path / "noversion" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert dyn.sglang_release({"__name__": "withversion.srt.speculative.w"}) == "0.5.17"
    assert dyn.sglang_release({"__name__": "noattr.srt.w"}) is None
    assert dyn.sglang_release({"__name__": "noversion.srt.w"}) is None
    assert dyn.sglang_release({"__name__": "notapackage"}) is None


# -- what the write is used for --------------------------------------------------------------


def _runner(**changes: Any) -> Any:
    from tests.runtime.standins import LlamaModel, MHATokenToKVPool

    model = LlamaModel()
    runner = types.SimpleNamespace(
        model=types.SimpleNamespace(model=model),
        token_to_kv_pool=MHATokenToKVPool(),
        attn_backend=types.SimpleNamespace(dcp_size=1),
    )
    for change, value in changes.items():
        if change == "layers":
            model.layers.append(model.layers[0])
        elif change == "no_hidden_norm":
            del model.layers[0].hidden_norm
        elif change == "mrope":
            model.is_mrope_enabled = True
        elif change == "k_scale":
            model.layers[0].self_attn.attn.k_scale = 0.5
        elif change == "pool":
            runner.token_to_kv_pool = type("SWAKVPool", (), {})()
        elif change == "store_dtype":
            import torch

            runner.token_to_kv_pool.store_dtype = torch.uint8
        elif change == "no_pool":
            del runner.token_to_kv_pool
        elif change in ("no_store_dtype", "no_dtype"):
            delattr(runner.token_to_kv_pool, change.removeprefix("no_"))
        elif change == "quantized":
            runner.token_to_kv_pool.is_quantized_kv_cache = True
        elif change == "hnd":
            runner.token_to_kv_pool.use_hnd = True
        elif change == "dcp":
            runner.attn_backend.dcp_size = value
        elif change == "later_layer":
            model.layers[0].is_input_layer = False
    return runner


DTYPE = "the draft KV pool stores another dtype than it computes"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"layers": True}, "the draft has 2 layers (a later layer's KV needs attention)"),
        ({"no_hidden_norm": True}, "the draft model lacks hidden_norm"),
        ({"mrope": True}, "the draft uses multimodal rotary positions"),
        ({"k_scale": True}, "the draft's KV cache is scaled"),
        ({"pool": True}, "the draft KV pool is SWAKVPool, not MHATokenToKVPool"),
        ({"no_pool": True}, "the draft KV pool is NoneType, not MHATokenToKVPool"),
        ({"store_dtype": True}, DTYPE),
        ({"no_store_dtype": True}, DTYPE),
        ({"no_dtype": True}, DTYPE),
        ({"quantized": True}, DTYPE),
        ({"hnd": True}, "the draft KV pool is laid out by page (HND)"),
        ({"dcp": 2}, "decode-context parallelism splits the draft KV"),
        ({"later_layer": True}, "the draft's layer does not take the target's hidden state"),
    ],
)
def test_drafts_whose_kv_the_write_cannot_reproduce_are_refused(change, reason):
    kv_write, why = dyn.draft_kv_write_for(_runner(**change))
    assert kv_write is None and why == reason


def test_a_plain_one_layer_draft_is_taken():
    kv_write, why = dyn.draft_kv_write_for(_runner())
    assert kv_write is not None and why == ""
    why = dyn.draft_kv_write_for(types.SimpleNamespace())[1]
    assert why == "the draft model has no model.layers"


def test_refused_draft_logs_once_and_keeps_the_draft_extend(shapes, caplog):
    world = make_world(shapes, "0.5.17")
    world.worker.draft_worker.draft_runner.model.model.is_mrope_enabled = True
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        step(world, 3, 10)
        step(world, 3, 11)
    assert len(extends(world)) == 2
    warnings = [r.getMessage() for r in caplog.records if "draft KV write" in r.getMessage()]
    assert len(warnings) == 1 and "multimodal rotary positions" in warnings[0]


def test_matches_tolerates_bf16_rounding_only():
    import torch

    from tests.runtime.standins import MHATokenToKVPool

    kv_write, _ = dyn.draft_kv_write_for(_runner())
    pool: MHATokenToKVPool = kv_write.pool
    loc = torch.tensor([5, 6])
    k = torch.tensor([[[1.0, -2.0]], [[0.5, 4.0]]])
    v = torch.tensor([[[3.0, 1.0]], [[-1.0, 2.0]]])
    pool.k_buffer[0][loc], pool.v_buffer[0][loc] = k * 1.01, v
    assert kv_write.matches(k, v, loc)[0]  # 1 % of the values: rounding
    pool.k_buffer[0][loc] = k * 1.05
    ok, detail = kv_write.matches(k, v, loc)
    assert not ok and "max |dK| 0.2 of 4.2" in detail


# -- what the mutation run showed untested ---------------------------------------------------


def kv_lines(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if "draft KV write" in r.getMessage()]


def test_the_log_lines_and_notes_say_what_runs(shapes, caplog):
    world = make_world(shapes, "0.5.17")
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
        adapter = dyn._adapters[type(world.worker)]
        (line,) = kv_lines(caplog)
    assert line.startswith("[dynspec] draft KV write matches SGLang's draft-extend at bs=3 (max ")
    assert line.endswith(
        "): fallback steps now write the draft KV only; the step before speculation resumes "
        "runs the draft-extend"
    )
    assert adapter.draft_kv_write_note.startswith("draft KV write (checked at bs 3: max |dK| ")


def test_before_its_first_step_the_note_says_it_is_not_yet_checked(shapes):
    world = make_world(shapes, "0.5.17")
    class Extend:  # the adapter resolves, no step runs
        def is_decode(self) -> bool:
            return False

    world.batch.forward_mode = Extend()
    assert dyn.maybe_fallback_v2(world.worker, world.batch) is None
    adapter = dyn._adapters[type(world.worker)]
    assert adapter.draft_kv_write_note.startswith(
        "draft KV write (checked at the first fallback step; eager: its CUDA graphs are on by "
        "default only on SGLang 0.5.12.post1"
    )


def test_a_later_rank_logs_nothing(shapes, caplog):
    world = make_world(shapes, "0.5.17")
    world.worker.tp_rank = 1
    world.worker.draft_worker.draft_runner.model.model.is_mrope_enabled = True
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
    assert kv_lines(caplog) == []
    world = make_world(shapes, "0.5.17")
    world.worker.tp_rank = 1
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
    assert kv_lines(caplog) == []
    assert dyn._adapters[type(world.worker)].draft_kv_write.checked


def test_a_later_rank_does_not_warn_of_a_mismatch_either(shapes, caplog):
    world = make_world(shapes, "0.5.17")
    world.worker.tp_rank = 1
    layer = world.worker.draft_worker.draft_runner.model.model.layers[0]
    real_forward = layer.forward
    layer.forward = lambda p, e, h, fb, r: real_forward(p, e + 0.3, h, fb, r)
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
    assert dyn._adapters[type(world.worker)].draft_kv_write.broken
    assert kv_lines(caplog) == []


def test_a_backend_without_a_dcp_size_value_is_one_rank():
    runner = _runner()
    runner.attn_backend.dcp_size = None
    assert dyn.draft_kv_write_for(runner)[0] is not None


def test_with_tp_every_rank_must_agree_to_use_it(shapes, caplog):
    """TP 2 without a CPU group to agree over: no rank uses what it cannot agree on."""
    world = make_world(shapes, "0.5.17")
    world.worker.target_worker.model_runner.tp_group = types.SimpleNamespace(world_size=2)
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        step(world, 3, 10)
        step(world, 3, 11)
    assert len(extends(world)) == 2
    adapter = dyn._adapters[type(world.worker)]
    assert adapter.draft_kv_write is None
    assert adapter.draft_kv_write_note == "SGLang's draft-extend (another TP rank cannot use it)"
    assert kv_lines(caplog) == [
        "[dynspec] draft KV write not used: another TP rank cannot use it; fallback steps run "
        "SGLang's draft-extend"
    ]


def test_with_tp_the_check_must_pass_on_every_rank(shapes, caplog):
    world = make_world(shapes, "0.5.17")
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        assert dyn._adapter_for(world.worker, "v2") is not None  # start-up on one rank
        world.worker.target_worker.model_runner.tp_group = types.SimpleNamespace(world_size=2)
        step(world, 3, 10)
        step(world, 3, 11)
    assert len(extends(world)) == 2
    adapter = dyn._adapters[type(world.worker)]
    assert adapter.draft_kv_write.broken.endswith("; another TP rank's differed")
    (line,) = kv_lines(caplog)
    assert line.endswith("another TP rank's differed); fallback steps keep SGLang's draft-extend")
    assert adapter.draft_kv_write_note.startswith("SGLang's draft-extend (the draft KV write ")


def test_a_pool_that_cannot_be_read_back_keeps_the_draft_extend(shapes, caplog):
    world = make_world(shapes, "0.5.17")
    pool = world.worker.draft_worker.draft_runner.token_to_kv_pool

    def unreadable(layer_id: int) -> Any:
        raise RuntimeError("layer-wise transfer in flight")

    pool.get_key_buffer = unreadable
    with caplog.at_level(logging.WARNING, logger=dyn.__name__):
        step(world, 3, 10)
        step(world, 3, 11)
    assert len(extends(world)) == 2
    assert dyn._adapters[type(world.worker)].draft_kv_write.broken == (
        "reading the KV pool back raised RuntimeError: layer-wise transfer in flight"
    )


def test_the_profile_names_the_phase(shapes, monkeypatch, caplog):
    monkeypatch.setenv(dyn.PROFILE_ENV, "1")
    world = make_world(shapes, "0.5.17")
    with caplog.at_level(logging.INFO, logger=dyn.__name__):
        step(world, 3, 10)
        step(world, 3, 11)
    profiles = [r.getMessage() for r in caplog.records if "profile bs=3" in r.getMessage()]
    assert " draft_extend=" in profiles[0] and " draft_kv_write=" not in profiles[0]
    assert " draft_kv_write=" in profiles[-1]


def test_an_eagle_draft_reads_the_hidden_state_without_fc(shapes):
    """EAGLE (not -3): the target's hidden state is as wide as the draft's, no fc."""
    import torch

    from tests.runtime.standins import HIDDEN, LlamaDecoderLayer, LlamaModel

    world = make_world(shapes, "0.5.17")
    model = LlamaModel()
    model.embed_tokens = torch.nn.Embedding(16, HIDDEN)
    model.fc = None  # would fail if called
    layer = LlamaDecoderLayer()
    layer.input_layernorm = type(layer.input_layernorm)(HIDDEN, 1.5)
    layer.hidden_norm = type(layer.hidden_norm)(HIDDEN, 0.5)
    layer.self_attn = type(layer.self_attn)(2 * HIDDEN)
    model.layers = torch.nn.ModuleList([layer])
    world.worker.draft_worker.draft_runner.model.model = model
    assert_the_second_step_wrote_the_kv_alone(world)


def test_an_older_draft_model_without_the_newer_attributes_is_taken(shapes):
    """0.5.10's llama_eagle3: no is_input_layer, no fc_norm / input_norm, no is_mrope_enabled
    attribute; a pool and backend without the quantisation, HND and DCP attributes."""
    world = make_world(shapes, "0.5.17")
    runner = world.worker.draft_worker.draft_runner
    model = runner.model.model
    del model.layers[0].is_input_layer, model.is_mrope_enabled
    del model.fc_norm, model.input_norm
    attn = model.layers[0].self_attn.attn
    del attn.k_scale, attn.v_scale
    del runner.attn_backend
    assert_the_second_step_wrote_the_kv_alone(world)


def test_a_draft_input_lacking_a_draft_state_field_keeps_the_draft_extend(shapes):
    def without_topk_index(batch: Any) -> None:
        fields = {k: v for k, v in vars(batch.spec_info).items() if k != "topk_index"}
        batch.spec_info = types.SimpleNamespace(**fields)

    assert second_step_runs_the_draft_extend(make_world(shapes, "0.5.17"), without_topk_index)


def test_dsa_draft_state_keeps_the_draft_extend(shapes):
    import torch

    def dsa_state(batch: Any) -> None:
        batch.spec_info.dsa_topk_indices = torch.zeros(3, 8, dtype=torch.int64)

    assert second_step_runs_the_draft_extend(make_world(shapes, "0.5.17"), dsa_state)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("no_layers", "the draft model has no model.layers"),
        ("no_self_attn", "the draft model lacks forward_prepare_native, attn"),
        ("v_scale", "the draft's KV cache is scaled"),
    ],
)
def test_more_drafts_the_write_cannot_reproduce(change, reason):
    runner = _runner()
    model = runner.model.model
    if change == "no_layers":
        runner.model = types.SimpleNamespace(model=types.SimpleNamespace(fc=model.fc))
    elif change == "no_self_attn":
        del model.layers[0].self_attn
    else:
        model.layers[0].self_attn.attn.v_scale = 0.5
    kv_write, why = dyn.draft_kv_write_for(runner)
    assert kv_write is None and why == reason


def test_matches_accepts_exactly_the_tolerance_and_names_both_parts():
    import torch

    kv_write, _ = dyn.draft_kv_write_for(_runner())
    pool = kv_write.pool
    loc = torch.tensor([5])
    k = torch.tensor([[[50.0, 2.0]]])
    v = torch.tensor([[[3.0, 1.0]]])
    pool.k_buffer[0][loc], pool.v_buffer[0][loc] = torch.tensor([[[50.0, 1.0]]]), v
    ok, detail = kv_write.matches(k, v, loc)  # |dK| 1.0 = 2 % of 50: still rounding
    assert ok
    assert detail == "max |dK| 1 of 50, max |dV| 0 of 3"


def test_under_auto_a_probe_put_off_by_a_stale_draft_state_speculates_next(shapes):
    """auto in fallback wants a speculative probe while the draft state is stale: that step
    runs plain with SGLang's draft-extend, the next one is the worker's speculative step."""
    world = make_world(shapes, "0.5.17", threshold="auto")
    adapter = dyn._adapter_for(world.worker, "v2")
    policy = adapter.controller.policy
    padded = dyn.padded_batch_size(3, policy.graph_sizes)
    # plain steps win at this size, both costs known (no explore step): in fallback
    policy.adopt(dyn.Snapshot(1.0, dyn.CostTable({padded: (30.0, 10.0)})))
    policy.in_fallback, policy._gap_padded, policy._probe_gap = True, padded, 4
    policy.config = dataclasses.replace(  # one-step probes
        policy.config, probe_requests=1, probe_steps_min=1
    )
    world.worker.forward_batch_generation = lambda batch, **kwargs: "speculative result"
    results = [step(world, 3, 10 + i) for i in range(6)]
    # 1: checked (draft-extend); 2, 3: KV write; 4: the probe, run plain with the
    # draft-extend; 5: the speculative step it owed; 6: fallback again (KV write)
    speculated = [r == "speculative result" for r in results]
    assert speculated == [False, False, False, False, True, False]
    assert len(extends(world)) == 2 and adapter.draft_state_stale


# -- DYNSPEC_DRAFT_KV_WRITE_STEPS: several fallback steps' writes run as one ------------------


def stored_like_each_step(world: Any, seq_lens: list[int], bs: int) -> bool:
    """Whether the pool holds, for each step at these lengths, what the stand-in draft model's
    own draft-extend stores for it."""
    import torch

    from tests.runtime.standins import reference_draft_kv, stored_draft_kv

    for seq_len in seq_lens:
        slots, k, v = reference_draft_kv(world, seq_len, bs)
        got_k, got_v = stored_draft_kv(world, slots)
        if not (torch.allclose(got_k, k) and torch.allclose(got_v, v) and k.abs().sum() > 0):
            return False
    return True


@pytest.mark.parametrize("version", ["0.5.12.post1", "0.5.17", "0.5.23"])
def test_the_writes_of_n_steps_are_stored_together_at_the_nth(shapes, version, monkeypatch):
    from tests.runtime.standins import draft_runner

    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_STEPS_ENV, "3")
    world = make_world(shapes, version)
    pool = draft_runner(world).token_to_kv_pool
    step(world, 3, 10)  # checks the write (SGLang's draft-extend)
    stores = len(pool.writes)
    step(world, 3, 11)
    step(world, 3, 12)
    assert len(pool.writes) == stores and not stored_like_each_step(world, [11], 3)
    step(world, 3, 13)  # the third kept step: all three stored, oldest first
    assert [loc.shape[0] for loc in pool.writes[stores:]] == [3, 3, 3]
    assert stored_like_each_step(world, [11, 12, 13], 3)
    assert len(extends(world)) == 1
    adapter = dyn._adapters[type(world.worker)]
    assert "3 fallback steps' writes run as one" in adapter.draft_kv_write_note


@pytest.mark.usefixtures("resume_after_one_small_step")
@pytest.mark.parametrize("next_step", ["prefill", "resume", "grammar"])
def test_every_other_kind_of_step_stores_the_kept_writes_first(shapes, monkeypatch, next_step):
    """A prefill's draft-extend may store into a slot a kept row still targets, and a draft
    that speculates, or SGLang's own step, reads the KV: each finds the kept rows stored."""
    from tests.runtime.standins import ForwardMode, draft_runner, new_decode_batch

    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_STEPS_ENV, "8")
    world = make_world(shapes, "0.5.17")
    pool = draft_runner(world).token_to_kv_pool
    step(world, 3, 10)  # checked
    step(world, 3, 11)  # kept
    assert not stored_like_each_step(world, [11], 3)
    stores = len(pool.writes)
    if next_step == "prefill":
        batch = new_decode_batch(world, 3, 12)
        batch.forward_mode = ForwardMode.EXTEND
        assert dyn.maybe_fallback_v2(world.worker, batch) is None  # SGLang's prefill
    elif next_step == "resume":
        step(world, 1, 12)  # speculation resumes: first a step with SGLang's draft-extend
        assert len(extends(world)) == 2
    else:
        batch = new_decode_batch(world, 3, 12)
        batch.has_grammar = True  # a grammar the fallback cannot mask here: SGLang's step
        dyn._adapters[type(world.worker)].grammar = None
        assert dyn.maybe_fallback_v2(world.worker, batch) is None
    assert stored_like_each_step(world, [11], 3)
    assert pool.writes[stores].shape[0] == 3  # the kept step's rows came first
    assert not dyn._adapters[type(world.worker)].draft_kv_write.kept


def test_a_slot_two_kept_steps_write_holds_the_later_steps_kv(shapes, monkeypatch):
    """A slot freed after one kept step and handed to another request's next step is written
    twice among the kept rows: the later step's K and V stay, as with a write per step."""
    import torch

    from tests.runtime.standins import draft_runner

    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_STEPS_ENV, "2")
    world = make_world(shapes, "0.5.17")
    step(world, 3, 10)  # checked
    kv_write = dyn._adapters[type(world.worker)].draft_kv_write
    loc = torch.tensor([40, 41])
    hidden = torch.randn(2, kv_write.inner.fc.in_features)
    first, later = torch.tensor([3, 4]), torch.tensor([5, 6])
    kv_write.defer(first, hidden, torch.tensor([7, 8]), loc)
    kv_write.defer(later, hidden + 1.0, torch.tensor([9, 10]), loc)  # stores both
    k, v = kv_write.compute(later, hidden + 1.0, torch.tensor([9, 10]))
    pool = draft_runner(world).token_to_kv_pool
    assert torch.allclose(pool.k_buffer[0][loc], k) and torch.allclose(pool.v_buffer[0][loc], v)
    assert not kv_write.kept


def test_a_kept_step_keeps_copies_of_its_rows(shapes, monkeypatch):
    """The hidden states a fallback step hands the write are its target graph's output
    buffer, which the next step's replay overwrites before the kept rows are stored."""
    import torch

    from tests.runtime.standins import draft_runner

    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_STEPS_ENV, "2")
    world = make_world(shapes, "0.5.17")
    step(world, 3, 10)  # checked
    kv_write = dyn._adapters[type(world.worker)].draft_kv_write
    tokens, positions, loc = torch.tensor([3, 4]), torch.tensor([7, 8]), torch.tensor([40, 41])
    hidden = torch.randn(2, kv_write.inner.fc.in_features)
    k, v = kv_write.compute(tokens, hidden, positions)
    kv_write.defer(tokens, hidden, positions, loc)
    for t in (tokens, hidden, positions, loc):
        t.add_(1)  # the buffers change under the kept step, as the next replay changes them
    kv_write.defer(tokens, hidden, positions, torch.tensor([50, 51]))
    pool = draft_runner(world).token_to_kv_pool
    at = torch.tensor([40, 41])
    assert torch.allclose(pool.k_buffer[0][at], k) and torch.allclose(pool.v_buffer[0][at], v)


def test_one_step_per_write_writes_at_once_without_copies(shapes):
    """The default: each fallback step's write runs in its step, on the step's own tensors
    (no copies: four more kernels a step)."""
    import torch

    world = make_world(shapes, "0.5.17")
    step(world, 3, 10)  # checked
    kv_write = dyn._adapters[type(world.worker)].draft_kv_write
    assert kv_write.steps_per_write == 1
    seen: list[tuple[Any, ...]] = []
    kv_write.write = lambda *args: seen.append(args)  # type: ignore[method-assign]
    args = (torch.tensor([3]), torch.randn(1, kv_write.inner.fc.in_features), torch.tensor([7]),
            torch.tensor([40]))
    kv_write.defer(*args)
    assert len(seen) == 1 and all(a is b for a, b in zip(seen[0], args, strict=True))
    assert not kv_write.kept


@pytest.mark.parametrize(("value", "steps", "warns"), [("", 1, False), ("1", 1, False),
                                                       ("4", 4, False), ("64", 64, False),
                                                       ("0", 1, True), ("65", 1, True),
                                                       ("two", 1, True)])
def test_the_steps_per_write_setting(monkeypatch, value, steps, warns):
    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_STEPS_ENV, value)
    said: list[str] = []
    assert dyn.draft_kv_write_steps(said.append) == steps
    assert bool(said) == warns
    if warns:
        assert said[0].startswith(f"[dynspec] {dyn.DRAFT_KV_WRITE_STEPS_ENV}={value!r}")


@pytest.mark.parametrize(
    ("release", "value", "steps"),
    [("0.5.17", None, 8), ("0.5.17", "1", 1), ("0.5.23", None, 1), ("0.5.23", "4", 4),
     ("0.5.12.post1", None, 8), ("0.5.13.post1", None, 1)],
)
def test_eight_steps_per_write_by_default_where_that_ran_on_a_gpu(
    shapes, monkeypatch, release, value, steps
):
    """Unset, the batched write keeps 8 steps on the releases it has run on
    (``DRAFT_KV_WRITE_STEPS_RELEASES``) and 1 elsewhere; a value set wins everywhere."""
    from tests.runtime.standins import package_says_release

    monkeypatch.setenv(dyn.DRAFT_KV_WRITE_ENV, "1")
    if value is None:
        monkeypatch.delenv(dyn.DRAFT_KV_WRITE_STEPS_ENV, raising=False)
    else:
        monkeypatch.setenv(dyn.DRAFT_KV_WRITE_STEPS_ENV, value)
    world = make_world(shapes, release)
    package_says_release(monkeypatch, world, release)
    step(world, 3, 10)
    assert dyn._adapters[type(world.worker)].draft_kv_write.steps_per_write == steps
