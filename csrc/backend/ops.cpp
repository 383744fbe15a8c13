#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Native neuron kernels: the metadata-only ops every backend must provide (empty, views,
// resize, set_, copies, scalar reads), and unboxed fast paths for hot ops. The GEMM family
// and convolution live in gemm.cpp. Everything else reaches the boxed zero-copy fallback
// (fallback.cpp).
#include <ATen/EmptyTensor.h>
#include <ATen/InferSize.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ScalarOps.h>
#include <ATen/TensorUtils.h>
#include <ATen/ExpandUtils.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/cat_cpu_dispatch.h>
#include <ATen/ops/cat_meta_dispatch.h>
#include <ATen/ops/embedding_dense_backward_cpu_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/eq_cpu_dispatch.h>
#include <ATen/ops/eq_meta_dispatch.h>
#include <ATen/ops/ge_cpu_dispatch.h>
#include <ATen/ops/ge_meta_dispatch.h>
#include <ATen/ops/gt_cpu_dispatch.h>
#include <ATen/ops/gt_meta_dispatch.h>
#include <ATen/ops/le_cpu_dispatch.h>
#include <ATen/ops/le_meta_dispatch.h>
#include <ATen/ops/lt_cpu_dispatch.h>
#include <ATen/ops/lt_meta_dispatch.h>
#include <ATen/ops/ne_cpu_dispatch.h>
#include <ATen/ops/ne_meta_dispatch.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/nll_loss_backward_cpu_dispatch.h>
#include <ATen/ops/nll_loss_backward_meta_dispatch.h>
#include <ATen/ops/nll_loss_forward_cpu_dispatch.h>
#include <ATen/ops/nll_loss_forward_meta_dispatch.h>
#include <ATen/ops/_log_softmax_backward_data_cpu_dispatch.h>
#include <ATen/ops/_softmax_backward_data_cpu_dispatch.h>
#include "cpu_stub.h"  // before DispatchStub.h: CPU stubs are called below (GELU, layer norm)
#include <ATen/native/Activation.h>
#include <ATen/native/ReduceOpsUtils.h>
#include <ATen/native/Resize.h>
#include <ATen/native/layer_norm.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/add_cpu_dispatch.h>
#include <ATen/ops/div_cpu_dispatch.h>
#include <ATen/ops/mean_cpu_dispatch.h>
#include <ATen/ops/mul_cpu_dispatch.h>
#include <ATen/ops/sub_cpu_dispatch.h>
#include <ATen/ops/sqrt_cpu_dispatch.h>
#include <ATen/ops/clamp_cpu_dispatch.h>
#include <ATen/ops/cos_cpu_dispatch.h>
#include <ATen/ops/erf_cpu_dispatch.h>
#include <ATen/ops/exp_cpu_dispatch.h>
#include <ATen/ops/expm1_cpu_dispatch.h>
#include <ATen/ops/log_cpu_dispatch.h>
#include <ATen/ops/log1p_cpu_dispatch.h>
#include <ATen/ops/neg_cpu_dispatch.h>
#include <ATen/ops/reciprocal_cpu_dispatch.h>
#include <ATen/ops/rsqrt_cpu_dispatch.h>
#include <ATen/ops/sigmoid_cpu_dispatch.h>
#include <ATen/ops/sin_cpu_dispatch.h>
#include <ATen/ops/tanh_cpu_dispatch.h>
#include <ATen/ops/sum_cpu_dispatch.h>
#include <ATen/ops/_softmax_cpu_dispatch.h>
#include <ATen/ops/_log_softmax_cpu_dispatch.h>
#include <ATen/ops/gelu_cpu_dispatch.h>
#include <ATen/ops/gelu_backward_cpu_dispatch.h>
#include <ATen/ops/native_group_norm_cpu_dispatch.h>
#include <ATen/ops/native_group_norm_backward_cpu_dispatch.h>
#include <ATen/ops/native_layer_norm_cpu_dispatch.h>
#include <ATen/ops/native_layer_norm_backward_cpu_dispatch.h>
#include <ATen/ops/pow_cpu_dispatch.h>
#include <ATen/ops/silu_cpu_dispatch.h>
#include <ATen/ops/silu_backward_cpu_dispatch.h>
#include <ATen/ops/threshold_backward_cpu_dispatch.h>
#include <ATen/ops/index_select_cpu_dispatch.h>
#include <ATen/ops/relu_cpu_dispatch.h>
#include <ATen/ops/arange_cpu_dispatch.h>
#include <ATen/ops/masked_fill_cpu_dispatch.h>
#include <ATen/native/RangeUtils.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/clamp_min_cpu_dispatch.h>
#include <ATen/ops/mse_loss_cpu_dispatch.h>
#include <ATen/ops/mse_loss_backward_cpu_dispatch.h>
#include <ATen/ops/_local_scalar_dense_ops.h>
#include <ATen/ops/copy.h>
#include <ATen/ops/result_type.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../runtime/runtime.h"
#include "allocator.h"
#include "embedding_backward.h"
#include "enqueue.h"
#include "fusion.h"
#include "fallback.h"
#include "gelu_tanh.h"
#include "fp8.h"
#include "gpu_trace.h"
#include "sync_debug.h"
#include "transpose.h"
#include "vml_threads.h"
#include "zero_copy.h"

// ATen/native/group_norm.h's stubs. That header cannot be included next to layer_norm.h (both
// name their stubs' types at::native::forward_fn / backward_fn), so its two declarations are
// repeated here, with other names for the types (torch 2.13's signatures; torch is pinned).
namespace at::native {
using group_norm_fn = void (*)(const Tensor& X, const Tensor& gamma, const Tensor& beta, int64_t N, int64_t C,
                               int64_t HxW, int64_t group, double eps, Tensor& Y, Tensor& mean, Tensor& rstd);
using group_norm_backward_fn = void (*)(const Tensor& dY, const Tensor& X, const Tensor& mean, const Tensor& rstd,
                                        const Tensor& gamma, int64_t N, int64_t C, int64_t HxW, int64_t group,
                                        Tensor& dX, Tensor& dgamma, Tensor& dbeta);
DECLARE_DISPATCH(group_norm_fn, GroupNormKernel)
DECLARE_DISPATCH(group_norm_backward_fn, GroupNormBackwardKernel)
}  // namespace at::native

namespace torchneuron {
namespace {

// Makes `device` current for the scope (allocations use the current device).
struct CurrentDevice {
  int saved;
  explicit CurrentDevice(int device) : saved(neuron::rt::current_device()) {
    if (device != saved) neuron::rt::set_current_device(device);
  }
  ~CurrentDevice() {
    if (saved != neuron::rt::current_device()) neuron::rt::set_current_device(saved);
  }
};

int target_device(std::optional<c10::Device> device) {
  int d = device && device->has_index() ? device->index() : neuron::rt::current_device();
  check_device_index(d);
  return d;
}

// ---- factories and metadata ----------------------------------------------------------
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!pin_memory.value_or(false), "Only dense CPU tensors can be pinned");
  TORCH_CHECK(layout.value_or(c10::kStrided) == c10::kStrided,
              "neuron supports strided tensors only, not layout ", *layout);
  CurrentDevice guard(target_device(device));
  return at::detail::empty_generic(size, device_allocator(),
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  TORCH_CHECK(!pin_memory.value_or(false), "Only dense CPU tensors can be pinned");
  TORCH_CHECK(layout.value_or(c10::kStrided) == c10::kStrided,
              "neuron supports strided tensors only, not layout ", *layout);
  CurrentDevice guard(target_device(device));
  return at::detail::empty_strided_generic(size, stride, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// Zero tensors (autograd's efficient zeros) own no memory: the ZeroTensor key makes every
// kernel treat them as zeros. Built like CPU's, with the neuron key.
at::Tensor efficient_zero_tensor(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                                 std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                                 std::optional<bool> pin_memory) {
  c10::Device dev(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(target_device(device)));
  at::native::ZeroTensorAllocator allocator(dev);
  auto keys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1) |
              c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);
  return at::detail::empty_generic(size, &allocator, keys, c10::dtype_or_default(dtype), std::nullopt);
}

void grow_storage(const at::Tensor& self, size_t needed) {
  c10::StorageImpl* storage = self.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  if (needed > storage->nbytes()) resize_storage_bytes(storage, needed);
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef sym_size,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto size = C10_AS_INTARRAYREF_SLOW(sym_size);
  auto* impl = self.unsafeGetTensorImpl();
  if (impl->sizes() == size && !memory_format) return self;  // keeps existing strides
  for (int64_t s : size) TORCH_CHECK(s >= 0, "Trying to create tensor with negative dimension ", s);
  impl->set_sizes_contiguous(size);
  const size_t needed = at::detail::computeStorageNbytesContiguous(
      size, self.dtype().itemsize(), impl->storage_offset());
  if (impl->numel() > 0) grow_storage(self, needed);
  if (memory_format) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve,
                "Unsupported memory format ", *memory_format);
    impl->empty_tensor_restride(*memory_format);
  }
  return self;
}

at::Tensor& set_storage_offset(at::Tensor& self, c10::Storage storage, c10::SymInt sym_offset,
                               c10::SymIntArrayRef sym_size, c10::SymIntArrayRef sym_stride) {
  const int64_t offset = sym_offset.expect_int();
  auto size = C10_AS_INTARRAYREF_SLOW(sym_size);
  auto stride = C10_AS_INTARRAYREF_SLOW(sym_stride);
  at::native::checkSetStorage(self, storage, offset, size, stride);
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_offset(offset);
  if (stride.data() != nullptr) impl->set_sizes_and_strides(size, stride);
  else impl->set_sizes_contiguous(size);
  const size_t needed = at::detail::computeStorageNbytes(size, impl->strides(),
                                                         self.dtype().itemsize(), offset);
  if (impl->numel() > 0) grow_storage(self, needed);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage storage) {
  const int64_t numel = static_cast<int64_t>(storage.nbytes() / self.dtype().itemsize());
  std::vector<int64_t> size{numel};
  std::vector<int64_t> stride{1};
  return set_storage_offset(self, std::move(storage), 0, c10::fromIntArrayRefSlow(size),
                            c10::fromIntArrayRefSlow(stride));
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& src) {
  if (self.unsafeGetTensorImpl() == src.unsafeGetTensorImpl()) return self;
  return set_storage_offset(self, src.storage(), src.storage_offset(), src.sym_sizes(),
                            src.sym_strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, device_allocator(), true);
  return set_storage(self, storage);
}

// ---- copies ------------------------------------------------------------------------------
// The host waited for a copy on the current stream of `device`: every earlier piece of work on
// that stream is observed complete, as CUDA's memcpy_and_sync (which reports a stream
// synchronization to the GPU trace, so the stream sanitizer orders the host after it).
void host_waited_for_stream(c10::DeviceIndex device) {
  const int64_t stream = neuron::rt::current_stream(device);
  neuron::rt::observe_stream(device, stream);
  gpu_trace::stream_synchronization(device, stream);
}

// Cross-device copies land here (copy_ sends any copy involving PrivateUse1 to _copy_from).
// Both sides become CPU tensors over the same bytes and the CPU copy kernel does the rest:
// dtype conversion, broadcasting, strides, and the conj/neg bits.
int64_t copy_bytes(const at::Tensor& dst) { return static_cast<int64_t>(dst.numel()) * dst.element_size(); }

}  // namespace

// The copies CPU's kernel does slowly, at memory speed and with its bits: transposes
// (transpose.h) and fp8 <-> fp32/bf16 conversions, which CPU does element by element through
// c10's scalar functions (fp8.h). False: the caller runs CPU's copy.
bool fast_copy(const at::Tensor& d, const at::Tensor& s) { return transpose::try_copy(d, s) || fp8::try_copy(d, s); }

