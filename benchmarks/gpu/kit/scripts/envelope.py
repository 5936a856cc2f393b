"""The envelope sweep (issue 16): tokens/s per concurrency per draft-acceptance region, one server.

usage: python3 envelope.py URL OUT.json NAME [--levels 1,4,16,32,64,128]
           [--regions accept0,accept50,accept90,mix] [--duration 10] [--repeats 2]
           [--plen 64] [--olen 128] [--olen-spread 0] [--burst 1,64,1]
           [--burst-region accept50] [--keep-cache] [--estimate]

The server runs the crafted successor models (crafted.py): a prompt's tokens pick its region, so
the draft's acceptance is ~0 %, ~50 % or ~90 % ("mix": each client cycles through the three
regions request by request, so every batch holds all three). For each region and each level c a
closed loop of c clients runs for >= DURATION s (each client sends its next request as its last
one returns; the requests in flight then finish), REPEATS times in a row, as client.py does.
Every output is checked against the model's analytic continuation (``mismatched``).
``--olen-spread s`` draws each request's length from OLEN * (1 +- s), from the client's own
seeded draws, so every server gets the same requests: with one length for all, the c requests
of a level start together and, one token a step, finish together, and a server that does
anything that desynchronises them (a speculative step) pays for more, smaller prefill batches
that no real traffic has.
Before each sweep level, and once before the burst, the client empties the server's radix cache
(``POST /flush_cache``; ``--keep-cache``: not), so every server meets every level in the same
state. Without it the comparison depended on run order: on 2026-12-03 the crafted 8b servers'
KV pools (745k tokens) filled with cached prompts after ~750k tokens of traffic, and from then on
each allocation ran SGLang's eviction, which walks every cached leaf (``RadixCache.evict``); the
patched servers, which ran two regions, met that in their second region, plain decoding (one
region) never did.
Each level also records the GPU's clocks, temperature, power and throttle reasons while it ran
(``"gpu"``, gpu_sampler.py; None without nvidia-smi): on 2026-12-03 servers running the same
kind of step differed by 10-20 % at c >= 64, and a level that records no clocks cannot tell a
slower GPU from a slower server; and the host's CPUs as the server's processes met them
(``"host"``, host_sampler.py: the scheduler's CPU share, run-queue wait, the cores it ran on and
how busy their SMT siblings were), the step's other half; and the kernels the server's JIT
caches gained during the level (``"jit_compiled"``, jit_compiles.py).
``--burst`` then runs its levels back to back once more in ``--burst-region`` (``"phase":
"burst"``; accept50, where speculation wins at c = 1 and plain steps at c = 64 on the 8b
models): each level records its wall-clock start and end (``started_unix``/``ended_unix``), so
the server log's switch lines show how long after a load change the controller switched.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crafted
import server_info
from gpu_sampler import GpuSampler
from host_sampler import HostSampler
from jit_compiles import JitCompiles
from keepalive import post_json
from together import run_together

MIX = "mix"
REGION_NAMES = tuple(name for name, _ in crafted.REGIONS)
EFFECTIVE_KEYS = (*server_info.EFFECTIVE_KEYS, "model_path")  # which crafted model ran
WARMUP_S = 15.0  # server info, warm-up requests
# Seconds after DURATION until a level's last requests finish: OLEN tokens at ~20 ms a token (the
# slowest case measured, unpatched EAGLE-3 at c = 128, is ~50 tokens/s per request).
TAIL_S_PER_TOKEN = 0.02


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("name")
    ap.add_argument("--levels", default="1,4,16,32,64,128")
    ap.add_argument("--regions", default=",".join((*REGION_NAMES, MIX)))
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--plen", type=int, default=64)
    ap.add_argument("--olen", type=int, default=128)
    ap.add_argument("--olen-spread", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--burst", default="", help="levels run back to back after the sweep")
    ap.add_argument("--burst-region", default="accept50", choices=REGION_NAMES)
    ap.add_argument("--keep-cache", action="store_true",
                    help="do not empty the radix cache before each level")
    ap.add_argument("--seed", type=int, default=0,
                    help="another set of draws (prompts, lengths) for every level: the same "
                         "seed gives every server the same requests, and one sample of the "
                         "traffic then recurs on each")
    ap.add_argument("--estimate", action="store_true")
    a = ap.parse_args(argv)
    a.level_list = [int(x) for x in a.levels.split(",") if x]
    a.region_list = [r for r in a.regions.split(",") if r]
    a.burst_list = [int(x) for x in a.burst.split(",") if x]
    unknown = [r for r in a.region_list if r not in (*REGION_NAMES, MIX)]
    if (unknown or not a.region_list or not a.level_list
            or min(a.level_list + a.burst_list) < 1 or not 0.0 <= a.olen_spread < 1.0):
        ap.error(f"--regions from {', '.join((*REGION_NAMES, MIX))}; "
                 "--levels and --burst integers >= 1; --olen-spread in [0, 1)")
    return a


def estimate_s(levels: int, regions: int, repeats: int, duration: float, olen: int,
               burst: int = 0) -> int:
    """Expected seconds of one sweep and its burst levels (server start not included)."""
    runs = levels * regions * repeats + burst
    return round(WARMUP_S + runs * (duration + olen * TAIL_S_PER_TOKEN))


def prompt(rng: random.Random, region: int, length: int) -> list[int]:
    start = crafted.region_start(region)
    return [rng.randrange(start, start + crafted.REGION_SIZE) for _ in range(length)]


def region_of_request(region: str, client: int, sent: int) -> int:
    """The region index of a client's ``sent``-th request ("mix": all three, in turn)."""
    if region == MIX:
        return (client + sent) % len(REGION_NAMES)
    return REGION_NAMES.index(region)


