# Concurrency sweep + greedy reference outputs against an SGLang /generate endpoint (stdlib only).
# usage: python3 client.py URL OUT.json NAME [--levels 1,4,16,32,64,128] [--plen 256] [--olen 256]
# [--greedy 16] [--duration S --repeats R] [--olens 128,512]
# --duration S: each level is a closed loop of c clients, each sending its next request as soon as
# its last one returns, until S seconds have passed (then the requests in flight finish); a level is
# then at least S seconds of decoding instead of one wave of c requests (one hiccup moves a short
# wave's number). --repeats R runs every level R times in a row (entries keep their "repeat").
# Each level records, beside output_tok_per_s (tokens / wall, the wall running until the last
# request in flight at the deadline returns), loaded_tok_per_s: the sum over the c clients of each
# one's tokens / its own busy time, the rate while all c requests were in flight (Little's law
# for a closed loop). After the deadline fewer and fewer requests run, and how long that drain
# lasts depends on how far the clients' requests have drifted apart, not on the server's speed:
# a level of 510 requests (2 clients a wave behind) ran 10 % longer by the wall than one of 512.
# Beside it, server_tok_per_s: the same sum over each client's server-side times (SGLang's
# meta_info e2e_latency, from the request's arrival in the tokenizer manager to its last token),
# and mean_outside_server_ms, the mean of latency - e2e_latency: HTTP, the response's JSON, this
# client. On an H200 that time varied from 29 to 137 ms per request between repeats of one level
# (2026-12-04), on every kind of server, as much as the patch's whole effect.
# full_load_tok_per_s: loaded_tok_per_s over the requests that ended while every client still had
# work (full_load_requests of them): a request that ran after the first client's last one
# returned ran at lower concurrency, so faster. The loaded figure counts it: where the deadline
# falls inside a wave's returns, some clients start one more request and others stop, and that
# partial wave (e.g. 39 of 64 requests) reads 5-7 % faster than the level (a plain c = 64 level
# of 359 requests: loaded 8 400 tok/s, wall 7 964; a patched one of 320, whole waves: 7 958 and
# 7 937; H200, 2026-12-05). Which server gets a partial wave depends on where its waves end
# against the deadline, not on its speed.
# first_requests_tok_per_s and after_first_tok_per_s split loaded_tok_per_s into each client's
# first request (the level's start: its first wave's prefills, a patched server's switch to
# fallback) and the requests after it. Each client thread
# keeps one HTTP/1.1 connection open across its requests (keepalive.py), as serving clients do;
# a level's clients open theirs before its clock starts and are then released together
# (together.py), and each level records how far apart they sent their first requests
# (first_sends_span_ms);
# each level records this process's own garbage-collector pauses (gc_pauses.py, "client_gc").
# Before each level the server's radix cache is emptied (--keep-cache: not), as envelope.py does:
# a server whose KV pool is smaller (a speculative one's: the draft's KV shares it) otherwise
# starts evicting cached prompts earlier in the sweep than plain decoding. Each level also records
# the GPU's clocks (gpu_sampler.py; None without nvidia-smi) and where the server's processes and
# this client ran on the host's CPUs and what they waited for (host_sampler.py: v1's step is host
# time, and its first server on a machine ran slower at every step at the same GPU clocks), and
# the kernels the server's JIT caches gained during the level (jit_compiles.py: a first server
# compiles at first use what later ones load).
# --olens A,B: every level at each of these output lengths (each entry keeps its "olen"). Without
# --duration a level is one wave of c requests sent together, and the wave's wall at two lengths
# splits it into a fixed part (the prefill of c prompts and the steps around it) and a per-token
# part (one decode step of c requests): benchmarks/gpu/wave_fit.py fits the two per server.
# --olen-spread s: in closed loops, each prompt of the pool asks for olen * (1 +- s) tokens (one
# seeded draw per prompt, the same on every server), so the c requests never run in step: with
# equal lengths they start and finish together in waves, and a level moves by several percent
# when its waves fall out of step (benchmarks/gpu/batch_lines.py, RESULTS.md 2026-12-05).
import argparse
import http.client
import json
import queue
import random
import statistics
import sys
import time
import urllib.error

