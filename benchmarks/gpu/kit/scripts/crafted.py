"""Large-margin "successor" models for greedy-equality checks (layout shared by mkweights/check).

The target's residual contributions are zero (o_proj = down_proj = 0), so its last hidden state
is the input token's embedding ``g[t]`` (a +-1 code); its output head maps ``g[t]`` to
``succ(t)`` with a logit margin of about H against about 4.5 sqrt(H) for every other token.
Greedy decoding therefore continues ``t, succ(t), succ(succ(t)), ...`` whatever the context.

Tokens live in three regions, each a cycle of ``REGION_SIZE`` ids. The EAGLE-3 draft (one
layer) proposes ``succ(d(t))`` where ``d(t) = succ(t)`` for a "good" token and
``succ(succ(t))`` for a bad one, so a draft token is accepted when the tokens on its path are
good: the fraction of good tokens sets the acceptance of each region.
"""

from __future__ import annotations

BASE = 1000
REGION_SIZE = 2048
# (name, fraction of good tokens): the draft is right about that often per draft token.
REGIONS = (("accept0", 0.0), ("accept50", 0.5), ("accept90", 0.9))
VOCAB = 128256


def region_of(token: int) -> int:
    index = (token - BASE) // REGION_SIZE
    if token < BASE or index >= len(REGIONS):
        raise ValueError(f"token {token} is outside the crafted regions")
    return index


def region_start(index: int) -> int:
    return BASE + index * REGION_SIZE


def succ(token: int) -> int:
    start = region_start(region_of(token))
    return start + (token - start + 1) % REGION_SIZE


def pred(token: int) -> int:
    start = region_start(region_of(token))
    return start + (token - start - 1) % REGION_SIZE


def good(token: int) -> bool:
    """Whether the draft gets this token's successor right (a fixed hash, not random)."""
    fraction = REGIONS[region_of(token)][1]
    return ((token * 2654435761) % 2**32) / 2**32 < fraction


def draft_next(token: int) -> int:
    return succ(token) if good(token) else succ(succ(token))


def all_tokens() -> range:
    return range(BASE, BASE + REGION_SIZE * len(REGIONS))


def expected_continuation(prompt: list[int], n: int) -> list[int]:
    out, token = [], prompt[-1]
    for _ in range(n):
        token = succ(token)
        out.append(token)
    return out
