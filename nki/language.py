"""Alias of :mod:`torchneuron.nki.language` (``import nki.language as nl``)."""

import sys as _sys

import torchneuron.nki.language as _impl

_sys.modules[__name__] = _impl
