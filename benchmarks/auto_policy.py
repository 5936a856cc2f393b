"""The ``auto`` controller against fixed thresholds, plain decoding and EAGLE-3, simulated.

A closed loop of c clients (each sends its next request as its last one returns) runs for
DURATION simulated seconds per level against a server whose step costs are the ones an H200
measured on SGLang 0.5.17 with the crafted 8b models (CUDA-event step times from the
``[dynspec] auto`` switch lines, RESULTS.md, 2026-12-02): a speculative step and a plain
step per padded decode batch size, a prefill step per batch of new requests (its cost set so
that plain decoding's levels match the H200's plain server; the draft's share of an EAGLE-3
prefill is a guess), SGLang's draft-extend on the step before speculation resumes. Each
request's draft acceptance is its region's (0 %, 50 %, 90 % per draft token, steps 3;
"mix": each client cycles through the three). The controllers are the runtime's own classes
(``DynSpecController`` for a fixed T, ``AutoController`` for ``auto``), driven by the
simulated steps: what runs here is the decision rule, the measurement windows, probes,
explore steps and hysteresis of the shipped code, not a copy. Step times carry +-3 % noise.
No GPU, no time measured: the numbers are simulated tokens per simulated second; the GPU
envelope (``benchmarks/gpu/kit``, ``env-*``) is the measurement.

    python benchmarks/auto_policy.py [--duration 10] [--levels 1,4,16,32,64,128]
        [--regions accept0,accept50,accept90,mix] [--thresholds 4,8,16,32,64] [--seed 1]
        [--olen 128] [--olen-spread 0.5] [--burst 1,64,1] [--costs h200|h100]
        [--sequence REGION:C:SECONDS,...] [--round-trip-ms 0]

``--costs h100``: an H100's step costs (``h100_costs``) in place of the H200's.
``--sequence``: instead of the sweep and the burst, these levels in this order on every
server (e.g. a GPU hold's replay: ``mix:4:1.2,accept0:1:10,accept90:1:10,accept0:1:10``),
one table with auto's ratio and switches per level.

``--olen-spread s``: each request's length uniform in OLEN * (1 +- s), as ``envelope.py
--olen-spread`` (default 0.5, as the 2026-12-03 GPU envelope ran); 0 gives every request one
length, so a level's requests start and finish together, which no real traffic does.

``--round-trip-ms r``: a finished request's successor reaches the server r simulated ms after
it finished (the client's answer and the scheduler's receive); until then the decode batch is
one short. 0 (the default) lets it join before the next decode step. On an H100 at c = 4 about
5 % of the decode batch lines read one request short (the seventeenth hold, RESULTS.md): about
two 6.4-ms steps a finish.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from dynspec_patch.transforms.runtime.dynspec_fallback import (
    AutoConfig,
    AutoController,
    CostTable,
    DynSpecController,
    GoodputPolicy,
    StepTokens,
    padded_batch_size,
)

# SGLang 0.5.17's decode graph sizes up to --cuda-graph-max-bs 128 (the envelope servers').
GRAPH_SIZES = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 129, 8)]
# ms per step by padded batch size: (speculative step, plain step), 0.5.17, crafted 8b, H200.
MEASURED = CostTable({
    1: (6.86, 4.82), 2: (6.92, 4.86), 4: (7.09, 4.88), 6: (7.46, 4.90), 8: (7.85, 4.91),
    14: (9.21, 5.09), 16: (9.19, 5.12), 32: (11.2, 5.40), 64: (16.6, 5.70), 128: (28.8, 6.50),
})
DRAFT_EXTEND_MS = (1.0, 0.008)  # the step before speculation resumes: + a + b * bs
# A prefill step: a + b * new requests (64-token prompts); set so that plain decoding's levels
# come within 5 % of the H200's plain server on 2026-12-03 (c = 16 ... 128, lengths 128 +- 50 %).
PREFILL_MS = (6.0, 0.5)
H100_PREFILL_MS = (7.9, 0.55)  # an H100's prefill step (set as PREFILL_MS is, on H100 plain)
DRAFT_PREFILL_SHARE = 0.1  # what an EAGLE-3 server's draft adds to a prefill step (a guess)
REGIONS = {"accept0": 0.0, "accept50": 0.5, "accept90": 0.9}
MIX = "mix"
COMPARED = ("plain", "eagle", "auto")  # the simulations a sequence table compares
NUM_STEPS = 3  # draft tokens per speculative step (steps 3, topk 1)
NOISE = 0.03


def h100_costs(h200: CostTable) -> CostTable:
    """An H100's step costs: the H200's scaled to what the H100 holds' switch lines read
    (2026-12-06 and 07: a speculative step 8.8 / 11.0 / 13.8 ms and a plain one 6.1 / 6.6 /
    6.6 ms at bs 1 / 16 / 32): speculative x1.28 at bs 1 falling to x1.21 from bs 16, plain
    x1.27. Nothing above bs 32 was read there; against the fifteenth hold's servers (one
    seed, 10-s levels) simulated plain decoding comes within 3 % at c <= 16 and 4-8 % low at
    c >= 32, EAGLE-3 at 90 % within 3 % at c <= 32 and 5-7 % low above, at 50 % 4 % low at
    c = 1 and 7-14 % low at c >= 16: ratios between servers, not their tok/s, are what it
    is for."""
    return CostTable({
        bs: (spec * (1.28 - 0.07 * min(1.0, (bs - 1) / 15)), plain * 1.27)
        for bs, (spec, plain) in h200.entries.items()
    })


def use_costs(name: str) -> None:
    """Simulate on ``name``'s step costs from here on: "h200" (measured) or "h100"."""
    global MEASURED, PREFILL_MS
    MEASURED, PREFILL_MS = COSTS[name]


