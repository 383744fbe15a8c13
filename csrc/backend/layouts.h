// Tensor arguments and results of any layout for the boxed fallback: dense ones go through
// ZeroCopy (zero_copy.h), sparse ones through SparseAliases (sparse.h), nested ones through
// NestedAliases (nested.h). One LayoutAliases lives as long as one op call's ZeroCopy.
#pragma once

#include <ATen/Tensor.h>

#include "nested.h"
#include "sparse.h"
#include "zero_copy.h"

namespace torchneuron {

struct LayoutAliases {
  explicit LayoutAliases(ZeroCopy& zc) : sparse(zc), nested(zc) {}
  SparseAliases sparse;
  NestedAliases nested;
};

// trace_flags: how the profiler counts a dense argument's bytes (ZeroCopy::in).
inline at::Tensor alias_in(ZeroCopy& zc, LayoutAliases& la, const at::Tensor& t,
                           bool allow_cpu = false, int64_t trace_flags = 0) {
  if (is_sparse_layout(t)) return la.sparse.in(t);
  if (t.defined() && t.is_nested()) return la.nested.in(t);
  return zc.in(t, allow_cpu, trace_flags);
}
inline at::Tensor alias_out(ZeroCopy& zc, LayoutAliases& la, const at::Tensor& cpu) {
  if (is_sparse_layout(cpu)) return la.sparse.out(cpu);
  if (cpu.defined() && cpu.is_nested()) return la.nested.out(cpu);
  return zc.out(cpu);
}

}  // namespace torchneuron
