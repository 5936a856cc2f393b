"""Serve the threshold natively on 0.5.14+: an ``--speculative-adaptive`` config, no source change.

SGLang 0.5.14+ routes each decode batch to a slot of ``candidate_steps`` by batch size, and
steps 0 is a plain decode through a one-node verify that keeps the draft KV warm. The slot key
is compared with the batch size *padded up to the next CUDA-graph batch size*, so the key is
placed just above the padded threshold: batches of at most T (padded) keep speculating.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
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