namespace {

// A non_blocking copy between a neuron tensor and pinned host memory is queued, like CUDA's
// cudaMemcpyAsync: the host runs ahead and must synchronize before it reads a host destination
// (a program that does not reads stale bytes, as on a GPU) or writes a host source. The queued
// kernel holds the host tensor, so pinned memory freed meanwhile is released only after the
// copy. Pageable memory copies synchronously, as CUDA's do, and so does anything whose error
// or warning could otherwise surface late (broadcasting, complex to real, unusual layouts).
bool enqueue_pinned_copy(const at::Tensor& self, const at::Tensor& dst) {
  using neuron::rt::trace::CopyKind;
  if (!may_enqueue()) return false;
  const bool htod = self.is_cpu() && dst.is_privateuseone();
  const bool dtoh = self.is_privateuseone() && dst.is_cpu();
  if (!htod && !dtoh) return false;
  const at::Tensor& host = htod ? self : dst;
  if (self.layout() != at::kStrided || dst.layout() != at::kStrided || self.is_quantized() ||
      dst.is_quantized() || self.sizes() != dst.sizes() || dst.numel() == 0 ||
      (self.is_complex() && !dst.is_complex()) || host.storage().data() == nullptr ||
      !host_allocator()->is_pinned(host.storage().data())) {
    return false;
  }
  auto zc = std::make_shared<ZeroCopy>(ZeroCopy::Queued{});
  at::Tensor s = zc->in(self, /*allow_cpu=*/true);
  at::Tensor d = zc->in_output(dst, /*allow_cpu=*/true);
  zc->release_tensors();
  const CopyKind kind = htod ? CopyKind::HtoD : CopyKind::DtoH;
  const int64_t bytes = copy_bytes(dst);
  enqueue_kernel(zc->device(), htod ? "Memcpy HtoD (non_blocking)" : "Memcpy DtoH (non_blocking)",
                 [zc, s, d, kind, bytes] {
                   zc->launch_copy(kind, bytes, /*blocking=*/false);
                   if (!fast_copy(d, s)) d.copy_(s);
                 });
  return true;
}

// A small copy between dense neuron tensors of one device and one dtype is a memmove of the
// bytes: no aliases, no TensorIterator, and with the engine on it is queued like any kernel
// (a device-to-device copy otherwise runs the queue first). Up to 128 KiB, below ATen's own
// parallel copy. Conjugate/negative views (resolved by the copy), zero tensors, partial
// overlap (ATen raises) and profiling (which records the copy) take the general path.
constexpr int64_t kSmallBytes = 128 << 10;  // small copies and zero fills

bool small_copy(const at::Tensor& src, const at::Tensor& dst) {
  if (!src.is_privateuseone() || !dst.is_privateuseone() || src.device() != dst.device() ||
      src.scalar_type() != dst.scalar_type() || src.sizes() != dst.sizes() || !src.is_contiguous() ||
      !dst.is_contiguous() || src.is_conj() || dst.is_conj() || src.is_neg() || dst.is_neg() ||
      src._is_zerotensor() || dst._is_zerotensor()) {
    return false;
  }
  const int64_t nbytes = dst.numel() * static_cast<int64_t>(dst.element_size());
  if (nbytes == 0 || nbytes > kSmallBytes || partially_overlap(dst, src) ||
      C10_UNLIKELY(neuron::rt::trace::active())) {
    return false;
  }
  using neuron::rt::trace::CopyKind;
  using neuron::rt::trace::Kind;
  run_or_enqueue(dst.device().index(), "Memcpy DtoD", [from = src.const_data_ptr(), to = dst.mutable_data_ptr(), nbytes] {
    std::memmove(to, from, static_cast<size_t>(nbytes));
  }, captured_launch(Kind::Memcpy, {{&src, 0}, {&dst, prof::kOutput}}, "Memcpy DtoD", nbytes, CopyKind::DtoD));
  return true;
}

// Other copies within one device, between layouts (autograd's gradient layout fixes, a
// transpose made contiguous, a slice's gradient) or broadcasting: queued when the engine is on
// and CPU's copy kernel can raise nothing (one dtype, or real dtypes, so casts such as
// autocast's and integer-to-float ones too; a source that broadcasts to the destination; no
// overlap).
bool queued_copy(const at::Tensor& src, const at::Tensor& dst) {
  // (Dtypes CPU's copy kernel converts: float4_e2m1fn_x2, a "reduced floating" type, raises in it.)
  const auto st = src.scalar_type(), dt = dst.scalar_type();
  auto floating = [](c10::ScalarType t) { return c10::isFloatingType(t) && t != c10::ScalarType::Float4_e2m1fn_x2; };
  auto real = [&](c10::ScalarType t) { return floating(t) || c10::isIntegralType(t, /*includeBool=*/true); };
  const bool dtypes = (st == dt && (real(st) || c10::isComplexType(st))) || (real(st) && real(dt));
  if (!may_enqueue() || !dtypes || !queueable_like(dst, dst) || !queueable_like(src, src) ||
      src.device() != dst.device() || src._is_zerotensor() ||
      dst._is_zerotensor() || !at::is_expandable_to(src.sizes(), dst.sizes()) ||
      at::has_internal_overlap(dst) == at::MemOverlap::Yes ||
      (!src.is_same(dst) && !disjoint_memory(dst, src))) {
    return false;
  }
  QueuedCall q;
  at::Tensor s = q.in(src), d = q.into(dst);
  q.as_copy(neuron::rt::trace::CopyKind::DtoD, "Memcpy DtoD", copy_bytes(dst));
  q.enqueue("Memcpy DtoD", [s, d]() mutable {
    if (!fast_copy(d, s)) d.copy_(s);
  }, fusion::tiles_enabled() ? fusion::cast(dst, src) : nullptr);
  return true;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  using neuron::rt::trace::CopyKind;
  // Nothing to copy, nothing to wait for (a KV cache's torch.tensor([], device=...) each step).
  if (self.numel() == 0 && dst.numel() == 0) return dst;
  if (small_copy(self, dst)) return dst;
  if (queued_copy(self, dst)) return dst;
  if (self.is_privateuseone() && dst.is_privateuseone() && self.device() != dst.device()) {
    // neuron:i -> neuron:j is a legal copy, unlike an op mixing devices: alias each side alone.
    ZeroCopy zs, zd;
    at::Tensor s = zs.in(self);
    at::Tensor d = zd.in_output(dst);
    zd.launch_copy(CopyKind::DtoD, copy_bytes(dst), false);
    d.copy_(s, non_blocking);
    return dst;
  }
  if (non_blocking && enqueue_pinned_copy(self, dst)) return dst;
  // One alias set for both sides, so a copy between overlapping views sees the sharing.
  ZeroCopy zc;
  at::Tensor src = zc.in(self, /*allow_cpu=*/true);
  at::Tensor d = zc.in_output(dst, /*allow_cpu=*/true);
  const CopyKind kind = !self.is_privateuseone() ? CopyKind::HtoD
                        : !dst.is_privateuseone() ? CopyKind::DtoH : CopyKind::DtoD;
  // A device-to-host copy the caller waits for synchronizes the stream (like cudaMemcpy).
  const bool blocking_dtoh = kind == CopyKind::DtoH && !non_blocking;
  if (blocking_dtoh) sync_debug::on_sync("Memcpy DtoH (a blocking copy to the CPU: .cpu(), .to(\"cpu\"), .tolist(), print)");
  zc.launch_copy(kind, copy_bytes(dst), blocking_dtoh);
  if (!fast_copy(d, src)) d.copy_(src, non_blocking);
  if (blocking_dtoh) host_waited_for_stream(self.device().index());
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::Tensor d = dst;
  d.resize_(self.sizes());
  return copy_from(self, d, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  // item(): a blocking device-to-host copy of one element.
  sync_debug::on_sync("aten::_local_scalar_dense (Tensor.item(), or a tensor used as a Python number or bool)");
  ZeroCopy zc;
  at::Tensor s = zc.in(self);
  zc.launch_copy(neuron::rt::trace::CopyKind::DtoH, self.element_size(), /*blocking=*/true);
  at::Scalar value =
      at::_ops::_local_scalar_dense::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), s);
  host_waited_for_stream(self.device().index());
  return value;
}

// `module.to("neuron")` moves parameters with `param.data = moved` only when ATen calls the
// two tensors "shallow-copy compatible"; torch 2.13 knows CPU/CUDA/... but not PrivateUse1,
// so nn.Module._apply would create *new* Parameters and silently untie shared weights (GPT-2's
// embedding and LM head). Dense CPU and neuron tensors are compatible: same TensorImpl type.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto plain_dense = [](const at::Tensor& t) {
    const auto ks = t.key_set();
    return ks.has_any(c10::DispatchKeySet(c10::DispatchKey::Dense)) &&
           (ks.has_backend(c10::BackendComponent::CPUBit) ||
            ks.has_backend(c10::BackendComponent::PrivateUse1Bit)) &&
           !ks.has(c10::DispatchKey::Python) && !ks.has(c10::DispatchKey::Functionalize);
  };
  if (plain_dense(self) && plain_dense(from)) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

// Tensor.record_stream: tell the caching allocator the block is used on another stream.
void record_stream(at::Tensor& self, c10::Stream stream) {
  // CUDA unpacks the stream as a CUDAStream, which refuses other device types.
  TORCH_CHECK(stream.device_type() == c10::DeviceType::PrivateUse1,
              "record_stream: expected a neuron stream for a tensor on ", self.device(), ", but got a stream on ",
              stream.device());
  device_allocator()->recordStream(self.storage().data_ptr(), stream);
}

// ---- hot ops: unboxed wrappers around CPU kernels ------------------------------------------
template <class T> struct Arg { using type = T; };
template <> struct Arg<const at::Tensor&> { using type = at::Tensor; };
template <> struct Arg<at::Tensor&> { using type = at::Tensor; };

template <> struct Arg<const std::optional<at::Tensor>&> { using type = std::optional<at::Tensor>; };

template <class T> T&& map_in(ZeroCopy&, T&& v) { return std::forward<T>(v); }
inline at::Tensor map_in(ZeroCopy& zc, const at::Tensor& t) { return zc.in(t); }
inline at::Tensor map_in(ZeroCopy& zc, at::Tensor& t) { return zc.in(t); }
inline std::optional<at::Tensor> map_in(ZeroCopy& zc, const std::optional<at::Tensor>& t) {
  if (t.has_value() && t->defined()) return zc.in(*t);
  return t;
}

// The same for a queued kernel's arguments (enqueue.h, QueuedCall).
template <class T> T&& q_in(QueuedCall&, T&& v) { return std::forward<T>(v); }
inline at::Tensor q_in(QueuedCall& q, const at::Tensor& t) { return q.in(t); }
inline std::optional<at::Tensor> q_in(QueuedCall& q, const std::optional<at::Tensor>& t) { return q.in(t); }

template <class R> struct Out {
  static R map(ZeroCopy&, R&& r) { return std::move(r); }
};
template <> struct Out<at::Tensor> {
  static at::Tensor map(ZeroCopy& zc, at::Tensor&& r) { return zc.out(r); }
};
template <> struct Out<std::tuple<at::Tensor, at::Tensor>> {
  static std::tuple<at::Tensor, at::Tensor> map(ZeroCopy& zc, std::tuple<at::Tensor, at::Tensor>&& r) {
    return {zc.out(std::get<0>(r)), zc.out(std::get<1>(r))};
  }
};
template <> struct Out<std::tuple<at::Tensor, at::Tensor, at::Tensor>> {
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> map(
      ZeroCopy& zc, std::tuple<at::Tensor, at::Tensor, at::Tensor>&& r) {
    return {zc.out(std::get<0>(r)), zc.out(std::get<1>(r)), zc.out(std::get<2>(r))};
  }
};

// ---- complex32 on the hot paths ---------------------------------------------------------------
// CPU has no complex32 kernel for most hot ops (sum, div, mean); CUDA computes them in complex64
// and rounds once. The boxed fallback does exactly that (its widening retry, fallback.cpp), so a
// hot op with a complex32 argument leaves the unboxed path for it. The test is one dtype compare
// per tensor argument: fp32/fp16/bf16 calls stay on the unboxed path, with CPU's results.
inline bool is_chalf(const at::Tensor& t) { return t.defined() && t.scalar_type() == c10::ScalarType::ComplexHalf; }
inline bool is_chalf(const std::optional<c10::ScalarType>& t) { return t == c10::ScalarType::ComplexHalf; }
inline bool is_chalf(const std::optional<at::Tensor>& t) { return t.has_value() && is_chalf(*t); }
template <class V> bool is_chalf(const V&) { return false; }
template <class... A> bool any_chalf(const A&... args) { return (is_chalf(args) || ...); }

template <class Sig> struct Hot;
template <class R, class... A> struct Hot<R(A...)> {
  // Functional ops: alias the inputs, run the CPU kernel, adopt the result.
  template <R (*F)(A...), const char* Name>
  static R call(A... args) {
    if (C10_UNLIKELY(any_chalf(args...))) return FromStack<R>::get(via_fallback<Name>(args...));
    ZeroCopy zc;
    // Braced initialisation evaluates left to right, so device checks see arguments in order.
    std::tuple<typename Arg<A>::type...> cpu{map_in(zc, args)...};
    zc.launch(Name);
    R r = std::apply(F, cpu);
    zc.sync_inputs();
    return Out<R>::map(zc, std::move(r));
  }
};

// ---- enqueued hot ops (enqueue.h) -------------------------------------------------------------
// A hot op enqueues its kernel only when no error can depend on the data or surface late: every
// tensor argument is a neuron tensor of the op's device and dtype (no casts, no host values the
// caller could change before the kernel reads them), floating point, and same-shaped or 0-dim.
// (A Python number reaches the op as a CPU "wrapped number": no one else can change it.) An
// argument partially overlapping `ref` (an element of it, say) makes CPU kernels raise: not here.
inline bool same_kind(const at::Tensor& ref, const at::Tensor& t) {
  if (is_number(t)) return number_keeps_dtype(ref, t);
  return t.is_privateuseone() && t.device() == ref.device() && t.scalar_type() == ref.scalar_type() &&
         (t.dim() == 0 || t.sizes() == ref.sizes()) && !partially_overlap(ref, t);
}
template <class V> bool same_kind(const at::Tensor&, const V&) { return true; }  // scalars, ints
// ... and for an in-place op, whose result is self's shape: an operand broadcasting to self
// (linear's bias added in place to a batched product) cannot fail either.
inline bool inplace_kind(const at::Tensor& self, const at::Tensor& t) {
  if (is_number(t)) return number_keeps_dtype(self, t);
  return t.is_privateuseone() && t.device() == self.device() && t.scalar_type() == self.scalar_type() &&
         at::is_expandable_to(t.sizes(), self.sizes()) && !partially_overlap(self, t);
}
template <class V> bool inplace_kind(const at::Tensor&, const V&) { return true; }
inline bool enqueueable(const at::Tensor& ref) {
  return ref.is_privateuseone() && c10::isFloatingType(ref.scalar_type()) && !ref.is_conj() && !ref.is_neg();
}
inline bool enqueueable_integral(const at::Tensor& ref) {
  return ref.is_privateuseone() && c10::isIntegralType(ref.scalar_type(), /*includeBool=*/false);
}

