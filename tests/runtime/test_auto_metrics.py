"""``auto``'s Prometheus series in SGLang's multiprocess mode: written by the scheduler-side
process, read back the way SGLang's ``/metrics`` reads them (MultiProcessCollector)."""

import json
import subprocess
import sys
import textwrap

import pytest

SCHEDULER = textwrap.dedent(
    """
    import json, os, sys, types

    from dynspec_patch.transforms.runtime import dynspec_fallback as dyn

    args = types.SimpleNamespace(enable_metrics=sys.argv[1] == "on", served_model_name="m8b")
    metrics = dyn.AutoMetrics.create(args)
    if metrics is None:
        print(json.dumps(None))
        raise SystemExit(0)
    sizes = [1, 2, 4, 8, 16, 32, 64]
    policy = dyn.GoodputPolicy(dyn.AutoConfig(confirm_steps=2), sizes)
    costs = dyn.CostTable({bs: (10.0 + 0.6 * bs, 7.0 + 0.15 * bs) for bs in sizes})
    controller = dyn.AutoController(policy, source=True, metrics=metrics)
    controller.measurements.snapshot = lambda: dyn.Snapshot(2.0, costs)
    for bs in [1] * 40 + [64] * 40:  # speculation at bs 1, plain steps at bs 64
        controller.decide(bs)
    print(json.dumps({"switches": policy.n_switches, "fallback_steps": policy.n_fallback_steps,
                      "spec": policy.last.spec_tok_s, "plain": policy.last.plain_tok_s}))
    """
)

READER = textwrap.dedent(
    """
    import json

    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    samples = {s.name: (s.labels, s.value) for m in registry.collect() for s in m.samples
               if s.name.startswith("sglang:dynspec")}
    print(json.dumps(samples))
    """
)


def run(code: str, *argv: str, env: dict) -> object:
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def multiproc_env(tmp_path):
    import os

    pytest.importorskip("prometheus_client")
    return {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}


def test_the_series_appear_with_the_controllers_values(multiproc_env):
    truth = run(SCHEDULER, "on", env=multiproc_env)
    assert truth["switches"] == 1 and truth["fallback_steps"] > 0
    samples = run(READER, env=multiproc_env)
    labels = {"model_name": "m8b"}
    # Updated at the sync steps (every 16): the last one is step 64, before the 16 last steps.
    assert samples["sglang:dynspec_speculating"] == [labels, 0.0]
    assert samples["sglang:dynspec_switches_total"] == [labels, 1.0]
    fallback_by_step_64 = truth["fallback_steps"] - 16
    assert samples["sglang:dynspec_fallback_steps_total"] == [labels, fallback_by_step_64]
    assert samples["sglang:dynspec_spec_tok_per_s"] == [labels, pytest.approx(truth["spec"])]
    assert samples["sglang:dynspec_plain_tok_per_s"] == [labels, pytest.approx(truth["plain"])]


def test_no_series_without_enable_metrics_or_without_multiprocess_mode(multiproc_env):
    assert run(SCHEDULER, "off", env=multiproc_env) is None
    assert run(READER, env=multiproc_env) == {}
    plain_env = {k: v for k, v in multiproc_env.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    assert run(SCHEDULER, "on", env=plain_env) is None