class Sweep:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a

    def length(self, rng: random.Random) -> int:
        """A request's new tokens: OLEN, or OLEN * (1 +- spread) from the client's draws."""
        if not self.a.olen_spread:
            return self.a.olen
        spread = self.a.olen_spread
        return max(1, round(self.a.olen * rng.uniform(1.0 - spread, 1.0 + spread)))

    def generate(self, ids: list[int], olen: int | None = None) -> dict:
        olen = olen or self.a.olen
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": olen, "temperature": 0,
                                "ignore_eos": True},
        }
        t = time.perf_counter()
        try:
            out = post_json(self.a.url, "/generate", body, self.a.timeout)
        except (OSError, ValueError, http.client.HTTPException) as exc:  # a reset, a bad body
            return {"error": repr(exc)}
        latency = time.perf_counter() - t
        out = out[0] if isinstance(out, list) else out
        got = out.get("output_ids") or []
        meta = out.get("meta_info") or {}
        e2e = meta.get("e2e_latency")
        return {
            "latency_s": latency,
            "tokens": meta.get("completion_tokens", len(got)),
            "mismatched": got != crafted.expected_continuation(ids, olen),
            "accept_length": meta.get("spec_accept_length"),
            "outside_server_s": None if e2e is None else latency - e2e,
        }

    def level(self, region: str, conc: int, seed: int) -> dict:
        """One closed loop of ``conc`` clients for >= duration seconds, started together
        (together.py)."""
        duration, started = self.a.duration, time.time()

        def client(k: int, t0: float) -> list[dict]:
            rng, done = random.Random(seed * 1000 + k), []
            while time.perf_counter() - t0 < duration:
                ids = prompt(rng, region_of_request(region, k, len(done)), self.a.plen)
                done.append(self.generate(ids, self.length(rng)))
            return done

        parts, t0, first_span = run_together(conc, client, self.a.url, self.a.timeout)
        res = [r for part in parts for r in part]
        return {**summarize(res, time.perf_counter() - t0, conc),
                "first_sends_span_ms": first_span,
                "started_unix": round(started, 3), "ended_unix": round(time.time(), 3)}