// Records for fusion (fusion.h) of the in-place hot ops: add_/sub_ (other, alpha), mul_/div_.
inline neuron::rt::engine::Record hot_record(const char* name, const at::Tensor& self, const at::Tensor& other) {
  return fusion::binary(name, self, self, other, nullptr);
}
inline neuron::rt::engine::Record hot_record(const char* name, const at::Tensor& self, const at::Tensor& other,
                                             const at::Scalar& alpha) {
  return fusion::binary(name, self, self, other, &alpha);
}

// In-place wrapper for ops shaped (Tensor& self, rest...).
// Integral: the caller vouches that the op cannot raise over integers of self's dtype (add_,
// sub_ and mul_ with an integral alpha: they wrap; a BatchNorm's num_batches_tracked += 1).
template <class... Rest> struct HotInplace {
  template <at::Tensor& (*F)(at::Tensor&, Rest...), const char* Name, bool Integral = false>
  static at::Tensor& call(at::Tensor& self, Rest... rest) {
    if (C10_UNLIKELY(any_chalf(self, rest...))) {
      via_fallback<Name>(self, rest...);  // writes self (rounded once from complex64)
      return self;
    }
    if (may_enqueue() && (enqueueable(self) || (Integral && enqueueable_integral(self))) && (inplace_kind(self, rest) && ...) &&
        at::has_internal_overlap(self) != at::MemOverlap::Yes) {
      auto zc = std::make_shared<ZeroCopy>(ZeroCopy::Queued{});
      at::Tensor s = zc->in(self, /*allow_cpu=*/false, prof::kOutput | prof::kRead);
      auto cpu = std::make_shared<std::tuple<at::Tensor, std::decay_t<Rest>...>>(s, map_in(*zc, rest)...);
      zc->release_tensors();
      enqueue_kernel(
          zc->device(), Name,
          [zc, cpu] {
            zc->launch(Name);
            std::apply([](at::Tensor& a, auto&... r) { F(a, r...); }, *cpu);
          },
          fusion::enabled() ? hot_record(Name, self, rest...) : nullptr, zc->captured_tensors());
      return self;
    }
    ZeroCopy zc;
    at::Tensor s = zc.in(self, /*allow_cpu=*/false, prof::kOutput | prof::kRead);
    std::tuple<at::Tensor&, typename Arg<Rest>::type...> cpu{s, map_in(zc, rest)...};
    zc.launch(Name);
    std::apply(F, cpu);
    zc.sync_inputs();
    return self;
  }
};

// ---- hot ops with outputs from the device pool (zero_copy.h, pooled) -------------------------
bool plain(const at::Tensor& t) { return t.is_contiguous() && !t.is_conj() && !t.is_neg(); }

// Functional ops whose result has the shape and dtype of their first argument (silu, softmax,
// their backward, ...): CPU's out= kernel `O` writes a result from the device pool. CPU's
// functional kernel would take host memory to adopt: ≈ 1 us a call at small sizes (a 256-element
// sqrt 2.9 -> 1.9 us), fresh pages at large ones. Taken when every tensor argument is contiguous,
// of the first one's floating dtype and shape (then the out= kernel computes what the functional
// one does, into the same layout); otherwise CPU's functional kernel `F` (Hot).
template <class T> bool pooled_arg_fits(const at::Tensor& first, const T& arg) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return plain(arg) && arg.scalar_type() == first.scalar_type() && arg.sizes().equals(first.sizes());
  } else if constexpr (std::is_same_v<T, bool>) {
    return !arg;  // softmax's half_to_float: another result dtype (and CPU's own error)
  } else if constexpr (std::is_same_v<T, at::Scalar>) {
    return !arg.isComplex();  // a complex number makes the result complex
  } else if constexpr (std::is_same_v<T, std::optional<at::Scalar>>) {
    // a clamp bound: complex raises; a floating bound of an integer tensor makes it floating
    return !arg.has_value() ||
           (!arg->isComplex() && !(arg->isFloatingPoint() && !c10::isFloatingType(first.scalar_type())));
  } else if constexpr (std::is_same_v<T, c10::ScalarType>) {
    return arg == first.scalar_type();  // softmax backward's input dtype: the result's
  } else {
    return true;
  }
}

// ... and may be queued (the engine on, enqueue.h): tensors on first's device; a dim in range
// (softmax's: checked here, so its error is raised at the call); clamp with a bound.
template <class T> bool pooled_arg_queues(const at::Tensor& first, const T& arg) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return queueable_like(first, arg);
  } else if constexpr (std::is_same_v<T, int64_t>) {
    (void)c10::maybe_wrap_dim(arg, first.dim());  // raises CPU's IndexError at the call
    return true;
  } else if constexpr (std::is_same_v<T, std::optional<at::Scalar>>) {
    return !arg.has_value() || !arg->isComplex();
  } else {
    return true;
  }
}
template <class T> constexpr bool kOptionalScalar = std::is_same_v<std::decay_t<T>, std::optional<at::Scalar>>;
template <class T> bool is_bound(const T& arg) {
  if constexpr (kOptionalScalar<T>) return arg.has_value();
  else return false;
}
template <class... A> bool clamp_has_bound(const A&... args) {  // CPU raises for clamp(x, None, None)
  if constexpr (!(kOptionalScalar<A> || ...)) return true;
  else return (is_bound(args) || ...);
}

// A pointwise op's operands that are not contiguous (a slice in rotary embeddings, a
// channels-last activation): queued too when they have first's dtype and shape; the result's
// layout is the one CPU's TensorIterator gives it, worked out on meta tensors (≈ 3 us).
template <class T> bool strided_arg_fits(const at::Tensor& first, const T& arg) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return arg.scalar_type() == first.scalar_type() && arg.sizes().equals(first.sizes());
  } else {
    return pooled_arg_fits(first, arg);
  }
}
// Result layouts that TensorIterator works out on meta tensors (≈ 2-3 us a call: building the
// meta tensors and the iterator), remembered per thread by the operands' geometry, the only thing
// a layout depends on (sizes and strides; not dtypes, not values). A training loop repeats a few
// geometries, so a lookup (tens of ns) replaces the build. A geometry is remembered only once it
// built, so a call that must raise (shapes that do not broadcast) still reaches TensorIterator.
class LayoutCache {
 public:
  using Key = c10::SmallVector<int64_t, 24>;
  // Appends t's geometry to key (a 0-dim tensor or a number: its rank, 0).
  static void add(Key& key, const at::Tensor& t) {
    key.push_back(t.dim());
    key.append(t.sizes().begin(), t.sizes().end());
    key.append(t.strides().begin(), t.strides().end());
  }
  static void add_number(Key& key) { key.push_back(0); }
  using Layout = c10::SmallVector<int64_t, 12>;  // sizes, then strides
  // The layout remembered for key, else the one of the tensor `build()` returns (TensorIterator's
  // output over meta operands; it raises for operands that do not broadcast), remembered. Valid
  // until the next call: callers copy what they keep.
  template <class Build> const Layout& get(Key key, Build&& build) {
    for (const Entry& e : entries_) {
      if (e.key.size() == key.size() && std::equal(key.begin(), key.end(), e.key.begin())) return e.layout;
    }
    const at::Tensor out = build();
    Entry& e = entries_[next_];
    next_ = (next_ + 1) % entries_.size();
    e.key = std::move(key);
    e.layout.assign(out.sizes().begin(), out.sizes().end());
    e.layout.append(out.strides().begin(), out.strides().end());
    return e.layout;
  }

 private:
  struct Entry {
    Key key;  // empty: unused (every real key holds at least one rank)
    c10::SmallVector<int64_t, 12> layout;
  };
  std::array<Entry, 16> entries_;
  size_t next_ = 0;
};

template <class... A> std::vector<int64_t> pointwise_strides(const A&... args) {
  thread_local LayoutCache cache;
  LayoutCache::Key key;
  auto geometry = [&](const auto& a) {
    if constexpr (std::is_same_v<std::decay_t<decltype(a)>, at::Tensor>) LayoutCache::add(key, a);
  };
  (geometry(args), ...);
  const LayoutCache::Layout& layout = cache.get(std::move(key), [&] {
    at::TensorIteratorConfig config;
    config.add_owned_output(at::Tensor());
    auto add = [&](const auto& a) {
      if constexpr (std::is_same_v<std::decay_t<decltype(a)>, at::Tensor>) config.add_owned_const_input(meta_like(a));
    };
    (add(args), ...);
    return config.build().output(0);
  });
  return std::vector<int64_t>(layout.begin() + static_cast<std::ptrdiff_t>(layout.size() / 2), layout.end());
}

// Ops whose integer results keep the operand's dtype (neg: T5's relative positions; clamp with
// integer bounds and relu: index arithmetic such as MoE routing, queued so graphs capture it)
// take the pooled route for integers too; the others' results are floating (exp, sigmoid, ...).
template <const char* Name> bool keeps_integers(c10::ScalarType dtype) {
  static const bool keeps = std::string_view(Name) == "aten::neg" || std::string_view(Name) == "aten::clamp" ||
                            std::string_view(Name) == "aten::relu";
  return keeps && c10::isIntegralType(dtype, /*includeBool=*/false);
}

// A result from the device pool (contiguous if `strides` is empty) written now by CPU's out=
// kernel, `run(o, args...)` over the arguments' aliases (non-tensors passed as they are).
template <class Run, class... A>
at::Tensor run_pooled(const char* name, c10::IntArrayRef sizes, c10::ScalarType dtype, c10::IntArrayRef strides,
                      Run&& run, const A&... args) {
  ZeroCopy zc;
  std::tuple<typename Arg<const A&>::type...> cpu{map_in(zc, args)...};
  zc.launch(name);
  at::Tensor out = pooled(zc, sizes, dtype, strides);
  at::Tensor o = zc.in_output(out);
  std::apply([&](auto&... a) { run(o, a...); }, cpu);
  return out;
}

// The fusion record of a queued pooled op: clamp with both bounds (the precompiled family).
template <const char* Name, class... A>
neuron::rt::engine::Record pooled_record(const at::Tensor& out, const A&... args) {
  using Args = std::tuple<std::decay_t<A>...>;
  if constexpr (std::is_same_v<Args, std::tuple<at::Tensor, std::optional<at::Scalar>, std::optional<at::Scalar>>>) {
    static const bool is_clamp = std::string_view(Name) == "aten::clamp";
    if (is_clamp && fusion::tiles_enabled()) {
      const auto& [self, lo, hi] = std::forward_as_tuple(args...);
      return fusion::clamp(Name, out, self, lo, hi);
    }
  }
  return nullptr;
}

template <class Sig> struct Pooled;
template <class... A> struct Pooled<at::Tensor(A...)> {
  template <at::Tensor (*F)(A...), at::Tensor& (*O)(at::Tensor&, A...), const char* Name>
  static at::Tensor call(A... args) {
    const at::Tensor& first = std::get<0>(std::forward_as_tuple(args...));
    static const int64_t vml_bound = serial_vml_bound(op_handle<Name>().operator_name());
    SerialVml vml(first.numel() < vml_bound);  // MKL's vector math on one thread (vml_threads.h)
    auto queues = [&] { return may_enqueue() && (pooled_arg_queues(first, args) && ...) && clamp_has_bound(args...); };
    std::vector<int64_t> strides;  // the result's, if not contiguous
    const bool pooled_dtype = c10::isFloatingType(first.scalar_type()) || keeps_integers<Name>(first.scalar_type());
    if (!pooled_dtype || !(pooled_arg_fits(first, args) && ...)) {
      static const bool pointwise = op_handle<Name>().hasTag(at::Tag::pointwise);
      if (!pointwise || !c10::isFloatingType(first.scalar_type()) || !(strided_arg_fits(first, args) && ...) ||
          first.numel() == 0 || !queues()) {
        return Hot<at::Tensor(A...)>::template call<F, Name>(args...);
      }
      strides = pointwise_strides(args...);
    }
    if (!strides.empty() || queues()) {
      QueuedCall q;
      std::tuple<std::decay_t<A>...> cpu{q_in(q, args)...};  // values: the kernel runs later
      at::Tensor out;
      at::Tensor o = q.out(out, first.sizes(), first.scalar_type(), strides);
      const bool serial = first.numel() < vml_bound;
      q.enqueue(Name, [cpu, o, serial]() mutable {
        SerialVml vml(serial);
        std::apply([&](auto&... a) { O(o, a...); }, cpu);
      }, pooled_record<Name>(out, args...));
      return out;
    }
    return run_pooled(Name, first.sizes(), first.scalar_type(), {}, [](at::Tensor& o, auto&... a) { O(o, a...); },
                      args...);
  }
};

// relu's out= kernel: CPU's relu is clamp_min(x, 0) (so the same bits), which has one.
at::Tensor& relu_out(at::Tensor& out, const at::Tensor& self) { return at::cpu::clamp_min_out(out, self, 0); }

// Elementwise ops over same-shaped contiguous operands (or 0-dim scalars).
template <class OutCall, class FuncCall>
at::Tensor elementwise(ZeroCopy& zc, const at::Tensor& a, const at::Tensor& b, c10::ScalarType dtype,
                       OutCall out_call, FuncCall func_call) {
  if (plain(a) && plain(b) && (a.dim() == 0 || b.dim() == 0 || a.sizes() == b.sizes())) {
    at::Tensor out = pooled(zc, a.dim() == 0 ? b.sizes() : a.sizes(), dtype);
    at::Tensor o = zc.in_output(out);
    out_call(o);
    zc.sync_inputs();
    return out;
  }
  return zc.out(func_call());
}

