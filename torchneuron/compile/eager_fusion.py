"""Adaptive Eager's kernel generator: one C++ kernel for a group of queued elementwise kernels.

The execution engine's fuser (csrc/backend/fusion.h) hands over a group *signature*: how many
float32 buffers of one element count the group touches, and its kernels in queue order, each
an op kind over buffer slots (the first written). This module writes the C++ of one loop that
runs the whole sequence per element, compiles it with Inductor's C++ toolchain (the compile
backend's code cache: flags, vector ISA, on-disk cache) in a background thread, and installs
the kernel's address in the fuser (``_C._fusion_install``).

Bit-identical to the unfused kernels by construction, not by tolerance. The loop reproduces
how ATen runs an elementwise kernel over contiguous float32: the range split across threads by
``at::parallel_for`` with TensorIterator's grain size and, in each thread's range, whole pairs
of vectors with the op's vector formula, then a scalar remainder (``vectorized_loop`` in
ATen/native/cpu/Loops.h). The vector part is written here with ATen's own vector primitives
(``at::vec::Vectorized``) in the formula of each op's ATen kernel; the remainders (fewer than
two vectors per thread) are handed back to the fuser, which runs them through the ATen kernels
themselves. So every element goes through the same arithmetic in the same order as unfused; only
the trips through memory between ops disappear. What this rules out (docs/architecture.md,
Adaptive Eager): reductions (a fused reduction would re-associate), other dtypes (bf16/fp16 ops
round each result to 16 bits), ops ATen computes with MKL's vector math (exp, tanh, ...) except
sqrt, and Inductor's own pointwise codegen, which measured 1-ulp to many-ulp differences from
ATen on add with alpha, lerp, addcmul, addcdiv, sqrt, exp and tanh (its vector math and FMA use
differ).

sqrt is the one MKL op taken, because the Adam family calls it in the middle of its step: ATen
computes float sqrt with MKL's ``vmsSqrt`` (not correctly rounded: ~20 % of results differ from
IEEE sqrt by an ulp), whose result per element does not depend on how the array is cut into
calls (checked at sizes 5 to 1 M, any offset, 1 and 2 threads). A kernel holding a sqrt runs
each thread's vector range in tiles of ``_TILE`` elements: the ops before the sqrt over the
tile, then ``vmsSqrt`` on it with ATen's mode, then the ops after; values an unstored slot
carries across a sqrt wait in a per-thread scratch tile instead of device memory.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import threading

import torch

__all__ = ["KINDS", "UNSTORED", "parse", "unstored", "source", "compile_signatures", "compile_signature", "request",
           "wait"]

# Op kinds, in the order of `enum Kind` in csrc/backend/fusion.h: (name, buffers, scalars,
# vector formula). x0 is the first input; s0 the first Python number. The formulas are those of
# ATen's float32 CPU kernels as built in the torch wheel (checked bit for bit by
# tests/device/test_fusion.py): ufunc add (a + alpha*b as fmadd(b, alpha, a)), BinaryOpsKernel
# (mul, div), PointwiseOpsKernel (addcmul, whose build contracts s*t1*t2 + self into one FMA;
# addcdiv), LerpKernel (lerp_vec). Only vector formulas: ATen's scalar remainders are compiled
# loops whose auto-vectorization (and so rounding) depends on the address alignment, so the
# fuser runs the remainders through ATen's kernels themselves (fusion.cpp). sqrt has no vector
# formula: it is a call of MKL's vmsSqrt over a tile (the module docstring).
KINDS = (
    ("add", 3, 1, "at::vec::fmadd({x1}, Vec({s0}), {x0})"),
    ("add_scalar", 2, 2, "at::vec::fmadd(Vec({s0}), Vec({s1}), {x0})"),
    ("mul", 3, 0, "{x0} * {x1}"),
    ("mul_scalar", 2, 1, "{x0} * Vec({s0})"),
    ("div", 3, 0, "{x0} / {x1}"),
    ("div_scalar", 2, 1, "{x0} / Vec({s0})"),
    ("addcmul", 4, 1, "at::vec::fmadd(Vec({s0}) * {x1}, {x2}, {x0})"),
    ("addcdiv", 4, 1, "{x0} + Vec({s0}) * {x1} / {x2}"),
    ("lerp_scalar", 3, 1, "lerp_vec({x0}, {x1}, {s0})"),
    ("sqrt", 2, 0, None),
    # (The enum's later kinds are the precompiled family's (casts, kScale, kClamp, kAbs, kMaxAll:
    # backend/tile_fusion.h) and the GEMM family's (fusion.cpp, fuse_gemm); their signatures
    # never reach this module.)
)

_PRELUDE = r"""
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

