"""The argument spec of dynspec.patch.sglang_dynspec, shared by the action plugin (which
validates the task with it) and the module file (which only documents the module)."""

from __future__ import annotations

ARGUMENT_SPEC = {
    "state": {"type": "str", "default": "present", "choices": ["present", "absent"]},
    "threshold": {"type": "raw"},  # an int 1..65536 or "auto" (checked by patcher.engine)
    "worker": {"type": "str", "default": "auto", "choices": ["auto", "v1", "v2", "both"]},
    "route": {"type": "str", "choices": ["patch", "native"]},
    "restart": {"type": "bool", "default": True},
    "restart_cmd": {"type": "str"},
    "health_timeout": {"type": "float", "default": 1200.0},
    "stop_timeout": {"type": "float", "default": 60.0},
    "server_port": {"type": "int"},
    "server_pid": {"type": "int"},
    "router": {"type": "str"},
    "router_worker_url": {"type": "str"},
    "drain_timeout": {"type": "float", "default": 600.0},
    "force": {"type": "bool", "default": False},
}
