#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "zero_copy.h"

#include "../runtime/engine.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/TensorImpl.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "../runtime/runtime.h"
#include "allocator.h"

namespace torchneuron {

void check_device_index(int index) {
  try {
    neuron::rt::check_device(index);
  } catch (const std::out_of_range& e) {
    TORCH_CHECK(false, e.what());
  }
}

void ZeroCopy::set_device(int d) {
  if (cpu_output_ != nullptr) output_mismatch(d);
  if (cpu_seen_) {
    mismatch(at::Device(at::kCPU), at::Device(at::kPrivateUse1, static_cast<c10::DeviceIndex>(d)));
  }
  if (device_ < 0) {
    check_device_index(d);
    device_ = d;
  } else if (d != device_) {
    mismatch(at::Device(at::kPrivateUse1, static_cast<c10::DeviceIndex>(device_)),
             at::Device(at::kPrivateUse1, static_cast<c10::DeviceIndex>(d)));
  }
}

void ZeroCopy::mismatch(const at::Device& a, const at::Device& b) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
              "devices, ", a, " and ", b, "! Move them with .to(device) first.");
}

// An output on the CPU (out=, or a self mutated in place) for an op on a neuron device. CUDA
// accepts CPU tensors only as 0-dim *inputs*: its structured kernels check out= devices in
// resize_output, TensorIterator refuses a CPU output next to device inputs.
void ZeroCopy::output_mismatch(int d) {
  const at::Device dev(at::kPrivateUse1, static_cast<c10::DeviceIndex>(d));
  TORCH_CHECK(!cpu_output_is_out_, "Expected out tensor to have device ", dev, ", but got cpu instead");
  mismatch(dev, at::Device(at::kCPU));
}

// ---- alias recycling ----
// Every op makes a CPU alias (TensorImpl + StorageImpl) per device tensor argument; creating
// and destroying them is a large share of a small op's cost (measured: the 16-element add).
// Aliases nothing else kept are pooled per thread and retargeted by the next op. An alias is
// reusable only when this ZeroCopy held its last reference: no Python object, autograd, backend
// or fake-tensor metadata, no weak references (checked by sole_owner).
namespace {
constexpr size_t kAliasPoolSize = 16;
thread_local c10::SmallVector<c10::intrusive_ptr<c10::TensorImpl>, kAliasPoolSize> t_alias_pool;

bool sole_owner(const c10::intrusive_ptr<c10::TensorImpl>& p) {
  c10::TensorImpl* impl = p.get();
  return p.use_count() == 1 && p.weak_use_count() == 1 && impl->pyobj_slot()->load_pyobj() == nullptr &&
         impl->autograd_meta() == nullptr && impl->get_backend_meta() == nullptr &&
         impl->fake_tensor_mode() == nullptr && !impl->has_symbolic_sizes_strides() && !impl->is_python_dispatch() &&
         !impl->is_wrapped_number() && impl->allow_tensor_metadata_change() && impl->has_storage();
}

// ---- finding what an op call has seen (args_, storages_) ----
// A scan while the list is short; past kIndexFrom entries an index by key (an op over many
// tensors, a foreach list of 3 x 150 parameters, made the scans quadratic).
constexpr size_t kIndexFrom = 16;
using Index = std::unordered_map<const void*, size_t>;

// The position of the entry whose key() is `key` in `list`, or -1.
template <class List>
std::ptrdiff_t position(const List& list, const Index& index, const void* key) {
  if (index.empty()) {
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].key() == key) return static_cast<std::ptrdiff_t>(i);
    }
    return -1;
  }
  const auto it = index.find(key);
  return it == index.end() ? -1 : static_cast<std::ptrdiff_t>(it->second);
}

// Keeps `index` up to date after an entry was appended to `list`.
template <class List>
void index_last(const List& list, Index& index) {
  if (list.size() < kIndexFrom) return;
  if (list.size() == kIndexFrom) {
    for (size_t i = 0; i < list.size(); ++i) index.emplace(list[i].key(), i);
  } else {
    index.emplace(list.back().key(), list.size() - 1);
  }
}
}  // namespace

