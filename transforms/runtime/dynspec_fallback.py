"""Dynamic speculation disable for SGLang EAGLE / EAGLE3 workers (installed by dynspec-patch).

When the decode batch is larger than ``--speculative-disable-batch-threshold T`` the patched
worker runs one plain decode step instead of draft + verify. A fallback step is a *verify of a
one-node tree* (root = last verified token, no drafts): the target runs in DECODE mode, SGLang's
own verify/sample does the bookkeeping (v1 on 0.5.12.post1's verify() loop: on write-only steps
of greedy batches the same bookkeeping for one token without verify(), ``_v1_one_token_verify``;
v2, where ``GREEDY_ARGMAX_ENV`` or ``GREEDY_ARGMAX_RELEASES`` turns it on: greedy batches take
the argmax alone, ``GreedyArgmax``, once checked against SGLang's sampler),
and the worker's own draft-extend keeps the draft KV warm
(by default on ``GPU_PROVEN_RELEASES``, v2 and v1 alike: ``DraftKvWrite`` stores the draft's K
and V alone, checked once against it).
The state after a fallback step equals the state after a spec step whose drafts were all rejected,
so speculation resumes without special handling.

``--speculative-disable-batch-threshold auto`` (``AutoController``) decides each pure decode
step by expected goodput at its batch size padded to the CUDA-graph size: speculate iff
``tokens_per_step / spec_ms`` beats ``1 / plain_ms`` (tokens per request per ms), where
``tokens_per_step`` is 1 + the mean accepted drafts per request over the newest verify steps
that hold at least 256 requests (kept while in fallback, replaced by each probe, whose reading
counts times what the last speculative stretch a probe began settled to against that probe,
at most 1: mixed traffic speculates at a lower acceptance than a fallback batch shows) and the
step times come from a cost table ``{padded bs: (spec ms, fallback ms)}``, interpolated between
measured sizes. The other mode must win by more than 2 % for
``--speculative-disable-min-dwell-steps`` (default 8) consecutive decisions before a switch;
switching back at about the same batch size (within 2x) needs 4x as many wins each time it
happens again (up to 1024x; one time forgiven per 8192 steps without a switch), so a load near
the crossover does not flap, while a load that moves (2x or more) switches within the dwell
steps.
``--speculative-disable-resume-below`` is refused with ``auto`` (one warning, the feature
off). In fallback, a speculative probe (enough consecutive steps for 64 requests, at most 8)
runs after 16 fallback steps, the gap doubling per probe up to 1024 and starting again at 16
when the batch size moves 2x; speculating, one plain probe step runs every 1024 steps (the
plain cost stays as fresh as the speculative one). Where the table lacks a mode's cost at a
size, one step of that mode runs every 8 steps until it is known ("explore"); meanwhile a size
above the largest one with both costs runs plain steps if they win there, and one below the
smallest speculates if speculation wins there (a speculative step's cost relative to a plain
one does not fall as the batch grows), so a sudden load bigger than any seen switches within
the dwell steps instead of speculating until its costs are measured. Where plain steps win
even if every draft token were accepted (``speculative_num_steps + 1`` tokens per step), no
probe and no explore step speculates.

The cost table is not measured at start-up on any release (replaying the speculative graphs
outside a real step needs release-specific draft and verify inputs): ``auto`` starts by
speculating and measures both kinds of steps online, on the real path: CUDA events around
the worker's own speculative step (run from the hook, whose re-entry answers None) and around
each fallback step, recorded on TP rank 0 only and read at sync steps (every 16 decode steps,
steps at least 2 old: no host sync inside a step). A v2 step's ``accept_lens`` is summed on
the device and copied to pinned memory behind an event, read at a sync step too. At each
sync step rank 0's snapshot (acceptance and table) is broadcast over the TP group's CPU group
and adopted by every rank, so all inputs of every decision are the same on every rank. DP
attention stays refused; DP replicas decide independently.

Visible decisions: one INFO line at start-up, one per switch (rank 0) with the batch, both
tok/s estimates, both step times and the tokens per step. With ``--enable-metrics`` (SGLang's
prometheus multiprocess mode), rank 0 writes ``sglang:dynspec_speculating`` (1/0),
``sglang:dynspec_switches_total``, ``sglang:dynspec_fallback_steps_total``,
``sglang:dynspec_spec_tok_per_s`` and ``sglang:dynspec_plain_tok_per_s`` (label
``model_name``), updated at sync steps; no prometheus_client, no multiprocess directory or
metrics off: no series, no error.

Safety rules:
- every SGLang name this module touches is listed in ``V1_NEEDS`` / ``V2_NEEDS``; the adapter
  resolves them once per process from the live worker module (``transforms/runtime_probe.py``
  checks the same tables statically), and any missing name turns the feature off for the
  process (fail closed);
- decisions use rank-identical inputs only: batch sizes and step counters (a fixed T), plus,
  for ``auto``, the snapshots every rank adopts at the same steps; never a clock read on the
  deciding rank.

The module imports neither torch nor SGLang at import time: it must stay importable by the
patcher's static probe and by CPU tests.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import itertools
import logging
import math
import os
import sys
import textwrap
import time
import types
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

THRESHOLD_ARG = "speculative_disable_batch_threshold"
DEFAULT_MIN_DWELL_STEPS = 8
# Small decode batches in a row before speculation resumes (DynSpecController says why).
RESUME_SMALL_STEPS = 32
SUPPORTED_ALGORITHMS = frozenset({"EAGLE", "EAGLE3"})
V1_WORKER_CLASS = "EAGLEWorker"
V2_WORKER_CLASS = "EAGLEWorkerV2"


# --------------------------------------------------------------------------------------------
# Controller
# --------------------------------------------------------------------------------------------


def default_resume_below(threshold: int) -> int:
    """Batch size at or below which speculation resumes: ``T - max(1, T // 8)``, at least 1.

    At least 1, because a decode batch is never smaller: with 0, T = 1 would never resume.
    """
    return max(1, threshold - max(1, threshold // 8))


def effective_batch_size(local_batch_size: int, global_num_tokens: list[int] | None) -> int:
    """Batch size the decision uses: the max over DP ranks when they were all-gathered.

    The scheduler sets ``global_num_tokens`` for its MLP sync. With DP attention refused
    (``refusal_reason``), 0.4.10+ sets it to ``[local batch size]`` (DeepEP / a2a MoE,
    ``moe_dense_tp_size`` 1) or not at all; 0.4.x's DeepEP path (``enable_sp_layernorm``),
    which counted ``batch size * speculative_num_draft_tokens`` there, is refused.
    """
    if global_num_tokens:
        return max(int(n) for n in global_num_tokens)
    return int(local_batch_size)


class DynSpecController:
    """Hysteresis switch between speculative and fallback decode steps.

    Enters fallback when the batch size is > ``threshold``, resumes speculation once it has
    been <= ``resume_below`` for ``resume_steps`` decode steps in a row (``RESUME_SMALL_STEPS``,
    32), and stays at least ``min_dwell_steps`` decode steps in a mode before switching. Inputs
    are integers only, so every TP rank fed the same batch sizes takes the same decisions
    (ranks that diverged would hang in collectives).

    Why resuming waits for a small batch to last: under load a decode batch can be small for a
    while the next requests are still arriving and being prefilled. On 2026-12-04 (SGLang
    0.5.17, c = 64 waves) one decode step ran at bs 10 between two at bs 64; on 2026-12-05 (an
    H100, 0.5.12.post1, c = 128 waves) the first 5 requests of a wave decoded alone for 8 steps
    while the other 123 were still on their way, speculation resumed at bs 5, the 123 prefilled
    with the full draft pass and 8 speculative steps ran as the batch grew to 128 before
    fallback came back: that level gave 0.943 of plain decoding where its repeat gave 0.979.
    Each such resume costs a draft-extend step and up to ``min_dwell_steps`` speculative steps
    at the full batch (26 ms each where a fallback step takes 8). A load that really dropped
    waits 32 cheap small-batch steps (about 0.2 s) longer to speculate.
    """

    def __init__(
        self,
        threshold: int,
        resume_below: int | None = None,
        min_dwell_steps: int = DEFAULT_MIN_DWELL_STEPS,
        log: Callable[[str], None] | None = None,
        resume_steps: int | None = None,
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"threshold must be an integer >= 1, got {threshold!r}")
        if resume_below is None:
            resume_below = default_resume_below(threshold)
        if isinstance(resume_below, bool) or not isinstance(resume_below, int):
            raise ValueError(f"resume_below must be an integer, got {resume_below!r}")
        if not 1 <= resume_below <= threshold:
            raise ValueError(
                f"resume_below must be in [1, threshold], got {resume_below} for {threshold}"
            )
        if isinstance(min_dwell_steps, bool) or not isinstance(min_dwell_steps, int):
            raise ValueError(f"min_dwell_steps must be an integer, got {min_dwell_steps!r}")
        if min_dwell_steps < 1:
            raise ValueError(f"min_dwell_steps must be >= 1, got {min_dwell_steps}")
        self.threshold = threshold
        self.resume_below = resume_below
        self.min_dwell_steps = min_dwell_steps
        if resume_steps is None:
            resume_steps = RESUME_SMALL_STEPS
        if isinstance(resume_steps, bool) or not isinstance(resume_steps, int) or resume_steps < 1:
            raise ValueError(f"resume_steps must be an integer >= 1, got {resume_steps!r}")
        self.resume_steps = resume_steps
        self._log = log
        self.in_fallback = False
        # The first switch may happen at once: a burst at start-up needs no warm-up dwell.
        self.steps_in_mode = min_dwell_steps
        self.small_steps_in_a_row = 0  # decode steps at or below resume_below, the newest last
        self.n_fallback_steps = 0
        self.n_spec_steps = 0
        self.n_switches = 0

    @property
    def min_fallback_batch_size(self) -> int:
        """The smallest decode batch a fallback step is sized for: a smaller one (only the steps
        before speculation resumes have one) pads up to it."""
        return self.resume_below

    def decide(self, batch_size: int) -> bool:
        """Record one decode step of ``batch_size`` requests; True means run it as fallback."""
        # Counted in both modes: the batch that enters fallback is above T, so every fallback
        # stretch counts its small batches from 0.
        small = batch_size <= self.resume_below
        self.small_steps_in_a_row = self.small_steps_in_a_row + 1 if small else 0
        if self.in_fallback:
            switch = self.small_steps_in_a_row >= self.resume_steps
        else:
            switch = batch_size > self.threshold
        if switch and self.steps_in_mode >= self.min_dwell_steps:
            self._switch(batch_size)
        self.steps_in_mode += 1
        if self.in_fallback:
            self.n_fallback_steps += 1
        else:
            self.n_spec_steps += 1
        return self.in_fallback

    def _switch(self, batch_size: int) -> None:
        before, after = ("fallback", "spec") if self.in_fallback else ("spec", "fallback")
        previous_steps = self.steps_in_mode
        self.in_fallback = not self.in_fallback
        self.steps_in_mode = 0
        self.n_switches += 1
        if self._log is not None:
            self._log(
                f"[dynspec] {before} -> {after} at decode bs={batch_size} "
                f"(threshold={self.threshold}, resume_below={self.resume_below}, "
                f"steps_in_prev_mode={previous_steps}, switches={self.n_switches}, "
                f"fallback_steps={self.n_fallback_steps}, spec_steps={self.n_spec_steps})"
            )


# --------------------------------------------------------------------------------------------
# The ``auto`` controller: speculate or not by expected goodput at the current batch size
# --------------------------------------------------------------------------------------------

AUTO = "auto"
MAX_THRESHOLD = 65536


def parse_threshold(value: Any) -> int | str:
    """The threshold field's value as the runtime uses it: an int 1..65536 or ``"auto"``."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value)
    if number is None or not 1 <= number <= MAX_THRESHOLD:
        raise ValueError(f"threshold must be an integer 1..{MAX_THRESHOLD} or auto, got {value!r}")
    return number


@dataclass(frozen=True)
class AutoConfig:
    """The ``auto`` controller's constants; every one counts steps or is a ratio, none is time.

    ``confirm_steps``: consecutive decisions the other mode must win before a switch (the
    server's ``--speculative-disable-min-dwell-steps``). ``margin``: how much better (relative
    tok/s) the other mode must be to win one. ``flap_window`` / ``flap_factor`` /
    ``flap_max``: a switch back within ``flap_window`` steps of the last switch, at a padded
    batch size within 2x of that switch's, needs ``confirm_steps * flap_factor ** flaps``
    wins, ``flaps`` counting such switches in a row (at most ``flap_max``), less one for
    every ``flap_window`` steps since the last switch; there, at ``composition_min_batch``
    requests or more, after a flap or within ``flap_window`` steps of the switch, fallback
    switches back only on an acceptance of ``flap_factor`` probes' requests
    (``acceptance_requests`` at most), not one probe's (below that many, one probe's:
    ``GoodputPolicy._acceptance_is_enough``). ``probe_gap`` /
    ``probe_gap_max``: in fallback, a speculative probe after this many fallback steps, the
    gap doubling after each probe (up to the cap) until speculation is back, and back to
    ``probe_gap`` when the padded batch size moves 2x; speculating, one plain probe step every
    ``probe_gap_max`` steps. ``probe_requests`` / ``probe_steps_min`` / ``probe_steps_max``: a
    speculative probe runs consecutive steps until it has verified this many requests and run
    at least ``probe_steps_min`` steps (a request's own tokens per step is read over them), at
    most ``probe_steps_max`` steps, and stops when the padded batch size moves 2x from the one
    it began at (a wave's first requests probed alone, then the rest arrived: its steps would
    be speculative steps at the full batch, each 3x a plain one at bs 128, and read another
    load's acceptance).
    ``explore_gap``: while the table has no cost for the other mode at this batch size, one
    step of it every this many steps. ``sync_every``: rank 0's measurements become every
    rank's decision inputs at the decode steps that are multiples of this; ``lag_steps``: only
    steps at least this old are read then (their GPU work is done, so reading their events
    waits for nothing). ``acceptance_requests`` / ``acceptance_distinct``: the acceptance is
    the mean over the newest verify steps that together hold at least ``acceptance_requests``
    requests (a request counted once per step) and at least ``acceptance_distinct`` different
    requests (the oldest step's batch and every request that began decoding since), unless
    that takes more than ``acceptance_steps_max`` steps: at bs 1 the first bound alone is two
    or three requests, and on mixed traffic each has its own acceptance, so each speculative
    stretch would read the request it is on; a few long requests keep the window in steps.
    ``composition_bounds`` / ``composition_min_batch``: a probe's acceptance counts times the
    ratio of what the last speculative stretch a probe began ended at to that probe
    (``Measurements``), kept within these bounds, learned only from stretches that end with
    at least this many requests (one request's acceptance is its own, not a batch's
    composition). ``max_tokens_per_step``: the most a speculative step can give a request
    (``speculative_num_steps + 1``; None: no bound); where speculation loses even at that, no
    probe and no explore step speculates.
    ``probe_change``: a probe at about the load of the probes before it (within 2x, no
    speculative stretch between) whose steps so far read within this ratio of their acceptance
    joins them in the acceptance window; one that reads further off, or at another load,
    replaces it (a 64-request probe alone has a sampling error of ~7 % on mixed traffic: 0.3
    is a change of traffic, not noise). ``probe_confidence``: a probe read by request counts
    at ``speculating_tokens``'s bound, its estimate less this many standard errors (16 mixed
    requests over 4 steps read within ~17 %; on its estimate alone such a probe called
    speculation back in three of five simulated minutes at c = 16, where plain steps win).
    ``probe_confidence_few``: the same below ``composition_min_batch`` requests, where a probe
    reads one request's own acceptance over its 8 steps: a 50 %-acceptance request reads 1 to
    4 tokens a step, and 2 standard errors took its bound below the break-even at bs 1
    (1.45 tokens per step on an H200's costs) where speculating gives 1.3x plain steps; a
    mixed load that fell to one request while in fallback then stayed there (the simulator
    with an H200's costs, six seeds: the mix at c = 1 / 4 at worst 0.834 / 0.894 of the
    better of plain steps and EAGLE-3 at 2, 0.999 / 0.978 at 1).
    ``prefill_window``: the newest prefill batches of each mode whose times ``PrefillCost``
    is fitted to; ``admission_tokens``: the admission rate (requests prefilled per token
    decoded) is read over the newest steps that decoded at least this many tokens (about 512
    requests of 128 tokens: over 16384, a closed loop's waves at c = 128 moved it between 1 in
    94 and 1 in 177 tokens in the simulator, where the outputs' mean is 128).
    """

    confirm_steps: int = DEFAULT_MIN_DWELL_STEPS
    margin: float = 0.02
    flap_window: int = 8192
    flap_factor: int = 4
    flap_max: int = 5
    probe_gap: int = 16
    probe_gap_max: int = 1024
    probe_requests: int = 64
    probe_steps_min: int = 2
    probe_steps_max: int = 8
    explore_gap: int = 8
    sync_every: int = 16
    lag_steps: int = 2
    acceptance_requests: int = 256
    acceptance_distinct: int = 16
    acceptance_steps_max: int = 1024
    cost_window: int = 16
    composition_bounds: tuple[float, float] = (0.5, 1.0)
    composition_min_batch: int = 8
    max_tokens_per_step: float | None = None
    probe_change: float = 0.3
    probe_confidence: float = 2.0
    probe_confidence_few: float = 1.0
    prefill_window: int = 64
    admission_tokens: int = 65536


# "name=value,..." overrides some of ``AutoConfig``'s numbers on one server (an experiment:
# the defaults are what the simulator and the GPU holds support), e.g.
# DYNSPEC_AUTO_CONFIG=probe_confidence=3
AUTO_CONFIG_ENV = "DYNSPEC_AUTO_CONFIG"


def auto_config_overrides(warn: Callable[[str], None]) -> dict[str, int | float]:
    """``DYNSPEC_AUTO_CONFIG``'s overrides of ``AutoConfig``'s int and float fields: an int
    field takes a positive int, a float field a non-negative number; anything else warns once
    and none applies."""
    value = os.environ.get(AUTO_CONFIG_ENV, "").strip()
    if not value:
        return {}
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(AutoConfig)
        if type(f.default) in (int, float)
    }
    not_used = f"[dynspec] {AUTO_CONFIG_ENV}={value!r} not used"
    overrides: dict[str, int | float] = {}
    for item in value.split(","):
        name, _, text = (part.strip() for part in item.partition("="))
        if name not in defaults:
            warn(f"{not_used}: {name!r} is not one of {sorted(defaults)}")
            return {}
        kind = type(defaults[name])
        try:
            number = kind(text)
        except ValueError:
            number = None
        if number is None or number < (1 if kind is int else 0):
            least = "a positive int" if kind is int else "a non-negative number"
            warn(f"{not_used}: {name} takes {least}, not {text!r}")
            return {}
        overrides[name] = number
    return overrides


@dataclass(frozen=True)
class PrefillCost:
    """A prefill batch of n requests costs about ``fixed_ms + per_request_ms * n``.

    What a mode's prefills cost per decode step follows from it: a loaded closed loop admits
    as many requests as it finishes, r = bs * tokens per step / mean output length a step
    (``Snapshot.admitted_per_token``: 1 / that length), and SGLang runs one prefill batch
    between two decode steps when any arrived, about 1 - e^-r of them (arrivals as Poisson's).
    A mode that decodes more tokens per step admits more requests a step into as many
    batches, so its fixed part is spread over more tokens: on an H100 (0.5.17, 2026-12-06,
    accept90 at c = 128, outputs of 128 +- 50 % tokens) the prefills took about 5.5 ms per
    plain step and 9-10 ms per speculative step of 3.4 times the tokens, and EAGLE-3 won by
    13 % where decode steps alone put plain steps ahead by 14 %.
    """

    fixed_ms: float
    per_request_ms: float

    def per_step_ms(self, admitted_per_step: float) -> float:
        """Prefill time per decode step where ``admitted_per_step`` requests arrive a step."""
        r = admitted_per_step
        return self.fixed_ms * -math.expm1(-r) + self.per_request_ms * r


