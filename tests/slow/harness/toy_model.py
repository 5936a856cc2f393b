"""The toy language model behind the fake target and draft forwards (no torch needed).

Greedy decoding of this model is a known sequence, so the tests can compute independently
which token every request must emit at every step, and how many drafted tokens a speculative
step must accept. The model looks only at the previous token: positions are checked
separately (tests compare them with the sequence lengths), so an off-by-one in the EAGLE
position bookkeeping cannot hide in the token values, nor make them depend on it.
"""

from __future__ import annotations

VOCAB = 97  # prime, so the sequence does not cycle quickly
HIDDEN = 8
TOPK = 1


def next_token(token: int) -> int:
    """The target's argmax after ``token``."""
    return (token * 7 + 1) % VOCAB


def draft_next_token(token: int) -> int:
    """The draft model's guess: right, except after tokens that are 4 mod 5."""
    guess = next_token(token)
    return (guess + 1) % VOCAB if token % 5 == 4 else guess


def greedy_continuation(last_token: int, steps: int) -> list[int]:
    out = []
    token = last_token
    for _ in range(steps):
        token = next_token(token)
        out.append(token)
    return out


def accepted_drafts(root: int, num_steps: int) -> int:
    """Drafts a chain (topk=1) speculative step accepts after ``root``: the draft proposes
    num_steps tokens by chaining its own guesses; the target accepts the longest correct prefix.
    """
    accepted, token = 0, root
    for _ in range(num_steps):
        if draft_next_token(token) != next_token(token):
            break
        token = next_token(token)
        accepted += 1
    return accepted
