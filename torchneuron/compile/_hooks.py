"""Import-time hook for eager FlexAttention on neuron.

``torch.nn.attention.flex_attention._validate_device`` rejects neuron tensors before any
compile backend runs, so eager ``flex_attention`` needs the patch as soon as that module is
imported. Importing it eagerly would slow ``import torch`` down; instead a ``sys.meta_path``
finder patches the module right after it loads (or immediately, if already loaded).
"""

from __future__ import annotations

import importlib.abc
import sys

_TARGET = "torch.nn.attention.flex_attention"
_installed = False


def _patch() -> None:
    from .inductor_patches import patch_flex_validate_device

    patch_flex_validate_device()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self._inner = inner

    def create_module(self, spec):  # noqa: D102
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: D102
        self._inner.exec_module(module)
        _patch()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # noqa: D102
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install_import_hooks() -> None:
    """Allow neuron tensors in eager ``flex_attention`` (idempotent, cheap: no torch import)."""
    global _installed
    if _installed:
        return
    _installed = True
    if _TARGET in sys.modules:
        _patch()
    else:
        sys.meta_path.insert(0, _Finder())