c10::Storage ZeroCopy::alias_storage(c10::StorageImpl* s, c10::TensorImpl* spare) {
  if (const auto i = position(storages_, storage_index_, s); i >= 0) return storages_[i].alias;
  void* data = s->data_ptr().get();
  const size_t nbytes = s->nbytes();
  c10::Storage alias;
  c10::StorageImpl* own = spare != nullptr ? spare->storage().unsafeGetStorageImpl() : nullptr;
  if (own != nullptr && c10::raw::intrusive_ptr::use_count(own) == 1 &&
      c10::raw::weak_intrusive_ptr::use_count(own) == 1 &&
      own->pyobj_slot()->load_pyobj() == nullptr && own->allocator() == c10::GetCPUAllocator()) {
    // The spare alias's own storage, held by nothing else: point it at these bytes.
    own->set_data_ptr_noswap(c10::DataPtr(data, c10::Device(c10::kCPU)));
    own->set_nbytes(nbytes);
    own->set_resizable(true);
    alias = spare->storage();
  } else {
    // Non-owning view of the device bytes. Resizable with the CPU allocator: if an out=
    // kernel grows it, sync_inputs() adopts the new buffer into the device storage.
    alias = c10::Storage(c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), nbytes, c10::DataPtr(data, c10::Device(c10::kCPU)),
        c10::GetCPUAllocator(), /*resizable=*/true));
  }
  storages_.push_back({s, alias, data, nbytes});
  index_last(storages_, storage_index_);
  return alias;
}

void ZeroCopy::recycle_aliases() noexcept {
  storages_.clear();  // the entries' references to the alias storages
  storage_index_.clear();
  arg_index_.clear();
  for (auto& a : args_) {
    c10::intrusive_ptr<c10::TensorImpl> impl = a.alias.getIntrusivePtr();
    a.alias.reset();
    if (t_alias_pool.size() < kAliasPoolSize && sole_owner(impl)) {
      t_alias_pool.push_back(std::move(impl));
    }
  }
}

