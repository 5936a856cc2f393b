"""The GPU's clocks, temperature, power and throttle reasons while a measurement runs.

One ``nvidia-smi --query-gpu=... --loop-ms=N`` process streams a line per interval for as long
as the sampler is open (one process, not one per sample, so the host the server shares is not
disturbed); ``summary()`` condenses the lines: SM and memory clocks (mean, min), the hottest
temperature, the mean power and every non-idle throttle reason that showed up. Servers that
ran at different clocks are not comparable, and a benchmark that records no clocks cannot say
so. Without ``nvidia-smi`` (a CPU machine) the summary is None.

    with GpuSampler() as gpu:
        ...                                   # the level
    level["gpu"] = gpu.summary()
"""

from __future__ import annotations

import statistics
import subprocess
import threading
from typing import IO, Any

FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw")
# The throttle reasons' field: its newer name first (drivers >= 535), then the older one.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
# clocks_throttle_reasons.active bits (nvml.h: nvmlClocksThrottleReason*); 0x1 (GPU idle) is
# left out, it says nothing about a loaded GPU.
THROTTLE_REASONS = {
    0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


class GpuSampler:
    """Samples GPU ``index`` every ``interval_ms`` while open (a context manager)."""

    def __init__(self, interval_ms: int = 1000, index: int = 0,
                 command: str = "nvidia-smi") -> None:
        self.command, self.index, self.interval_ms = command, index, interval_ms
        self.rows: list[tuple[float, float, float, float, int]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def _query(self, reasons: str) -> list[str]:
        return [self.command, f"--id={self.index}",
                f"--query-gpu={','.join((*FIELDS, reasons))}", "--format=csv,noheader,nounits"]

    def __enter__(self) -> GpuSampler:
        """One sample now, with the first reasons field this nvidia-smi knows; then the loop.
        Nothing runs where no nvidia-smi answers."""
        for reasons in REASON_FIELDS:
            try:
                once = subprocess.run(self._query(reasons), capture_output=True, text=True,
                                      timeout=10)
            except (OSError, subprocess.TimeoutExpired):  # no nvidia-smi, or a hung one
                return self
            row = parse_line(once.stdout.partition("\n")[0])
            if once.returncode == 0 and row is not None:
                break
        else:
            return self
        self.rows.append(row)
        self._proc = subprocess.Popen([*self._query(reasons), f"--loop-ms={self.interval_ms}"],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True)
        assert self._proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,),
                                        daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            row = parse_line(line)
            if row is not None:
                self.rows.append(row)

    def summary(self) -> dict[str, Any] | None:
        """The condensed samples, or None where none came (no GPU, or nvidia-smi failed)."""
        if not self.rows:
            return None
        sm, mem, temp, power, reasons = zip(*self.rows, strict=True)
        seen = 0
        for bits in reasons:
            seen |= bits
        return {
            "samples": len(self.rows),
            "sm_mhz_mean": round(statistics.mean(sm), 1),
            "sm_mhz_min": min(sm),
            "mem_mhz_mean": round(statistics.mean(mem), 1),
            "temperature_c_max": max(temp),
            "power_w_mean": round(statistics.mean(power), 1),
            "throttle_reasons": [name for bit, name in THROTTLE_REASONS.items() if seen & bit],
        }


def parse_line(line: str) -> tuple[float, float, float, float, int] | None:
    """One nvidia-smi csv line (sm MHz, mem MHz, °C, W, reasons bitmask), or None if it is not
    one (a header, "[N/A]", a warning)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS) + 1:
        return None
    try:
        sm, mem, temp, power = (float(p) for p in parts[:4])
        reasons = int(parts[4], 16)
    except ValueError:
        return None
    return sm, mem, temp, power, reasons
