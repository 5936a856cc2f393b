"""Stand-ins for SGLang's GPU-native dependencies, so its Python modules import on a CPU box.

Import this module before anything from ``sglang``. It does three things
(test-environment.md §3):

1. A meta-path finder serves stand-in modules for ``sgl_kernel``, ``flashinfer`` and
   ``torchvision`` (and any of their submodules). Every attribute of a stand-in is a
   ``MagicMock`` named after its dotted path, so ``from sgl_kernel import x`` works and a call
   to it records itself instead of running a CUDA kernel. Nothing here computes anything:
   code that must compute on CPU gets a reference kernel from ``ref_kernels`` instead.
2. ``torch.library.register_fake`` becomes a no-op for the stubbed namespaces, because the op
   it targets (``sgl_kernel::...``) does not exist without the real extension.
3. With ``DYNSPEC_FAKE_CUDA=1`` (or ``fake_cuda()``), torch claims one CUDA 12.8 device of
   capability (9, 0). SGLang decides ``is_cuda()`` at import time and only then defines names
   such as ``spec_utils.fast_topk``, so worker modules cannot import without it.
   ``restore_cuda()`` undoes it once the imports are done, so that CPU execution afterwards
   never takes a CUDA-only branch by accident.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

STUBBED_PACKAGES = ("sgl_kernel", "flashinfer", "torchvision")


def _is_stubbed(fullname: str) -> bool:
    return fullname.split(".", 1)[0] in STUBBED_PACKAGES


class StubCalledError(RuntimeError):
    """A stand-in for a GPU kernel was called after the imports were done."""


_CREATED: list[mock.MagicMock] = []
_FORBIDDEN = False


def _refuse(name: str) -> Callable[..., Any]:
    def side_effect(*_: Any, **__: Any) -> Any:
        raise StubCalledError(f"{name} is a GPU stand-in with no CPU implementation")

    return side_effect


class StubModule(types.ModuleType):
    """A package whose every missing attribute is a named MagicMock."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # keep dunder probes (e.g. __wrapped__) honest
        dotted = f"{self.__name__}.{name}"
        value = mock.MagicMock(name=dotted)
        if _FORBIDDEN:
            value.side_effect = _refuse(dotted)
        _CREATED.append(value)
        setattr(self, name, value)
        return value


def forbid_stub_calls() -> None:
    """From now on, calling any stand-in raises: decorators and import-time calls are over, and
    a kernel that runs must be a reference implementation, never a silent MagicMock."""
    global _FORBIDDEN
    _FORBIDDEN = True
    for value in _CREATED:
        value.side_effect = _refuse(value._mock_name or "stub")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StubModule(spec.name)
        module.__path__ = []  # a package, so that any submodule import reaches the finder
        module.__dynspec_stub__ = True
        # transformers parses the version of any importable torchvision; "0.0.0" makes every
        # "torchvision >= X" check false, so it never takes a torchvision-only code path.
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not _is_stubbed(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


_FINDER = _StubFinder()


def install_finder() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)  # first, so a half-installed real package never wins


def is_stub(module: types.ModuleType) -> bool:
    return bool(getattr(module, "__dynspec_stub__", False))


_real_register_fake = torch.library.register_fake


def _register_fake(op: Any, *args: Any, **kwargs: Any) -> Any:
    name = op if isinstance(op, str) else getattr(op, "__name__", "")
    if isinstance(name, str) and name.split("::", 1)[0] in STUBBED_PACKAGES:
        if args:  # register_fake(op, fn) form
            return args[0]
        return lambda fn: fn  # decorator form
    return _real_register_fake(op, *args, **kwargs)


def install_register_fake() -> None:
    torch.library.register_fake = _register_fake


_SAVED_CUDA: dict[str, Callable[..., Any] | str | None] = {}


def fake_cuda() -> None:
    """Make torch report one CUDA 12.8 device with capability (9, 0)."""
    if _SAVED_CUDA:
        return
    _SAVED_CUDA.update(
        is_available=torch.cuda.is_available,
        device_count=torch.cuda.device_count,
        get_device_capability=torch.cuda.get_device_capability,
        version=torch.version.cuda,
    )
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.version.cuda = "12.8"


def restore_cuda() -> None:
    """Undo ``fake_cuda``; later CPU execution sees the truth again."""
    if not _SAVED_CUDA:
        return
    torch.cuda.is_available = _SAVED_CUDA.pop("is_available")
    torch.cuda.device_count = _SAVED_CUDA.pop("device_count")
    torch.cuda.get_device_capability = _SAVED_CUDA.pop("get_device_capability")
    torch.version.cuda = _SAVED_CUDA.pop("version")


def install_torch_compat() -> None:
    """Names that SGLang 0.4.x calls on torch 2.6-2.7 but torch 2.13 no longer has."""
    cpu = torch._C._cpu
    if not hasattr(cpu, "_is_amx_tile_supported"):
        cpu._is_amx_tile_supported = lambda: False  # 0.4.10.post2 utils.cpu_has_amx_support


def install(*, with_fake_cuda: bool | None = None) -> None:
    install_finder()
    install_register_fake()
    install_torch_compat()
    if with_fake_cuda is None:
        with_fake_cuda = os.environ.get("DYNSPEC_FAKE_CUDA") == "1"
    if with_fake_cuda:
        fake_cuda()


install()