def summarize(res: list[dict], wall: float, conc: int) -> dict:
    ok = [r for r in res if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    d = {
        "concurrency": conc,
        "requests": len(res),
        "failed": len(res) - len(ok),
        "mismatched": sum(r["mismatched"] for r in ok),
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / wall, 1),
        "req_per_s": round(len(ok) / wall, 3),
    }
    if ok:
        d["mean_latency_s"] = round(statistics.mean(r["latency_s"] for r in ok), 3)
        d["mean_tpot_ms"] = round(
            statistics.mean(r["latency_s"] / max(1, r["tokens"]) * 1000 for r in ok), 3)
    acc = [r["accept_length"] for r in ok if r["accept_length"] is not None]
    if acc:
        d["mean_spec_accept_length"] = round(statistics.mean(acc), 3)
    outside = [r["outside_server_s"] for r in ok if r["outside_server_s"] is not None]
    if outside:  # HTTP, JSON and this client: the same code on every server
        d["mean_outside_server_ms"] = round(1000 * statistics.mean(outside), 1)
    errors = [r["error"] for r in res if "error" in r]
    if errors:
        d["first_error"] = errors[0]
    return d


def main(argv: list[str]) -> None:
    a = parse_args(argv)
    longest = round(a.olen * (1.0 + a.olen_spread))
    planned = estimate_s(len(a.level_list), len(a.region_list), a.repeats, a.duration, longest,
                         len(a.burst_list))
    if a.estimate:
        print(planned)
        return
    print(f"envelope {a.name}: {len(a.region_list)} regions x {len(a.level_list)} levels x "
          f"{a.repeats} repeats of >= {a.duration:g}s: about {planned}s", flush=True)
    started = time.perf_counter()
    info, error = server_info.fetch(a.url)
    out: dict = {
        "name": a.name, "url": a.url, "plen": a.plen, "olen": a.olen,
        "olen_spread": a.olen_spread, "seed": a.seed, "duration_s": a.duration,
        "repeats": a.repeats, "regions": a.region_list, "estimated_s": planned,
        "flush_cache": not a.keep_cache,
        "server_info": info, "effective_args": server_info.effective_args(info, EFFECTIVE_KEYS),
        "levels": [], "errors": [error] if error else [],
    }
    print("effective args:", json.dumps(out["effective_args"]), flush=True)
    sweep = Sweep(a)
    rng = random.Random(7)
    with ThreadPoolExecutor(4) as ex:  # warm-up: lazy compiles stay out of the first level
        warm = list(ex.map(sweep.generate, [prompt(rng, i % 3, a.plen) for i in range(8)]))
    out["errors"] += [f"warmup: {w['error']}" for w in warm if "error" in w]
    runs = [("sweep", region, conc, rep) for region in a.region_list for conc in a.level_list
            for rep in range(a.repeats)]
    runs += [("burst", a.burst_region, conc, 0) for conc in a.burst_list]
    for n, (phase, region, conc, rep) in enumerate(runs):
        first_of_burst = phase == "burst" and runs[n - 1][0] != "burst"
        flushed = False
        if not a.keep_cache and (phase == "sweep" or first_of_burst):
            why = server_info.flush_cache(a.url)
            flushed = not why
            if why:
                out["errors"].append(f"{phase} {region} c={conc}: cache not flushed: {why}")
        with GpuSampler() as gpu, HostSampler() as host, JitCompiles() as jit:
            seed = 1000 + conc + 7919 * rep + 31 * n + 104729 * a.seed
            d = {"region": region, **sweep.level(region, conc, seed)}
        d |= {"repeat": rep, "duration_s": a.duration, "phase": phase, "cache_flushed": flushed,
              "gpu": gpu.summary(), "host": host.summary(), "jit_compiled": jit.summary()}
        if d["failed"]:
            out["errors"].append(f"{phase} {region} c={conc}: {d['first_error']}")
        out["levels"].append(d)
        print(json.dumps(d), flush=True)
        out["elapsed_s"] = round(time.perf_counter() - started, 1)
        with open(a.out, "w") as f:
            json.dump(out, f)
    out["elapsed_s"] = round(time.perf_counter() - started, 1)
    with open(a.out, "w") as f:
        json.dump(out, f)
    print(f"wrote {a.out} in {out['elapsed_s']}s (estimated {planned}s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
