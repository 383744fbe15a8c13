"""One table of Trainium hardware facts, and the emulated topology read from the environment.

Everything that depends on the hardware reads it from here: the allocator's capacity per
device, ``torch.neuron.get_device_properties``, the NKI simulator's limits and the
performance models. Figures come from ``shared/reference/trainium-hardware.md`` (public AWS
documentation); per-engine numbers are per *physical* NeuronCore.

This module must stay importable without torch: the NKI simulator and the CLI use it alone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import lru_cache

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


@dataclass(frozen=True)
class Engine:
    """One compute engine of a physical NeuronCore."""

    clock_hz: float
    lanes: int  # elements per cycle for 32-bit data (partition lanes)
    lanes_16bit: int = 0  # elements per cycle for bf16/fp16 where the engine is wider (0: same)


@dataclass(frozen=True)
class Platform:
    """Hardware facts of one Trainium generation."""

    name: str  # NKI target name: "trn1", "trn2", "trn3"
    chip: str  # marketing name
    core_version: str  # NeuronCore generation
    physical_cores_per_chip: int
    hbm_bytes_per_chip: int
    hbm_bandwidth_per_chip: float  # bytes/s
    default_lnc: int
    # TensorE (per physical core)
    pe_rows: int
    pe_cols: int
    tensor_clock_hz: float
    tensor_tflops: dict  # dtype name -> dense TFLOPS per physical core
    chip_tflops: dict  # dtype name -> dense TFLOPS per chip (published)
    vector: Engine
    scalar: Engine
    gpsimd: Engine
    # On-chip memory (per physical core)
    sbuf_partitions: int
    sbuf_bytes_per_partition: int  # physical
    sbuf_usable_bytes_per_partition: int  # usable by kernels
    psum_bytes_per_partition: int
    psum_banks: int
    # DMA (per physical core)
    dma_queues: int
    dma_queue_bytes_per_ns: float
    dma_fixed_cost_s: float
    dma_issue_cost_s: float
    # Collectives
    neuronlink_bytes_per_s: float  # per chip
    cc_cores: int
    matmul_max_moving_free: int = 512  # N limit of nc_matmul moving tile
    extra: dict = field(default_factory=dict)

    @property
    def psum_bank_bytes(self) -> int:
        return self.psum_bytes_per_partition // self.psum_banks

    @property
    def dma_bytes_per_s(self) -> float:
        """Aggregate DMA bandwidth of one physical core (all queues)."""
        return self.dma_queues * self.dma_queue_bytes_per_ns * 1e9

    def peak_flops(self, dtype: str = "bfloat16") -> float:
        """Dense TensorE FLOP/s of one physical core for ``dtype``."""
        key = _DTYPE_CLASS.get(dtype, dtype)
        return self.tensor_tflops[key] * 1e12

    @property
    def hbm_bytes_per_s_per_physical_core(self) -> float:
        """A physical core's share of the chip's HBM bandwidth (derived)."""
        return self.hbm_bandwidth_per_chip / self.physical_cores_per_chip

    @property
    def dma_transfer_fixed_s(self) -> float:
        """Fixed cost of one DMA transfer including the descriptor issue (derived: fixed cost
        per transfer + hardware-DGE instruction cost). The profiler's estimator charges it
        once per kernel (a kernel moves at least one tile in) and once per ring step of a
        collective; see docs/profiling.md."""
        return self.dma_fixed_cost_s + self.dma_issue_cost_s


# dtype name -> the TensorE rate class it runs at
_DTYPE_CLASS = {
    "bfloat16": "bf16",
    "float16": "bf16",
    "tfloat32": "bf16",
    "float32": "fp32",
    "float8_e4m3": "fp8",
    "float8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "int8": "fp8",
    "uint8": "fp8",
}

PLATFORMS: dict[str, Platform] = {
    "trn1": Platform(
        name="trn1",
        chip="Trainium",
        core_version="NeuronCore-v2",
        physical_cores_per_chip=2,
        hbm_bytes_per_chip=32 * GiB,
        hbm_bandwidth_per_chip=820e9,
        default_lnc=1,
        pe_rows=128,
        pe_cols=128,
        tensor_clock_hz=2.8e9,
        tensor_tflops={"bf16": 92.0, "fp8": 92.0, "fp32": 23.0},
        chip_tflops={"bf16": 190.0, "fp8": 190.0, "fp32": 47.5},
        vector=Engine(1.12e9, 128),
        scalar=Engine(1.4e9, 128),
        gpsimd=Engine(1.4e9, 128),
        sbuf_partitions=128,
        sbuf_bytes_per_partition=192 * KiB,
        sbuf_usable_bytes_per_partition=180_224,
        psum_bytes_per_partition=16 * KiB,
        psum_banks=8,
        dma_queues=16,
        dma_queue_bytes_per_ns=17.0,
        dma_fixed_cost_s=1.3e-6,
        dma_issue_cost_s=0.6e-6,
        neuronlink_bytes_per_s=384e9,
        cc_cores=6,
    ),
    "trn2": Platform(
        name="trn2",
        chip="Trainium2",
        core_version="NeuronCore-v3",
        physical_cores_per_chip=8,
        hbm_bytes_per_chip=96 * GiB,
        hbm_bandwidth_per_chip=2.9e12,
        default_lnc=2,
        pe_rows=128,
        pe_cols=128,
        tensor_clock_hz=2.4e9,
        tensor_tflops={"bf16": 79.0, "fp8": 158.0, "fp32": 20.0},
        chip_tflops={"bf16": 667.0, "fp8": 1299.0, "fp32": 181.0},
        vector=Engine(0.96e9, 256, 512),
        scalar=Engine(1.2e9, 128),
        gpsimd=Engine(1.2e9, 128),
        sbuf_partitions=128,
        sbuf_bytes_per_partition=224 * KiB,
        sbuf_usable_bytes_per_partition=212_984,
        psum_bytes_per_partition=16 * KiB,
        psum_banks=8,
        dma_queues=16,
        dma_queue_bytes_per_ns=23.0,
        dma_fixed_cost_s=1.3e-6,
        dma_issue_cost_s=0.6e-6,
        neuronlink_bytes_per_s=1.28e12,
        cc_cores=20,
    ),
    "trn3": Platform(
        name="trn3",
        chip="Trainium3",
        core_version="NeuronCore-v4",
        physical_cores_per_chip=8,
        hbm_bytes_per_chip=144 * GiB,
        hbm_bandwidth_per_chip=4.9e12,
        default_lnc=2,
        pe_rows=128,
        pe_cols=128,
        tensor_clock_hz=2.4e9,
        tensor_tflops={"bf16": 79.0, "fp8": 315.0, "fp32": 20.0},
        chip_tflops={"bf16": 671.0, "fp8": 2517.0, "fp32": 183.0},
        vector=Engine(1.2e9, 256, 512),
        scalar=Engine(1.2e9, 128, 256),
        gpsimd=Engine(1.2e9, 128),
        sbuf_partitions=128,
        sbuf_bytes_per_partition=256 * KiB,
        sbuf_usable_bytes_per_partition=245_752,
        psum_bytes_per_partition=16 * KiB,
        psum_banks=8,
        dma_queues=16,
        dma_queue_bytes_per_ns=33.0,
        dma_fixed_cost_s=1.3e-6,
        dma_issue_cost_s=0.6e-6,
        neuronlink_bytes_per_s=2.56e12,
        cc_cores=16,
        matmul_max_moving_free=512,
    ),
}

#: Platforms the PyTorch device can emulate (TorchNeuron supports Trn2/Trn3 only).
DEVICE_PLATFORMS = ("trn2", "trn3")


def get_platform(name: str | None = None) -> Platform:
    """The :class:`Platform` called ``name``, or the one selected by the environment."""
    if name is None:
        name = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2") or "trn2"
    key = name.strip().lower()
    if key not in PLATFORMS:
        raise ValueError(
            f"unknown Neuron platform {name!r}; expected one of {sorted(PLATFORMS)} "
            "(set NEURON_PLATFORM_TARGET_OVERRIDE to trn2 or trn3)"
        )
    return PLATFORMS[key]


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": KiB, "m": 1000**2, "mb": 1000**2,
          "mib": MiB, "g": 1000**3, "gb": 1000**3, "gib": GiB, "t": 1000**4, "tb": 1000**4,
          "tib": 1 << 40, "ki": KiB, "mi": MiB, "gi": GiB, "ti": 1 << 40}


def parse_size(text: str) -> int:
    """Parse a byte size such as ``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``"1048576"``."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse memory size {text!r}; use bytes or a unit, e.g. '2GiB', '512MiB'")
    value, unit = m.groups()
    return int(float(value) * _UNITS[(unit or "").lower()])


