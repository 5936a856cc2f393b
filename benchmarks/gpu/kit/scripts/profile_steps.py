# Where a loaded server's decode steps spend their time (stdlib only).
# usage: python3 profile_steps.py URL OUTDIR NAME [--concurrency 64] [--steps 30] [--trace-root DIR]
#                                [--olen 512 [--olen-spread S]] [--wave OLEN [--waves N]]
#
# Keeps CONCURRENCY clients in a closed loop, asks the server for a torch-profiler trace of STEPS
# forward steps (SGLang's /start_profile, GPU activity only, so the host is not slowed down), then
# reads the trace: GPU busy time (the union of kernel intervals) against the wall span of the
# profiled steps, and the kernels that took the most time. A step whose GPU is busy for much less
# than its wall time is host-bound (Python, launches, synchronisation), not kernel-bound.
# The window is also cut into decode steps (every --layers decode-marker kernels start one):
# the intervals that hold a prefill (--prefill-marker kernels) against those that hold a decode
# step alone, with what the prefill's intervals add in wall time, in GPU busy time and by kernel,
# and the GPU's idle gaps longer than --gap-us inside them with the kernels on either side.
# --olen-spread S: each request asks for OLEN * (1 +- S) new tokens, so requests end and new
# ones are prefilled every few steps, as on mixed traffic (the envelope's OLEN_SPREAD).
#
# --wave OLEN: instead, one wave on an idle server with an empty radix cache: the trace starts,
# CONCURRENCY requests of OLEN new tokens go out together, the trace stops when the last returns.
# Every server does the same work in that window (the prefill of the wave's prompts, the decode
# steps, the switch between them), so two servers' traces compare kernel by kernel, which a
# closed loop's window of STEPS steps does not (on 2026-12-04 one held prefill batches and the
# other none). The window splits at the first decode-attention kernel (--decode-marker) into the
# prefill phase and the decode phase, each with its wall and GPU busy time; the GPU's idle gaps
# longer than --gap-us are counted and the largest listed with the kernels around them.
# --waves N: each client sends N requests one after another, as a closed loop does, so the
# trace holds N - 1 boundaries where one wave ends and the next one's prefill runs. Every
# --layers decode-marker kernels start a decode step; the time outside the steady steps (the
# window before the first step, each step interval beyond the median step, the tail) is what
# the waves cost beyond their decode steps: the fixed part wave_fit.py fits, traced.
# Writes OUTDIR/NAME.profile.json and prints a short table.
import argparse
import bisect
import glob
import gzip
import itertools
import json
import os
import random
import threading
import time
import urllib.request

from keepalive import post_json  # beside this script
from together import run_together

ap = argparse.ArgumentParser()
ap.add_argument("url")
ap.add_argument("outdir")
ap.add_argument("name")
ap.add_argument("--concurrency", type=int, default=64)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--plen", type=int, default=256)
ap.add_argument("--olen", type=int, default=512)
ap.add_argument(
    "--olen-spread",
    type=float,
    default=0.0,
    help="closed loop: each request asks for OLEN * (1 +- this) new tokens (0 <= S < 1)",
)
ap.add_argument("--settle", type=float, default=6.0, help="seconds of load before profiling")
ap.add_argument("--trace-root", default=None, help="where the raw traces go (default OUTDIR)")
ap.add_argument(
    "--wave",
    type=int,
    default=None,
    metavar="OLEN",
    help="trace one wave of CONCURRENCY requests of OLEN new tokens on an idle server",
)
ap.add_argument(
    "--decode-marker",
    default="_fwd_grouped_kernel_stage1",
    help="a kernel only decode steps run (triton decode attention)",
)
ap.add_argument(
    "--prefill-marker",
    default="_fwd_kernel",
    help="the name of a kernel only prefills run (triton extend attention), matched exactly",
)
ap.add_argument("--gap-us", type=float, default=200.0, help="idle gaps longer than this are listed")
ap.add_argument(
    "--waves",
    type=int,
    default=1,
    help="with --wave: each client sends this many requests one after another (a closed loop "
    "of this many waves, whose boundaries the trace then holds)",
)
ap.add_argument(
    "--layers", type=int, default=32, help="decode-marker kernels per decode step (the layers)"
)
a = ap.parse_args()
if not 0.0 <= a.olen_spread < 1.0:
    ap.error(f"--olen-spread must be in [0, 1), got {a.olen_spread}")


