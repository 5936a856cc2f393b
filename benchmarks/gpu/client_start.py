"""How far apart a level's first requests reach a server: the kit's two ways of starting c
client threads, in one run, against a stand-in server on 127.0.0.1 (CPU only).

- "connect on first request": c threads from a ThreadPoolExecutor, each opening its connection
  with its first request (how client.py and envelope.py started a level until 2026-12-05);
- "together": together.run_together (every thread connects, then all are released at once).

The stand-in (its own process, asyncio) notes when each /generate arrives and answers after
50 ms. Each row gives the median over the repeats of the span from the first to the c-th
arrival, and together / connect-on-first-request.

    python benchmarks/gpu/client_start.py [--levels 16,64,128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "kit" / "scripts"))
from keepalive import post_json
from together import run_together

ANSWER_AFTER_S = 0.05
BODY = {"input_ids": list(range(1000, 1064)), "sampling_params": {"max_new_tokens": 8}}


def serve(port: Synchronized[int]) -> None:
    """The stand-in: HTTP/1.1 keep-alive; /generate answers after ANSWER_AFTER_S, /arrivals
    hands over (and forgets) the arrival times noted so far."""
    arrivals: list[float] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            path, length = line.split()[1].decode(), 0
            while (header := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = header.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            await reader.readexactly(length)
            if path == "/generate":
                arrivals.append(time.monotonic())
                await asyncio.sleep(ANSWER_AFTER_S)
                body = json.dumps({"output_ids": [5] * 8}).encode()
            else:
                body = json.dumps(arrivals).encode()
                arrivals.clear()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
        port.value = server.sockets[0].getsockname()[1]
        await server.serve_forever()

    asyncio.run(main())


def arrivals(url: str) -> list[float]:
    request = urllib.request.Request(url + "/arrivals", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return sorted(json.loads(answer.read()))


def connect_on_first_request(url: str, conc: int) -> None:
    with ThreadPoolExecutor(conc) as ex:
        list(ex.map(lambda _k: post_json(url, "/generate", BODY, 10), range(conc)))


def together(url: str, conc: int) -> None:
    run_together(conc, lambda _k, _t0: post_json(url, "/generate", BODY, 10), url, 10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="16,64,128")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spawn = multiprocessing.get_context("spawn")
    port = spawn.Value("i", 0)
    server = spawn.Process(target=serve, args=(port,), daemon=True)
    server.start()
    try:
        while not port.value:
            time.sleep(0.01)
        url = f"http://127.0.0.1:{port.value}"
        print(f"first c arrivals, span in ms (median of {args.repeats}; CPUs: "
              f"{multiprocessing.cpu_count()})\n")
        print("| c | connect on first request | together | together / connect on first |")
        print("|---|---|---|---|")
        for conc in (int(c) for c in args.levels.split(",")):
            spans: dict[str, list[float]] = {"first": [], "together": []}
            for _ in range(args.repeats):  # alternating, so a slow moment hits both
                for name, start in (("first", connect_on_first_request), ("together", together)):
                    arrivals(url)
                    start(url, conc)
                    got = arrivals(url)[:conc]
                    spans[name].append(1000 * (got[-1] - got[0]))
            first, both = statistics.median(spans["first"]), statistics.median(spans["together"])
            print(f"| {conc} | {first:.2f} | {both:.2f} | {both / first:.2f} |")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
