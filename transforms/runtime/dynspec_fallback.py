"""Dynamic speculation disable for SGLang EAGLE workers (installed by dynspec-patch).

This placeholder fails closed: ``maybe_fallback_v1`` and ``maybe_fallback_v2`` always
return None, so the patched worker runs its normal speculative step. The real fallback
replaces this file; the hooks and their call signatures stay the same.
"""


def maybe_fallback_v1(worker, batch):
    return None


def maybe_fallback_v2(worker, batch):
    return None
