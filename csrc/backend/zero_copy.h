// Zero-copy execution of CPU kernels over neuron memory.
//
// Device memory is host memory, so a neuron tensor's bytes can be viewed as a CPU tensor.
// Within one op call, every device storage gets exactly one CPU alias storage (so ATen's
// overlap checks see sharing), CPU kernels run on the aliases, and their results are mapped
// back: an input alias returns the original device tensor, a view of an input alias becomes a
// device view of the original storage, and a fresh CPU result is adopted into device memory
// in place (counted by the device allocator). Nothing is copied.
#pragma once

#include <ATen/Tensor.h>
#include <ATen/core/operator_name.h>
#include <c10/util/SmallVector.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "../runtime/engine.h"
#include "profiler.h"

namespace torchneuron {

// Device index validation with a RuntimeError naming the fix.
void check_device_index(int index);

class ZeroCopy {
 public:
  // While torch.profiler records device activities, a ZeroCopy also records the kernel it
  // runs (see profiler.h); otherwise this is one branch.
  ZeroCopy() {
    if (C10_UNLIKELY(neuron::rt::trace::active())) trace_ = prof::begin_launch();
  }
  // For a kernel queued on the execution engine (enqueue.h): in() does not run the queue.
  struct Queued {};
  // While a graph is captured, a queued kernel's ZeroCopy also notes its operands (in the
  // profiler's encoding) and the launching Python frames for the replays' activities:
  // captured_tensors(), given to enqueue_kernel.
  explicit ZeroCopy(Queued) : queued_(true) {
    if (C10_UNLIKELY(neuron::rt::engine::capturing())) captured_ = prof::capture_template();
  }
  ~ZeroCopy() {
    if (C10_UNLIKELY(trace_ != nullptr)) prof::finish(std::move(trace_), device_);
    if (!args_.empty()) recycle_aliases();
  }
  ZeroCopy(const ZeroCopy&) = delete;
  ZeroCopy& operator=(const ZeroCopy&) = delete;

  // ---- the kernel ----
  // Call right before the CPU kernel runs: counts the op (get_executed_ops) and, when
  // profiling, starts the device activity (named nc::<op>).
  void launch(const char* qualified_name);
  void launch(const c10::OperatorName& op);
  // A copy of `bytes` bytes (the activity is named "Memcpy HtoD/DtoH/DtoD").
  void launch_copy(neuron::rt::trace::CopyKind kind, int64_t bytes, bool blocking);

  // ---- inputs ----
  // Note a tensor argument: checks devices (same neuron device; CPU only as 0-dim scalars
  // unless allow_cpu; never as outputs, trace_flags & kOutput, of an op on a neuron device) and
  // returns the CPU alias for neuron tensors, the tensor itself otherwise. Kernels may read an
  // alias before launch() (argument checks on values), so the first neuron tensor runs the
  // execution engine's queue (unless this ZeroCopy is for a queued kernel).
  // trace_flags: how the profiler records the argument (prof::kOutput for out= buffers).
  at::Tensor in(const at::Tensor& t, bool allow_cpu = false, int64_t trace_flags = 0);
  // A device buffer the kernel writes (a preallocated output): aliased like in(), recorded as
  // written rather than read.
  // extra_flags: prof::kRead for a buffer the kernel also reads (in place).
  at::Tensor in_output(const at::Tensor& t, bool allow_cpu = false, int64_t extra_flags = 0);
  // An extra argument of the kernel's device activity (raw JSON value; profiling only).
  void trace_meta(const char* key, std::string raw_json) {
    if (C10_UNLIKELY(trace_ != nullptr)) trace_->rec.meta.emplace_back(key, std::move(raw_json));
  }
  void set_device(int d);
  int device() const { return device_; }

  // ---- outputs ----
  // Map a CPU result back to the device (see the header comment).
  at::Tensor out(const at::Tensor& cpu);

  // Adopt alias storages a CPU kernel reallocated (out= resize) and copy back the metadata
  // of mutated arguments. Call after the kernel, before out().
  void sync_inputs();

  bool any_neuron() const { return device_ >= 0; }
  // The operands noted while a graph is captured (null otherwise), for enqueue_kernel.
  neuron::rt::engine::TracePayload captured_tensors() const { return captured_; }
  // While a graph is captured: the replays' activity is a copy of `bytes` (as launch_copy's).
  void captured_as_copy(neuron::rt::trace::CopyKind kind, const char* name, int64_t bytes) {
    if (C10_LIKELY(captured_ == nullptr)) return;
    captured_->kind = neuron::rt::trace::Kind::Memcpy;
    captured_->copy = kind;
    captured_->name = name;
    captured_->bytes = bytes;
  }
  // Whether this ZeroCopy belongs to a queued kernel (ZeroCopy(Queued{})).
  bool queued() const { return queued_; }

