"""Serve the threshold natively on 0.5.14+: an ``--speculative-adaptive`` config, no source change.

SGLang 0.5.14+ routes each decode batch to a slot of ``candidate_steps`` by batch size, and
steps 0 is a plain decode through a one-node verify that keeps the draft KV warm. The slot key
is compared with the batch size *padded up to the next CUDA-graph batch size*, so the key is
placed just above the padded threshold: batches of at most T (padded) keep speculating.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CONFIG_FILE_NAME = "dynspec-adaptive.json"


@dataclass(frozen=True)
class NativeConfig:
    flags: tuple[str, ...]
    config: dict[str, dict[str, list[int]]]
    threshold: int
    effective_threshold: int
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "flags": list(self.flags),
            "config": self.config,
            "threshold": self.threshold,
            "effective_threshold": self.effective_threshold,
            "notes": list(self.notes),
        }


def _padded(batch_size: int, cuda_graph_bs: Sequence[int]) -> int:
    ordered = sorted(cuda_graph_bs)
    index = bisect.bisect_left(ordered, batch_size)
    return ordered[index] if index < len(ordered) else batch_size


def native_config(
    threshold: int,
    num_steps: int,
    config_path: str,
    cuda_graph_bs: Sequence[int] | None = None,
) -> NativeConfig:
    """Flags and JSON config that make 0.5.14+ speculate at batch ≤ T and plain-decode above."""
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1, got {threshold}")
    if num_steps < 1:
        raise ValueError(f"speculative num steps must be >= 1, got {num_steps}")
    notes = [
        "needs --speculative-eagle-topk 1 (adaptive refuses topk > 1), no DP attention, "
        "no multi-layer EAGLE, no two-batch overlap, no pdmux",
        f"--speculative-num-steps must stay {num_steps}: it is the only speculative candidate",
        "no hysteresis across slots: the switch happens on each step's batch size",
    ]
    effective = threshold
    if cuda_graph_bs:
        effective = _padded(threshold, cuda_graph_bs)
        if effective != threshold:
            notes.append(
                f"batch sizes are padded to CUDA-graph sizes first, so speculation runs up to "
                f"{effective}, not {threshold}; pick a captured batch size to be exact"
            )
    else:
        notes.append(
            "CUDA-graph batch sizes unknown: exact only if the threshold is a captured batch size "
            "or CUDA graphs are off"
        )
    config = {
        "1": {"candidate_steps": [num_steps]},
        str(effective + 1): {"candidate_steps": [0]},
    }
    flags = ("--speculative-adaptive", "--speculative-adaptive-config", config_path)
    return NativeConfig(flags, config, threshold, effective, tuple(notes))


# SGLang 0.5.14+ (speculative/adaptive_spec_params.py: adaptive_unsupported_reason) switches
# --speculative-adaptive off with a warning in these configurations: the threshold would then
# silently do nothing, so they are refused before anything is written.
_UNSUPPORTED_SWITCHES = (
    ("enable_dp_attention", "--enable-dp-attention", "DP attention (tier decisions are not "
     "synchronized across DP ranks)"),
    ("enable_multi_layer_eagle", "--enable-multi-layer-eagle", "multi-layer EAGLE "
     "(MultiLayerEagleWorkerV2 does not implement adaptive)"),
    ("enable_two_batch_overlap", "--enable-two-batch-overlap", "two-batch overlap (the "
     "adaptive state swap would discard the TboAttnBackend wrapper)"),
    ("enable_pdmux", "--enable-pdmux", "pdmux (the adaptive state swap does not update "
     "decode_attn_backend_group)"),
)


def _flag_value(argv: Sequence[str], name: str) -> str | None:
    value = None
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def adaptive_unsupported_reason(
    server_args: Mapping[str, object], argv: Sequence[str] = ()
) -> str | None:
    """Why SGLang would switch ``--speculative-adaptive`` off for this server (None: it runs).

    ``server_args`` are the server's effective args where known, ``argv`` its command line.
    """
    algorithm = server_args.get("speculative_algorithm") or _flag_value(
        argv, "--speculative-algorithm"
    )
    if algorithm is not None and algorithm not in ("EAGLE", "EAGLE3", "NEXTN"):
        return f"speculative_algorithm={algorithm} (adaptive supports EAGLE/EAGLE3 only)"
    topk = server_args.get("speculative_eagle_topk")
    if topk is None:
        topk = _flag_value(argv, "--speculative-eagle-topk")
    if topk is not None and str(topk) != "1":
        return f"speculative_eagle_topk={topk} (adaptive supports topk 1 only)"
    for key, flag, what in _UNSUPPORTED_SWITCHES:
        if server_args.get(key) or flag in argv:
            return f"{key}=True: {what}"
    return None
