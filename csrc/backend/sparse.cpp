#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Sparse neuron tensors: the SparsePrivateUse1 and SparseCsrPrivateUse1 dispatch keys.
//
// Two routes, as for dense tensors:
//   * metadata ops (member accessors, constructors from members, resize, copy between
//     sparse tensors) run the CPU kernel directly on the neuron tensors: those kernels only
//     read and write the sparse tensor's fields and build results from the *options* they
//     are given, so they are device-generic (CPU and CUDA register the same functions);
//   * every other op goes through cpu_fallback (fallback.cpp), which aliases sparse
//     arguments with SparseAliases below and runs the SparseCPU / SparseCsrCPU kernel.
#include "sparse.h"

#include "fallback.h"

#include <ATen/SparseCsrTensorImpl.h>
#include <ATen/SparseTensorImpl.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <string>

namespace torchneuron {
namespace {

at::SparseTensorImpl* coo_impl(const at::Tensor& t) {
  return static_cast<at::SparseTensorImpl*>(t.unsafeGetTensorImpl());
}
at::SparseCsrTensorImpl* csr_impl(const at::Tensor& t) {
  return static_cast<at::SparseCsrTensorImpl*>(t.unsafeGetTensorImpl());
}

// A sparse tensor over the given members, for the device (or CPU) that owns them. The
// impl takes its device from the current device when it is built, hence the guard.
at::Tensor make_coo(c10::DispatchKey key, const at::Tensor& like, const at::Tensor& indices,
                    const at::Tensor& values, int64_t sparse_dim, int64_t dense_dim,
                    c10::IntArrayRef sizes, bool coalesced) {
  c10::OptionalDeviceGuard guard;
  if (values.device().type() == c10::DeviceType::PrivateUse1) guard.reset_device(values.device());
  auto impl = c10::make_intrusive<at::SparseTensorImpl>(c10::DispatchKeySet(key), like.dtype());
  impl->raw_resize_(sparse_dim, dense_dim, sizes);
  impl->set_indices_and_values_unsafe(indices, values);
  impl->set_coalesced(coalesced);
  return at::Tensor(std::move(impl));
}

at::Tensor make_compressed(c10::DispatchKey key, const at::Tensor& like, const at::Tensor& compressed,
                           const at::Tensor& plain, const at::Tensor& values, c10::IntArrayRef sizes) {
  auto impl = c10::make_intrusive<at::SparseCsrTensorImpl>(c10::DispatchKeySet(key), values.device(),
                                                           like.layout(), like.dtype());
  impl->set_member_tensors(compressed, plain, values, sizes);
  return at::Tensor(std::move(impl));
}

}  // namespace

at::Tensor SparseAliases::in(const at::Tensor& t) {
  // CPU (or other) sparse tensors get the dense rules: an error next to neuron tensors.
  if (t.device().type() != c10::DeviceType::PrivateUse1) return zc_.in(t);
  at::Tensor alias;
  Entry e;
  if (t.is_sparse()) {
    auto* d = coo_impl(t);
    at::Tensor idx = zc_.in(d->indices()), val = zc_.in(d->values());
    alias = make_coo(c10::DispatchKey::SparseCPU, t, idx, val, d->sparse_dim(), d->dense_dim(),
                     t.sizes(), d->coalesced());
    e.members[0] = idx.unsafeGetTensorImpl();
    e.members[1] = val.unsafeGetTensorImpl();
    e.members[2] = nullptr;
  } else {
    auto* d = csr_impl(t);
    at::Tensor ci = zc_.in(d->compressed_indices()), pi = zc_.in(d->plain_indices()),
               val = zc_.in(d->values());
    alias = make_compressed(c10::DispatchKey::SparseCsrCPU, t, ci, pi, val, t.sizes());
    e.members[0] = ci.unsafeGetTensorImpl();
    e.members[1] = pi.unsafeGetTensorImpl();
    e.members[2] = val.unsafeGetTensorImpl();
  }
  e.device = t;
  e.alias = alias;
  e.sizes = t.sizes().vec();
  entries_.push_back(std::move(e));
  return alias;
}

void SparseAliases::sync() {
  for (auto& e : entries_) {
    const at::Tensor& a = e.alias;
    const bool resized = a.sizes() != c10::IntArrayRef(e.sizes);
    if (a.is_sparse()) {
      auto* ai = coo_impl(a);
      auto* di = coo_impl(e.device);
      const bool replaced = ai->indices().unsafeGetTensorImpl() != e.members[0] ||
                            ai->values().unsafeGetTensorImpl() != e.members[1];
      if (resized || replaced || ai->sparse_dim() != di->sparse_dim()) {
        di->raw_resize_(ai->sparse_dim(), ai->dense_dim(), a.sizes());
        di->set_indices_and_values_unsafe(zc_.out(ai->indices()), zc_.out(ai->values()));
      }
      di->set_coalesced(ai->coalesced());
    } else {
      auto* ai = csr_impl(a);
      const bool replaced = ai->compressed_indices().unsafeGetTensorImpl() != e.members[0] ||
                            ai->plain_indices().unsafeGetTensorImpl() != e.members[1] ||
                            ai->values().unsafeGetTensorImpl() != e.members[2];
      if (resized || replaced) {
        csr_impl(e.device)->set_member_tensors(zc_.out(ai->compressed_indices()),
                                               zc_.out(ai->plain_indices()), zc_.out(ai->values()),
                                               a.sizes());
      }
    }
  }
}

at::Tensor SparseAliases::out(const at::Tensor& cpu) {
  if (cpu.device().type() != c10::DeviceType::CPU) return cpu;
  for (auto& e : entries_) {
    if (e.alias.unsafeGetTensorImpl() == cpu.unsafeGetTensorImpl()) return e.device;  // in-place
  }
  if (cpu.is_sparse()) {
    auto* c = coo_impl(cpu);
    return make_coo(c10::DispatchKey::SparsePrivateUse1, cpu, zc_.out(c->indices()), zc_.out(c->values()),
                    c->sparse_dim(), c->dense_dim(), cpu.sizes(), c->coalesced());
  }
  auto* c = csr_impl(cpu);
  return make_compressed(c10::DispatchKey::SparseCsrPrivateUse1, cpu, zc_.out(c->compressed_indices()),
                         zc_.out(c->plain_indices()), zc_.out(c->values()), cpu.sizes());
}

namespace {

void sparse_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  cpu_fallback(op, stack, c10::DispatchKey::SparseCPU);
}
void sparse_compressed_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  cpu_fallback(op, stack, c10::DispatchKey::SparseCsrCPU);
}

