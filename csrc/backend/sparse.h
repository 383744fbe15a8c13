// Sparse neuron tensors (COO and CSR/CSC/BSR/BSC) over CPU sparse kernels, zero-copy.
//
// A sparse tensor owns no storage: it is metadata (sizes, sparse/dense dims, layout, the
// coalesced flag) around dense member tensors (indices and values; compressed and plain
// indices and values). On neuron the members are ordinary dense neuron tensors, so a sparse
// neuron tensor aliases as a sparse CPU tensor whose members are the ZeroCopy aliases of
// its members. CPU sparse kernels run on that alias; results map back member by member.
#pragma once

#include <ATen/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/SmallVector.h>

#include <string>
#include <vector>

#include "zero_copy.h"

namespace torchneuron {

// COO or any compressed layout (the layouts with their own dispatch keys).
inline bool is_sparse_layout(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return impl != nullptr && (impl->is_sparse() || impl->is_sparse_compressed());
}

class SparseAliases {
 public:
  explicit SparseAliases(ZeroCopy& zc) : zc_(zc) {}

  // A sparse neuron tensor as a sparse CPU tensor over aliases of its members (device
  // checks as for dense arguments); other tensors go through ZeroCopy::in.
  at::Tensor in(const at::Tensor& t);

  // After the kernel (and ZeroCopy::sync_inputs): in-place sparse kernels replace, narrow or
  // resize an argument's members and change its shape or coalesced flag; carry that over to
  // the neuron tensor.
  void sync();

  // A sparse CPU result as a sparse neuron tensor: the original argument for an in-place
  // result, else a new sparse neuron tensor whose members are ZeroCopy::out of the CPU
  // members (input members come back as themselves, fresh ones are adopted).
  at::Tensor out(const at::Tensor& cpu);

 private:
  struct Entry {
    at::Tensor device, alias;
    // The alias's members and shape as built, to detect what a kernel changed.
    c10::TensorImpl* members[3];
    std::vector<int64_t> sizes;
  };
  ZeroCopy& zc_;
  c10::SmallVector<Entry, 2> entries_;
};

// The ops of the sparse (compressed=false) or compressed keys that run their CPU kernel
// directly on the neuron tensors (sparse.cpp), as "name.overload".
std::vector<std::string> sparse_generic_ops(bool compressed);

}  // namespace torchneuron
