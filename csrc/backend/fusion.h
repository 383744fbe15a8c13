// Adaptive Eager (issue 13): runs of queued elementwise kernels run as one generated kernel.
//
// A queued kernel that fusion understands carries a Record (what it computes, over which
// bytes). When the queue runs, the engine offers the fuser the run of record-carrying kernels
// at its front (runtime/engine.h). The fuser splits the run into groups by element count
// (kernels of different groups touch disjoint memory, so they may run group by group), and
// runs each group as one kernel generated for its op sequence by
// torchneuron/compile/eager_fusion.py and cached by that sequence. Sequences are compiled in
// the background once seen twice; until then, or if compiling fails, the kernels run on their
// own. Generated kernels compute every element exactly as the ATen CPU kernel of each op does
// (same vector and scalar formulas, same parallel split), so fused results are bit-identical
// to unfused ones; docs/architecture.md, Adaptive Eager, says what that rules out.
//
// Scope: float32 contiguous tensors of one element count per kernel, and the ops of Kind. The
// generated kernel runs the vector part of each thread's range; the scalar remainders (ATen's
// compiled scalar loops round depending on address alignment) run through ATen's kernels here.
//
// A second family needs no generated code: casts between bfloat16, float32 and fp8, products
// with a 0-dim tensor's value, clamps, and abs with a whole-tensor max (the scaling casts of
// low-precision training and their amax, such as torchao's float8 casts), over dense tensors of
// one layout. Every element's bits depend only on its inputs, up to NaN and zero for abs and max
// (tile_fusion.h; those cases are redone through ATen), so a precompiled kernel runs their
// groups at once, tile by tile. Which intermediates it leaves unstored is known per allocation
// (allocator.h, freed_by). This family is on by default (it compiles nothing);
// TORCH_NEURONX_ENABLE_CONCATENATION=0 turns it off with the rest. A third family, under the
// same switch, puts the int8 -> bf16 widening of a matmul's weight and a per-column product
// after it into the AMX GEMM kernel or the few-row kernel (torchao's weight-only int8 linear;
// fusion.cpp, fuse_gemm).
// A region holds kernels of one family.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../runtime/engine.h"

