"""``nki.typing`` (also ``neuronxcc.nki.typing``): annotation types of kernel signatures.

``tensor``, ``mutable_tensor`` (an input the kernel writes), ``scalar``... are markers for
annotations such as ``x: nt.tensor[128, 512]``; the simulator does not enforce them.
"""

from __future__ import annotations

__all__ = ["tensor", "mutable_tensor", "scalar", "sbuf", "psum", "hbm", "shared_hbm"]


class _Annotation:
    """An annotation marker; subscripting (``tensor[128, 512]``) returns the marker itself."""

    def __init__(self, name: str):
        self.__name__ = name

    def __getitem__(self, item):
        return self

    def __repr__(self) -> str:
        return f"nki.typing.{self.__name__}"


tensor = _Annotation("tensor")
mutable_tensor = _Annotation("mutable_tensor")
scalar = _Annotation("scalar")
sbuf = _Annotation("sbuf")
psum = _Annotation("psum")
hbm = _Annotation("hbm")
shared_hbm = _Annotation("shared_hbm")