using Vec = at::vec::Vectorized<float>;

// LerpKernel.cpp's lerp_vec with a uniform weight.
static inline Vec lerp_vec(Vec start, Vec end, float w) {
  const Vec weight(w);
  const auto mask = weight.abs() < Vec(0.5f);
  const Vec coeff = Vec::blendv(weight - Vec(1.f), weight, mask);
  const Vec base = Vec::blendv(end, start, mask);
  return at::vec::fmadd(coeff, end - start, base);
}

// MKL's vector sqrt (LP64, exported by libtorch_cpu), called as ATen/cpu/vml.h calls it.
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode);
// MKL would open an OpenMP team of its own for each tile called from a thread outside a parallel
// region (a range below the grain size runs on the caller): one MKL thread per call instead.
extern "C" int MKL_Set_Num_Threads_Local(int n);
constexpr long long kVmlMode = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE

extern "C" int vec_size() { return Vec::size(); }
"""

# TensorIterator's grain size (at::internal::GRAIN_SIZE): the same split as unfused kernels.
_GRAIN = 32768
# Elements per tile of a kernel holding a sqrt (a multiple of two vectors of any width): 2 KB a
# buffer, so a tile's buffers stay in the first-level cache between the phases.
_TILE = 512


# In a signature, after the kernels: the slots not to store (intermediates nothing references).
UNSTORED = 0xFF


def _walk(signature: bytes) -> tuple[int, list[tuple[int, tuple[int, ...]]], int]:
    """parse(), and the offset just past the kernels."""
    nbufs, ops, i = signature[0], [], 1
    while i < len(signature) and signature[i] != UNSTORED:
        kind = signature[i]
        arity = KINDS[kind][1]
        ops.append((kind, tuple(signature[i + 1:i + 1 + arity])))
        i += 1 + arity
    return nbufs, ops, i


def parse(signature: bytes) -> tuple[int, list[tuple[int, tuple[int, ...]]]]:
    """(buffer count, [(kind, slots)]) of a group signature (fusion.cpp, Group::signature)."""
    nbufs, ops, _ = _walk(signature)
    return nbufs, ops


def unstored(signature: bytes) -> set[int]:
    """The slots a group's kernel leaves unstored: written, but their memory was freed before any
    kernel after the region was enqueued (fusion.cpp), so their values stay in registers."""
    end = _walk(signature)[2]
    return set(signature[end + 1:]) if end < len(signature) else set()


def _vector_phase(ops, load, store) -> list[str]:
    """One vector's sequence over `ops` [(kind, slots, first scalar)]: each slot loaded from
    ``load(slot)`` on first read, the written slots stored at the end to ``store(slot)`` (None:
    not stored)."""
    current: dict[int, str] = {}
    written: list[int] = []
    lines: list[str] = []
    for kind, slots, first in ops:
        _, _, nscalars, formula = KINDS[kind]
        names = {}
        for j, slot in enumerate(slots[1:]):
            if slot not in current:
                current[slot] = f"l{slot}"
                lines.append(f"const Vec l{slot} = Vec::loadu({load(slot)});")
            names[f"x{j}"] = current[slot]
        for j in range(nscalars):
            names[f"s{j}"] = f"s[{first + j}]"
        out = f"t{len(lines)}"
        lines.append(f"const Vec {out} = {formula.format(**names)};")
        current[slots[0]] = out
        if slots[0] not in written:
            written.append(slots[0])
    for slot in written:
        where = store(slot)
        if where is not None:
            lines.append(f"{current[slot]}.store({where});")
    return lines


def _with_scalars(ops) -> list[tuple[int, tuple[int, ...], int]]:
    """`ops` with the index of each op's first Python number."""
    out, scalar = [], 0
    for kind, slots in ops:
        out.append((kind, slots, scalar))
        scalar += KINDS[kind][2]
    return out


def _body(ops, skip: set[int] = frozenset()) -> list[str]:
    """One vector's sequence: loads on first read, stores of the written slots at the end
    (except the `skip` slots)."""
    return _vector_phase(_with_scalars(ops), lambda slot: f"b{slot} + i",
                         lambda slot: None if slot in skip else f"b{slot} + i")


