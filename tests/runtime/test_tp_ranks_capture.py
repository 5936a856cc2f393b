"""Two TP ranks (torch.distributed, gloo, two processes) build the fallback's adapter on the
stand-in world: its start-up captures agree over the real group, so when one rank loses its
DECODE graphs (``DYNSPEC_DECODE_GRAPHS_FAIL_ON_RANKS``) both run the target eagerly."""

import json
import os
import textwrap
from pathlib import Path

import pytest

from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
from tests.runtime.gloo_ranks import last_lines_of_ranks

pytestmark = pytest.mark.torch

TESTS_DIR = Path(__file__).resolve().parents[1]

RANK = textwrap.dedent(
    """
    import json, os, sys, types

    import torch.distributed as dist

    tests_dir, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # the test helpers as a package found through its own path: no checkout dir on sys.path
    package = types.ModuleType("tests")
    package.__path__ = [tests_dir]
    sys.modules["tests"] = package

    from dynspec_patch.transforms.runtime import dynspec_fallback as dyn
    from tests.runtime.test_decode_graphs import graph_world, step

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    world = graph_world("0.5.17", "v2", batch_size=4)
    world.worker.tp_rank = rank
    runner = world.worker.target_worker.model_runner
    runner.tp_group = types.SimpleNamespace(world_size=2, cpu_group=dist.group.WORLD)
    stepped = step(world, "v2") is not None
    print(json.dumps({
        "stepped": stepped,
        "captured": len(runner.captures),
        "replayed": world.recorder.get("target_forward")["graph"] is not None,
        "note": dyn._adapters[type(world.worker)].decode_graphs_note,
    }), flush=True)
    dist.barrier()  # neither rank tears the group down while the other still uses it
    # gloo's threads can abort the process as it exits: leave without teardown (see
    # test_auto_ranks.py); the answer is printed and flushed, and both ranks are done
    os._exit(0)
    """
)


def run_ranks(fail_on: str | None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != dyn.DECODE_GRAPHS_FAIL_RANKS_ENV}
    if fail_on is not None:  # every rank's environment, as a launcher gives it
        env[dyn.DECODE_GRAPHS_FAIL_RANKS_ENV] = fail_on
    lines = last_lines_of_ranks(
        RANK, 2, lambda rank, port: [str(TESTS_DIR), str(rank), port], env=env
    )
    return [json.loads(line) for line in lines]


def test_both_ranks_replay_the_graphs_they_both_captured():
    answers = run_ranks(None)
    assert [a["replayed"] for a in answers] == [True, True]
    assert all(a["stepped"] and a["captured"] == 1 for a in answers)


def test_one_rank_losing_its_graphs_makes_both_run_eagerly():
    rank0, rank1 = run_ranks("1")
    assert [rank0["replayed"], rank1["replayed"]] == [False, False]
    assert rank0["stepped"] and rank1["stepped"]
    assert rank0["captured"] == rank1["captured"] == 1  # both ran the capture's collectives
    assert "another TP rank could not capture them" in rank0["note"]
    assert f"{dyn.DECODE_GRAPHS_FAIL_RANKS_ENV} names TP rank 1" in rank1["note"]