// Every op with a SparseCPU (SparseCsrCPU) kernel gets the same route on neuron, listed
// explicitly: a backend fallback would lose to the op's CompositeExplicitAutograd(NonFunctional)
// kernel where one exists (structured ops such as mm, sin, add), and that kernel allocates its
// result with the sparse input's options, which CPU's own sparse kernel never does. The
// metadata ops get generic_kernel: SparseCPU and SparseCsrCPU register the same functions
// for them as SparseMeta (tests/device/test_sparse.py checks it, so a kernel that started
// touching data on CPU would be noticed), except COO's copy_, whose CPU kernel only checks
// the layouts and calls copy_sparse_to_sparse_. Running copies here, not on aliases, is
// what lets them cross devices (sparse .to() / .cpu() / copy_ from a CPU sparse tensor).
const char* const kGenericCoo[] = {
    "_indices", "_values", "indices", "values", "_nnz", "sparse_dim", "dense_dim", "_dimV",
    "is_coalesced", "_coalesced_", "_sparse_coo_tensor_with_dims",
    "_sparse_coo_tensor_with_dims_and_tensors", "empty.memory_format", "sparse_resize_",
    "sparse_resize_and_clear_", "copy_sparse_to_sparse_", "copy_"};
const char* const kGenericCompressed[] = {"crow_indices", "col_indices", "ccol_indices", "row_indices",
                                          "values", "_nnz", "sparse_dim", "dense_dim",
                                          "empty.memory_format", "copy_", "resize_as_sparse_"};

// Random ops must draw from the neuron generator (random.cpp), never run a CPU kernel on
// aliases. The one sparse random kernel of torch 2.13, SparseCsrCPU's normal_, fills the
// values; so does this, through the dense neuron kernel.
at::Tensor& sparse_compressed_normal_(at::Tensor& self, double mean, double std, std::optional<at::Generator> gen) {
  self.values().normal_(mean, std, gen);
  return self;
}

bool register_compressed_normal(torch::Library& m, const std::string& name) {
  if (name != "normal_") return false;
  m.impl("normal_", TORCH_FN(sparse_compressed_normal_));
  return true;
}

}  // namespace

std::vector<std::string> sparse_generic_ops(bool compressed) {
  if (compressed) return {std::begin(kGenericCompressed), std::end(kGenericCompressed)};
  return {std::begin(kGenericCoo), std::end(kGenericCoo)};
}

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_fallback>());
}
TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_compressed_fallback>());
}
TORCH_LIBRARY_IMPL(aten, SparsePrivateUse1, m) {
  register_layout_ops<c10::DispatchKey::SparseCPU, &sparse_fallback>(m, kGenericCoo);
}
TORCH_LIBRARY_IMPL(aten, SparseCsrPrivateUse1, m) {
  register_layout_ops<c10::DispatchKey::SparseCsrCPU, &sparse_compressed_fallback>(m, kGenericCompressed,
                                                                                   register_compressed_normal);
}

}  // namespace torchneuron
