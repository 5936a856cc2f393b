"""What the kit's clients record of the server they measure, and ask of it (stdlib only).

``effective_args``: the server_info fields that decide a run's speed, in every result file,
so a number always travels with the configuration it came from. ``flush_cache``: the server's
radix cache emptied before a level, so every server meets every level in the same state.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

EFFECTIVE_KEYS = (
    "speculative_algorithm",
    "disable_overlap_schedule",
    "speculative_eagle_topk",
    "speculative_num_steps",
    "speculative_num_draft_tokens",
    "speculative_disable_batch_threshold",
    "speculative_adaptive",
    "speculative_adaptive_config",
    "tp_size",
    "dp_size",
    "disable_cuda_graph",
    "cuda_graph_max_bs",
    "max_running_requests",
    "attention_backend",
    "version",
)
# /flush_cache answers 400 while requests are still running or queued: retry this often, 0.2 s
# apart (a level's last responses are in, but the scheduler may not have retired them yet).
FLUSH_TRIES = 50


def fetch(url: str) -> tuple[dict, str | None]:
    """The server's info (``/get_server_info``, else ``/server_info``), or ({}, why not)."""
    error = None
    for path in ("/get_server_info", "/server_info"):
        try:
            with urllib.request.urlopen(url + path, timeout=30) as r:
                return json.loads(r.read()), None
        except Exception as exc:  # a benchmark records the failure and goes on
            error = f"server_info: {exc!r}"
    return {}, error


def effective_args(info: dict, keys: tuple[str, ...] = EFFECTIVE_KEYS) -> dict:
    return {k: info.get(k) for k in keys}


def flush_cache(url: str, tries: int = FLUSH_TRIES) -> str:
    """Empty the server's radix cache: "" once it did, else why not."""
    why = ""
    for _ in range(tries):
        req = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30):
                return ""
        except urllib.error.HTTPError as exc:  # 400: requests still running
            why = f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace').strip()}"
        except OSError as exc:  # URLError, a reset
            return repr(exc)
        time.sleep(0.2)
    return why