at::Tensor ZeroCopy::in(const at::Tensor& t, bool allow_cpu, int64_t trace_flags) {
  if (!t.defined()) return t;
  const auto dev = t.device();
  if (dev.type() != c10::DeviceType::PrivateUse1) {
    if (dev.type() == c10::DeviceType::CPU && (allow_cpu || t.dim() == 0)) {
      if (!allow_cpu && (trace_flags & prof::kOutput)) {
        // A 0-dim CPU tensor the op would write: an error once the op is on a neuron device.
        cpu_output_ = t.unsafeGetTensorImpl();
        cpu_output_is_out_ = !(trace_flags & prof::kRead);
        if (device_ >= 0) output_mismatch(device_);
      }
      note_tensor(t, trace_flags);
      return t;
    }
    if (device_ >= 0) mismatch(at::Device(at::kPrivateUse1, static_cast<c10::DeviceIndex>(device_)), dev);
    TORCH_CHECK(dev.type() == c10::DeviceType::CPU || dev.type() == c10::DeviceType::Meta,
                "neuron operators cannot take tensors on ", dev);
    cpu_seen_ = dev.type() == c10::DeviceType::CPU;  // an error once a neuron tensor appears
    return t;
  }
  set_device(dev.index());
  // A kernel that runs now must see what every queued kernel wrote (engine.h), and may read an
  // alias before launch() (argument checks on values): the queue runs first.
  if (C10_UNLIKELY(!queued_ && neuron::rt::engine::pending())) neuron::rt::engine::drain();
  c10::TensorImpl* src = t.unsafeGetTensorImpl();
  // The same tensor passed twice (ldexp_ -> ldexp.out(self, other, out=self)) must stay one
  // tensor for the kernel: TensorIterator recognises an output that is also an input by
  // identity, and refuses to resize it ("doesn't match the broadcast shape").
  if (const auto i = position(args_, arg_index_, src); i >= 0) {
    note_tensor(t, trace_flags);
    return args_[i].alias;
  }
  c10::intrusive_ptr<c10::TensorImpl> impl;
  // A TensorImpl made under InferenceMode is an inference tensor for good (no autograd keys):
  // reused outside it, an alias the kernel marks requires_grad (SDPA's backend choice) raised
  // "inference tensor outside InferenceMode" (vLLM generating, then training, in one process).
  // So a pooled alias is reused only in the mode it was made in.
  while (!t_alias_pool.empty() && t_alias_pool.back()->is_inference() != c10::InferenceMode::is_enabled()) {
    t_alias_pool.pop_back();
  }
  if (!t_alias_pool.empty()) {
    impl = std::move(t_alias_pool.back());
    t_alias_pool.pop_back();
    impl->set_storage_and_dtype(alias_storage(src->storage().unsafeGetStorageImpl(), impl.get()), t.dtype());
  } else {
    impl = c10::make_intrusive<c10::TensorImpl>(alias_storage(src->storage().unsafeGetStorageImpl(), nullptr),
                                                c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  }
  // Set both ways: a pooled alias may carry the bits of its previous tensor.
  impl->_set_conj(src->is_conj());
  impl->_set_neg(src->is_neg());
  impl->set_sizes_and_strides(src->sizes(), src->strides(), src->storage_offset());
  at::Tensor alias(std::move(impl));
  args_.push_back({t, alias});
  index_last(args_, arg_index_);
  note_tensor(t, trace_flags);
  return alias;
}

at::Tensor ZeroCopy::in_output(const at::Tensor& t, bool allow_cpu, int64_t extra_flags) {
  return in(t, allow_cpu, prof::kOutput | extra_flags);
}

using prof::kernel_name;

void ZeroCopy::launch(const char* qualified_name) {
  track_hot(qualified_name);
  if (C10_UNLIKELY(trace_ != nullptr)) {
    prof::begin_execution(*trace_, neuron::rt::trace::Kind::Kernel, kernel_name(qualified_name));
  }
}

void ZeroCopy::launch(const c10::OperatorName& op) {
  track_fallback(op);
  if (C10_UNLIKELY(trace_ != nullptr)) {
    std::string name = op.name;
    if (!op.overload_name.empty()) name += "." + op.overload_name;
    // Fills are memsets on the device (DMA), which is how trace tools classify them.
    const bool fill = op.name == "aten::fill_" || op.name == "aten::zero_";
    if (fill) name.erase(0, 6);
    prof::begin_execution(*trace_, fill ? neuron::rt::trace::Kind::Memset : neuron::rt::trace::Kind::Kernel,
                          fill ? "Memset (" + name + ")" : kernel_name(name.c_str()));
    trace_->rec.meta.emplace_back("fallback", "1");  // no dedicated neuron kernel (boxed path)
  }
}

void ZeroCopy::launch_copy(neuron::rt::trace::CopyKind kind, int64_t bytes, bool blocking) {
  if (C10_LIKELY(trace_ == nullptr)) return;
  const char* dir = kind == neuron::rt::trace::CopyKind::HtoD   ? "HtoD"
                    : kind == neuron::rt::trace::CopyKind::DtoH ? "DtoH"
                                                                : "DtoD";
  trace_->rec.copy = kind;
  trace_->rec.bytes = bytes;
  trace_->rec.blocking = blocking;
  prof::begin_execution(*trace_, neuron::rt::trace::Kind::Memcpy, std::string("Memcpy ") + dir);
}

at::Tensor pooled(const ZeroCopy& zc, c10::IntArrayRef sizes, c10::ScalarType dtype, c10::IntArrayRef strides) {
  c10::OptionalDeviceGuard guard;
  if (zc.device() >= 0) {
    guard.reset_device(c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(zc.device())));
  }
  const auto keys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  return strides.empty() ? at::detail::empty_generic(sizes, device_allocator(), keys, dtype, std::nullopt)
                         : at::detail::empty_strided_generic(sizes, strides, device_allocator(), keys, dtype);
}

