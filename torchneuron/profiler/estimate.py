"""Estimated Trainium time of one device activity: FLOPs, bytes, engine, roofline.

For every kernel the runtime recorded, :func:`cost_of` answers: how many FLOPs (FlopCounterMode's
formulas plus ours, :mod:`.estimate_flops`), how many HBM bytes (stride- and broadcast-aware,
views of one buffer read once, :func:`.records.unique_bytes`), which engine does the work, and
how long it would take on the configured platform::

    est = max(engine time, bytes / HBM bandwidth) + fixed cost per kernel

Engine times use the NKI performance model's per-instruction cost formulas
(:mod:`torchneuron.nki.perf_model`: TensorE tile cycles, VectorE/ScalarE cycles per element
and their 16-bit speedups) applied to the whole op as if tiled over the 128 partitions. NKI
kernels take the performance model's own latency; collectives an alpha-beta model
(:mod:`.estimate_collectives`). Every figure comes from :mod:`torchneuron.platform`; every
assumption is listed in docs/profiling.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from .. import platform as _platform
from ..nki import perf_model as _pm
from .estimate_flops import NORM_FLOPS, POINTWISE_FLOPS, REDUCTION_FLOPS, SOFTMAX_FLOPS, flops_of
from .records import DeviceRecord, TensorMeta, unique_bytes

__all__ = ["Hardware", "Cost", "cost_of", "engine_of", "portability_of", "MATMUL_OPS",
           "NO_TRAINIUM_LOWERING"]

MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "_int_mm", "addmv", "mv",
              "dot", "vdot", "addbmm"}
ATTENTION_FWD = {"_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_fused_attention_overrideable", "_efficient_attention_forward",
                 "_flash_attention_forward"}
ATTENTION_BWD = {n + "_backward" for n in ATTENTION_FWD} | {"_efficient_attention_backward",
                                                            "_flash_attention_backward"}
CONV_OPS = {"convolution_overrideable", "convolution_backward_overrideable", "convolution",
            "_convolution", "convolution_backward"}
#: Activations evaluated on ScalarE (the activation-function engine).
SCALAR_OPS = {"exp", "exp2", "log", "log2", "log1p", "tanh", "sigmoid", "gelu", "silu",
              "softplus", "erf", "erfinv", "sqrt", "rsqrt", "sin", "cos", "elu", "mish",
              "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward", "pow",
              "reciprocal", "hardswish", "logit"}
#: Pure data movement: gathers, concatenations, layout copies (DMA engines).
DMA_OPS = {"copy", "clone", "cat", "stack", "index_select", "embedding", "gather", "index",
           "index_put", "index_add", "scatter", "scatter_add", "slice_scatter", "select_scatter",
           "repeat", "flip", "roll", "constant_pad_nd", "narrow_copy", "contiguous",
           "as_strided_scatter", "_unsafe_index", "masked_select", "take", "unfold_copy",
           "permute_copy", "expand_copy", "transpose_copy", "diagonal_copy", "split_with_sizes_copy"}
#: Index generation, masks, sorting: GpSimd (the general-purpose SIMD engine).
GPSIMD_OPS = {"arange", "tril", "triu", "nonzero", "sort", "topk", "randperm", "argsort",
              "embedding_dense_backward", "bincount", "cumsum", "cumprod", "searchsorted",
              "unique", "_unique2", "masked_scatter", "linspace"}
BINARY_OPS = {"add", "sub", "mul", "div", "maximum", "minimum", "where", "eq", "ne", "lt", "le",
              "gt", "ge", "fmod", "remainder", "addcmul", "addcdiv", "lerp", "threshold_backward",
              "logical_and", "logical_or", "bitwise_and", "bitwise_or", "rsub", "atan2",
              "masked_fill", "clamp"}

#: Ops AWS's eager backend does not run on the device (public limits, shared reference
#: torchneuron-api.md section 14): random number generation runs on the host CPU, and there is
#: no ``_scaled_mm``.
NO_TRAINIUM_LOWERING = {
    "bernoulli": "device RNG ops run on the host CPU in AWS's backend",
    "normal": "device RNG ops run on the host CPU in AWS's backend",
    "uniform": "device RNG ops run on the host CPU in AWS's backend",
    "random": "device RNG ops run on the host CPU in AWS's backend",
    "exponential": "device RNG ops run on the host CPU in AWS's backend",
    "native_dropout": "dropout's mask comes from device RNG, which runs on the host CPU in AWS's backend",
    "multinomial": "device RNG ops run on the host CPU in AWS's backend",
    "randperm": "device RNG ops run on the host CPU in AWS's backend",
    "_scaled_mm": "AWS's backend has no _scaled_mm (fp8 scaled matmul)",
}

_SIXTEEN = {"bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
            "float8_e5m2fnuz", "int8", "uint8", "bool"}
_DTYPE_CLASS = {"bfloat16": "bf16", "float16": "bf16", "float32": "fp32", "float64": "fp32",
                "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8",
                "float8_e5m2fnuz": "fp8", "int8": "fp8", "uint8": "fp8"}


@dataclass(frozen=True)
class Hardware:
    """The peaks the estimator uses for one logical NeuronCore (LNC physical cores)."""

    platform: _platform.Platform
    lnc: int

    @classmethod
    def current(cls, platform: str | None = None, lnc: int | None = None) -> "Hardware":
        """From the emulated topology (``NEURON_PLATFORM_TARGET_OVERRIDE``,
        ``NEURON_LOGICAL_NC_CONFIG``) unless given."""
        if platform is None or lnc is None:
            try:
                topo = _platform.topology()
                platform = platform or topo.platform.name
                lnc = lnc or topo.lnc
            except ValueError:
                platform = platform or "trn2"
        p = _platform.get_platform(platform)
        return cls(p, int(lnc or p.default_lnc))

    @property
    def name(self) -> str:
        return self.platform.name

    @property
    def label(self) -> str:
        return f"{self.platform.chip} (estimated)"

    def peak_flops(self, dtype: str = "bfloat16") -> float:
        """Dense TensorE FLOP/s of the logical core."""
        return self.platform.tensor_tflops[_DTYPE_CLASS.get(dtype, "bf16")] * 1e12 * self.lnc

    @property
    def hbm_bw(self) -> float:
        """HBM bytes/s available to the logical core."""
        return self.platform.hbm_bytes_per_s_per_physical_core * self.lnc

    @property
    def dma_bw(self) -> float:
        return self.platform.dma_bytes_per_s * self.lnc

    @property
    def mem_bw(self) -> float:
        """Bytes/s an op can stream through HBM: limited by HBM and by the DMA queues."""
        return min(self.hbm_bw, self.dma_bw)

    @property
    def fixed_s(self) -> float:
        return self.platform.dma_transfer_fixed_s

    def as_dict(self) -> dict:
        p = self.platform
        return {"platform": p.name, "chip": p.chip, "lnc": self.lnc,
                "peak_bf16_flops": self.peak_flops("bfloat16"),
                "peak_fp32_flops": self.peak_flops("float32"),
                "peak_fp8_flops": self.peak_flops("float8_e4m3fn"),
                "hbm_bytes_per_s": self.hbm_bw, "dma_bytes_per_s": self.dma_bw,
                "kernel_fixed_s": self.fixed_s,
                "hbm_bytes": p.hbm_bytes_per_chip // (p.physical_cores_per_chip // self.lnc),
                "vector_hz": p.vector.clock_hz, "scalar_hz": p.scalar.clock_hz,
                "tensor_hz": p.tensor_clock_hz, "neuronlink_bytes_per_s": p.neuronlink_bytes_per_s}


@dataclass
class Cost:
    """The estimate for one activity (times in ns)."""

    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    engine: str = "vector"  # tensor, vector, scalar, gpsimd, dma, collective, host
    bound: str = "memory"  # compute, memory, latency, host
    est_ns: float = 0.0
    compute_ns: float = 0.0
    memory_ns: float = 0.0
    dtype: str = ""
    notes: list = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def mfu(self, hw: Hardware) -> float:
        peak = hw.peak_flops(self.dtype or "bfloat16")
        return self.flops / (self.est_ns * 1e-9 * peak) if self.est_ns > 0 else 0.0

    def mbu(self, hw: Hardware) -> float:
        return self.bytes / (self.est_ns * 1e-9 * hw.hbm_bw) if self.est_ns > 0 else 0.0


def _base(op: str) -> str:
    b = op.split(".", 1)[0]
    if b.startswith("_foreach_"):
        b = b[len("_foreach_"):]
    return b[:-1] if b.endswith("_") and not b.endswith("__") else b


def engine_of(op: str) -> str:
    """The engine an ATen op runs on: tensor (matmul, convolution, attention), scalar
    (activations), vector (arithmetic, reductions, norms), gpsimd (index generation, masks,
    sorts) or dma (data movement)."""
    b = _base(op)
    if b in MATMUL_OPS or b in CONV_OPS or op.split(".")[0] in ATTENTION_FWD | ATTENTION_BWD:
        return "tensor"
    if b in SCALAR_OPS or b in SOFTMAX_FLOPS:
        return "scalar"
    if b in DMA_OPS or b == "_to_copy":
        return "dma"
    if b in GPSIMD_OPS:
        return "gpsimd"
    return "vector"


# ---------------------------------------------------------------------------------------------
# engine models
# ---------------------------------------------------------------------------------------------
def _tile_cycles(m: int, k: int, n: int) -> float:
    """TensorE cycles of an (m x k) @ (k x n) product at the 16-bit rate: k in 128-row
    contraction tiles, the stationary operand in <=128-column tiles, the moving one in <=512
    (perf_model.matmul_cycles per instruction). The better orientation is taken."""
    def oriented(stat: int, mov: int) -> float:
        full_s, rem_s = divmod(stat, 128)
        full_m, rem_m = divmod(mov, 512)
        per_k = 0.0
        for s_size, s_count in ((128, full_s), (rem_s, 1 if rem_s else 0)):
            for m_size, m_count in ((512, full_m), (rem_m, 1 if rem_m else 0)):
                if s_count and m_count:
                    per_k += s_count * m_count * _pm.matmul_cycles(s_size, m_size, False)
        return per_k * math.ceil(k / 128)
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return min(oriented(m, n), oriented(n, m))


def _tensor_seconds(hw: Hardware, cycles: float, dtype: str) -> float:
    # Cycles are at the bf16 rate; other dtypes scale by the table's peak ratio.
    ratio = hw.peak_flops("bfloat16") / hw.peak_flops(dtype or "bfloat16")
    return cycles / hw.platform.tensor_clock_hz / hw.lnc * ratio


def _vector_seconds(hw: Hardware, elems: float, cycles_per_elem: float, sixteen: bool,
                    kind: str) -> float:
    speed = _pm.vector_speedup(hw.platform, sixteen, False, kind)
    per_partition = elems / hw.platform.sbuf_partitions
    return per_partition * cycles_per_elem / speed / _pm.clock_of(hw.platform, "vector") / hw.lnc


def _scalar_seconds(hw: Hardware, elems: float, sixteen: bool) -> float:
    speed = _pm.scalar_speedup(hw.platform, sixteen)
    per_partition = elems / hw.platform.sbuf_partitions
    return per_partition / speed / _pm.clock_of(hw.platform, "scalar") / hw.lnc


def _gpsimd_seconds(hw: Hardware, elems: float) -> float:
    per_partition = elems / hw.platform.sbuf_partitions
    # perf_model: iota/affine_select cost 150 + N cycles per instruction.
    return (150 + per_partition) / _pm.clock_of(hw.platform, "gpsimd") / hw.lnc


def _matmul_dims(op: str, ins: list[TensorMeta]) -> tuple[int, int, int, int] | None:
    """(batch, m, k, n) of a matrix product from its inputs."""
    b = _base(op)
    mats = [t for t in ins if len(t.shape) >= 1]
    if b in ("addmm", "baddbmm", "_addmm_activation", "addbmm", "addmv") and len(mats) >= 3:
        mats = mats[1:]
    if len(mats) < 2:
        return None
    a, w = mats[0].shape, mats[1].shape
    if b in ("mv", "addmv"):
        return (1, a[0], a[1], 1)
    if b in ("dot", "vdot"):
        return (1, 1, a[0], 1)
    if len(a) == 3 and len(w) == 3:
        return (a[0], a[1], a[2], w[2])
    if len(a) == 2 and len(w) == 2:
        return (1, a[0], a[1], w[1])
    return None


def _attention_dims(ins: list[TensorMeta], backward: bool):
    t = [x for x in ins if len(x.shape) == 4]
    if backward:
        t = t[1:]  # grad_out first
    if len(t) < 3:
        return None
    q, k, v = t[0].shape, t[1].shape, t[2].shape
    bh = q[0] * q[1]
    return bh, q[2], k[2], q[3], v[3]


def _causal_fraction(l: int, s: int) -> float:
    """Share of the score matrix a causal kernel computes: the lower triangle, in 128-row
    blocks (the diagonal blocks are full)."""
    if l <= 0 or s <= 0:
        return 1.0
    return min(1.0, 0.5 + 64.0 / max(min(l, s), 1))


# ---------------------------------------------------------------------------------------------
# the cost of one record
# ---------------------------------------------------------------------------------------------
def portability_of(rec: DeviceRecord) -> list[str]:
    """What would differ on a real Trainium: 64-bit dtypes (narrowed by the eager backend),
    ops without a device lowering, host tensors passed to device ops."""
    notes = []
    dts = {t.dtype for t in rec.tensors if not t.cpu}
    wide = sorted(dts & {"float64", "int64", "complex128", "uint64"})
    if wide:
        notes.append("64-bit:" + ",".join(wide))
    b = _base(rec.op)
    if rec.kind == "kernel" and b in NO_TRAINIUM_LOWERING:
        notes.append("no-lowering:" + b)
    if rec.kind != "memcpy" and any(t.cpu and t.numel > 1 for t in rec.tensors):
        notes.append("cpu-tensor")
    return notes


def cost_of(rec: DeviceRecord, hw: Hardware) -> Cost:
    """Estimated cost of one device record on ``hw``."""
    ins = [t for t in rec.tensors if t.read and not t.cpu]
    outs = [t for t in rec.tensors if t.written and not t.cpu]
    c = Cost()
    c.bytes_read = unique_bytes(ins)
    c.bytes_written = unique_bytes(outs)
    dtypes = [t.dtype for t in ins + outs if t.dtype.startswith(("float", "bfloat"))]
    c.dtype = dtypes[0] if dtypes else (ins[0].dtype if ins else "")
    c.notes = portability_of(rec)
    fixed = hw.fixed_s
    kind = rec.kind

    if kind == "nki":
        lat = float(rec.meta.get("nki_latency_us", 0.0)) * 1e3
        c.engine, c.bound = "tensor" if rec.meta.get("nki_flops") else "vector", "model"
        c.flops = int(rec.meta.get("nki_flops", 0))
        c.dtype = rec.meta.get("nki_dtype", c.dtype) or c.dtype
        c.est_ns = c.compute_ns = lat
        c.memory_ns = c.bytes / hw.mem_bw * 1e9
        return c
    if kind == "collective":
        from .estimate_collectives import collective_ns

        c.engine, c.bound = "collective", "network"
        c.est_ns = c.compute_ns = collective_ns(rec, hw)
        return c
    if kind in ("memcpy", "memset"):
        c.engine = "dma"
        nbytes = max(rec.bytes, c.bytes_written)
        if kind == "memcpy":
            c.bytes_read = c.bytes_read or nbytes
            c.bytes_written = c.bytes_written or nbytes
            # Host transfers: modelled at the core's DMA rate (no public PCIe figure).
            moved = nbytes if rec.copy in ("HtoD", "DtoH") else c.bytes
        else:
            c.bytes_read, c.bytes_written = 0, nbytes
            moved = nbytes
        c.memory_ns = moved / hw.mem_bw * 1e9
        src = {t.dtype for t in ins}
        dst = {t.dtype for t in outs}
        if src and dst and src != dst:  # a cast: VectorE tensor_copy as well
            elems = max((t.numel for t in outs), default=0)
            c.compute_ns = _vector_seconds(hw, elems, 1.0, bool(dst & _SIXTEEN), "copy") * 1e9
            c.engine = "vector"
        c.bound = "memory" if c.memory_ns >= c.compute_ns else "compute"
        c.est_ns = max(c.memory_ns, c.compute_ns) + fixed * 1e9
        if fixed * 1e9 > max(c.memory_ns, c.compute_ns):
            c.bound = "latency"
        return c

    op = rec.op
    b = _base(op)
    opname = op.split(".", 1)[0]
    in_shapes = [t.shape for t in ins]
    out_shapes = [t.shape for t in outs]
    out_elems = sum(t.numel for t in _dedupe(outs)) or max((t.numel for t in ins), default=0)
    in_elems = max((t.numel for t in ins), default=0)
    sixteen = c.dtype in _SIXTEEN
    engine = engine_of(op) if kind != "compiled" else "vector"
    secs = 0.0

    if kind == "compiled":
        c.flops = int(rec.meta.get("flops", 0))
        elems = max(c.flops, out_elems)
        secs = _vector_seconds(hw, elems, 1.0, sixteen, "tensor_scalar")
        if rec.meta.get("tensor_flops"):
            engine = "tensor"
    elif opname in ATTENTION_FWD or opname in ATTENTION_BWD:
        backward = opname in ATTENTION_BWD
        dims = _attention_dims(ins, backward)
        c.flops = flops_of(op, in_shapes, out_shapes, rec.meta)
        if dims:
            bh, l, s, e, ev = dims
            frac = _causal_fraction(l, s) if rec.meta.get("is_causal") else 1.0
            c.flops = int(c.flops * frac)
            mm = _tile_cycles(l, e, s) + _tile_cycles(l, s, ev)
            if backward:
                mm = 2.5 * mm  # recompute QK^T; dV, dP, dQ, dK
            secs = max(_tensor_seconds(hw, bh * mm * frac, c.dtype),
                       _scalar_seconds(hw, bh * l * s * frac, sixteen))
        engine = "tensor"
    elif b in MATMUL_OPS:
        dims = _matmul_dims(op, ins)
        c.flops = flops_of(op, in_shapes, out_shapes, rec.meta)
        if dims:
            bt, m, k, n = dims
            if not c.flops:
                c.flops = 2 * bt * m * k * n
            secs = _tensor_seconds(hw, bt * _tile_cycles(m, k, n), c.dtype)
    elif b in CONV_OPS:
        c.flops = flops_of(op, in_shapes, out_shapes, rec.meta)
        secs = c.flops / hw.peak_flops(c.dtype)  # implicit GEMM at the roof
    else:
        c.flops = flops_of(op, in_shapes, out_shapes, rec.meta)
        if b in SOFTMAX_FLOPS:
            # exp on ScalarE, max/sum reductions and the scale on VectorE, pipelined.
            secs = max(_scalar_seconds(hw, in_elems, sixteen),
                       _vector_seconds(hw, in_elems, 3.0, sixteen, "tensor_scalar"))
        elif b in NORM_FLOPS:
            passes = 8.0 if "backward" in b else 4.0
            secs = _vector_seconds(hw, in_elems, passes, sixteen, "tensor_scalar")
        elif b in REDUCTION_FLOPS:
            cyc = REDUCTION_FLOPS[b] * (0.5 if sixteen else 1.0)
            secs = _vector_seconds(hw, in_elems, cyc, False, "reduce")
        elif engine == "scalar":
            secs = _scalar_seconds(hw, out_elems, sixteen)
        elif engine == "gpsimd":
            secs = _gpsimd_seconds(hw, out_elems)
        elif engine == "dma":
            secs = 0.0
        elif b in BINARY_OPS:
            secs = _vector_seconds(hw, out_elems, 2.0 * POINTWISE_FLOPS.get(b, 1), sixteen,
                                   "tensor_tensor")
        else:
            secs = _vector_seconds(hw, out_elems, float(POINTWISE_FLOPS.get(b, 1)), sixteen,
                                   "tensor_scalar")
    c.engine = engine
    c.compute_ns = secs * 1e9
    c.memory_ns = c.bytes / hw.mem_bw * 1e9
    body = max(c.compute_ns, c.memory_ns)
    c.est_ns = body + fixed * 1e9
    if fixed * 1e9 > body:
        c.bound = "latency"
    else:
        c.bound = "compute" if c.compute_ns >= c.memory_ns else "memory"
    return c


def _dedupe(ts: list[TensorMeta]) -> list[TensorMeta]:
    seen = set()
    out = []
    for t in ts:
        key = (t.storage, t.offset, t.shape)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


@lru_cache(maxsize=8)
def hardware(platform: str | None = None, lnc: int | None = None) -> Hardware:
    """Cached :meth:`Hardware.current`."""
    return Hardware.current(platform, lnc)
