# Where a loaded server's decode steps spend their time (stdlib only).
# usage: python3 profile_steps.py URL OUTDIR NAME [--concurrency 64] [--steps 30] [--trace-root DIR]
#
# Keeps CONCURRENCY clients in a closed loop, asks the server for a torch-profiler trace of STEPS
# forward steps (SGLang's /start_profile, GPU activity only, so the host is not slowed down), then
# reads the trace: GPU busy time (the union of kernel intervals) against the wall span of the
# profiled steps, and the kernels that took the most time. A step whose GPU is busy for much less
# than its wall time is host-bound (Python, launches, synchronisation), not kernel-bound.
# Writes OUTDIR/NAME.profile.json and prints a short table.
import argparse
import glob
import gzip
import json
import os
import random
import threading
import time
import urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("url")
ap.add_argument("outdir")
ap.add_argument("name")
ap.add_argument("--concurrency", type=int, default=64)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--plen", type=int, default=256)
ap.add_argument("--olen", type=int, default=512)
ap.add_argument("--settle", type=float, default=6.0, help="seconds of load before profiling")
ap.add_argument("--trace-root", default=None, help="where the raw traces go (default OUTDIR)")
a = ap.parse_args()


def post(path, body, timeout=600):
    req = urllib.request.Request(
        a.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


stop = threading.Event()


def client(k):
    rng = random.Random(k)
    while not stop.is_set():
        ids = [rng.randrange(1000, 128000) for _ in range(a.plen)]
        body = {"max_new_tokens": a.olen, "temperature": 0, "ignore_eos": True}
        try:
            post("/generate", {"input_ids": ids, "sampling_params": body})
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


trace_dir = os.path.join(a.trace_root or a.outdir, f"trace-{a.name}")
os.makedirs(trace_dir, exist_ok=True)
threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(a.concurrency)]
for t in threads:
    t.start()
time.sleep(a.settle)
result = {"name": a.name, "concurrency": a.concurrency, "steps": a.steps}
try:
    post(
        "/start_profile",
        {"output_dir": trace_dir, "num_steps": a.steps, "activities": ["GPU"]},
    )
    files = []
    for _ in range(int(2 * float(os.environ.get("PROFILE_WAIT_S", "60")))):
        files = glob.glob(os.path.join(trace_dir, "*.json.gz")) + glob.glob(
            os.path.join(trace_dir, "*.json")
        )
        if files:
            time.sleep(2)  # let the writer finish
            break
        time.sleep(0.5)
    stop.set()
    if not files:
        raise RuntimeError(f"no trace written under {trace_dir}")
    path = sorted(files)[0]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    if not kernels:
        raise RuntimeError(f"no GPU events in {path}")
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels]
    wall_us = max(s for _, s in spans) - min(s for s, _ in spans)
    busy_us = union_us(spans)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(e.get("name", "?")[:120], [0.0, 0])
        entry[0] += float(e.get("dur", 0))
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    result.update(
        trace=os.path.basename(path),
        wall_ms=round(wall_us / 1000, 3),
        gpu_busy_ms=round(busy_us / 1000, 3),
        gpu_busy_fraction=round(busy_us / wall_us, 3) if wall_us else None,
        wall_ms_per_step=round(wall_us / 1000 / a.steps, 3),
        gpu_busy_ms_per_step=round(busy_us / 1000 / a.steps, 3),
        top_kernels=[{"name": n, "total_ms": round(v[0] / 1000, 3), "calls": v[1]} for n, v in top],
    )
except Exception as exc:
    stop.set()
    result["error"] = f"{type(exc).__name__}: {exc}"
with open(os.path.join(a.outdir, f"{a.name}.profile.json"), "w") as f:
    json.dump(result, f, indent=1)
if "error" in result:
    print(f"[{a.name}] profile failed: {result['error']}")
else:
    print(
        f"[{a.name}] profile c={a.concurrency}: {a.steps} steps, wall {result['wall_ms_per_step']} "
        f"ms/step, GPU busy {result['gpu_busy_ms_per_step']} ms/step "
        f"({result['gpu_busy_fraction']:.0%})"
    )
    for k in result["top_kernels"][:12]:
        print(f"  {k['total_ms'] / a.steps:8.3f} ms/step  {k['calls']:6d}  {k['name']}")