// The fusion record of a queued functional binary op into a fresh `out`: the generated family's
// (float32 operands of one count), else for mul the precompiled family's product with a 0-dim
// factor (torchao's scaling casts) or the GEMM family's product by a per-column vector.
template <const char* Name>
neuron::rt::engine::Record binary_record(const at::Tensor& out, const at::Tensor& self, const at::Tensor& other,
                                         const at::Scalar* alpha) {
  neuron::rt::engine::Record r = fusion::enabled() ? fusion::binary(Name, out, self, other, alpha) : nullptr;
  static const bool is_mul = std::string_view(Name) == "aten::mul.Tensor";
  if (r == nullptr && is_mul && fusion::tiles_enabled()) {
    r = fusion::scale(Name, out, self, other);
    if (r == nullptr) r = fusion::col_scale(Name, out, self, other);
  }
  return r;
}

// Elementwise ops over same-shaped neuron operands of one floating dtype: the output comes from
// the device pool at the call and the `.out` kernel is enqueued. Returns an undefined tensor if
// the call does not qualify.
template <const char* Name, class OutCall>
at::Tensor enqueue_elementwise(const at::Tensor& self, const at::Tensor& other, const at::Scalar* alpha,
                               OutCall out_call) {
  const at::Tensor& big = self.dim() >= other.dim() ? self : other;
  if (!may_enqueue() || !enqueueable(big) || !same_kind(big, self) || !same_kind(big, other) ||
      !plain(self) || !plain(other)) {
    return at::Tensor();
  }
  auto zc = std::make_shared<ZeroCopy>(ZeroCopy::Queued{});
  at::Tensor a = zc->in(self), b = zc->in(other);
  at::Tensor out = pooled(*zc, big.sizes(), big.scalar_type());
  at::Tensor o = zc->in_output(out);
  zc->release_tensors();
  enqueue_kernel(
      zc->device(), Name,
      [zc, a, b, o, out_call]() mutable {
        zc->launch(Name);
        out_call(o, a, b);
      },
      binary_record<Name>(out, self, other, alpha), zc->captured_tensors());
  return out;
}

// ... and the same over broadcast or strided operands (a mean's gradient is a 0-dim tensor
// expanded, then divided): the result's layout is the one CPU's TensorIterator gives it, worked
// out at the call on meta tensors of the operands' shapes and strides (≈ 2-3 us, taken only off
// the same-shape path, then remembered: LayoutCache); a shape mismatch raises CPU's error there.
// Operands of different real dtypes (an int64 timestep times a float, a float activation times a
// 0-dim int64 tensor) are queued when they promote to a floating dtype (at::result_type, as CPU's
// kernel promotes them): no cast can then fail. Without the engine the same call runs CPU's out=
// kernel at once into that pooled result, instead of CPU's functional kernel and the adoption of
// its host-allocated result (measured: 0.3 us less a call on 4x8 operands; RMSNorm's and rotary
// embeddings' broadcasts).
// Returns an undefined tensor if the call does not qualify.
// Integral: the caller's op cannot fail over integers (add, sub with an integral alpha, mul; an
// integer position id plus an offset): integral results queue too.
template <const char* Name, bool Integral = false, class OutCall>
at::Tensor pooled_broadcast(const at::Tensor& self, const at::Tensor& other, OutCall out_call) {
  const at::Tensor& ref = is_number(self) ? other : self;
  auto real = [](const at::Tensor& t) { return !c10::isComplexType(t.scalar_type()) && t.scalar_type() != at::kBool; };
  auto fits = [&](const at::Tensor& t) {
    if (is_number(t)) return real(t);
    return t.is_privateuseone() && t.device() == ref.device() && t.layout() == c10::kStrided && !t.is_conj() &&
           !t.is_neg() && real(t);
  };
  if (is_number(ref) || !fits(self) || !fits(other)) return at::Tensor();
  const c10::ScalarType dtype = at::result_type(self, other);
  if (!c10::isFloatingType(dtype) && !(Integral && c10::isIntegralType(dtype, /*includeBool=*/false))) {
    return at::Tensor();
  }
  thread_local LayoutCache cache;  // (see LayoutCache)
  LayoutCache::Key key;
  for (const at::Tensor* t : {&self, &other}) {
    if (is_number(*t)) LayoutCache::add_number(key);
    else LayoutCache::add(key, *t);
  }
  const LayoutCache::Layout& layout = cache.get(std::move(key), [&] {
    auto meta = [&](const at::Tensor& t) {  // a number: a 0-dim operand (layouts do not depend on dtypes)
      return is_number(t) ? ::at::empty({}, ref.options().device(c10::kMeta)) : meta_like(t);
    };
    const at::Tensor am = meta(self), bm = meta(other);
    at::Tensor result;
    at::TensorIterator iter;
    iter.build_borrowing_binary_op(result, am, bm);  // raises CPU's broadcast error
    return iter.output();
  });
  const auto rank = static_cast<std::ptrdiff_t>(layout.size() / 2);  // copied: see LayoutCache::get
  const c10::SmallVector<int64_t, 6> sizes(layout.begin(), layout.begin() + rank),
      strides(layout.begin() + rank, layout.end());
  if (!may_enqueue()) {  // (a number's alias is itself, a 0-dim CPU tensor)
    return run_pooled(Name, sizes, dtype, strides, out_call, self, other);
  }
  QueuedCall q;
  at::Tensor a = is_number(self) ? self : q.in(self), b = is_number(other) ? other : q.in(other), out;
  at::Tensor o = q.out(out, sizes, dtype, strides);
  q.enqueue(Name, [a, b, o, out_call]() mutable { out_call(o, a, b); },
            is_number(self) || is_number(other) ? nullptr : binary_record<Name>(out, self, other, nullptr));
  return out;
}

// Functional unary ops of floating inputs (sqrt, so that the optimizers' _foreach_sqrt does
// not synchronize): like enqueue_elementwise, else synchronously (Pooled).
template <const char* Name, at::Tensor& (*Out)(at::Tensor&, const at::Tensor&),
          at::Tensor (*Func)(const at::Tensor&)>
at::Tensor unary_floating(const at::Tensor& self) {
  const bool small = self.numel() < kCheapVmlBound;  // a vector-math call on one MKL thread (vml_threads.h)
  if (may_enqueue() && enqueueable(self) && plain(self)) {
    auto zc = std::make_shared<ZeroCopy>(ZeroCopy::Queued{});
    at::Tensor a = zc->in(self);
    at::Tensor out = pooled(*zc, self.sizes(), self.scalar_type());
    at::Tensor o = zc->in_output(out);
    zc->release_tensors();
    enqueue_kernel(
        zc->device(), Name,
        [zc, a, o, small]() mutable {
          zc->launch(Name);
          SerialVml vml(small);
          Out(o, a);
        },
        Out == &at::cpu::sqrt_out && fusion::enabled() ? fusion::sqrt(Name, out, self) : nullptr,
        zc->captured_tensors());
    return out;
  }
  return Pooled<at::Tensor(const at::Tensor&)>::call<Func, Out, Name>(self);
}

// ---- small IEEE elementwise ops without aliases or TensorIterator ---------------------------
// A 16-element add spends its time on bookkeeping, not arithmetic: three CPU aliases (ZeroCopy)
// and ATen's TensorIterator (shapes, types, strides) cost about 0.7 us over CPU's whole 1.2 us
// op (perf, tenth session). For contiguous operands of one IEEE dtype (float, double), same-
// shaped or a Python number, the bits of +, -, * and / are fixed by IEEE 754: one correctly
// rounded operation per element (ATen's a + alpha * b with alpha 1 is a + b in either order of
// evaluation; a number is first cast to the dtype, as TensorIterator casts it). A loop over the
// device bytes gives ATen's result without either. The one freedom IEEE leaves, which NaN's
// payload a NaN-NaN operation returns, ATen itself varies by path (its 5- and 16-element muls
// return different operands'). Comparisons (==, !=, <, <=, >, >=) are exact too, NaN
// unordered as in ATen's kernels; they write bool. Above kSmallNumel elements ATen's wider
// vectors win.
enum class Arith { Add, Sub, Mul, Div, Eq, Ne, Lt, Le, Gt, Ge };
constexpr bool is_comparison(Arith k) { return k >= Arith::Eq; }
constexpr int64_t kSmallNumel = 2048;

template <Arith K, class V> inline V arith(V a, V b) {
  if constexpr (K == Arith::Add) return a + b;
  else if constexpr (K == Arith::Sub) return a - b;
  else if constexpr (K == Arith::Mul) return a * b;
  else return a / b;
}

template <Arith K, class Tp> inline bool compare(Tp a, Tp b) {
  if constexpr (K == Arith::Eq) return a == b;
  else if constexpr (K == Arith::Ne) return a != b;
  else if constexpr (K == Arith::Lt) return a < b;
  else if constexpr (K == Arith::Le) return a <= b;
  else if constexpr (K == Arith::Gt) return a > b;
  else return a >= b;
}

// GCC's portable vector types, 32 bytes: two SSE2 (or NEON) operations where the build targets no
// wider ISA. (The attribute is dropped on a type that depends on a template parameter.)
typedef float F32x8 __attribute__((vector_size(32)));
typedef double F64x4 __attribute__((vector_size(32)));
template <class Tp> struct Vec32;
template <> struct Vec32<float> { using type = F32x8; };
template <> struct Vec32<double> { using type = F64x4; };

// o[i] = a[i] (op) b[i], or a[i] (op) *number when b is null. o may be a (in place) or b.
template <Arith K, class Tp>
void arith_loop(const Tp* a, const Tp* b, Tp number, Tp* o, int64_t n) {
  using V = typename Vec32<Tp>::type;
  static_assert(sizeof(V) == 32, "a vector type, not a scalar");
  constexpr int64_t kLanes = 32 / sizeof(Tp);
  V splat;  // element by element: V{} + number would turn -0.0 into +0.0
  for (int64_t j = 0; j < kLanes; ++j) splat[j] = number;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {  // memcpy: unaligned-safe; both loads precede the store
    V x, y = splat;
    std::memcpy(&x, a + i, sizeof(V));
    if (b != nullptr) std::memcpy(&y, b + i, sizeof(V));
    const V r = arith<K>(x, y);
    std::memcpy(o + i, &r, sizeof(V));
  }
  for (; i < n; ++i) o[i] = arith<K>(a[i], b != nullptr ? b[i] : number);
}