def parse_core_list(text: str) -> list[int]:
    """Parse ``NEURON_RT_VISIBLE_CORES`` syntax: ``"0-3"``, ``"1,3"``, ``"0-1,4"``."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            lo_i, hi_i = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part),) * 2
        except ValueError:
            raise ValueError(f"bad core {part!r} in NEURON_RT_VISIBLE_CORES={text!r}; expected core "
                             "numbers and ranges such as '1,3' or '0-3'") from None
        if "-" in part:
            if hi_i < lo_i:
                raise ValueError(f"bad core range {part!r} in NEURON_RT_VISIBLE_CORES={text!r}")
            cores.extend(range(lo_i, hi_i + 1))
        else:
            cores.append(lo_i)
    if len(set(cores)) != len(cores):
        raise ValueError(f"NEURON_RT_VISIBLE_CORES={text!r} lists a core twice")
    return cores


@dataclass(frozen=True)
class Topology:
    """The emulated machine: which logical NeuronCores this process sees as ``neuron:N``."""

    platform: Platform
    num_chips: int
    lnc: int  # physical cores per logical core
    visible_cores: tuple  # global logical core id of each device index
    memory_per_device: int  # bytes of HBM capacity per device

    @property
    def logical_cores_per_chip(self) -> int:
        return self.platform.physical_cores_per_chip // self.lnc

    @property
    def total_logical_cores(self) -> int:
        return self.num_chips * self.logical_cores_per_chip

    @property
    def device_count(self) -> int:
        return len(self.visible_cores)

    def chip_of(self, device_index: int) -> int:
        return self.visible_cores[device_index] // self.logical_cores_per_chip

    def describe(self) -> str:
        p = self.platform
        return (f"{p.name} ({p.chip}), {self.num_chips} chip(s), LNC={self.lnc}, "
                f"{self.device_count} device(s) of {self.memory_per_device / GiB:.1f} GiB")


def _env_int(env, name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def read_topology(env: dict | None = None) -> Topology:
    """Build the :class:`Topology` from environment variables (see ``docs/env-vars.md``)."""
    env = os.environ if env is None else env
    platform = get_platform(env.get("NEURON_PLATFORM_TARGET_OVERRIDE") or "trn2")
    if platform.name not in DEVICE_PLATFORMS:
        raise ValueError(f"the neuron device emulates {DEVICE_PLATFORMS} only, not {platform.name}")
    chips = _env_int(env, "TORCHNEURON_NUM_CHIPS", 1)
    if chips < 1:
        raise ValueError(f"TORCHNEURON_NUM_CHIPS={chips} must be >= 1")
    lnc = _env_int(env, "NEURON_LOGICAL_NC_CONFIG", platform.default_lnc)
    if lnc not in (1, 2):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={lnc} is invalid; it must be 1 or 2")
    per_chip = platform.physical_cores_per_chip // lnc
    total = chips * per_chip
    raw_visible = env.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if raw_visible:
        visible = parse_core_list(raw_visible)
        bad = [c for c in visible if c < 0 or c >= total]
        if bad:
            raise ValueError(
                f"NEURON_RT_VISIBLE_CORES={raw_visible!r} names core(s) {bad} but this "
                f"{platform.name} machine has logical cores 0-{total - 1} "
                f"({chips} chip(s) x {per_chip} at LNC={lnc})")
    else:
        visible = list(range(total))
    raw_mem = env.get("TORCHNEURON_DEVICE_MEMORY", "").strip()
    mem = parse_size(raw_mem) if raw_mem else platform.hbm_bytes_per_chip // per_chip
    if mem <= 0:
        raise ValueError(f"TORCHNEURON_DEVICE_MEMORY={raw_mem!r} must be positive")
    return Topology(platform, chips, lnc, tuple(visible), mem)


@lru_cache(maxsize=1)
def topology() -> Topology:
    """The process-wide topology, read once from the environment at first use."""
    return read_topology()