import server_info  # beside this script
from gc_pauses import GcPauses
from gpu_sampler import GpuSampler
from host_sampler import HostSampler
from jit_compiles import JitCompiles
from keepalive import post_json
from together import run_together

a = None  # the parsed arguments (main)


def prompts(seed, n):
    r = random.Random(seed)
    return [[r.randrange(1000, a.vocab) for _ in range(a.plen)] for _ in range(n)]


def post(path, body):
    return post_json(a.url, path, body, a.timeout)


def gen(ids, olen=None):
    for _attempt in range(2):  # one retry on a connection-level error
        t = time.perf_counter()
        try:
            r = post(
                "/generate",
                {
                    "input_ids": ids,
                    "sampling_params": {
                        "max_new_tokens": olen or a.olen,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                },
            )
            if isinstance(r, list):
                r = r[0]
            return r, time.perf_counter() - t
        except (ConnectionError, http.client.HTTPException, urllib.error.URLError) as e:
            err = e
            time.sleep(0.5)
    raise err


def run(reqs, conc, olen=None):
    """``reqs`` sent by ``conc`` clients released together, each taking the next one as its
    last returns; (results in the order of reqs, wall seconds, how far apart in ms the clients
    sent their first requests)."""
    todo = queue.SimpleQueue()
    for i in range(len(reqs)):
        todo.put(i)
    res = [None] * len(reqs)

    def client(_k, _t0):
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            res[i] = gen(reqs[i], olen)

    _, t0, first_span = run_together(conc, client, a.url, a.timeout)
    return res, time.perf_counter() - t0, first_span


def pool_lengths(rng, size, olen, spread):
    """Each prompt's new tokens in a closed loop: ``olen``, or with ``spread`` s one draw each
    from olen * (1 +- s), the same for every server given the same seed."""
    if not spread:
        return [olen] * size
    return [max(1, round(olen * rng.uniform(1.0 - spread, 1.0 + spread))) for _ in range(size)]


def run_for(seed, conc, duration, olen=None):
    """A closed loop of ``conc`` clients issuing requests until ``duration`` seconds passed.

    Returns (results, wall seconds, output_ids of the first answer to each prompt of the
    pool by prompt index, each client's (result, latency, end) list, ``end`` in seconds since
    the clients were released, how far apart in ms the clients sent their first requests).
    Client k sends prompts k, k + conc, ...: how many each one finishes depends on the
    server's timing, so outputs are compared by prompt, never by position in the results.
    The clients start together (together.py)."""
    rng = random.Random(seed)
    pool = [[rng.randrange(1000, a.vocab) for _ in range(a.plen)] for _ in range(4 * conc)]
    lengths = pool_lengths(rng, len(pool), olen or a.olen, a.olen_spread)
    by_prompt = {}

    def client(k, t0):
        done, i = [], k
        while time.perf_counter() - t0 < duration:
            r = gen(pool[i % len(pool)], lengths[i % len(pool)])
            by_prompt.setdefault(i % len(pool), r[0].get("output_ids"))
            done.append((*r, time.perf_counter() - t0))
            i += conc
        return done

    parts, t0, first_span = run_together(conc, client, a.url, a.timeout)
    res = [r for part in parts for r in part]
    return (res, time.perf_counter() - t0, by_prompt, parts, first_span)


def tokens(result):
    r = result[0]
    return r.get("meta_info", {}).get("completion_tokens", len(r.get("output_ids", [])))


def loaded_rate(parts):
    """Sum over the clients of each one's tokens / its busy time (the latencies of its requests,
    back to back): without the clients' idle time in the drain after the deadline, but with a
    partial last wave's faster requests (``full_load_rate`` leaves those out)."""
    return sum(sum(map(tokens, part)) / sum(r[1] for r in part) for part in parts if part)


# A request that ends this fraction of the median latency after the drain began still counts
# as run at full load: a wave in step ends at one decode step, its answers a few ms apart.
FULL_LOAD_SLACK = 0.05


def full_load_rate(parts):
    """(``loaded_rate`` over the requests that ended by the drain's start, how many): the drain
    starts when the first client's last request returns (from then on fewer than c run); each
    part's entries are (result, latency, end), ``end`` on one clock for every client."""
    live = [part for part in parts if part]
    if not live:
        return 0.0, 0
    latency = statistics.median(r[1] for part in live for r in part)
    cut = min(part[-1][2] for part in live) + FULL_LOAD_SLACK * latency
    kept = [[r for r in part if r[2] <= cut] for part in live]
    return loaded_rate(kept), sum(map(len, kept))


def loaded_rate_split(parts):
    """``loaded_rate`` over each client's first request alone, and over the requests after
    it: a level's start (its first wave's prefills; a patched server's switch to fallback and,
    on its first level, its one-time checks) apart from the closed loop that follows."""
    return loaded_rate([part[:1] for part in parts]), loaded_rate([part[1:] for part in parts])


def server_time(result):
    """The server's own time for a request (meta_info e2e_latency), None where it has none."""
    return result[0].get("meta_info", {}).get("e2e_latency") or None


def server_rate(parts):
    """``loaded_rate`` by the server's times instead of the client's latencies: what the
    server did while busy, without the time a request spent in HTTP and in this client. None
    where a request has no server time."""
    times = [server_time(r) for part in parts for r in part]
    if not times or None in times:
        return None
    return sum(sum(map(tokens, part)) / sum(map(server_time, part)) for part in parts if part)


def summarize(res, wall, conc):
    mi = [r[0].get("meta_info", {}) for r in res]
    toks = [tokens(r) for r in res]
    lat = [r[1] for r in res]
    tpot = [lt / max(1, t) * 1000 for lt, t in zip(lat, toks, strict=False)]
    d = dict(
        concurrency=conc,
        requests=len(res),
        wall_s=round(wall, 3),
        output_tokens=sum(toks),
        output_tok_per_s=round(sum(toks) / wall, 1),
        req_per_s=round(len(res) / wall, 3),
        mean_latency_s=round(statistics.mean(lat), 3),
        p50_latency_s=round(statistics.median(lat), 3),
        mean_tpot_ms=round(statistics.mean(tpot), 3),
        mean_server_e2e_s=round(statistics.mean([m.get("e2e_latency", 0) or 0 for m in mi]), 3),
    )
    outside = [r[1] - server_time(r) for r in res if server_time(r) is not None]
    if outside:
        d["mean_outside_server_ms"] = round(1000 * statistics.mean(outside), 1)
    acc = [m["spec_accept_length"] for m in mi if m.get("spec_accept_length") is not None]
    vct = [m["spec_verify_ct"] for m in mi if m.get("spec_verify_ct") is not None]
    if acc:
        d["mean_spec_accept_length"] = round(statistics.mean(acc), 3)
    if vct:
        d["mean_spec_verify_ct"] = round(statistics.mean(vct), 2)
        d["tokens_per_verify"] = round(sum(toks) / max(1, sum(vct)), 3)
    return d


def parse(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("name")
    ap.add_argument("--levels", default="1,4,16,32,64,128")
    ap.add_argument("--plen", type=int, default=256)
    ap.add_argument("--olen", type=int, default=256)
    ap.add_argument("--olens", default="", help="comma list: every level at each length")
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=128000)
    ap.add_argument("--min-reqs", type=int, default=8)
    ap.add_argument("--mult", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--duration", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--keep-cache", action="store_true")
    ap.add_argument("--olen-spread", type=float, default=0.0,
                    help="closed loops (--duration): each prompt's length olen * (1 +- s)")
    parsed = ap.parse_args(argv)
    if not 0.0 <= parsed.olen_spread < 1.0:
        ap.error(f"--olen-spread must be in [0, 1), got {parsed.olen_spread}")
    return parsed


def main(argv):
    global a
    a = parse(argv)
    out = {"name": a.name, "url": a.url, "plen": a.plen, "olen": a.olen, "levels": [], "errors": []}
    info, error = server_info.fetch(a.url)
    if info:
        out["server_info"] = info
    if error:
        out["errors"].append(error)
    out["effective_args"] = server_info.effective_args(info)
    print("effective args:", out["effective_args"], flush=True)
    # warm-up (short) so lazy compilation does not land in the first measured level
    try:
        run([p for p in prompts(7, 4)], 4)
        print("warm-up done", flush=True)
    except Exception as e:
        out["errors"].append(f"warmup: {e!r}")
    # greedy reference outputs, concurrency 1
    t = time.perf_counter()
    gp = prompts(12345, a.greedy)
    greedy = []
    for p in gp:
        try:
            r, _ = gen(p)
            greedy.append(r.get("output_ids"))
        except Exception as e:
            greedy.append(None)
            out["errors"].append(f"greedy: {e!r}")
    out["greedy_c1"] = greedy
    print(f"greedy c=1: {len(greedy)} prompts in {time.perf_counter() - t:.1f}s", flush=True)
    olens = [int(x) for x in a.olens.split(",") if x] or [a.olen]
    levels = [int(x) for x in a.levels.split(",") if x]
    for c, olen, rep in [(c, o, r) for c in levels for o in olens for r in range(a.repeats)]:
        n = max(a.min_reqs, a.mult * c)
        flushed = False
        if not a.keep_cache:
            why = server_info.flush_cache(a.url)
            flushed = not why
            if why:
                out["errors"].append(f"c={c}: cache not flushed: {why}")
        try:
            with (GpuSampler() as gpu, GcPauses() as pauses, HostSampler() as host,
                  JitCompiles() as jit):
                if a.duration > 0:
                    res, wall, by_prompt, parts, first_span = run_for(
                        1000 + c + 7919 * rep, c, a.duration, olen
                    )
                    firsts = [by_prompt.get(i) for i in range(min(16, c))]
                else:
                    res, wall, first_span = run(prompts(1000 + c, n), c, olen)
                    firsts = [r.get("output_ids") for r, _ in res[:16]]
            d = summarize(res, wall, c)
            d["repeat"] = rep
            d["olen"] = olen
            if a.duration > 0:
                d["duration_s"] = a.duration
                d["olen_spread"] = a.olen_spread
                d["loaded_tok_per_s"] = round(loaded_rate(parts), 1)
                served = server_rate(parts)
                d["server_tok_per_s"] = None if served is None else round(served, 1)
                full, counted = full_load_rate(parts)
                d["full_load_tok_per_s"] = round(full, 1)
                d["full_load_requests"] = counted
                first, after = loaded_rate_split(parts)
                d["first_requests_tok_per_s"] = round(first, 1)
                d["after_first_tok_per_s"] = round(after, 1)
            d["first_sends_span_ms"] = first_span
            d["cache_flushed"] = flushed
            d["gpu"] = gpu.summary()
            d["host"] = host.summary()
            d["jit_compiled"] = jit.summary()
            d["client_gc"] = pauses.summary()
            if rep == 0 and olen == olens[0] and c == max(levels):
                # greedy outputs of the fixed prompts under load
                d["note"] = "output_ids of prompts 0-15 kept in greedy_at_max_conc"
                out["greedy_at_max_conc"] = firsts
        except Exception as e:
            d = dict(concurrency=c, error=repr(e))
            out["errors"].append(f"c={c}: {e!r}")
        out["levels"].append(d)
        print(json.dumps(d), flush=True)
        with open(a.out, "w") as f:
            json.dump(out, f)
    with open(a.out, "w") as f:
        json.dump(out, f)
    print("wrote", a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
