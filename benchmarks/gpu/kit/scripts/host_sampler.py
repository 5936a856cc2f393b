"""The host's CPUs as a level meets them: where SGLang's processes ran and what they waited for.

v1's step is host time (the scheduler's Python loop between GPU launches), and v1's first
server on a machine ran slower at every step than a second one on two machines (RESULTS.md,
2026-12-02 and 2026-12-05) with the same GPU clocks. What sets a host-bound step's pace and
changes from one server process to the next is where the scheduler's main thread runs: beside
a busy process on the same core or its SMT sibling, on another NUMA node than the GPU, behind
other runnable threads. The sampler reads, once a second while open, ``/proc`` for the main
thread of each SGLang process of the server (matched by the title SGLang gives it,
``sglang::scheduler``, ``sglang::detokenizer``, and the ``sglang.launch_server`` process that
runs the HTTP server and tokenizer) and of this client, and ``/proc/stat`` for every CPU:

    with HostSampler() as host:
        ...                                   # the level
    level["host"] = host.summary()

Per process: its main thread's CPU share (of one CPU), its run-queue wait (time it was runnable
but not running, from ``schedstat``), its involuntary context switches per second, the CPUs and
NUMA nodes it was seen on, how busy the other SMT threads of its core were while it ran there,
and how often another sampled process that was busy (a tenth of the interval or more) was
seen on its core. The client's CPU share is its whole process's (its work runs in one thread
per connection), SGLang's processes' their main thread's. For the host: the CPUs' mean busy
share, the 1-minute load, the mean ``cpu MHz`` that ``/proc/cpuinfo`` reports (a VM often
reports a fixed figure), and the topology (CPUs, cores, NUMA nodes, the GPUs' NUMA nodes). Reads
only; on a host without ``/proc`` the summary is None.
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (name in the summary, how its command line starts or what it holds)
TITLES = (("scheduler", "sglang::scheduler"), ("detokenizer", "sglang::detokenizer"))
SERVER_MODULE = "sglang.launch_server"
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class ThreadSample:
    cpu_ticks: int  # utime + stime of the thread (of every thread: whole_process)
    cpu: int  # the CPU it last ran on
    wait_ns: int  # runnable, not running
    involuntary: int


@dataclass
class Tick:
    at: float  # time.monotonic()
    threads: dict[str, ThreadSample]  # the main thread of each process still there
    cpu_times: dict[int, tuple[int, int]]  # per CPU: (busy jiffies, all jiffies)


def read_thread(proc: Path, pid: int, whole_process: bool = False) -> ThreadSample | None:
    """The main thread of ``pid``: /proc/PID/task/PID/{stat,schedstat,status}; with
    ``whole_process`` the CPU time is every thread's (/proc/PID/stat), the rest the main
    thread's. None once the process is gone."""
    task = proc / str(pid) / "task" / str(pid)
    try:
        stat = (task / "stat").read_text()
        schedstat = (task / "schedstat").read_text().split()
        status = (task / "status").read_text()
        process_stat = (proc / str(pid) / "stat").read_text() if whole_process else stat
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 is fields[0]
    process = process_stat[process_stat.rindex(")") + 2:].split()
    involuntary = next((int(line.split()[1]) for line in status.splitlines()
                        if line.startswith("nonvoluntary_ctxt_switches:")), 0)
    return ThreadSample(cpu_ticks=int(process[11]) + int(process[12]), cpu=int(fields[36]),
                        wait_ns=int(schedstat[1]), involuntary=involuntary)


