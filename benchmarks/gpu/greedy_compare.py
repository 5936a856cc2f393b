"""(a) Greedy equivalence: the patched server at T=1 against a baseline server.

Sends the same prompts at temperature 0 to both servers, concurrently (so that the patched
server's decode batch is above T=1 and almost every step is a fallback step), and reports, per
prompt, the index of the first generated token where the outputs differ.

Expected: identical outputs for nearly all prompts; rare late divergences from floating-point
near-ties between different batch shapes/kernels are possible (fallback-design.md §4.3). An
early divergence on many prompts is a bug.

    python benchmarks/gpu/greedy_compare.py --baseline-port 30000 --patched-port 30001
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _client import add_server_args, greedy_payload, output_token_ids, server_from
from prompts import load_prompts


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, the shorter length if one is a prefix, else None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(divergences: list[int | None]) -> dict[str, object]:
    diverged = sorted(d for d in divergences if d is not None)
    return {
        "prompts": len(divergences),
        "identical": len(divergences) - len(diverged),
        "diverged": len(diverged),
        "earliest_divergence": diverged[0] if diverged else None,
        "median_divergence": diverged[len(diverged) // 2] if diverged else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(parser, "baseline", 30000, "baseline server (no speculation)")
    add_server_args(parser, "patched", 30001,
                    "patched EAGLE server (--speculative-disable-batch-threshold 1)")
    parser.add_argument("--prompts-file", type=Path, help="one prompt per line (default: built-in)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16,
                        help="requests in flight per server; keep it above T")
    parser.add_argument("--output", type=Path, help="write per-prompt results as JSON lines")
    parser.add_argument("--max-diverged-fraction", type=float, default=0.05,
                        help="exit 1 when more prompts than this diverge (default 0.05)")
    ns = parser.parse_args(argv)

    baseline, patched = server_from(ns, "baseline"), server_from(ns, "patched")
    prompts = load_prompts(ns.prompts_file, ns.num_prompts)

    def run(server, prompt: str) -> list[int]:
        ids = output_token_ids(server.generate(greedy_payload(prompt, ns.max_new_tokens,
                                                              ignore_eos=False)))
        if ids is None:
            raise RuntimeError(f"{server.base}: response carries no token ids")
        return ids

    with ThreadPoolExecutor(ns.concurrency) as pool:
        base_out = list(pool.map(lambda p: run(baseline, p), prompts))
        patch_out = list(pool.map(lambda p: run(patched, p), prompts))

    divergences = [first_divergence(a, b) for a, b in zip(base_out, patch_out, strict=True)]
    if ns.output:
        with ns.output.open("w") as fh:
            for prompt, a, b, d in zip(prompts, base_out, patch_out, divergences, strict=True):
                fh.write(json.dumps({"prompt": prompt, "first_divergence": d,
                                     "baseline_len": len(a), "patched_len": len(b)}) + "\n")
    summary = summarize(divergences)
    print(json.dumps(summary, indent=2))
    too_many = summary["diverged"] > ns.max_diverged_fraction * len(prompts)
    return 1 if too_many else 0


if __name__ == "__main__":
    sys.exit(main())
