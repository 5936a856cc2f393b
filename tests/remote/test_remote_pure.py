"""Pure parts of the remote layer: argv edits, era rules, log parsing, live-worker decision."""

from __future__ import annotations

import pytest

from dynspec_patch.patcher.deploy import edit_argv, proof_holds
from dynspec_patch.patcher.facts import (
    EffectiveArgs,
    decide_live_worker,
    effective_from_argv,
    parse_server_args_line,
    version_key,
)
from dynspec_patch.patcher.remote_agent import is_server_argv

BASE = ["/v/bin/python", "-m", "sglang.launch_server", "--model-path", "m",
        "--speculative-algorithm", "EAGLE"]


@pytest.mark.parametrize(("argv", "add", "expected_tail"), [
    pytest.param(BASE, ["--speculative-disable-batch-threshold", "32"],
                 ["--speculative-disable-batch-threshold", "32"], id="add"),
    pytest.param([*BASE, "--speculative-disable-batch-threshold", "8"],
                 ["--speculative-disable-batch-threshold", "32"],
                 ["--speculative-disable-batch-threshold", "32"], id="replace-separate"),
    pytest.param([*BASE, "--speculative-disable-batch-threshold=8", "--port", "1"],
                 ["--speculative-disable-batch-threshold", "32"],
                 ["--port", "1", "--speculative-disable-batch-threshold", "32"],
                 id="replace-equals-form"),
])
def test_edit_argv_adds_or_replaces_the_threshold(argv, add, expected_tail):
    out = edit_argv(argv, remove_valued=("--speculative-disable-batch-threshold",), add=add)
    assert out[: len(BASE)] == BASE
    assert out[len(BASE):] == expected_tail
    assert out.count("--speculative-disable-batch-threshold") == 1


def test_edit_argv_removes_bare_and_valued_native_flags():
    argv = [*BASE, "--speculative-adaptive", "--speculative-adaptive-config", "/x y.json"]
    out = edit_argv(argv, remove_valued=("--speculative-adaptive-config",),
                    remove_bare=("--speculative-adaptive",))
    assert out == BASE


@pytest.mark.parametrize(("argv", "server"), [
    (["python", "-m", "sglang.launch_server", "--port", "1"], True),
    (["python3", "-msglang.launch_server"], True),
    (["/v/bin/python", "/v/bin/sglang", "serve", "--model-path", "m"], True),
    (["sglang", "serve"], True),
    (["python", "-m", "sglang.bench_serving", "--port", "1"], False),
    (["grep", "sglang.launch_server"], False),
    (["python", "-c", "from multiprocessing.spawn import spawn_main"], False),
])
def test_server_process_recognition(argv, server):
    assert is_server_argv(argv) is server


def test_version_key_orders_posts_and_rcs():
    assert version_key("0.5.3.post1") < version_key("0.5.3.post2") < version_key("0.5.4")
    assert version_key("0.5.10rc0") < version_key("0.5.10") < version_key("0.5.10.post1")
    assert version_key("0.4.10.post2") < version_key("0.5.1")


# The Addendum table: effective disable_overlap_schedule per release from argv + env.
FLAG = ["--disable-overlap-schedule"]
TOPK4 = ["--speculative-eagle-topk", "4"]


