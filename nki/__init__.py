"""Top-level ``nki`` package: the NKI API of torchneuron under its upstream name.

``import nki; import nki.language as nl; import nki.isa as nisa`` (also ``nki.isa.constants``,
``nki.collectives``, ``nki.typing``, ``nki.dtype``) give the very same modules as
``torchneuron.nki``, ``torchneuron.nki.language``, ...
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
from torchneuron.nki import (__all__, __version__, collectives, constants, dtype,  # noqa: F401
                             isa, language, typing)

for _name, _mod in (("language", language), ("isa", isa), ("isa.constants", constants),
                    ("collectives", collectives), ("typing", typing), ("dtype", dtype)):
    _sys.modules.setdefault(__name__ + "." + _name, _mod)
    _sys.modules.setdefault("torchneuron.nki." + _name, _mod)


def __getattr__(name):
    return getattr(_impl, name)
