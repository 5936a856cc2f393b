"""The toy language model behind the fake target and draft forwards (no torch needed).

Greedy decoding of this model is a known sequence, so the tests can compute independently
which token every request must emit at every position.
"""

from __future__ import annotations

VOCAB = 97  # prime, so the sequence does not cycle quickly
HIDDEN = 8
TOPK = 1


def next_token(token: int, position: int) -> int:
    """The argmax token after ``token`` sitting at ``position`` (the target's greedy choice)."""
    return (token * 7 + position * 3 + 1) % VOCAB


def draft_next_token(token: int, position: int) -> int:
    """The draft model's guess; right most of the time, wrong on every fifth position."""
    guess = next_token(token, position)
    return (guess + 1) % VOCAB if position % 5 == 4 else guess


def greedy_continuation(last_token: int, seq_len: int, steps: int) -> list[int]:
    """Tokens a request emits in ``steps`` decode steps: the last emitted token has no KV yet,
    so it is fed at position ``seq_len``."""
    out = []
    token, position = last_token, seq_len
    for _ in range(steps):
        token = next_token(token, position)
        out.append(token)
        position += 1
    return out