namespace torchneuron::fusion {

// Must match KINDS in torchneuron/compile/eager_fusion.py.
enum Kind : uint8_t {
  kAdd,         // out = a + alpha * b                  (add, sub with -alpha)
  kAddScalar,   // out = a + alpha * s                  (a Python number s)
  kMul,         // out = a * b
  kMulScalar,   // out = a * s
  kDiv,         // out = a / b
  kDivScalar,   // out = a / s
  kAddcmul,     // out = a + value * b * c
  kAddcdiv,     // out = a + value * b / c
  kLerpScalar,  // out = lerp(a, b, weight)
  kSqrt,        // out = sqrt(a)                        (MKL's vmsSqrt, as ATen calls it)
  // The precompiled family (tile_fusion.h): never sent to the code generator.
  kWiden,       // float32 out = bfloat16 a
  kNarrow,      // float8 out = float32 a
  kScale,       // float32 out = a * (a 0-dim float32 tensor's value)
  kClamp,       // float32 out = clamp(a, lo, hi)
  kAbs,         // out = abs(a)                         (bfloat16 or float32; read only by a kMaxAll)
  kMaxAll,      // (0-dim) = max(a)                     (bfloat16 or float32: the amax of a scale)
  // The GEMM family (fusion.cpp, fuse_gemm): a bf16 matmul on amx_gemm.h's kernel (or
  // gemv.h's few-row kernel) with the int8 weight it reads widened in cache, and the
  // per-column product after it in its epilogue.
  kWidenInt8,   // bfloat16 out = int8 a                (exact)
  kToBf16,      // bfloat16 out = float32 a             (the column vector's cast)
  kMatmul,      // bfloat16 out = a @ b                 (gemm::amx_mm, gemv::few_rows)
  kMulCols,     // bfloat16 out = a * v                 (a m x n, v n values along the columns)
};

// Buffers of each kind: out, then inputs (kMaxAll: its input only; its 0-dim result is
// Record::result); and its Python numbers, in order.
inline constexpr uint8_t kArity[] = {3, 2, 3, 2, 3, 2, 4, 4, 3, 2, 2, 2, 2, 2, 2, 1, 2, 2, 3, 3};
inline constexpr uint8_t kScalars[] = {1, 2, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0};
// In a group's signature (fusion.cpp, Group), after the kernels: the slots not to store.
inline constexpr char kUnstored = static_cast<char>(0xFF);

// Calls fn(kind, slots, numbers) for each kernel of a group signature ([buffer count][kind,
// slots...]...[kUnstored, slots...]), in queue order: its slots (out, then inputs) and its first
// Python number in `numbers`, the group's numbers in kernel order. Returns the offset where the
// kernels end (the signature's size, or its kUnstored mark).
template <class Fn>
size_t for_each_op(const std::string& signature, const float* numbers, Fn&& fn) {
  size_t at = 1;
  while (at < signature.size() && signature[at] != kUnstored) {
    const auto kind = static_cast<Kind>(signature[at]);
    fn(kind, reinterpret_cast<const uint8_t*>(signature.data()) + at + 1, numbers);
    numbers += kScalars[kind];
    at += 1 + kArity[kind];
  }
  return at;
}

namespace detail {
extern bool g_on;      // TORCH_NEURONX_ENABLE_CONCATENATION=1 (or set_enabled); off by default
extern bool g_tiles;   // the precompiled family; on unless TORCH_NEURONX_ENABLE_CONCATENATION=0
}
// Whether queued kernels get records (a load; the fuser also checks determinism). A graph
// capture records them always: its replays may run with fusion on.
inline bool enabled() noexcept { return detail::g_on || neuron::rt::engine::capturing(); }
void set_enabled(bool on) noexcept;
// The same for the precompiled family (casts, products with a 0-dim value, clamps, amax).
inline bool tiles_enabled() noexcept { return detail::g_tiles || neuron::rt::engine::capturing(); }
void set_tiles_enabled(bool on) noexcept;
// The same for foreach list kernels (foreach.cpp): with fusion on, and with the precompiled
// family on where the interpreted kernel runs (fusion_interpreter.h), which then fuses an
// optimizer step's lists with nothing to compile.
bool lists_enabled() noexcept;

// Records of the hot ops (ops.cpp). `name` is the op's qualified name ("aten::add_.Tensor");
// `out` is the tensor written. Null when the call is outside fusion's scope.
neuron::rt::engine::Record binary(const char* name, const at::Tensor& out, const at::Tensor& self,
                                  const at::Tensor& other, const at::Scalar* alpha);
// The record of sqrt(self) into `out` (ops.cpp's queued sqrt, `name` its hot-op name).
neuron::rt::engine::Record sqrt(const char* name, const at::Tensor& out, const at::Tensor& self);
// One record per element of a list sqrt, outs[i] = sqrt(self[i]); null unless all can join.
neuron::rt::engine::Record list_sqrt(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& self,
                                     const char* name);
// Records of the precompiled family (null when the call is outside its scope): `out` =
// `self` cast (bfloat16 -> float32, float32 -> fp8); `out` = `self` * `other` where other is a
// 0-dim float32 neuron tensor (`name` the op's hot name); `out` = clamp(`self`, lo, hi).
neuron::rt::engine::Record cast(const at::Tensor& out, const at::Tensor& self);
neuron::rt::engine::Record scale(const char* name, const at::Tensor& out, const at::Tensor& self,
                                 const at::Tensor& other);
neuron::rt::engine::Record clamp(const char* name, const at::Tensor& out, const at::Tensor& self,
                                 const std::optional<at::Scalar>& lo, const std::optional<at::Scalar>& hi);
// The GEMM family (cast() records its int8 -> bf16 and float32 -> bf16 copies): `out` =
// `a` @ `b` run by `kernel`, A row-major and B column-major: gemm::amx_mm_out; on a half-rate
// host gemv::few_rows, or gemm::half_product (exact fp32 copies) with its queued call's
// `arena`; `out` = `self` * `other` (`name` the op's hot name) for a bf16 m x n `self` and a bf16
// `other` of n values broadcast along its rows.
enum class MatmulKernel : int64_t { kAmx = 0, kFewRows = 1, kRouted = 2 };
neuron::rt::engine::Record matmul(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                                  MatmulKernel kernel, const at::Tensor& arena = {});
neuron::rt::engine::Record col_scale(const char* name, const at::Tensor& out, const at::Tensor& self,
                                     const at::Tensor& other);
// `out` = abs(`self`); `out` (0-dim) = max(`self`) (torch.max(x), every element).
neuron::rt::engine::Record abs(const at::Tensor& out, const at::Tensor& self);
neuron::rt::engine::Record max_all(const at::Tensor& out, const at::Tensor& self);
// Records of ops queued by the boxed fallback (fallback.cpp), from their arguments.
neuron::rt::engine::Record boxed(const c10::OperatorHandle& op, const torch::jit::Stack& args);

// A kernel compiled for a group signature (eager_fusion.py), or 0 if compiling failed.
void install(const std::string& signature, uintptr_t kernel);
// Fault injection for tests of the failure path (a generated kernel itself cannot fail): the
// next fused region raises after running its first `groups` groups. -1 clears it.
void fail_after(int groups) noexcept;

struct Stats {
  uint64_t compiled = 0;  // group kernels installed
  uint64_t failed = 0;    // group signatures that failed to compile (run unfused for good)
  uint64_t requested = 0; // compilations requested
  uint64_t tiled = 0;     // groups run by the precompiled kernel (tile_fusion.h)
  uint64_t gemm = 0;      // matmuls run with a widened weight or a column product fused (fuse_gemm)
  uint64_t interpreted = 0;  // groups run by the interpreted kernel (fusion_interpreter.h)
};
Stats stats() noexcept;

}  // namespace torchneuron::fusion