COSTS = {"h200": (MEASURED, PREFILL_MS), "h100": (h100_costs(MEASURED), H100_PREFILL_MS)}


def cost_ms(speculative: bool, padded: int) -> float:
    """The measured cost of a step at ``padded``: the runtime's own interpolation between
    measured sizes; outside them, the nearest one's."""
    sizes = sorted(MEASURED.entries)
    ms = MEASURED.step_ms(speculative, min(max(padded, sizes[0]), sizes[-1]))
    assert ms is not None  # every measured size has both costs
    return ms


@dataclass
class Request:
    client: int
    acceptance: float
    left: int
    rng: random.Random  # its own draws: every server sees the same requests
    rid: int = 0  # as SGLang's: the controller's probes read each request's own tokens


@dataclass
class Server:
    """One way of choosing each decode step's mode: plain, EAGLE-3, a fixed T, or auto."""

    name: str
    speculative_server: bool
    decide: Callable[[int], bool]  # True: this decode step runs plain
    controller: AutoController | None = None
    on_deferred: Callable[[], None] = lambda: None
    switches: Callable[[], int] = lambda: 0


class StepClock:
    """The controller's clock: each step's time is the simulated cost just run."""

    def __init__(self) -> None:
        self.next_ms = 0.0

    def start(self) -> None:
        return None

    def stop(self, started: None) -> float:
        return self.next_ms

    def elapsed_ms(self, handle: float) -> float:
        return handle


def make_server(kind: str) -> tuple[Server, StepClock]:
    clock = StepClock()
    if kind == "plain":
        return Server(kind, False, lambda bs: True), clock
    if kind == "eagle":
        return Server(kind, True, lambda bs: False), clock
    if kind == "auto":
        controller = AutoController(
            GoodputPolicy(AutoConfig(max_tokens_per_step=NUM_STEPS + 1.0), GRAPH_SIZES),
            source=True,
            clock=clock,
        )
        policy = controller.policy
        return Server(
            kind, True, controller.decide, controller, policy.defer_speculation,
            lambda: policy.n_switches,
        ), clock
    fixed = DynSpecController(int(kind.removeprefix("T")))
    return Server(kind, True, fixed.decide, switches=lambda: fixed.n_switches), clock


def accepted(rng: random.Random, acceptance: float) -> int:
    """Draft tokens accepted in one verify: the leading run of right guesses, at most 3."""
    n = 0
    while n < NUM_STEPS and rng.random() < acceptance:
        n += 1
    return n


@dataclass
class LevelResult:
    tok_s: float
    switches: int
    wall_s: float
    extra: dict = field(default_factory=dict)


