"""Tables (markdown) and plots (PNG) from the GPU kit's results.

usage: python benchmarks/gpu/report.py [RESULTS_JSON] [LOG_LINES] [OUTDIR]
  RESULTS_JSON  benchmarks/gpu/results/h200-0.5.12.post1.json (sessions -> results by variant)
  LOG_LINES     benchmarks/gpu/results/dynspec-log-lines.txt ([dynspec] server log lines)
  OUTDIR        where tokens-per-second-*.png go (default: beside RESULTS_JSON)
Prints the tables; plots need matplotlib (skipped with a note when it is missing).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LEVELS = (1, 16, 32, 64, 128)
PROFILE = re.compile(
    r"\[dynspec\] profile bs=(\d+) steps=(\d+) gpu/host ms: (.*) total=([\d.]+)/([\d.]+)"
)


def tok_s(result: dict) -> dict[int, float]:
    """Output tokens/s by concurrency (the first measurement of each level)."""
    out: dict[int, float] = {}
    for level in result.get("levels", []):
        out.setdefault(int(level["concurrency"]), float(level["output_tok_per_s"]))
    return out


def tpot(result: dict) -> dict[int, float]:
    out: dict[int, float] = {}
    for level in result.get("levels", []):
        out.setdefault(int(level["concurrency"]), float(level["mean_tpot_ms"]))
    return out


def speed_table(results: dict, rows: list[tuple[str, str]], base: str) -> str:
    head = "| output tok/s at concurrency | " + " | ".join(str(c) for c in LEVELS) + " |"
    lines = [head, "|---" * (len(LEVELS) + 1) + "|"]
    for key, label in rows:
        if key not in results:
            continue
        values = tok_s(results[key])
        cells = [f"{values[c]:.1f}" if c in values else "–" for c in LEVELS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    base_values = tok_s(results[base])
    for key, label in rows:
        if not key.startswith("dyn") or key not in results:
            continue
        values = tok_s(results[key])
        cells = [f"{values[c] / base_values[c]:.0%}" if c in values else "–" for c in LEVELS]
        lines.append(f"| {label} ÷ plain decoding | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(results: dict, pairs: list[tuple[str, str, str]]) -> str:
    lines = ["| ratio | " + " | ".join(str(c) for c in LEVELS) + " |", "|---" * 6 + "|"]
    for num, den, label in pairs:
        if num not in results or den not in results:
            continue
        a, b = tok_s(results[num]), tok_s(results[den])
        cells = [f"{a[c] / b[c]:.2f}" if c in a and c in b else "–" for c in LEVELS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def breakdown(log_lines: str) -> str:
    """Last profile line per (server, batch size): mean GPU / host ms per phase."""
    last: dict[tuple[str, int], re.Match[str]] = {}
    server = ""
    for line in log_lines.splitlines():
        if line.startswith("=== "):
            server = line[4:]
        elif match := PROFILE.search(line):
            last[(server, int(match.group(1)))] = match
    out = [
        "| server | bs | steps | phases (GPU ms / host ms) | total GPU / host ms |",
        "|---|---|---|---|---|",
    ]
    for (server, bs), m in last.items():
        phases = m.group(3).replace(" end=", " tail=")
        out.append(f"| {server} | {bs} | {m.group(2)} | {phases} | {m.group(4)} / {m.group(5)} |")
    return "\n".join(out)


def correctness(results: dict) -> str:
    lines = [
        "| server | requests | failed | mismatched | accept length 0% / 50% / 90% region (c=1) |",
        "|---|---|---|---|---|",
    ]
    for key in sorted(k for k in results if k.startswith("check-")):
        r = results[key]
        region = r["phases"]["c1"]["by_region"]
        acc = " / ".join(str(v["accept_length"]) for v in region.values())
        lines.append(
            f"| {key} | {r['total_requests']} | {r['total_failed']} | "
            f"{r['total_mismatched']} | {acc} |"
        )
    return "\n".join(lines)


def plot(results: dict, rows: list[tuple[str, str]], title: str, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"(matplotlib missing: {path.name} not drawn)"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for key, label in rows:
        if key not in results:
            continue
        values = tok_s(results[key])
        xs = [c for c in LEVELS if c in values]
        style = "-" if key.startswith(("base", "dyn")) else "--"
        ax.plot(xs, [values[c] for c in xs], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(LEVELS, [str(c) for c in LEVELS])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return f"wrote {path}"


def main() -> None:
    results_path = (
        Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results/h200-0.5.12.post1.json"
    )
    logs_path = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / "results/dynspec-log-lines.txt"
    out_dir = Path(sys.argv[3]) if len(sys.argv) > 3 else results_path.parent
    sessions = json.loads(results_path.read_text())
    s1 = sessions["session1"]["results"]
    s2 = sessions["session2"]["results"]
    rows1 = [
        ("base", "plain decoding"),
        ("eagle-v2", "EAGLE-3 v2 (overlap), unpatched"),
        ("dyn-v2-eager", "v2 patched, eager fallback (previous runtime)"),
        ("dyn-v2", "v2 patched, DECODE graphs (first server, cold Triton cache)"),
        ("dyn-v2-rerun", "v2 patched, DECODE graphs (warm cache; levels 32,64,32,24,48,128,32)"),
        ("eagle-v1", "EAGLE-3 v1, unpatched"),
        ("dyn-v1", "v1 patched, DECODE graphs"),
    ]
    rows2 = [
        ("base-dv32000", "plain decoding"),
        ("eagle-v2-dv32000", "EAGLE-3 v2 (overlap), unpatched"),
        ("dyn-v2-dv32000", "v2 patched, DECODE graphs"),
        ("eagle-v1-dv32000", "EAGLE-3 v1, unpatched"),
        ("dyn-v1-dv32000", "v1 patched, DECODE graphs"),
    ]
    print("## Session 1: draft head over the full 128256-token vocabulary\n")
    print(speed_table(s1, rows1, "base"))
    print()
    print(
        ratio_table(
            s1,
            [
                ("dyn-v2", "eagle-v2", "v2 patched ÷ unpatched"),
                ("dyn-v1", "eagle-v1", "v1 patched ÷ unpatched"),
                ("dyn-v2", "dyn-v2-eager", "v2 graphs ÷ v2 eager"),
            ],
        )
    )
    print("\n## Session 2: draft head over 32000 tokens (as EAGLE-3 drafts for Llama 3.1)\n")
    print(speed_table(s2, rows2, "base-dv32000"))
    print()
    print(
        ratio_table(
            s2,
            [
                ("dyn-v2-dv32000", "eagle-v2-dv32000", "v2 patched ÷ unpatched"),
                ("dyn-v1-dv32000", "eagle-v1-dv32000", "v1 patched ÷ unpatched"),
            ],
        )
    )
    print("\n## TPOT at concurrency 1 (ms)\n")
    for results, pairs in (
        (s1, (("dyn-v2", "eagle-v2"), ("dyn-v1", "eagle-v1"))),
        (s2, (("dyn-v2-dv32000", "eagle-v2-dv32000"), ("dyn-v1-dv32000", "eagle-v1-dv32000"))),
    ):
        for a, b in pairs:
            ta, tb = tpot(results[a])[1], tpot(results[b])[1]
            print(f"- {a}: {ta:.3f} ms vs {b}: {tb:.3f} ms = {ta / tb:.1%}")
    print("\n## Fallback step breakdown\n")
    print(breakdown(logs_path.read_text()))
    print("\n## Greedy checks (crafted successor models)\n")
    print(correctness(s1))
    print()
    print(
        plot(
            s1,
            rows1,
            "H200, SGLang 0.5.12.post1, 8B shape, full-vocab draft head",
            out_dir / "tokens-per-second-session1.png",
        )
    )
    print(
        plot(
            s2,
            rows2,
            "H200, SGLang 0.5.12.post1, 8B shape, 32k draft head",
            out_dir / "tokens-per-second-session2.png",
        )
    )


if __name__ == "__main__":
    main()
