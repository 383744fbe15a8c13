// Adaptive Eager's precompiled kernel (fusion.h): a group of queued casts, scalings, clamps and
// a scale's amax (abs, whole-tensor max) run as one pass over the elements, tile by tile, with
// no code generation.
//
// These ops share a property the generated kernels (torchneuron/compile/eager_fusion.py) must
// otherwise buy with care: each element's bits depend on nothing but that element's inputs,
// never on how the elements are cut into vectors, threads or calls. A widening cast is exact; a
// narrowing to fp8 is c10's conversion (fp8.h, bit-identical on every path); a product with one
// value is one IEEE rounding; clamp's two bounds are ATen's max-then-min on both its vector
// and scalar paths (NaN passes through with its bits). So a fused pass computes what the
// unfused kernels do, bit for bit, whatever its own vector width and tiling; only the trips
// through memory between the ops go. (The one freedom IEEE leaves, which operand's payload
// NaN * NaN returns, ATen's own kernels leave open too: fusion.cpp's small-op comment.)
//
// Two more ops hold it only up to NaN and zero, and the caller completes them (fusion.cpp):
// abs clears the sign bit (ATen's bfloat16 scalar path canonicalizes a NaN instead), and a
// whole-tensor max does not depend on the order it is taken in unless the result is zero
// (+0 or -0 first) or NaN (which payload). run() reports the steps that met either.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace torchneuron::tile_fusion {

enum class Op : uint8_t {
  Widen,   // float32 out = bfloat16 in (exact)
  Narrow,  // float8_e4m3fn / float8_e5m2 out = float32 in (c10's conversion)
  Scale,   // float32 out = in * value (a 0-dim float32 tensor's value when the kernel runs)
  Clamp,   // float32 out = min(max(in, lo), hi)
  Abs,     // out = |in| (bfloat16 or float32): the sign bit cleared
  Max,     // *result = the max of in (bfloat16 or float32), one value
};

struct Step {
  Op op;
  uint8_t out, in;               // slots
  float lo = 0.f, hi = 0.f;      // Clamp's bounds
  const float* value = nullptr;  // Scale's factor, read when the group runs
  void* result = nullptr;        // Max's 0-dim output (in's dtype)
};

struct Slot {
  void* data;
  c10::ScalarType dtype;
  bool stored;  // false: an intermediate nothing can read afterwards (fusion.cpp): never written back
};

// Runs `steps` in order over elements [0, numel) of `slots`, tile by tile (parallel over the
// elements as ATen's elementwise kernels are). On AVX-512 hosts two kinds of runs of steps whose
// intermediates no other step reads skip the tiles and go in registers: an abs and the max of
// it (an amax: one integer max over the magnitudes' bits), and a scaling cast (widen, scale,
// clamp, narrow). Slots hold numel elements each. Sets redo[i]
// for each Max step i whose result was zero or NaN (its result is then unset) and each Abs
// step i that met a NaN (its NaNs' bits are then ATen's vector path's, not its scalar path's).
void run(const Step* steps, size_t nsteps, const Slot* slots, size_t nslots, int64_t numel, bool* redo);

}  // namespace torchneuron::tile_fusion