at::Tensor make_device_tensor(c10::Storage storage, const at::Tensor& like) {
  auto keys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  // A zero tensor's storage holds no data: losing the key would make kernels read it.
  if (like._is_zerotensor()) keys = keys | c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), keys, like.dtype());
  c10::TensorImpl* src = like.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(src->sizes(), src->strides(), src->storage_offset());
  if (src->is_conj()) impl->_set_conj(true);
  if (src->is_neg()) impl->_set_neg(true);
  return at::Tensor(std::move(impl));
}

namespace {
void release_storage_ref(void* ctx) { delete static_cast<c10::Storage*>(ctx); }
}  // namespace

at::Tensor ZeroCopy::adopt(const at::Tensor& cpu) {
  c10::StorageImpl* cs = cpu.storage().unsafeGetStorageImpl();
  for (auto& [key, dev_storage] : adopted_) {
    if (key == cs) return make_device_tensor(dev_storage, cpu);
  }
  const int device = device_ >= 0 ? device_ : neuron::rt::current_device();
  const size_t nbytes = cs->nbytes();
  // The device memory *is* the CPU result's memory: keep the CPU storage alive for as long
  // as the device storage lives (a reference, not a copy).
  void* data = cs->data_ptr().get();
  c10::DataPtr holder(data, new c10::Storage(cpu.storage()), &release_storage_ref,
                      c10::Device(c10::kCPU));
  c10::Storage dev_storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes,
      device_allocator()->adopt(device, std::move(holder), nbytes), device_allocator(),
      /*resizable=*/true));
  adopted_.emplace_back(cs, dev_storage);
  return make_device_tensor(std::move(dev_storage), cpu);
}

at::Tensor ZeroCopy::out(const at::Tensor& cpu) {
  if (C10_UNLIKELY(trace_ != nullptr)) {
    prof::end_execution(*trace_);
    at::Tensor r = map_out(cpu);
    prof::encode_tensor(trace_->rec.tensors, r, prof::kOutput);
    return r;
  }
  return map_out(cpu);
}

at::Tensor ZeroCopy::map_out(const at::Tensor& cpu) {
  if (!cpu.defined() || cpu.device().type() != c10::DeviceType::CPU) return cpu;
  c10::TensorImpl* impl = cpu.unsafeGetTensorImpl();
  for (auto& a : args_) {
    if (a.alias.unsafeGetTensorImpl() == impl) return a.device_tensor;  // in-place / out=
  }
  c10::StorageImpl* cs = impl->storage().unsafeGetStorageImpl();
  for (auto& e : storages_) {
    if (e.alias.unsafeGetStorageImpl() != cs) continue;
    // A view of an input: a device view of the original storage, keeping the base's keys.
    const at::Tensor* base = nullptr;
    for (auto& a : args_) {
      if (a.device_tensor.storage().unsafeGetStorageImpl() == e.device_storage) {
        base = &a.device_tensor;
        break;
      }
    }
    auto view = c10::make_intrusive<c10::TensorImpl>(
        c10::TensorImpl::VIEW, c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(e.device_storage)),
        base ? base->key_set() : c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), cpu.dtype());
    view->set_sizes_and_strides(impl->sizes(), impl->strides(), impl->storage_offset());
    if (impl->is_conj()) view->_set_conj(true);
    if (impl->is_neg()) view->_set_neg(true);
    return at::Tensor(std::move(view));
  }
  return adopt(cpu);
}

void ZeroCopy::release_tensors() {
  for (auto& a : args_) a.device_tensor.reset();
  arg_index_.clear();  // (keyed by the tensors just released)
}

