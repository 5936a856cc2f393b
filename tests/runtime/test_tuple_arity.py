"""The 0.4.x entry's tuple arity: the one the scheduler unpacks, by majority of the returns."""

from __future__ import annotations

from dynspec_patch.transforms.runtime.dynspec_fallback import tuple_return_arity

ENTRY_0_4_5_SHAPE = """
def forward_batch_speculative_generation(self, batch):
    if batch.forward_mode.is_decode():
        return (logits_output, verified_id, bid, accepted)
    elif batch.forward_mode.is_idle():
        return logits_output, next_token_ids, bid, 0, False
    else:
        return logits_output, next_token_ids, bid, 0
"""


def test_the_dp_only_idle_branch_does_not_decide_the_arity():
    assert tuple_return_arity(ENTRY_0_4_5_SHAPE) == 4


def test_a_tie_or_no_tuple_is_unknown():
    assert (
        tuple_return_arity("def f():\n    if a:\n        return 1, 2\n    return 1, 2, 3\n") is None
    )
    assert tuple_return_arity("def f():\n    return None\n") is None
