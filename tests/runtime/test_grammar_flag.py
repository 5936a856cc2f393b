"""Which batches count as grammar-constrained, across the batch types of each release."""

from __future__ import annotations

from types import SimpleNamespace

from dynspec_patch.transforms.runtime.dynspec_fallback import _has_grammar


def test_flag_is_used_where_the_batch_has_one():
    assert _has_grammar(SimpleNamespace(has_grammar=True, sampling_info=None)) is True
    assert _has_grammar(SimpleNamespace(has_grammar=False, sampling_info=None)) is False


def test_without_the_flag_the_sampling_grammars_decide():
    # 0.5.5.post2's ModelWorkerBatch carries no has_grammar; its SamplingBatchInfo does grammars.
    def batch(grammars):
        return SimpleNamespace(sampling_info=SimpleNamespace(grammars=grammars))

    assert _has_grammar(batch(None)) is False
    assert _has_grammar(batch([None, None])) is False
    assert _has_grammar(batch([None, object()])) is True
