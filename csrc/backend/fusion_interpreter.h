// Adaptive Eager's interpreted kernel (fusion.h): a group of queued float32 elementwise kernels
// (the generated kernels' ops, Kind kAdd..kSqrt) run tile by tile by a precompiled loop, with no
// code generation.
//
// It computes what a generated kernel computes (torchneuron/compile/eager_fusion.py), bit for
// bit, by the same rules: each op's vector formula as ATen's float32 CPU kernel writes it, the
// elements split across threads as ATen splits them (at::parallel_for, TensorIterator's grain),
// in each thread's range whole pairs of 16-float vectors here and the scalar remainder handed
// back to the caller, which runs it through ATen's kernels (fusion.cpp, run_remainder). Where it
// differs is only in where values wait between ops: a generated kernel keeps a vector's values
// in registers through the whole sequence, this one runs one op at a time over a tile of 512
// elements that stays in the first-level cache (unstored slots in a per-thread scratch tile,
// never in device memory), so it pays a load and a store per op and element that the generated
// kernel does not, and nothing to compile.
//
// Adaptive Eager runs a group here when its generated kernel is not compiled (yet, or at all:
// with TORCH_NEURONX_ENABLE_CONCATENATION unset, the foreach list kernels of an optimizer step,
// the one region of elementwise kernels that recurs in every training step, fuse here by default).
#pragma once

#include <cstdint>
#include <string>

namespace torchneuron::fusion_interpreter {

// Whether this host runs it: AVX-512 (its vectors), ATen's float kernels at least AVX2 (whose
// vector formulas use FMA as the ones here do; the remainders' split is a multiple of either
// width) and MKL (sqrt is MKL's vmsSqrt, as ATen's).
bool available() noexcept;

// Runs the group `signature` (fusion.cpp, Group::signature: [buffer count][kind, slots...]...
// optionally followed by [kUnstored, slots...]) over elements [0, numel) of `buffers`, with the
// Python numbers `scalars` in op order, and leaves [begin, end) of each thread t's scalar
// remainder in remainders[2t], remainders[2t + 1] (the array holds two entries per intra-op
// thread, zeroed by the caller), as a generated kernel does.
void run(const std::string& signature, float* const* buffers, const float* scalars, int64_t numel,
         int64_t* remainders);

}  // namespace torchneuron::fusion_interpreter
