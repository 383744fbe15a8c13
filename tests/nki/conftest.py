"""Make the repository importable (``nki``, ``torchneuron.nki``) when pytest runs from anywhere."""

import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if importlib.util.find_spec("nki") is None:
    sys.path.append(_ROOT)


class _FrameView:
    """A frame as ``tracer.user_frame`` sees it, with mutmut's trampoline frames left out."""

    __slots__ = ("_f",)

    def __init__(self, f):
        self._f = f

    f_code = property(lambda self: self._f.f_code)
    f_lineno = property(lambda self: self._f.f_lineno)

    @property
    def f_back(self):
        return _skip(self._f.f_back)


def _skip(f):
    while f is not None and f.f_code.co_filename == _TRAMPOLINE:
        f = f.f_back
    return None if f is None else _FrameView(f)


class _SysWithoutTrampolines:
    """``sys`` for tracer.py under mutation testing: mutmut calls every function of the mutated
    file through a trampoline in its own package, which would otherwise be taken for the
    kernel's source line (it is outside torchneuron/nki). Only frame walking is changed."""

    def __getattr__(self, name):
        return getattr(sys, name)

    @staticmethod
    def _getframe(depth=0):
        f = _skip(sys._getframe(1))  # the caller of _getframe
        for _ in range(depth):
            f = f.f_back
        return f


import torchneuron.nki.tracer as _tracer  # noqa: E402

if hasattr(_tracer, "x_user_frame__mutmut_orig"):  # tracer.py mutated by mutmut (tools/mutation.py)
    import mutmut.mutation.trampoline as _tramp

    _TRAMPOLINE = _tramp.__file__
    _tracer.sys = _SysWithoutTrampolines()
