"""Alias of :mod:`torchneuron.nki.isa` (``import nki.isa as nisa``)."""

import sys as _sys

import torchneuron.nki.isa as _impl

_sys.modules[__name__] = _impl
