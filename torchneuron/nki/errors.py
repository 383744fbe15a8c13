"""Error classes of the NKI simulator.

Every error names the rule it enforces, what was wrong (shapes, buffers, dtypes) and where:
the kernel source ``file:line`` of the offending call, plus a one-sentence fix. Catch
:class:`NKIError` to catch all of them.
"""

from __future__ import annotations


class NKIError(Exception):
    """Base class: a kernel broke an NKI rule (tracing, tile limit, memory, dtype...)."""

    rule = "nki"

    def __init__(self, message: str, *, fix: str | None = None, location: str | None = None,
                 rule: str | None = None):
        if rule is not None:
            self.rule = rule
        self.detail = message
        self.fix = fix
        self.location = location
        super().__init__(self._format())

    def _format(self) -> str:
        text = f"[{self.rule}] {self.detail}"
        if self.location:
            text = f"{self.location}: {text}"
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text


class NKITracingError(NKIError):
    """A Python construct or argument the NKI compiler would reject."""

    rule = "tracing"


class NKIArgumentError(NKIError):
    """A bad argument to an ``nl.*``/``nisa.*`` call (wrong kind, op, value)."""

    rule = "argument"


class NKIShapeError(NKIError):
    """Shapes of operands do not agree, or a tile exceeds an instruction's size limits."""

    rule = "shape"


class NKIPartitionError(NKIShapeError):
    """Partition-dimension size or start-partition rule broken."""

    rule = "partition"


class NKIDtypeError(NKIError):
    """A dtype an instruction does not accept."""

    rule = "dtype"


class NKIBufferError(NKIError):
    """An operand lives in a memory (HBM/SBUF/PSUM) the instruction cannot access."""

    rule = "buffer"


class NKIMemoryError(NKIError):
    """SBUF or PSUM capacity exceeded, or a PSUM tile straddling banks."""

    rule = "memory"


class NKIOutOfBoundsError(NKIError):
    """An index, slice or access pattern outside its tensor."""

    rule = "out-of-bounds"


class NKIPlatformError(NKIError):
    """An instruction not available on the target NeuronCore generation."""

    rule = "platform"


__all__ = [
    "NKIError", "NKITracingError", "NKIArgumentError", "NKIShapeError", "NKIPartitionError",
    "NKIDtypeError", "NKIBufferError", "NKIMemoryError", "NKIOutOfBoundsError",
    "NKIPlatformError",
]
