// The profiler's recording entry points for the c10d backend (torchneuron._C_distributed, a
// separate extension): a table of function pointers handed over as the capsule
// torchneuron._C._trace_api, so both extensions share one trace buffer.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace torchneuron {

struct TraceApi {
  int version;  // kTraceApiVersion
  bool (*active)();
  uint64_t (*current_correlation)();
  int32_t (*thread_id)();
  int64_t (*now_ns)();
  // name, device, comm queue, framework op correlation, launching thread, launch start/end,
  // start/end (ns), bytes, extra args ("key\x1fjson\x1e..."), encoded tensors (may be null)
  void (*record_collective)(const char*, int, int64_t, uint64_t, int32_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, const char*, const std::vector<int64_t>*);
  void (*encode_tensor)(std::vector<int64_t>&, const at::Tensor&, int64_t flags);
  // Wait for the kernels the execution engine queued (runtime/engine.h) before a collective
  // reads device memory; throws the error of one that failed.
  void (*drain)();
};

constexpr int kTraceApiVersion = 2;

}  // namespace torchneuron
