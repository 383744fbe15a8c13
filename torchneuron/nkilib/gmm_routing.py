"""Route ``torch._grouped_mm`` on ``neuron`` tensors through the NKI grouped-matmul kernels.

``enable()`` registers, through ``torch.library.Library("aten", "IMPL")``, an
``AutogradPrivateUse1`` kernel for ``aten::_grouped_mm`` (a CompositeExplicitAutograd op
with an autograd formula, so the autograd-key kernel takes over for ``neuron`` tensors): the
call goes to :func:`torchneuron.nkilib.ops.grouped_mm` (``nkilib::grouped_mm`` /
``nkilib::grouped_mm_wgrad``, whose backward is again grouped matmuls). Unsupported options
(``bias``, a different ``out_dtype``) raise NotImplementedError naming them. CPU tensors are
never affected. torchneuron calls ``enable()`` at import when
``TORCHNEURON_NKI_GROUPED_MM=1``.
"""

from __future__ import annotations

import torch

_LIB = None
_CALLS = {"nki": 0}


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    from .ops import grouped_mm
    _CALLS["nki"] += 1
    return grouped_mm(mat_a, mat_b, offs, bias, out_dtype)


def enable() -> None:
    """Make ``torch._grouped_mm`` on ``neuron`` tensors use the NKI kernels (idempotent)."""
    global _LIB
    if _LIB is None:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_grouped_mm", _grouped_mm, "AutogradPrivateUse1")
        _LIB = lib


def disable() -> None:
    """Undo :func:`enable`."""
    global _LIB
    if _LIB is not None:
        _LIB._destroy()
        _LIB = None


def enabled() -> bool:
    return _LIB is not None


def calls() -> dict:
    """How many ``torch._grouped_mm`` calls took the NKI path since import (for tests)."""
    return dict(_CALLS)
