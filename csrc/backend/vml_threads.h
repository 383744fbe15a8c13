// Small calls of MKL's vector math on one MKL thread.
//
// ATen computes sqrt, exp, log, tanh, sin, erf, trunc and a few more float/double ops with MKL's
// vector math (ATen/cpu/vml.h). Below its 2,048-element grain ATen makes one call from the
// calling thread, outside any parallel region, and MKL then opens an OpenMP team of its own for
// it: a 128-element exp or sqrt costs 1.9 us on CPU against 1.0 us on one MKL thread (2-core
// host). Those functions are elementwise and give the same bits for any number of MKL threads
// (tests/device/test_vml_threads.py checks each op), so neuron makes such small calls with MKL's
// thread count set to one for the calling thread, for the duration of the call. Where the team
// pays for itself depends on the function's cost: one thread wins below 2,048 elements for sqrt
// and trunc, below ~900 for tanh, ~1,500 for atan, ~2,000 for exp and log (measured, CPU); so
// the bound is 2,048 for the cheap two and 512 for the others. Larger calls keep ATen's split.
#pragma once

#include <ATen/Config.h>
#include <ATen/core/operator_name.h>

#include <cstdint>

#if AT_MKL_ENABLED()
extern "C" int MKL_Set_Num_Threads_Local(int nt);  // MKL's service API, exported by libtorch_cpu
#endif

namespace torchneuron {

// ATen's grain for its vector-math kernels (UnaryOpsKernel.cpp): below it, one call, no region.
constexpr int64_t kVmlGrain = 2048;
// The bound for sqrt (ops.cpp, foreach.cpp) and trunc.
constexpr int64_t kCheapVmlBound = kVmlGrain;

// For an ATen op computed with MKL's vector math (functional, in-place, out=): the element count
// below which it runs on one MKL thread (at most kVmlGrain); 0 for any other op.
int64_t serial_vml_bound(const c10::OperatorName& op);

// RAII: one MKL thread for the calling thread while alive, if `on`.
class SerialVml {
 public:
  explicit SerialVml(bool on) {
#if AT_MKL_ENABLED()
    if (on) {
      saved_ = MKL_Set_Num_Threads_Local(1);
      on_ = true;
    }
#else
    (void)on;
#endif
  }
  ~SerialVml() {
#if AT_MKL_ENABLED()
    if (on_) MKL_Set_Num_Threads_Local(saved_);
#endif
  }
  SerialVml(const SerialVml&) = delete;
  SerialVml& operator=(const SerialVml&) = delete;

 private:
  bool on_ = false;
  int saved_ = 0;
};

}  // namespace torchneuron