void ZeroCopy::sync_inputs() {
  if (C10_UNLIKELY(trace_ != nullptr)) prof::end_execution(*trace_);
  for (auto& e : storages_) {
    c10::StorageImpl* alias = e.alias.unsafeGetStorageImpl();
    if (alias->data_ptr().get() == e.data && alias->nbytes() == e.nbytes) continue;
    // The kernel reallocated this buffer (out= resize): make the new bytes the device
    // storage's, in place, so every tensor sharing the storage sees them.
    const size_t nbytes = alias->nbytes();
    c10::DataPtr fresh = alias->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
    const int device = device_ >= 0 ? device_ : neuron::rt::current_device();
    if (fresh.get() == e.data) {
      e.device_storage->set_nbytes(nbytes);  // shrunk in place
    } else {
      e.device_storage->set_data_ptr_noswap(device_allocator()->adopt(device, std::move(fresh), nbytes));
      e.device_storage->set_nbytes(nbytes);
    }
    alias->set_data_ptr_noswap(c10::DataPtr(e.device_storage->data_ptr().get(), c10::Device(c10::kCPU)));
    e.data = e.device_storage->data_ptr().get();
    e.nbytes = nbytes;
  }
  for (auto& a : args_) {
    c10::TensorImpl* al = a.alias.unsafeGetTensorImpl();
    c10::TensorImpl* dv = a.device_tensor.unsafeGetTensorImpl();
    if (al->sizes() != dv->sizes() || al->strides() != dv->strides() ||
        al->storage_offset() != dv->storage_offset()) {
      dv->set_sizes_and_strides(al->sizes(), al->strides(), al->storage_offset());
    }
  }
}

void resize_storage_bytes(c10::StorageImpl* impl, size_t nbytes) {
  TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
  // Queued kernels hold aliases of the old bytes: they run first (no bytes, nothing to wait for:
  // a factory's empty result sized by its out= kernel, arange's).
  const size_t old = impl->nbytes();
  if (C10_UNLIKELY(old > 0 && neuron::rt::engine::pending())) neuron::rt::engine::drain();
  int device = impl->data_ptr().device().index();
  if (device < 0) device = neuron::rt::current_device();
  c10::DataPtr fresh = device_allocator()->allocate_on(device, nbytes);
  const size_t keep = std::min(old, nbytes);
  if (keep > 0 && impl->data_ptr().get() != nullptr) std::memcpy(fresh.get(), impl->data_ptr().get(), keep);
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(nbytes);
}

// ---- op tracking ----
namespace {
std::atomic<bool> g_tracking{true};
std::mutex g_track_mu;
std::unordered_map<const c10::OperatorName*, int64_t> g_fallback_counts;
std::unordered_map<const char*, int64_t> g_hot_counts;
}  // namespace

void track_fallback(const c10::OperatorName& name) {
  if (!g_tracking.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_track_mu);
  ++g_fallback_counts[&name];
}

void track_hot(const char* name) {
  if (!g_tracking.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_track_mu);
  ++g_hot_counts[name];
}

std::vector<std::pair<std::string, int64_t>> executed_ops(bool fallback_only) {
  neuron::rt::engine::drain_quietly();  // count what was enqueued, not only what has run
  std::lock_guard<std::mutex> lock(g_track_mu);
  std::unordered_map<std::string, int64_t> merged;
  for (auto& [name, n] : g_fallback_counts) {
    std::string s = name->name;
    if (!name->overload_name.empty()) s += "." + name->overload_name;
    merged[s] += n;
  }
  if (!fallback_only) {
    for (auto& [name, n] : g_hot_counts) merged[name] += n;
  }
  return {merged.begin(), merged.end()};
}

void clear_op_tracking() {
  neuron::rt::engine::drain_quietly();  // ops enqueued before the clear are not counted after it
  std::lock_guard<std::mutex> lock(g_track_mu);
  g_fallback_counts.clear();
  g_hot_counts.clear();
}

void set_op_tracking(bool enabled) { g_tracking.store(enabled); }

}  // namespace torchneuron