// o[i] = a[i] (cmp) b[i], or a[i] (cmp) number when b is null.
template <Arith K, class Tp>
void compare_loop(const Tp* a, const Tp* b, Tp number, bool* o, int64_t n) {
  if (b != nullptr) {
    for (int64_t i = 0; i < n; ++i) o[i] = compare<K>(a[i], b[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) o[i] = compare<K>(a[i], number);
  }
}

bool small_operand(const at::Tensor& t, const at::Tensor& ref) {
  return t.is_privateuseone() && t.scalar_type() == ref.scalar_type() && t.device() == ref.device() &&
         t.is_contiguous() && t.sizes() == ref.sizes() && !t._is_zerotensor();
}

// `self (op) other` into a fresh tensor or, in place, into self, computed here; false if the call
// does not qualify (then the general path runs, and raises what it raises). `result` receives
// the output.
template <const char* Name, Arith K>
bool small_binary(const at::Tensor& self, const at::Tensor& other, const at::Scalar* alpha, bool in_place,
                  at::Tensor* result) {
  if (!self.is_privateuseone()) return false;
  const c10::ScalarType dt = self.scalar_type();
  const int64_t n = self.numel();
  if ((dt != at::kFloat && dt != at::kDouble) || n == 0 || n > kSmallNumel || !self.is_contiguous() ||
      self._is_zerotensor()) {
    return false;
  }
  const bool number = is_number(other);  // real numbers never promote a float or double tensor
  if (!number && !small_operand(other, self)) return false;
  // In place over a partially overlapping operand: ATen raises.
  if (in_place && !number && partially_overlap(self, other)) return false;
  if (alpha != nullptr && (alpha->isSymbolic() || !alpha->equal(1))) return false;
  // The profiler records a kernel with its tensors (ZeroCopy).
  if (C10_UNLIKELY(neuron::rt::trace::active())) return false;
  float nf = 0.f;
  double nd = 0.0;
  if (number && !(dt == at::kFloat ? number_value(other, &nf) : number_value(other, &nd))) return false;  // complex
  const int device = self.device().index();
  if (in_place) {
    *result = self;
  } else {
    CurrentDevice guard(device);
    *result = at::detail::empty_generic(self.sizes(), device_allocator(),
                                        c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                        is_comparison(K) ? at::kBool : dt, std::nullopt);
  }
  auto run = [n, dt, nf, nd, a = self.const_data_ptr(), b = number ? nullptr : other.const_data_ptr(),
              o = result->mutable_data_ptr()] {
    track_hot(Name);
    const auto* fa = static_cast<const float*>(a);
    const auto* fb = static_cast<const float*>(b);
    const auto* da = static_cast<const double*>(a);
    const auto* db = static_cast<const double*>(b);
    if constexpr (is_comparison(K)) {
      if (dt == at::kFloat) compare_loop<K>(fa, fb, nf, static_cast<bool*>(o), n);
      else compare_loop<K>(da, db, nd, static_cast<bool*>(o), n);
    } else {
      if (dt == at::kFloat) arith_loop<K>(fa, fb, nf, static_cast<float*>(o), n);
      else arith_loop<K>(da, db, nd, static_cast<double*>(o), n);
    }
  };
  // (a graph's replays: the hot path's traced launch; self read, and written in place)
  auto captured = captured_launch(neuron::rt::trace::Kind::Kernel,
                                  {{&self, in_place ? prof::kOutput | prof::kRead : 0},
                                   {number ? nullptr : &other, 0},
                                   {in_place ? nullptr : result, prof::kOutput}});
  run_or_enqueue(
      device, Name, run,
      [&]() -> neuron::rt::engine::Record {
        // The fuser takes arithmetic only.
        return !is_comparison(K) && fusion::enabled() ? fusion::binary(Name, *result, self, other, alpha) : nullptr;
      },
      std::move(captured));
  return true;
}

// The in-place forms: the small path, else the general one (HotInplace).
template <const char* Name, Arith K, at::Tensor& (*F)(at::Tensor&, const at::Tensor&, const at::Scalar&)>
at::Tensor& inplace_alpha(at::Tensor& self, const at::Tensor& other, const at::Scalar& alpha) {
  at::Tensor r;
  if (small_binary<Name, K>(self, other, &alpha, /*in_place=*/true, &r)) return self;
  if (alpha.isIntegral(/*includeBool=*/false)) {  // a float alpha over integers raises (at the call)
    return HotInplace<const at::Tensor&, const at::Scalar&>::template call<F, Name, true>(self, other, alpha);
  }
  return HotInplace<const at::Tensor&, const at::Scalar&>::template call<F, Name>(self, other, alpha);
}
template <const char* Name, Arith K, at::Tensor& (*F)(at::Tensor&, const at::Tensor&)>
at::Tensor& inplace(at::Tensor& self, const at::Tensor& other) {
  at::Tensor r;
  if (small_binary<Name, K>(self, other, nullptr, /*in_place=*/true, &r)) return self;
  // Integer division is true division (a float result) or raises on zero: not queued.
  return HotInplace<const at::Tensor&>::template call<F, Name, K == Arith::Mul>(self, other);
}

// Comparisons: the small path; else, with the engine on, queued with the bool result laid out
// by ATen's structured meta function (which raises CPU's broadcast errors at the call) and
// CPU's out= kernel over aliases (any real dtype: integer labels against -100, token ids against
// a pad id); else the boxed fallback, as before they had a kernel here. A Python number arrives
// as a Scalar; the small path wraps it as ATen's meta function wraps it.
template <const char* Name, Arith K, at::Tensor (*Meta)(const at::Tensor&, const at::Tensor&),
          at::Tensor& (*Out)(at::Tensor&, const at::Tensor&, const at::Tensor&)>
at::Tensor comparison(const at::Tensor& self, const at::Tensor& other) {
  if (at::Tensor r; small_binary<Name, K>(self, other, nullptr, false, &r)) return r;
  const at::Tensor& ref = self.is_privateuseone() ? self : other;
  if (may_enqueue() && ref.is_privateuseone() && queueable_value(ref, self) && queueable_value(ref, other) &&
      !self.is_complex() && !other.is_complex()) {
    const at::Tensor m = Meta(meta_like(self), meta_like(other));
    QueuedCall q;
    at::Tensor a = queued_value(q, self), b = queued_value(q, other), out;
    at::Tensor o = q.out(out, m.sizes(), m.scalar_type(), m.strides());
    q.enqueue(Name, [a, b, o]() mutable { Out(o, a, b); });
    return out;
  }
  return via_fallback<Name>(self, other).back().toTensor();
}
template <const char* Name, Arith K, at::Tensor (*Meta)(const at::Tensor&, const at::Scalar&),
          at::Tensor& (*Out)(at::Tensor&, const at::Tensor&, const at::Scalar&)>
at::Tensor comparison_scalar(const at::Tensor& self, const at::Scalar& other) {
  if (self.is_privateuseone() && !other.isSymbolic() && self.numel() <= kSmallNumel) {
    at::Tensor number = c10::scalar_to_tensor(other);
    number.unsafeGetTensorImpl()->set_wrapped_number(true);
    if (at::Tensor r; small_binary<Name, K>(self, number, nullptr, false, &r)) return r;
  }
  if (may_enqueue() && !other.isSymbolic() && !other.isComplex() && self.is_privateuseone() &&
      queueable_value(self, self) && !self.is_complex()) {
    const at::Tensor m = Meta(meta_like(self), other);
    QueuedCall q;
    at::Tensor a = q.in(self), out;
    at::Tensor o = q.out(out, m.sizes(), m.scalar_type(), m.strides());
    q.enqueue(Name, [a, other, o]() mutable { Out(o, a, other); });
    return out;
  }
  return via_fallback<Name>(self, other).back().toTensor();
}

// zero_ (torch.zeros, zero_grad without set_to_none) of a small contiguous tensor: a memset,
// whatever the dtype (every dtype's zero is all-zero bits), queued on the engine like the copies
// above. (Negative and conjugate views never arrive here: their dispatch keys run the op on a
// resolved tensor and write back, -0.0 as on CPU.) A zero tensor and profiling (a "Memset"
// activity) take the boxed fallback as before.
template <const char* Name>
at::Tensor& zero_(at::Tensor& self) {
  const int64_t nbytes = self.numel() * static_cast<int64_t>(self.element_size());
  if (!self.is_privateuseone() || !self.is_contiguous() || self._is_zerotensor() || nbytes == 0 ||
      nbytes > kSmallBytes || C10_UNLIKELY(neuron::rt::trace::active())) {
    via_fallback<Name>(self);
    return self;
  }
  run_or_enqueue(self.device().index(), Name, [to = self.mutable_data_ptr(), nbytes] {
    track_hot(Name);
    std::memset(to, 0, static_cast<size_t>(nbytes));
  }, captured_launch(neuron::rt::trace::Kind::Memset, {{&self, prof::kOutput}}, "Memset (zero_)"));
  return self;
}

template <const char* Name, Arith K, at::Tensor& (*Out)(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Scalar&),
          at::Tensor (*Func)(const at::Tensor&, const at::Tensor&, const at::Scalar&)>
at::Tensor binary_alpha(const at::Tensor& self, const at::Tensor& other, const at::Scalar& alpha) {
  if (C10_UNLIKELY(any_chalf(self, other))) return via_fallback<Name>(self, other, alpha).back().toTensor();
  if (at::Tensor r; small_binary<Name, K>(self, other, &alpha, false, &r)) return r;
  // (A complex alpha with real tensors is CPU's error, raised at the call by the synchronous path.)
  if (!alpha.isComplex()) {
    auto out_call = [alpha](at::Tensor& o, const at::Tensor& a, const at::Tensor& b) { Out(o, a, b, alpha); };
    if (at::Tensor r = enqueue_elementwise<Name>(self, other, &alpha, out_call); r.defined()) return r;
    if (alpha.isIntegral(/*includeBool=*/false)) {
      if (at::Tensor r = pooled_broadcast<Name, true>(self, other, out_call); r.defined()) return r;
    } else if (at::Tensor r = pooled_broadcast<Name>(self, other, out_call); r.defined()) {
      return r;
    }
  }
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(other);
  zc.launch(Name);
  return elementwise(zc, a, b, at::result_type(a, b), [&](at::Tensor& o) { Out(o, a, b, alpha); },
                     [&] { return Func(a, b, alpha); });
}

template <const char* Name, Arith K, bool TrueDivide, at::Tensor& (*Out)(at::Tensor&, const at::Tensor&, const at::Tensor&),
          at::Tensor (*Func)(const at::Tensor&, const at::Tensor&)>
at::Tensor binary(const at::Tensor& self, const at::Tensor& other) {
  if (C10_UNLIKELY(any_chalf(self, other))) return via_fallback<Name>(self, other).back().toTensor();
  if (at::Tensor r; small_binary<Name, K>(self, other, nullptr, false, &r)) return r;
  auto out_call = [](at::Tensor& o, const at::Tensor& a, const at::Tensor& b) { Out(o, a, b); };
  if (at::Tensor r = enqueue_elementwise<Name>(self, other, nullptr, out_call); r.defined()) return r;
  if (at::Tensor r = pooled_broadcast<Name, K == Arith::Mul>(self, other, out_call); r.defined()) return r;
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(other);
  zc.launch(Name);
  c10::ScalarType dtype = at::result_type(a, b);
  if (TrueDivide && c10::isIntegralType(dtype, /*includeBool=*/true)) {
    dtype = c10::typeMetaToScalarType(c10::get_default_dtype());
  }
  return elementwise(zc, a, b, dtype, [&](at::Tensor& o) { Out(o, a, b); }, [&] { return Func(a, b); });
}

#define HOT_NAME(var, str) constexpr char var[] = str;
HOT_NAME(kAdd, "aten::add.Tensor")
HOT_NAME(kU_neg, "aten::neg")
HOT_NAME(kClamp, "aten::clamp")
HOT_NAME(kU_exp, "aten::exp")
HOT_NAME(kU_log, "aten::log")
HOT_NAME(kU_tanh, "aten::tanh")
HOT_NAME(kU_sigmoid, "aten::sigmoid")
HOT_NAME(kU_rsqrt, "aten::rsqrt")
HOT_NAME(kU_reciprocal, "aten::reciprocal")
HOT_NAME(kU_erf, "aten::erf")
HOT_NAME(kU_sin, "aten::sin")
HOT_NAME(kU_cos, "aten::cos")
HOT_NAME(kU_log1p, "aten::log1p")
HOT_NAME(kU_expm1, "aten::expm1")
HOT_NAME(kSub, "aten::sub.Tensor")
HOT_NAME(kMul, "aten::mul.Tensor")
HOT_NAME(kDiv, "aten::div.Tensor")
HOT_NAME(kAdd_, "aten::add_.Tensor")
HOT_NAME(kSqrt, "aten::sqrt")
HOT_NAME(kSub_, "aten::sub_.Tensor")
HOT_NAME(kMul_, "aten::mul_.Tensor")
HOT_NAME(kDiv_, "aten::div_.Tensor")
HOT_NAME(kSum, "aten::sum.dim_IntList")
HOT_NAME(kMean, "aten::mean.dim")
HOT_NAME(kSoftmax, "aten::_softmax")
HOT_NAME(kMseLoss, "aten::mse_loss")
HOT_NAME(kMseLossBwd, "aten::mse_loss_backward")
HOT_NAME(kLogSoftmax, "aten::_log_softmax")
HOT_NAME(kGelu, "aten::gelu")
HOT_NAME(kGeluBwd, "aten::gelu_backward")
HOT_NAME(kLayerNorm, "aten::native_layer_norm")
HOT_NAME(kLayerNormBwd, "aten::native_layer_norm_backward")
HOT_NAME(kGroupNorm, "aten::native_group_norm")
HOT_NAME(kArange, "aten::arange.start_out")
HOT_NAME(kMaskedFill, "aten::masked_fill_.Scalar")
HOT_NAME(kGroupNormBwd, "aten::native_group_norm_backward")
HOT_NAME(kPowScalar, "aten::pow.Tensor_Scalar")
HOT_NAME(kSilu, "aten::silu")
HOT_NAME(kSiluBwd, "aten::silu_backward")
HOT_NAME(kRelu, "aten::relu")
HOT_NAME(kThresholdBwd, "aten::threshold_backward")
HOT_NAME(kIndexSelect, "aten::index_select")
HOT_NAME(kEq, "aten::eq.Tensor")
HOT_NAME(kNe, "aten::ne.Tensor")
HOT_NAME(kLt, "aten::lt.Tensor")
HOT_NAME(kLe, "aten::le.Tensor")
HOT_NAME(kGt, "aten::gt.Tensor")
HOT_NAME(kGe, "aten::ge.Tensor")
HOT_NAME(kEqS, "aten::eq.Scalar")
HOT_NAME(kNeS, "aten::ne.Scalar")
HOT_NAME(kLtS, "aten::lt.Scalar")
HOT_NAME(kLeS, "aten::le.Scalar")
HOT_NAME(kGtS, "aten::gt.Scalar")
HOT_NAME(kGeS, "aten::ge.Scalar")
HOT_NAME(kZero_, "aten::zero_")
HOT_NAME(kNllLoss, "aten::nll_loss_forward")
HOT_NAME(kCat, "aten::cat")
HOT_NAME(kSoftmaxBwd, "aten::_softmax_backward_data")
HOT_NAME(kLogSoftmaxBwd, "aten::_log_softmax_backward_data")
HOT_NAME(kNllLossBwd, "aten::nll_loss_backward")
HOT_NAME(kEmbeddingBwd, "aten::embedding_dense_backward")
#undef HOT_NAME

// ---- GELU: ATen's own kernel below oneDNN's break-even ----------------------------------------
// CPU's exact ("none") GELU over a contiguous float/bf16/fp16 input of more than one element
// runs oneDNN's eltwise primitive, whose per-call setup (primitive descriptor, memory objects)
// costs 7-14 us: a 2,048-element GELU takes 10 us forward and 17 us backward that way against
// 3.6 and 5.0 through ATen's vectorized kernel, the one CPU itself runs for strided inputs or
// with oneDNN off (figures in architecture.md, *GELU*). The two agree to about 1 ulp, not bit
// for bit. Below kGeluAtenNumel elements (oneDNN's break-even on this host class, 2 threads)
// neuron runs ATen's kernel; at and above it, CPU's `out=` kernel (oneDNN). Either way a
// contiguous input's result comes from the device pool (its layout is CPU's); strided inputs
// and mixed dtypes run CPU's functional kernel unchanged. The tanh approximation over
// contiguous fp32/bf16/fp16 runs gelu_tanh.h's kernel instead (SLEEF's 3.5-ULP tanh).
constexpr int64_t kGeluAtenNumel = 16384;

void gelu_kernel(const at::Tensor& out, const at::Tensor& a, at::native::GeluType type, c10::string_view approximate) {
  at::Tensor o = out;
  if (type == at::native::GeluType::Tanh && gelu_tanh::available(a)) {
    gelu_tanh::forward(o, a);  // SLEEF's 3.5-ULP tanh (gelu_tanh.h)
  } else if (a.numel() < kGeluAtenNumel) {
    auto iter = at::TensorIterator::unary_op(o, a);
    at::native::GeluKernel(c10::kCPU, iter, type);
  } else {
    at::cpu::gelu_out(o, a, approximate);
  }
}

void gelu_backward_kernel(const at::Tensor& out, const at::Tensor& g, const at::Tensor& a, at::native::GeluType type,
                          c10::string_view approximate) {
  at::Tensor o = out;
  if (type == at::native::GeluType::Tanh && gelu_tanh::available(a, &g)) {
    gelu_tanh::backward(o, g, a);
  } else if (a.numel() < kGeluAtenNumel) {
    auto iter = at::TensorIterator::borrowing_binary_op(o, g, a);
    at::native::GeluBackwardKernel(c10::kCPU, iter, type);
  } else {
    at::cpu::gelu_backward_out(o, g, a, approximate);
  }
}

at::Tensor gelu(const at::Tensor& self, c10::string_view approximate) {
  const auto type = at::native::get_gelutype_enum(approximate);  // validates the string first
  if (!plain(self) || !c10::isFloatingType(self.scalar_type())) {
    return Hot<at::Tensor(const at::Tensor&, c10::string_view)>::call<&at::cpu::gelu, kGelu>(self, approximate);
  }
  if (may_enqueue() && queueable_like(self, self)) {
    QueuedCall q;
    at::Tensor a = q.in(self), out;
    at::Tensor o = q.out(out, a.sizes(), a.scalar_type());
    q.enqueue(kGelu, [a, o, type, approx = std::string(approximate)] { gelu_kernel(o, a, type, approx); });
    return out;
  }
  ZeroCopy zc;
  at::Tensor a = zc.in(self);
  zc.launch(kGelu);
  at::Tensor out = pooled(zc, a.sizes(), a.scalar_type());
  gelu_kernel(zc.in_output(out), a, type, approximate);
  return out;
}

at::Tensor gelu_backward(const at::Tensor& grad, const at::Tensor& self, c10::string_view approximate) {
  const auto type = at::native::get_gelutype_enum(approximate);
  if (!plain(self) || !plain(grad) || grad.sizes() != self.sizes() || grad.scalar_type() != self.scalar_type() ||
      !c10::isFloatingType(self.scalar_type())) {
    return Hot<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>::call<&at::cpu::gelu_backward,
                                                                                          kGeluBwd>(grad, self,
                                                                                                    approximate);
  }
  if (may_enqueue() && queueable_like(self, self) && queueable_like(self, grad)) {
    QueuedCall q;
    at::Tensor g = q.in(grad), a = q.in(self), out;
    at::Tensor o = q.out(out, a.sizes(), a.scalar_type());
    q.enqueue(kGeluBwd,
              [g, a, o, type, approx = std::string(approximate)] { gelu_backward_kernel(o, g, a, type, approx); });
    return out;
  }
  ZeroCopy zc;
  at::Tensor g = zc.in(grad), a = zc.in(self);
  zc.launch(kGeluBwd);
  at::Tensor out = pooled(zc, a.sizes(), a.scalar_type());
  gelu_backward_kernel(zc.in_output(out), g, a, type, approximate);
  return out;
}

// ---- layer norm, sum, mean: queued with results shaped at the call ---------------------------
// With the engine on these are the synchronization points left in an MLP's or a transformer's
// step; each is queued (enqueue.h) when its arguments are neuron tensors of one floating dtype
// and CPU's checks pass at the call. Layer norm over one dtype runs what CPU's native_layer_norm
// runs after its checks, its kernel stub over the contiguous input and parameters, writing
// straight into results allocated at the call, synchronously or queued: the same bits, no copy
// of the activations and no adoption of CPU-allocated results (measured on 4x8: 0.9 us less a
// synchronous call, 2.7 us less a queued one, which also no longer copies the activations). Results contiguous, mean/rstd shaped
// [*batch dims, 1...] (the kernel writes their M values).
using LayerNormResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

void layer_norm_kernel(const at::Tensor& y, const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& x,
                       const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
                       int64_t M, int64_t N) {
  c10::MaybeOwned<at::Tensor> w = at::borrow_from_optional_tensor(weight), b = at::borrow_from_optional_tensor(bias);
  c10::MaybeOwned<at::Tensor> X = x.expect_contiguous(), gamma = w->expect_contiguous(), beta = b->expect_contiguous();
  at::Tensor Y = y, mean_ = mean, rstd_ = rstd;
  at::native::LayerNormKernel(c10::kCPU, *X, *gamma, *beta, M, N, eps, &Y, &mean_, &rstd_);
}

void layer_norm_backward_kernel(const at::Tensor& dx, const at::Tensor& dw, const at::Tensor& db, const at::Tensor& g,
                                const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                                const std::optional<at::Tensor>& weight, int64_t M, int64_t N) {
  c10::MaybeOwned<at::Tensor> w = at::borrow_from_optional_tensor(weight);
  c10::MaybeOwned<at::Tensor> X = x.expect_contiguous(), gamma = w->expect_contiguous();
  at::Tensor dx_ = dx, dw_ = dw, db_ = db;
  at::native::LayerNormBackwardKernel(c10::kCPU, g, *X, mean, rstd, *gamma, M, N, &dx_, &dw_, &db_);
}

// The arguments of a layer norm (forward or backward) that runs the kernel stubs: neuron tensors
// of one floating dtype (CPU's mixed-dtype case, bf16 input with fp32 parameters, keeps CPU's
// functional kernel) and something to normalize (CPU's empty-input cases likewise).
bool layer_norm_direct(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias) {
  return queueable_like(input, input) && c10::isFloatingType(input.scalar_type()) && input.numel() > 0 &&
         queueable_opt(input, weight) && queueable_opt(input, bias);
}

LayerNormResult layer_norm_hot(const at::Tensor& input, at::IntArrayRef normalized_shape,
                               const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                               double eps) {
  const bool w = weight.has_value() && weight->defined(), b = bias.has_value() && bias->defined();
  if (layer_norm_direct(input, weight, bias)) {
    const auto [M, N] = at::native::_check_layer_norm_inputs(input, normalized_shape, w ? *weight : at::Tensor(),
                                                             b ? *bias : at::Tensor());
    if (M > 0 && N > 0) {
      const int64_t axis = input.dim() - static_cast<int64_t>(normalized_shape.size());
      c10::SmallVector<int64_t, 6> stat(input.sizes().begin(), input.sizes().begin() + axis);
      stat.resize(input.dim(), 1);
      if (may_enqueue()) {
        QueuedCall q;
        at::Tensor x = q.in(input), y, mean, rstd;
        std::optional<at::Tensor> wa = q.in(weight), ba = q.in(bias);
        at::Tensor yo = q.out(y, x.sizes(), x.scalar_type()), mo = q.out(mean, stat, x.scalar_type()),
                   ro = q.out(rstd, stat, x.scalar_type());
        q.enqueue(kLayerNorm, [x, wa, ba, yo, mo, ro, eps, M = M, N = N] {
          layer_norm_kernel(yo, mo, ro, x, wa, ba, eps, M, N);
        });
        return {y, mean, rstd};
      }
      ZeroCopy zc;
      at::Tensor x = zc.in(input);
      std::optional<at::Tensor> wa, ba;
      if (w) wa = zc.in(*weight);
      if (b) ba = zc.in(*bias);
      zc.launch(kLayerNorm);
      at::Tensor y = pooled(zc, x.sizes(), x.scalar_type()), mean = pooled(zc, stat, x.scalar_type()),
                 rstd = pooled(zc, stat, x.scalar_type());
      layer_norm_kernel(zc.in_output(y), zc.in_output(mean), zc.in_output(rstd), x, wa, ba, eps, M, N);
      return {y, mean, rstd};
    }
  }
  return Hot<LayerNormResult(const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
                             const std::optional<at::Tensor>&, double)>::call<&at::cpu::native_layer_norm,
                                                                              kLayerNorm>(input, normalized_shape,
                                                                                          weight, bias, eps);
}

LayerNormResult layer_norm_backward_hot(const at::Tensor& grad_out, const at::Tensor& input,
                                        at::IntArrayRef normalized_shape, const at::Tensor& mean,
                                        const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& bias, std::array<bool, 3> mask) {
  const bool w = weight.has_value() && weight->defined(), b = bias.has_value() && bias->defined();
  if (layer_norm_direct(input, weight, bias) && queueable_like(input, grad_out) &&
      grad_out.sizes() == input.sizes() && queueable_like(input, mean) && queueable_like(input, rstd) &&
      (!mask[1] || w) && (!mask[2] || b)) {
    const auto [M, N] = at::native::_check_layer_norm_inputs(input, normalized_shape, w ? *weight : at::Tensor(),
                                                             b ? *bias : at::Tensor());
    if (M > 0 && N > 0 && mean.numel() == M && rstd.numel() == M) {
      if (may_enqueue()) {
        QueuedCall q;
        at::Tensor g = q.in(grad_out), x = q.in(input), m = q.in(mean), r = q.in(rstd), dx, dw, db;
        std::optional<at::Tensor> wa = q.in(weight);
        at::Tensor dxo, dwo, dbo;
        if (mask[0]) dxo = q.out(dx, x.sizes(), x.scalar_type());
        if (mask[1]) dwo = q.out(dw, weight->sizes(), x.scalar_type());
        if (mask[2]) dbo = q.out(db, bias->sizes(), x.scalar_type());
        q.enqueue(kLayerNormBwd, [g, x, m, r, wa, dxo, dwo, dbo, M = M, N = N] {
          layer_norm_backward_kernel(dxo, dwo, dbo, g, x, m, r, wa, M, N);
        });
        return {dx, dw, db};
      }
      ZeroCopy zc;
      at::Tensor g = zc.in(grad_out), x = zc.in(input), m = zc.in(mean), r = zc.in(rstd), dx, dw, db;
      std::optional<at::Tensor> wa;
      if (w) wa = zc.in(*weight);
      zc.launch(kLayerNormBwd);
      at::Tensor dxo, dwo, dbo;
      if (mask[0]) dx = pooled(zc, x.sizes(), x.scalar_type()), dxo = zc.in_output(dx);
      if (mask[1]) dw = pooled(zc, weight->sizes(), x.scalar_type()), dwo = zc.in_output(dw);
      if (mask[2]) db = pooled(zc, bias->sizes(), x.scalar_type()), dbo = zc.in_output(db);
      layer_norm_backward_kernel(dxo, dwo, dbo, g, x, m, r, wa, M, N);
      return {dx, dw, db};
    }
  }
  return Hot<LayerNormResult(const at::Tensor&, const at::Tensor&, at::IntArrayRef, const at::Tensor&,
                             const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                             std::array<bool, 3>)>::call<&at::cpu::native_layer_norm_backward,
                                                         kLayerNormBwd>(grad_out, input, normalized_shape, mean, rstd,
                                                                        weight, bias, mask);
}

// Group norm (diffusion models' UNets), forward and backward, queued like layer norm: CPU's
// kernel stubs (GroupNormKernel / GroupNormBackwardKernel, what CPU's functional ops call) write
// results shaped at the call as CPU's ops shape theirs (the input's suggested layout; mean/rstd
// [N, group] of the parameters' dtype, fp32 parameters under a bf16/fp16 input). The functional
// ops plus a copy of each result took 2.2x CPU's forward at a UNet block's shape (4x64x32x32,
// 32 groups: fresh host pages for the result, then a pass to copy it). The arguments are checked
// here as CPU's ops check them before calling their stubs (group counts, parameter sizes and
// dtypes, an input dense in its suggested layout); calls that fail a check run synchronously,
// raising CPU's error at the call.
bool group_norm_args(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias, int64_t N, int64_t C, int64_t HxW, int64_t group,
                     c10::ScalarType* param_dtype) {
  if (!may_enqueue() || !queueable_like(input, input) || !c10::isFloatingType(input.scalar_type()) ||
      input.dim() < 2 || input.numel() == 0 || input.size(0) != N || input.size(1) != C || group <= 0 ||
      C % group != 0 || N * C * HxW != input.numel() || !input.is_contiguous(input.suggest_memory_format())) {
    return false;
  }
  std::optional<c10::ScalarType> pdt;
  for (const auto* p : {&weight, &bias}) {
    if (!p->has_value() || !(*p)->defined()) continue;
    const at::Tensor& t = **p;
    if (!t.is_privateuseone() || t.device() != input.device() || t.numel() != C || !t.is_contiguous() ||
        t.is_conj() || t.is_neg() || (pdt && *pdt != t.scalar_type())) {
      return false;
    }
    pdt = t.scalar_type();
  }
  const auto dt = input.scalar_type();
  if (pdt && *pdt != dt && !(*pdt == at::kFloat && (dt == at::kBFloat16 || dt == at::kHalf))) return false;
  *param_dtype = pdt.value_or(dt);
  return true;
}

LayerNormResult group_norm_hot(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, int64_t N, int64_t C, int64_t HxW,
                               int64_t group, double eps) {
  if (c10::ScalarType pdt; group_norm_args(input, weight, bias, N, C, HxW, group, &pdt)) {
    QueuedCall q;
    at::Tensor x = q.in(input), y, mean, rstd;
    std::optional<at::Tensor> wa = q.in(weight), ba = q.in(bias);
    at::Tensor yo = q.out(y, input.sizes(), input.scalar_type(), suggested_strides(input));
    at::Tensor mo = q.out(mean, {N, group}, pdt), ro = q.out(rstd, {N, group}, pdt);
    q.enqueue(kGroupNorm, [x, wa, ba, yo, mo, ro, N, C, HxW, group, eps] {
      at::Tensor Y = yo, mean = mo, rstd = ro;  // (the stub takes its results by reference)
      at::native::GroupNormKernel(c10::kCPU, x, wa.value_or(at::Tensor()), ba.value_or(at::Tensor()), N, C, HxW,
                                  group, eps, Y, mean, rstd);
    });
    return {y, mean, rstd};
  }
  return Hot<LayerNormResult(const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                             int64_t, int64_t, int64_t, int64_t, double)>::call<&at::cpu::native_group_norm,
                                                                                 kGroupNorm>(input, weight, bias, N, C,
                                                                                             HxW, group, eps);
}

LayerNormResult group_norm_backward_hot(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
                                        const at::Tensor& rstd, const std::optional<at::Tensor>& weight, int64_t N,
                                        int64_t C, int64_t HxW, int64_t group, std::array<bool, 3> mask) {
  c10::ScalarType pdt;
  const bool w = weight.has_value() && weight->defined();
  // (Without a weight CPU's op cannot shape dgamma/dbeta, empty_like(gamma), and raises.)
  if ((w || (!mask[1] && !mask[2])) && group_norm_args(input, weight, std::nullopt, N, C, HxW, group, &pdt) &&
      queueable_like(input, grad_out) &&
      grad_out.sizes() == input.sizes() && grad_out.is_contiguous(input.suggest_memory_format()) &&
      mean.is_privateuseone() && rstd.is_privateuseone() && mean.device() == input.device() &&
      rstd.device() == input.device() && mean.scalar_type() == pdt && rstd.scalar_type() == pdt &&
      mean.numel() == N * group && rstd.numel() == N * group && mean.is_contiguous() && rstd.is_contiguous()) {
    QueuedCall q;
    at::Tensor g = q.in(grad_out), x = q.in(input), m = q.in(mean), r = q.in(rstd), dx, dw, db, dxo, dwo, dbo;
    std::optional<at::Tensor> wa = q.in(weight);
    if (mask[0]) dxo = q.out(dx, input.sizes(), input.scalar_type(), suggested_strides(input));
    if (mask[1]) dwo = q.out(dw, {C}, pdt);
    if (mask[2]) dbo = q.out(db, {C}, pdt);
    q.enqueue(kGroupNormBwd, [g, x, m, r, wa, dxo, dwo, dbo, N, C, HxW, group] {
      at::Tensor dX = dxo, dgamma = dwo, dbeta = dbo;  // undefined where the mask is false
      at::native::GroupNormBackwardKernel(c10::kCPU, g, x, m, r, wa.value_or(at::Tensor()), N, C, HxW, group, dX,
                                          dgamma, dbeta);
    });
    return {dx, dw, db};
  }
  return Hot<LayerNormResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, int64_t, int64_t, int64_t, int64_t,
                             std::array<bool, 3>)>::call<&at::cpu::native_group_norm_backward,
                                                         kGroupNormBwd>(grad_out, input, mean, rstd, weight, N, C,
                                                                        HxW, group, mask);
}