@pytest.mark.parametrize(("version", "extra", "env", "expected"), [
    pytest.param("0.4.10.post2", [], {}, True, id="0.4-always-true"),
    pytest.param("0.5.3.post3", ["--enable-beta-spec"], {}, False, id="beta-eagle"),
    pytest.param("0.5.3.post3", [], {}, True, id="no-beta"),
    pytest.param("0.5.5.post2", FLAG, {"SGLANG_ENABLE_SPEC_V2": "1"}, False,
                 id="0.5.5-env-beats-flag"),
    pytest.param("0.5.5.post2", [], {}, True, id="0.5.5-env-default-off"),
    pytest.param("0.5.10.post1", FLAG, {"SGLANG_ENABLE_SPEC_V2": "true"}, False,
                 id="0.5.10-env-beats-flag"),
    pytest.param("0.5.10.post1", [], {"SGLANG_ENABLE_SPEC_V2": "maybe"}, True,
                 id="0.5.10-garbage-is-default"),
    pytest.param("0.5.12.post1", [], {}, False, id="0.5.12-v2-default"),
    pytest.param("0.5.12.post1", TOPK4, {}, True, id="0.5.12-topk-forces-v1"),
    pytest.param("0.5.12.post1", FLAG, {}, True, id="0.5.12-flag-respected"),
    pytest.param("0.5.13.post1", [], {"SGLANG_ENABLE_SPEC_V2": "0"}, True, id="0.5.13-env-off"),
    pytest.param("0.5.16", [], {"SGLANG_ENABLE_SPEC_V2": "0"}, False, id="0.5.16-env-ignored"),
])
def test_effective_disable_overlap_from_argv_and_env(version, extra, env, expected):
    values, evidence = effective_from_argv(version, [*BASE, *extra], env)
    assert values["disable_overlap_schedule"] is expected
    assert evidence


@pytest.mark.parametrize(("version", "values", "worker"), [
    ("0.4.6.post5", {"speculative_algorithm": "EAGLE", "disable_overlap_schedule": True}, "v1"),
    ("0.5.10.post1", {"speculative_algorithm": "EAGLE", "disable_overlap_schedule": False}, "v2"),
    ("0.5.10.post1", {"speculative_algorithm": "EAGLE3", "disable_overlap_schedule": True}, "v1"),
    ("0.5.10.post1", {"speculative_algorithm": "EAGLE", "disable_overlap_schedule": False,
                      "enable_multi_layer_eagle": True}, "none"),
    ("0.5.10.post1", {"speculative_algorithm": "NGRAM", "disable_overlap_schedule": True}, "none"),
    ("0.5.10.post1", {"speculative_algorithm": None, "disable_overlap_schedule": False}, "none"),
    ("0.5.13.post1", {"speculative_algorithm": "EAGLE", "disable_overlap_schedule": True}, "v2"),
    ("0.5.16", {"speculative_algorithm": "EAGLE", "disable_overlap_schedule": False}, "v2"),
    ("0.5.23", {"speculative_algorithm": "EAGLE3", "disable_overlap_schedule": True}, "v2"),
    ("0.4.1", {"speculative_algorithm": "EAGLE", "disable_overlap_schedule": True}, "none"),
])
def test_live_worker_rule(version, values, worker):
    assert decide_live_worker(version, EffectiveArgs(values, "/server_info")).worker == worker


def test_parse_dataclass_repr_log_line():
    line = ("[2026-01-01 00:00:00] server_args=ServerArgs(model_path='/m/it''s', "
            "speculative_algorithm='EAGLE', disable_overlap_schedule=False, "
            "speculative_eagle_topk=1, cuda_graph_bs=[1, 2, 4], tp_size=2)")
    parsed = parse_server_args_line(line)
    assert parsed["speculative_algorithm"] == "EAGLE"
    assert parsed["disable_overlap_schedule"] is False
    assert parsed["speculative_eagle_topk"] == 1
    assert parsed["cuda_graph_bs"] == [1, 2, 4]


def test_parse_dict_log_line():
    line = ("[x] server_args={'model_path': 'm', 'disable_overlap_schedule': True, "
            "'speculative_algorithm': 'EAGLE3'}")
    parsed = parse_server_args_line(line)
    assert parsed == {"model_path": "m", "disable_overlap_schedule": True,
                      "speculative_algorithm": "EAGLE3"}


def test_proof_needs_the_exact_threshold():
    assert proof_holds({"speculative_disable_batch_threshold": 32},
                       {"speculative_disable_batch_threshold": 32})
    assert not proof_holds({"speculative_disable_batch_threshold": None},
                           {"speculative_disable_batch_threshold": 32})
    assert not proof_holds({}, {"speculative_disable_batch_threshold": "<present>"})
    assert proof_holds({}, {"speculative_disable_batch_threshold": "<absent>"})
    assert not proof_holds(None, {})