def _tiled_body(ops, skip: set[int]) -> tuple[list[str], list[int]]:
    """The tile loop's body for a sequence holding sqrt: phases of vector ops split by the sqrt
    calls. A slot's current value is in device memory (``b<k>``) or, for an unstored slot a
    later phase reads, in its scratch tile (``c<k>``). Returns the lines and the scratch slots."""
    phases: list = []  # ("vec", [(kind, slots, first scalar)]) or ("sqrt", slots)
    for kind, slots, first in _with_scalars(ops):
        if KINDS[kind][3] is None:
            phases.append(("sqrt", slots))
        else:
            if not phases or phases[-1][0] != "vec":
                phases.append(("vec", []))
            phases[-1][1].append((kind, slots, first))

    def read_after(p: int) -> set[int]:
        later = set()
        for what, body in phases[p + 1:]:
            if what == "sqrt":
                later.add(body[1])
            else:
                for _, slots, _ in body:
                    later.update(slots[1:])
        return later

    where: dict[int, str] = {}  # slot -> "c" once its value moved to scratch
    scratch: list[int] = []

    def addr(slot: int, vec: bool) -> str:
        if where.get(slot) == "c":
            return f"c{slot} + (i - i0)" if vec else f"c{slot}"
        return f"b{slot} + i" if vec else f"b{slot} + i0"

    def to_scratch(slot: int) -> None:
        where[slot] = "c"
        if slot not in scratch:
            scratch.append(slot)

    lines: list[str] = []
    for p, (what, body) in enumerate(phases):
        later = read_after(p)

        def place(slot: int, later=later) -> bool:
            """Where a value written in this phase goes: False if nowhere (unstored, and no
            later phase reads it), else device memory or (unstored) the scratch tile."""
            if slot in skip:
                if slot not in later:
                    return False
                to_scratch(slot)
            else:
                where.pop(slot, None)
            return True

        if what == "sqrt":
            dst, src = body
            source = addr(src, False)
            if place(dst):
                lines.append(f"vmsSqrt(static_cast<int>(i1 - i0), {source}, {addr(dst, False)}, kVmlMode);")
            continue
        vec = _vector_phase(body, lambda slot: addr(slot, True),
                            lambda slot: addr(slot, True) if place(slot) else None)
        lines.append("for (int64_t i = i0; i < i1; i += Vec::size()) {")
        lines += ["  " + line for line in vec]
        lines.append("}")
    return lines, scratch


def _kernel(signature: bytes, name: str) -> str:
    nbufs, ops = parse(signature)
    bufs = "\n".join(f"  float* const b{k} = buffers[{k}];" for k in range(nbufs))
    skip = unstored(signature)
    doc = "; ".join(f"{KINDS[k][0]}{list(slots)}" for k, slots in ops) + (f"; unstored {sorted(skip)}" if skip else "")
    if not any(KINDS[kind][3] is None for kind, _ in ops):
        vec = "\n".join("      " + line for line in _body(ops, skip))
        loop = f"""    for (int64_t i = lo; i < vend; i += Vec::size()) {{
{vec}
    }}"""
    else:  # in tiles, for the sqrt calls (module docstring), on one MKL thread
        body, scratch = _tiled_body(ops, skip)
        alloc = f"new float[{len(scratch) * _TILE}]" if scratch else "nullptr"
        tiles = "".join(f"\n    float* const c{slot} = scratch.get() + {j * _TILE};" for j, slot in enumerate(scratch))
        inner = "\n".join("      " + line for line in body)
        loop = f"""    const int mkl_threads = MKL_Set_Num_Threads_Local(1);
    std::unique_ptr<float[]> scratch({alloc});{tiles}
    for (int64_t i0 = lo; i0 < vend; i0 += {_TILE}) {{
      const int64_t i1 = std::min<int64_t>(i0 + {_TILE}, vend);
{inner}
    }}
    MKL_Set_Num_Threads_Local(mkl_threads);"""
    return f"""
// {doc}
extern "C" void {name}(float* const* buffers, const float* s, int64_t n, int64_t* remainders) {{
{bufs}
  at::parallel_for(0, n, {_GRAIN}, [&](int64_t lo, int64_t hi) {{
    // As ATen's vectorized_loop: whole pairs of vectors here, the remainder by ATen's kernels.
    const int64_t vend = lo + (hi - lo) / (2 * Vec::size()) * (2 * Vec::size());
{loop}
    const int t = at::get_thread_num();
    remainders[2 * t] = vend;
    remainders[2 * t + 1] = hi;
  }});
}}
"""