def post(path, body, timeout=600):
    req = urllib.request.Request(
        a.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


stop = threading.Event()


def prompt(rng):
    return [rng.randrange(1000, 128000) for _ in range(a.plen)]


def generate(ids, olen):
    body = {"max_new_tokens": olen, "temperature": 0, "ignore_eos": True}
    post_json(a.url, "/generate", {"input_ids": ids, "sampling_params": body}, 600)


def request_olen(rng):
    if not a.olen_spread:
        return a.olen
    return max(1, round(a.olen * rng.uniform(1.0 - a.olen_spread, 1.0 + a.olen_spread)))


def client(k):
    rng = random.Random(k)
    while not stop.is_set():
        try:
            generate(prompt(rng), request_olen(rng))
        except Exception:
            time.sleep(0.2)


def union_us(intervals):
    total, end = 0.0, None
    for start, stop_ in sorted(intervals):
        if end is None or start > end:
            total += stop_ - start
            end = stop_
        elif stop_ > end:
            total += stop_ - end
            end = stop_
    return total


def wait_for_trace(trace_dir, poll_s=0.5):
    """The server's trace file once it is whole: its size unchanged since the last look and
    its JSON read to the end (a trace read while the server still wrote it ended mid-stream on
    two of four servers of an H100 hold, 2026-12-06). PROFILE_WAIT_S bounds the wait."""
    wait_s = float(os.environ.get("PROFILE_WAIT_S", "60"))
    deadline = time.monotonic() + wait_s
    seen = None
    while time.monotonic() < deadline:
        files = sorted(
            glob.glob(os.path.join(trace_dir, "*.json.gz"))
            + glob.glob(os.path.join(trace_dir, "*.json"))
        )
        if files:
            size = os.path.getsize(files[0])
            if size and (files[0], size) == seen and is_whole(files[0]):
                return files[0]
            seen = (files[0], size)
        time.sleep(poll_s)
    what = "no whole trace" if seen else "no trace"
    raise RuntimeError(f"{what} written under {trace_dir} in {wait_s:g} s")


def is_whole(path):
    """Whether ``path`` holds one whole JSON document (gzip-compressed where it ends in .gz)."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            json.load(f)
    except (EOFError, OSError, ValueError):
        return False
    return True


def gpu_events(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "?")[:120])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    if not kernels:
        raise RuntimeError(f"no GPU events in {path}")
    return sorted(kernels)


def top_kernels(kernels, n=25):
    by_name: dict[str, list[float]] = {}
    for start, end, name in kernels:
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": k, "total_ms": round(v[0] / 1000, 3), "calls": v[1]} for k, v in top]


def span(kernels):
    """Wall and GPU busy ms of these kernels, first start to last end."""
    if not kernels:
        return {"wall_ms": 0.0, "gpu_busy_ms": 0.0}
    wall = max(e for _, e, _ in kernels) - kernels[0][0]
    return {
        "wall_ms": round(wall / 1000, 3),
        "gpu_busy_ms": round(union_us([(s, e) for s, e, _ in kernels]) / 1000, 3),
    }


def idle_gaps(kernels, origin):
    """The GPU's idle stretches longer than --gap-us: (ms from origin, ms, kernel before, after)."""
    gaps, end, last = [], None, None
    for start, stop_, name in kernels:
        if end is not None and start - end > a.gap_us:
            gaps.append(((end - origin) / 1000, (start - end) / 1000, last, name))
        if end is None or stop_ > end:
            end, last = stop_, name
    return gaps


def busy_fraction(whole):
    return round(whole["gpu_busy_ms"] / whole["wall_ms"], 3) if whole["wall_ms"] else None


def steps_report(kernels):
    whole = span(kernels)
    return dict(
        **whole,
        gpu_busy_fraction=busy_fraction(whole),
        wall_ms_per_step=round(whole["wall_ms"] / a.steps, 3),
        gpu_busy_ms_per_step=round(whole["gpu_busy_ms"] / a.steps, 3),
        top_kernels=top_kernels(kernels),
        intervals=prefill_intervals(kernels),
    )


def prefill_intervals(kernels):
    """The window cut at each decode step's start (every --layers decode-marker kernels): the
    intervals that hold prefill-marker kernels against those that hold a decode step alone.
    What a prefill's interval adds is its mean wall and GPU busy time beyond a decode-only
    interval's (median wall, mean busy), and by kernel the time per interval beyond theirs."""
    starts = [s for s, _, n in kernels if a.decode_marker in n][:: a.layers]
    alone: list[tuple[float, float, dict[str, float]]] = []
    with_prefill: list[tuple[float, float, dict[str, float]]] = []
    prefill_gaps: list[tuple[float, float, str, str]] = []  # in intervals with a prefill
    prefill_calls = 0
    kernel_starts = [s for s, _, _ in kernels]
    longest = max(e - s for s, e, _ in kernels)
    for begin, end in itertools.pairwise(starts):
        near = kernels[
            bisect.bisect_left(kernel_starts, begin - longest) : bisect.bisect_left(
                kernel_starts, end
            )
        ]
        inside = [(max(s, begin), min(e, end), n) for s, e, n in near if e > begin]
        by_name: dict[str, float] = {}
        for s, e, n in inside:
            by_name[n] = by_name.get(n, 0.0) + (e - s)
        calls = sum(n == a.prefill_marker for s, _, n in near if s >= begin)
        prefill_calls += calls
        busy = union_us([(s, e) for s, e, _ in inside])
        (with_prefill if calls else alone).append((end - begin, busy, by_name))
        if calls:
            prefill_gaps += idle_gaps(sorted(inside), starts[0])
    if not alone:
        return {"decode_only": 0, "with_prefill": len(with_prefill)}
    wall_alone = sorted(w for w, _, _ in alone)[len(alone) // 2]
    busy_alone = sum(b for _, b, _ in alone) / len(alone)
    report = {
        "decode_only": {
            "count": len(alone),
            "wall_ms_median": round(wall_alone / 1000, 4),
            "gpu_busy_ms_mean": round(busy_alone / 1000, 4),
        },
        "with_prefill": {"count": len(with_prefill), "prefill_marker_calls": prefill_calls},
    }
    if with_prefill:
        n = len(with_prefill)
        wall = sum(w for w, _, _ in with_prefill) / n
        busy = sum(b for _, b, _ in with_prefill) / n
        extra_wall, extra_busy = wall - wall_alone, busy - busy_alone
        extra_idle = extra_wall - extra_busy
        names = {name for *_, by_name in alone + with_prefill for name in by_name}
        beyond = {
            name: sum(d.get(name, 0.0) for *_, d in with_prefill) / n
            - sum(d.get(name, 0.0) for *_, d in alone) / len(alone)
            for name in names
        }
        # prefill forwards, at --layers marker calls each (a draft pass that runs attention
        # adds one call per prefill: 3 % more on a 32-layer target)
        forwards = prefill_calls / a.layers
        per_prefill = n / forwards / 1000  # an interval's extra us -> ms per prefill forward
        report["with_prefill"].update(
            prefill_forwards=round(forwards, 2),
            per_prefill_ms={
                "wall": round(extra_wall * per_prefill, 3),
                "gpu_busy": round(extra_busy * per_prefill, 3),
                "idle": round(extra_idle * per_prefill, 3),
            },
            wall_ms_mean=round(wall / 1000, 4),
            gpu_busy_ms_mean=round(busy / 1000, 4),
            extra_wall_ms=round(extra_wall / 1000, 4),
            extra_gpu_busy_ms=round(extra_busy / 1000, 4),
            extra_idle_ms=round(extra_idle / 1000, 4),
            kernels_beyond_decode=[
                {"name": name, "ms_per_interval": round(us / 1000, 4)}
                for name, us in sorted(beyond.items(), key=lambda kv: -kv[1])[:20]
            ],
            idle_gaps=dict(
                longer_than_us=a.gap_us,
                count=len(prefill_gaps),
                ms_per_interval=round(sum(g[1] for g in prefill_gaps) / n, 4),
                largest=[
                    {"at_ms": round(t, 3), "ms": round(d, 3), "after": b, "before": k}
                    for t, d, b, k in sorted(prefill_gaps, key=lambda g: -g[1])[:12]
                ],
            ),
        )
    return report


def wave_report(kernels):
    origin = kernels[0][0]
    first_decode = next((s for s, _, n in kernels if a.decode_marker in n), None)
    prefill = [k for k in kernels if first_decode is None or k[0] < first_decode]
    decode = [k for k in kernels if first_decode is not None and k[0] >= first_decode]
    gaps = idle_gaps(kernels, origin)

    def in_prefill(at_ms):
        return first_decode is None or at_ms < (first_decode - origin) / 1000

    largest = sorted(gaps, key=lambda g: -g[1])[:12]
    whole = span(kernels)
    return dict(
        **whole,
        **steps_outside(kernels),
        gpu_busy_fraction=busy_fraction(whole),
        prefill_phase=dict(
            **span(prefill), kernels=len(prefill), top_kernels=top_kernels(prefill, 15)
        ),
        decode_phase=dict(
            **span(decode),
            kernels=len(decode),
            decode_marker_calls=sum(a.decode_marker in n for _, _, n in decode),
        ),
        idle_gaps=dict(
            longer_than_us=a.gap_us,
            count=len(gaps),
            total_ms=round(sum(g[1] for g in gaps), 3),
            in_prefill_phase_ms=round(sum(g[1] for g in gaps if in_prefill(g[0])), 3),
            largest=[
                {"at_ms": round(t, 3), "ms": round(d, 3), "after": b, "before": n}
                for t, d, b, n in largest
            ],
        ),
        top_kernels=top_kernels(kernels),
    )


def steps_outside(kernels):
    """Decode steps (every --layers decode-marker kernels) and the time outside steady ones."""
    starts = [s for s, _, n in kernels if a.decode_marker in n][:: a.layers]
    if len(starts) < 3:
        return {"decode_steps": len(starts)}
    intervals = [b - s for s, b in itertools.pairwise(starts)]
    step = sorted(intervals)[len(intervals) // 2]
    beyond = [i - step for i in intervals if i > 1.5 * step]
    tail = max(e for _, e, _ in kernels) - starts[-1] - step
    outside = starts[0] - kernels[0][0] + sum(beyond) + max(0.0, tail)
    return {
        "decode_steps": len(starts),
        "step_ms_median": round(step / 1000, 4),
        "long_step_intervals": len(beyond),
        "outside_steady_steps_ms": round(outside / 1000, 3),
    }


def run_wave(trace_dir):
    """--waves waves of --concurrency requests, the first sent together, traced from before the
    first to after the last; the server is idle before and after, so the kernels are theirs."""
    post("/flush_cache", {})
    rng = random.Random(0)
    prompts = [[prompt(rng) for _ in range(a.waves)] for _ in range(a.concurrency)]
    post("/start_profile", {"output_dir": trace_dir, "activities": ["GPU"]})

    def one(k, _t0):
        for ids in prompts[k]:
            generate(ids, a.wave)

    run_together(a.concurrency, one, a.url, 600)  # connections open, then released at once
    post("/stop_profile", {})
    return wait_for_trace(trace_dir)


def run_loaded(trace_dir):
    threads = [
        threading.Thread(target=client, args=(k,), daemon=True) for k in range(a.concurrency)
    ]
    for t in threads:
        t.start()
    time.sleep(a.settle)
    try:
        post(
            "/start_profile", {"output_dir": trace_dir, "num_steps": a.steps, "activities": ["GPU"]}
        )
        return wait_for_trace(trace_dir)
    finally:
        stop.set()


trace_dir = os.path.join(a.trace_root or a.outdir, f"trace-{a.name}")
os.makedirs(trace_dir, exist_ok=True)
result = {"name": a.name, "concurrency": a.concurrency}
result.update(
    {"wave_olen": a.wave, "waves": a.waves, "plen": a.plen} if a.wave else {"steps": a.steps}
)
try:
    path = run_wave(trace_dir) if a.wave else run_loaded(trace_dir)
    kernels = gpu_events(path)
    result["trace"] = os.path.basename(path)
    result.update(wave_report(kernels) if a.wave else steps_report(kernels))
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
with open(os.path.join(a.outdir, f"{a.name}.profile.json"), "w") as f:
    json.dump(result, f, indent=1)
if "error" in result:
    print(f"[{a.name}] profile failed: {result['error']}")
elif a.wave:
    pre, dec, gaps = result["prefill_phase"], result["decode_phase"], result["idle_gaps"]
    print(
        f"[{a.name}] wave c={a.concurrency} olen={a.wave}: wall {result['wall_ms']} ms, GPU busy "
        f"{result['gpu_busy_ms']} ms; prefill phase {pre['wall_ms']} / {pre['gpu_busy_ms']} ms, "
        f"decode phase {dec['wall_ms']} / {dec['gpu_busy_ms']} ms; {gaps['count']} idle gaps "
        f"> {a.gap_us:g} us, {gaps['total_ms']} ms ({gaps['in_prefill_phase_ms']} in prefill)"
    )
    if "outside_steady_steps_ms" in result:
        print(
            f"  {result['decode_steps']} decode steps of {result['step_ms_median']} ms (median); "
            f"outside the steady steps {result['outside_steady_steps_ms']} ms"
        )
    for g in gaps["largest"][:6]:
        where = f"after {g['after'][:50]}  before {g['before'][:50]}"
        print(f"  idle {g['ms']:8.3f} ms at {g['at_ms']:9.3f} ms  {where}")
else:
    print(
        f"[{a.name}] profile c={a.concurrency}: {a.steps} steps, wall {result['wall_ms_per_step']} "
        f"ms/step, GPU busy {result['gpu_busy_ms_per_step']} ms/step "
        f"({result['gpu_busy_fraction']:.0%})"
    )
    for k in result["top_kernels"][:12]:
        print(f"  {k['total_ms'] / a.steps:8.3f} ms/step  {k['calls']:6d}  {k['name']}")
    alone, pre = result["intervals"]["decode_only"], result["intervals"]["with_prefill"]
    if isinstance(alone, dict) and pre.get("count"):
        print(
            f"  decode-only intervals {alone['count']}: {alone['wall_ms_median']} ms wall "
            f"(median), {alone['gpu_busy_ms_mean']} ms busy; with a prefill {pre['count']}: "
            f"+{pre['extra_wall_ms']} ms wall, +{pre['extra_gpu_busy_ms']} ms busy, "
            f"+{pre['extra_idle_ms']} ms idle; per prefill forward "
            f"({pre['prefill_forwards']}): {pre['per_prefill_ms']}"
        )
        for k in pre["kernels_beyond_decode"][:8]:
            print(f"  {k['ms_per_interval']:8.3f} ms/interval beyond decode  {k['name']}")
        gaps = pre["idle_gaps"]
        print(
            f"  idle gaps > {a.gap_us:g} us in them: {gaps['count']}, "
            f"{gaps['ms_per_interval']} ms per interval"
        )
        for g in gaps["largest"][:6]:
            print(f"  idle {g['ms']:8.3f} ms  after {g['after'][:50]}  before {g['before'][:50]}")
