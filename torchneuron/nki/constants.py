"""``nki.isa.constants``: the enums of ``nki.isa`` instruction arguments (AWS's values).

Also importable as ``nki.isa.constants`` / ``torchneuron.nki.isa.constants`` and re-exported
by ``nki.isa``. ``nc_version`` is ordered (``get_nc_version() >= nc_version.gen3``).
"""

from __future__ import annotations

from enum import Enum, IntEnum

__all__ = ["engine", "reduce_cmd", "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version",
           "dma_engine"]


class engine(Enum):
    """NeuronCore engines (``engine=`` argument)."""

    tensor = 1
    vector = 5
    scalar = 2
    gpsimd = 3
    dma = 4
    sync = 6
    unknown = 0


class reduce_cmd(Enum):
    """Accumulator-register commands of reducing instructions."""

    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(Enum):
    """Descriptor generation of a DMA (``unknown``: let the compiler choose)."""

    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(Enum):
    """What an indirect DMA does with an out-of-bounds index."""

    error = 0
    skip = 1


class matmul_perf_mode(Enum):
    none = "none"
    double_row = "double_row"


class nc_version(IntEnum):
    """NeuronCore generation: gen2 = trn1/inf2, gen3 = trn2, gen4 = trn3 (ordered)."""

    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(Enum):
    """How ``sendrecv`` moves data: the shared DMA engines or GpSimd's internal DMA."""

    dma = 1
    gpsimd_dma = 2