class Simulation:
    """One server through the levels in order, as ``envelope.py`` runs them: its controller
    keeps what it learned from one level to the next."""

    def __init__(self, kind: str, seed: int, round_trip_ms: float = 0.0) -> None:
        self.server, self.clock = make_server(kind)
        self.seed = seed
        self.round_trip_ms = round_trip_ms  # a finish to its successor's arrival
        self.rng = random.Random(seed)  # step-time noise
        self.stale = True  # no draft state yet: the first speculative step drafts first
        self.rids = itertools.count()

    def level(
        self, region: str, conc: int, duration: float, olen: int, spread: float = 0.0
    ) -> LevelResult:
        server, rng = self.server, self.rng
        sent = [0] * conc
        switches_before = server.switches()

        def new_request(client: int) -> Request:
            name = region
            if region == MIX:
                name = list(REGIONS)[(client + sent[client]) % len(REGIONS)]
            own = random.Random(f"{self.seed} {region} {conc} {client} {sent[client]}")
            sent[client] += 1
            length = round(olen * own.uniform(1.0 - spread, 1.0 + spread))
            return Request(client, REGIONS[name], max(1, length), own, next(self.rids))

        waiting = [new_request(k) for k in range(conc)]
        running: list[Request] = []
        arriving: list[tuple[float, Request]] = []  # (when it reaches the server, request)
        now_ms, tokens = 0.0, 0
        spent: collections.Counter[str] = collections.Counter()
        while waiting or running or arriving:
            if not (waiting or running):  # the server idles until the next one arrives
                now_ms = max(now_ms, min(when for when, _ in arriving))
            waiting += [request for when, request in arriving if when <= now_ms]
            arriving = [(when, request) for when, request in arriving if when > now_ms]
            if waiting:  # SGLang runs the new requests' prefill before the next decode step
                ms = PREFILL_MS[0] + PREFILL_MS[1] * len(waiting)
                controller = server.controller
                if server.speculative_server and not (controller and controller.in_fallback):
                    ms *= 1.0 + DRAFT_PREFILL_SHARE  # (in fallback the direct prefill skips it)
                ms *= rng.uniform(1.0 - NOISE, 1.0 + NOISE)
                now_ms += ms
                spent["prefill"] += ms
                if controller is not None:
                    self.clock.next_ms = ms
                    controller.finish_prefill(controller.start_step(), len(waiting))
                running += waiting
                waiting = []
                continue
            bs = len(running)
            plain = server.decide(bs)
            padded = padded_batch_size(bs, GRAPH_SIZES)
            timed = True
            if not plain and self.stale:  # one more plain step, with SGLang's draft-extend
                plain, timed = True, False
                server.on_deferred()
                ms = cost_ms(False, padded) + DRAFT_EXTEND_MS[0] + DRAFT_EXTEND_MS[1] * padded
                self.stale = False
            else:
                ms = cost_ms(not plain, padded)
                self.stale = plain and server.speculative_server
            ms *= rng.uniform(1.0 - NOISE, 1.0 + NOISE)
            self.clock.next_ms = ms
            now_ms += ms
            spent["plain" if plain and timed else "drafting" if plain else "spec"] += ms
            each = []
            finished = []
            for request in running:
                got = 1 if plain else 1 + accepted(request.rng, request.acceptance)
                got = min(got, request.left)
                request.left -= got
                each.append(float(got))
                if request.left == 0:
                    finished.append(request)
            tokens += int(sum(each))
            if server.controller is not None and timed:
                started = server.controller.start_step()
                read = StepTokens(sum(each) / bs, tuple(each))
                reader = None if plain else (lambda value=read: value)
                server.controller.finish_step(started, not plain, bs, reader, running)
            for request in finished:
                running.remove(request)
                if now_ms < duration * 1000.0:
                    arriving.append((now_ms + self.round_trip_ms, new_request(request.client)))
        return LevelResult(1000.0 * tokens / now_ms, server.switches() - switches_before,
                           now_ms / 1000.0, dict(spent))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--olen", type=int, default=128)
    ap.add_argument("--olen-spread", type=float, default=0.5,
                    help="each request's length uniform in olen * (1 +- spread)")
    ap.add_argument("--levels", default="1,4,16,32,64,128")
    ap.add_argument("--regions", default="accept0,accept50,accept90,mix")
    ap.add_argument("--thresholds", default="4,8,16,32,64")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--burst", default="1,64,1",
                    help="accept50 levels run after the sweep (envelope.py's burst); empty: none")
    ap.add_argument("--costs", choices=sorted(COSTS), default="h200",
                    help="whose step costs: the H200's measured table or an H100's")
    ap.add_argument("--sequence", type=parse_sequence, default=None,
                    metavar="REGION:C:SECONDS,...",
                    help="these levels in this order instead of the sweep and the burst")
    ap.add_argument("--round-trip-ms", type=float, default=0.0,
                    help="a finished request's successor reaches the server this many "
                         "simulated ms later (0: before the next decode step)")
    return ap.parse_args()


