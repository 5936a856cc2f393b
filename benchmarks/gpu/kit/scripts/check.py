"""Greedy checks against a server running the crafted successor models (stdlib only).

usage: python3 check.py URL OUT.json NAME

Every output token is compared with the model's analytic continuation (crafted.py), so a
dropped, repeated or wrong token anywhere - before, during or after a switch - is a mismatch.
Phases:
  c1        2 prompts per acceptance region at concurrency 1 (speculating below the threshold):
            tokens/s and accept length per region
  burst     64 requests at once (fallback above the threshold), then c1 again (resumed)
  ramp      48 requests with lengths 16..256: the batch shrinks through the threshold while
            they finish, so the server switches back mid-flight
  late      48 requests of 192 tokens at once (fallback), and 8 more of 384 tokens sent while
            those decode: the 8 are prefilled during fallback steps (the prefill's draft pass,
            DYNSPEC_DRAFT_PREFILL_WRITE) and speculate once the 48 are done: every token
            they return is checked as everywhere else. (Their accept lengths average their
            fallback steps in, and the crafted draft proposes from the token alone, so they
            cannot show whether the draft KV holds: the server's prefill-write check line does.)
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crafted

URL, OUT, NAME = sys.argv[1], sys.argv[2], sys.argv[3]
PROMPT_LEN = 64
LATE_AFTER_S = 0.3  # the 48 early requests are decoding by then (prefilled in one batch)


def prompt(rng: random.Random, region: int) -> list[int]:
    start = crafted.region_start(region)
    return [rng.randrange(start, start + crafted.REGION_SIZE) for _ in range(PROMPT_LEN)]


def generate(item: tuple[list[int], int]) -> dict:
    ids, n = item
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    req = urllib.request.Request(
        URL + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
    except Exception as exc:
        return {"error": repr(exc)}
    out = out[0] if isinstance(out, list) else out
    got = out.get("output_ids") or []
    want = crafted.expected_continuation(ids, n)
    first_bad = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if first_bad is None and len(got) != n:
        first_bad = min(len(got), n)
    meta = out.get("meta_info", {})
    return {
        "region": crafted.REGIONS[crafted.region_of(ids[0])][0],
        "tokens": len(got),
        "latency_s": time.perf_counter() - t,
        "mismatch_at": first_bad,
        "accept_length": meta.get("spec_accept_length"),
    }


def run(items: list[tuple[list[int], int]], concurrency: int) -> tuple[list[dict], float]:
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        res = list(ex.map(generate, items))
    return res, time.perf_counter() - t


def summary(res: list[dict], wall: float) -> dict:
    ok = [r for r in res if "error" not in r]
    return {
        "requests": len(res),
        "failed": len(res) - len(ok),
        "mismatched": sum(r["mismatch_at"] is not None for r in ok),
        "first_mismatches": [r["mismatch_at"] for r in ok if r["mismatch_at"] is not None][:8],
        "tokens": sum(r["tokens"] for r in ok),
        "tok_per_s": round(sum(r["tokens"] for r in ok) / wall, 1),
    }


def per_region(res: list[dict]) -> dict:
    out = {}
    for name, _ in crafted.REGIONS:
        rs = [r for r in res if r.get("region") == name]
        acc = [r["accept_length"] for r in rs if r.get("accept_length") is not None]
        out[name] = {
            "tok_per_s": round(sum(r["tokens"] for r in rs) / sum(r["latency_s"] for r in rs), 1),
            "accept_length": round(statistics.mean(acc), 3) if acc else None,
            "mismatched": sum(r["mismatch_at"] is not None for r in rs),
        }
    return out


def c1_phase(rng: random.Random) -> tuple[dict, list[dict]]:
    items = [(prompt(rng, r), 128) for r in range(len(crafted.REGIONS)) for _ in range(2)]
    res, wall = run(items, 1)
    return {**summary(res, wall), "by_region": per_region(res)}, res


def late_phase(rng: random.Random) -> dict:
    early = [(prompt(rng, i % len(crafted.REGIONS)), 192) for i in range(48)]
    late = [(prompt(rng, i % len(crafted.REGIONS)), 384) for i in range(8)]
    t = time.perf_counter()
    with ThreadPoolExecutor(len(early) + len(late)) as ex:
        early_futures = [ex.submit(generate, item) for item in early]
        time.sleep(LATE_AFTER_S)
        late_futures = [ex.submit(generate, item) for item in late]
        res_early = [f.result() for f in early_futures]
        res_late = [f.result() for f in late_futures]
    wall = time.perf_counter() - t
    return {**summary(res_early + res_late, wall), "late_by_region": per_region(res_late)}


def main() -> None:
    rng = random.Random(20261130)
    report: dict = {"name": NAME, "url": URL, "phases": {}}
    run([(prompt(rng, 2), 16)], 1)  # warm-up
    report["phases"]["c1"], _ = c1_phase(rng)
    burst = [(prompt(rng, i % len(crafted.REGIONS)), 192) for i in range(64)]
    res, wall = run(burst, 64)
    report["phases"]["burst64"] = summary(res, wall)
    report["phases"]["c1_after_burst"], _ = c1_phase(rng)
    ramp = [(prompt(rng, i % len(crafted.REGIONS)), 16 + 5 * i) for i in range(48)]
    res, wall = run(ramp, 48)
    report["phases"]["ramp48"] = summary(res, wall)
    report["phases"]["c1_after_ramp"], _ = c1_phase(rng)
    report["phases"]["late48"] = late_phase(rng)
    phases = report["phases"].values()
    report["total_requests"] = sum(p["requests"] for p in phases)
    report["total_failed"] = sum(p["failed"] for p in phases)
    report["total_mismatched"] = sum(p["mismatched"] for p in phases)
    with open(OUT, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "phases"}))
    for name, p in report["phases"].items():
        print(name, json.dumps(p))


if __name__ == "__main__":
    main()