  // A queued kernel's temporaries (gemm::scratch) may come from `arena`, the CPU alias of
  // device memory its call allocated from the caching allocator: a queued kernel may not enter
  // the pool, and fresh host memory faults its pages in on every call (an fp16 product's
  // widened 4096 x 4096 weight: 64 MiB, ~20 ms). take_scratch returns `bytes` of it (64-byte
  // aligned) or nullptr once it is used up.
  void set_scratch_arena(at::Tensor arena) {
    arena_ = std::move(arena);
    arena_used_ = 0;
  }
  void* take_scratch(size_t bytes) {
    const size_t at = (arena_used_ + 63) & ~size_t{63};
    if (!arena_.defined() || at + bytes > arena_.nbytes()) return nullptr;
    arena_used_ = at + bytes;
    return static_cast<char*>(arena_.data_ptr()) + at;
  }

  // For a kernel queued on the execution engine (enqueue.h), after the last in(): drop the
  // references to the device tensors, keeping only the aliases (raw views of the bytes). A
  // tensor the user drops is then freed at once, as on CUDA: the caching allocator's block is
  // written again only by later kernels, and memory that could go away (adopted, mapped from
  // another process) is released behind the queue (engine.h, after_queue). sync_inputs() must
  // not be called afterwards: a queued kernel changes no tensor's metadata.
  void release_tensors();

 private:
  struct Entry {
    c10::StorageImpl* device_storage;
    c10::Storage alias;
    void* data;
    size_t nbytes;
    const void* key() const { return device_storage; }
  };
  struct Arg {
    at::Tensor device_tensor;
    at::Tensor alias;
    const void* key() const { return device_tensor.unsafeGetTensorImpl(); }
  };
  c10::Storage alias_storage(c10::StorageImpl* s, c10::TensorImpl* spare);
  void recycle_aliases() noexcept;
  at::Tensor map_out(const at::Tensor& cpu);
  at::Tensor adopt(const at::Tensor& cpu);
  [[noreturn]] void mismatch(const at::Device& a, const at::Device& b);
  [[noreturn]] void output_mismatch(int device);

  int device_ = -1;
  bool queued_ = false;    // ZeroCopy(Queued{})
  at::Tensor arena_;       // set_scratch_arena
  size_t arena_used_ = 0;
  void note_tensor(const at::Tensor& t, int64_t flags) {
    if (C10_UNLIKELY(trace_ != nullptr)) prof::encode_tensor(trace_->rec.tensors, t, flags);
    if (C10_UNLIKELY(captured_ != nullptr)) prof::encode_tensor(captured_->tensors, t, flags);
  }
  bool cpu_seen_ = false;  // a non-scalar CPU tensor among the arguments
  const c10::TensorImpl* cpu_output_ = nullptr;  // a 0-dim CPU tensor the op writes
  bool cpu_output_is_out_ = false;                // ... as out= (else mutated in place)
  c10::SmallVector<Entry, 4> storages_;
  c10::SmallVector<Arg, 6> args_;
  // Positions in the lists above by device storage and by device tensor, kept once a list is
  // long (zero_copy.cpp, position: scans made an op over many tensors quadratic).
  std::unordered_map<const void*, size_t> arg_index_, storage_index_;
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 2> adopted_;
  std::unique_ptr<prof::Pending> trace_;  // non-null only while profiling
  std::shared_ptr<neuron::rt::trace::Record> captured_;  // non-null only for a queued kernel captured
};

// Wrap CPU bytes as a device tensor (used for adoption and by the c10d backend).
at::Tensor make_device_tensor(c10::Storage storage, const at::Tensor& like);

// A fresh result on the op's device (the current device if no neuron tensor was seen) from
// the device's caching allocator, contiguous unless `strides` are given, for kernels that write
// it through an out= CPU kernel on its alias: functional CPU kernels would take host memory,
// fresh pages for large results on every call, and adoption bookkeeping.
at::Tensor pooled(const ZeroCopy& zc, c10::IntArrayRef sizes, c10::ScalarType dtype, c10::IntArrayRef strides = {});

// Storage growth on the storage's device, keeping the old bytes (resize_, set_, hooks).
void resize_storage_bytes(c10::StorageImpl* storage, size_t nbytes);

// ---- op tracking (torchneuron.get_executed_ops) ----
// Keys are stable addresses (the operator's name in the dispatcher, or a string literal), so
// counting costs a hash lookup and no string building.
void track_fallback(const c10::OperatorName& name);
void track_hot(const char* qualified_name);
std::vector<std::pair<std::string, int64_t>> executed_ops(bool fallback_only);
void clear_op_tracking();
void set_op_tracking(bool enabled);

}  // namespace torchneuron