def parse_sequence(text: str) -> list[tuple[str, int, float]]:
    """``REGION:C:SECONDS,...`` as levels; a bad one is argparse's one-line error."""
    levels = []
    for item in text.split(","):
        parts = item.split(":")
        try:
            region, conc, seconds = parts[0], int(parts[1]), float(parts[2])
        except (IndexError, ValueError):
            raise argparse.ArgumentTypeError(f"{item!r} is not REGION:C:SECONDS") from None
        if len(parts) != 3 or region not in (*REGIONS, MIX) or conc < 1 or seconds <= 0:
            raise argparse.ArgumentTypeError(
                f"{item!r}: REGION one of {', '.join((*REGIONS, MIX))}, C >= 1, SECONDS > 0")
        levels.append((region, conc, seconds))
    return levels


def sequence_table(sims: dict[str, Simulation], levels: list[tuple[str, int, float]],
                   args: argparse.Namespace, title: str) -> tuple[Table, float]:
    """The levels in order on the plain, EAGLE-3 and auto simulations (each goes on from
    where it stands): one table, and the worst auto ÷ max(plain, EAGLE-3) in it."""
    table = Table(title=title)
    for column in ("level", "region", "c", "s", "plain", "EAGLE-3", "auto", "auto ÷ max",
                   "auto switches"):
        table.add_column(column, justify="right")
    worst = 1.0
    for number, (region, conc, seconds) in enumerate(levels, 1):
        results = {kind: sims[kind].level(region, conc, seconds, args.olen, args.olen_spread)
                   for kind in COMPARED}
        auto = results["auto"]
        over_max = auto.tok_s / max(results["plain"].tok_s, results["eagle"].tok_s)
        worst = min(worst, over_max)
        table.add_row(str(number), region, str(conc), f"{seconds:g}",
                      f"{results['plain'].tok_s:.0f}", f"{results['eagle'].tok_s:.0f}",
                      f"{auto.tok_s:.0f}", f"{over_max:.3f}", str(auto.switches))
    return table, worst


def main() -> None:
    args = parse_args()
    use_costs(args.costs)
    console = Console()
    if args.sequence is not None:
        sims = {kind: Simulation(kind, args.seed, args.round_trip_ms) for kind in COMPARED}
        table, worst = sequence_table(sims, args.sequence, args,
                                      f"sequence ({args.costs} costs): simulated output tok/s")
        console.print(table)
        console.print(f"worst auto ÷ max(plain, EAGLE-3): {worst:.3f}")
        return
    levels = [int(x) for x in args.levels.split(",")]
    fixed = [f"T{t}" for t in args.thresholds.split(",")]
    worst_max, worst_fixed = 1.0, 1.0
    regions = args.regions.split(",")
    kinds = ("plain", "eagle", *fixed, "auto")
    sims = {kind: Simulation(kind, args.seed, args.round_trip_ms) for kind in kinds}
    for region in regions:
        table = Table(title=f"{region}: simulated output tok/s ({args.duration:g} s levels)")
        for column in ("c", "plain", "EAGLE-3", "best fixed T", "auto", "auto ÷ max",
                       "auto ÷ best T", "auto switches"):
            table.add_column(column, justify="right")
        for c in levels:
            results = {
                kind: sims[kind].level(region, c, args.duration, args.olen, args.olen_spread)
                for kind in kinds
            }
            best = max(fixed, key=lambda k: results[k].tok_s)
            auto = results["auto"]
            over_max = auto.tok_s / max(results["plain"].tok_s, results["eagle"].tok_s)
            over_fixed = auto.tok_s / results[best].tok_s
            worst_max, worst_fixed = min(worst_max, over_max), min(worst_fixed, over_fixed)
            table.add_row(
                str(c), f"{results['plain'].tok_s:.0f}", f"{results['eagle'].tok_s:.0f}",
                f"{results[best].tok_s:.0f} ({best})", f"{auto.tok_s:.0f}", f"{over_max:.3f}",
                f"{over_fixed:.3f}", str(auto.switches),
            )
        console.print(table)
    burst = [int(x) for x in args.burst.split(",") if x]
    if burst:  # after the sweep, as envelope.py runs it: a load change after the last region
        table, worst = sequence_table(
            sims, [("accept50", c, args.duration) for c in burst], args,
            "burst after the sweep, accept50: simulated output tok/s")
        worst_max = min(worst_max, worst)
        console.print(table)
    console.print(f"worst auto ÷ max(plain, EAGLE-3): {worst_max:.3f}; "
                  f"worst auto ÷ best fixed T: {worst_fixed:.3f}")


if __name__ == "__main__":
    main()