// arange (position ids, a timestep embedding's frequencies): the size from CPU's formula, which
// raises CPU's errors at the call; the empty result the factory passes is sized here (no
// bytes: nothing to wait for) and CPU's kernel fills it later.
at::Tensor& arange_out_hot(const at::Scalar& start, const at::Scalar& end, const at::Scalar& step, at::Tensor& out) {
  const auto dt = out.scalar_type();
  const bool kind = dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf ||
                    dt == at::kLong || dt == at::kInt;
  if (may_enqueue() && kind && out.is_privateuseone() && out.layout() == c10::kStrided && !out.is_conj() &&
      !out.is_neg() && !start.isComplex() && !end.isComplex() && !step.isComplex()) {
    int64_t size = 0;
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "arange_out", [&] {
      size = at::native::compute_arange_size<scalar_t>(start, end, step);
    });
    if (out.numel() != size) out.resize_({size});
    if (out.is_contiguous()) {
      QueuedCall q;
      at::Tensor o = q.inout(out);
      q.enqueue(kArange, [o, start, end, step]() mutable { at::cpu::arange_out(o, start, end, step); });
      return out;
    }
  }
  via_fallback<kArange>(start, end, step, out);
  return out;
}

// mse_loss (a diffusion model's loss) and its backward over same-shaped contiguous operands of one
// floating dtype: CPU's kernels into a 0-dim result (mean, sum) or one of the input's shape.
bool queueable_mse(const at::Tensor& self, const at::Tensor& target, int64_t reduction) {
  return may_enqueue() && queueable_like(self, self) && queueable_like(self, target) &&
         c10::isFloatingType(self.scalar_type()) && self.sizes() == target.sizes() && self.is_contiguous() &&
         target.is_contiguous() && reduction >= 0 && reduction <= 2;
}