def fit_prefill_cost(samples: Sequence[tuple[int, float]]) -> PrefillCost | None:
    """``PrefillCost`` by least squares over (requests, ms) of prefill batches, both parts at
    least 0; batches slower than 3x the median (a kernel compiled, the allocator grew) left
    out. Batches all of one size cannot split the two parts: their mean counts as fixed
    (there, at 1 request a batch, where r is small, either split gives the same cost)."""
    if not samples:
        return None
    times = sorted(ms for _, ms in samples)
    cap = 3.0 * times[len(times) // 2]
    kept = [(n, ms) for n, ms in samples if ms <= cap and n > 0]
    if not kept:
        return None
    mean_n = sum(n for n, _ in kept) / len(kept)
    mean_ms = sum(ms for _, ms in kept) / len(kept)
    spread = sum((n - mean_n) ** 2 for n, _ in kept)
    if spread == 0:
        return PrefillCost(mean_ms, 0.0)
    slope = sum((n - mean_n) * (ms - mean_ms) for n, ms in kept) / spread
    slope = min(max(slope, 0.0), mean_ms / mean_n)
    return PrefillCost(mean_ms - slope * mean_n, slope)


@dataclass(frozen=True)
class CostTable:
    """Step times in ms by padded decode batch size: ``{bs: (speculative ms, fallback ms)}``.

    A mode's time at a size between two measured sizes is interpolated linearly; outside the
    measured range it is unknown (None): step time is not linear in the batch size, and a
    guess that is too low would favour that mode.
    """

    entries: dict[int, tuple[float | None, float | None]] = dataclasses.field(
        default_factory=dict
    )

    def step_ms(self, speculative: bool, batch_size: int) -> float | None:
        column = 0 if speculative else 1
        known = sorted((bs, ms[column]) for bs, ms in self.entries.items() if ms[column])
        below = [(bs, ms) for bs, ms in known if bs <= batch_size]
        above = [(bs, ms) for bs, ms in known if bs >= batch_size]
        if not below or not above:
            return None
        (bs0, ms0), (bs1, ms1) = below[-1], above[0]
        if bs0 == bs1:
            return ms0
        return ms0 + (ms1 - ms0) * (batch_size - bs0) / (bs1 - bs0)

    def deciding_size(self, batch_size: int, tokens_per_step: float) -> int | None:
        """A measured size whose costs decide for ``batch_size`` too, where that has none.

        A speculative step verifies N tokens per request and a plain step one, so the first
        grows faster with the batch: their cost ratio does not fall as the batch grows. Then
        above the largest size with both costs, plain steps win if they win there; below the
        smallest, speculation wins if it wins there. None where no such bound decides.
        """
        both = sorted(bs for bs, (spec, plain) in self.entries.items() if spec and plain)
        if not both:
            return None
        if batch_size > both[-1]:
            spec, plain = self.entries[both[-1]]
            return both[-1] if tokens_per_step / spec < 1.0 / plain else None
        if batch_size < both[0]:
            spec, plain = self.entries[both[0]]
            return both[0] if tokens_per_step / spec > 1.0 / plain else None
        return None


@dataclass(frozen=True)
class Snapshot:
    """Every measured input of a decision, the same object on every TP rank.

    ``tokens_per_step``: expected tokens per speculative step per request (1 + accepted
    drafts), None before the first verify step was read; ``tokens_load``: the padded batch
    size of the newest verify step it holds (0: none); ``tokens_requests``: the requests its
    verify steps hold (a request counted once per step); ``tokens_of_stretch``: they are a
    speculative stretch's, not a probe's (in fallback: the stretch before it).
    ``admitted_per_token``: requests prefilled per token decoded (0: not read yet);
    ``prefill_spec`` / ``prefill_plain``: the prefill batches' cost while speculating / in
    fallback (where the direct prefill skips the draft's pass), None before one was timed.
    """

    tokens_per_step: float | None = None
    table: CostTable = dataclasses.field(default_factory=CostTable)
    tokens_load: int = 0
    tokens_requests: int = 0
    tokens_of_stretch: bool = False
    admitted_per_token: float = 0.0
    prefill_spec: PrefillCost | None = None
    prefill_plain: PrefillCost | None = None

    def prefill_ms_per_step(self, speculative: bool, admitted_per_step: float) -> float:
        """A mode's prefill time per decode step at this admission rate (0 while no prefill
        was timed: where only the other mode's was, it stands in)."""
        mine, other = self.prefill_spec, self.prefill_plain
        if not speculative:
            mine, other = other, mine
        cost = mine or other
        return cost.per_step_ms(admitted_per_step) if cost is not None else 0.0

    def to_wire(self) -> list[float]:
        """Floats for a broadcast: tokens, their load, their requests, whether a stretch's,
        the admission rate, both prefill costs' two parts, then (bs, spec ms, plain ms) rows;
        NaN for None."""
        nan = float("nan")
        wire = [nan if self.tokens_per_step is None else self.tokens_per_step,
                float(self.tokens_load), float(self.tokens_requests),
                float(self.tokens_of_stretch), self.admitted_per_token]
        for cost in (self.prefill_spec, self.prefill_plain):
            wire += [nan, nan] if cost is None else [cost.fixed_ms, cost.per_request_ms]
        for bs, (spec, plain) in sorted(self.table.entries.items()):
            wire += [float(bs), nan if spec is None else spec, nan if plain is None else plain]
        return wire

    @classmethod
    def from_wire(cls, wire: list[float]) -> Snapshot:
        def value(x: float) -> float | None:
            return None if x != x else float(x)  # NaN: unknown

        def cost(fixed: float, per_request: float) -> PrefillCost | None:
            return None if fixed != fixed else PrefillCost(fixed, per_request)

        rows = wire[9:]
        entries = {
            int(rows[i]): (value(rows[i + 1]), value(rows[i + 2])) for i in range(0, len(rows), 3)
        }
        return cls(value(wire[0]), CostTable(entries), int(wire[1]), int(wire[2]), bool(wire[3]),
                   wire[4], cost(wire[5], wire[6]), cost(wire[7], wire[8]))


@dataclass(frozen=True)
class Estimates:
    """What one decision compared: tok/s of each mode at ``batch_size`` (padded), from the
    step costs at ``costs_of``: ``padded`` itself, or the measured size that decides for it
    (``CostTable.deciding_size``), each step with its share of the prefills between decode
    steps (``PrefillCost``; 0 until prefills were timed and the admission rate read)."""

    batch_size: int
    padded: int
    tokens_per_step: float
    spec_ms: float
    plain_ms: float
    costs_of: int
    spec_prefill_ms: float = 0.0
    plain_prefill_ms: float = 0.0

    @property
    def spec_tok_s(self) -> float:
        ms = self.spec_ms + self.spec_prefill_ms
        return 1000.0 * self.costs_of * self.tokens_per_step / ms

    @property
    def plain_tok_s(self) -> float:
        return 1000.0 * self.costs_of / (self.plain_ms + self.plain_prefill_ms)


def padded_batch_size(batch_size: int, graph_sizes: list[int]) -> int:
    """The CUDA-graph size a decode batch pads to (itself above the largest graph)."""
    return next((g for g in graph_sizes if g >= batch_size), batch_size)


class GoodputPolicy:
    """The decision core of ``auto``: pure, torch-free, fed a ``Snapshot`` and batch sizes.

    Per decode step it compares ``padded * tokens_per_step / (spec_ms + its prefills)`` with
    ``padded / (plain_ms + its prefills)`` (each mode's prefill time per decode step,
    ``PrefillCost``) and switches mode after the other one won ``confirm_steps``
    consecutive decisions by more than ``margin``. Whatever is unknown, and not decided by
    a measured size that bounds it (``CostTable.deciding_size``), keeps the current mode
    (speculation at start-up). It also says which steps run the other mode once:
    probes (in fallback after 16, 32, ... 1024 steps, re-measuring acceptance and the
    speculative cost; speculating, every 1024 steps, re-measuring the plain cost) and explore
    steps (the table has no cost of the other mode at this size). In fallback, speculation
    wins only on an acceptance read at about this load (within 2x, ``Snapshot.tokens_load``):
    one read at another load (a single request, another mix) waits for the probe due here.
    Decisions depend only on the adopted snapshots, the batch sizes and step counts, so ranks
    fed the same agree.
    """

    def __init__(
        self,
        config: AutoConfig | None = None,
        graph_sizes: list[int] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config or AutoConfig()
        if self.config.confirm_steps < 1:
            raise ValueError(f"min_dwell_steps must be >= 1, got {self.config.confirm_steps}")
        self.graph_sizes = sorted(set(graph_sizes or []))
        self._log = log
        self.snapshot = Snapshot()
        self.in_fallback = False
        self.steps = 0
        self.n_fallback_steps = 0
        self.n_spec_steps = 0
        self.n_switches = 0
        self.n_probes = 0
        self.n_explores = 0
        self.last: Estimates | None = None  # the latest decision's estimates, when known
        # Whether the latest step runs out of mode: a probe or an explore step.
        self.last_out_of_mode = False
        self._wins = 0
        self._since_probe = 0
        self._probe_gap = self.config.probe_gap_max  # speculating first
        self._probe_left = 0  # further steps of the speculative probe under way
        self._gap_padded = 0  # the padded batch size the probe gap grew at
        self._last_explore: dict[tuple[bool, int], int] = {}
        self._last_switch: tuple[int, int] | None = None  # (step, padded batch size)
        self._flaps = 0
        # A speculative step in fallback (probe, explore) that ran as a plain step instead
        # (``defer_speculation``): the next plain step of fallback speculates in its place.
        self._deferred = False

    def adopt(self, snapshot: Snapshot) -> None:
        """Take new measured inputs (call at the same step on every rank)."""
        self.snapshot = snapshot

    def estimates(self, batch_size: int) -> Estimates | None:
        padded = padded_batch_size(batch_size, self.graph_sizes)
        tokens = self.snapshot.tokens_per_step
        spec_ms = self.snapshot.table.step_ms(True, padded)
        plain_ms = self.snapshot.table.step_ms(False, padded)
        if tokens is None:
            return None
        if spec_ms and plain_ms:
            return self._with_prefills(batch_size, padded, tokens, spec_ms, plain_ms, padded)
        deciding = self.snapshot.table.deciding_size(padded, tokens)
        if deciding is None:
            return None
        spec_ms, plain_ms = self.snapshot.table.entries[deciding]
        assert spec_ms and plain_ms  # deciding_size picks sizes with both costs
        return self._with_prefills(batch_size, padded, tokens, spec_ms, plain_ms, deciding)

    def _with_prefills(
        self, batch_size: int, padded: int, tokens: float, spec_ms: float, plain_ms: float,
        costs_of: int,
    ) -> Estimates:
        """The estimates at ``costs_of``, each mode's step with its prefills: a mode admits
        ``costs_of * tokens per step * admitted_per_token`` requests a step
        (``PrefillCost``)."""
        snapshot = self.snapshot
        admitted = costs_of * snapshot.admitted_per_token
        return Estimates(
            batch_size, padded, tokens, spec_ms, plain_ms, costs_of,
            snapshot.prefill_ms_per_step(True, admitted * tokens),
            snapshot.prefill_ms_per_step(False, admitted),
        )

    def decide(self, batch_size: int) -> bool:
        """Record one decode step of ``batch_size`` requests; True means run it as fallback."""
        step = self.steps
        self.steps += 1
        padded = padded_batch_size(batch_size, self.graph_sizes)
        estimates = self.estimates(batch_size)
        self.last = estimates
        if estimates is not None and self._other_mode_wins(estimates):
            self._wins += 1
            if self._wins >= self._wins_needed(padded):
                self._switch(estimates)
        else:
            self._wins = 0
        run_fallback = self.in_fallback
        if self._probe_left > 0 and not _same_load(padded, self._gap_padded):
            self._probe_left = 0  # the load moved 2x: the gap starts again below
        if self._probe_left > 0 and self.in_fallback:  # the probe under way goes on
            self._probe_left -= 1
            run_fallback = False
        elif self._explores(padded, estimates, step):
            run_fallback = not self.in_fallback
            self.n_explores += 1
        else:
            if self.in_fallback and not _same_load(padded, self._gap_padded):
                self._probe_gap = self.config.probe_gap  # the load moved: probe soon
                self._since_probe = 0
            self._gap_padded = padded
            self._since_probe += 1
            due = self._since_probe >= self._probe_gap
            if due and not (self.in_fallback and self._speculation_cannot_win(padded)):
                run_fallback = not self.in_fallback
                self._since_probe = 0
                self._probe_gap = min(2 * self._probe_gap, self.config.probe_gap_max)
                self.n_probes += 1
                if self.in_fallback:
                    self._probe_left = self._probe_steps(batch_size) - 1
        if self._deferred and (run_fallback or not self.in_fallback):
            run_fallback = run_fallback and not self.in_fallback
            self._deferred = False
        self.last_out_of_mode = run_fallback != self.in_fallback
        if run_fallback:
            self.n_fallback_steps += 1
        else:
            self.n_spec_steps += 1
        return run_fallback

    def defer_speculation(self) -> None:
        """The speculative step just decided ran as a plain step: in fallback, the next step
        that would run plain speculates instead, so a probe or an explore step is put off by
        one step, never lost. Once speculating again (a switch back), nothing is owed."""
        self._deferred = True

    def _probe_steps(self, batch_size: int) -> int:
        """A speculative probe's steps at ``batch_size``: enough to verify ``probe_requests``
        requests, at least ``probe_steps_min`` (each request's own tokens per step is read
        over them), at most ``probe_steps_max``."""
        config = self.config
        wanted = max(-(-config.probe_requests // max(1, batch_size)), config.probe_steps_min)
        return min(wanted, config.probe_steps_max)

    def _wins_needed(self, padded: int) -> int:
        """``confirm_steps``, times ``flap_factor ** flaps`` at the load of the last switch."""
        if not self._at_last_switch_load(padded):
            return self.config.confirm_steps
        return self.config.confirm_steps * self.config.flap_factor ** self._recent_flaps()

    def _at_last_switch_load(self, padded: int) -> bool:
        return self._last_switch is not None and _same_load(padded, self._last_switch[1])

    def _recent_flaps(self) -> int:
        """The switches back and forth at one load, one forgiven per ``flap_window`` steps."""
        if self._last_switch is None:
            return 0
        quiet = (self.steps - self._last_switch[0]) // self.config.flap_window
        return max(0, self._flaps - quiet)

    def _recent_switch(self) -> bool:
        """Whether the last switch came within ``flap_window`` steps."""
        last = self._last_switch
        return last is not None and self.steps - last[0] < self.config.flap_window

    def _acceptance_is_of(self, padded: int) -> bool:
        """Whether the acceptance was read at about this load (within 2x): in fallback it
        comes from probes, and one read at another load (a single request, another mix) says
        little of this batch; the probe gap restarts when the load moves, so a probe here
        reads it soon."""
        load = self.snapshot.tokens_load
        return not load or _same_load(padded, load)

    def _other_mode_wins(self, est: Estimates) -> bool:
        ahead = 1.0 + self.config.margin
        if self.in_fallback:
            return (
                not self.snapshot.tokens_of_stretch
                and self._acceptance_is_of(est.padded)
                and self._acceptance_is_enough(est.padded)
                and est.spec_tok_s > est.plain_tok_s * ahead
            )
        return est.plain_tok_s > est.spec_tok_s * ahead

    def _acceptance_is_enough(self, padded: int) -> bool:
        """Whether the acceptance holds enough requests to switch back to speculation: one
        probe's, except at ``composition_min_batch`` requests or more at about the load
        speculation was last left at, within ``flap_window`` steps of that switch or after
        switching there back and forth: there ``flap_factor`` probes' (at most
        ``acceptance_requests``; probes that agree pool until they hold them, one that reads a
        change of traffic starts afresh). A probe reads the fallback batch's mix of the
        moment, which at 16 requests moved by a quarter from one probe to the next (an H100,
        0.5.17, mixed traffic, 2026-12-06: five switches in a 10-s level, after which the flap
        rule held speculation there at 8 % below plain steps) and, after 16 clients began at
        once, swung for seconds: the first switch back read 1.97 and 2.14 tokens per step on
        48 and 32 requests and the speculative stretch after it 1.36 and 1.18 (three switches
        in a minute's first 17 s on four of five servers of two holds). Below that many
        requests each request's acceptance is its own, and one probe's follows it, after a
        flap too: the probes of a few mixed requests read other requests and do not agree, so
        they never pooled, and a load of one request that had switched at that size before
        (a warm-up's mix, then a 0 %-acceptance stretch) stayed in fallback for the
        ``flap_window`` (the simulator with an H100's costs, six seeds of a run of small
        loads: a minute of mixed traffic at c = 1 gave 0.919 of the better of plain steps and
        EAGLE-3, 0.864 at worst; 1.001 and 0.998 with one probe's). Switching back there still
        takes ``_wins_needed``'s wins, ``flap_factor`` times more for each flap."""
        config = self.config
        if padded < config.composition_min_batch:
            return True
        recent = self._recent_flaps() > 0 or self._recent_switch()
        if not (self._at_last_switch_load(padded) and recent):
            return True
        probe = padded * self._probe_steps(padded)
        needed = min(config.acceptance_requests, config.flap_factor * probe)
        return self.snapshot.tokens_requests >= needed

    def _explores(self, padded: int, estimates: Estimates | None, step: int) -> bool:
        """Whether this step runs the other mode once, to measure its cost at this size: only
        where no measured size decides it (``CostTable.deciding_size`` at today's acceptance).
        In fallback an explore step is a speculative step (at bs 64 on an H100, 19.1 ms against
        a plain step's 7.1), two at each padded size a level reaches (a size's first time is
        dropped). ``estimates``: this step's, from ``decide``."""
        other_is_spec = self.in_fallback
        if self.snapshot.table.step_ms(other_is_spec, padded) is not None:
            return False
        if other_is_spec and self._speculation_cannot_win(padded):
            return False
        if estimates is not None:
            return False  # decided by a bound: its cost is measured once the bound no longer is
        key = (other_is_spec, padded)
        last = self._last_explore.get(key)
        if last is not None and step - last < self.config.explore_gap:
            return False
        self._last_explore[key] = step
        return True

    def _speculation_cannot_win(self, padded: int) -> bool:
        """Whether plain steps win at ``padded`` even if every draft token were accepted
        (by its own costs with their prefills, or by the largest size below it that has both
        by decode steps alone)."""
        most = self.config.max_tokens_per_step
        if most is None:
            return False
        table = self.snapshot.table
        spec_ms, plain_ms = table.step_ms(True, padded), table.step_ms(False, padded)
        if spec_ms and plain_ms:
            best = self._with_prefills(padded, padded, most, spec_ms, plain_ms, padded)
            return best.spec_tok_s < best.plain_tok_s
        deciding = table.deciding_size(padded, most)
        return deciding is not None and deciding < padded

    def _switch(self, est: Estimates) -> None:
        before, after = ("fallback", "spec") if self.in_fallback else ("spec", "fallback")
        flapping = self._at_last_switch_load(est.padded)
        self._flaps = min(self._recent_flaps() + 1, self.config.flap_max) if flapping else 0
        self._last_switch = (self.steps, est.padded)
        self.in_fallback = not self.in_fallback
        self._wins = 0
        self._since_probe = 0
        self._probe_left = 0
        self._gap_padded = est.padded
        # In fallback: probes from the first gap on; speculating: a plain step now and then
        # keeps the plain cost as fresh as the speculative one (context lengths grow).
        self._probe_gap = self.config.probe_gap if self.in_fallback else self.config.probe_gap_max
        self.n_switches += 1
        if self._log is not None:
            costs_of = "" if est.costs_of == est.padded else f", step costs of bs {est.costs_of}"
            prefills = est.spec_prefill_ms or est.plain_prefill_ms
            spec_prefill = f" + {est.spec_prefill_ms:.2f} ms of prefills" if prefills else ""
            plain_prefill = f" + {est.plain_prefill_ms:.2f} ms of prefills" if prefills else ""
            self._log(
                f"[dynspec] auto: {before} -> {after} at decode bs={est.batch_size} "
                f"(padded {est.padded}{costs_of}): spec {est.spec_tok_s:.0f} tok/s "
                f"({est.tokens_per_step:.2f} tokens/step, {est.spec_ms:.2f} ms/step"
                f"{spec_prefill}) vs plain {est.plain_tok_s:.0f} tok/s ({est.plain_ms:.2f} "
                f"ms/step{plain_prefill}); {self._counters()}"
                f"{self._prefills_read() if prefills else ''}"
            )

    def _counters(self) -> str:
        """The counters a switch line and ``describe`` show."""
        return (
            f"switches={self.n_switches}, fallback_steps={self.n_fallback_steps}, "
            f"spec_steps={self.n_spec_steps}, probes={self.n_probes}"
        )

    def describe(self) -> str:
        """Where the policy stands: its mode, counters and (once read) prefill costs."""
        mode = "fallback" if self.in_fallback else "speculating"
        prefills = self.snapshot.prefill_spec or self.snapshot.prefill_plain
        return (
            f"{mode}, steps={self.steps}, {self._counters()}, explores={self.n_explores}"
            f"{self._prefills_read() if prefills else ''}"
        )

    def _prefills_read(self) -> str:
        """What the prefill shares of a switch line come from: each mode's fitted batch cost
        and the admission rate."""
        snapshot = self.snapshot
        costs = [
            f"{mode} {cost.fixed_ms:.2f} + {cost.per_request_ms:.2f} ms a request"
            for mode, cost in (("speculating", snapshot.prefill_spec),
                               ("in fallback", snapshot.prefill_plain))
            if cost is not None
        ]
        per_token = snapshot.admitted_per_token
        admitted = f"1 request admitted per {1.0 / per_token:.0f} tokens" if per_token > 0 else (
            "no admission read yet"
        )
        return f"; prefill batches {', '.join(costs)}; {admitted}"


def _same_load(padded: int, other: int) -> bool:
    """Whether two padded batch sizes are within 2x of each other (the same load; 0, nothing
    recorded yet, is no padded size's load)."""
    return padded < 2 * other and other < 2 * padded


def step_clock(device: Any) -> HostClock | CudaEventClock:
    """How ``auto`` times steps on ``device``: CUDA events on a GPU, the host clock elsewhere.

    On a GPU the host clock times the launches, not the step (with the overlap scheduler the
    host returns before the GPU has run it): an H200 measured 2-4 ms per step at every batch
    size by the host clock, where the GPU took 7-20 ms.
    """
    kind = str(device).partition(":")[0]  # "cuda", "cuda:1", torch.device("cuda", 1)
    return CudaEventClock() if kind == "cuda" else HostClock()


class HostClock:
    """Step timing by the host clock (CPU devices; CPU tests inject clocks of their own)."""

    def start(self) -> Any:
        return time.perf_counter()

    def stop(self, started: Any) -> Any:
        return started, time.perf_counter()

    def elapsed_ms(self, handle: Any) -> float:
        return (handle[1] - handle[0]) * 1000.0


class CudaEventClock:
    """Step timing by CUDA events: recorded in the step, read (old, so done) at a sync step."""

    def start(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started: Any) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return started, event

    def elapsed_ms(self, handle: Any) -> float:
        started, ended = handle
        ended.synchronize()
        return float(started.elapsed_time(ended))


@dataclass
class _Measured:
    step: int
    speculative: bool
    padded: int
    requests: int
    timing: Any
    # A speculative step's tokens per request, read when resolved (None: a fallback step).
    tokens_per_request: Callable[[], StepTokens] | None
    # Whether the policy was in fallback when the step ran: a speculative step then is a
    # probe (it re-measures acceptance outright); any step then ends a speculative stretch.
    in_fallback: bool = False
    # Requests that had begun decoding by this step (prefilled), counted from the start.
    started: int = 0
    # A probe's requests, in batch order (their ``rid``s): None for any other step.
    request_keys: tuple[Hashable, ...] | None = None


@dataclass
class _MeasuredPrefill:
    """A prefill batch on the source rank, resolved with the decode step after it."""

    step: int  # the decode step after it
    requests: int
    timing: Any
    in_fallback: bool


class StepTokens(NamedTuple):
    """One verify step's tokens per request (1 + accepted drafts): their mean, and each
    request's in batch order where the worker reports them (None: the mean alone)."""

    mean: float
    each: tuple[float, ...] | None = None


class _Verified(NamedTuple):
    """One verify step in the acceptance window."""

    tokens: float  # tokens over all its requests (1 + accepted drafts each)
    requests: int
    started: int  # ``_Measured.started``
    # A probe's step: (request, its tokens) for each of its requests, where both are known.
    each: tuple[tuple[Hashable, float], ...] | None = None


def speculating_tokens_per_step(steps: Iterable[_Verified]) -> float:
    """The tokens per request per step that speculating would settle at, from a fallback
    batch's probe steps: the harmonic mean of each request's own mean over the steps.

    A speculating batch holds each request for a time inversely proportional to its tokens
    per step (Little's law), so it holds more of the low-acceptance requests than the batch
    a probe samples in fallback, where every request lasts one step per token: a probe's
    plain mean overstates it (mixed traffic of 0 / 50 / 90 % acceptance: the plain mean 2.1
    tokens per step, a speculative stretch settles at the harmonic mean, 1.6). A request's
    mean over a few steps is noisy and 1 / mean is convex, so 1 / mean alone reads low (a
    50 %-acceptance request over 4 steps: ~7 %, over 2: ~14 %); ``_steps_per_token`` takes
    off that bias's second-order term (over 2 steps then within ~5 %, over 4 within ~1.5 %).
    """
    return speculating_tokens(steps, 0.0).estimate


class SpeculatingTokens(NamedTuple):
    """What probe steps read by request say speculating would settle at (tokens per request
    per step): the estimate, and the bound a probe counts at."""

    estimate: float  # ``speculating_tokens_per_step``
    bound: float  # the estimate less ``z`` standard errors


def speculating_tokens(steps: Iterable[_Verified], z: float) -> SpeculatingTokens:
    """``speculating_tokens_per_step``, 1 / the requests' mean steps per token, and its bound:
    1 / (that mean + ``z`` standard errors of it).

    The error is the spread of the requests' own steps per token over their number (one
    request: the spread of its readings, by the delta method). A probe of 16 mixed requests
    over 4 steps reads the harmonic mean within ~17 % (the simulator, 2026-12-06): a probe one
    standard deviation high called speculation back at c = 16 every few probes, where plain
    steps win by 5-9 %; a probe's requests say how far their mean can be trusted, and probes
    that agree pool their requests, so the bound closes in on the estimate as they add up.
    """
    readings = _readings_by_request(steps)
    each = [_steps_per_token(values) for values in readings.values()]
    n = len(each)
    mean = sum(each) / n
    if n > 1:
        variance_of_mean = sum((s - mean) ** 2 for s in each) / ((n - 1) * n)
    else:
        [values] = readings.values()
        k, average = len(values), sum(values) / len(values)
        spread = sum((x - average) ** 2 for x in values) / (k - 1) if k > 1 else 0.0
        variance_of_mean = spread / (k * average**4)
    bound = 1.0 / min(1.0, mean + z * math.sqrt(variance_of_mean))
    return SpeculatingTokens(1.0 / mean, bound)


def _readings_by_request(steps: Iterable[_Verified]) -> dict[Hashable, list[float]]:
    """Each request's tokens at each of these probe steps it was in, in step order."""
    readings: dict[Hashable, list[float]] = collections.defaultdict(list)
    for step in steps:
        assert step.each is not None  # the caller checked: every step has its requests'
        for key, value in step.each:
            readings[key].append(value)
    return readings


def _plain_mean(steps: Iterable[_Verified]) -> float:
    """Tokens per request over these verify steps, every request-step alike."""
    tokens = requests = 0.0
    for step in steps:
        tokens += step.tokens
        requests += step.requests
    return tokens / requests


def _steps_per_token(readings: list[float]) -> float:
    """1 / a request's tokens per step, from its readings: 1 / their mean, less the
    second-order bias of that (variance / (n * mean^3), 1 / x being convex) where there are
    two or more; at least 1 / the largest reading, at most 1 (a verify gives 1 token or more)."""
    n = len(readings)
    mean = sum(readings) / n
    estimate = 1.0 / mean
    if n > 1:
        variance = sum((x - mean) ** 2 for x in readings) / (n - 1)
        estimate -= variance / (n * mean**3)
    return min(1.0, max(1.0 / max(readings), estimate))


class Measurements:
    """Rank 0's step times and acceptance, turned into a ``Snapshot`` at sync steps.

    The first time of each (mode, size) is dropped (it pays one-off compiles and allocator
    growth); a size's cost is the median of its last ``cost_window`` times. Acceptance is the
    mean tokens per request over the newest verify steps holding ``acceptance_requests``
    requests and ``acceptance_distinct`` different ones (one step of a large batch, many
    steps of a small one, so a single step or a single request does not decide it), kept while
    in fallback, where probes re-measure it: a probe
    replaces what the speculative stretch left, or a probe at another load, or one whose steps
    so far read more than ``probe_change`` off; a probe that agrees with the probes before it at
    about their load joins them, so the window spans several probes.

    A probe's plain mean overstates what speculating would give when requests differ in
    acceptance: speculation finishes the high-acceptance requests sooner, so a speculating
    batch holds more of the low-acceptance ones than the batch a probe samples in fallback
    (mixed traffic with 0 / 50 / 90 % acceptance: a probe's plain mean 2.1 tokens per step, a
    speculative stretch settles at 1.6). So a probe whose steps say which request gave which
    tokens reads ``speculating_tokens_per_step``, the harmonic mean of its requests' own means
    (an H100 at 16 mixed requests, 2026-12-06: the plain mean 2.09 switched back to speculation
    and the stretch settled at 1.28, three switches in a 10-s level on every such server). And
    each speculative stretch entered from a probe records how its acceptance ended against the
    probe that started it, ``composition`` (1 where they agree), and a probe's acceptance
    counts times that until the next stretch measures it again (what the harmonic mean does
    not foresee: acceptance that goes with length, a worker that reports only the mean): on a probe
    of ``composition_min_batch`` requests or more at any load (the ratio is the traffic's),
    on fewer only at about the load it was learned at (within 2x; a few requests' acceptance
    is their own: a mixed load of 128 that turns into one request must speculate again at
    once).
    """

    def __init__(
        self, config: AutoConfig, clock: Any, log: Callable[[str], None] | None = None
    ) -> None:
        self.config = config
        self.clock = clock
        self._log = log
        self._probe_shown = False  # the first probe read by request was logged
        self.tokens_per_step: float | None = None
        # The newest verify steps, newest last, with their requests and tokens in all, and
        # their mean
        self._verified: collections.deque[_Verified] = collections.deque()
        self._held = 0
        self._tokens = 0.0
        self._raw: float | None = None  # tokens per request over the window, uncorrected
        # A window read by request: ``_raw`` less its sampling error (None: read by its mean)
        self._raw_bound: float | None = None
        self._in_probe = False
        # The probe under way: its steps, and the window of the probes before it that it may
        # join (empty: it stands alone).
        self._probe_steps: list[_Verified] = []
        self._before_probe: list[_Verified] = []
        # What was published when the probe under way began: a probe that reads a change off
        # the probes before it at this load counts at most that until another agrees with it
        self._published_before_probe: float | None = None
        self._change_cap: float | None = None  # that cap, while the change is unconfirmed
        self._from_probe = False  # the window holds a probe's steps (no stretch since)
        self._in_stretch = False
        self._stretch_entry: float | None = None  # the probe's acceptance a stretch began at
        self._stretch_entry_load = 0  # the padded batch size that probe read it at
        self.composition = 1.0
        self._composition_load = 0  # the padded batch size the composition was learned at
        self._padded = 0  # the padded batch size of the newest verify step
        self._pending: list[_Measured] = []
        self._times: dict[tuple[bool, int], collections.deque[float]] = {}
        self._seen: collections.Counter[tuple[bool, int]] = collections.Counter()
        self._pending_prefills: list[_MeasuredPrefill] = []
        # (requests, ms) of the newest prefill batches, by whether they ran while speculating
        self._prefills: dict[bool, collections.deque[tuple[int, float]]] = {
            speculating: collections.deque(maxlen=config.prefill_window)
            for speculating in (True, False)
        }
        # (tokens decoded, requests admitted since the step before) of the newest steps
        self._admissions: collections.deque[tuple[float, int]] = collections.deque()
        self._decoded = 0.0
        self._admitted = 0
        self._last_started: int | None = None

    def add(self, measured: _Measured) -> None:
        self._pending.append(measured)

    def add_prefill(self, measured: _MeasuredPrefill) -> None:
        self._pending_prefills.append(measured)

    def resolve(self, up_to_step: int) -> None:
        """Read every pending step at or before ``up_to_step`` (their GPU work is done)."""
        keep: list[_Measured] = []
        for measured in self._pending:
            if measured.step > up_to_step:
                keep.append(measured)
                continue
            key = (measured.speculative, measured.padded)
            ms = self.clock.elapsed_ms(measured.timing)
            self._seen[key] += 1
            if self._seen[key] > 1 and ms > 0:
                window = self._times.setdefault(
                    key, collections.deque(maxlen=self.config.cost_window)
                )
                window.append(ms)
            decoded = float(measured.requests)
            if measured.tokens_per_request is not None:
                reading = measured.tokens_per_request()
                decoded = reading.mean * measured.requests
                self._add_acceptance(measured, reading)
            elif measured.in_fallback:
                if self._in_probe:
                    self._show_first_probe()
                self._in_probe = False  # a fallback step ends a probe
                self._end_stretch()
            self._add_admissions(measured.started, decoded)
        self._pending = keep
        waiting: list[_MeasuredPrefill] = []
        for prefill in self._pending_prefills:
            if prefill.step > up_to_step:
                waiting.append(prefill)
                continue
            ms = self.clock.elapsed_ms(prefill.timing)
            if ms > 0:
                self._prefills[not prefill.in_fallback].append((prefill.requests, ms))
        self._pending_prefills = waiting

    def _add_admissions(self, started: int, decoded: float) -> None:
        """Count one step's tokens and the requests admitted since the step before it, over
        the newest steps that decoded ``admission_tokens`` (a step whose acceptance could
        not be read, 0 tokens, passes its admissions on to the next)."""
        if decoded <= 0:
            return
        admitted = started - self._last_started if self._last_started is not None else 0
        self._last_started = started
        self._admissions.append((decoded, admitted))
        self._decoded += decoded
        self._admitted += admitted
        window = self._admissions
        while len(window) > 1 and self._decoded - window[0][0] >= self.config.admission_tokens:
            tokens, requests = window.popleft()
            self._decoded -= tokens
            self._admitted -= requests

    @property
    def admitted_per_token(self) -> float:
        return self._admitted / self._decoded if self._decoded > 0 else 0.0

    def _add_acceptance(self, measured: _Measured, reading: StepTokens) -> None:
        requests, padded, probe = measured.requests, measured.padded, measured.in_fallback
        starts_probe = probe and not self._in_probe
        read_at = self._padded
        self._in_probe = probe
        if probe:
            self._end_stretch()  # at the stretch's own load, before this step's
        elif not self._in_stretch:
            self._in_stretch = True
            self._stretch_entry = self._raw if self._from_probe else None
            self._stretch_entry_load = read_at
            self._from_probe = False
        self._padded = padded
        if reading.mean > 0 and requests > 0:
            keys, each = measured.request_keys, reading.each
            known = probe and keys is not None and each is not None and len(keys) == len(each)
            per_request = tuple(zip(keys, each, strict=True)) if known else None
            entry = _Verified(reading.mean * requests, requests, measured.started, per_request)
            if probe:
                if starts_probe:
                    poolable = self._from_probe and _same_load(padded, read_at)
                    self._before_probe = list(self._verified) if poolable else []
                    self._published_before_probe = self.tokens_per_step
                    self._probe_steps = []
                    self._from_probe = True
                self._probe_steps.append(entry)
                self._set_window(self._probe_window())
            else:
                self._verified.append(entry)
                self._held += entry.requests
                self._tokens += entry.tokens
            self._trim_window()
            window = self._verified
            if self._reads_by_request(window):
                self._raw, self._raw_bound = speculating_tokens(window, self._confidence(requests))
            else:  # the running sums: a stretch's window can hold 1024 steps
                self._raw = self._tokens / self._held
                self._raw_bound = None
        self._publish()

    def _confidence(self, requests: int) -> float:
        """The standard errors a probe of ``requests`` requests a step counts less:
        ``probe_confidence``, or ``probe_confidence_few`` below ``composition_min_batch``."""
        config = self.config
        if requests < config.composition_min_batch:
            return config.probe_confidence_few
        return config.probe_confidence

    def _reads_by_request(self, steps: Collection[_Verified]) -> bool:
        """Whether these are probe steps that say which request gave which tokens."""
        return self._from_probe and all(step.each for step in steps)

    def _window_reading(self, steps: Collection[_Verified]) -> float:
        """Tokens per request per step of these verify steps: probe steps that say which
        request gave which tokens, ``speculating_tokens_per_step``; else their plain mean."""
        if self._reads_by_request(steps):
            return speculating_tokens_per_step(steps)
        return _plain_mean(steps)

    def _show_first_probe(self) -> None:
        """Log, once, the first probe read by request (``composition_min_batch`` requests or
        more with two readings or more), so a real server shows how its probes read."""
        steps = self._probe_steps
        if self._log is None or self._probe_shown or not steps:
            return
        if not all(step.each for step in steps):
            return
        readings = _readings_by_request(steps)
        if sum(len(v) >= 2 for v in readings.values()) < self.config.composition_min_batch:
            return
        self._probe_shown = True
        self._show_by_request("the first probe", steps)

    def show_probes_that_switched_back(self) -> None:
        """Log the probes whose acceptance just called speculation back, where they read by
        request (a switch back on a high probe is the one a real server gets wrong)."""
        if self._log is not None and self._verified and self._reads_by_request(self._verified):
            self._show_by_request("the probes that called speculation back", self._verified)

    def _show_by_request(self, what: str, steps: Collection[_Verified]) -> None:
        """One line: each request's tokens per step (a digit a step), what they say speculating
        would settle at, the bound it counts at and the batch's plain mean."""
        assert self._log is not None
        readings = _readings_by_request(steps)
        each = " ".join(
            "".join(str(int(x)) if x < 10 else "+" for x in values) for values in readings.values()
        )
        z = self.config.probe_confidence
        speculating = speculating_tokens(steps, z)
        self._log(
            f"[dynspec] auto: {what} read by request ({len(readings)} requests, "
            f"{len(steps)} steps; each request's tokens per step: {each}): speculating would "
            f"settle at {speculating.estimate:.2f} tokens per step, at least "
            f"{speculating.bound:.2f} within {z:g} standard errors; the "
            f"fallback batch's plain mean is {_plain_mean(steps):.2f}"
        )

    def _trim_window(self) -> None:
        """Drop the oldest verify steps the newer ones do without: while the rest still hold
        ``acceptance_requests`` requests and ``acceptance_distinct`` different ones (or more
        than ``acceptance_steps_max`` steps)."""
        window, config = self._verified, self.config
        while len(window) > 1:
            distinct = window[1].requests + window[-1].started - window[1].started
            enough = distinct >= config.acceptance_distinct or (
                len(window) > config.acceptance_steps_max
            )
            if self._held - window[0].requests < config.acceptance_requests or not enough:
                return
            oldest = window.popleft()
            self._held -= oldest.requests
            self._tokens -= oldest.tokens

    def _set_window(self, steps: list[_Verified]) -> None:
        self._verified = collections.deque(steps)
        self._held = sum(v.requests for v in steps)
        self._tokens = sum(v.tokens for v in steps)

    def _probe_window(self) -> list[_Verified]:
        """The probe so far, after the probes before it where its mean so far agrees with
        theirs (within ``probe_change``): judged on every step it has verified, not its first
        alone (at bs 1 a step is one request's one verify: 1 token or 4 at 50 % acceptance).

        One that reads a change beyond that replaces them but counts at most what they did
        (``_change_cap``) until the next probe agrees with it. A rise so read is often a
        sample: a probe of 16 mixed requests reads high by a quarter or more about once in
        ten (a batch short of low-acceptance requests, whose own spread then understates the
        error), and on its own it called speculation back at c = 16 where plain steps win (the
        simulator with an H100's step costs, 2026-12-06: one minute in ten). A fall counts at
        once, reading below what they did. So does a rise on fewer than
        ``composition_min_batch`` requests (a few requests' acceptance is their own: at c = 1
        on mixed traffic the next probe is often another request's, and would not agree) or on
        ``probe_requests`` or more (a batch that large reads within ~6 %: a change of 30 % is
        the traffic's).
        """
        steps = self._probe_steps
        self._change_cap = None
        if self._before_probe:
            before = self._before_probe
            reading, pooled = self._window_reading(steps), self._window_reading(before)
            if abs(reading / pooled - 1.0) <= self.config.probe_change:
                return before + steps
            config = self.config
            if config.composition_min_batch <= steps[-1].requests < config.probe_requests:
                self._change_cap = self._published_before_probe
        return list(steps)

    def _end_stretch(self) -> None:
        if not self._in_stretch:
            return
        self._in_stretch = False
        at_entry_load = _same_load(self._padded, self._stretch_entry_load)
        if self._stretch_entry and self._raw and self._newest_is_a_batch() and at_entry_load:
            low, high = self.config.composition_bounds
            self.composition = min(high, max(low, self._raw / self._stretch_entry))
            self._composition_load = self._padded
        self._publish()

    def _newest_is_a_batch(self) -> bool:
        """Whether the newest verify step held ``composition_min_batch`` requests or more: a
        batch's composition, not a few requests' own acceptance."""
        newest = self._verified[-1] if self._verified else None
        return newest is not None and newest.requests >= self.config.composition_min_batch

    def _publish(self) -> None:
        if self._raw is None:
            return
        applies = self._from_probe and (
            self._newest_is_a_batch() or _same_load(self._padded, self._composition_load)
        )
        tokens = self._raw if self._raw_bound is None else self._raw_bound
        tokens = tokens * self.composition if applies else tokens
        if self._change_cap is not None and self._from_probe:
            tokens = min(tokens, self._change_cap)
        self.tokens_per_step = tokens

    def snapshot(self) -> Snapshot:
        entries: dict[int, tuple[float | None, float | None]] = {}
        for (speculative, padded), window in self._times.items():
            spec, plain = entries.get(padded, (None, None))
            median = float(sorted(window)[len(window) // 2])
            entries[padded] = (median, plain) if speculative else (spec, median)
        return Snapshot(
            self.tokens_per_step,
            CostTable(entries),
            self._padded,
            self._held,
            tokens_of_stretch=self._raw is not None and not self._from_probe,
            admitted_per_token=self.admitted_per_token,
            prefill_spec=fit_prefill_cost(self._prefills[True]),
            prefill_plain=fit_prefill_cost(self._prefills[False]),
        )


def broadcast_from_first_rank(cpu_group: Any) -> Callable[[Snapshot | None], Snapshot]:
    """``share`` for TP > 1: every rank gets the first rank's snapshot (two CPU broadcasts:
    its length, then its floats; the other ranks' ``mine`` is ignored)."""
    import torch
    import torch.distributed as dist

    source = dist.get_global_rank(cpu_group, 0)

    def share(mine: Snapshot | None) -> Snapshot:
        wire = mine.to_wire() if mine is not None else []
        length = torch.tensor([len(wire)], dtype=torch.int64)
        dist.broadcast(length, src=source, group=cpu_group)
        values = torch.tensor(wire, dtype=torch.float64)
        if values.numel() != int(length[0]):
            values = torch.zeros(int(length[0]), dtype=torch.float64)
        dist.broadcast(values, src=source, group=cpu_group)
        return Snapshot.from_wire(values.tolist())

    return share


class AutoController:
    """``auto`` in a worker: the policy, rank 0's measurements, the sync, the metrics.

    Only the source rank (TP rank 0) measures. At every decode step that is a multiple of
    ``sync_every`` it reads its steps that are at least ``lag_steps`` old and every rank adopts
    its snapshot (``share``: a broadcast over the TP group's CPU group; the identity without
    TP), so all decisions in between use identical inputs.
    """

    # A fallback step can happen at any batch size: DECODE graphs for every graph size.
    min_fallback_batch_size = 1

    def __init__(
        self,
        policy: GoodputPolicy,
        *,
        source: bool,
        share: Callable[[Snapshot | None], Snapshot] | None = None,
        clock: Any = None,
        metrics: AutoMetrics | None = None,
    ) -> None:
        self.policy = policy
        self.source = source
        self._share = share
        self.measurements = Measurements(policy.config, clock or HostClock(), policy._log)
        self.metrics = metrics
        self.n_syncs = 0
        self.n_started = 0  # requests prefilled so far (source rank only)

    @property
    def in_fallback(self) -> bool:
        return self.policy.in_fallback

    def decide(self, batch_size: int) -> bool:
        """True means run this decode step as fallback (see ``GoodputPolicy.decide``)."""
        step = self.policy.steps
        if step and step % self.policy.config.sync_every == 0:
            self._sync(step)
        in_fallback = self.policy.in_fallback
        run_fallback = self.policy.decide(batch_size)
        if in_fallback and not self.policy.in_fallback and self.source:
            self.measurements.show_probes_that_switched_back()
        return run_fallback

    def _sync(self, step: int) -> None:
        mine = None
        if self.source:
            self.measurements.resolve(step - self.policy.config.lag_steps)
            mine = self.measurements.snapshot()
        snapshot = self._share(mine) if self._share is not None else mine
        if snapshot is not None:
            self.policy.adopt(snapshot)
        self.n_syncs += 1
        if self.metrics is not None:
            self.metrics.update(self.policy)

    def finish_prefill(self, started: Any, requests: int) -> None:
        """Mark the end of a prefill batch begun at ``started`` (``start_step``): count its
        requests, which begin decoding next (a chunked prompt counts at each chunk, which
        only shortens the acceptance window and raises the admission rate a little), and time
        it (``PrefillCost``)."""
        if not self.source:
            return
        self.n_started += requests
        self.measurements.add_prefill(
            _MeasuredPrefill(
                self.policy.steps, requests, self.measurements.clock.stop(started),
                self.policy.in_fallback,
            )
        )

    def start_step(self) -> Any:
        """Mark the start of the step just decided, or of a prefill batch (source rank only;
        no sync)."""
        return self.measurements.clock.start() if self.source else None

    def finish_step(
        self,
        started: Any,
        speculative: bool,
        batch_size: int,
        tokens_per_request: Callable[[], StepTokens] | None = None,
        requests: Sequence[Any] = (),
    ) -> None:
        """Mark its end; ``tokens_per_request`` reads a speculative step's acceptance later;
        ``requests``: the batch's (SGLang's ``Req``s, in batch order), whose ``rid``s a probe
        keeps to read each request's own tokens per step."""
        if not self.source:
            return
        probe = speculative and self.policy.in_fallback
        keys = tuple(req.rid for req in requests) if probe and requests else None
        clock = self.measurements.clock
        self.measurements.add(
            _Measured(
                step=self.policy.steps - 1,
                speculative=speculative,
                padded=padded_batch_size(batch_size, self.policy.graph_sizes),
                requests=batch_size,
                timing=clock.stop(started),
                tokens_per_request=tokens_per_request if speculative else None,
                in_fallback=self.policy.in_fallback,
                started=self.n_started,
                request_keys=keys,
            )
        )


class AutoMetrics:
    """``auto``'s Prometheus series, written in SGLang's multiprocess mode (rank 0 only).

    ``sglang:dynspec_speculating`` (1 speculating, 0 fallback), ``sglang:dynspec_switches``
    and ``sglang:dynspec_fallback_steps`` (counters, ``_total``), and
    ``sglang:dynspec_spec_tok_per_s`` / ``sglang:dynspec_plain_tok_per_s`` (the latest
    decision's estimates). Updated at sync steps.
    """

    def __init__(self, prometheus: Any, labels: dict[str, str]) -> None:
        names = list(labels)

        def gauge(name: str, doc: str) -> Any:
            return prometheus.Gauge(
                name, doc, labelnames=names, multiprocess_mode="mostrecent", registry=None
            ).labels(**labels)

        def counter(name: str, doc: str) -> Any:
            return prometheus.Counter(name, doc, labelnames=names, registry=None).labels(**labels)

        self.speculating = gauge(
            "sglang:dynspec_speculating", "1 while auto speculates, 0 while it runs plain steps."
        )
        self.switches = counter("sglang:dynspec_switches", "Mode switches of auto.")
        self.fallback_steps = counter(
            "sglang:dynspec_fallback_steps", "Decode steps run as plain (fallback) steps."
        )
        self.spec_tok_s = gauge(
            "sglang:dynspec_spec_tok_per_s", "Estimated speculative tok/s at the current batch."
        )
        self.plain_tok_s = gauge(
            "sglang:dynspec_plain_tok_per_s", "Estimated plain tok/s at the current batch."
        )
        self._counted = (0, 0)

    @classmethod
    def create(cls, server_args: Any) -> AutoMetrics | None:
        """The series when SGLang exports metrics (``--enable-metrics``), else None."""
        if not getattr(server_args, "enable_metrics", False):
            return None
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return None  # SGLang's /metrics reads only the multiprocess files
        try:
            import prometheus_client
        except ImportError:
            return None
        name = getattr(server_args, "served_model_name", None) or getattr(
            server_args, "model_path", ""
        )
        return cls(prometheus_client, {"model_name": str(name or "")})

    def update(self, policy: GoodputPolicy) -> None:
        self.speculating.set(0 if policy.in_fallback else 1)
        switches, fallback_steps = self._counted
        self.switches.inc(policy.n_switches - switches)
        self.fallback_steps.inc(policy.n_fallback_steps - fallback_steps)
        self._counted = (policy.n_switches, policy.n_fallback_steps)
        if policy.last is not None:
            self.spec_tok_s.set(policy.last.spec_tok_s)
            self.plain_tok_s.set(policy.last.plain_tok_s)


# --------------------------------------------------------------------------------------------
# The names the runtime needs: one table, read by the adapter here and by runtime_probe.
# --------------------------------------------------------------------------------------------

# Scopes, i.e. where a name must exist (the probe maps each to source files):
#   module       a global of the worker's module (import, def, class or assignment)
#   worker       a member of the worker (method, property or instance attribute)
#   draft_worker a member of the v2 draft worker (``worker.draft_worker``)
#   fields       a dataclass field of the worker-module global named by ``owner``
#   member       a class member (method / enum member) of the global named by ``owner``
#   param        a parameter of method ``owner`` = "<Global>.<method>"
#   target_param a parameter of the target worker's ``forward_batch_generation``
#   runner_attr  an attribute of the target model runner
#   batch_member a member of SGLang's ScheduleBatch
#   verify_module a global of the module holding the release's verify body: the module of
#                the worker-module global ``run_eagle_verify`` (0.5.16+), else the worker's
#   fn_param     a parameter of the function ``owner``, a global of the verify module or else
#                of the worker's module
#   draft_param  a parameter of the v2 draft worker's method ``owner``


@dataclass(frozen=True)
class Need:
    """One SGLang name the runtime uses; the first candidate found is the one used."""

    key: str
    scope: str
    candidates: tuple[str, ...]
    owner: str = ""
    optional: bool = False
    # Only required when another need resolved to a given candidate: (key, candidate).
    when: tuple[str, str] | None = None
    why: str = ""


# Needs both worker variants share.
_COMMON_NEEDS: tuple[Need, ...] = (
    Need("verify_input_cls", "module", ("EagleVerifyInput",), why="one-node verify input"),
    Need("draft_input_cls", "module", ("EagleDraftInput",), why="draft state class"),
    Need("capture_mode_cls", "module", ("CaptureHiddenMode",), why="FULL hidden capture"),
    Need("capture_full", "member", ("FULL",), owner="CaptureHiddenMode"),
    Need("vi_draft_token", "fields", ("draft_token",), owner="EagleVerifyInput"),
    Need("vi_custom_mask", "fields", ("custom_mask",), owner="EagleVerifyInput"),
    Need("vi_positions", "fields", ("positions",), owner="EagleVerifyInput"),
    Need("vi_index", "fields", ("retrive_index", "retrieve_index"), owner="EagleVerifyInput"),
    Need(
        "vi_next_token",
        "fields",
        ("retrive_next_token", "retrieve_next_token"),
        owner="EagleVerifyInput",
    ),
    Need(
        "vi_next_sibling",
        "fields",
        ("retrive_next_sibling", "retrieve_next_sibling"),
        owner="EagleVerifyInput",
    ),
    Need("vi_cum_len", "fields", ("retrive_cum_len", "retrieve_cum_len"), owner="EagleVerifyInput"),
    Need("vi_spec_steps", "fields", ("spec_steps",), owner="EagleVerifyInput"),
    Need("vi_draft_token_num", "fields", ("draft_token_num",), owner="EagleVerifyInput"),
    Need("vi_capture_mode", "fields", ("capture_hidden_mode",), owner="EagleVerifyInput"),
    Need("vi_topk", "fields", ("topk",), owner="EagleVerifyInput", optional=True),
    Need("vi_seq_lens_sum", "fields", ("seq_lens_sum",), owner="EagleVerifyInput", optional=True),
    Need("vi_seq_lens_cpu", "fields", ("seq_lens_cpu",), owner="EagleVerifyInput", optional=True),
    Need("root_field", "fields", ("verified_id", "bonus_tokens"), owner="EagleDraftInput"),
    Need("target_kwarg", "target_param", ("is_verify", "skip_sample"), why="logits only"),
    Need(
        "graph_attr",
        "runner_attr",
        ("graph_runner", "cuda_graph_runner", "decode_cuda_graph_runner"),
        why="swapped for DECODE graphs during a fallback step: its graphs are TARGET_VERIFY",
    ),
    Need("moe_ctx", "module", ("speculative_moe_backend_context",), optional=True),
    Need("moe_a2a_ctx", "module", ("speculative_moe_a2a_backend_context",), optional=True),
)

V1_NEEDS: tuple[Need, ...] = (
    *_COMMON_NEEDS,
    Need(
        "bitmask_fn",
        "module",
        ("generate_token_bitmask",),
        optional=True,
        why="grammar mask of the tree; without it grammar batches keep speculating",
    ),
    Need(
        "entry",
        "worker",
        ("forward_batch_speculative_generation", "forward_batch_generation"),
        # The 0.4.x worker also inherits TpModelWorker.forward_batch_generation: look for
        # the speculative name first.
        why="hooked method; its name decides the return contract",
    ),
    Need("verify_output_cls", "module", ("EagleVerifyOutput",)),
    Need("prepare_for_verify", "member", ("prepare_for_verify",), owner="EagleVerifyInput"),
    Need("prepare_page_size", "param", ("page_size",), owner="EagleVerifyInput.prepare_for_verify"),
    Need("vi_verify", "member", ("verify",), owner="EagleVerifyInput"),
    Need(
        "verify_vocab_mask",
        "param",
        ("vocab_mask",),
        owner="EagleVerifyInput.verify",
        optional=True,
        why="without it grammar batches keep speculating",
    ),
    Need(
        "vo_next_input",
        "fields",
        ("draft_input", "draft_extend_input"),
        owner="EagleVerifyOutput",
        why="draft_extend_input: the draft-extend returns the next draft input",
    ),
    Need("vo_tokens", "fields", ("verified_id", "accept_tokens"), owner="EagleVerifyOutput"),
    Need(
        "vo_per_req",
        "fields",
        (
            "accept_length_per_req_cpu",
            "num_accepted_drafts_per_req_cpu",
            "num_correct_drafts_per_req_cpu",
        ),
        owner="EagleVerifyOutput",
    ),
    Need(
        "vo_indices",
        "fields",
        ("accepted_indices", "accept_indices", "accepeted_indices"),
        owner="EagleVerifyOutput",
    ),
    Need(
        "draft_extend_input_ids",
        "fields",
        ("input_ids",),
        owner="EagleDraftExtendInput",
        when=("vo_next_input", "draft_extend_input"),
    ),
    Need(
        "draft_extend_input_cls",
        "module",
        ("EagleDraftExtendInput",),
        when=("vo_next_input", "draft_extend_input"),
    ),
    Need(
        "preprocess_idle",
        "worker",
        ("_draft_preprocess_idle",),
        when=("vo_next_input", "draft_extend_input"),
        why="installs an idle draft input when every request finished",
    ),
    Need(
        "result_cls",
        "module",
        ("GenerationBatchResult",),
        when=("entry", "forward_batch_generation"),
    ),
    Need(
        "gbr_logits",
        "fields",
        ("logits_output",),
        owner="GenerationBatchResult",
        when=("entry", "forward_batch_generation"),
    ),
    Need(
        "gbr_tokens",
        "fields",
        ("next_token_ids",),
        owner="GenerationBatchResult",
        when=("entry", "forward_batch_generation"),
    ),
    Need(
        "gbr_graph",
        "fields",
        ("can_run_cuda_graph",),
        owner="GenerationBatchResult",
        when=("entry", "forward_batch_generation"),
    ),
    Need(
        "gbr_count",
        "fields",
        ("num_accepted_tokens", "num_accepted_drafts", "num_correct_drafts"),
        owner="GenerationBatchResult",
        when=("entry", "forward_batch_generation"),
    ),
    Need(
        "gbr_per_req",
        "fields",
        (
            "accept_length_per_req_cpu",
            "num_accepted_drafts_per_req_cpu",
            "num_correct_drafts_per_req_cpu",
        ),
        owner="GenerationBatchResult",
        optional=True,
    ),
    Need(
        "logprob_fn",
        "module",
        ("add_output_logprobs_for_spec_v1",),
        optional=True,
        why="logprobs of the accepted token (else the worker's add_logprob_values)",
    ),
    Need("logprob_method", "worker", ("add_logprob_values",), optional=True),
    Need("draft_extend", "worker", ("forward_draft_extend_after_decode",)),
    Need("draft_tp_context", "worker", ("draft_tp_context",)),
    Need("draft_model_runner", "worker", ("draft_model_runner",)),
    Need("target_worker", "worker", ("target_worker",)),
    Need("allocator", "worker", ("token_to_kv_pool_allocator",)),
    Need("page_size", "worker", ("page_size",)),
    Need("server_args", "worker", ("server_args",)),
    Need("get_mwb", "batch_member", ("get_model_worker_batch",)),
    Need("batch_size", "batch_member", ("batch_size",)),
    Need("evict_swa", "batch_member", ("maybe_evict_swa",), optional=True),
)

V2_NEEDS: tuple[Need, ...] = (
    *_COMMON_NEEDS,
    Need("entry", "worker", ("forward_batch_generation",)),
    # Sampling: EagleVerifyInput.sample (<= 0.5.13.post1) or eagle_sample(vi, ...) (0.5.14+).
    Need("vi_sample", "member", ("sample",), owner="EagleVerifyInput", optional=True),
    Need(
        "sample_vocab_mask",
        "param",
        ("vocab_mask",),
        owner="EagleVerifyInput.sample",
        optional=True,
        when=("vi_sample", "sample"),
        why="without it grammar batches keep speculating",
    ),
    Need("sample_fn", "verify_module", ("eagle_sample",), optional=True),
    Need(
        "sample_fn_mask",
        "fn_param",
        ("grammar_mask", "vocab_mask"),
        owner="eagle_sample",
        optional=True,
        when=("sample_fn", "eagle_sample"),
        why="without it grammar batches keep speculating",
    ),
    # Grammar: a bitmask over the tree (<= 0.5.16), or a GrammarMask built from a GrammarTree
    # after the release's grammar barrier (0.5.17+). Without either, grammar batches speculate.
    Need("bitmask_fn", "verify_module", ("generate_token_bitmask",), optional=True),
    Need(
        "bitmask_takes_vi",
        "fn_param",
        ("verify_input",),
        owner="generate_token_bitmask",
        optional=True,
        when=("bitmask_fn", "generate_token_bitmask"),
        why="the bitmask signature the fallback calls (reqs, verify_input, ...)",
    ),
    Need("grammar_mask_fn", "verify_module", ("build_grammar_vocab_mask",), optional=True),
    Need(
        "grammar_tree_cls",
        "verify_module",
        ("GrammarTree",),
        when=("grammar_mask_fn", "build_grammar_vocab_mask"),
    ),
    Need(
        "target_capture_kwarg",
        "target_param",
        ("capture_hidden_mode",),
        optional=True,
        why="0.5.16+: FULL hidden capture is a keyword of the target forward",
    ),
    Need(
        "exec_config",
        "module",
        ("get_exec",),
        optional=True,
        why="0.5.19+: graph batch sizes and hidden-state capture are read from get_exec()",
    ),
    Need(
        "spec_config",
        "module",
        ("get_spec",),
        optional=True,
        why="0.5.17+: attention backends read the speculative widths from get_spec()",
    ),
    Need(
        "parallel_config",
        "module",
        ("get_parallel",),
        optional=True,
        why="0.5.22+: the TP group is get_parallel().tp_group (the model runner has none)",
    ),
    Need("result_cls", "module", ("GenerationBatchResult",)),
    Need("gbr_next_draft_input", "fields", ("next_draft_input",), owner="GenerationBatchResult"),
    Need("gbr_accept_lens", "fields", ("accept_lens",), owner="GenerationBatchResult"),
    Need(
        "gbr_stride",
        "fields",
        ("speculative_num_draft_tokens",),
        owner="GenerationBatchResult",
        optional=True,
        why="absent: the scheduler reads the worker's stride, so pad to it",
    ),
    Need(
        "gbr_new_seq_lens",
        "fields",
        ("new_seq_lens",),
        owner="GenerationBatchResult",
        optional=True,
    ),
    Need(
        "gbr_allocate_lens",
        "fields",
        ("allocate_lens",),
        owner="GenerationBatchResult",
        optional=True,
    ),
    Need(
        "gbr_keep_alive",
        "fields",
        ("extra_keep_alive_refs",),
        owner="GenerationBatchResult",
        optional=True,
    ),
    Need("di_new_seq_lens", "fields", ("new_seq_lens",), owner="EagleDraftInput", optional=True),
    Need("di_verify_done", "fields", ("verify_done",), owner="EagleDraftInput", optional=True),
    Need("di_allocate_lens", "fields", ("allocate_lens",), owner="EagleDraftInput", optional=True),
    Need("logprob_method", "worker", ("_compute_spec_v2_logprobs",), optional=True),
    Need(
        "logprob_fn",
        "verify_module",
        ("compute_spec_v2_logprobs", "compute_spec_logprobs"),
        optional=True,
        why="compute_spec_logprobs (0.5.19+) takes accept_index as a keyword and no steps",
    ),
    Need("target_worker", "worker", ("target_worker",)),
    Need("draft_worker", "worker", ("draft_worker",)),
    Need("num_draft_tokens", "worker", ("speculative_num_draft_tokens",)),
    Need("num_steps", "worker", ("speculative_num_steps",)),
    Need("req_to_token_pool", "worker", ("req_to_token_pool",)),
    Need("server_args", "worker", ("server_args",)),
    Need("draft_extend_for_decode", "draft_worker", ("_draft_extend_for_decode",)),
    Need(
        "draft_extend_kv_plan",
        "draft_param",
        ("kv_loc_plan",),
        owner="_draft_extend_for_decode",
        optional=True,
        why="0.5.22+: left at None (a plain KV pool needs no id translation)",
    ),
    Need("draft_runner", "draft_worker", ("draft_runner",)),
    # The draft TP context: draft_worker.draft_tp_context(tp_group[, owns_attention=...])
    # (<= 0.5.21), then the module function draft_tp_context(owns_attention) (0.5.22) or
    # draft_tp_context(layout) (0.5.23); its parameters say which.
    Need("draft_tp_context", "draft_worker", ("draft_tp_context",), optional=True),
    Need("draft_tp_fn", "module", ("draft_tp_context",), optional=True),
    Need(
        "draft_tp_layout",
        "fn_param",
        ("layout",),
        owner="draft_tp_context",
        optional=True,
        when=("draft_tp_fn", "draft_tp_context"),
    ),
    Need(
        "draft_tp_owns",
        "fn_param",
        ("owns_attention",),
        owner="draft_tp_context",
        optional=True,
        when=("draft_tp_fn", "draft_tp_context"),
    ),
    Need(
        "draft_tp_group",
        "fn_param",
        ("tp_group",),
        owner="draft_tp_context",
        optional=True,
        when=("draft_tp_fn", "draft_tp_context"),
    ),
    Need(
        "draft_parallel_layout",
        "draft_worker",
        ("parallel_layout",),
        when=("draft_tp_layout", "layout"),
    ),
    Need(
        "draft_owns_attention",
        "draft_worker",
        ("draft_owns_attention",),
        when=("draft_tp_owns", "owns_attention"),
    ),
    # The width-1 draft-extend of fallback steps; any of these missing: the N-token one.
    Need(
        "draft_extend_graph_cls",
        "module",
        ("EAGLEDraftExtendCudaGraphRunner",),
        optional=True,
        why="captures the width-1 draft-extend graphs",
    ),
    Need("draft_backend_factory", "module", ("DraftBackendFactory",), optional=True),
    Need(
        "draft_extend_graph_attr",
        "draft_worker",
        ("cuda_graph_runner_for_draft_extend",),
        optional=True,
    ),
    Need(
        "draft_extend_backend_attr", "draft_worker", ("draft_extend_attn_backend",), optional=True
    ),
)

NEEDS_BY_VARIANT: dict[str, tuple[Need, ...]] = {"v1": V1_NEEDS, "v2": V2_NEEDS}


def resolve_needs(
    needs: tuple[Need, ...], has: Callable[[Need, str], bool]
) -> tuple[dict[str, str | None], list[Need]]:
    """Resolve each need to its first present candidate; return (names, missing needs).

    ``has(need, candidate)`` answers whether a name exists: the adapter asks live objects, the
    static probe asks the release's source. Both share this function, so they cannot drift.
    """
    names: dict[str, str | None] = {}
    missing: list[Need] = []
    for need in needs:
        if need.when is not None and names.get(need.when[0]) != need.when[1]:
            continue
        found = next((c for c in need.candidates if has(need, c)), None)
        names[need.key] = found
        if found is None and not need.optional:
            missing.append(need)
    return names, missing


def tuple_return_arity(source: str) -> int | None:
    """Length of the tuples a (dedented) method mostly returns; None when absent or a tie.

    The 0.4.x entry returns a tuple whose length changed between releases (4, then 5 with
    ``can_run_cuda_graph``); the fallback must return the same shape the scheduler unpacks.
    The majority decides because 0.4.4.post2 – 0.4.6.post3 return a 5-tuple from their
    DP-only idle branch alone, while decode and extend return the 4 the scheduler unpacks.
    """
    tree = ast.parse(textwrap.dedent(source))
    counts = collections.Counter(
        len(node.value.elts)
        for node in ast.walk(tree)
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple)
    ).most_common(2)
    if not counts or (len(counts) == 2 and counts[0][1] == counts[1][1]):
        return None
    return counts[0][0]


# --------------------------------------------------------------------------------------------
# Per-process adapter
# --------------------------------------------------------------------------------------------


class Unsupported(Exception):
    """The live SGLang lacks a name the fallback needs, or runs a refused configuration."""


@dataclass
class Adapter:
    """Everything resolved once per process for one worker class."""

    variant: str
    names: dict[str, str | None]
    module_globals: dict[str, Any]
    controller: DynSpecController | AutoController
    # The 0.4.x entry returns a tuple of this length; None: a GenerationBatchResult.
    tuple_arity: int | None = None
    # Whether grammar batches can take the fallback (the release can mask the one-node tree).
    grammar: bool = False
    # The target's DECODE graphs (None: fallback target forwards run eagerly), and why.
    decode_graphs: DecodeGraphs | None = None
    decode_graphs_note: str = ""
    profiler: StepProfiler | _NoProfiler | None = None
    # v2: how the draft TP context is entered (see v2_draft_tp_mode).
    draft_tp: str | None = None
    # Globals of the module holding the verify body, and the needs resolved there.
    verify_globals: dict[str, Any] = dataclasses.field(default_factory=dict)
    verify_keys: frozenset[str] = frozenset()
    # v2: the width-1 draft-extend graphs (None: fallback steps run the N-token one), and why.
    draft_extend_width1: Width1DraftExtend | None = None
    draft_extend_width1_note: str = ""
    # v2: the draft KV write of fallback steps (None: SGLang's draft-extend), and why.
    draft_kv_write: DraftKvWrite | None = None
    draft_kv_write_note: str = ""
    # A prefill in fallback stores the draft's K and V only (None: SGLang's draft pass).
    draft_prefill_write: DraftPrefillWrite | None = None
    draft_prefill_write_note: str = ""
    # v2: such a prefill skips SGLang's draft pass (None: the write runs inside it).
    draft_prefill_direct: DraftPrefillDirect | None = None
    draft_prefill_direct_note: str = ""
    # v1: write-only fallback steps of greedy batches do verify()'s bookkeeping themselves
    # (``one_token_verify``), and why or why not.
    one_token_verify: bool = False
    one_token_verify_note: str = ""
    # v2: greedy fallback steps sample by one argmax (None: SGLang's sampler), and why.
    greedy_argmax: GreedyArgmax | None = None
    greedy_argmax_note: str = ""
    # v2: the last decode step handed on a stale draft state (a draft KV write step): the next
    # speculative step must wait for a fallback step that runs SGLang's draft-extend.
    draft_state_stale: bool = False
    # Set while the worker's own entry runs inside the hook (auto's speculative step, a
    # prefill with ``draft_prefill_write``): the re-entered hook answers None.
    reentered: bool = False

    def tp_group(self, worker: Any) -> Any:
        """This server's TP group (``tp_group_of``)."""
        return tp_group_of(worker, self.names, self.module_globals)

    def cls(self, key: str) -> Any:
        """The worker-module (or, for a ``verify_module`` need, verify-module) global."""
        name = self.names[key]
        return (self.verify_globals if key in self.verify_keys else self.module_globals)[name]

    def name(self, key: str) -> str:
        """The concrete spelling of a required need."""
        value = self.names[key]
        assert value is not None, key
        return value


_OFF = object()  # sentinel: the feature is off for this worker class for the process life
_adapters: dict[type, Any] = {}


def _dataclass_field_names(obj: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()


# The worker-module global whose module holds the verify body (0.5.16+: eagle_worker_common).
VERIFY_HELPER = "run_eagle_verify"


def verify_module_globals(module_globals: dict[str, Any]) -> dict[str, Any]:
    """Globals of the module holding the release's verify body (the ``verify_module`` scope)."""
    helper = module_globals.get(VERIFY_HELPER)
    module = sys.modules.get(getattr(helper, "__module__", "")) if helper is not None else None
    return vars(module) if module is not None else module_globals


def _has_param(fn: Any, name: str) -> bool:
    try:
        return fn is not None and name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _live_has(worker: Any, module_globals: dict[str, Any]) -> Callable[[Need, str], bool]:
    """``has`` for resolve_needs, answered from the live worker and its module."""
    verify_globals = verify_module_globals(module_globals)

    def owner_obj(owner: str) -> Any:
        return module_globals.get(owner)

    def has(need: Need, name: str) -> bool:
        scope = need.scope
        if scope == "module":
            return name in module_globals
        if scope == "verify_module":
            return name in verify_globals
        if scope == "fn_param":
            fn = verify_globals.get(need.owner) or module_globals.get(need.owner)
            return _has_param(fn, name)
        if scope == "draft_param":
            draft = getattr(worker, "draft_worker", None)
            return _has_param(getattr(draft, need.owner, None), name)
        if scope == "worker":
            return hasattr(type(worker), name) or hasattr(worker, name)
        if scope == "draft_worker":
            draft = getattr(worker, "draft_worker", None)
            return draft is not None and hasattr(draft, name)
        if scope == "fields":
            return name in _dataclass_field_names(owner_obj(need.owner))
        if scope == "member":
            obj = owner_obj(need.owner)
            return obj is not None and hasattr(obj, name)
        if scope == "param":
            cls_name, method = need.owner.split(".")
            return _has_param(getattr(owner_obj(cls_name), method, None), name)
        if scope == "target_param":
            return _has_param(worker.target_worker.forward_batch_generation, name)
        if scope == "runner_attr":
            return hasattr(worker.target_worker.model_runner, name)
        if scope == "batch_member":
            batch_cls = module_globals.get("ScheduleBatch")
            return batch_cls is not None and hasattr(batch_cls, name)
        raise ValueError(f"unknown scope {scope!r}")

    return has


def refusal_reason(worker: Any, variant: str) -> str | None:
    """Why this server configuration must not use the fallback, or None."""
    args = worker.server_args
    algorithm = str(getattr(args, "speculative_algorithm", "") or "").upper()
    if algorithm not in SUPPORTED_ALGORITHMS:
        return f"speculative algorithm {algorithm or 'NONE'} (only EAGLE/EAGLE3)"
    expected = V1_WORKER_CLASS if variant == "v1" else V2_WORKER_CLASS
    if type(worker).__name__ != expected:
        return f"worker class {type(worker).__name__} (only {expected})"
    for flag, label in (
        ("enable_dp_attention", "DP attention"),
        # 0.4.x, DeepEP MoE without DP attention: the scheduler's all-gather counts
        # batch size * speculative_num_draft_tokens (verify tokens), so a one-token decode
        # forward would be sized wrongly, and so would the decision
        ("enable_sp_layernorm", "DeepEP MoE on 0.4.x (enable_sp_layernorm)"),
        ("enable_multi_layer_eagle", "multi-layer EAGLE"),
        ("enable_two_batch_overlap", "two-batch overlap"),
        ("enable_pdmux", "pdmux"),
    ):
        if getattr(args, flag, False):
            return label
    if int(getattr(args, "pp_size", 1) or 1) > 1:
        return "pipeline parallelism"
    runner = worker.target_worker.model_runner
    for attr in ("hybrid_gdn_config", "mamba2_config", "hybrid_lightning_config"):
        if getattr(runner, attr, None) is not None:
            return "hybrid Mamba/GDN/Lightning target"
    if variant == "v2":
        return _v2_refusal(worker, args, runner)
    return None


def _v2_refusal(worker: Any, args: Any, runner: Any) -> str | None:
    # The worker's own topk is the resolved one (0.5.19+ server_args hold the raw input).
    topk = getattr(worker, "topk", None)
    if not isinstance(topk, int) or isinstance(topk, bool):
        topk = int(getattr(args, "speculative_eagle_topk", 1) or 1)
    if topk != 1:
        return "topk > 1 with the v2 worker"
    if getattr(worker, "adaptive_controller", None) is not None:
        # Two controllers would fight: SGLang's adaptive swaps the target's graph runner,
        # attention backend and draft width per batch size, and the 0.5.12+ scheduler feeds
        # every v2 result into its EMA. SGLang's adaptive keeps the server.
        return (
            "SGLang's own adaptive speculation (--speculative-adaptive) runs on this server; "
            "relaunch without --speculative-adaptive to use the threshold"
        )
    if getattr(args, "enable_return_routed_experts", False):
        return "returning routed experts (the fallback's result does not carry them)"
    if getattr(runner, "watermark_state", None) is not None:
        return "watermarking (the fallback's sampling does not apply it)"
    return None


def _tp_rank(worker: Any) -> int:
    """The worker's TP rank (0 where it has none: a server without tensor parallelism)."""
    return int(getattr(worker, "tp_rank", 0) or 0)


def _rank0_logger(worker: Any, level: int = logging.INFO) -> Callable[[str], None]:
    is_rank0 = _tp_rank(worker) == 0

    def log(message: str) -> None:
        if is_rank0:
            logger.log(level, message)

    return log


def _warn_rank0(worker: Any, message: str) -> None:
    _rank0_logger(worker, logging.WARNING)(
        f"[dynspec] speculation-disable fallback is OFF: {message}"
    )


# With speculation on, SGLang caps running requests at 32 or 48 unless told otherwise.
SPEC_DEFAULT_MAX_RUNNING = 32


def _warn_if_never_triggers(worker: Any, threshold: int) -> None:
    max_running = getattr(worker.server_args, "max_running_requests", None)
    if max_running is not None and int(max_running) <= threshold:
        _rank0_logger(worker, logging.WARNING)(
            f"[dynspec] max_running_requests={max_running} <= threshold={threshold}: the "
            "fallback can never trigger"
        )
    elif max_running is None and threshold >= SPEC_DEFAULT_MAX_RUNNING:
        _rank0_logger(worker, logging.WARNING)(
            f"[dynspec] threshold={threshold} but --max-running-requests is unset: speculative "
            "servers default to 32 or 48 running requests, so the fallback may never trigger"
        )


def _build_adapter(worker: Any, variant: str, threshold: int | str) -> Adapter:
    module = sys.modules.get(type(worker).__module__)
    if module is None:
        raise Unsupported(f"module {type(worker).__module__} is not loaded")
    module_globals = vars(module)
    reason = refusal_reason(worker, variant)
    if reason is not None:
        raise Unsupported(f"refused: {reason}")
    names, missing = resolve_needs(NEEDS_BY_VARIANT[variant], _live_has(worker, module_globals))
    if missing:
        listed = ", ".join(
            f"{n.scope}:{n.owner + '.' if n.owner else ''}{n.candidates[0]}" for n in missing
        )
        raise Unsupported(f"this SGLang lacks {listed}")
    _check_verify_input_fields(module_globals[names["verify_input_cls"]], names)
    needs = NEEDS_BY_VARIANT[variant]
    adapter = Adapter(
        variant=variant,
        names=names,
        module_globals=module_globals,
        verify_globals=verify_module_globals(module_globals),
        verify_keys=frozenset(n.key for n in needs if n.scope == "verify_module"),
        controller=_make_controller(worker, names, module_globals, threshold),
    )
    if variant == "v1":
        adapter.grammar = names["verify_vocab_mask"] is not None and names["bitmask_fn"] is not None
        _resolve_v1_contract(worker, adapter)
    else:
        _resolve_v2_contract(worker, adapter)
    if threshold != AUTO:
        _warn_if_never_triggers(worker, int(threshold))
    return adapter


def _make_controller(
    worker: Any, names: dict[str, str | None], module_globals: dict[str, Any], threshold: int | str
) -> DynSpecController | AutoController:
    args = worker.server_args
    min_dwell = (
        getattr(args, "speculative_disable_min_dwell_steps", None) or DEFAULT_MIN_DWELL_STEPS
    )
    resume_below = getattr(args, "speculative_disable_resume_below", None)
    if threshold != AUTO:
        return DynSpecController(
            int(threshold),
            resume_below=resume_below,
            min_dwell_steps=min_dwell,
            log=_rank0_logger(worker),
        )
    if resume_below is not None:
        raise ValueError(
            "--speculative-disable-resume-below applies to a fixed threshold, not auto"
        )
    runner = worker.target_worker.model_runner
    verify_graphs = getattr(runner, names["graph_attr"], None)  # the sizes decode batches pad to
    graph_sizes = [int(b) for b in getattr(verify_graphs, "capture_bs", None) or []]
    tp_group = tp_group_of(worker, names, module_globals)
    share = None
    if int(getattr(tp_group, "world_size", 1) or 1) > 1:
        cpu_group = getattr(tp_group, "cpu_group", None)
        if cpu_group is None:
            raise Unsupported("auto needs the TP group's CPU group to share rank 0's costs")
        share = broadcast_from_first_rank(cpu_group)
    source = _tp_rank(worker) == 0
    num_steps = getattr(args, "speculative_num_steps", None)
    config = AutoConfig(
        confirm_steps=int(min_dwell),
        max_tokens_per_step=float(num_steps) + 1.0 if num_steps else None,
    )
    overrides = auto_config_overrides(_rank0_logger(worker, logging.WARNING))
    if overrides:
        config = dataclasses.replace(config, **overrides)
    policy = GoodputPolicy(config, graph_sizes, log=_rank0_logger(worker))
    controller = AutoController(
        policy,
        source=source,
        share=share,
        clock=step_clock(getattr(runner, "device", "cpu")),
        metrics=AutoMetrics.create(args) if source else None,
    )
    _rank0_logger(worker)(
        f"[dynspec] auto: each decode step speculates or runs a plain step by expected tok/s "
        f"at its padded batch size (graph sizes {graph_sizes or 'none'}); no start-up cost "
        f"measurement: speculation first, step costs measured online "
        f"({type(controller.measurements.clock).__name__}) on TP rank 0 and shared "
        f"every {config.sync_every} steps; switch after {config.confirm_steps} consecutive "
        f"wins by > {config.margin:.0%}; metrics {'on' if controller.metrics else 'off'}"
        + (f"; {AUTO_CONFIG_ENV}: {overrides}" if overrides else "")
    )
    return controller


def _check_verify_input_fields(verify_input_cls: Any, names: dict[str, str | None]) -> None:
    """Fail closed when EagleVerifyInput gained a required field the fallback does not fill."""
    filled = {names[k] for k in names if k.startswith("vi_") and names[k] is not None}
    for f in dataclasses.fields(verify_input_cls):
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and f.init and f.name not in filled:
            raise Unsupported(f"EagleVerifyInput has an unknown required field {f.name!r}")


def _resolve_v1_contract(worker: Any, adapter: Adapter) -> None:
    names = adapter.names
    if names["logprob_fn"] is None and names["logprob_method"] is None:
        raise Unsupported("no spec-v1 logprob helper (add_output_logprobs_for_spec_v1)")
    if names["entry"] == "forward_batch_speculative_generation":
        try:
            source = inspect.getsource(getattr(type(worker), names["entry"]))
        except (OSError, TypeError) as exc:
            raise Unsupported(f"cannot read the entry method source: {exc}") from exc
        arity = tuple_return_arity(source)
        if arity not in (4, 5):
            raise Unsupported("the entry method returns tuples of differing lengths")
        adapter.tuple_arity = arity


def _resolve_v2_contract(worker: Any, adapter: Adapter) -> None:
    names = adapter.names
    # Where new_seq_lens travels: on the result (0.5.13+) or on the next draft input.
    if names["gbr_new_seq_lens"] is None and names["di_new_seq_lens"] is None:
        raise Unsupported("neither GenerationBatchResult nor EagleDraftInput has new_seq_lens")
    if names["gbr_allocate_lens"] is not None and names["di_allocate_lens"] is None:
        raise Unsupported("allocate_lens on the result but not on EagleDraftInput")
    if names["vi_sample"] is None and names["sample_fn"] is None:
        raise Unsupported("neither EagleVerifyInput.sample nor eagle_sample")
    adapter.draft_tp = v2_draft_tp_mode(names)
    if adapter.draft_tp is None:
        raise Unsupported("no draft TP context this runtime knows how to enter")
    adapter.grammar = v2_grammar_mode(names) is not None
    runner = worker.target_worker.model_runner
    if names["draft_extend_kv_plan"] is not None and getattr(runner, "is_hybrid_swa", False):
        raise Unsupported("refused: a hybrid SWA KV pool translates KV ids (0.5.22+)")


def v2_draft_tp_mode(names: dict[str, str | None]) -> str | None:
    """How to enter the draft TP context: the draft worker's method, or the module function."""
    if names.get("draft_tp_layout") is not None:
        return "fn(layout)"
    if names.get("draft_tp_owns") is not None and names.get("draft_tp_group") is None:
        return "fn(owns_attention)"
    if names.get("draft_tp_context") is None:
        return None
    if names.get("draft_tp_owns") is not None:
        return "method(tp_group, owns_attention)"
    return "method(tp_group)"


def v2_grammar_mode(names: dict[str, str | None]) -> str | None:
    """Which grammar mask the v2 fallback can build and hand to sampling (None: speculate)."""
    mask_param = names.get("sample_vocab_mask") or names.get("sample_fn_mask")
    if mask_param == "grammar_mask" and names.get("grammar_mask_fn") is not None:
        return "grammar_mask"
    if mask_param == "vocab_mask" and names.get("bitmask_takes_vi") is not None:
        return "bitmask"
    return None


def _adapter_for(worker: Any, variant: str) -> Adapter | None:
    """The process-wide adapter for this worker class, or None when the feature is off."""
    cached = _adapters.get(type(worker))
    if cached is not None:
        return None if cached is _OFF else cached
    threshold = getattr(getattr(worker, "server_args", None), THRESHOLD_ARG, None)
    if threshold is None:
        _adapters[type(worker)] = _OFF
        return None
    try:
        adapter = _build_adapter(worker, variant, parse_threshold(threshold))
    except (Unsupported, ValueError) as exc:  # ValueError: bad threshold / hysteresis args
        _warn_rank0(worker, str(exc))
        _adapters[type(worker)] = _OFF
        return None
    controller = adapter.controller
    describe = controller.policy.describe if isinstance(controller, AutoController) else None
    adapter.profiler = _make_profiler(worker, describe)
    _prepare_decode_graphs(adapter, worker, worker.target_worker)
    if variant == "v2":
        _prepare_draft_extend_width1(adapter, worker)
    _prepare_draft_kv_write(adapter, worker)
    _prepare_draft_prefill_write(adapter, worker)
    _prepare_draft_prefill_direct(adapter, worker)
    if variant == "v1":
        _prepare_one_token_verify(adapter, worker)
    else:
        _prepare_greedy_argmax(adapter, worker)
    _warm_up_graphs(adapter, worker)
    _adapters[type(worker)] = adapter
    return adapter


def reset_for_tests() -> None:
    """Forget every resolved adapter (tests only: production resolves once per process)."""
    _adapters.clear()


# --------------------------------------------------------------------------------------------
# Target DECODE graphs: a fallback step's target forward at plain-decoding speed
# --------------------------------------------------------------------------------------------

# "0" turns the DECODE graphs off: fallback target forwards then run eagerly (diagnostics).
DECODE_GRAPHS_ENV = "DYNSPEC_DECODE_GRAPHS"
# Tests only: TP ranks (e.g. "1" or "0,2") whose DECODE graphs, once captured, are discarded
# as a failed capture, so a multi-GPU test can check that every rank then runs eagerly. The
# capture itself still runs on every rank: SGLang's graph capture runs collectives (custom
# all-reduce registers its buffers at the end), and a rank skipping it would hang the others.
DECODE_GRAPHS_FAIL_RANKS_ENV = "DYNSPEC_DECODE_GRAPHS_FAIL_ON_RANKS"


@dataclass
class DecodeGraphs:
    """The target's DECODE CUDA graphs and the attention backend they were captured on."""

    runner: Any
    attn_backend: Any
    batch_sizes: list[int]


@contextlib.contextmanager
def _attributes_set(obj: Any, values: dict[str, Any]) -> Iterator[None]:
    """Set attributes of ``obj`` for the block, restoring the previous values afterwards."""
    saved = {name: getattr(obj, name) for name in values}
    try:
        for name, value in values.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def _new_attention_backend(model_runner: Any) -> Any:
    """A second attention backend of the target's kind, with buffers of its own.

    ``init_cuda_graph_state`` of a backend reallocates the buffers its captured graphs read,
    so the DECODE graphs must not share the backend of the TARGET_VERIFY graphs.
    """
    restore = {}
    if hasattr(model_runner, "init_new_workspace"):
        restore["init_new_workspace"] = model_runner.init_new_workspace
    with _attributes_set(model_runner, restore):
        factory = getattr(model_runner, "_get_attention_backend", None)
        if factory is not None:
            if "init_new_workspace" in inspect.signature(factory).parameters:
                return factory(init_new_workspace=True)
            return factory()
        # 0.4.x: init_attention_backend() builds one and stores it on the runner.
        with _attributes_set(model_runner, {"attn_backend": model_runner.attn_backend}):
            model_runner.init_attention_backend()
            return model_runner.attn_backend


def _settable(obj: Any, name: str) -> bool:
    """Whether ``obj.name`` may be assigned (0.5.19+ seal ServerArgs after resolution)."""
    try:
        setattr(obj, name, getattr(obj, name))
    except (AttributeError, TypeError):
        return False
    return True


# The provenance SGLang records for our changes of sealed ServerArgs (0.5.17+).
ARGS_OVERRIDE_SOURCE = "dynspec-patch.graph-capture"


def _can_set_args(args: Any, names: Any) -> bool:
    """Whether these ServerArgs fields can be set: plainly, or through ``override``."""
    return all(_settable(args, n) for n in names) or callable(getattr(args, "override", None))


@contextlib.contextmanager
def _server_args_set(args: Any, values: dict[str, Any]) -> Iterator[None]:
    """Set ServerArgs fields for the block and restore them afterwards.

    Plain assignment where SGLang allows it; 0.5.17+ seal the resolved args (a bare
    assignment raises), and ``ServerArgs.override(source, **fields)`` is their one mutation
    point, so both the change and the restore go through it there.
    """
    if all(_settable(args, name) for name in values):
        with _attributes_set(args, values):
            yield
        return
    saved = {name: getattr(args, name) for name in values}
    args.override(ARGS_OVERRIDE_SOURCE, **values)
    try:
        yield
    finally:
        args.override(ARGS_OVERRIDE_SOURCE + ".restore", **saved)


def _hidden_capture_values(has_mode: bool) -> dict[str, Any]:
    """FULL hidden-state capture; 0.5.17+ also has a mode, whose "last" would capture LAST."""
    values: dict[str, Any] = {"enable_return_hidden_states": True}
    if has_mode:
        values["return_hidden_states_mode"] = "full"
    return values


def _graph_size_holders(args: Any, graph_bag: Any) -> list[tuple[Any, str]]:
    """Where the decode graph batch sizes are read at capture: (object, attribute), distinct.

    ``server_args.cuda_graph_bs`` (<= 0.5.13), ``server_args.cuda_graph_config.decode.bs``
    (0.5.14 - 0.5.18) and ``get_exec().graph.cuda_graph_config.decode.bs`` (0.5.19+).
    """
    holders: list[tuple[Any, str]] = []
    if isinstance(getattr(args, "cuda_graph_bs", None), list) and _settable(args, "cuda_graph_bs"):
        holders.append((args, "cuda_graph_bs"))
    for config in (args, graph_bag):
        config = getattr(config, "cuda_graph_config", None)
        decode = getattr(config, "decode", None)
        known = any(decode is holder for holder, _ in holders)
        if isinstance(getattr(decode, "bs", None), list) and not known and _settable(decode, "bs"):
            holders.append((decode, "bs"))
    return holders


def _cut_graph_sizes(
    stack: contextlib.ExitStack, args: Any, graph_bag: Any, min_batch_size: int
) -> None:
    """For the block of ``stack``: graph batch sizes cut to those >= ``min_batch_size`` (the
    sizes a fallback step can have; smaller batches pad up to the first), wherever this
    release reads them; the largest alone when none is that large."""
    for holder, attr in _graph_size_holders(args, graph_bag):
        sizes = getattr(holder, attr)
        above = sorted({b for b in sizes if b >= min_batch_size}) or [max(sizes)]
        stack.enter_context(_attributes_set(holder, {attr: above}))


def capture_decode_graphs(
    model_runner: Any, graph_attr: str, min_batch_size: int, exec_config: Any = None
) -> tuple[DecodeGraphs | None, str]:
    """Capture DECODE graphs (FULL hidden capture) for the target; (None, why) if not possible.

    SGLang's own graph runner class is constructed while the runner looks non-speculative, on a
    new attention backend, with hidden-state capture on so the graphs return the hidden states
    the draft-extend needs (no recapture at the first fallback step), and only for the
    CUDA-graph batch sizes >= ``min_batch_size`` (smaller batches pad up to the first).
    ``exec_config`` is 0.5.19+'s ``get_exec()``, where those settings are read from.
    """
    verify_graphs = getattr(model_runner, graph_attr, None)
    if verify_graphs is None:
        return None, "CUDA graphs are off on this server"
    args = model_runner.server_args
    features = getattr(exec_config, "features", None)
    on_args = hasattr(args, "enable_return_hidden_states") and _can_set_args(
        args, ("enable_return_hidden_states",)
    )
    on_bag = features is not None and "enable_return_hidden_states" in features
    if not (on_args or on_bag):
        return None, "this SGLang cannot capture hidden states in graphs"
    non_speculative = getattr(type(model_runner.spec_algorithm), "NONE", None)
    if non_speculative is None:
        return None, "SpeculativeAlgorithm has no NONE"
    backend = _new_attention_backend(model_runner)
    runner_values = {"spec_algorithm": non_speculative, "attn_backend": backend}
    with contextlib.ExitStack() as stack:
        if on_args:
            has_mode = hasattr(args, "return_hidden_states_mode")
            stack.enter_context(_server_args_set(args, _hidden_capture_values(has_mode)))
        if on_bag:
            has_mode = "return_hidden_states_mode" in features
            stack.enter_context(features.override(**_hidden_capture_values(has_mode)))
        _cut_graph_sizes(stack, args, getattr(exec_config, "graph", None), min_batch_size)
        stack.enter_context(_attributes_set(model_runner, runner_values))
        runner = type(verify_graphs)(model_runner)
    mode = getattr(runner, "capture_hidden_mode", None)
    if mode is not None and getattr(mode, "name", "FULL") != "FULL":
        return None, f"the graphs were captured with hidden states {mode.name}, not FULL"
    captured = sorted(int(b) for b in getattr(runner, "capture_bs", []))
    return DecodeGraphs(runner=runner, attn_backend=backend, batch_sizes=captured), ""


def _prepare_decode_graphs(adapter: Adapter, worker: Any, target_worker: Any) -> None:
    """Capture the target DECODE graphs once per process; failures leave eager forwards."""
    if os.environ.get(DECODE_GRAPHS_ENV, "1").strip() == "0":
        adapter.decode_graphs_note = f"off ({DECODE_GRAPHS_ENV}=0): eager target forwards"
        return
    log = _rank0_logger(worker)
    started = time.perf_counter()
    try:
        exec_config = adapter.cls("exec_config")() if adapter.names.get("exec_config") else None
        graphs, why = capture_decode_graphs(
            target_worker.model_runner,
            adapter.name("graph_attr"),
            adapter.controller.min_fallback_batch_size,
            exec_config=exec_config,
        )
    except Exception as exc:  # capture failed: stay correct, run the target eagerly
        graphs, why = None, f"capture failed: {type(exc).__name__}: {exc}"
    rank = _tp_rank(worker)
    if graphs is not None and rank in _ranks_in(os.environ.get(DECODE_GRAPHS_FAIL_RANKS_ENV)):
        graphs, why = None, f"capture failed: {DECODE_GRAPHS_FAIL_RANKS_ENV} names TP rank {rank}"
    # Every rank replays, or none: the ranks' all-reduces must run the same way at every step
    # (a graph's custom all-reduce reads the buffers every rank registered at its capture).
    if not _all_ranks_agree(adapter.tp_group(worker), graphs is not None) and graphs:
        graphs, why = None, "another TP rank could not capture them"
    if graphs is None:
        adapter.decode_graphs_note = f"eager target forwards ({why})"
        _rank0_logger(worker, logging.WARNING)(
            f"[dynspec] fallback target DECODE graphs not used: {why}"
        )
        return
    adapter.decode_graphs = graphs
    adapter.decode_graphs_note = f"DECODE graphs for bs {graphs.batch_sizes}"
    log(
        f"[dynspec] captured target DECODE graphs for bs {graphs.batch_sizes} in "
        f"{time.perf_counter() - started:.1f}s"
    )


def _ranks_in(text: str | None) -> set[int]:
    """The TP ranks a comma-separated list names; anything that is not a rank is ignored."""
    return {int(part) for part in (text or "").split(",") if part.strip().isdigit()}


@contextlib.contextmanager
def target_decode_mode(model_runner: Any, graph_attr: str, graphs: DecodeGraphs | None):
    """Route the target's next forward to the DECODE graphs, or run it eagerly without any.

    The captured graph under ``graph_attr`` is TARGET_VERIFY, which a DECODE batch must never
    replay; the attention backend is swapped too, since forward batches and graph replays
    read ``model_runner.attn_backend``.
    """
    if graphs is None:
        values = {graph_attr: None}
    else:
        values = {graph_attr: graphs.runner, "attn_backend": graphs.attn_backend}
    with _attributes_set(model_runner, values):
        yield


# --------------------------------------------------------------------------------------------
# v2: the draft-extend of a fallback step at one token per request (width-1 graphs)
# --------------------------------------------------------------------------------------------

# "1" / "0" turn the width-1 draft-extend on / off; unset: on where it has run on a GPU
# (``lever_on``), otherwise the N-token draft-extend, as before.
DRAFT_EXTEND_WIDTH1_ENV = "DYNSPEC_DRAFT_EXTEND_WIDTH1"
# What the draft worker (and, while capturing, the server args) say for one token per request:
# the values of SGLang's own steps-0 state (0.5.14+ ``build_adaptive_runtime_state``).
WIDTH1_STATE: dict[str, int] = {"speculative_num_steps": 0, "speculative_num_draft_tokens": 1}
# Attention-backend attributes that size the draft-extend metadata, and their width-1 values.
_BACKEND_WIDTH1 = {"speculative_num_steps": 0, "num_draft_tokens": 1}


@dataclass
class Width1DraftExtend:
    """SGLang's draft-extend CUDA graphs captured at one token per request."""

    runner: Any
    attn_backend: Any
    batch_sizes: list[int]
    # False under --disable-cuda-graph-padding: only the captured sizes replay.
    pads_to_graph: bool = True
    # Why a real step's width-1 call raised; set: the N-token draft-extend from then on.
    broken: str = ""

    def covers(self, batch_size: int) -> bool:
        """Whether a batch of this size replays a width-1 graph (never SGLang's eager path)."""
        if self.broken or not self.batch_sizes:
            return False
        if self.pads_to_graph:
            return batch_size <= self.batch_sizes[-1]
        return batch_size in self.batch_sizes


def _server_args_objects(draft: Any) -> list[Any]:
    """The server args of the draft worker and of its model runner, each object once."""
    found: list[Any] = []
    for args in (
        getattr(draft, "server_args", None),
        getattr(draft.draft_runner, "server_args", None),
    ):
        if args is not None and all(args is not seen for seen in found):
            found.append(args)
    return found


def _captured_width(runner: Any) -> Any:
    """Tokens per request a draft-extend graph runner captured (0.5.14+ names it first)."""
    for name in ("captured_req_width", "num_tokens_per_bs"):
        if hasattr(runner, name):
            return getattr(runner, name)
    return None


def _new_draft_extend_runner(graph_cls: Any, draft: Any, backend: Any) -> Any:
    """SGLang's draft-extend graph runner for ``draft`` on ``backend`` (this captures)."""
    params = inspect.signature(graph_cls).parameters
    kwargs: dict[str, Any] = {}
    if "draft_extend_attn_backend" in params:  # 0.5.12+; older runners read the worker's
        kwargs["draft_extend_attn_backend"] = backend
    if "speculative_num_steps" in params:
        kwargs["speculative_num_steps"] = WIDTH1_STATE["speculative_num_steps"]
    return graph_cls(draft, **kwargs)


def capture_draft_extend_width1(
    draft: Any,
    graph_cls: Any,
    factory_cls: Any,
    min_batch_size: int,
    spec_config: Any = None,
    graph_bag: Any = None,
) -> tuple[Width1DraftExtend | None, str]:
    """Capture draft-extend graphs at one token per request; (None, why) if not possible.

    SGLang's own graph runner class and attention-backend factory are called while the draft
    worker, the server args and (0.5.17+) the ``get_spec()`` config bag ``spec_config`` say
    ``WIDTH1_STATE`` (as SGLang 0.5.14+ builds its steps-0 state under
    ``_override_worker_state``), on a second draft-extend attention backend, so the N-token
    graphs and their buffers stay untouched; only for the graph batch sizes >=
    ``min_batch_size`` (``graph_bag``: 0.5.19+'s ``get_exec().graph``, where they are read).
    The new backend's widths are checked before anything is captured on it: a backend sized
    for N tokens under a width-1 graph writes past its buffers (an illegal memory access on
    0.5.17, whose triton backend reads its widths from ``get_spec()``). Every attribute is
    restored afterwards, also when capture raises. Called only where SGLang captured its own
    (N-token) draft-extend graphs.
    """
    args_objects = _server_args_objects(draft)
    with contextlib.ExitStack() as stack:
        for args in args_objects:
            stack.enter_context(_server_args_set(args, WIDTH1_STATE))
            _cut_graph_sizes(stack, args, graph_bag, min_batch_size)
        if spec_config is not None:
            leaves = {k: v for k, v in WIDTH1_STATE.items() if k in spec_config}
            stack.enter_context(spec_config.override(**leaves))
        stack.enter_context(_attributes_set(draft, WIDTH1_STATE))
        factory = factory_cls(
            draft.server_args, draft.draft_runner, draft.topk, WIDTH1_STATE["speculative_num_steps"]
        )
        backend = factory.create_draft_extend_backend()
        if backend is None:
            return None, "SGLang made no draft-extend attention backend"
        widths = {n: getattr(backend, n) for n in _BACKEND_WIDTH1 if hasattr(backend, n)}
        if not widths:  # nothing to check it against: fail closed
            return None, f"{type(backend).__name__} shows no draft-extend width to check"
        for name, value in widths.items():
            if value != _BACKEND_WIDTH1[name]:
                return None, f"the new attention backend has {name}={value}"
        stack.enter_context(_attributes_set(draft, {"draft_extend_attn_backend": backend}))
        runner = _new_draft_extend_runner(graph_cls, draft, backend)
    width = _captured_width(runner)
    if width != 1:
        return None, f"the graph runner captured {width} tokens per request, not 1"
    sizes = sorted(int(b) for b in getattr(runner, "capture_bs", []))
    pads = not getattr(runner, "disable_padding", False)
    return Width1DraftExtend(runner, backend, sizes, pads_to_graph=pads), ""


def _replays_draft_extend_graphs(draft: Any) -> bool:
    """Whether the draft worker's ``_draft_extend_for_decode`` reads its graph runner.

    0.5.5.post2 captures draft-extend graphs but its draft-extend never replays them: a
    width-1 graph would only cost memory there.
    """
    try:
        source = inspect.getsource(draft._draft_extend_for_decode)
    except (OSError, TypeError):
        return False
    return "cuda_graph_runner_for_draft_extend" in source


def tp_group_of(worker: Any, names: dict[str, str | None], module_globals: dict[str, Any]) -> Any:
    """The TP group every rank of this server's worker is in (None: no TP group found).

    The target model runner's ``tp_group`` (up to 0.5.21), else the release's
    ``get_parallel().tp_group`` (0.5.22+: the model runner has none). The target's group holds
    every rank that runs a fallback step, whatever TP size the draft has.
    """
    group = getattr(worker.target_worker.model_runner, "tp_group", None)
    getter = names.get("parallel_config")
    if group is None and getter:
        group = getattr(module_globals[getter](), "tp_group", None)
    return group


def _all_ranks_agree(tp_group: Any, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of ``tp_group`` (one CPU all-reduce when TP > 1).

    A rank that cannot ask the others answers False, as every rank of that server does.
    """
    if int(getattr(tp_group, "world_size", 1) or 1) <= 1:
        return ok
    cpu_group = getattr(tp_group, "cpu_group", None)
    if cpu_group is None:
        return False
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group)
    return bool(flag[0])


_WIDTH1_NEEDS = (
    "draft_extend_graph_cls",
    "draft_backend_factory",
    "draft_extend_graph_attr",
    "draft_extend_backend_attr",
)


def lever_on(env: str, proven: bool) -> bool:
    """Whether a speed lever runs: ``env`` "1" on, "0" off; unset, only where it is ``proven``.

    A lever is proven on the layout of SGLang it has run on with a GPU (greedy outputs
    checked): an illegal memory access in a CUDA graph poisons the process, which no exception
    handler can undo, so an unproven layout keeps the path that has run there.
    """
    value = os.environ.get(env, "").strip()
    if value in ("0", "1"):
        return value == "1"
    return proven


# The releases of the execute() layout (0.5.14+) where the speed levers (width-1 draft-extend,
# start-up warm-up, draft KV write) have run on an H200 with greedy outputs checked on the
# crafted models and the strict KV check on (0.5.17: 2026-12-01 and 2026-12-02, RESULTS.md).
GPU_PROVEN_RELEASES = ("0.5.17",)
# Where the draft KV write has run on an H200, v1 and v2, bit for bit at its check and with 0
# mismatched greedy tokens (strict KV check on): 0.5.12.post1 (2026-12-02) and 0.5.17.
DRAFT_KV_WRITE_RELEASES = ("0.5.12.post1", *GPU_PROVEN_RELEASES)


def sglang_release(module_globals: dict[str, Any]) -> str | None:
    """The release the worker module's package says it is (``<package>.version.__version__``,
    as ``sglang.version`` has it), or None where that cannot be read."""
    package = str(module_globals["__name__"]).partition(".")[0]
    try:
        return str(importlib.import_module(f"{package}.version").__version__)
    except Exception:  # no such module or attribute: an unknown release proves nothing
        return None


def on_gpu_proven_release(
    adapter: Adapter, releases: tuple[str, ...] = GPU_PROVEN_RELEASES
) -> bool:
    """Whether this server's SGLang is one of ``releases`` (``GPU_PROVEN_RELEASES``)."""
    return sglang_release(adapter.module_globals) in releases


def lever_asked_for(env: str) -> bool:
    """Whether the user turned the lever of ``env`` on (``1``), not only left it to its
    default: where it then cannot run, that is worth a warning."""
    return os.environ.get(env, "").strip() == "1"


def lever_off_note(adapter: Adapter, env: str, releases: tuple[str, ...]) -> str:
    """"" where the lever of ``env`` runs on this server (``lever_on``, proven on
    ``releases``), else the note that says it is off and how to turn it on."""
    if lever_on(env, on_gpu_proven_release(adapter, releases)):
        return ""
    return f"off ({env}=1 turns it on; on a GPU it has run with SGLang {', '.join(releases)} only)"


def replays_with_replay(runner_cls: Any) -> bool:
    """Whether a graph runner class replays through ``replay()``: SGLang <= 0.5.13's layout,
    where the width-1 draft-extend and the warm-up ran on an H200 (0.5.12.post1, 2026-12-01;
    0 mismatched tokens on the crafted models). 0.5.14+ replay through ``execute()``."""
    return callable(getattr(runner_cls, "replay", None))


def _prepare_draft_extend_width1(adapter: Adapter, worker: Any) -> None:
    """Capture the width-1 draft-extend graphs once per process; failures keep the N-token one."""
    has_graph_cls = adapter.names.get("draft_extend_graph_cls")
    graph_cls = adapter.cls("draft_extend_graph_cls") if has_graph_cls else None
    if not lever_on(
        DRAFT_EXTEND_WIDTH1_ENV, replays_with_replay(graph_cls) or on_gpu_proven_release(adapter)
    ):
        # Another 0.5.14+ release (execute() layout): 0.5.17 made an illegal memory access
        # before its fix (its backends read the widths from get_spec()); only 0.5.17 has run it.
        adapter.draft_extend_width1_note = (
            f"off ({DRAFT_EXTEND_WIDTH1_ENV}=1 turns it on; by default only on SGLang <= "
            f"0.5.13 and {', '.join(GPU_PROVEN_RELEASES)}, where it has run on a GPU)"
        )
        return
    draft = worker.draft_worker
    started = time.perf_counter()
    missing = [
        n.candidates[0] for n in V2_NEEDS if n.key in _WIDTH1_NEEDS and not adapter.names[n.key]
    ]
    graphs: Width1DraftExtend | None = None
    if missing:
        why = "this SGLang lacks " + ", ".join(missing)
    elif getattr(draft, "cuda_graph_runner_for_draft_extend", None) is None:
        why = "this server runs its draft-extend without a CUDA graph"
    elif not _replays_draft_extend_graphs(draft):
        why = "this SGLang's _draft_extend_for_decode never replays a graph (0.5.5: eager)"
    else:
        try:
            exec_config = adapter.cls("exec_config")() if adapter.names.get("exec_config") else None
            spec_config = adapter.cls("spec_config")() if adapter.names.get("spec_config") else None
            with _draft_contexts(adapter, *_v2_draft_tp(adapter, draft)):
                graphs, why = capture_draft_extend_width1(
                    draft,
                    adapter.cls("draft_extend_graph_cls"),
                    adapter.cls("draft_backend_factory"),
                    adapter.controller.min_fallback_batch_size,
                    spec_config=spec_config,
                    graph_bag=getattr(exec_config, "graph", None),
                )
        except Exception as exc:  # capture failed: stay correct with the N-token draft-extend
            graphs, why = None, f"capture failed: {type(exc).__name__}: {exc}"
        if not _all_ranks_agree(adapter.tp_group(worker), graphs is not None) and graphs:
            graphs, why = None, "another TP rank could not capture them"
    if graphs is None:
        adapter.draft_extend_width1_note = f"N-token draft-extend ({why})"
        _rank0_logger(worker, logging.WARNING)(
            f"[dynspec] width-1 draft-extend graphs not used: {why}; fallback steps run the "
            f"{int(worker.speculative_num_draft_tokens)}-token draft-extend"
        )
        return
    adapter.draft_extend_width1 = graphs
    adapter.draft_extend_width1_note = f"width-1 draft-extend graphs for bs {graphs.batch_sizes}"
    _rank0_logger(worker)(
        f"[dynspec] captured width-1 draft-extend graphs for bs {graphs.batch_sizes} in "
        f"{time.perf_counter() - started:.1f}s"
    )


@contextlib.contextmanager
def draft_extend_width1_mode(draft: Any, graphs: Width1DraftExtend) -> Iterator[None]:
    """The draft worker runs its draft-extend at one token per request for the block.

    Its width, its draft-extend graph runner and attention backend are the width-1 ones; all
    are back as they were afterwards, also when the block raises. The scheduler never sees the
    swap: it reads the stride from the result or from ``EAGLEWorkerV2`` between steps.
    """
    values = {
        **WIDTH1_STATE,
        "cuda_graph_runner_for_draft_extend": graphs.runner,
        "draft_extend_attn_backend": graphs.attn_backend,
    }
    with _attributes_set(draft, values):
        yield


# --------------------------------------------------------------------------------------------
# v1 and v2: a fallback step writes the draft's KV and runs nothing else of the draft
# --------------------------------------------------------------------------------------------

# "1" / "0" turn the draft KV write on / off; unset: on where it has run on a GPU (``lever_on``).
DRAFT_KV_WRITE_ENV = "DYNSPEC_DRAFT_KV_WRITE"
# The draft KV write's result matches SGLang's draft-extend when no element of K or V differs
# by more than this fraction of the largest magnitude there (bf16 GEMMs of another shape).
KV_MATCH_TOLERANCE = 0.02
# "1" / "0": the draft KV write replays a CUDA graph per DECODE graph size / runs eagerly;
# unset: graphs where they have run on a GPU (``lever_on``, DRAFT_KV_WRITE_GRAPH_RELEASES).
DRAFT_KV_WRITE_GRAPHS_ENV = "DYNSPEC_DRAFT_KV_WRITE_GRAPHS"
# Where the write's graphs have run on an H200, v1 and v2, with 0 mismatched greedy tokens on
# v2 (strict KV check on): 0.5.12.post1 (2026-12-02, RESULTS.md).
DRAFT_KV_WRITE_GRAPH_RELEASES = ("0.5.12.post1",)
# v2: N > 1 keeps the draft KV write of N fallback steps and runs it as one (the weights of the
# draft's ``fc`` and ``qkv``, about 200 MB for Llama-3.1-8B's EAGLE-3, read once per N steps
# instead of once per step: on an H200 the per-step write took 0.10 ms of a 6.6 ms step at bs 64,
# 2026-12-04); every kept step is stored before anything else runs on the draft. Unset: 8 where
# it has run on a GPU (DRAFT_KV_WRITE_STEPS_RELEASES), else 1 (each step writes its own).
DRAFT_KV_WRITE_STEPS_ENV = "DYNSPEC_DRAFT_KV_WRITE_STEPS"
MAX_DRAFT_KV_WRITE_STEPS = 64
# Where N = 8 has run on a GPU: 0.5.17 (H200, 2026-12-05, RESULTS.md: 0 mismatched greedy
# tokens on the crafted models with the strict KV check on, the steady decode lines at c = 64
# and 128 0.985 of plain decoding's speed where the per-step write gave 0.971-0.979) and
# 0.5.12.post1 (H100, 2026-12-05, third hold: the same check, 0 mismatched; steady lines 0.987
# of plain decoding at c = 64 and 128).
DRAFT_KV_WRITE_STEPS_RELEASES = ("0.5.12.post1", "0.5.17")
DRAFT_KV_WRITE_STEPS_PROVEN = 8
# "1" lets a prefill that comes while fallback steps run store the draft's K and V of its
# tokens only (``DraftPrefillWrite``; v1 and v2, where the draft KV write runs); "0": SGLang's
# whole draft pass; unset: on where it has run on a GPU (DRAFT_PREFILL_WRITE_RELEASES). On
# an H200 the draft's prefill pass took about 19 ms of GPU per 64 prompts of 256 tokens at
# c = 64, two thirds of it attention and MLP (2026-12-04, RESULTS.md).
DRAFT_PREFILL_WRITE_ENV = "DYNSPEC_DRAFT_PREFILL_WRITE"
# Where the prefill write has run on a GPU: 0.5.17 (H200, v2: its only EAGLE worker;
# 2026-12-05, RESULTS.md: its check bit-exact on three servers, 0 mismatched greedy tokens on
# the crafted models with the strict KV check on, and the extra time per wave of a closed loop
# at c = 64 and 128 down from +46 / +66 ms to +6..+25 ms against plain decoding) and
# 0.5.12.post1 (H100, 2026-12-05, third hold, v2 and v1: the check bit-exact on six servers,
# 0 mismatched greedy tokens on the crafted models, strict KV check on, on each worker).
DRAFT_PREFILL_WRITE_RELEASES = ("0.5.12.post1", "0.5.17")
# ModelRunner's prefill CUDA graph (SGLang 0.5.17+; None: the prefill runs eagerly)
DRAFT_PREFILL_GRAPH_ATTR = "prefill_cuda_graph_runner"
# "1" lets a v2 prefill that comes while fallback steps run skip SGLang's draft pass
# altogether (``DraftPrefillDirect``: the draft KV write of inputs built here as that pass
# builds them, no ForwardBatch, attention metadata, LM head or top-k); "0": the prefill write
# inside SGLang's pass (``DraftPrefillWrite``); unset: on where it has run on a GPU
# (DRAFT_PREFILL_DIRECT_RELEASES). On an H100 with 0.5.17 (2026-12-06, seventh hold, mixed
# output lengths at c = 64) a prefill with the write inside SGLang's pass cost 2.9 ms more
# than plain decoding's, 2.1 ms of it with the GPU idle while the host ran the pass, and the
# draft's LM head GEMM 0.65 ms.
DRAFT_PREFILL_DIRECT_ENV = "DYNSPEC_DRAFT_PREFILL_DIRECT"
# Where it has run on a GPU: 0.5.17 (H100, 2026-12-06, eighth hold, RESULTS.md: its check
# bit-exact on four servers, 0 mismatched outputs over 6238 requests of the crafted 8b models,
# greedy outputs equal to plain decoding's; a fixed-T server at c = 32 / 64 / 128 with mixed
# output lengths 0.955 / 0.968 / 0.962 of plain decoding, against 0.934 / 0.839 / 0.903 with
# the write inside SGLang's pass on the same machine).
DRAFT_PREFILL_DIRECT_RELEASES = ("0.5.17",)
# SGLang's v2 draft pass of a prefill (a method of the draft worker), its leading parameters,
# and the helper it takes each request's last token from (0.5.17+: the target's next token,
# or a chunk's next prompt token)
DRAFT_PREFILL_METHOD = "_draft_extend_for_prefill"
DRAFT_PREFILL_PARAMS = ("batch", "target_hidden_states", "next_token_ids")
DRAFT_PREFILL_TAIL_HELPER = "_eagle_prefill_tail_tokens"

# capture(body) -> (replay, what body returned): body's work recorded once, replayed on the
# same tensors.
GraphCapture = Callable[[Callable[[], Any]], tuple[Callable[[], None], Any]]


def graph_capture(device: Any) -> GraphCapture | None:
    """A CUDA graph capturer for ``device`` (None off CUDA); its graphs share one memory pool.

    Each body runs once eagerly first (lazy initialisation, kernel compiles), then is captured
    after a device synchronisation, as SGLang's own graph runners do.
    """
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    pool = torch.cuda.graph_pool_handle()

    def capture(body: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        body()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = body()
        return graph.replay, out

    return capture


@dataclass
class _WriteGraph:
    """The draft KV write of ``size`` rows as one graph, and the tensors it reads and fills."""

    replay: Callable[[], None]
    tokens: Any
    hidden: Any
    positions: Any
    loc: Any
    k: Any
    v: Any

    def run(self, tokens: Any, hidden: Any, positions: Any, loc: Any) -> tuple[Any, Any]:
        bs = tokens.shape[0]
        self.tokens[:bs].copy_(tokens)
        self.hidden[:bs].copy_(hidden)
        self.positions[:bs].copy_(positions)
        self.loc.zero_()  # padding rows store into slot 0, which SGLang never hands out
        self.loc[:bs].copy_(loc)
        self.replay()
        return self.k[:bs], self.v[:bs]


@dataclass
class DraftKvWrite:
    """The K and V a one-layer EAGLE-3 draft stores for a fallback step's token, and only that.

    What a draft-extend leaves behind that a later speculative step reads is the draft KV of
    each position; its attention, MLP, LM head and top-k only serve the next draft, which a
    fallback step does not make. The draft's only layer takes ``[input_layernorm(embed(token)),
    hidden_norm(fc(target hidden))]``, so its K and V at a position depend on that position's
    token and target hidden state alone: computed here with the draft model's own modules and
    stored with its KV pool's own ``set_kv_buffer``, as its attention backend stores them.

    ``checked`` turns True once a real step's result matched what SGLang's own draft-extend
    stored for the same rows (``matches``); until then every fallback step runs SGLang's
    draft-extend, and a mismatch (``broken``) keeps it for the rest of the process.

    Run eagerly, its dozen small kernels cost 0.6-0.8 ms of host time per step (H200,
    2026-12-02), in a step whose host time bounds the server; with ``capture`` it replays one
    graph per size of ``graph_sizes`` instead, each captured at its first write (the start-up
    warm-up writes every size it has time for).
    """

    inner: Any  # the draft model's LlamaModel: embed_tokens, fc, its norms, layers
    layer: Any  # its only decoder layer
    pool: Any  # the draft runner's token_to_kv_pool
    checked: bool = False
    broken: str = ""
    capture: GraphCapture | None = None
    graph_sizes: list[int] = dataclasses.field(default_factory=list)
    graphs: dict[int, _WriteGraph] = dataclasses.field(default_factory=dict)
    warn: Callable[[str], None] | None = None  # says once that a capture failed
    runs: str = "eager"  # how it runs, in words
    steps_per_write: int = 1  # fallback steps whose writes run as one (``defer``)
    kept: list[tuple[Any, Any, Any, Any]] = dataclasses.field(default_factory=list)

    @property
    def attn(self) -> Any:
        return self.layer.self_attn.attn

    def compute(self, tokens: Any, hidden: Any, positions: Any) -> tuple[Any, Any]:
        """(K, V) of the draft's layer for ``tokens`` at ``positions`` after ``hidden``."""
        import torch

        with torch.no_grad():
            return self._compute(tokens, hidden, positions)

    def _compute(self, tokens: Any, hidden: Any, positions: Any) -> tuple[Any, Any]:
        import torch

        inner, layer, attn = self.inner, self.layer, self.attn
        embeds = inner.embed_tokens(tokens.to(torch.int64))
        if hidden.shape[-1] != embeds.shape[-1]:  # EAGLE-3: the target's auxiliary states
            if getattr(inner, "input_norm", None) is not None:
                hidden = inner.input_norm(hidden)
            fc_norm = getattr(inner, "fc_norm", None)
            if fc_norm is not None:
                chunks = hidden.chunk(len(fc_norm), dim=-1)
                normed = [norm(c) for norm, c in zip(fc_norm, chunks, strict=True)]
                hidden = torch.cat(normed, dim=-1)
            hidden = inner.fc(hidden)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        _, k, v = layer.self_attn.forward_prepare_native(positions, x)  # int64 seq_lens
        return (
            k.view(-1, attn.tp_k_head_num, attn.qk_head_dim),
            v.view(-1, attn.tp_v_head_num, attn.v_head_dim),
        )

    def write(self, tokens: Any, hidden: Any, positions: Any, loc: Any) -> tuple[Any, Any]:
        """Store the draft's K and V for ``tokens`` at ``loc``, and return them.

        Through the graph of the smallest size that holds the batch, else eagerly.
        """
        graph = self._graph(tokens, hidden, positions)
        if graph is not None:
            return graph.run(tokens, hidden, positions, loc)
        k, v = self.compute(tokens, hidden, positions)
        self.pool.set_kv_buffer(self.attn, loc, k, v)
        return k, v

    def defer(self, tokens: Any, hidden: Any, positions: Any, loc: Any) -> None:
        """Keep this step's rows (copies: the hidden states are a graph's output buffer, which
        the next step overwrites); store every kept step once ``steps_per_write`` are kept.
        With one step per write, write at once."""
        if self.steps_per_write == 1:
            self.write(tokens, hidden, positions, loc)
            return
        self.kept.append((tokens.clone(), hidden.clone(), positions.clone(), loc.clone()))
        if len(self.kept) >= self.steps_per_write:
            self.flush()

    def flush(self) -> None:
        """Store the kept steps' K and V: computed for all their rows at once, stored step by
        step, oldest first, so a slot freed and handed out again between two kept steps ends
        up with the later step's, as writes at each step would have left it."""
        kept, self.kept = self.kept, []
        if len(kept) == 1:
            self.write(*kept[0])
            return
        if not kept:
            return
        import torch

        k, v = self.compute(*(torch.cat([step[i] for step in kept]) for i in range(3)))
        start = 0
        for *_, loc in kept:
            end = start + loc.shape[0]
            self.pool.set_kv_buffer(self.attn, loc, k[start:end], v[start:end])
            start = end

    def _graph(self, tokens: Any, hidden: Any, positions: Any) -> _WriteGraph | None:
        if self.capture is None:
            return None
        size = next((s for s in self.graph_sizes if s >= tokens.shape[0]), None)
        if size is None:
            return None
        graph = self.graphs.get(size)
        if graph is None:
            try:
                graph = self.graphs[size] = self._capture(size, hidden, positions)
            except Exception as exc:  # stay correct: eager writes from now on
                self.capture = None
                if self.warn is not None:
                    self.warn(
                        f"[dynspec] draft KV write graph capture failed at bs {size} "
                        f"({type(exc).__name__}: {exc}); the write runs eagerly from now on"
                    )
                return None
        if graph.hidden.shape[1:] != hidden.shape[1:] or graph.hidden.dtype != hidden.dtype:
            return None
        return graph

    def _capture(self, size: int, hidden: Any, positions: Any) -> _WriteGraph:
        import torch

        device = hidden.device
        tokens = torch.zeros(size, dtype=torch.int64, device=device)
        static_hidden = hidden.new_zeros((size, *hidden.shape[1:]))
        static_positions = positions.new_zeros((size,))
        loc = torch.zeros(size, dtype=torch.int64, device=device)

        def body() -> tuple[Any, Any]:
            k, v = self.compute(tokens, static_hidden, static_positions)
            self.pool.set_kv_buffer(self.attn, loc, k, v)
            return k, v

        assert self.capture is not None
        replay, (k, v) = self.capture(body)
        return _WriteGraph(replay, tokens, static_hidden, static_positions, loc, k, v)

    def matches(self, k: Any, v: Any, loc: Any) -> tuple[bool, str]:
        """Whether the pool holds (``k``, ``v``) at ``loc``, and the largest differences.

        One host sync: called once per process, on the step that checks the write.
        """
        layer_id = self.attn.layer_id
        stored = (
            self.pool.get_key_buffer(layer_id)[loc],
            self.pool.get_value_buffer(layer_id)[loc],
        )
        ok, parts = True, []
        for name, mine, theirs in (("K", k, stored[0]), ("V", v, stored[1])):
            mine, theirs = mine.float(), theirs.reshape(mine.shape).float()
            diff = float((mine - theirs).abs().max())
            scale = float(theirs.abs().max())
            ok = ok and diff <= KV_MATCH_TOLERANCE * scale
            parts.append(f"max |d{name}| {diff:.3g} of {scale:.3g}")
        return ok, ", ".join(parts)


def draft_kv_write_for(draft_runner: Any) -> tuple[DraftKvWrite | None, str]:
    """The draft KV write for this draft model runner, or (None, why) where it cannot be exact.

    Only a one-layer draft whose K and V its own modules compute from the token and the
    target's hidden state (no multimodal rotary positions), stored unscaled in a plain MHA KV
    pool of the model's dtype, without decode-context parallelism.
    """
    model = getattr(draft_runner, "model", None)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None:
        return None, "the draft model has no model.layers"
    if len(layers) != 1:
        return None, f"the draft has {len(layers)} layers (a later layer's KV needs attention)"
    layer = layers[0]
    missing = [
        name
        for owner, name in (
            (inner, "embed_tokens"),
            (inner, "fc"),
            (layer, "input_layernorm"),
            (layer, "hidden_norm"),
            (getattr(layer, "self_attn", None), "forward_prepare_native"),
            (getattr(layer, "self_attn", None), "attn"),
        )
        if not hasattr(owner, name)
    ]
    if missing:
        return None, "the draft model lacks " + ", ".join(missing)
    if not getattr(layer, "is_input_layer", True):
        return None, "the draft's layer does not take the target's hidden state"
    if getattr(inner, "is_mrope_enabled", False):
        return None, "the draft uses multimodal rotary positions"
    attn = layer.self_attn.attn
    if getattr(attn, "k_scale", None) is not None or getattr(attn, "v_scale", None) is not None:
        return None, "the draft's KV cache is scaled"
    pool = getattr(draft_runner, "token_to_kv_pool", None)
    if type(pool).__name__ != "MHATokenToKVPool":
        return None, f"the draft KV pool is {type(pool).__name__}, not MHATokenToKVPool"
    if getattr(pool, "is_quantized_kv_cache", False) or (
        getattr(pool, "store_dtype", None) != getattr(pool, "dtype", None)
    ):
        return None, "the draft KV pool stores another dtype than it computes"
    if getattr(pool, "use_hnd", False):
        return None, "the draft KV pool is laid out by page (HND)"
    if int(getattr(getattr(draft_runner, "attn_backend", None), "dcp_size", 1) or 1) > 1:
        return None, "decode-context parallelism splits the draft KV"
    return DraftKvWrite(inner, layer, pool), ""


V1_NEXT_DRAFT_INPUT_FIELDS = ("topk_p", "topk_index", "hidden_states", "capture_hidden_mode")


def _v1_draft_kv_write_refusal(adapter: Adapter) -> str:
    """Why v1 of this release cannot hand on a draft input after a draft KV write, or ""."""
    if adapter.names["vo_next_input"] != "draft_extend_input":
        return "this release's v1 verify hands the next draft input to the draft-extend to fill"
    fields = _dataclass_field_names(adapter.cls("draft_input_cls"))
    missing = [f for f in V1_NEXT_DRAFT_INPUT_FIELDS if f not in fields]
    if missing:
        return "EagleDraftInput lacks " + ", ".join(missing)
    if not hasattr(adapter.cls("capture_mode_cls"), "LAST"):
        return "CaptureHiddenMode lacks LAST"
    return ""


def _prepare_draft_kv_write(adapter: Adapter, worker: Any) -> None:
    """Find the draft KV write once per process (checked later, at its first real step)."""
    if not lever_on(DRAFT_KV_WRITE_ENV, on_gpu_proven_release(adapter, DRAFT_KV_WRITE_RELEASES)):
        adapter.draft_kv_write_note = (
            f"off ({DRAFT_KV_WRITE_ENV}=1 turns it on; by default only on SGLang "
            f"{', '.join(DRAFT_KV_WRITE_RELEASES)}, where it has run on a GPU)"
        )
        return
    why = _v1_draft_kv_write_refusal(adapter) if adapter.variant == "v1" else ""
    kv_write, why = (None, why) if why else draft_kv_write_for(_draft_runner(adapter, worker))
    if not _all_ranks_agree(adapter.tp_group(worker), kv_write is not None) and kv_write:
        kv_write, why = None, "another TP rank cannot use it"
    if kv_write is None:
        adapter.draft_kv_write_note = f"SGLang's draft-extend ({why})"
        _rank0_logger(worker, logging.WARNING)(
            f"[dynspec] draft KV write not used: {why}; fallback steps run SGLang's draft-extend"
        )
        return
    adapter.draft_kv_write = kv_write
    kv_write.runs = _use_draft_kv_write_graphs(adapter, worker, kv_write)
    if adapter.variant == "v2":
        proven = on_gpu_proven_release(adapter, DRAFT_KV_WRITE_STEPS_RELEASES)
        kv_write.steps_per_write = draft_kv_write_steps(
            _rank0_logger(worker, logging.WARNING), DRAFT_KV_WRITE_STEPS_PROVEN if proven else 1
        )
        if kv_write.steps_per_write > 1:
            kv_write.runs += f"; {kv_write.steps_per_write} fallback steps' writes run as one"
    adapter.draft_kv_write_note = (
        f"draft KV write (checked at the first fallback step; {kv_write.runs})"
    )


def draft_kv_write_steps(warn: Callable[[str], None], default: int = 1) -> int:
    """``DYNSPEC_DRAFT_KV_WRITE_STEPS`` as an int in 1..64, ``default`` where it is unset;
    anything else warns and gives 1."""
    value = os.environ.get(DRAFT_KV_WRITE_STEPS_ENV, "").strip()
    if not value:
        return default
    if value.isdigit() and 1 <= int(value) <= MAX_DRAFT_KV_WRITE_STEPS:
        return int(value)
    warn(
        f"[dynspec] {DRAFT_KV_WRITE_STEPS_ENV}={value!r} is not an integer in "
        f"1..{MAX_DRAFT_KV_WRITE_STEPS}; each fallback step writes its own draft KV"
    )
    return 1


def _use_draft_kv_write_graphs(adapter: Adapter, worker: Any, kv_write: DraftKvWrite) -> str:
    """Let the write replay CUDA graphs at the DECODE graphs' sizes; what it runs, in words."""
    proven = on_gpu_proven_release(adapter, DRAFT_KV_WRITE_GRAPH_RELEASES)
    if not lever_on(DRAFT_KV_WRITE_GRAPHS_ENV, proven):
        if os.environ.get(DRAFT_KV_WRITE_GRAPHS_ENV, "").strip() == "0":
            return f"eager, {DRAFT_KV_WRITE_GRAPHS_ENV}=0"
        return (
            f"eager: its CUDA graphs are on by default only on SGLang "
            f"{', '.join(DRAFT_KV_WRITE_GRAPH_RELEASES)}, where they have run on a GPU "
            f"({DRAFT_KV_WRITE_GRAPHS_ENV}=1 turns them on)"
        )
    if adapter.decode_graphs is None:
        return "eager, as the target's fallback forwards"
    if int(getattr(adapter.tp_group(worker), "world_size", 1) or 1) > 1:
        return "eager: with TP its embedding all-reduces"
    capture = graph_capture(next(kv_write.inner.parameters()).device)
    if capture is None:
        return "eager: not on a CUDA device"
    kv_write.capture = capture
    kv_write.graph_sizes = list(adapter.decode_graphs.batch_sizes)
    kv_write.warn = _rank0_logger(worker, logging.WARNING)
    return f"CUDA graphs for bs {kv_write.graph_sizes}, captured by the warm-up or at first use"


@dataclass
class DraftPrefillWrite:
    """A prefill's draft pass as the draft KV write of its tokens, while fallback steps run.

    SGLang runs the draft over every token a prefill adds (its attention, MLP and LM head), so
    that the next step can draft. While the server runs fallback steps no step drafts from
    that, and what a later speculative step reads of it is the draft KV of each position: the
    draft KV write's computation (``DraftKvWrite``) over the tokens and target hidden states
    SGLang's draft pass was given (its inputs shifted by one, each request's last token the
    target's next one). The draft model's ``forward`` answers the rest with zeros: the draft
    state SGLang makes from them is stale (``Adapter.draft_state_stale``), and the step before
    speculation resumes runs SGLang's draft-extend.

    ``checked`` turns True once a real prefill's K and V matched what SGLang's own draft pass
    stored for the same tokens; until then every prefill runs that pass, and a mismatch
    (``broken``) keeps it for the rest of the process.
    """

    kv_write: DraftKvWrite
    checked: bool = False
    broken: str = ""

    def takes(self, input_ids: Any, forward_batch: Any, input_embeds: Any) -> bool:
        """Whether this draft pass is one the write reproduces: the tokens of an extend, a
        target hidden state and a slot for each, no embeddings given in their place
        (multimodal inputs, ``input_embeds``). Anything else runs SGLang's pass."""
        mode = getattr(forward_batch, "forward_mode", None)
        if mode is None or not mode.is_extend() or input_embeds is not None:  # IDLE is not extend
            return False
        if getattr(forward_batch, "mm_input_embeds", None) is not None:
            return False
        contains_mm = getattr(forward_batch, "contains_mm_inputs", None)
        if callable(contains_mm) and contains_mm():
            return False
        hidden = getattr(getattr(forward_batch, "spec_info", None), "hidden_states", None)
        loc = getattr(forward_batch, "out_cache_loc", None)
        rows = int(input_ids.shape[0])
        return (
            rows > 0
            and hidden is not None
            and int(hidden.shape[0]) == rows
            and loc is not None
            and int(loc.shape[0]) == rows
        )

    def placeholder(self, rows: int) -> tuple[Any, list[Any]]:
        """What the draft's LlamaModel returns (its last hidden state, the auxiliary one), as
        zeros for ``rows`` tokens: never drafted from, only given shapes. A real tensor, not
        an expanded row: SGLang's logits processor may view or index it any way (its MLP
        alone would have made a wider one)."""
        weight = self.kv_write.inner.embed_tokens.weight
        zeros = weight.new_zeros((rows, weight.shape[-1]))
        return zeros, [zeros]


@dataclass
class DraftPrefillDirect:
    """A v2 prefill's draft pass, while fallback steps run, as the draft KV write alone.

    SGLang's ``_draft_extend_for_prefill`` shifts each request's tokens by one (its last one
    from SGLang's own helper), builds a ForwardBatch and the attention metadata, and runs the
    draft model, its LM head and a top-k for the next draft state. ``DraftPrefillWrite``
    replaces the model's forward by the draft KV write; all the rest still runs, on the host
    while the GPU waits. Here the method itself is replaced: the tokens and positions built
    as that pass builds them, their K and V stored by the draft KV write, and the next draft
    state made of zeros shaped like the one SGLang's pass returned at the checked prefill
    (stale: the step before speculation resumes runs SGLang's draft-extend), its root the
    target's next token as SGLang's.
    """

    tail_tokens: Callable[[Any, Any], Any]  # SGLang's helper: each request's last token
    root_field: str
    # The draft state class and, per field, how a state is made: ("root", None),
    # ("zeros", (shape after the first dimension, dtype)) or ("value", the value).
    state_cls: Any = None
    fields: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    broken: str = ""

    def takes(self, batch: Any, hidden: Any, next_token_ids: Any, extra: list[Any]) -> bool:
        """Whether this pass is one built here: an extend of text tokens (every other argument
        None: no multimodal embeddings) with each request's prefix and extend lengths, a
        target hidden state and a slot for each token."""
        mode = getattr(batch, "forward_mode", None)
        if mode is None or not mode.is_extend() or any(a is not None for a in extra):
            return False
        lens = getattr(batch, "extend_lens", None)
        prefixes = getattr(batch, "prefix_lens", None)
        loc = getattr(batch, "out_cache_loc", None)
        if not isinstance(lens, list) or not isinstance(prefixes, list) or loc is None:
            return False
        rows = sum(lens)
        return (
            len(lens) == len(prefixes) == int(next_token_ids.shape[0]) > 0
            and rows == int(batch.input_ids.shape[0]) == int(hidden.shape[0])
            and rows == int(loc.shape[0])
        )

    def inputs(self, batch: Any, next_token_ids: Any) -> tuple[Any, Any]:
        """(tokens, positions) of the draft's pass: each request's tokens shifted by one, its
        last from ``tail_tokens``; its positions from its prefix length on. One small copy
        to the device, no host sync."""
        import torch

        lens, prefixes = batch.extend_lens, batch.prefix_lens
        ends = list(itertools.accumulate(lens))
        starts_less_prefix = [e - n - p for e, n, p in zip(ends, lens, prefixes, strict=True)]
        device = batch.input_ids.device
        index = torch.tensor(  # pinned: the copy neither waits for the GPU nor holds it up
            [*(e - 1 for e in ends), *starts_less_prefix, *lens],
            dtype=torch.int64,
            pin_memory=device.type == "cuda",
        ).to(device, non_blocking=True)
        bs, rows = len(lens), ends[-1]
        last, start_less_prefix, repeats = index[:bs], index[bs : 2 * bs], index[2 * bs :]
        tokens = torch.empty_like(batch.input_ids)
        tokens[:-1] = batch.input_ids[1:]
        tokens[last] = self.tail_tokens(batch, next_token_ids).to(tokens.dtype)
        positions = torch.arange(rows, device=device) - torch.repeat_interleave(
            start_less_prefix, repeats, output_size=rows
        )
        return tokens, positions

    def adopt(self, state: Any, next_token_ids: Any, tokens: Any, sglang_tokens: Any) -> str:
        """Learn the draft state's make from the one SGLang's pass returned for this prefill,
        and check the tokens built here against SGLang's; "" or why the pass stays SGLang's
        (one host sync, at the checked prefill only)."""
        import torch

        if not dataclasses.is_dataclass(state):
            return f"its draft state is a {type(state).__name__}, not a dataclass"
        if sglang_tokens is None or not torch.equal(sglang_tokens, tokens):
            return "the tokens built for the draft differ from SGLang's"
        rows = int(next_token_ids.shape[0])
        fields: dict[str, tuple[str, Any]] = {}
        for field in dataclasses.fields(state):
            if not field.init:
                continue
            value = getattr(state, field.name)
            if field.name == self.root_field:
                if not torch.is_tensor(value) or not torch.equal(value, next_token_ids):
                    return f"its {field.name} is not the target's next tokens"
                fields[field.name] = ("root", None)
            elif torch.is_tensor(value):
                if value.dim() == 0 or int(value.shape[0]) != rows:
                    return f"its {field.name} is not one row per request"
                fields[field.name] = ("zeros", (tuple(value.shape[1:]), value.dtype))
            else:
                fields[field.name] = ("value", value)
        if self.root_field not in fields:
            return f"its draft state has no {self.root_field}"
        self.state_cls, self.fields = type(state), fields
        return ""

    def state(self, next_token_ids: Any) -> Any:
        """The next draft state, as the checked one was made, for these requests."""
        import torch

        values: dict[str, Any] = {}
        for name, (kind, spec) in self.fields.items():
            if kind == "root":
                values[name] = next_token_ids
            elif kind == "zeros":
                shape, dtype = spec
                rows = (int(next_token_ids.shape[0]), *shape)
                values[name] = torch.zeros(rows, dtype=dtype, device=next_token_ids.device)
            else:
                values[name] = spec
        return self.state_cls(**values)


def _prepare_draft_prefill_direct(adapter: Adapter, worker: Any) -> None:
    """Take the direct prefill where it is turned on and the prefill write is there, on a v2
    worker whose draft pass this reproduces (one warning where turned on and it cannot be)."""
    off = lever_off_note(adapter, DRAFT_PREFILL_DIRECT_ENV, DRAFT_PREFILL_DIRECT_RELEASES)
    if off:
        adapter.draft_prefill_direct_note = off
        return
    why = _draft_prefill_direct_refusal(adapter, worker)
    if why:
        adapter.draft_prefill_direct_note = f"SGLang's draft pass ({why})"
        if lever_asked_for(DRAFT_PREFILL_DIRECT_ENV):
            _rank0_logger(worker, logging.WARNING)(
                f"[dynspec] {DRAFT_PREFILL_DIRECT_ENV}=1 not used: {why}"
            )
        return
    method = getattr(type(worker.draft_worker), DRAFT_PREFILL_METHOD)
    adapter.draft_prefill_direct = DraftPrefillDirect(
        method.__globals__[DRAFT_PREFILL_TAIL_HELPER], str(adapter.names["root_field"])
    )
    adapter.draft_prefill_direct_note = (
        "prefills in fallback skip SGLang's draft pass (checked at the first one)"
    )


def _draft_prefill_direct_refusal(adapter: Adapter, worker: Any) -> str:
    """Why a prefill here cannot skip SGLang's draft pass ("" where it can)."""
    if adapter.variant != "v2":
        return f"only v2's draft pass ({DRAFT_PREFILL_METHOD}) is built here, not v1's"
    if adapter.draft_prefill_write is None:
        return f"it needs the prefill write ({adapter.draft_prefill_write_note})"
    method = getattr(type(getattr(worker, "draft_worker", None)), DRAFT_PREFILL_METHOD, None)
    if not callable(method):
        return f"the draft worker has no {DRAFT_PREFILL_METHOD}"
    params = tuple(inspect.signature(method).parameters)[1 : 1 + len(DRAFT_PREFILL_PARAMS)]
    if params != DRAFT_PREFILL_PARAMS:
        return f"{DRAFT_PREFILL_METHOD} takes ({', '.join(params)}), not the ones known"
    if not callable(getattr(method, "__globals__", {}).get(DRAFT_PREFILL_TAIL_HELPER)):
        return f"{DRAFT_PREFILL_METHOD} takes no last tokens from {DRAFT_PREFILL_TAIL_HELPER}"
    return ""


def _prepare_draft_prefill_write(adapter: Adapter, worker: Any) -> None:
    """Take the prefill write where it is turned on and the draft KV write is there (one
    warning where it is turned on and cannot be)."""
    off = lever_off_note(adapter, DRAFT_PREFILL_WRITE_ENV, DRAFT_PREFILL_WRITE_RELEASES)
    if off:
        adapter.draft_prefill_write_note = off
        return
    if adapter.draft_kv_write is None:
        adapter.draft_prefill_write_note = "SGLang's draft pass (no draft KV write)"
        if lever_asked_for(DRAFT_PREFILL_WRITE_ENV):
            _rank0_logger(worker, logging.WARNING)(
                f"[dynspec] {DRAFT_PREFILL_WRITE_ENV}=1 not used: it needs the draft KV write "
                f"({adapter.draft_kv_write_note}); prefills keep SGLang's draft pass"
            )
        return
    adapter.draft_prefill_write = DraftPrefillWrite(adapter.draft_kv_write)
    adapter.draft_prefill_write_note = (
        "prefills in fallback store the draft KV only (checked at the first one)"
    )


def _draft_state_stub(draft_input: Any) -> tuple[Any, Any, Any] | None:
    """The (topk_p, topk_index, hidden_states) a KV-write step hands on, or None: not possible.

    The step's incoming ones: the right shapes for the scheduler's filter, merge and overlap
    buffers, never drafted from (``Adapter.draft_state_stale``). None where the draft input
    lacks one, or carries draft state this runtime does not hand on (rejection sampling's
    ``draft_probs``, DSA's ``dsa_topk_indices``).
    """
    for extra in ("draft_probs", "dsa_topk_indices"):
        if getattr(draft_input, extra, None) is not None:
            return None
    stub = tuple(getattr(draft_input, n, None) for n in ("topk_p", "topk_index", "hidden_states"))
    return None if any(t is None for t in stub) else stub  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Warm-up at start-up: what the first real replays would compile, compiled before them
# --------------------------------------------------------------------------------------------

# "0" / "1": no warm-up replays (the first fallback steps then compile what they need) / warm
# up; unset: where the replays have run on a GPU (``lever_on``).
WARMUP_ENV = "DYNSPEC_WARMUP"
# No new warm-up replay starts after this many seconds (default 30: on the first server of a
# fresh H200, empty caches, SGLang's own graph capture took 80 s and 10 s of warm-up ran 3 of
# 76 replays, the first two DECODE sizes compiling; warm caches: 76 of 76 in 0.3 s).
WARMUP_BUDGET_ENV = "DYNSPEC_WARMUP_BUDGET_S"
DEFAULT_WARMUP_BUDGET_S = 30.0
FORWARD_BATCH_MODULE = "sglang.srt.model_executor.forward_batch_info"


def warmup_order(batch_sizes: list[int]) -> tuple[list[int], list[int]]:
    """The sizes to replay at warm-up: (the smallest of each Triton specialisation, the other
    sizes), each ascending.

    A replay runs SGLang's eager attention-metadata kernels (the triton backend's
    ``get_num_kv_splits_triton`` in DECODE mode, on int32 buffers no speculative step hands
    it), and Triton compiles a kernel once per specialisation of its integer arguments (== 1,
    divisible by 16) and of its block constant (``MAX_NUM_SEQ``: 256 or the next power of two
    above). The first list compiles; a budget that runs out in the second skips only sizes
    whose kernels are already compiled.
    """

    def key(bs: int) -> tuple[bool, bool, int]:
        return bs == 1, bs % 16 == 0, max(256, 1 << (bs - 1).bit_length())

    firsts: list[int] = []
    rest: list[int] = []
    seen: set[tuple[bool, bool, int]] = set()
    for bs in sorted(set(batch_sizes)):
        (rest if key(bs) in seen else firsts).append(bs)
        seen.add(key(bs))
    return firsts, rest


class _PaddingBatch:
    """Attributes of a warm-up batch where SGLang has no dataclass to hold them.

    A field that is not set reads as None, as in a batch that leaves it unset.
    """

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _dataclass_instance(cls: Any, values: dict[str, Any]) -> Any:
    """An instance of dataclass ``cls`` with ``values``, every other field at its default
    (None where it has none), without running its ``__init__`` / ``__post_init__``."""
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in values:
            value = values[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        object.__setattr__(obj, f.name, value)
    return obj


def _padding_batch(runner: Any, bs: int, device: Any, forward_mode: Any, **extra: Any) -> Any:
    """A forward batch of ``bs`` padding rows only, for a warm-up replay of ``runner``.

    Each row reads request-pool row 0 for ``seq_len_fill_value`` tokens and writes its KV to
    slot 0, which SGLang reserves for padding: what the padded rows of every real replay do.
    It is SGLang's own ForwardBatch (every other field at its default) where there is one.
    """
    import torch

    fill = int(getattr(runner, "seq_len_fill_value", 1) or 1)

    def zeros() -> Any:
        return torch.zeros(bs, dtype=torch.int64, device=device)

    values = {
        "forward_mode": forward_mode,
        "batch_size": bs,
        "input_ids": zeros(),
        "req_pool_indices": zeros(),
        "seq_lens": torch.full((bs,), fill, dtype=torch.int64, device=device),
        "seq_lens_cpu": torch.full((bs,), fill, dtype=torch.int64),
        "seq_lens_sum": bs * fill,
        "out_cache_loc": zeros(),
        "positions": zeros(),
        "num_token_non_padded": torch.tensor(bs, dtype=torch.int32, device=device),
        **extra,
    }
    forward_batch_cls = getattr(sys.modules.get(FORWARD_BATCH_MODULE), "ForwardBatch", None)
    if dataclasses.is_dataclass(forward_batch_cls):
        return _dataclass_instance(forward_batch_cls, values)
    return _PaddingBatch(**values)


def _padding_hidden(runner: Any, rows: int) -> Any:
    """Zero hidden states as wide as a draft-extend graph's input buffer (None: unknown)."""
    buffers = getattr(runner, "buffers", runner)
    buffer = getattr(buffers, "hidden_states", None)
    if buffer is None or not hasattr(buffer, "new_zeros"):
        return None
    return buffer.new_zeros((rows, *buffer.shape[1:]))


def replay_graph(runner: Any, forward_batch: Any, bs: int) -> Any:
    """Replay ``runner``'s graph for ``forward_batch``, through the method this release has.

    ``replay(forward_batch)`` up to 0.5.13; ``execute(forward_batch)`` from 0.5.14 (0.5.23's
    draft-extend runner also takes the row of each request's last token, ``select_index``:
    row i at one token per request).
    """
    replay = getattr(runner, "replay", None)
    if callable(replay):
        return replay(forward_batch)
    execute = runner.execute
    if "select_index" in inspect.signature(execute).parameters:
        import torch

        rows = torch.arange(bs, dtype=torch.int64, device=forward_batch.seq_lens.device)
        return execute(forward_batch, select_index=rows)
    return execute(forward_batch)


def _forward_mode(name: str) -> Any:
    """SGLang's ForwardMode member ``name``."""
    modes = getattr(sys.modules.get(FORWARD_BATCH_MODULE), "ForwardMode", None)
    return getattr(modes, name)


def _warmup_replays(adapter: Adapter, worker: Any) -> list[tuple[str, Callable[[], Any]]]:
    """(kind, call) for every warm-up step, in order: clamp_position; one DECODE and one
    width-1 extend size of each Triton specialisation (``warmup_order``: what compiles); the
    draft KV write (with its graphs: each size's capture); the other DECODE and width-1 extend
    sizes, whose kernels are compiled by then. A budget that runs out then skips what costs a
    fallback step least."""
    import torch

    target_runner = worker.target_worker.model_runner
    device = getattr(target_runner, "device", "cuda")
    replays: list[tuple[str, Callable[[], Any]]] = []
    later: list[tuple[str, Callable[[], Any]]] = []
    decode = adapter.decode_graphs
    if decode is not None:
        # The fallback's DECODE ForwardBatch.init_new computes positions with clamp_position, a
        # JIT kernel (0.5.10+; torch.compile before) that no speculative step calls.
        clamp = getattr(sys.modules.get(FORWARD_BATCH_MODULE), "clamp_position", None)
        if clamp is not None:
            rows = max([2, *decode.batch_sizes])  # > 1: torch.compile specialises 0 and 1
            seq_lens = torch.full((rows,), 2, dtype=torch.int64, device=device)
            replays.append(("clamp_position", functools.partial(clamp, seq_lens)))
        graph_attr = adapter.name("graph_attr")
        # The runner's own modes (IntEnums: NULL is 0, so no ``or``): no recapture at warm-up.
        mode = getattr(decode.runner, "capture_forward_mode", None)
        if mode is None:
            mode = _forward_mode("DECODE")
        hidden_mode = getattr(decode.runner, "capture_hidden_mode", None)
        if hidden_mode is None:
            hidden_mode = adapter.cls("capture_mode_cls").FULL

        def replay_decode(bs: int) -> None:
            batch = _padding_batch(
                decode.runner, bs, device, mode, capture_hidden_mode=hidden_mode, spec_info=None
            )
            with target_decode_mode(target_runner, graph_attr, decode):
                replay_graph(decode.runner, batch, bs)

        firsts, rest = warmup_order(decode.batch_sizes)
        replays += [("DECODE", functools.partial(replay_decode, bs)) for bs in firsts]
        later += [("DECODE", functools.partial(replay_decode, bs)) for bs in rest]
    width1 = adapter.draft_extend_width1
    if width1 is not None:
        draft = worker.draft_worker

        def replay_extend(bs: int) -> None:
            spec_info = _PaddingBatch(hidden_states=_padding_hidden(width1.runner, bs))
            batch = _padding_batch(
                width1.runner, bs, device, width1.runner.forward_mode, spec_info=spec_info
            )
            contexts = _draft_contexts(adapter, *_v2_draft_tp(adapter, draft))
            with contexts, draft_extend_width1_mode(draft, width1):
                replay_graph(width1.runner, batch, bs)

        firsts, rest = warmup_order(width1.batch_sizes)
        replays += [("width-1 draft-extend", functools.partial(replay_extend, bs)) for bs in firsts]
        later += [("width-1 draft-extend", functools.partial(replay_extend, bs)) for bs in rest]
    kv_write = adapter.draft_kv_write
    if kv_write is not None:
        fc = kv_write.inner.fc

        def write_kv(bs: int) -> None:
            rows = torch.zeros(bs, dtype=torch.int64, device=fc.weight.device)  # slot 0: padding
            hidden = torch.zeros(bs, fc.in_features, dtype=fc.weight.dtype, device=rows.device)
            with _draft_contexts(adapter, *_draft_tp(adapter, worker)):
                kv_write.write(rows, hidden, rows, rows)

        # With its graphs: once per graph size, which captures each (else each would be
        # captured at its first fallback step, holding that step up); eager: the kernels of the
        # smallest and the largest size.
        sizes = adapter.decode_graphs.batch_sizes if adapter.decode_graphs else []
        writes = kv_write.graph_sizes if kv_write.capture is not None else sorted({1, *sizes[-1:]})
        for bs in writes:
            replays.append(("draft KV write", functools.partial(write_kv, bs)))
    replays += _slot_assignment_warmups(adapter, worker, device)
    replays += _prefill_slot_write_warmups(worker, device)
    return replays + later


# SGLang's speculative slot bookkeeping (``assign_req_to_token_pool_func``), by release: where
# it lives from 0.5.16, in 0.5.13-0.5.15, up to 0.5.12.
SLOT_ASSIGN_MODULES = (
    "sglang.srt.mem_cache.allocation",
    "sglang.srt.speculative.triton_ops.cache_locs",
    "sglang.srt.speculative.spec_utils",
)


def _slot_assignment_warmups(
    adapter: Adapter, worker: Any, device: Any
) -> list[tuple[str, Callable[[], Any]]]:
    """SGLang's ``assign_req_to_token_pool`` for every batch size a step can hand it.

    Every speculative step (and the allocation before a fallback step) records a request's new
    slots with this Triton kernel, whose block constant is the batch size's next power of two:
    it compiles once per power of two, at the first batch of that size after a start with empty
    caches: inside a loaded level, where the scheduler's thread waits for it (0.5.17, a fresh
    H100's first server, 2026-12-05: three of its four levels compiled it, and the one that
    compiled it and SGLang's prefill kernel gave 0.934 of plain decoding, the others
    0.980-0.995). Its offsets are int32 (v2's decode allocation) or int64 (v1's verify and
    extend, the seq_lens); both are compiled. Triton also compiles a variant per pointer
    alignment (16 bytes or not), and the slots come from SGLang's allocator as a view into its
    free list that moves on by whole int64 entries, so half its allocations are 8 bytes off:
    both are compiled (0.5.17, a fresh H100's first server with the aligned variants warmed up,
    2026-12-06: its second c = 64 level compiled the kernel again). Each call assigns nothing:
    every row's range is empty (start == end), so the kernel reads the offsets and stores no
    slot.
    """
    import torch

    assign = _loaded_from(SLOT_ASSIGN_MODULES, "assign_req_to_token_pool_func")
    pool = _request_pool(worker)
    if assign is None or pool is None:
        return []  # its first real uses compile it, as before
    req_to_token = pool.req_to_token
    sizes = adapter.decode_graphs.batch_sizes if adapter.decode_graphs else []
    max_running = getattr(worker.server_args, "max_running_requests", None)
    largest = max([1, *sizes, int(max_running or 1)])

    def assign_nothing(bs: int, dtype: Any, slots_offset: int) -> None:
        rows = torch.zeros(bs, dtype=torch.int64, device=device)  # request-pool row 0
        empty = torch.zeros(bs, dtype=dtype, device=device)  # start == end: no slot stored
        free_list = torch.zeros(bs + slots_offset, dtype=torch.int64, device=device)
        assign(rows, req_to_token, empty, empty, free_list[slots_offset:], bs)

    powers = [1 << k for k in range((largest - 1).bit_length() + 1)]
    return [
        ("slot assignment", functools.partial(assign_nothing, bs, dtype, slots_offset))
        for slots_offset in (0, 1)  # 16-byte aligned, 8 bytes off
        for dtype in (torch.int32, torch.int64)
        for bs in powers
    ]


# SGLang's prefill slot write (``write_req_to_token_pool_triton``), by release: where it lives
# from 0.5.16, in 0.5.13-0.5.15, 0.5.3.post3-0.5.12, up to 0.5.3.post1.
PREFILL_SLOT_WRITE_MODULES = (
    "sglang.kernels.ops.memory.common",
    "sglang.srt.mem_cache.triton_ops.common",
    "sglang.srt.mem_cache.common",
    "sglang.srt.managers.schedule_batch",
)
# Its parameters where the warm-up knows them (0.4.x's lack ``prefix_tensors``: not warmed up).
PREFILL_SLOT_WRITE_PARAMS = (
    "req_to_token_ptr",
    "req_pool_indices",
    "prefix_tensors",
    "pre_lens",
    "seq_lens",
    "extend_lens",
    "out_cache_loc",
    "req_to_token_ptr_stride",
)


def _loaded_from(modules: tuple[str, ...], name: str) -> Any:
    """``name`` from the first of these SGLang modules that is loaded and has it, or None."""
    for module in modules:
        found = getattr(sys.modules.get(module), name, None)
        if found is not None:
            return found
    return None


def _request_pool(worker: Any) -> Any:
    """SGLang's request-to-token pool, which the EAGLE worker or its target runner holds."""
    return getattr(worker, "req_to_token_pool", None) or getattr(
        worker.target_worker.model_runner, "req_to_token_pool", None
    )


def _prefill_slot_write_warmups(worker: Any, device: Any) -> list[tuple[str, Callable[[], Any]]]:
    """SGLang's ``write_req_to_token_pool_triton``, with the slots 16-byte aligned and 8 bytes
    off.

    Every prefill records its requests' slots with this Triton kernel, plain decoding's as
    well as a speculative server's. Its block constant is fixed, so it compiles once per
    variant Triton makes, and Triton makes one per pointer alignment: the slots come from
    SGLang's allocator as a view into its free list that moves on by whole int64 entries, so
    half the prefills hand it slots 8 bytes off, and the first of those after a start with
    empty caches compiles it again inside a loaded level, where the scheduler's thread waits
    (0.5.17, a fresh H100's first server, 2026-12-06: its second c = 64 level compiled it and
    gave 0.932 of plain decoding; the plain server after it met a warm cache). Each call writes
    nothing: one request with no prefix and no new token; its other arguments have the dtypes
    SGLang's prefill passes (int64, the prefix pointers uint64).
    """
    import torch

    kernel = _loaded_from(PREFILL_SLOT_WRITE_MODULES, "write_req_to_token_pool_triton")
    params = tuple(getattr(kernel, "arg_names", ()))
    pool = _request_pool(worker)
    if kernel is None or params != PREFILL_SLOT_WRITE_PARAMS or pool is None:
        return []  # its first real uses compile it, as before
    req_to_token = pool.req_to_token

    def write_nothing(slots_offset: int) -> None:
        zero = torch.zeros(1, dtype=torch.int64, device=device)  # row 0, no prefix, no token
        prefixes = torch.zeros(1, dtype=torch.uint64, device=device)  # never read: no prefix
        free_list = torch.zeros(1 + slots_offset, dtype=torch.int64, device=device)
        kernel[(1,)](
            req_to_token,
            zero,
            prefixes,
            zero,
            zero,
            zero,
            free_list[slots_offset:],
            req_to_token.shape[1],
        )

    return [
        ("prefill slot write", functools.partial(write_nothing, slots_offset))
        for slots_offset in (0, 1)  # 16-byte aligned, 8 bytes off
    ]


def run_warmup(
    replays: list[tuple[str, Callable[[], Any]]],
    budget_s: float,
    stop_together: Callable[[bool], bool],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[int, list[str], str]:
    """Run ``replays`` in order; (how many ran, what raised, why it stopped early or "").

    No replay starts after ``budget_s`` seconds. One that raises is reported and the others
    still run (what it would have compiled then compiles at its first real use).
    ``stop_together(flag)`` answers whether any rank wants to stop, so every TP rank stops
    before the same replay (a replay of a TP model runs collectives; time differs by rank).
    """
    started = clock()
    done, errors = 0, []
    for kind, call in replays:
        late = clock() - started > budget_s
        if stop_together(late):
            why = f"the {budget_s:g}s budget ran out" if late else "another TP rank stopped"
            return done, errors, why
        try:
            call()
        except Exception as exc:  # never break the server
            errors.append(f"a {kind} replay raised {type(exc).__name__}: {exc}")
        else:
            done += 1
    return done, errors, ""


def _warmup_budget() -> float:
    raw = os.environ.get(WARMUP_BUDGET_ENV, "").strip()
    try:
        return float(raw) if raw else DEFAULT_WARMUP_BUDGET_S
    except ValueError:
        return DEFAULT_WARMUP_BUDGET_S


def _warm_up_graphs(adapter: Adapter, worker: Any) -> None:
    """Replay each graph a fallback step uses once, at start-up (bounded; one log line)."""
    if adapter.decode_graphs is None and adapter.draft_extend_width1 is None:
        return  # nothing replays, and a draft KV write alone runs no graph
    runners = [g.runner for g in (adapter.decode_graphs, adapter.draft_extend_width1) if g]
    proven = all(replays_with_replay(type(r)) for r in runners) or on_gpu_proven_release(adapter)
    if not lever_on(WARMUP_ENV, proven):
        return  # by default only where its replays have run on a GPU (<= 0.5.13, 0.5.17)
    started = time.perf_counter()
    budget = _warmup_budget()
    tp_group = adapter.tp_group(worker)
    try:
        replays = _warmup_replays(adapter, worker)
        done, errors, why = run_warmup(
            replays, budget, lambda stop: not _all_ranks_agree(tp_group, not stop)
        )
        _synchronize(getattr(worker.target_worker.model_runner, "device", "cpu"))
    except Exception as exc:  # building the replays failed: the first real steps compile
        replays, done, errors, why = [], 0, [f"{type(exc).__name__}: {exc}"], ""
    counts = collections.Counter(kind for kind, _ in replays)
    kinds = ", ".join(f"{kind} {n}" for kind, n in counts.items()) or "none"
    line = (
        f"[dynspec] warm-up replays at start-up: {done}/{len(replays)} ok ({kinds}) in "
        f"{time.perf_counter() - started:.1f}s"
    )
    if errors:
        line += f"; {len(errors)} raised, the first: {errors[0]}"
    if why:
        line += f"; stopped early: {why}"
    level = logging.WARNING if errors or why else logging.INFO
    _rank0_logger(worker, level)(line)


def _synchronize(device: Any) -> None:
    """Wait for the warm-up's device work (start-up only; never inside a step)."""
    import torch

    kind = torch.device(device).type
    if kind != "cpu":
        torch.get_device_module(kind).synchronize()


# --------------------------------------------------------------------------------------------
# Step profiler: where a fallback step's time goes (CUDA events, off unless asked for)
# --------------------------------------------------------------------------------------------

# N > 0: log the mean per-phase times of fallback steps every N fallback steps.
PROFILE_ENV = "DYNSPEC_PROFILE"


class StepProfiler:
    """Per-phase GPU times (CUDA events) and host times of fallback steps, by batch size, and
    of the prefill batches run from the hook, by mode.

    Marks are recorded without synchronising; every ``every`` steps the oldest pending step
    is resolved with one ``synchronize`` on its last event, so the overlap scheduler keeps
    running ahead except at those rare points. ``describe``: one more line at each report
    (``auto``'s counters and prefill costs: ``GoodputPolicy.describe``).
    """

    def __init__(
        self, every: int, log: Callable[[str], None], describe: Callable[[], str] | None = None
    ) -> None:
        self.every = every
        self._log = log
        self._describe = describe
        # (batch size, or a prefill's mode; marks) of the steps and prefills not yet read
        self._pending: list[tuple[int | str, list[tuple[str, Any, float]]]] = []
        self._current: list[tuple[str, Any, float]] | None = None
        self._device: Any = None
        self._key: int | str = 0
        self._sums: dict[int, dict[str, list[float]]] = {}
        # prefill batches by mode: phase sums as ``_sums``, and the requests they held
        self._prefill_sums: dict[str, dict[str, list[float]]] = {}
        self._prefill_requests: collections.Counter[str] = collections.Counter()
        self._steps = 0

    def start(self, batch_size: int, device: Any) -> None:
        self._begin(batch_size, device)

    def start_prefill(self, requests: int, in_fallback: bool, device: Any) -> None:
        """Time a prefill batch of ``requests`` (it counts in no step's period)."""
        mode = "in fallback" if in_fallback else "speculating"
        self._prefill_requests[mode] += requests
        self._begin(mode, device)

    def _begin(self, key: int | str, device: Any) -> None:
        self._device = device
        self._key = key
        self._current = []
        self.mark("start")

    def mark(self, phase: str) -> None:
        if self._current is None:
            return
        event = None
        if self._device.type == "cuda":
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._current.append((phase, event, time.perf_counter()))

    def finish(self) -> None:
        if self._current is None:
            return
        prefill = isinstance(self._key, str)  # a prefill's key is its mode
        self.mark("prefill" if prefill else "end")
        self._pending.append((self._key, self._current))
        self._current = None
        if prefill:
            return  # read with the steps
        self._steps += 1
        if self._steps % self.every == 0:
            self._resolve_all()
            self._report()

    def _resolve_all(self) -> None:
        for key, marks in self._pending:
            last_event = marks[-1][1]
            if last_event is not None:
                last_event.synchronize()
            if isinstance(key, str):
                sums = self._prefill_sums.setdefault(key, {})
            else:
                sums = self._sums.setdefault(key, {})
            for (_, ev0, t0), (phase, ev1, t1) in itertools.pairwise(marks):
                gpu_ms = ev0.elapsed_time(ev1) if ev0 is not None else 0.0
                entry = sums.setdefault(phase, [0.0, 0.0, 0.0])
                entry[0] += gpu_ms
                entry[1] += (t1 - t0) * 1000.0
                entry[2] += 1
        self._pending.clear()

    def summary(self) -> dict[int, dict[str, tuple[float, float]]]:
        """{batch size: {phase: (mean GPU ms, mean host ms)}} of the steps resolved so far."""
        return {bs: _phase_means(phases) for bs, phases in sorted(self._sums.items())}

    def prefill_summary(self) -> dict[str, dict[str, tuple[float, float]]]:
        """{mode: {phase: (mean GPU ms, mean host ms)}} of the prefill batches resolved so far."""
        return {mode: _phase_means(phases) for mode, phases in sorted(self._prefill_sums.items())}

    def _report(self) -> None:
        """One line per batch size: each phase's mean over the steps that ran it, and the mean
        step (a phase only some steps run, e.g. the draft-extend of the step that checks the
        draft KV write, counts in the total by its share of the steps)."""
        for bs, phases in self.summary().items():
            sums = self._sums[bs].values()
            steps = int(max(v[2] for v in sums))
            parts = " ".join(f"{p}={g:.3f}/{h:.3f}" for p, (g, h) in phases.items())
            total_gpu = sum(v[0] for v in sums) / steps
            total_host = sum(v[1] for v in sums) / steps
            self._log(
                f"[dynspec] profile bs={bs} steps={steps} gpu/host ms: {parts} "
                f"total={total_gpu:.3f}/{total_host:.3f}"
            )
        for mode, phases in self.prefill_summary().items():
            batches = int(max(v[2] for v in self._prefill_sums[mode].values()))
            parts = " ".join(f"{p}={g:.3f}/{h:.3f}" for p, (g, h) in phases.items())
            per_batch = self._prefill_requests[mode] / batches  # every begun one is read here
            self._log(
                f"[dynspec] profile prefill {mode} batches={batches} "
                f"requests/batch={per_batch:.1f} gpu/host ms: {parts}"
            )
        if self._describe is not None:
            self._log(f"[dynspec] profile auto: {self._describe()}")


def _phase_means(phases: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    return {phase: (v[0] / v[2], v[1] / v[2]) for phase, v in phases.items()}


class _NoProfiler:
    def start(self, batch_size: int, device: Any) -> None:
        pass

    def start_prefill(self, requests: int, in_fallback: bool, device: Any) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def finish(self) -> None:
        pass


def _make_profiler(
    worker: Any, describe: Callable[[], str] | None = None
) -> StepProfiler | _NoProfiler:
    raw = os.environ.get(PROFILE_ENV, "").strip()
    every = int(raw) if raw.isdigit() else 0
    if every <= 0:
        return _NoProfiler()
    return StepProfiler(every, _rank0_logger(worker), describe)


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _draft_contexts(adapter: Adapter, tp_context: Any, tp_group: Any) -> Iterator[None]:
    """The contexts the worker wraps its own draft calls in (MoE ones where they exist)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(tp_context(tp_group))
        for key in ("moe_ctx", "moe_a2a_ctx"):
            if adapter.names[key] is not None:
                stack.enter_context(adapter.cls(key)())
        yield


def _one_node_verify_input(adapter: Adapter, root: Any, batch: Any, seq_lens_cpu: Any) -> Any:
    """EagleVerifyInput of a one-node tree per request, rooted at ``root`` (int64)."""
    import torch

    bs = root.shape[0]
    device = root.device
    names = adapter.names
    minus_one = torch.full((bs, 1), -1, dtype=torch.int64, device=device)
    values: dict[str, Any] = {
        "vi_draft_token": root,
        "vi_custom_mask": None,
        "vi_positions": batch.seq_lens.to(torch.int64),
        "vi_index": torch.arange(bs, dtype=torch.int64, device=device)[:, None],
        "vi_next_token": minus_one,
        "vi_next_sibling": minus_one.clone(),
        "vi_cum_len": None,
        "vi_spec_steps": 0,
        "vi_draft_token_num": 1,
        "vi_capture_mode": adapter.cls("capture_mode_cls").FULL,
        "vi_topk": 1,
        # Only the TARGET_VERIFY batch reads these two; set them as the worker's draft() does.
        "vi_seq_lens_sum": _host_seq_lens_sum(batch, seq_lens_cpu, 0),
        "vi_seq_lens_cpu": seq_lens_cpu,
    }
    kwargs = {names[k]: v for k, v in values.items() if names.get(k) is not None}
    return adapter.cls("verify_input_cls")(**kwargs)


def _grammar_mask(adapter: Adapter, batch: Any, vi: Any, device: Any) -> Any:
    """Grammar vocab mask for the one-node tree (the worker's own verify does the same)."""
    next_token = getattr(vi, adapter.name("vi_next_token"))
    mask = adapter.cls("bitmask_fn")(
        batch.reqs,
        vi,
        next_token.cpu(),
        getattr(vi, adapter.name("vi_next_sibling")).cpu(),
        vi.draft_token.view(next_token.shape).cpu(),
        batch.sampling_info.vocab_size,
    )
    if mask is None:
        return None
    # Otherwise the mask of the previous extend would be applied again.
    batch.sampling_info.vocab_mask = None
    return mask.to(device)


def _target_decode(adapter: Adapter, worker_batch: Any, target_worker: Any) -> tuple[Any, bool]:
    """Target forward of a DECODE batch on the DECODE graphs (or eagerly): (logits, graph?)."""
    kwargs: dict[str, Any] = {adapter.name("target_kwarg"): True}
    if adapter.names.get("target_capture_kwarg") is not None:  # 0.5.16+: not read off the batch
        kwargs["capture_hidden_mode"] = adapter.cls("capture_mode_cls").FULL
    runner = target_worker.model_runner
    with target_decode_mode(runner, adapter.name("graph_attr"), adapter.decode_graphs):
        out = target_worker.forward_batch_generation(worker_batch, **kwargs)
    if isinstance(out, tuple):  # 0.4.x: (logits, next_token_ids[, can_run_cuda_graph])
        return out[0], bool(out[2]) if len(out) > 2 else False
    return out.logits_output, bool(out.can_run_cuda_graph)


def _has_grammar(batch: Any) -> bool:
    """Whether any request is grammar-constrained (0.5.5's ModelWorkerBatch has no flag)."""
    flag = getattr(batch, "has_grammar", None)
    if flag is not None:
        return bool(flag)
    return any(g is not None for g in getattr(batch.sampling_info, "grammars", None) or ())


def _is_pure_decode(batch: Any) -> bool:
    mode = batch.forward_mode
    return bool(mode.is_decode()) and not getattr(batch, "is_extend_in_batch", False)


def _other_batch(worker: Any, adapter: Adapter, batch: Any, kwargs: dict[str, Any]) -> Any:
    """A batch that is not a pure decode batch (a prefill, mostly): None, the worker runs it
    as usual; or run from here: in fallback, with the draft KV write in place of the draft's
    pass (``DraftPrefillWrite``), and under ``auto`` a prefill timed and its requests counted
    (``AutoController.finish_prefill``: the acceptance window's bound, ``PrefillCost``)."""
    controller = adapter.controller
    kv_write_only = _prefill_stores_draft_kv_only(adapter, batch)
    if not (isinstance(controller, AutoController) and batch.forward_mode.is_extend()):
        if kv_write_only:
            return _profiled_prefill(_prefill_with_draft_kv_write, worker, adapter, batch, kwargs)
        return None
    run = _prefill_with_draft_kv_write if kv_write_only else _run_own_entry
    started = controller.start_step()
    result = _profiled_prefill(run, worker, adapter, batch, kwargs)
    controller.finish_prefill(started, len(batch.seq_lens))
    return result


def _profiled_prefill(
    run: Callable[[Any, Adapter, Any, dict[str, Any]], Any],
    worker: Any,
    adapter: Adapter,
    batch: Any,
    kwargs: dict[str, Any],
) -> Any:
    """``run`` the prefill batch, timed by the step profiler (``DYNSPEC_PROFILE``) by mode."""
    profiler = adapter.profiler
    assert profiler is not None
    profiler.start_prefill(len(batch.seq_lens), adapter.controller.in_fallback,
                           batch.seq_lens.device)
    result = run(worker, adapter, batch, kwargs)
    profiler.finish()
    return result


def _decide(adapter: Adapter, batch: Any) -> bool:
    bs = effective_batch_size(len(batch.seq_lens), getattr(batch, "global_num_tokens", None))
    return adapter.controller.decide(bs)


def _auto_start(adapter: Adapter) -> Any:
    controller = adapter.controller
    return controller.start_step() if isinstance(controller, AutoController) else None


def _auto_finish(
    adapter: Adapter,
    started: Any,
    batch_size: int,
    tokens_per_request: Callable[[], StepTokens] | None = None,
    requests: Sequence[Any] = (),
) -> None:
    """End the timing of an ``auto`` step: speculative when it has an acceptance reader."""
    controller = adapter.controller
    if isinstance(controller, AutoController):
        speculative = tokens_per_request is not None
        controller.finish_step(started, speculative, batch_size, tokens_per_request, requests)


def _auto_spec_step(worker: Any, adapter: Adapter, batch: Any, kwargs: dict[str, Any]) -> Any:
    """None (the worker speculates as usual), or, under ``auto``, the worker's own speculative
    step run from here, timed, its acceptance read later: the re-entered hook returns None."""
    if not isinstance(adapter.controller, AutoController):
        return None
    bs = len(batch.seq_lens)
    started = adapter.controller.start_step()
    result = _run_own_entry(worker, adapter, batch, kwargs)
    source = adapter.controller.source
    reader = _tokens_per_request_reader(adapter, result, bs) if source else _no_acceptance
    _auto_finish(adapter, started, bs, reader, batch.reqs)
    return result


def _run_own_entry(worker: Any, adapter: Adapter, batch: Any, kwargs: dict[str, Any]) -> Any:
    """The worker's own (patched) entry, run from here: its hook, re-entered, answers None."""
    entry = getattr(worker, adapter.names["entry"])
    adapter.reentered = True
    try:
        return entry(batch, **kwargs)
    finally:
        adapter.reentered = False


def _needs_a_fresh_draft_state(adapter: Adapter) -> bool:
    """Whether a step that would speculate runs one more fallback step first, with SGLang's
    draft-extend: the last step handed on no draft state to draft from (a draft KV write).

    That step is not timed (it is neither kind of step ``auto`` measures); ``auto`` runs the
    speculative step it wanted at the next step.
    """
    if not adapter.draft_state_stale:
        return False
    if isinstance(adapter.controller, AutoController):
        adapter.controller.policy.defer_speculation()
    return True


def _no_acceptance() -> StepTokens:
    """A speculative step whose acceptance cannot be read (0: the measurements skip it)."""
    return StepTokens(0.0)


def _step_tokens(each: list[float]) -> StepTokens:
    return StepTokens(sum(each) / len(each), tuple(each))


def _tokens_per_request_reader(
    adapter: Adapter, result: Any, bs: int
) -> Callable[[], StepTokens]:
    """Reads a speculative step's tokens per request (1 + accepted drafts) once it is done.

    v1 counts accepted drafts on the host (the tuple's 4th item, or the result's count, and
    each request's where the release's result has them, ``gbr_per_req``); v2's
    ``accept_lens`` (bonus included, one per request) is a device tensor: it is copied to
    pinned host memory behind an event, read at a later sync step, never waited for inside a
    step.
    """
    if bs <= 0 or result is None:
        return _no_acceptance
    if adapter.variant == "v1":
        if isinstance(result, tuple):  # 0.4.x: (logits, tokens, bid, accepted drafts, ...)
            tokens = StepTokens(1.0 + float(result[3]) / bs)
            return lambda: tokens
        per_request = adapter.names["gbr_per_req"]
        drafts = getattr(result, per_request) if per_request is not None else None
        if drafts is not None and len(drafts) == bs:
            tokens = _step_tokens([1.0 + float(n) for n in drafts])
        else:
            tokens = StepTokens(1.0 + float(getattr(result, adapter.name("gbr_count"))) / bs)
        return lambda: tokens
    accept_lens = getattr(result, "accept_lens", None)
    if accept_lens is None:
        return _no_acceptance
    if getattr(accept_lens, "is_cuda", False):
        import torch

        host = torch.empty((bs,), dtype=accept_lens.dtype, pin_memory=True)
        host.copy_(accept_lens[:bs], non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def read() -> StepTokens:
            done.synchronize()
            return _step_tokens([float(n) for n in host.tolist()])

        return read
    tokens = _step_tokens([float(n) for n in accept_lens[:bs].tolist()])
    return lambda: tokens


# --------------------------------------------------------------------------------------------
# v1: EAGLEWorker (0.4.4 - 0.5.12.post1)
# --------------------------------------------------------------------------------------------


def maybe_fallback_v1(worker: Any, batch: Any) -> Any:
    """Run one fallback decode step for ``EAGLEWorker`` and return its result, or None.

    None means "run the speculative step as usual": the feature is off (no threshold, refused
    configuration or missing SGLang name), the batch is not a pure decode batch, or the
    controller chose to speculate.
    """
    adapter = _adapter_for(worker, "v1")
    if adapter is None or adapter.reentered:
        return None
    if not _is_pure_decode(batch) or batch.spec_info is None:
        return _other_batch(worker, adapter, batch, {})
    if _has_grammar(batch) and not adapter.grammar:
        return None
    if not _decide(adapter, batch):
        if not _needs_a_fresh_draft_state(adapter):
            return _auto_spec_step(worker, adapter, batch, {})
        return _v1_step(worker, adapter, batch, full_draft=True)
    started = _auto_start(adapter)
    adapter.profiler.start(len(batch.seq_lens), batch.seq_lens.device)
    result = _v1_step(worker, adapter, batch)
    adapter.profiler.finish()
    _auto_finish(adapter, started, len(batch.seq_lens))
    return result


def _v1_step(worker: Any, adapter: Adapter, batch: Any, full_draft: bool = False) -> Any:
    import torch

    names = adapter.names
    draft_input = batch.spec_info
    # (a) the non-allocating half of the worker's _draft_preprocess_decode
    if names["evict_swa"] is not None:
        batch.maybe_evict_swa()
    for req in batch.reqs:
        if hasattr(req, "decode_batch_idx"):
            req.decode_batch_idx += 1
    root = getattr(batch.spec_info, adapter.name("root_field")).to(torch.int64)
    orchestrator = batch.sampling_info.penalizer_orchestrator
    if orchestrator.is_required:  # the same "relaxed" penalties as spec mode
        orchestrator.cumulate_output_tokens(root)
    seq_lens_cpu = getattr(batch, "seq_lens_cpu", None)

    # (b)+(c) one-node verify input; its prepare_for_verify allocates one slot per request
    vi = _one_node_verify_input(adapter, root, batch, seq_lens_cpu)
    vi.prepare_for_verify(batch, worker.page_size)
    slots = batch.out_cache_loc  # one per request; verify() rebinds the batch's
    batch.return_hidden_states = False
    batch.spec_info = vi

    # (d) target DECODE forward on the worker batch: no spec metadata, FULL capture, L+1
    mwb = batch.get_model_worker_batch()
    mwb.spec_info = None
    mwb.capture_hidden_mode = adapter.cls("capture_mode_cls").FULL
    mwb.seq_lens = batch.seq_lens + 1  # a new tensor: batch.seq_lens is advanced by verify()
    if getattr(mwb, "seq_lens_cpu", None) is not None:
        mwb.seq_lens_cpu = mwb.seq_lens_cpu + 1
        mwb.seq_lens_sum = int(mwb.seq_lens_cpu.sum())
    else:
        mwb.seq_lens_sum = int(mwb.seq_lens.sum())
    vocab_mask = None
    target_worker = worker.target_worker
    adapter.profiler.mark("prepare")
    logits_output, can_run_graph = _target_decode(adapter, mwb, target_worker)
    adapter.profiler.mark("target")
    if _has_grammar(batch):
        vocab_mask = _grammar_mask(adapter, batch, vi, root.device)

    # (e) the bookkeeping: sample, append, finish, grammar, KV accounting, seq_lens. SGLang's
    #     verify() does it, or, on a write-only step of a plain greedy batch, the same for one
    #     token without verify()'s tree kernels and host synchronisations
    hidden = logits_output.hidden_states
    stub = _write_only_stub(adapter, draft_input, full_draft)
    tp = _draft_tp(adapter, worker)
    written = False
    if stub is not None and _one_token_verify_applies(adapter, batch):
        tokens = torch.argmax(logits_output.next_token_logits, dim=-1).to(torch.int32)
        # The draft KV write needs only the tokens: launched before the bookkeeping's one host
        # sync, the GPU runs it while the host waits for the tokens, not after the host loop.
        with _draft_contexts(adapter, *tp):
            adapter.draft_kv_write.write(tokens, hidden, batch.seq_lens, slots)
        written = True
        res = _v1_one_token_verify(adapter, batch, tokens)
    else:
        vi.hidden_states = hidden
        verify_args = [batch, logits_output, worker.token_to_kv_pool_allocator, worker.page_size]
        if names["verify_vocab_mask"] is not None:
            verify_args.append(vocab_mask)
        res = vi.verify(*verify_args)
        indices = getattr(res, adapter.name("vo_indices"))
        logits_output.next_token_logits = logits_output.next_token_logits[indices]
        if logits_output.hidden_states is not None:
            logits_output.hidden_states = logits_output.hidden_states[indices]
        if batch.return_logprob:
            if names["logprob_fn"] is not None:
                adapter.cls("logprob_fn")(batch, res, logits_output)
            else:
                worker.add_logprob_values(batch, res, logits_output)
    adapter.profiler.mark("verify")

    # (f) draft KV sync: the draft KV write alone, or the worker's own draft-extend (which
    #     also makes a fresh draft state)
    tokens = getattr(res, adapter.name("vo_tokens"))
    phase = _v1_draft(worker, adapter, batch, res, stub, tokens, hidden, slots, tp, written)
    adapter.profiler.mark(phase)

    # (g) the same result contract as the speculative path, with zero accepted drafts
    if adapter.tuple_arity is not None:
        result = (logits_output, tokens, mwb.bid, 0, can_run_graph)
        return result[: adapter.tuple_arity]
    kwargs: dict[str, Any] = {
        "logits_output": logits_output,
        "next_token_ids": tokens,
        adapter.name("gbr_count"): 0,
        "can_run_cuda_graph": can_run_graph,
    }
    if names["gbr_per_req"] is not None:
        kwargs[names["gbr_per_req"]] = list(getattr(res, adapter.name("vo_per_req")))
    return adapter.cls("result_cls")(**kwargs)


def _v1_draft(
    worker: Any,
    adapter: Adapter,
    batch: Any,
    res: Any,
    stub: tuple[Any, Any, Any] | None,
    tokens: Any,
    hidden: Any,
    slots: Any,
    tp: tuple[Any, Any],
    written: bool,
) -> str:
    """The draft's part of a v1 fallback step, after verify(); the phase it ran.

    As on v2 (``_v2_draft``): once checked, the draft KV write alone (unless ``written``
    already, by the one-token bookkeeping), and the next draft input carries the incoming
    draft state ``stub`` of the requests still running (never drafted from); else, and
    always where ``stub`` is None, the worker's draft-extend. The check needs a step in which
    no request finished (SGLang's draft-extend then stores every row).
    """
    next_input = getattr(res, adapter.name("vo_next_input"))
    kv_write = adapter.draft_kv_write
    rows = next_input.input_ids.shape[0] if stub is not None else 0
    if rows == 0 or not (kv_write.checked or rows == len(batch.reqs)):
        _v1_draft_extend(worker, adapter, batch, next_input, tp)
        adapter.draft_state_stale = False
        return "draft_extend"
    if kv_write.checked:
        if not written:  # (verify() advanced the lengths by the one token)
            with _draft_contexts(adapter, *tp):
                kv_write.write(tokens, hidden, batch.seq_lens - 1, slots)
        if rows != len(batch.reqs):  # as verify() filtered the draft-extend input
            import torch

            running = [i for i, req in enumerate(batch.reqs) if not req.finished()]
            keep = torch.tensor(running, dtype=torch.int64, device=tokens.device)
            stub = tuple(t[keep] for t in stub)
        topk_p, topk_index, draft_hidden = stub
        batch.spec_info = adapter.cls("draft_input_cls")(
            **{adapter.name("root_field"): next_input.input_ids},
            topk_p=topk_p,
            topk_index=topk_index,
            hidden_states=draft_hidden,
            capture_hidden_mode=adapter.cls("capture_mode_cls").LAST,
        )
        batch.input_ids = next_input.input_ids  # as the draft-extend's prepare leaves it
        adapter.draft_state_stale = True
        return "draft_kv_write"
    with _draft_contexts(adapter, *tp):  # the draft-extend stores these slots again
        mine = kv_write.write(tokens, hidden, batch.seq_lens - 1, slots)
    _v1_draft_extend(worker, adapter, batch, next_input, tp)
    adapter.draft_state_stale = False
    _check_draft_kv_write(worker, adapter, kv_write, mine, slots)
    return "draft_extend"


def _write_only_stub(
    adapter: Adapter, draft_input: Any, full_draft: bool
) -> tuple[Any, Any, Any] | None:
    """The draft state a step that may write the draft KV alone hands on, or None: this step
    runs the worker's draft-extend (the write is off or broke, speculation resumes next, or
    the draft input cannot be handed on)."""
    kv_write = adapter.draft_kv_write
    if kv_write is None or kv_write.broken or full_draft:
        return None
    return _draft_state_stub(draft_input)


def _v1_draft_extend(
    worker: Any, adapter: Adapter, batch: Any, next_input: Any, tp: tuple[Any, Any]
) -> None:
    """Draft KV sync + fresh draft state through the worker's own draft-extend."""
    with _draft_contexts(adapter, *tp):
        if adapter.names["vo_next_input"] == "draft_extend_input":
            if next_input.input_ids.shape[0] > 0:
                batch.spec_info = next_input
                batch.spec_info = worker.forward_draft_extend_after_decode(batch)
            else:
                worker._draft_preprocess_idle(batch)
        else:
            batch.spec_info = next_input
            root_after = getattr(next_input, adapter.name("root_field"), None)
            if root_after is not None and root_after.shape[0] > 0:
                worker.forward_draft_extend_after_decode(batch)


# --------------------------------------------------------------------------------------------
# v1: verify()'s bookkeeping for one token, without verify()
# --------------------------------------------------------------------------------------------

# "0" / "1": v1 write-only fallback steps run SGLang's verify() / their own one-token
# bookkeeping; unset: the bookkeeping where it has run on a GPU (``lever_on``).
ONE_TOKEN_VERIFY_ENV = "DYNSPEC_V1_ONE_TOKEN_VERIFY"
ONE_TOKEN_VERIFY_RELEASES = ("0.5.12.post1",)
# The attributes of a request that the v1 verify() reads or writes where its per-request loop
# is the one ``_v1_one_token_verify`` repeats (0.5.12.post1). A verify() that touches another,
# or not one of these, keeps SGLang's verify().
VERIFY_REQUEST_ATTRIBUTES = frozenset(
    {
        "output_ids",
        "require_reasoning",
        "update_reasoning_tokens",
        "check_finished",
        "finished",
        "grammar",
        "kv_committed_len",
        "kv_allocated_len",
        "spec_verify_ct",
        "spec_num_correct_drafts",
        "update_spec_correct_drafts_histogram",
    }
)


def verify_request_attributes(source: str) -> frozenset[str]:
    """The attributes of ``req``, verify()'s request loop variable, that ``source`` touches."""
    tree = ast.parse(textwrap.dedent(source))
    return frozenset(
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "req"
    )


def _one_token_verify_refusal(adapter: Adapter) -> str:
    """Why this release's verify() cannot be replaced by ``_v1_one_token_verify``, or ""."""
    if adapter.draft_kv_write is None:
        return "it runs only on steps of the draft KV write, which is off"
    verify_cls = adapter.cls("verify_input_cls")
    if getattr(sys.modules.get(verify_cls.__module__), "SIMULATE_ACC_LEN", 0) > 0:
        return "SGLang simulates acceptance (SIMULATE_ACC_LEN)"
    try:
        touched = verify_request_attributes(inspect.getsource(verify_cls.verify))
    except (OSError, TypeError, SyntaxError) as exc:
        return f"cannot read verify()'s source ({type(exc).__name__})"
    if touched != VERIFY_REQUEST_ATTRIBUTES:
        extra = sorted(touched - VERIFY_REQUEST_ATTRIBUTES)
        missing = sorted(VERIFY_REQUEST_ATTRIBUTES - touched)
        return (
            "verify()'s request loop is not the one it repeats "
            f"(it also touches: {', '.join(extra) or '-'}; not: {', '.join(missing) or '-'})"
        )
    return ""


def _prepare_one_token_verify(adapter: Adapter, worker: Any) -> None:
    """Whether write-only v1 fallback steps do verify()'s bookkeeping themselves, once."""
    proven = on_gpu_proven_release(adapter, ONE_TOKEN_VERIFY_RELEASES)
    if not lever_on(ONE_TOKEN_VERIFY_ENV, proven):
        adapter.one_token_verify_note = (
            f"SGLang's verify() ({ONE_TOKEN_VERIFY_ENV}=1 turns the one-token bookkeeping on; "
            f"by default only on SGLang {', '.join(ONE_TOKEN_VERIFY_RELEASES)}, where it has "
            "run on a GPU)"
        )
        return
    why = _one_token_verify_refusal(adapter)
    if why:
        adapter.one_token_verify_note = f"SGLang's verify() ({why})"
        _rank0_logger(worker, logging.WARNING)(
            f"[dynspec] v1 one-token bookkeeping not used: {why}; fallback steps run "
            "SGLang's verify()"
        )
        return
    adapter.one_token_verify = True
    adapter.one_token_verify_note = "one-token bookkeeping on write-only steps of greedy batches"


def _one_token_verify_applies(adapter: Adapter, batch: Any) -> bool:
    """Whether the bookkeeping of a step that may write the draft KV alone is
    ``_v1_one_token_verify``'s: the write is checked, and verify() would only argmax: all
    greedy, no penalties, logit bias, custom logit processor, grammar or logprobs. Any other
    step runs SGLang's verify()."""
    if not adapter.one_token_verify or not adapter.draft_kv_write.checked:
        return False
    return samples_by_argmax(batch) and not batch.return_logprob


# The penalties the overlap scheduler's copy of the sampling info carries accumulated
# (``acc_linear_penalties`` <= 0.5.5.post2, ``acc_additive`` / ``acc_scaling`` after).
ACC_PENALTIES = ("linear", "additive", "scaling")


def samples_by_argmax(batch: Any) -> bool:
    """Whether SGLang's sampling of a one-node tree for ``batch`` is one argmax over the
    target's logits: every request greedy, and nothing that changes the logits first (no
    penalties, accumulated or not, no logit bias, custom logit processor or grammar). A
    release whose sampling info lacks the orchestrator, ``logit_bias`` or
    ``has_custom_logit_processor`` never qualifies on a guess; the ``acc_*`` penalties count
    where the release has them (``ACC_PENALTIES``)."""
    info = batch.sampling_info
    # The overlap scheduler hands the worker a copy whose orchestrator is None and whose
    # penalties are accumulated into acc_* (SamplingBatchInfo.copy_for_forward).
    orchestrator = getattr(info, "penalizer_orchestrator", info)
    return (
        bool(info.is_all_greedy)
        and orchestrator is not info
        and not (orchestrator is not None and orchestrator.is_required)
        and getattr(info, "logit_bias", True) is None
        and all(getattr(info, f"acc_{kind}_penalties", None) is None for kind in ACC_PENALTIES)
        and not getattr(info, "has_custom_logit_processor", True)
        and not _has_grammar(batch)
    )


def _v1_one_token_verify(adapter: Adapter, batch: Any, tokens: Any) -> Any:
    """What SGLang's v1 verify() does for a one-node tree of a greedy batch, and its output.

    ``tokens`` are the argmax (verify()'s greedy tree kernel accepts exactly that); then, as
    verify(): the lengths grow by one, each request appends its token and checks whether it
    finished, its KV accounting and speculative counters advance (0 drafts accepted), and
    the batch keeps the KV slots of the requests still running. One host synchronisation
    (the tokens) where verify() has five, plus a Python loop per accepted token. Nothing is
    freed: a one-node tree has no rejected slot. The output has the fields the rest of the
    step reads: the tokens, the next draft-extend input's ``input_ids`` (the running
    requests' tokens) and the accepted drafts per request; verify()'s logits indices are the
    identity for a one-node tree, so the logits stay as they are.
    """
    import torch

    batch.seq_lens.add_(1)
    batch.seq_lens_cpu.add_(1)
    think_end_id = batch.model_config.think_end_id
    running = []
    for i, (req, token) in enumerate(zip(batch.reqs, tokens.tolist(), strict=True)):
        req.output_ids.append(token)
        if req.require_reasoning and think_end_id is not None:
            req.update_reasoning_tokens(token, think_end_id)
        req.check_finished()
        req.kv_committed_len += 1
        req.kv_allocated_len = req.kv_committed_len
        req.spec_verify_ct += 1  # (spec_num_correct_drafts: verify() adds 0 to it)
        req.update_spec_correct_drafts_histogram(0)
        if not req.finished():
            running.append(i)
    next_tokens = tokens
    if len(running) < len(batch.reqs):
        keep = torch.tensor(running, dtype=torch.int64, device=tokens.device)
        batch.out_cache_loc = batch.out_cache_loc[keep]
        next_tokens = tokens[keep]
    return types.SimpleNamespace(
        **{
            adapter.name("vo_tokens"): tokens,
            adapter.name("vo_next_input"): types.SimpleNamespace(input_ids=next_tokens),
            adapter.name("vo_per_req"): [0] * len(batch.reqs),
        }
    )


# --------------------------------------------------------------------------------------------
# v2: EAGLEWorkerV2 (0.5.4 - 0.5.23)
# --------------------------------------------------------------------------------------------


# "0" / "1": greedy v2 fallback steps sample through SGLang's sampler / by one argmax;
# unset: the argmax where it has run on a GPU (``lever_on``).
GREEDY_ARGMAX_ENV = "DYNSPEC_GREEDY_ARGMAX"
# Where it has run on a GPU: 0.5.17 (H200, 2026-12-04: greedy outputs identical to plain
# decoding, 4 prompts at c = 1 and 16 x 256 tokens at c = 64 and at c = 128, on four servers;
# the sampling phase of a bs-64 fallback step 0.050 / 0.089 ms GPU / host against 0.058 / 0.37)
# and 0.5.12.post1 (H100, 2026-12-05: the same comparison on three servers, and 0 mismatched
# tokens in the crafted greedy check).
GREEDY_ARGMAX_RELEASES: tuple[str, ...] = ("0.5.12.post1", "0.5.17")
# SGLang's sampler does more than the argmax while one of these is set (a truthy value).
GREEDY_ARGMAX_REFUSING_ENVS = ("SGLANG_SIMULATE_ACC_LEN", "SGLANG_SANITIZE_NAN_LOGITS")


@dataclass
class GreedyArgmax:
    """A greedy fallback step's tokens by one argmax over the target's logits.

    For a batch that ``samples_by_argmax``, SGLang's sampler of a one-node tree returns the
    argmax and the same accept length for every request, after a verify input and a tree
    kernel that cost a dozen small kernels per step; plain decoding's sampler takes the
    argmax alone. ``accept_len`` is what the release's sampler reported on the first such
    step, which also compared its tokens with the argmax (``matches``); until then every step
    runs the sampler, and a difference (``broken``) keeps it for the rest of the process.
    """

    accept_len: int | None = None
    broken: str = ""

    @property
    def checked(self) -> bool:
        return self.accept_len is not None

    def sample(self, logits: Any) -> tuple[Any, Any]:
        """(tokens, accept lengths) as the release's sampler returns them, by one argmax."""
        import torch

        predict = torch.argmax(logits, dim=-1).to(torch.int32)
        accept_lens = torch.full_like(predict, int(self.accept_len or 0))
        return predict, accept_lens

    @staticmethod
    def matches(logits: Any, predict: Any, accept_lens: Any) -> tuple[int | None, str]:
        """The sampler's accept length where its ``predict`` is the argmax of ``logits`` in
        the argmax's dtype and shape and every request's ``accept_lens`` is the same (else
        None), and what was compared. One host sync."""
        import torch

        mine = torch.argmax(logits, dim=-1).to(torch.int32)
        if predict.dtype != mine.dtype or predict.shape != mine.shape:
            shape = tuple(predict.shape)
            return None, f"tokens {predict.dtype} {shape}, argmax {tuple(mine.shape)}"
        if accept_lens.dtype != mine.dtype or accept_lens.shape != mine.shape:
            return None, f"accept lengths {accept_lens.dtype} {tuple(accept_lens.shape)}"
        differ = int((predict != mine).sum())
        lengths = sorted(set(accept_lens.tolist()))
        if differ or len(lengths) != 1:
            return None, f"{differ} of {mine.shape[0]} tokens differ, accept lengths {lengths}"
        return lengths[0], f"{mine.shape[0]} tokens equal, accept length {lengths[0]}"


def _greedy_argmax_refusal() -> str:
    """Why SGLang's sampler does more than the argmax in this process, or ""."""
    for name in GREEDY_ARGMAX_REFUSING_ENVS:
        value = os.environ.get(name, "").strip().lower()
        if value not in ("", "0", "false", "no", "off"):
            return f"{name}={value}"
    return ""


def _prepare_greedy_argmax(adapter: Adapter, worker: Any) -> None:
    """Whether greedy v2 fallback steps sample by one argmax, once per process."""
    proven = on_gpu_proven_release(adapter, GREEDY_ARGMAX_RELEASES)
    if not lever_on(GREEDY_ARGMAX_ENV, proven):
        where = ", ".join(GREEDY_ARGMAX_RELEASES) or "no release yet"
        adapter.greedy_argmax_note = (
            f"SGLang's sampler ({GREEDY_ARGMAX_ENV}=1 turns the argmax on; by default only "
            f"where it has run on a GPU: {where})"
        )
        return
    why = _greedy_argmax_refusal()
    if why:
        adapter.greedy_argmax_note = f"SGLang's sampler ({why})"
        _rank0_logger(worker, logging.WARNING)(
            f"[dynspec] one-argmax sampling not used: {why}; fallback steps run SGLang's sampler"
        )
        return
    adapter.greedy_argmax = GreedyArgmax()
    adapter.greedy_argmax_note = "one argmax on greedy steps, once checked against the sampler"


def maybe_fallback_v2(worker: Any, batch: Any, **kwargs: Any) -> Any:
    """Run one fallback decode step for ``EAGLEWorkerV2`` and return its result, or None.

    ``batch`` is the ModelWorkerBatch (<= 0.5.12.post1) or ScheduleBatch (0.5.13+) the worker
    received; ``kwargs`` are the worker's other parameters: ``on_publish`` (0.5.13+),
    ``grammar_barrier`` (0.5.17+), ``pp_proxy_tensors`` (0.5.19+; pipeline parallelism is
    refused, so it is always None here).
    """
    adapter = _adapter_for(worker, "v2")
    if adapter is None or adapter.reentered:
        return None
    if not _is_pure_decode(batch) or batch.spec_info is None:
        settle_draft_kv(adapter, worker)  # a prefill: its draft pass stores into fresh slots
        return _other_batch(worker, adapter, batch, kwargs)
    stride = int(worker.speculative_num_draft_tokens)
    if (_has_grammar(batch) and not adapter.grammar) or getattr(
        worker.draft_worker, "speculative_num_draft_tokens", stride
    ) != stride:  # (mid-swap: the scheduler and the draft-extend would disagree on stride)
        settle_draft_kv(adapter, worker)
        return None
    on_publish, grammar_barrier = kwargs.get("on_publish"), kwargs.get("grammar_barrier")
    if not _decide(adapter, batch):
        if not _needs_a_fresh_draft_state(adapter):  # (nothing kept: see settle_draft_kv)
            return _auto_spec_step(worker, adapter, batch, kwargs)
        return _v2_step(worker, adapter, batch, on_publish, grammar_barrier, full_draft=True)
    started = _auto_start(adapter)
    adapter.profiler.start(len(batch.seq_lens), batch.seq_lens.device)
    result = _v2_step(worker, adapter, batch, on_publish, grammar_barrier)
    adapter.profiler.finish()
    _auto_finish(adapter, started, len(batch.seq_lens))
    return result


def _v2_step(
    worker: Any,
    adapter: Adapter,
    batch: Any,
    on_publish: Any,
    grammar_barrier: Any = None,
    full_draft: bool = False,
) -> Any:
    import torch

    draft_input = batch.spec_info  # the FutureMap has already been resolved into it
    root = getattr(draft_input, adapter.name("root_field")).to(torch.int64)
    bs = len(batch.seq_lens)
    stride = int(worker.speculative_num_draft_tokens)
    device = batch.seq_lens.device
    # These were made on the schedule stream and get rebound below; as verify() does, tell the
    # caching allocator not to recycle them before this (forward) stream is done with them.
    if device.type != "cpu":
        stream = torch.get_device_module(device).current_stream()
        for tensor in (
            batch.seq_lens,
            batch.req_pool_indices,
            batch.input_ids,
            batch.out_cache_loc,
        ):
            if tensor is not None:
                tensor.record_stream(stream)

    # A one-node tree accepts one token per request, so the lengths after this step are
    # known before it runs. Where the scheduler waits on ``verify_done`` before it prepares
    # the next batch (<= 0.5.12.post1), record it now: SGLang records it after its verify's
    # sampling, and then its draft's work hides the scheduler's; a fallback step has almost
    # no draft work after sampling, so the GPU would idle while the scheduler prepares.
    # The same on 0.5.13+, whose scheduler waits on the event ``on_publish`` records before
    # it prepares the next batch: publish the lengths before the target forward, not after
    # the sampling as SGLang's verify does (plain decoding's scheduler does not wait at all).
    new_seq_lens = batch.seq_lens + 1
    verify_done = _event_recorded(device) if adapter.names["di_verify_done"] else None
    if on_publish is not None:
        on_publish(new_seq_lens)

    # The scheduler over-allocated >= stride slots from L on; read them (never allocate).
    req_to_token = worker.req_to_token_pool.req_to_token
    offsets = batch.seq_lens.to(torch.int64)[:, None] + torch.arange(stride, device=device)
    slots = req_to_token[batch.req_pool_indices.to(torch.int64)[:, None], offsets].to(torch.int64)

    # 1) target DECODE forward on a shallow copy: the batch's tensors are shared with the
    #    schedule stream and must not change in place.
    decode_batch = copy.copy(batch)
    decode_batch.input_ids = root
    decode_batch.out_cache_loc = slots[:, 0].contiguous()
    decode_batch.seq_lens = batch.seq_lens + 1
    seq_lens_cpu = getattr(batch, "seq_lens_cpu", None)
    if seq_lens_cpu is not None:
        decode_batch.seq_lens_cpu = seq_lens_cpu + 1
    decode_batch.seq_lens_sum = _host_seq_lens_sum(batch, seq_lens_cpu, bs)
    decode_batch.spec_info = None
    decode_batch.capture_hidden_mode = adapter.cls("capture_mode_cls").FULL
    adapter.profiler.mark("prepare")
    logits_output, can_run_graph = _target_decode(adapter, decode_batch, worker.target_worker)
    adapter.profiler.mark("target")

    # 2) sampling: one argmax for a greedy batch (once checked), else a one-node verify input
    #    through the release's sampler, grammar mask included
    batch.input_ids = root  # as SGLang's verify does (input = the tree); sample() reads it
    predict, accept_lens = _v2_tokens(worker, adapter, root, batch, logits_output, grammar_barrier)
    adapter.profiler.mark("sample")

    # 3) the result, padded to the stride N where the scheduler reads the worker's stride (or
    #    the width-1 draft-extend is off); unpadded where it travels on the result
    hidden = logits_output.hidden_states
    width1 = adapter.draft_extend_width1
    if width1 is not None and not width1.covers(bs):
        width1 = None
    narrow_draft = width1 is not None or adapter.draft_kv_write is not None
    out_stride = 1 if narrow_draft and adapter.names["gbr_stride"] is not None else stride
    tokens = predict if out_stride == 1 else _rows_padded(predict, stride)
    if batch.return_logprob:
        _v2_logprobs(worker, adapter, batch, logits_output, predict, bs)
    result = _v2_result(
        adapter,
        draft_input,
        logits_output,
        tokens,
        accept_lens,
        new_seq_lens,
        verify_done,
        can_run_graph,
        out_stride,
        keep_alive=decode_batch,
    )
    adapter.profiler.mark("pad_result")

    # 4) draft KV sync: the draft KV write alone, or SGLang's draft-extend (width-1, else the
    #    N-token one, where only row i*N is real)
    phase = _v2_draft(
        worker, adapter, batch, result, draft_input, slots, predict, hidden, width1, full_draft
    )
    adapter.profiler.mark(phase)
    return result


def settle_draft_kv(adapter: Adapter, worker: Any) -> None:
    """Store the draft KV writes kept from earlier fallback steps (``DraftKvWrite.defer``), as
    anything but a write-only fallback step must first: the draft reads its KV, and a prefill
    or a draft-extend may write slots a kept row still targets. (A speculative step always
    comes after a step with SGLang's draft-extend, since a write-only step leaves the draft
    state stale: that step stores them.)"""
    kv_write = adapter.draft_kv_write
    if kv_write is not None and kv_write.kept:
        with _draft_contexts(adapter, *_draft_tp(adapter, worker)):
            kv_write.flush()


def _prefill_stores_draft_kv_only(adapter: Adapter, batch: Any) -> bool:
    """Whether this prefill runs with ``DraftPrefillWrite``: turned on, not broken, the draft
    KV write checked on this server, and fallback steps running (a prefill while speculating
    keeps SGLang's draft pass: the next step drafts from it)."""
    prefill = adapter.draft_prefill_write
    if prefill is None or prefill.broken or not adapter.controller.in_fallback:
        return False
    kv_write = prefill.kv_write
    return kv_write.checked and not kv_write.broken and bool(batch.forward_mode.is_extend())


def _prefill_with_draft_kv_write(
    worker: Any, adapter: Adapter, batch: Any, kwargs: dict[str, Any]
) -> Any:
    """The worker's own prefill, run from here with the draft model's ``forward`` replaced for
    its duration: each draft pass the prefill write takes stores K and V and returns zeros
    (the first also runs SGLang's pass and is compared with it). The re-entered hook answers
    None. Where the direct prefill is taken, the draft worker's pass is replaced instead."""
    prefill = adapter.draft_prefill_write
    assert prefill is not None
    direct = adapter.draft_prefill_direct
    if direct is not None and not direct.broken:
        return _prefill_without_draft_pass(worker, adapter, prefill, direct, batch, kwargs)
    inner = prefill.kv_write.inner
    sglang_forward = inner.forward
    written: list[tuple[Any, Any, Any]] = []  # (K, V, slots) of each pass it took

    def forward(input_ids: Any, positions: Any, forward_batch: Any, *args: Any, **kw: Any):
        def sglang_pass() -> Any:
            return sglang_forward(input_ids, positions, forward_batch, *args, **kw)

        embeds = args[0] if args else kw.get("input_embeds")
        if not prefill.takes(input_ids, forward_batch, embeds):
            return sglang_pass()
        loc = forward_batch.out_cache_loc
        hidden = forward_batch.spec_info.hidden_states
        try:
            k, v = prefill.kv_write.write(input_ids, hidden, positions, loc)
        except Exception as exc:  # SGLang's pass stores these slots over whatever it left
            why = _prefill_lever_raised(worker, exc, "draft prefill write", "keep")
            prefill.broken = f"the write raised {why}"
            return sglang_pass()
        written.append((k, v, loc))
        if not prefill.checked:  # SGLang's pass stores the same slots again: compared below
            return sglang_pass()
        return prefill.placeholder(int(input_ids.shape[0]))

    # SGLang 0.5.17+ runs the draft's prefill from a CUDA graph captured at start-up, which
    # never calls the forward set here: the runner goes without it for this pass (eager).
    runner = _draft_runner(adapter, worker)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_instance_attribute_set(inner, "forward", forward))
        if vars(runner).get(DRAFT_PREFILL_GRAPH_ATTR) is not None:
            stack.enter_context(_attributes_set(runner, {DRAFT_PREFILL_GRAPH_ATTR: None}))
        # the worker's own entry: it enters the draft's TP context around its pass
        result = _run_own_entry(worker, adapter, batch, kwargs)
    _after_prefill_write(worker, adapter, prefill, written)
    return result


def _prefill_lever_raised(worker: Any, exc: Exception, lever: str, verb: str) -> str:
    """One warning (TP rank 0) that ``lever`` raised ``exc`` and prefills ``verb`` SGLang's
    draft pass from now on; the exception in words."""
    raised = f"{type(exc).__name__}: {exc}"
    _rank0_logger(worker, logging.WARNING)(
        f"[dynspec] {lever} raised {raised}; prefills {verb} SGLang's draft pass"
    )
    return raised


@contextlib.contextmanager
def _instance_attribute_set(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.name`` for the block; afterwards the one ``obj`` itself held (a compiled
    forward, a wrapper), or none again, so that the class's own shows through."""
    own = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own is None:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


def _after_prefill_write(
    worker: Any,
    adapter: Adapter,
    prefill: DraftPrefillWrite,
    written: list[tuple[Any, Any, Any]],
    direct: DraftPrefillDirect | None = None,
) -> None:
    """The first prefill the write took is checked; after a later one the draft state handed
    on is stale."""
    if written and not prefill.checked:
        _check_draft_prefill_write(worker, adapter, prefill, written, direct)
    elif written:
        adapter.draft_state_stale = True


def _prefill_without_draft_pass(
    worker: Any,
    adapter: Adapter,
    prefill: DraftPrefillWrite,
    direct: DraftPrefillDirect,
    batch: Any,
    kwargs: dict[str, Any],
) -> Any:
    """The worker's own prefill, run from here with its draft worker's draft pass replaced
    for its duration (``DraftPrefillDirect``): each pass it takes stores the draft's K and V
    of the tokens built here and hands on a stale draft state. The first also runs SGLang's
    pass, which stores the same slots again, and is compared with it: K and V, the tokens,
    the draft state's make."""
    draft = worker.draft_worker
    sglang_pass = getattr(draft, DRAFT_PREFILL_METHOD)
    written: list[tuple[Any, Any, Any]] = []  # (K, V, slots) of each pass it took

    def draft_pass(batch: Any, target_hidden_states: Any, next_token_ids: Any, *args, **kw):
        def sglang() -> Any:
            return sglang_pass(batch, target_hidden_states, next_token_ids, *args, **kw)

        if not direct.takes(batch, target_hidden_states, next_token_ids, [*args, *kw.values()]):
            return sglang()
        loc = batch.out_cache_loc
        try:
            tokens, positions = direct.inputs(batch, next_token_ids)
            k, v = prefill.kv_write.write(tokens, target_hidden_states, positions, loc)
        except Exception as exc:  # SGLang's pass stores these slots over whatever it left
            why = _prefill_lever_raised(worker, exc, "direct draft prefill", "run")
            direct.broken = f"it raised {why}"
            return sglang()
        written.append((k, v, loc))
        if not prefill.checked:  # SGLang's pass stores the same slots again: compared below
            state = sglang()
            direct.broken = direct.adopt(state, next_token_ids, tokens, batch.input_ids)
            return state
        batch.input_ids = tokens  # as SGLang's pass leaves it
        return direct.state(next_token_ids)

    with _instance_attribute_set(draft, DRAFT_PREFILL_METHOD, draft_pass):
        result = _run_own_entry(worker, adapter, batch, kwargs)
    _after_prefill_write(worker, adapter, prefill, written, direct)
    return result


def _check_draft_prefill_write(
    worker: Any,
    adapter: Adapter,
    prefill: DraftPrefillWrite,
    written: list[tuple[Any, Any, Any]],
    direct: DraftPrefillDirect | None = None,
) -> None:
    """Compare the prefill write with what SGLang's draft pass just stored (once; one host
    sync and, with TP, one CPU all-reduce each for the write and the direct prefill); every
    rank keeps or drops each together. The K and V the direct prefill wrote are those of the
    tokens and positions it built: where they match, so did those."""
    try:
        results = [prefill.kv_write.matches(k, v, loc) for k, v, loc in written]
        ok = all(matched for matched, _ in results)
        detail = "; ".join(d for _, d in results)
    except Exception as exc:  # cannot read the pool back: stay with SGLang's pass
        ok, detail = False, f"reading the KV pool back raised {type(exc).__name__}: {exc}"
    if not _all_ranks_agree(adapter.tp_group(worker), ok) and ok:
        ok, detail = False, f"{detail}; another TP rank's differed"
    tokens = sum(int(loc.shape[0]) for *_, loc in written)
    if direct is not None:
        if not ok:
            direct.broken = direct.broken or "its K and V differ from SGLang's"
        elif not _all_ranks_agree(adapter.tp_group(worker), not direct.broken):
            direct.broken = direct.broken or "another TP rank's draft state differed"
        adapter.draft_prefill_direct_note = (
            f"SGLang's draft pass ({direct.broken})"
            if direct.broken
            else f"prefills in fallback skip SGLang's draft pass (checked over {tokens} tokens)"
        )
    if ok:
        prefill.checked = True
        adapter.draft_prefill_write_note = (
            f"prefills in fallback store the draft KV only (checked over {tokens} tokens: "
            f"{detail})"
        )
        how = "the draft KV only"
        if direct is not None:
            how = (
                f"the draft KV only, inside SGLang's draft pass (not skipped: {direct.broken})"
                if direct.broken
                else "the draft KV only, without SGLang's draft pass"
            )
        _rank0_logger(worker)(
            f"[dynspec] draft prefill write matches SGLang's draft pass over {tokens} tokens "
            f"({detail}): prefills while fallback steps run now store {how}"
        )
        return
    prefill.broken = detail
    adapter.draft_prefill_write_note = f"SGLang's draft pass (the prefill write differed: {detail})"
    _rank0_logger(worker, logging.WARNING)(
        f"[dynspec] draft prefill write differs from SGLang's draft pass over {tokens} tokens "
        f"({detail}); prefills keep SGLang's draft pass"
    )


def _v2_draft(
    worker: Any,
    adapter: Adapter,
    batch: Any,
    result: Any,
    draft_input: Any,
    slots: Any,
    predict: Any,
    hidden: Any,
    width1: Width1DraftExtend | None,
    full_draft: bool,
) -> str:
    """The draft's part of a fallback step; the phase it ran.

    Once checked, the draft KV write alone: the next draft input gets the incoming draft state
    (never drafted from; ``draft_state_stale``). Else, and always where ``full_draft`` (the
    step before speculation resumes), SGLang's draft-extend; the first step that could use an
    unchecked write stores its K and V first, then SGLang's draft-extend stores the same slots
    again, and the two are compared.
    """
    kv_write = adapter.draft_kv_write
    stub = None
    if kv_write is not None and not kv_write.broken and not full_draft:
        stub = _draft_state_stub(draft_input)
    if kv_write is None or stub is None:  # SGLang's draft-extend alone (the write is off)
        settle_draft_kv(adapter, worker)
        phase = _v2_draft_extend(worker, adapter, batch, result, slots, predict, hidden, width1)
        adapter.draft_state_stale = False
        return phase
    loc = slots[:, 0].contiguous()
    tp = _draft_tp(adapter, worker)
    if kv_write.checked:
        with _draft_contexts(adapter, *tp):
            kv_write.defer(predict, hidden, batch.seq_lens, loc)
        next_input = result.next_draft_input
        next_input.topk_p, next_input.topk_index, next_input.hidden_states = stub
        batch.input_ids, batch.out_cache_loc = predict, loc  # as SGLang's prepare leaves them
        adapter.draft_state_stale = True
        return "draft_kv_write"
    with _draft_contexts(adapter, *tp):  # the draft-extend stores these slots again
        mine = kv_write.write(predict, hidden, batch.seq_lens, loc)
    phase = _v2_draft_extend(worker, adapter, batch, result, slots, predict, hidden, width1)
    adapter.draft_state_stale = False
    _check_draft_kv_write(worker, adapter, kv_write, mine, loc)
    return phase


def _check_draft_kv_write(
    worker: Any, adapter: Adapter, kv_write: DraftKvWrite, mine: tuple[Any, Any], loc: Any
) -> None:
    """Compare the draft KV write with what SGLang's draft-extend just stored (once; one
    host sync and, with TP, one CPU all-reduce); every rank keeps or drops it together."""
    try:
        ok, detail = kv_write.matches(*mine, loc)
    except Exception as exc:  # cannot read the pool back: stay with the draft-extend
        ok, detail = False, f"reading the KV pool back raised {type(exc).__name__}: {exc}"
    if not _all_ranks_agree(adapter.tp_group(worker), ok) and ok:
        ok, detail = False, f"{detail}; another TP rank's differed"
    bs = int(loc.shape[0])
    if ok:
        kv_write.checked = True
        adapter.draft_kv_write_note = (
            f"draft KV write (checked at bs {bs}: {detail}; {kv_write.runs})"
        )
        _rank0_logger(worker)(
            f"[dynspec] draft KV write matches SGLang's draft-extend at bs={bs} ({detail}): "
            "fallback steps now write the draft KV only; the step before speculation resumes "
            "runs the draft-extend"
        )
        return
    kv_write.broken = detail
    adapter.draft_kv_write_note = f"SGLang's draft-extend (the draft KV write differed: {detail})"
    _rank0_logger(worker, logging.WARNING)(
        f"[dynspec] draft KV write differs from SGLang's draft-extend at bs={bs} ({detail}); "
        "fallback steps keep SGLang's draft-extend"
    )


def _event_recorded(device: Any) -> Any:
    """A device event recorded now on the current stream."""
    import torch

    event = torch.get_device_module(device).Event()
    event.record()
    return event


def _host_seq_lens_sum(batch: Any, seq_lens_cpu: Any, extra: int) -> int | None:
    """``sum(seq_lens) + extra`` from what SGLang keeps on the host: no device sync.

    Its CPU copy of seq_lens (every v2 release up to 0.5.12.post1 has one), else its int
    ``seq_lens_sum``; None when it keeps neither, as 0.5.13's sync-free decode itself does.
    """
    if seq_lens_cpu is not None:
        return int(seq_lens_cpu.sum()) + extra
    total = getattr(batch, "seq_lens_sum", None)
    return total + extra if isinstance(total, int) else None


def _rows_padded(rows: Any, stride: int) -> Any:
    """``rows`` at rows 0, stride, 2 * stride, ... of zeros ``stride`` times as long."""
    padded = rows.new_zeros((rows.shape[0] * stride, *rows.shape[1:]))
    padded[::stride] = rows
    return padded


def _result_view(result: Any, tokens: Any, hidden: Any) -> Any:
    """A shallow copy of ``result`` whose draft-extend inputs are ``tokens`` and ``hidden``.

    Its ``next_draft_input`` is the result's own, so the draft-extend fills the one the
    scheduler gets.
    """
    view = copy.copy(result)
    view.logits_output = copy.copy(result.logits_output)
    view.logits_output.hidden_states = hidden
    view.next_token_ids = tokens
    return view


def _v2_draft_extend(
    worker: Any,
    adapter: Adapter,
    batch: Any,
    result: Any,
    slots: Any,
    predict: Any,
    hidden: Any,
    width1: Width1DraftExtend | None,
) -> str:
    """Keep the draft KV warm through the draft worker's own draft-extend; the phase it ran."""
    draft = worker.draft_worker
    stride = int(worker.speculative_num_draft_tokens)
    with _draft_contexts(adapter, *_v2_draft_tp(adapter, draft)):
        if width1 is not None and _draft_extend_width1_step(
            worker, draft, batch, result, slots, predict, hidden, width1
        ):
            return "draft_extend_w1"
        batch.out_cache_loc = slots.reshape(-1)
        if result.next_token_ids.shape[0] == predict.shape[0] * stride:
            result.logits_output.hidden_states = _rows_padded(hidden, stride)
            draft._draft_extend_for_decode(batch, result)
        else:  # an unpadded (stride-1) result whose width-1 draft-extend just failed
            wide = _result_view(result, _rows_padded(predict, stride), _rows_padded(hidden, stride))
            draft._draft_extend_for_decode(batch, wide)
    return "draft_extend"


def _draft_extend_width1_step(
    worker: Any,
    draft: Any,
    batch: Any,
    result: Any,
    slots: Any,
    predict: Any,
    hidden: Any,
    width1: Width1DraftExtend,
) -> bool:
    """The draft-extend at one token per request; False when it raised (the batch restored).

    Each request's one real token goes in at position L, slot L, with the target's hidden
    state of L: row i * N of the N-token draft-extend. Its ``accept_lens`` (1) select that row,
    so the next draft input gets the same topk and hidden state. After a failure every later
    step runs the N-token draft-extend (one warning).
    """
    if not hasattr(batch, "__dict__"):
        return False
    snapshot = dict(vars(batch))  # prepare_for_extend_to_fill_draft_kvcache rebinds fields
    narrow = result
    if result.next_token_ids.shape[0] != predict.shape[0]:
        narrow = _result_view(result, predict, hidden)
    batch.out_cache_loc = slots[:, 0].contiguous()
    try:
        with draft_extend_width1_mode(draft, width1):
            draft._draft_extend_for_decode(batch, narrow)
    except Exception as exc:  # stay correct: the N-token draft-extend redoes the same rows
        vars(batch).clear()
        vars(batch).update(snapshot)
        width1.broken = f"{type(exc).__name__}: {exc}"
        _rank0_logger(worker, logging.WARNING)(
            f"[dynspec] width-1 draft-extend failed at bs={predict.shape[0]} ({width1.broken}); "
            "fallback steps run the N-token draft-extend from now on"
        )
        return False
    return True


def _v2_tokens(
    worker: Any,
    adapter: Adapter,
    root: Any,
    batch: Any,
    logits_output: Any,
    grammar_barrier: Any,
) -> tuple[Any, Any]:
    """(predict, accept_lens) of a fallback step: one argmax where ``GreedyArgmax`` is on,
    checked and the batch ``samples_by_argmax``; else SGLang's sampler over a one-node tree,
    whose first greedy step checks the argmax."""
    greedy = adapter.greedy_argmax
    if greedy is not None and (greedy.broken or not samples_by_argmax(batch)):
        greedy = None
    if greedy is not None and greedy.checked:
        return greedy.sample(logits_output.next_token_logits)
    vi = _one_node_verify_input(adapter, root, batch, getattr(batch, "seq_lens_cpu", None))
    predict, accept_lens = _v2_sample(adapter, vi, batch, logits_output, grammar_barrier)
    if greedy is not None:
        _check_greedy_argmax(worker, adapter, greedy, logits_output, predict, accept_lens)
    return predict, accept_lens


def _check_greedy_argmax(
    worker: Any,
    adapter: Adapter,
    greedy: GreedyArgmax,
    logits_output: Any,
    predict: Any,
    accept_lens: Any,
) -> None:
    """Compare the argmax with what SGLang's sampler just returned (once; one host sync and,
    with TP, one CPU all-reduce); every rank keeps or drops it together."""
    try:
        accept_len, detail = greedy.matches(logits_output.next_token_logits, predict, accept_lens)
    except Exception as exc:  # cannot compare: keep the sampler
        accept_len, detail = None, f"comparing raised {type(exc).__name__}: {exc}"
    ok = _all_ranks_agree(adapter.tp_group(worker), accept_len is not None)
    if accept_len is not None and not ok:
        detail = f"{detail}; another TP rank's differed"
    bs = int(predict.shape[0])
    if ok:
        greedy.accept_len = accept_len
        adapter.greedy_argmax_note = f"one argmax on greedy steps (checked at bs {bs}: {detail})"
        _rank0_logger(worker)(
            f"[dynspec] greedy fallback steps sample by one argmax: it matches SGLang's sampler "
            f"at bs={bs} ({detail})"
        )
        return
    greedy.broken = detail
    adapter.greedy_argmax_note = f"SGLang's sampler (the argmax differed: {detail})"
    _rank0_logger(worker, logging.WARNING)(
        f"[dynspec] one argmax differs from SGLang's sampler at bs={bs} ({detail}); "
        "fallback steps keep SGLang's sampler"
    )


def _v2_sample(
    adapter: Adapter, vi: Any, batch: Any, logits_output: Any, grammar_barrier: Any
) -> tuple[Any, Any]:
    """(predict, accept_lens) from the release's sampler, with the grammar mask it takes."""
    names = adapter.names
    mask = None
    if adapter.grammar and _has_grammar(batch):
        if v2_grammar_mode(names) == "grammar_mask":
            mask = _v2_grammar_mask(adapter, batch, vi, grammar_barrier)
        else:
            mask = _grammar_mask(adapter, batch, vi, vi.draft_token.device)
    if names["sample_fn"] is not None:
        args = [vi, batch, logits_output]
        if names["sample_fn_mask"] is not None:
            args.append(mask)
        predict, accept_lens, _ = adapter.cls("sample_fn")(*args)
        return predict, accept_lens
    args = [batch, logits_output]
    if names["sample_vocab_mask"] is not None:
        args.append(mask)
    predict, accept_lens, _ = vi.sample(*args)
    return predict, accept_lens


def _v2_grammar_mask(adapter: Adapter, batch: Any, vi: Any, grammar_barrier: Any) -> Any:
    """0.5.17+: a GrammarMask over the one-node tree, after the scheduler's grammar barrier."""
    next_token = getattr(vi, adapter.name("vi_next_token"))
    tree = adapter.cls("grammar_tree_cls").from_device(
        next_token,
        getattr(vi, adapter.name("vi_next_sibling")),
        vi.draft_token.view(next_token.shape),
    )
    return adapter.cls("grammar_mask_fn")(
        reqs=batch.reqs,
        tree=tree,
        sampling_info=batch.sampling_info,
        device=next_token.device,
        barrier=grammar_barrier,
    )


def _draft_runner(adapter: Adapter, worker: Any) -> Any:
    """The draft model runner of either worker."""
    if adapter.variant == "v1":
        return worker.draft_model_runner
    return worker.draft_worker.draft_runner


def _draft_tp(adapter: Adapter, worker: Any) -> tuple[Callable[[Any], Any], Any]:
    """(context factory, its argument) for the draft TP context of either worker."""
    if adapter.variant == "v1":
        return worker.draft_tp_context, _draft_runner(adapter, worker).tp_group
    return _v2_draft_tp(adapter, worker.draft_worker)


def _v2_draft_tp(adapter: Adapter, draft: Any) -> tuple[Callable[[Any], Any], Any]:
    """(context factory, its argument) for the draft TP context, as that release enters it."""
    mode = adapter.draft_tp
    if mode == "fn(layout)":
        return adapter.cls("draft_tp_fn"), draft.parallel_layout
    if mode == "fn(owns_attention)":
        return adapter.cls("draft_tp_fn"), draft.draft_owns_attention
    if mode == "method(tp_group, owns_attention)":
        owns = draft.draft_owns_attention
        return (
            lambda group: draft.draft_tp_context(group, owns_attention=owns),
            draft.draft_runner.tp_group,
        )
    return draft.draft_tp_context, draft.draft_runner.tp_group


def _v2_logprobs(
    worker: Any, adapter: Adapter, batch: Any, logits_output: Any, predict: Any, bs: int
) -> None:
    """Logprobs of the sampled token in the (bs, steps+1) layout spec v2 returns."""
    import torch

    steps = int(worker.speculative_num_steps)
    accept_index = torch.full((bs, steps + 1), -1, dtype=torch.int32, device=predict.device)
    accept_index[:, 0] = torch.arange(bs, dtype=torch.int32, device=predict.device)
    if adapter.names["logprob_method"] is not None:
        worker._compute_spec_v2_logprobs(batch, logits_output, predict, accept_index)
    elif adapter.names["logprob_fn"] == "compute_spec_logprobs":  # 0.5.19+
        adapter.cls("logprob_fn")(batch, logits_output, predict, accept_index=accept_index)
    elif adapter.names["logprob_fn"] is not None:
        adapter.cls("logprob_fn")(batch, logits_output, predict, accept_index, steps)
    # Neither helper: that release's spec v2 path returns no logprobs either.


def _v2_result(
    adapter: Adapter,
    draft_input: Any,
    logits_output: Any,
    padded_tokens: Any,
    accept_lens: Any,
    new_seq_lens: Any,
    verify_done: Any,
    can_run_graph: bool,
    stride: int,
    keep_alive: Any,
) -> Any:
    """GenerationBatchResult shaped like that release's verify() result."""
    import torch

    names = adapter.names
    next_kwargs: dict[str, Any] = {
        adapter.name("root_field"): padded_tokens[::stride].to(torch.int32)
    }
    result_kwargs: dict[str, Any] = {
        "logits_output": logits_output,
        "next_token_ids": padded_tokens,
        "can_run_cuda_graph": can_run_graph,
        "accept_lens": accept_lens,
    }
    if names["gbr_new_seq_lens"] is not None:
        result_kwargs["new_seq_lens"] = new_seq_lens
    else:
        next_kwargs["new_seq_lens"] = new_seq_lens
    if verify_done is not None:
        next_kwargs["verify_done"] = verify_done
    if names["gbr_allocate_lens"] is not None:
        next_kwargs["allocate_lens"] = draft_input.allocate_lens
        result_kwargs["allocate_lens"] = draft_input.allocate_lens
    if names["gbr_stride"] is not None:
        result_kwargs["speculative_num_draft_tokens"] = stride
    if names["gbr_keep_alive"] is not None:
        result_kwargs["extra_keep_alive_refs"] = [keep_alive]
    result_kwargs["next_draft_input"] = adapter.cls("draft_input_cls")(**next_kwargs)
    return adapter.cls("result_cls")(**result_kwargs)
