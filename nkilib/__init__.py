"""Top-level ``nkilib`` package: the very module ``torchneuron.nkilib`` under its upstream name."""

import sys as _sys

try:
    import torch as _torch  # noqa: F401  (see nki/__init__.py: import torch before torchneuron)
except ImportError:
    pass

import torchneuron.nkilib as _impl

_sys.modules[__name__] = _impl