def read_cpu_times(proc: Path) -> dict[int, tuple[int, int]]:
    """Per CPU from /proc/stat: (busy jiffies, all jiffies); idle and iowait are not busy."""
    out = {}
    for line in (proc / "stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *values = line.split()
            ticks = [int(v) for v in values[:8]]
            out[int(name[3:])] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    return out


def find_processes(proc: Path, client_pid: int) -> dict[str, int]:
    """SGLang's processes by their titles, the server's main process, and this client."""
    found: dict[str, int] = {"client": client_pid}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        first = argv[0].decode(errors="replace")
        for name, title in TITLES:
            if first.startswith(title) and name not in found:
                found[name] = int(entry.name)
        if SERVER_MODULE.encode() in argv and "server" not in found:
            found["server"] = int(entry.name)
    return found


def topology(sys_root: Path) -> dict[str, Any]:
    """CPU → (core, NUMA node); the GPUs' NUMA nodes (PCI vendor 0x10de, display class)."""
    core_of: dict[int, tuple[int, int]] = {}
    node_of: dict[int, int] = {}
    cpus = sys_root / "devices" / "system" / "cpu"
    for d in sorted(cpus.glob("cpu[0-9]*")):
        n = int(d.name[3:])
        try:
            core_of[n] = (int((d / "topology" / "physical_package_id").read_text()),
                          int((d / "topology" / "core_id").read_text()))
        except (OSError, ValueError):
            core_of[n] = (0, n)
        node_of[n] = next((int(p.name[4:]) for p in d.glob("node[0-9]*")), 0)
    gpu_nodes = []
    for dev in sorted((sys_root / "bus" / "pci" / "devices").glob("*")):
        try:
            if ((dev / "vendor").read_text().strip() == "0x10de"
                    and (dev / "class").read_text().strip().startswith("0x03")):
                gpu_nodes.append(int((dev / "numa_node").read_text()))
        except (OSError, ValueError):
            continue
    return {"core_of": core_of, "node_of": node_of, "gpu_numa_nodes": gpu_nodes}


def cpu_mhz(proc: Path) -> float | None:
    try:
        values = [float(line.split(":")[1]) for line in (proc / "cpuinfo").read_text().splitlines()
                  if line.startswith("cpu MHz")]
    except (OSError, ValueError):
        return None
    return statistics.fmean(values) if values else None


class HostSampler:
    """Samples the host every ``interval_s`` while open (a context manager)."""

    def __init__(self, interval_s: float = 1.0, proc: str = "/proc", sys_root: str = "/sys",
                 client_pid: int | None = None) -> None:
        self.interval_s = interval_s
        self.proc, self.sys_root = Path(proc), Path(sys_root)
        self.client_pid = os.getpid() if client_pid is None else client_pid
        self.pids: dict[str, int] = {}
        self.ticks: list[Tick] = []
        self.topo: dict[str, Any] = {}
        self.mhz: list[float] = []
        self.loadavg: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> HostSampler:
        if not (self.proc / "stat").exists():
            return self
        self.topo = topology(self.sys_root)
        self.pids = find_processes(self.proc, self.client_pid)
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        threads = {}
        for name, pid in self.pids.items():
            # the client's work runs in one thread per connection, SGLang's in the main thread
            s = read_thread(self.proc, pid, whole_process=name == "client")
            if s is not None:
                threads[name] = s
        self.ticks.append(Tick(time.monotonic(), threads, read_cpu_times(self.proc)))
        mhz = cpu_mhz(self.proc)
        if mhz is not None:
            self.mhz.append(mhz)

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._sample()
        try:
            self.loadavg = float((self.proc / "loadavg").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            self.loadavg = None

    def summary(self) -> dict[str, Any] | None:
        """None if nothing was sampled (no /proc, or the sampler never opened)."""
        if len(self.ticks) < 2:
            return None
        core_of, node_of = self.topo["core_of"], self.topo["node_of"]
        busy = [cpu_busy(a.cpu_times, b.cpu_times) for a, b in itertools.pairwise(self.ticks)]
        means = [statistics.fmean(b.values()) for b in busy if b]
        host = {
            "cpus": len(core_of),
            "cores": len(set(core_of.values())),
            "numa_nodes": len(set(node_of.values())),
            "gpu_numa_nodes": self.topo["gpu_numa_nodes"],
            "busy_pct": round(statistics.fmean(means), 1) if means else None,
            "load_1min": self.loadavg,
            "cpu_mhz": round(statistics.fmean(self.mhz)) if self.mhz else None,
        }
        procs = {}
        for name in self.pids:
            summary = self._process_summary(name, busy)
            if summary is not None:
                procs[name] = summary
        return {"host": host, "processes": procs}

    def _process_summary(self, name: str, busy: list[dict[int, float]]) -> dict[str, Any] | None:
        """Over the ticks that saw the process: each interval is charged to the CPU it was on at
        the interval's end (a thread that moved within the second is charged to one of them)."""
        seen = [(i, t) for i, t in enumerate(self.ticks) if name in t.threads]
        if len(seen) < 2:
            return None
        (_, t0), (_, t1) = seen[0], seen[-1]
        first, last, wall = t0.threads[name], t1.threads[name], t1.at - t0.at
        if wall <= 0:
            return None
        core_of, node_of = self.topo["core_of"], self.topo["node_of"]
        cpus = sorted({t.threads[name].cpu for _, t in seen})
        sibling_busy, shared = [], 0
        for i, t in seen[1:]:
            cpu = t.threads[name].cpu
            core = core_of.get(cpu)
            siblings = [c for c, k in core_of.items() if k == core and c != cpu]
            if siblings:
                sibling_busy.append(statistics.fmean(busy[i - 1].get(c, 0.0) for c in siblings))
            if any(core_of.get(s.cpu) == core and self._busy(other, i)
                   for other, s in t.threads.items() if other != name):
                shared += 1
        return {
            "pid": self.pids[name],
            "cpu_pct": round(100 * (last.cpu_ticks - first.cpu_ticks) / TICK / wall, 1),
            "runqueue_wait_pct": round(100 * (last.wait_ns - first.wait_ns) / 1e9 / wall, 2),
            "involuntary_switches_per_s": round((last.involuntary - first.involuntary) / wall, 1),
            "cpus": cpus,
            "numa_nodes": sorted({node_of.get(c, 0) for c in cpus}),
            "smt_sibling_busy_pct": round(statistics.fmean(sibling_busy), 1)
            if sibling_busy else None,
            "core_shared_pct": round(100 * shared / (len(seen) - 1), 1),
        }


    def _busy(self, name: str, i: int) -> bool:
        """Whether ``name`` ran at least a tenth of the interval that ends at tick ``i``."""
        before, after = self.ticks[i - 1], self.ticks[i]
        if name not in before.threads or name not in after.threads or after.at <= before.at:
            return False
        ticks = after.threads[name].cpu_ticks - before.threads[name].cpu_ticks
        return ticks / TICK >= 0.1 * (after.at - before.at)


def cpu_busy(a: dict[int, tuple[int, int]], b: dict[int, tuple[int, int]]) -> dict[int, float]:
    """Per CPU, the busy share (%) between two /proc/stat readings."""
    out = {}
    for cpu, (busy1, total1) in b.items():
        busy0, total0 = a.get(cpu, (busy1, total1))
        if total1 > total0:
            out[cpu] = 100 * (busy1 - busy0) / (total1 - total0)
    return out
