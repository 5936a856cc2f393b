"""Run code written for ``device="cuda"`` on CPU tensors.

SGLang 0.4.x creates some tensors with a hard-coded ``device="cuda"`` (e.g.
``EagleVerifyInput.verify`` in 0.4.6.post5 / 0.4.10.post2). Under ``CudaAsCpu`` every torch
call sees such a device argument as ``"cpu"``, and ``.cuda()`` / ``.to("cuda")`` keep the tensor
where it is. Nothing else changes: it is the CPU stand-in for the one GPU of the server.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":", 1)[0] == "cuda"


class CudaAsCpu(TorchFunctionMode):
    """Also: ``Tensor.record_stream`` is a no-op inside (one CPU "stream", nothing to order;
    torch.cpu's Stream is not an argument the C++ method accepts)."""

    def __enter__(self) -> CudaAsCpu:
        self._record_stream = torch.Tensor.record_stream
        torch.Tensor.record_stream = lambda tensor, stream: None
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.record_stream = self._record_stream
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)
