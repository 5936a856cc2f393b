"""(c) KV accounting under fallback: finish, stop, abort and grammar cases with strict checks.

Run it against a PATCHED server launched with a low threshold (so most steps are fallback
steps) and SGLang's strict memory checks on, e.g.

    SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1 python -m sglang.launch_server ... \\
        --speculative-disable-batch-threshold 2

SGLang itself raises ("memory leak detected" / token-pool check on idle) and the scheduler dies
when KV slots leak or are double-freed, so after every case this script checks /health and,
with --server-log, scans the new part of the server log for errors.

    python benchmarks/gpu/stress_mem_check.py --server-port 30001 --server-log server.log
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _client import Server, add_server_args, greedy_payload, server_from
from prompts import builtin_prompts

LOG_ALARMS = ("memory leak", "Traceback", "double free", "CUDA error")


def _many(server: Server, payloads: list[dict[str, Any]], concurrency: int) -> list[Any]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(server.generate, payloads))


def case_eos(server: Server, n: int) -> str:
    prompts = [f"Answer with a single word, then stop. {p}" for p in builtin_prompts(n)]
    outs = _many(server, [greedy_payload(p, 512) for p in prompts], n)
    reasons = [((o.get("meta_info") or {}).get("finish_reason") or {}).get("type") for o in outs]
    return f"finish reasons: {sorted(set(map(str, reasons)))}"


def case_max_new_tokens(server: Server, n: int) -> str:
    payloads = [greedy_payload(p, 1 + i % 17, ignore_eos=True)
                for i, p in enumerate(builtin_prompts(n))]
    outs = _many(server, payloads, n)
    lengths = [(o.get("meta_info") or {}).get("completion_tokens") for o in outs]
    wrong = [i for i, (n_out, p) in enumerate(zip(lengths, payloads, strict=True))
             if n_out != p["sampling_params"]["max_new_tokens"]]
    if wrong:
        raise AssertionError(f"completion_tokens != max_new_tokens for requests {wrong[:10]}")
    return f"{len(outs)} requests stopped exactly at max_new_tokens"


def case_stop_strings(server: Server, n: int) -> str:
    payloads = [greedy_payload(p, 256, stop=[".", "\n"]) for p in builtin_prompts(n)]
    outs = _many(server, payloads, n)
    leaked = [o["text"] for o in outs if "." in o.get("text", "")[:-1]]
    return f"{len(outs)} requests, {len(leaked)} with text past a stop string"


def case_abort(server: Server, n: int) -> str:
    """Half the streams are dropped by the client after a few chunks, half aborted by rid."""

    def drop_after(i: int) -> None:
        payload = greedy_payload(builtin_prompts(n)[i], 1024, ignore_eos=True)
        payload["return_logprob"] = False
        for k, _ in enumerate(server.generate_stream(payload)):
            if k >= 3 + i % 5:
                return

    def abort_by_rid(i: int) -> None:
        rid = f"dynspec-abort-{uuid.uuid4().hex}"
        payload = {**greedy_payload(builtin_prompts(n)[i], 1024, ignore_eos=True), "rid": rid}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(server.generate, payload)
            time.sleep(0.5 + 0.1 * (i % 5))
            server.post_json("/abort_request", {"rid": rid})
            pending.result()

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda i: (drop_after if i % 2 else abort_by_rid)(i), range(n)))
    return f"{n} requests aborted mid-decode"


def case_grammar(server: Server, n: int) -> str:
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer"}}, "required": ["name", "age"]}
    payloads = [greedy_payload(f"Invent a person. {p} Reply in JSON.", 128,
                               json_schema=json.dumps(schema)) for p in builtin_prompts(n)]
    outs = _many(server, payloads, n)
    bad = 0
    for out in outs:
        try:
            json.loads(out["text"])
        except ValueError:
            bad += 1
    if bad:
        raise AssertionError(f"{bad}/{len(outs)} grammar outputs are not valid JSON")
    return f"{len(outs)} JSON outputs, all valid"


def case_sampling(server: Server, n: int) -> str:
    payloads = [{"text": p, "sampling_params": {"temperature": 0.7, "top_p": 0.9,
                                                "max_new_tokens": 128}}
                for p in builtin_prompts(n)]
    _many(server, payloads, n)
    return f"{n} sampled requests"


def case_retraction(server: Server, n: int) -> str:
    """Long requests at high concurrency: with a small --mem-fraction-static the scheduler
    retracts running requests, which must not leak the fallback's slots."""
    payloads = [greedy_payload(p, 2048, ignore_eos=True) for p in builtin_prompts(n)]
    _many(server, payloads, n)
    return f"{n} long requests"


CASES: dict[str, Callable[[Server, int], str]] = {
    "eos": case_eos,
    "max_new_tokens": case_max_new_tokens,
    "stop_strings": case_stop_strings,
    "abort": case_abort,
    "grammar": case_grammar,
    "sampling": case_sampling,
    "retraction": case_retraction,
}


def new_alarms(log: Path | None, offset: int) -> tuple[list[str], int]:
    if log is None or not log.exists():
        return [], offset
    with log.open("rb") as fh:
        fh.seek(offset)
        text = fh.read().decode("utf-8", "replace")
        end = fh.tell()
    return [line for line in text.splitlines() if any(a in line for a in LOG_ALARMS)], end


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(parser, "server", 30001, "patched server (strict memory checks on)")
    parser.add_argument("--server-log", type=Path, help="server log file to scan for errors")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated subset of: {', '.join(CASES)}")
    ns = parser.parse_args(argv)
    server = server_from(ns, "server")
    selected = [c.strip() for c in ns.cases.split(",") if c.strip()]
    unknown = sorted(set(selected) - set(CASES))
    if unknown:
        parser.error(f"unknown cases: {unknown}")

    offset = ns.server_log.stat().st_size if ns.server_log and ns.server_log.exists() else 0
    failures = 0
    for name in selected:
        try:
            detail = CASES[name](server, ns.concurrency)
            status = "ok"
        except Exception as exc:  # report every case, then fail at the end
            detail, status = f"{type(exc).__name__}: {exc}", "FAILED"
        time.sleep(2.0)  # let the scheduler reach idle, where SGLang runs its own KV check
        alarms, offset = new_alarms(ns.server_log, offset)
        if not server.healthy():
            status, detail = "FAILED", detail + " | server unhealthy afterwards"
        if alarms:
            status, detail = "FAILED", detail + f" | log: {alarms[:3]}"
        failures += status != "ok"
        print(f"{name:<16} {status:<7} {detail}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
