"""Top-level ``nki`` package: the NKI API of torchneuron under its upstream name.

``import nki; import nki.language as nl; import nki.isa as nisa`` gives the very same modules
as ``torchneuron.nki``, ``torchneuron.nki.language`` and ``torchneuron.nki.isa``.
"""

import sys as _sys

try:
    # torchneuron/__init__.py imports torch, whose backend autoload imports torchneuron again;
    # importing torch first keeps that from meeting a half-initialised torchneuron.
    import torch as _torch  # noqa: F401
except ImportError:  # the simulator itself needs only numpy
    pass

import torchneuron.nki as _impl
from torchneuron.nki import *  # noqa: F401,F403
from torchneuron.nki import __all__, __version__, isa, language  # noqa: F401

_sys.modules.setdefault(__name__ + ".language", language)
_sys.modules.setdefault(__name__ + ".isa", isa)


def __getattr__(name):
    return getattr(_impl, name)