def source(signatures: list[bytes]) -> str:
    """The C++ of one library holding the kernel of each signature, ``kernel_<i>``:
    ``void kernel_i(float* const* buffers, const float* scalars, int64_t n, int64_t* remainders)``.
    Each runs the vector part of every thread's range and leaves ``[begin, end)`` of the scalar
    remainder of thread t's range in ``remainders[2t], remainders[2t+1]``. (Adaptive Eager
    compiles one signature per library: ``request``.)"""
    return _PRELUDE + "".join(_kernel(sig, f"kernel_{i}") for i, sig in enumerate(signatures))


def _expected_vec_size() -> int | None:
    return {"AVX2": 8, "AVX512": 16}.get(torch.backends.cpu.get_cpu_capability())


_libs: list = []  # compiled libraries stay loaded (their kernels are installed in the fuser)


@functools.cache
def _code_cache() -> type:
    """Inductor's C++ code cache, compiling against a precompiled header: the one Inductor
    precompiles for its own CPU kernels (``torch/csrc/inductor/cpp_prefix.h``, which holds
    ATen's vector headers), built once per compiler and flags in Inductor's cache directory. A
    kernel then compiles in ~1.2 s instead of ~3 s, most of it parsing headers
    (bench/engine.py prints both)."""
    from torch._inductor import codecache

    class FusionCodeCache(codecache.CppCodeCache):
        cache: dict = {}

        @classmethod
        def _get_uncompiled_header(cls, device: str) -> str | None:
            return codecache._get_cpp_prefix_header(device)

    return FusionCodeCache


def compile_signatures(signatures: list[bytes]) -> list[int]:
    """Compile the kernels for `signatures` into one library; their addresses. Raises if they
    cannot match ATen."""
    expected = _expected_vec_size()
    if expected is None:
        raise NotImplementedError(
            f"Adaptive Eager matches ATen's AVX2 and AVX512 kernels only; this CPU runs ATen's "
            f"{torch.backends.cpu.get_cpu_capability()} kernels")
    lib = _code_cache().load(source(signatures))
    if lib.vec_size() != expected:
        raise RuntimeError(f"generated kernel vector width {lib.vec_size()} != ATen's {expected}")
    _libs.append(lib)
    return [ctypes.cast(getattr(lib, f"kernel_{i}"), ctypes.c_void_p).value for i in range(len(signatures))]


def compile_signature(signature: bytes) -> int:
    """Compile the kernel for one signature; its address."""
    return compile_signatures([signature])[0]


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_pending: list[concurrent.futures.Future] = []
_exiting = False
_lock = threading.Lock()
errors: list[str] = []  # why signatures failed to compile (their kernels run unfused)


def _forget_executor() -> None:
    """A forked child has no compiling thread (and the parent's lock may have been held): it
    starts its own when it needs one."""
    global _executor, _lock
    _executor = None
    _lock = threading.Lock()
    _pending.clear()


os.register_at_fork(after_in_child=_forget_executor)


def _stop_compiling() -> None:
    """At interpreter exit, before its threads are joined: compiles not started are dropped (a
    compile in progress finishes, so no half-written library is left in the code cache). The
    program is over; a kernel compiled now would never run."""
    global _exiting
    _exiting = True


try:  # concurrent.futures' own hook: runs before non-daemon threads are joined (atexit runs after)
    threading._register_atexit(_stop_compiling)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # another Python, or imported during shutdown
    pass


def _compile_and_install(signature: bytes) -> None:
    from .. import _C

    if _exiting:
        return
    try:
        address = compile_signature(signature)
    except Exception as e:  # noqa: BLE001 - the group runs unfused, for good
        errors.append(f"{parse(signature)}: {type(e).__name__}: {e}")
        address = 0
    _C._fusion_install(signature, address)


def request(signatures: list[bytes]) -> None:
    """Compile `signatures` in the background, one library each. Called by the fuser, which
    runs their groups unfused until the kernels are installed. (One library per signature, not
    per request: the code cache is keyed by the source, so a library holding a group of kernels
    would be found again only by a program requesting the same group together.)"""
    global _executor
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="neuron-fusion")
        _pending.extend(_executor.submit(_compile_and_install, sig) for sig in signatures)


def wait() -> None:
    """Wait for every requested compilation to finish (tests and benchmarks)."""
    while True:
        with _lock:
            pending = [f for f in _pending if not f.done()]
            _pending[:] = pending
        if not pending:
            return
        concurrent.futures.wait(pending)
