"""The runtime's CPU tests run on the pinned CPU build of torch, not whatever pip found."""

from __future__ import annotations

import torch


def test_torch_is_the_pinned_cpu_build():
    assert torch.__version__ == "2.13.0+cpu"
    assert torch.version.cuda is None
