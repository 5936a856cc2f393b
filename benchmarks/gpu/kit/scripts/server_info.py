"""What the kit's clients record of the server they measure (stdlib only).

``effective_args``: the server_info fields that decide a run's speed, in every result file,
so a number always travels with the configuration it came from.
"""

from __future__ import annotations

import json
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