at::Tensor mse_loss_hot(const at::Tensor& self, const at::Tensor& target, int64_t reduction) {
  if (queueable_mse(self, target, reduction)) {
    QueuedCall q;
    at::Tensor s = q.in(self), t = q.in(target), out;
    at::Tensor o = reduction == at::Reduction::None ? q.out(out, self.sizes(), self.scalar_type())
                                                    : q.out(out, {}, self.scalar_type());
    q.enqueue(kMseLoss, [s, t, o, reduction] { copy_result(kMseLoss, o, at::cpu::mse_loss(s, t, reduction)); });
    return out;
  }
  return Hot<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>::call<&at::cpu::mse_loss, kMseLoss>(
      self, target, reduction);
}

at::Tensor mse_loss_backward_hot(const at::Tensor& grad_output, const at::Tensor& self, const at::Tensor& target,
                                 int64_t reduction) {
  if (queueable_mse(self, target, reduction) && queueable_like(self, grad_output) &&
      (reduction == at::Reduction::None ? grad_output.sizes() == self.sizes() && grad_output.is_contiguous()
                                        : grad_output.dim() == 0)) {
    QueuedCall q;
    at::Tensor g = q.in(grad_output), s = q.in(self), t = q.in(target), out;
    at::Tensor o = q.out(out, self.sizes(), self.scalar_type());
    q.enqueue(kMseLossBwd, [g, s, t, o, reduction] {
      copy_result(kMseLossBwd, o, at::cpu::mse_loss_backward(g, s, t, reduction));
    });
    return out;
  }
  return Hot<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>::call<
      &at::cpu::mse_loss_backward, kMseLossBwd>(grad_output, self, target, reduction);
}

// masked_fill_ with a number (attention's causal mask: scores.masked_fill(mask == 0, -inf);
// label ids: ids.masked_fill_(ids == -100, pad)), in place over a real or bool self: queued when
// the bool mask broadcasts to self and the number converts to self's dtype (CPU's conversion
// errors, and its shape and overlap errors, raise at the call on the synchronous path).
at::Tensor& masked_fill_hot(at::Tensor& self, const at::Tensor& mask, const at::Scalar& value) {
  const bool fits = may_enqueue() && self.is_privateuseone() && !c10::isComplexType(self.scalar_type()) &&
                    !self.is_conj() && !self.is_neg() && self.layout() == c10::kStrided && mask.is_privateuseone() &&
                    mask.device() == self.device() && mask.scalar_type() == at::kBool &&
                    mask.layout() == c10::kStrided && at::is_expandable_to(mask.sizes(), self.sizes()) &&
                    at::has_internal_overlap(self) != at::MemOverlap::Yes && !partially_overlap(self, mask) &&
                    number_fits(self.scalar_type(), value);
  if (fits) {
    QueuedCall q;
    at::Tensor s = q.inout(self), m = q.in(mask);
    q.enqueue(kMaskedFill, [s, m, value]() mutable { at::cpu::masked_fill_(s, m, value); });
    return self;
  }
  via_fallback<kMaskedFill>(self, mask, value);
  return self;
}

// ---- losses and embedding gradients: queued (the rest of a language model's step) ---------

// nll_loss (cross_entropy's second half), forward and backward: CPU's out= kernels into results
// shaped by CPU's meta function. A target out of range is found by the kernel: reported at the
// next synchronization, naming the op (as CUDA's device-side assert is).
std::tuple<at::Tensor, at::Tensor> nll_loss_forward_hot(const at::Tensor& self, const at::Tensor& target,
                                                        const std::optional<at::Tensor>& weight, int64_t reduction,
                                                        int64_t ignore_index) {
  if (may_enqueue() && queueable_like(self, self) && c10::isFloatingType(self.scalar_type()) &&
      queueable_index(self, target) && queueable_opt(self, weight)) {
    auto [om, tm] = at::meta::nll_loss_forward(meta_like(self), meta_like(target), meta_like(weight), reduction,
                                               ignore_index);
    QueuedCall q;
    at::Tensor s = q.in(self), t = q.in(target), out, total;
    std::optional<at::Tensor> w = q.in(weight);
    at::Tensor o = q.out(out, om.sizes(), om.scalar_type(), om.strides());
    at::Tensor tw = q.out(total, tm.sizes(), tm.scalar_type(), tm.strides());
    q.enqueue(kNllLoss, [s, t, w, o, tw, reduction, ignore_index]() mutable {
      at::cpu::nll_loss_forward_out(o, tw, s, t, w, reduction, ignore_index);
    });
    return {out, total};
  }
  return Hot<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                                int64_t, int64_t)>::call<&at::cpu::nll_loss_forward,
                                                                         kNllLoss>(self, target, weight, reduction,
                                                                                   ignore_index);
}

at::Tensor nll_loss_backward_hot(const at::Tensor& grad_output, const at::Tensor& self, const at::Tensor& target,
                                 const std::optional<at::Tensor>& weight, int64_t reduction, int64_t ignore_index,
                                 const at::Tensor& total_weight) {
  if (may_enqueue() && queueable_like(self, self) && c10::isFloatingType(self.scalar_type()) &&
      queueable_like(self, grad_output) && queueable_index(self, target) && queueable_opt(self, weight) &&
      queueable_like(self, total_weight)) {
    const at::Tensor gm = at::meta::nll_loss_backward(meta_like(grad_output), meta_like(self), meta_like(target),
                                                      meta_like(weight), reduction, ignore_index,
                                                      meta_like(total_weight));
    QueuedCall q;
    at::Tensor g = q.in(grad_output), s = q.in(self), t = q.in(target), tw = q.in(total_weight), out;
    std::optional<at::Tensor> w = q.in(weight);
    at::Tensor o = q.out(out, gm.sizes(), gm.scalar_type(), gm.strides());
    q.enqueue(kNllLossBwd, [g, s, t, w, tw, o, reduction, ignore_index]() mutable {
      at::cpu::nll_loss_backward_out(o, g, s, t, w, reduction, ignore_index, tw);
    });
    return out;
  }
  return Hot<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        int64_t, int64_t, const at::Tensor&)>::call<&at::cpu::nll_loss_backward,
                                                                    kNllLossBwd>(grad_output, self, target, weight,
                                                                                 reduction, ignore_index,
                                                                                 total_weight);
}

// embedding's weight gradient into a contiguous [num_weights, grad.size(-1)] result, CPU's
// layout: written in place by embedding_backward.h's walk (CPU's kernel's bits, without its fresh
// allocation and a copy) where it takes the arguments, else CPU's kernel (no out= form) copied in.
// CPU drops an index outside the table here (the forward raised for it); so does the walk.
at::Tensor embedding_dense_backward_hot(const at::Tensor& grad, const at::Tensor& indices, int64_t num_weights,
                                        int64_t padding_idx, bool scale_grad_by_freq) {
  const bool walk = embedding::direct(grad, indices, scale_grad_by_freq);
  if (may_enqueue() && queueable_like(grad, grad) && c10::isFloatingType(grad.scalar_type()) && grad.dim() >= 1 &&
      queueable_index(grad, indices) && num_weights >= 0) {
    QueuedCall q;
    at::Tensor g = q.in(grad), i = q.in(indices), out;
    at::Tensor o = q.out(out, {num_weights, grad.size(-1)}, grad.scalar_type());
    if (walk) {
      q.enqueue(kEmbeddingBwd, [g, i, o, padding_idx] { embedding::dense_backward(o, g, i, padding_idx); });
      return out;
    }
    q.enqueue(kEmbeddingBwd, [g, i, o, num_weights, padding_idx, scale_grad_by_freq] {
      copy_result(kEmbeddingBwd, o,
                  at::cpu::embedding_dense_backward(g, i, num_weights, padding_idx, scale_grad_by_freq));
    });
    return out;
  }
  if (walk && grad.is_privateuseone() && indices.is_privateuseone() && grad.device() == indices.device() &&
      num_weights >= 0) {
    ZeroCopy zc;
    at::Tensor g = zc.in(grad), i = zc.in(indices);
    zc.launch(kEmbeddingBwd);
    at::Tensor out = pooled(zc, {num_weights, grad.size(-1)}, grad.scalar_type());
    embedding::dense_backward(zc.in_output(out), g, i, padding_idx);
    return out;
  }
  return Hot<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool)>::call<
      &at::cpu::embedding_dense_backward, kEmbeddingBwd>(grad, indices, num_weights, padding_idx, scale_grad_by_freq);
}

