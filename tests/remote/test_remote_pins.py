"""Every pinned release over SSH: apply --no-restart, re-apply, revert; bytes checked each time."""

from __future__ import annotations

import pytest
from remote_harness import tree_bytes

from dynspec_patch.patcher import remote_commands as rc
from dynspec_patch.patcher.errors import RefusedError
from dynspec_patch.patcher.releases import load_pins

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")
PINS = load_pins()


def _apply(host, **kw):
    return rc.apply(host.options(), threshold=32, worker="auto", dry_run=False,
                    no_restart=True, restart_cmd=None, pid=None, port=None,
                    health_timeout=30.0, **kw)


@pytest.mark.parametrize("pin", PINS, ids=[p.version for p in PINS])
def test_pinned_release_round_trip_over_ssh(make_host, pin):
    host = make_host(pin.version)
    original = tree_bytes(host.package)
    host.server(*SPEC)
    facts = rc.detect_path(host.options(), pid=None, port=None)
    assert facts["release"] == pin.version
    assert facts["plan"].route == pin.route
    if pin.route == "unsupported":
        out = _apply(host)
        assert out["plan"].refused
        assert tree_bytes(host.package) == original
        return
    out = _apply(host)
    assert not out["plan"].refused, out["plan"].refusal_reason
    assert out["restart"].startswith("pending")
    if pin.route == "patch":
        patched = tree_bytes(host.package)
        assert patched != original
        assert rc.status(host.options())["host_state"] == "patched"
        assert _apply(host)["plan"].changes == ()
        assert tree_bytes(host.package) == patched
    else:
        assert tree_bytes(host.package) == original  # native: no source change
        assert (host.state / "dynspec-adaptive.json").exists()
    back = rc.revert(host.options(), dry_run=False, force=False, no_restart=True,
                     restart_cmd=None, pid=None, port=None, health_timeout=30.0)
    assert not back["plan"].refused
    assert tree_bytes(host.package) == original
    assert not (host.state / "manifest.json").exists()
    assert not (host.state / "dynspec-adaptive.json").exists()


def test_unsupported_release_refusal_is_exit_3_through_the_cli(make_host):
    unsupported = [p for p in PINS if p.route == "unsupported"]
    if not unsupported:
        pytest.skip("no unsupported release pinned")
    host = make_host(unsupported[0].version)
    host.server(*SPEC)
    out = _apply(host)
    from dynspec_patch.patcher import cli

    with pytest.raises(RefusedError):
        cli._finish(out.pop("plan"), as_json=True)
