"""``neuronxcc.nki``: the same modules as ``nki`` (``language``, ``isa``, ``typing``,
``collectives``, ``isa.constants``), under their legacy names."""

import sys as _sys

import nki as _nki  # noqa: F401  (imports torch first, then torchneuron.nki)
import torchneuron.nki as _impl

for _name in ("language", "isa", "isa.constants", "collectives", "typing", "dtype"):
    _sys.modules[__name__ + "." + _name] = _sys.modules["nki." + _name]
_sys.modules[__name__] = _impl
