"""The installed console script, as a user runs it after ``pip install``: ``apply --host``.

Issue 13: every ``apply --host`` of an installed dynspec-patch died with ``ModuleNotFoundError:
No module named 'patcher'`` (the plan cache named a package from before the rename) while the
suite, run from the checkout, passed. Here the console script the wheel installed runs in its
own process from a directory outside the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from remote_harness import tree_bytes

SPEC = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1")


def test_the_installed_console_script_plans_apply_host(make_host, box, tmp_path):
    host = make_host("0.5.10.post1")
    original = tree_bytes(host.package)
    host.server(*SPEC, env={"SGLANG_ENABLE_SPEC_V2": "1"})
    script = Path(sys.executable).parent / "dynspec-patch"
    env = {**os.environ, "DYNSPEC_CACHE": str(tmp_path / "cache")}  # a cold plan cache
    run = subprocess.run([str(script), "apply", "--host", box, "--threshold", "16", "--dry-run",
                          "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["route"] == "patch" and "+++ b/srt/server_args.py" in out["diff"]
    assert list((tmp_path / "cache" / "plans").glob("*.json"))  # planned through the cache
    assert tree_bytes(host.package) == original
