"""Loaded by ``_dynspec_fake.pth`` in a test venv: ``sglang`` imports as an empty package whose
``__path__`` is the REAL installed release (its heavy ``__init__`` is not run), and
``sglang.launch_server`` is our fake server. ``find_spec('sglang')`` still reports the real
package directory, so discovery is the same code path as on a real host."""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_FAKE = os.path.join(_HERE, "_dynspec_fake_server.py")


class _EmptyLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "sglang":
            real = importlib.machinery.PathFinder.find_spec(name, path)
            if real is None:
                return None
            spec = importlib.machinery.ModuleSpec(name, _EmptyLoader(), origin=real.origin,
                                                  is_package=True)
            spec.submodule_search_locations = list(real.submodule_search_locations)
            return spec
        if name == "sglang.launch_server":
            return importlib.util.spec_from_file_location(name, _FAKE)
        return None


sys.meta_path.insert(0, _Finder())