// cat (the backward of a split, e.g. attention's q/k/v): CPU's out= kernel into the layout
// CPU's meta function picks from the inputs' (it raises CPU's shape errors at the call).
at::Tensor cat_hot(const at::ITensorListRef& tensors, int64_t dim) {
  const auto list = tensors.materialize();
  bool queues = may_enqueue() && !list.empty() && c10::isFloatingType(list[0].get().scalar_type());
  for (size_t i = 0; queues && i < list.size(); ++i) queues = queueable_like(list[0].get(), list[i].get());
  if (queues) {
    std::vector<at::Tensor> metas;
    metas.reserve(list.size());
    for (const auto& t : list) metas.push_back(meta_like(t.get()));
    const at::Tensor m = at::meta::cat(metas, dim);
    QueuedCall q;
    std::vector<at::Tensor> inputs;
    inputs.reserve(list.size());
    for (const auto& t : list) inputs.push_back(q.in(t.get()));
    at::Tensor out;
    at::Tensor o = q.out(out, m.sizes(), m.scalar_type(), m.strides());
    q.enqueue(kCat, [inputs, o, dim]() mutable { at::cpu::cat_out(o, inputs, dim); });
    return out;
  }
  return via_fallback<kCat>(c10::List<at::Tensor>(std::vector<at::Tensor>(list.begin(), list.end())), dim)
      .back()
      .toTensor();
}

// sum / mean over dims: CPU's out= kernels (structured: the functional kernels run them) into a
// contiguous result of the reduced shape; make_dim_mask raises CPU's dim errors at the call.
template <const char* Name,
          at::Tensor (*F)(const at::Tensor&, at::OptionalIntArrayRef, bool, std::optional<c10::ScalarType>),
          at::Tensor& (*O)(at::Tensor&, const at::Tensor&, at::OptionalIntArrayRef, bool, std::optional<c10::ScalarType>)>
at::Tensor reduction(const at::Tensor& self, at::OptionalIntArrayRef dim, bool keepdim,
                     std::optional<c10::ScalarType> dtype) {
  if (may_enqueue() && queueable_like(self, self) && c10::isFloatingType(self.scalar_type()) &&
      (!dtype.has_value() || *dtype == self.scalar_type())) {
    const auto shape = at::native::shape_from_dim_mask(self, at::native::make_dim_mask(dim, self.dim()), keepdim);
    QueuedCall q;
    at::Tensor a = q.in(self), out;
    at::Tensor o = q.out(out, shape, self.scalar_type());
    std::optional<std::vector<int64_t>> dims;
    if (dim.has_value()) dims = dim->vec();
    q.enqueue(Name, [a, o, dims, keepdim, dtype]() mutable {
      O(o, a, dims.has_value() ? at::OptionalIntArrayRef(*dims) : at::OptionalIntArrayRef(), keepdim, dtype);
    });
    return out;
  }
  return Hot<at::Tensor(const at::Tensor&, at::OptionalIntArrayRef, bool, std::optional<c10::ScalarType>)>::call<
      F, Name>(self, dim, keepdim, dtype);
}

// ---- index_select (embedding lookups): result from the device pool ---------------------------
// CPU's functional kernel takes its result from the host allocator: an embedding lookup of
// 4,096 rows of 512 floats (8 MB) spent a third of its time on fresh pages (neuron 381 us vs
// CPU 281). CPU's kernel writes a contiguous result of self's shape with `dim` resized to the
// index count, so the pooled `out=` call gives the same tensor.
at::Tensor index_select_hot(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  if (any_chalf(self) || self.dim() == 0 || index.dim() > 1) {
    return Hot<at::Tensor(const at::Tensor&, int64_t, const at::Tensor&)>::call<&at::cpu::index_select,
                                                                               kIndexSelect>(self, dim, index);
  }
  if (may_enqueue() && queueable_like(self, self) && queueable_index(self, index)) {
    // Queued (an embedding lookup, the first op of a language model's step): an index out of
    // range is found by the kernel and reported at the next synchronization.
    const int64_t d = c10::maybe_wrap_dim(dim, self.dim());
    std::vector<int64_t> sizes = self.sizes().vec();
    sizes[d] = index.numel();
    QueuedCall q;
    at::Tensor s = q.in(self), i = q.in(index), out;
    at::Tensor o = q.out(out, sizes, self.scalar_type());
    q.enqueue(kIndexSelect, [s, i, o, d]() mutable { at::cpu::index_select_out(o, s, d, i); });
    return out;
  }
  ZeroCopy zc;
  at::Tensor s = zc.in(self), i = zc.in(index);
  zc.launch(kIndexSelect);
  const int64_t d = c10::maybe_wrap_dim(dim, s.dim());
  std::vector<int64_t> sizes = s.sizes().vec();
  sizes[d] = i.numel();
  at::Tensor out = pooled(zc, sizes, s.scalar_type());
  at::Tensor o = zc.in_output(out);
  at::cpu::index_select_out(o, s, d, i);
  return out;
}

using T = at::Tensor;
using CT = const at::Tensor&;
using S = const at::Scalar&;

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("_efficientzerotensor", TORCH_FN(efficient_zero_tensor));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_offset));
  m.impl("set_.source_Storage", TORCH_FN(set_storage));
  m.impl("set_.source_Tensor", TORCH_FN(set_tensor));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  m.impl("record_stream", TORCH_FN(record_stream));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));

  // Hot ops.
  m.impl("add.Tensor", TORCH_FN((binary_alpha<kAdd, Arith::Add, &at::cpu::add_out, &at::cpu::add>)));
  m.impl("sub.Tensor", TORCH_FN((binary_alpha<kSub, Arith::Sub, &at::cpu::sub_out, &at::cpu::sub>)));
  m.impl("mul.Tensor", TORCH_FN((binary<kMul, Arith::Mul, false, &at::cpu::mul_out, &at::cpu::mul>)));
  m.impl("div.Tensor", TORCH_FN((binary<kDiv, Arith::Div, true, &at::cpu::div_out, &at::cpu::div>)));
  m.impl("add_.Tensor", TORCH_FN((inplace_alpha<kAdd_, Arith::Add, &at::cpu::add_>)));
  m.impl("sub_.Tensor", TORCH_FN((inplace_alpha<kSub_, Arith::Sub, &at::cpu::sub_>)));
  m.impl("mul_.Tensor", TORCH_FN((inplace<kMul_, Arith::Mul, &at::cpu::mul_>)));
  m.impl("div_.Tensor", TORCH_FN((inplace<kDiv_, Arith::Div, &at::cpu::div_>)));
  m.impl("sqrt", TORCH_FN((unary_floating<kSqrt, &at::cpu::sqrt_out, &at::cpu::sqrt>)));
  m.impl("eq.Tensor", TORCH_FN((comparison<kEq, Arith::Eq, &at::meta::eq, &at::cpu::eq_out>)));
  m.impl("ne.Tensor", TORCH_FN((comparison<kNe, Arith::Ne, &at::meta::ne, &at::cpu::ne_out>)));
  m.impl("lt.Tensor", TORCH_FN((comparison<kLt, Arith::Lt, &at::meta::lt, &at::cpu::lt_out>)));
  m.impl("le.Tensor", TORCH_FN((comparison<kLe, Arith::Le, &at::meta::le, &at::cpu::le_out>)));
  m.impl("gt.Tensor", TORCH_FN((comparison<kGt, Arith::Gt, &at::meta::gt, &at::cpu::gt_out>)));
  m.impl("ge.Tensor", TORCH_FN((comparison<kGe, Arith::Ge, &at::meta::ge, &at::cpu::ge_out>)));
  m.impl("eq.Scalar", TORCH_FN((comparison_scalar<kEqS, Arith::Eq, &at::meta::eq, &at::cpu::eq_out>)));
  m.impl("ne.Scalar", TORCH_FN((comparison_scalar<kNeS, Arith::Ne, &at::meta::ne, &at::cpu::ne_out>)));
  m.impl("lt.Scalar", TORCH_FN((comparison_scalar<kLtS, Arith::Lt, &at::meta::lt, &at::cpu::lt_out>)));
  m.impl("le.Scalar", TORCH_FN((comparison_scalar<kLeS, Arith::Le, &at::meta::le, &at::cpu::le_out>)));
  m.impl("gt.Scalar", TORCH_FN((comparison_scalar<kGtS, Arith::Gt, &at::meta::gt, &at::cpu::gt_out>)));
  m.impl("ge.Scalar", TORCH_FN((comparison_scalar<kGeS, Arith::Ge, &at::meta::ge, &at::cpu::ge_out>)));
  m.impl("zero_", TORCH_FN(zero_<kZero_>));
  m.impl("sum.dim_IntList", TORCH_FN((reduction<kSum, &at::cpu::sum, &at::cpu::sum_out>)));
  m.impl("mean.dim", TORCH_FN((reduction<kMean, &at::cpu::mean, &at::cpu::mean_out>)));
  // Registered directly: through the fallback its composite passes a 0-dim out= and warns.
  m.impl("mse_loss", TORCH_FN(mse_loss_hot));
  m.impl("mse_loss_backward", TORCH_FN(mse_loss_backward_hot));
  m.impl("_softmax",
         TORCH_FN((Pooled<T(CT, int64_t, bool)>::call<&at::cpu::_softmax, &at::cpu::_softmax_out, kSoftmax>)));
  m.impl("_log_softmax", TORCH_FN((Pooled<T(CT, int64_t, bool)>::call<&at::cpu::_log_softmax,
                                                                      &at::cpu::_log_softmax_out, kLogSoftmax>)));
  m.impl("_softmax_backward_data", TORCH_FN((Pooled<T(CT, CT, int64_t, c10::ScalarType)>::call<
                                             &at::cpu::_softmax_backward_data, &at::cpu::_softmax_backward_data_out,
                                             kSoftmaxBwd>)));
  m.impl("_log_softmax_backward_data", TORCH_FN((Pooled<T(CT, CT, int64_t, c10::ScalarType)>::call<
                                                 &at::cpu::_log_softmax_backward_data,
                                                 &at::cpu::_log_softmax_backward_data_out, kLogSoftmaxBwd>)));
  m.impl("gelu", TORCH_FN(gelu));
  m.impl("gelu_backward", TORCH_FN(gelu_backward));
  m.impl("pow.Tensor_Scalar", TORCH_FN((Pooled<T(CT, S)>::call<&at::cpu::pow, &at::cpu::pow_out, kPowScalar>)));
  // Ops with a CPU kernel and a math composite (see fallback.cpp's list): CPU's kernel, unboxed.
  m.impl("native_layer_norm", TORCH_FN(layer_norm_hot));
  m.impl("native_layer_norm_backward", TORCH_FN(layer_norm_backward_hot));
  m.impl("native_group_norm", TORCH_FN(group_norm_hot));
  m.impl("arange.start_out", TORCH_FN(arange_out_hot));
  m.impl("masked_fill_.Scalar", TORCH_FN(masked_fill_hot));
  m.impl("native_group_norm_backward", TORCH_FN(group_norm_backward_hot));
  m.impl("silu", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::silu, &at::cpu::silu_out, kSilu>)));
  // silu_backward also has a CompositeImplicitAutograd kernel (math_silu_backward), which
  // autograd would run on a backend without a kernel of its own: five ops, other roundings.
  m.impl("silu_backward",
         TORCH_FN((Pooled<T(CT, CT)>::call<&at::cpu::silu_backward, &at::cpu::silu_backward_out, kSiluBwd>)));
  m.impl("relu", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::relu, &relu_out, kRelu>)));
  m.impl("threshold_backward", TORCH_FN((Pooled<T(CT, CT, S)>::call<&at::cpu::threshold_backward,
                                                                    &at::cpu::threshold_backward_out, kThresholdBwd>)));
  m.impl("index_select", TORCH_FN(index_select_hot));
  m.impl("cat", TORCH_FN(cat_hot));
  m.impl("nll_loss_forward", TORCH_FN(nll_loss_forward_hot));
  m.impl("nll_loss_backward", TORCH_FN(nll_loss_backward_hot));
  m.impl("embedding_dense_backward", TORCH_FN(embedding_dense_backward_hot));
  // Unary elementwise ops: unboxed, results from the device pool (Pooled).
  m.impl("neg", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::neg, &at::cpu::neg_out, kU_neg>)));
  m.impl("exp", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::exp, &at::cpu::exp_out, kU_exp>)));
  m.impl("log", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::log, &at::cpu::log_out, kU_log>)));
  m.impl("tanh", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::tanh, &at::cpu::tanh_out, kU_tanh>)));
  m.impl("sigmoid", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::sigmoid, &at::cpu::sigmoid_out, kU_sigmoid>)));
  m.impl("rsqrt", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::rsqrt, &at::cpu::rsqrt_out, kU_rsqrt>)));
  m.impl("reciprocal", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::reciprocal, &at::cpu::reciprocal_out, kU_reciprocal>)));
  m.impl("erf", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::erf, &at::cpu::erf_out, kU_erf>)));
  m.impl("sin", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::sin, &at::cpu::sin_out, kU_sin>)));
  m.impl("cos", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::cos, &at::cpu::cos_out, kU_cos>)));
  m.impl("log1p", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::log1p, &at::cpu::log1p_out, kU_log1p>)));
  m.impl("expm1", TORCH_FN((Pooled<T(CT)>::call<&at::cpu::expm1, &at::cpu::expm1_out, kU_expm1>)));
  m.impl("clamp", TORCH_FN((Pooled<T(CT, const std::optional<at::Scalar>&, const std::optional<at::Scalar>&)>::call<
                            &at::cpu::clamp, &at::cpu::clamp_out, kClamp>)));
}

// The conj/neg bits must reach the CPU copy kernel, which resolves them; without these
// fallthroughs the Conjugate fallback clones, which copies, which recurses.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

}  // namespace torchneuron
