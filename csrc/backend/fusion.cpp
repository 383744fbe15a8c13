// Adaptive Eager: records of queued kernels, and the fuser the engine calls (fusion.h).
#include "fusion.h"
#include "allocator.h"
#include "amx_gemm.h"
#include "cpu_features.h"
#include "enqueue.h"
#include "extrema.h"
#include "fp8.h"
#include "fusion_interpreter.h"
#include "gemm.h"
#include "gemv.h"
#include "tile_fusion.h"
#include "zero_copy.h"

#include <ATen/Config.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ScalarOps.h>
#include <ATen/ops/abs_cpu_dispatch.h>
#include <ATen/ops/add_cpu_dispatch.h>
#include <ATen/ops/addcdiv_cpu_dispatch.h>
#include <ATen/ops/addcmul_cpu_dispatch.h>
#include <ATen/ops/div_cpu_dispatch.h>
#include <ATen/Version.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/lerp_cpu_dispatch.h>
#include <ATen/ops/mul_cpu_dispatch.h>
#include <ATen/ops/sqrt_cpu_dispatch.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace torchneuron::fusion {

namespace {

// The precompiled family (tile_fusion.h) and the GEMM family (fuse_gemm): a region holds one family.
constexpr bool is_tiled(Kind k) { return k >= kWiden && k <= kMaxAll; }
constexpr bool is_gemm(Kind k) { return k >= kWidenInt8; }
// ATen computes float sqrt with MKL's vmsSqrt, and the generated kernels call it too
// (eager_fusion.py); a build without MKL computes it otherwise, so sqrt does not fuse there.
constexpr bool kSqrtFuses = AT_MKL_ENABLED();
constexpr size_t kMaxSlots = 255;  // buffers per group (one byte each in a signature)
constexpr int kCompileAfter = 2;   // a signature seen this often is compiled (adaptive)

// A queued kernel's record is an array of `count` records (in its first): one for a kernel of
// one op, one per element for a foreach list kernel (foreach.cpp), which fuses only whole.
struct Record {
  uint32_t count = 1;
  Kind kind;
  int64_t numel;
  int device = -1;
  std::array<void*, 4> ptr{};  // [0] is written
  std::array<c10::ScalarType, 4> dtype{c10::ScalarType::Float, c10::ScalarType::Float, c10::ScalarType::Float,
                                       c10::ScalarType::Float};
  std::array<float, 2> scalar{};
  const float* value = nullptr;  // kScale: the 0-dim factor's bytes, read when the region runs
  AllocationStamp out_stamp;  // the output's allocation (allocator.h): unstored slots, taken memory
  void* result = nullptr;                 // kMaxAll's 0-dim output
  // kAbs, kMaxAll, kToBf16: the input's sizes, then strides (redo, the cast); kMatmul: m, n, k,
  // A's and B's leading dimensions; kMulCols: the vector's sizes, then strides.
  c10::SmallVector<int64_t, 8> geometry;
  // The op, for torchneuron.get_executed_ops (a fused kernel still ran the op on the device).
  const char* hot = nullptr;
  const c10::OperatorName* boxed = nullptr;
  bool list = false;  // (the first record of) a foreach list kernel's
};

using KernelFn = void (*)(void* const* buffers, const float* scalars, int64_t numel, int64_t* remainders);

struct Entry {
  int seen = 0;
  bool requested = false;
  bool failed = false;
  KernelFn fn = nullptr;
};

std::mutex g_mu;  // the kernel cache: the fuser reads it, the compiling thread installs
std::unordered_map<std::string, Entry>* g_cache = new std::unordered_map<std::string, Entry>();
Stats g_stats;
std::atomic<int> g_fail_after{-1};  // fail_after()
std::vector<std::string>* g_to_compile = new std::vector<std::string>();  // for flush()

bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strcmp(v, "0") != 0;
}

// How many kernels queue up before the queue runs, and so the most one fused region takes.
// AWS's default is 1,024; here 64 (runtime/engine.cpp says why: measured).
size_t env_limit() {
  constexpr size_t kDefault = 64;
  const char* v = std::getenv("TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT");
  if (v == nullptr || *v == '\0') return kDefault;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return (end != v && *end == '\0' && n >= 2) ? static_cast<size_t>(n) : kDefault;
}

// One Python number as the ATen CPU kernel reads it (a float32 kernel converts a wrapped
// number or a Scalar to float directly from its own type).
bool scalar_of(const at::Tensor& wrapped, float* out) { return number_value(wrapped, out); }

bool scalar_of(const at::Scalar& s, float* out) {
  if (s.isComplex()) return false;
  *out = s.to<float>();
  return true;
}

// A Scalar argument of a boxed call (not a Scalar: false).
bool scalar_of(const c10::IValue& v, float* out) { return v.isScalar() && scalar_of(v.toScalar(), out); }

bool plain_float(const at::Tensor& t, int64_t numel) {
  return t.defined() && !t.is_cpu() && t.scalar_type() == c10::ScalarType::Float && t.numel() == numel &&
         t.is_contiguous() && !t.is_conj() && !t.is_neg() && t.const_data_ptr() != nullptr;
}

// Fill `r` over `tensors` (tensors[0] written); false unless all are plain float32 of one count.
bool fill(Record& r, Kind kind, std::initializer_list<const at::Tensor*> tensors, std::initializer_list<float> scalars) {
  const at::Tensor& out = **tensors.begin();
  if (!out.defined() || out.numel() == 0) return false;
  r.kind = kind;
  r.numel = out.numel();
  r.device = out.get_device();
  size_t i = 0;
  for (const at::Tensor* t : tensors) {
    if (!plain_float(*t, r.numel)) return false;
    r.ptr[i++] = const_cast<void*>(t->const_data_ptr());
  }
  i = 0;
  for (float s : scalars) r.scalar[i++] = s;
  r.out_stamp = allocation_stamp(out.storage().data_ptr());  // (unstored slots: fuse)
  return true;
}

// Below two vectors of ATen's width, ATen's vectorized loop runs no vector iteration: a fused
// kernel would run such a kernel entirely as its scalar remainder, through ATen's own kernel
// (fusion.cpp, run_remainder), at more cost than running it unfused (16-element add with fusion:
// 2.9 us an op against 2.5 unfused on an AVX-512 host). So a single kernel that small carries no
// record; a foreach list's small elements still do, so that the list stays whole.
int64_t min_fused_numel() {
  static const int64_t n = at::get_cpu_capability() == "AVX512" ? 32 : 16;  // eager_fusion.py, vec size
  return n;
}

neuron::rt::engine::Record make(Kind kind, std::initializer_list<const at::Tensor*> tensors,
                                std::initializer_list<float> scalars, const char* hot,
                                const c10::OperatorName* boxed = nullptr) {
  if ((*tensors.begin())->numel() < min_fused_numel()) return nullptr;
  auto r = std::make_shared<Record>();
  if (!fill(*r, kind, tensors, scalars)) return nullptr;
  r->hot = hot;
  r->boxed = boxed;
  return r;
}

// The records of a foreach list op, element by element, as CPU's slow path runs it on the
// aliases (foreach.cpp): `self[i].op_(other[i] or scalar(s)[i], ...)`. Null if any element is
// outside fusion's scope.
neuron::rt::engine::Record list_records(const c10::OperatorName& name, const torch::jit::Stack& args) {
  const std::string op = name.name.substr(15);  // after "aten::_foreach_"
  const std::string& o = name.overload_name;
  if (args.empty() || !args[0].isTensorList()) return nullptr;
  const std::vector<at::Tensor> self = args[0].toTensorList().vec();
  const size_t len = self.size();
  if (len == 0) return nullptr;
  auto list = [&](size_t i) {
    std::vector<at::Tensor> l = args.at(i).isTensorList() ? args.at(i).toTensorList().vec() : std::vector<at::Tensor>();
    l.resize(len);  // a shorter list (the op raises) leaves undefined tensors: no record
    return l;
  };
  // The i-th Python number: one for all (".Scalar") or one each (".ScalarList").
  std::vector<float> values(len);
  auto numbers = [&](size_t at) {
    if (o == "Scalar") {
      float v = 0.f;
      if (!scalar_of(args.at(at), &v)) return false;
      std::fill(values.begin(), values.end(), v);
      return true;
    }
    if (o != "ScalarList" || !args.at(at).isList()) return false;
    const auto ref = args.at(at).toListRef();
    if (ref.size() != len) return false;
    for (size_t i = 0; i < len; ++i) {
      if (!scalar_of(ref[i], &values[i])) return false;
    }
    return true;
  };
  std::shared_ptr<Record[]> recs(new Record[len]);
  const bool add = op == "add_", sub = op == "sub_", mul = op == "mul_", div = op == "div_";
  bool ok = true;
  if ((add || sub) && o == "List" && args.size() == 3) {
    float a = 0.f;
    const at::Scalar alpha = args[2].toScalar();
    if (!scalar_of(sub ? -alpha : alpha, &a)) return nullptr;  // ATen's sub: add with -alpha
    const auto other = list(1);
    for (size_t i = 0; i < len && ok; ++i) ok = fill(recs[i], kAdd, {&self[i], &self[i], &other[i]}, {a});
  } else if ((add || sub) && args.size() == 2 && numbers(1)) {
    for (size_t i = 0; i < len && ok; ++i) ok = fill(recs[i], kAddScalar, {&self[i], &self[i]}, {values[i], sub ? -1.f : 1.f});
  } else if ((mul || div) && o == "List" && args.size() == 2) {
    const auto other = list(1);
    for (size_t i = 0; i < len && ok; ++i) ok = fill(recs[i], mul ? kMul : kDiv, {&self[i], &self[i], &other[i]}, {});
  } else if ((mul || div) && args.size() == 2 && numbers(1)) {
    for (size_t i = 0; i < len && ok; ++i) ok = fill(recs[i], mul ? kMulScalar : kDivScalar, {&self[i], &self[i]}, {values[i]});
  } else if ((op == "addcmul_" || op == "addcdiv_") && args.size() == 4 && numbers(3)) {
    const auto t1 = list(1), t2 = list(2);
    const Kind kind = op == "addcmul_" ? kAddcmul : kAddcdiv;
    for (size_t i = 0; i < len && ok; ++i) {
      ok = fill(recs[i], kind, {&self[i], &self[i], &t1[i], &t2[i]}, {values[i]});
    }
  } else if (op == "lerp_" && o == "Scalar" && args.size() == 3 && numbers(2)) {
    const auto end = list(1);
    for (size_t i = 0; i < len && ok; ++i) ok = fill(recs[i], kLerpScalar, {&self[i], &self[i], &end[i]}, {values[i]});
  } else if (op == "sqrt_" && o.empty() && args.size() == 1 && kSqrtFuses) {
    for (size_t i = 0; i < len && ok; ++i) ok = fill(recs[i], kSqrt, {&self[i], &self[i]}, {});
  } else {
    return nullptr;
  }
  if (!ok) return nullptr;
  recs[0].count = static_cast<uint32_t>(len);
  recs[0].boxed = &name;
  recs[0].list = true;
  return recs;
}

py::object& compiler() {
  static py::object* mod = new py::object(py::module::import("torchneuron.compile.eager_fusion"));
  return *mod;
}

// One group of a region: the kernels over buffers of one element count, in queue order.
struct Group {
  int64_t numel = 0;
  c10::SmallVector<void*, 16> buffers;
  std::string signature;  // [buffers][kind, slots...]...[kUnstored, slots...]
  c10::SmallVector<float, 16> scalars;
  c10::SmallVector<uint8_t, 16> written;   // slots some kernel writes
  c10::SmallVector<uint8_t, 4> unstored;  // ... whose final values nobody can read
  c10::SmallVector<c10::ScalarType, 16> dtypes;     // of each slot
  c10::SmallVector<uint8_t, 16> born;  // slots a kernel of the region writes before any reads them
  c10::SmallVector<uint8_t, 16> dead;  // ... whose memory a later buffer of the region took
  c10::SmallVector<uint8_t, 4> abs_in, abs_out;       // slots kAbs kernels read and write
  c10::SmallVector<uint8_t, 4> max_in;                // ... and kMaxAll kernels read
  c10::SmallVector<uint64_t, 16> owner;  // precompiled family: the allocation last written in each slot
  c10::SmallVector<const Record*, 8> step_records;    // of each step (redo)
  c10::SmallVector<tile_fusion::Step, 8> steps;     // the precompiled family's kernels
};

// The scalar remainder [begin, end) of one thread's range, op by op through ATen's own kernels
// (the calls the unfused kernels made: same overloads, Python numbers as wrapped doubles, which
// convert to the same floats).
void run_remainder(const Group& g, int64_t begin, int64_t end) {
  const int64_t len = end - begin;
  auto view = [&](uint8_t slot) {
    return at::from_blob(static_cast<float*>(g.buffers[slot]) + begin, {len},
                         at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  };
  auto number = [](float v) { return at::scalar_to_tensor(at::Scalar(static_cast<double>(v))); };
  for_each_op(g.signature, g.scalars.data(), [&](Kind kind, const uint8_t* slots, const float* s) {
    std::array<at::Tensor, 4> t;
    for (uint8_t i = 0; i < kArity[kind]; ++i) t[i] = view(slots[i]);
    at::Tensor wrapped;
    switch (kind) {
      case kAdd: at::cpu::add_out(t[0], t[1], t[2], static_cast<double>(s[0])); break;
      case kAddScalar:
        wrapped = number(s[0]);
        wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
        at::cpu::add_out(t[0], t[1], wrapped, static_cast<double>(s[1]));
        break;
      case kMul: at::cpu::mul_out(t[0], t[1], t[2]); break;
      case kMulScalar:
      case kDivScalar:
        wrapped = number(s[0]);
        wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
        if (kind == kMulScalar) at::cpu::mul_out(t[0], t[1], wrapped);
        else at::cpu::div_out(t[0], t[1], wrapped);
        break;
      case kDiv: at::cpu::div_out(t[0], t[1], t[2]); break;
      case kAddcmul: at::cpu::addcmul_out(t[0], t[1], t[2], t[3], static_cast<double>(s[0])); break;
      case kAddcdiv: at::cpu::addcdiv_out(t[0], t[1], t[2], t[3], static_cast<double>(s[0])); break;
      case kLerpScalar: at::cpu::lerp_out(t[0], t[1], t[2], static_cast<double>(s[0])); break;
      case kSqrt: at::cpu::sqrt_out(t[0], t[1]); break;
      case kWiden:
      case kNarrow:
      case kScale:
      case kClamp:
      case kAbs:
      case kMaxAll:
      case kWidenInt8:
      case kToBf16:
      case kMatmul:
      case kMulCols: break;  // (the other families leave no remainders)
    }
  });
}

// A group by its generated kernel, or (null) by the interpreted one (fusion_interpreter.h).
void run_group(KernelFn kernel, const Group& g) {
  c10::SmallVector<int64_t, 16> remainders(2 * static_cast<size_t>(at::get_num_threads()) + 2, 0);
  if (kernel != nullptr) {
    kernel(const_cast<void* const*>(g.buffers.data()), g.scalars.data(), g.numel, remainders.data());
  } else {
    fusion_interpreter::run(g.signature, reinterpret_cast<float* const*>(g.buffers.data()), g.scalars.data(), g.numel,
                            remainders.data());
  }
  for (size_t t = 0; t + 1 < remainders.size(); t += 2) {
    if (remainders[t + 1] > remainders[t]) run_remainder(g, remainders[t], remainders[t + 1]);
  }
}

}  // namespace

namespace detail {
// Off by default until it wins on bench/engine.py (docs/benchmarks.md, Execution engine).
bool g_on = env_flag("TORCH_NEURONX_ENABLE_CONCATENATION", false);
// On unless TORCH_NEURONX_ENABLE_CONCATENATION=0: it compiles nothing, and a fused group only
// saves memory passes (docs/benchmarks.md, torchao's float8 casts).
bool g_tiles = env_flag("TORCH_NEURONX_ENABLE_CONCATENATION", true);
}

namespace {
neuron::rt::engine::Decision fuse(const std::vector<const void*>& records, const std::vector<uint64_t>& seqs);
void flush();
}  // namespace
void install_fuser() noexcept;

// The engine asks the fuser only while fusion is on: off, no queued kernel pays for looking.
void install_fuser() noexcept {
  if (detail::g_on || detail::g_tiles) neuron::rt::engine::set_fuser(&fuse, &flush);
  else neuron::rt::engine::set_fuser(nullptr, nullptr);
}

void set_enabled(bool on) noexcept {
  detail::g_on = on;
  install_fuser();
}

void set_tiles_enabled(bool on) noexcept {
  detail::g_tiles = on;
  install_fuser();
}

bool lists_enabled() noexcept {
  return enabled() || (detail::g_tiles && fusion_interpreter::available());
}

neuron::rt::engine::Record binary(const char* name, const at::Tensor& out, const at::Tensor& self,
                                  const at::Tensor& other, const at::Scalar* alpha) {
  // name is "aten::<op>.Tensor" or "aten::<op>_.Tensor": the op is the letters after "aten::".
  const char* op = name + 6;
  const bool add = std::strncmp(op, "add", 3) == 0, sub = std::strncmp(op, "sub", 3) == 0;
  const bool mul = std::strncmp(op, "mul", 3) == 0, div = std::strncmp(op, "div", 3) == 0;
  float a = 1.f, s = 0.f;
  if (add || sub) {
    // ATen's sub is add with -alpha (negated as a Scalar, then read as float).
    if (alpha != nullptr && !scalar_of(sub ? -*alpha : *alpha, &a)) return nullptr;
    if (alpha == nullptr && sub) a = -1.f;
    if (is_number(other)) return scalar_of(other, &s) ? make(kAddScalar, {&out, &self}, {s, a}, name) : nullptr;
    return make(kAdd, {&out, &self, &other}, {a}, name);
  }
  if (mul || div) {
    if (is_number(other)) {
      return scalar_of(other, &s) ? make(mul ? kMulScalar : kDivScalar, {&out, &self}, {s}, name) : nullptr;
    }
    return make(mul ? kMul : kDiv, {&out, &self, &other}, {}, name);
  }
  return nullptr;
}

neuron::rt::engine::Record sqrt(const char* name, const at::Tensor& out, const at::Tensor& self) {
  return kSqrtFuses ? make(kSqrt, {&out, &self}, {}, name) : nullptr;
}

neuron::rt::engine::Record list_sqrt(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& self,
                                     const char* name) {
  const size_t len = self.size();
  if (!kSqrtFuses || len == 0 || outs.size() != len) return nullptr;
  std::shared_ptr<Record[]> recs(new Record[len]);
  for (size_t i = 0; i < len; ++i) {
    if (!fill(recs[i], kSqrt, {&outs[i], &self[i]}, {})) return nullptr;
  }
  recs[0].count = static_cast<uint32_t>(len);
  recs[0].hot = name;
  recs[0].list = true;
  return recs;
}

namespace {
// An operand of the precompiled family: a neuron tensor of `dtype` with like's sizes and
// strides, non-overlapping and dense, so that the i-th element in memory of one is the i-th of
// the others (the order ATen's iterator walks them in, and the fused kernel's).
bool dense_like(const at::Tensor& t, const at::Tensor& like, c10::ScalarType dtype) {
  return t.defined() && t.is_privateuseone() && t.device() == like.device() && t.scalar_type() == dtype &&
         t.layout() == c10::kStrided && t.sizes().equals(like.sizes()) && t.strides().equals(like.strides()) &&
         t.is_non_overlapping_and_dense() && !t.is_conj() && !t.is_neg() && t.const_data_ptr() != nullptr;
}

// A record of `kind` over `numel` elements on t's device, for the op named `hot`.
std::shared_ptr<Record> new_record(Kind kind, const at::Tensor& t, int64_t numel, const char* hot) {
  auto r = std::make_shared<Record>();
  r->kind = kind;
  r->numel = numel;
  r->device = t.get_device();
  r->hot = hot;
  return r;
}

std::shared_ptr<Record> tiled(Kind kind, const at::Tensor& out, c10::ScalarType out_type, const at::Tensor& self,
                              c10::ScalarType self_type, const char* hot) {
  if (!out.defined() || out.numel() < min_fused_numel() || !dense_like(self, self, self_type) ||
      !dense_like(out, self, out_type)) {
    return nullptr;
  }
  auto r = new_record(kind, out, out.numel(), hot);
  r->ptr[0] = const_cast<void*>(out.const_data_ptr());
  r->ptr[1] = const_cast<void*>(self.const_data_ptr());
  r->dtype[0] = out_type;
  r->dtype[1] = self_type;
  r->out_stamp = allocation_stamp(out.storage().data_ptr());
  return r;
}

void keep_geometry(Record& r, const at::Tensor& t) {
  r.geometry.assign(t.sizes().begin(), t.sizes().end());
  r.geometry.append(t.strides().begin(), t.strides().end());
}

// A clamp bound as ATen's float kernel reads it (Scalar::to<float>), if it is a real number in
// float's range (a checked conversion would raise) and not NaN.
bool bound_of(const std::optional<at::Scalar>& s, float* out) {
  if (!s.has_value() || s->isComplex() || s->isSymbolic()) return false;
  const double v = s->toDouble();
  if (!(std::abs(v) <= static_cast<double>(std::numeric_limits<float>::max()))) return false;
  *out = s->to<float>();
  return true;
}
}  // namespace

neuron::rt::engine::Record cast(const at::Tensor& out, const at::Tensor& self) {
  static constexpr char kCopy[] = "Memcpy DtoD";  // the queued copy's name (ops.cpp)
  const auto from = self.scalar_type(), to = out.scalar_type();
  if (from == at::kBFloat16 && to == at::kFloat) return tiled(kWiden, out, to, self, from, kCopy);
  if (from == at::kFloat && fp8::is_fp8(to)) return tiled(kNarrow, out, to, self, from, kCopy);
  // (amx_gemm::widen_int8 widens through AVX512-FP16: on every AMX host, and nowhere else needed)
  if (from == at::kChar && to == at::kBFloat16 && cpu_features::avx512fp16()) {
    return tiled(kWidenInt8, out, to, self, from, kCopy);
  }
  if (from == at::kFloat && to == at::kBFloat16) {
    auto r = tiled(kToBf16, out, to, self, from, kCopy);
    if (r != nullptr) keep_geometry(*r, self);
    return r;
  }
  return nullptr;
}

neuron::rt::engine::Record scale(const char* name, const at::Tensor& out, const at::Tensor& self,
                                 const at::Tensor& other) {
  const bool swap = self.dim() == 0 && other.dim() != 0;
  const at::Tensor& big = swap ? other : self;
  const at::Tensor& factor = swap ? self : other;
  if (factor.dim() != 0 || !factor.is_privateuseone() || factor.device() != big.device() ||
      factor.scalar_type() != at::kFloat || factor.is_conj() || factor.is_neg() || factor.const_data_ptr() == nullptr ||
      factor.unsafeGetTensorImpl()->is_wrapped_number()) {
    return nullptr;
  }
  auto r = tiled(kScale, out, at::kFloat, big, at::kFloat, name);
  if (r != nullptr) r->value = static_cast<const float*>(factor.const_data_ptr());
  return r;
}

neuron::rt::engine::Record clamp(const char* name, const at::Tensor& out, const at::Tensor& self,
                                 const std::optional<at::Scalar>& lo, const std::optional<at::Scalar>& hi) {
  float l = 0.f, h = 0.f;
  if (!bound_of(lo, &l) || !bound_of(hi, &h)) return nullptr;
  auto r = tiled(kClamp, out, at::kFloat, self, at::kFloat, name);
  if (r != nullptr) r->scalar = {l, h};
  return r;
}

namespace {
bool abs_dtype(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat; }
}  // namespace

neuron::rt::engine::Record abs(const at::Tensor& out, const at::Tensor& self) {
  static constexpr char kAbs[] = "aten::abs";
  if (!abs_dtype(self)) return nullptr;
  auto r = tiled(fusion::kAbs, out, self.scalar_type(), self, self.scalar_type(), kAbs);
  if (r != nullptr) keep_geometry(*r, self);
  return r;
}

neuron::rt::engine::Record max_all(const at::Tensor& out, const at::Tensor& self) {
  static constexpr char kMax[] = "aten::max";
  if (!abs_dtype(self) || out.dim() != 0 || out.scalar_type() != self.scalar_type() || !out.is_privateuseone() ||
      self.numel() < min_fused_numel() || !dense_like(self, self, self.scalar_type())) {
    return nullptr;
  }
  auto r = new_record(kMaxAll, self, self.numel(), kMax);
  r->ptr[0] = const_cast<void*>(self.const_data_ptr());
  r->dtype[0] = self.scalar_type();
  r->result = out.mutable_data_ptr();
  keep_geometry(*r, self);
  return r;
}

neuron::rt::engine::Record matmul(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                                  MatmulKernel kernel, const at::Tensor& arena) {
  static constexpr char kMm[] = "aten::mm";
  if (!out.is_contiguous() || out.scalar_type() != at::kBFloat16 || a.stride(1) != 1 || b.stride(0) != 1) {
    return nullptr;
  }
  auto r = new_record(kMatmul, out, out.numel(), kMm);
  // (ptr[3]: the queued call's arena, device memory that later kernels reuse only after it)
  r->ptr = {out.mutable_data_ptr(), const_cast<void*>(a.const_data_ptr()), const_cast<void*>(b.const_data_ptr()),
            arena.defined() ? arena.data_ptr() : nullptr};
  r->dtype = {at::kBFloat16, at::kBFloat16, at::kBFloat16, at::kBFloat16};
  r->geometry = {a.size(0),   b.size(1),   a.size(1), a.stride(0), b.stride(1), static_cast<int64_t>(kernel),
                 arena.defined() ? static_cast<int64_t>(arena.nbytes()) : 0};
  r->out_stamp = allocation_stamp(out.storage().data_ptr());
  return r;
}

neuron::rt::engine::Record col_scale(const char* name, const at::Tensor& out, const at::Tensor& self,
                                     const at::Tensor& other) {
  const bool first = self.dim() < other.dim();  // v * x
  const at::Tensor& x = first ? other : self;
  const at::Tensor& v = first ? self : other;
  auto bf16 = [&](const at::Tensor& t) {
    return t.defined() && t.is_privateuseone() && t.device() == x.device() && t.scalar_type() == at::kBFloat16 &&
           t.layout() == c10::kStrided && !t.is_conj() && !t.is_neg() && t.const_data_ptr() != nullptr;
  };
  if (x.dim() != 2 || !bf16(x) || !bf16(v) || !bf16(out) || !x.is_contiguous() || !out.is_contiguous() ||
      !out.sizes().equals(x.sizes()) || v.numel() != x.size(1) || v.dim() < 1 || v.dim() > 2 ||
      v.size(-1) != x.size(1) || v.stride(-1) != 1 || x.numel() == 0) {
    return nullptr;
  }
  auto r = new_record(kMulCols, x, x.numel(), name);
  r->ptr = {out.mutable_data_ptr(), const_cast<void*>(x.const_data_ptr()), const_cast<void*>(v.const_data_ptr()), nullptr};
  r->dtype = {at::kBFloat16, at::kBFloat16, at::kBFloat16, at::kBFloat16};
  keep_geometry(*r, v);
  r->out_stamp = allocation_stamp(out.storage().data_ptr());
  return r;
}

neuron::rt::engine::Record boxed(const c10::OperatorHandle& op, const torch::jit::Stack& args) {
  const auto& name = op.schema().operator_name();
  if (name.name.size() < 8) return nullptr;
  if (name.name.rfind("aten::_foreach_", 0) == 0) return list_records(name, args);
  const std::string& n = name.name;
  const std::string& o = name.overload_name;
  auto tensor = [&](size_t i) -> const at::Tensor& { return args.at(i).toTensor(); };
  auto value = [&](size_t i, float* out) { return scalar_of(args.at(i), out); };
  float v = 0.f;
  if ((n == "aten::addcmul_" || n == "aten::addcdiv_") && o.empty() && args.size() == 4 && value(3, &v)) {
    return make(n == "aten::addcmul_" ? kAddcmul : kAddcdiv, {&tensor(0), &tensor(0), &tensor(1), &tensor(2)}, {v}, nullptr, &name);
  }
  if ((n == "aten::addcmul" || n == "aten::addcdiv") && o == "out" && args.size() == 5 && value(3, &v)) {
    return make(n == "aten::addcmul" ? kAddcmul : kAddcdiv, {&tensor(4), &tensor(0), &tensor(1), &tensor(2)}, {v}, nullptr, &name);
  }
  if (n == "aten::lerp_" && o == "Scalar" && args.size() == 3 && value(2, &v)) {
    return make(kLerpScalar, {&tensor(0), &tensor(0), &tensor(1)}, {v}, nullptr, &name);
  }
  if (n == "aten::lerp" && o == "Scalar_out" && args.size() == 4 && value(2, &v)) {
    return make(kLerpScalar, {&tensor(3), &tensor(0), &tensor(1)}, {v}, nullptr, &name);
  }
  return nullptr;
}

namespace {

// Counts the ops of the first n records as executed (a fused kernel still ran them).
void track_records(const std::vector<const void*>& records, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const Record& r = *static_cast<const Record*>(records[i]);
    if (r.hot != nullptr) track_hot(r.hot);
    else if (r.boxed != nullptr) track_fallback(*r.boxed);
  }
}

// Bytes [begin, end).
struct Span {
  uintptr_t begin, end;
  bool meets(const Span& o) const { return begin < o.end && o.begin < end; }
};
Span span(uintptr_t begin, size_t bytes) { return {begin, begin + bytes}; }
Span span(const void* p, int64_t bytes) { return span(reinterpret_cast<uintptr_t>(p), static_cast<size_t>(bytes)); }

// A record's geometry as sizes then strides (kAbs, kMaxAll, kToBf16, kMulCols).
at::IntArrayRef sizes_of(const Record& r) {
  return at::IntArrayRef(r.geometry.data(), static_cast<std::ptrdiff_t>(r.geometry.size() / 2));
}
at::IntArrayRef strides_of(const Record& r) {
  const auto rank = static_cast<std::ptrdiff_t>(r.geometry.size() / 2);
  return at::IntArrayRef(r.geometry.data() + rank, rank);
}
// A CPU view of `t`-typed bytes at p in the record's geometry.
at::Tensor view_of(void* p, const Record& r, c10::ScalarType t) {
  return at::from_blob(p, sizes_of(r), strides_of(r), at::TensorOptions().dtype(t));
}

// A region of the precompiled family: each group through tile_fusion::run, at once.
template <class Groups>
neuron::rt::engine::Decision run_tiled(const Groups& groups, const std::vector<const void*>& records, size_t n) {
  try {
    for (size_t g = 0; g < groups.size(); ++g) {
      if (static_cast<int>(g) == g_fail_after.load(std::memory_order_relaxed)) {
        g_fail_after.store(-1);
        throw std::runtime_error("injected fault after " + std::to_string(g) + " groups (fusion::fail_after)");
      }
      const Group& grp = groups[g];
      c10::SmallVector<tile_fusion::Slot, 16> slots;
      for (size_t s = 0; s < grp.buffers.size(); ++s) {
        const bool stored = std::find(grp.unstored.begin(), grp.unstored.end(), s) == grp.unstored.end();
        slots.push_back({grp.buffers[s], grp.dtypes[s], stored});
      }
      c10::SmallVector<bool, 8> redo_flags(grp.steps.size(), false);
      bool* redo = redo_flags.data();
      tile_fusion::run(grp.steps.data(), grp.steps.size(), slots.data(), slots.size(), grp.numel, redo);
      // Abs and max steps whose bits depend on ATen's path (a NaN; a zero max): ATen's kernels
      // over the inputs, which nothing in the region wrote (add()'s kAbs rules).
      for (size_t i = 0; i < grp.steps.size(); ++i) {
        if (!redo[i]) continue;
        const tile_fusion::Step& st = grp.steps[i];
        const Record& rec = *grp.step_records[i];
        auto view = [&](uint8_t slot) { return view_of(grp.buffers[slot], rec, grp.dtypes[slot]); };
        if (st.op == tile_fusion::Op::Abs) {
          if (slots[st.out].stored) {
            at::Tensor o = view(st.out);
            at::cpu::abs_out(o, view(st.in));
          }
          continue;
        }
        // A max: of the abs that wrote its input (stored: now ATen's; else recomputed), or of memory.
        int producer = -1;
        for (size_t j = 0; j < i; ++j) {
          if (grp.steps[j].op == tile_fusion::Op::Abs && grp.steps[j].out == st.in) producer = static_cast<int>(j);
        }
        at::Tensor input;
        if (producer >= 0 && !slots[st.in].stored) {  // as the unfused abs: same layout, ATen's kernel
          input = at::empty_strided(sizes_of(rec), strides_of(rec), at::TensorOptions().dtype(grp.dtypes[st.in]));
          at::cpu::abs_out(input, view(grp.steps[producer].in));
        } else {
          input = view(st.in);
        }
        const at::Tensor m = extrema::max_all(input);
        std::memcpy(st.result, m.const_data_ptr(), m.element_size());
      }
    }
  } catch (const std::exception& ex) {
    return {n, 0, error_text(ex)};
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_stats.tiled += groups.size();
  }
  track_records(records, n);
  return {n, 0, {}};
}

// ---- The GEMM family ---------------------------------------------------------------------
// torchao's weight-only int8 linear is `mm(x, w_int8.t().to(bf16)) * scale.to(bf16)`: a widened
// copy of the weight (twice its bytes, written then read once), the product, and a pass over
// the result. A region [widen?, matmul, cast?, mul?] runs as one call of the kernel the matmul
// was queued with (fusion::MatmulKernel: amx_gemm.h's on AMX hosts; where bf16 runs at half rate
// gemv.h's matrix-vector and few-row kernels, up to 16 rows, or the routed kernel's exact fp32
// copies, from 64). The kernel widens the int8 weight itself (the values the copy would write:
// into its L1 staging, amx_gemm::widen_int8; in registers; into its fp32 copy), and its epilogue
// rounds each sum to bf16, multiplies it by the column's bf16 value in fp32 and rounds again
// (bf16_gemm.h, Output::post_scale; gemv::round_scale_bf16), which is ATen's bf16 mul of the
// rounded product element by element. The unfused matmul runs the same kernel in the same order
// (gemm.cpp), so the bits are the unfused kernels', up to NaN: ATen's mul writes a NaN as
// 0xFFFF on its vector path and 0x7FC0 on its scalar tail, so a result with a NaN redoes the
// mul through ATen over the product recomputed unscaled. Taken only when the widened weight and
// the product are unstored (freed by the region's end: allocator.h, freed_by), else the kernels
// run unfused; the vector's cast runs through the queued copy's own calls.
neuron::rt::engine::Decision fuse_gemm(const std::vector<const void*>& records, const std::vector<uint64_t>& seqs) {
  if (!detail::g_tiles) return {0, 1, {}};
  auto rec = [&](size_t i) { return i < records.size() ? static_cast<const Record*>(records[i]) : nullptr; };
  auto is = [&](size_t i, Kind k) { return rec(i) != nullptr && rec(i)->count == 1 && rec(i)->kind == k; };
  size_t i = 0;
  const Record* widen = is(0, kWidenInt8) ? rec(i++) : nullptr;
  if (!is(i, kMatmul)) return {0, 1, {}};
  const Record* mm = rec(i++);
  const int64_t m = mm->geometry[0], n = mm->geometry[1], k = mm->geometry[2];
  // The weight the product reads is the widened copy, every element of it (a dense k x n
  // column-major matrix, the int8 source in the same layout).
  if (widen != nullptr && (widen->ptr[0] != mm->ptr[2] || widen->numel != k * n || mm->geometry[4] != k)) {
    return {0, 1, {}};
  }
  if (widen != nullptr && !freed_by(widen->out_stamp.generation, seqs[i - 1])) return {0, 1, {}};
  const Record* cast = nullptr;
  const Record* mul = nullptr;
  const size_t after_mm = i;
  const Record* c = is(i, kToBf16) ? rec(i) : nullptr;
  const size_t at_mul = c != nullptr ? i + 1 : i;
  if (is(at_mul, kMulCols) && rec(at_mul)->ptr[1] == mm->ptr[0] && rec(at_mul)->numel == m * n &&
      (c == nullptr || (rec(at_mul)->ptr[2] == c->ptr[0] && c->numel == n)) &&
      freed_by(mm->out_stamp.generation, seqs[at_mul])) {
    cast = c;
    mul = rec(at_mul);
    i = at_mul + 1;
  }
  if (i < 2) return {0, 1, {}};
  // What the region writes to memory (the vector's cast, the mul's result) meets nothing it reads.
  const Span a = span(mm->ptr[1], ((m - 1) * mm->geometry[3] + k) * 2);
  const Span b = widen != nullptr ? span(widen->ptr[1], k * n) : span(mm->ptr[2], ((n - 1) * mm->geometry[4] + k) * 2);
  c10::SmallVector<Span, 4> reads{a, b};
  // (the routed kernel's scratch, which later allocations of the region may take)
  if (mm->ptr[3] != nullptr) reads.push_back(span(mm->ptr[3], mm->geometry[6]));
  c10::SmallVector<Span, 2> writes;
  if (cast != nullptr) {
    reads.push_back(span(cast->ptr[1], n * 4));
    writes.push_back(span(cast->ptr[0], n * 2));
  }
  if (mul != nullptr) {
    if (cast == nullptr) reads.push_back(span(mul->ptr[2], n * 2));
    writes.push_back(span(mul->ptr[0], m * n * 2));
  }
  for (const Span& w : writes) {
    for (const Span& r : reads) {
      if (w.meets(r)) {
        i = after_mm;  // the widened product alone, if there is one
        break;
      }
    }
  }
  const auto kernel = static_cast<MatmulKernel>(mm->geometry[5]);
  if (i == after_mm) {
    cast = mul = nullptr;
    if (widen == nullptr) return {0, 1, {}};
  }
  try {
    if (cast != nullptr) {  // as the queued copy runs it (ops.cpp, queued_copy)
      at::Tensor src = view_of(cast->ptr[1], *cast, at::kFloat);
      at::Tensor dst = view_of(cast->ptr[0], *cast, at::kBFloat16);
      if (!fast_copy(dst, src)) dst.copy_(src);
    }
    std::vector<float> post;
    if (mul != nullptr) {
      const auto* v = static_cast<const uint16_t*>(mul->ptr[2]);
      post.resize(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) post[j] = c10::detail::f32_from_bits(v[j]);
    }
    const bf16_gemm::Matrix ma{mm->ptr[1], mm->geometry[3], false, nullptr};
    const bf16_gemm::Matrix mb = widen != nullptr ? bf16_gemm::Matrix{widen->ptr[1], k, true, amx_gemm::widen_int8}
                                                  : bf16_gemm::Matrix{mm->ptr[2], mm->geometry[4], true, nullptr};
    // The unfused matmul's kernel: the same sums in the same order, so the same bits.
    // out (bf16, leading dimension n) = the product, then times `scale` per column; false if NaN
    // (the operands as tensors, for the kernels that take them: A, and the weight W = B.t(), n x k)
    const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
    const at::Tensor ta = at::from_blob(const_cast<void*>(ma.p), {m, k}, {ma.ld, 1}, bf16);
    const at::Tensor tw = at::from_blob(const_cast<void*>(mb.p), {n, k}, {mb.ld, 1},
                                        widen != nullptr ? at::TensorOptions().dtype(at::kChar) : bf16);
    auto product = [&](void* dst, const float* scale) {
      if (kernel == MatmulKernel::kRouted) {
        // gemm::half_product's fp32 GEMM over exact copies (an int8 weight's is the bf16 one's),
        // in the queued call's arena; rounded by ATen's copy alone, else by the epilogue (which
        // rounds as that copy does, NaN aside: a NaN result is redone)
        ZeroCopy zc(ZeroCopy::Queued{});
        if (mm->ptr[3] != nullptr) {
          zc.set_scratch_arena(at::from_blob(mm->ptr[3], {mm->geometry[6]}, at::TensorOptions().dtype(at::kByte)));
        }
        if (scale == nullptr) {
          gemm::half_product(zc, at::from_blob(dst, {m, n}, bf16), ta, tw.t(), nullptr, 0.0f, 1.0f);
          return true;
        }
        const at::Tensor acc = gemm::half_sums(zc, {m, n}, ta, tw.t(), nullptr, 0.0f, 1.0f);
        return gemv::round_scale_bf16(acc.const_data_ptr<float>(), m, n, scale, static_cast<uint16_t*>(dst));
      }
      if (kernel == MatmulKernel::kFewRows) {
        return gemv::few_rows_bf16(at::from_blob(dst, {m, n}, bf16), ta, tw, scale);
      }
      std::atomic<bool> nan{false};
      bf16_gemm::Output out;
      out.bf16 = static_cast<uint16_t*>(dst);
      out.ld = n;
      if (scale != nullptr) {
        out.post_scale = scale;
        out.nan = &nan;
      }
      amx_gemm::gemm(m, n, k, ma, mb, out);
      return !nan.load();
    };
    const bool finite = product(mul != nullptr ? mul->ptr[0] : mm->ptr[0], mul != nullptr ? post.data() : nullptr);
    if (!finite) {  // the product unscaled into a temporary, then ATen's mul as unfused
      at::Tensor prod = at::empty_strided({m, n}, {n, 1}, at::TensorOptions().dtype(at::kBFloat16));
      product(prod.data_ptr(), nullptr);
      at::Tensor v = view_of(mul->ptr[2], *mul, at::kBFloat16);
      at::Tensor y = at::from_blob(mul->ptr[0], {m, n}, at::TensorOptions().dtype(at::kBFloat16));
      at::cpu::mul_out(y, prod, v);  // (bf16 products are commutative, NaN's bits included)
    }
  } catch (const std::exception& ex) {
    return {i, 0, error_text(ex)};
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    ++g_stats.gemm;
  }
  track_records(records, i);
  return {i, 0, {}};
}

// The engine's fuser (engine.h): split the offered run into groups, and run them fused if every
// group's kernel is compiled.
neuron::rt::engine::Decision fuse(const std::vector<const void*>& records, const std::vector<uint64_t>& seqs) {
  if (at::globalContext().deterministicAlgorithms()) return {0, records.size(), {}};
  if (is_gemm(static_cast<const Record*>(records[0])->kind)) return fuse_gemm(records, seqs);
  // Buffers seen so far, by first byte: [begin, end) and (group, slot).
  struct Buf {
    uintptr_t end;
    uint32_t group;
    uint32_t slot;
    uint64_t last;  // the last kernel of the region using it
  };
  std::map<uintptr_t, Buf> bufs;
  c10::SmallVector<Group, 4> groups;
  // A region is of one family: the generated kernels' or the precompiled one's.
  const bool tiles = is_tiled(static_cast<const Record*>(records[0])->kind);
  // (A graph capture records both families whatever is on: only the families on fuse.) With
  // the generated kernels off, the interpreted kernel takes foreach list kernels (fusion.h);
  // with them on, a group whose kernel is not compiled runs unfused, as before.
  const bool interpret = !tiles && !detail::g_on && detail::g_tiles && fusion_interpreter::available();
  if (!(tiles ? detail::g_tiles : detail::g_on || interpret)) return {0, 1, {}};
  // The 0-dim values the region's kernels use: the factors its kScale kernels read (when the
  // group runs, before its pass) and the results its kMaxAll kernels write (after it). No kernel
  // of the region may write a factor or a result's memory; two kScale kernels may read one factor.
  struct Value {
    uintptr_t at;
    bool written;  // a result (else a factor)
  };
  c10::SmallVector<Value, 4> values;
  // Adds one record to the region; false (and nothing changed) if it must end before it.
  auto add = [&](const Record& r, uint64_t seq) {
    if (is_gemm(r.kind) || is_tiled(r.kind) != tiles) return false;
    uint32_t g = 0;
    while (g < groups.size() && groups[g].numel != r.numel) ++g;
    const bool new_group = g == groups.size();
    const size_t nbufs = new_group ? 0 : groups[g].buffers.size();
    // Slots of this kernel's buffers; a buffer partially overlapping one seen before (or seen
    // with another element count) ends the region here.
    std::array<uint32_t, 4> slots{};
    struct Fresh {
      void* ptr;
      size_t bytes;
      c10::ScalarType dtype;
      bool born;
    };
    c10::SmallVector<Fresh, 4> fresh;
    c10::SmallVector<uintptr_t, 4> kill;  // buffers seen before whose memory this kernel's output took
    c10::SmallVector<uintptr_t, 4> used;  // buffers seen before that this kernel uses
    bool conflict = false;
    // The buffers seen before that [begin, begin + bytes) meets (they never overlap each other).
    auto seen_meeting = [&](uintptr_t begin, size_t bytes) {
      c10::SmallVector<uintptr_t, 4> hits;
      auto it = bufs.lower_bound(begin);
      if (it != bufs.begin() && std::prev(it)->second.end > begin) --it;
      for (; it != bufs.end() && it->first < begin + bytes; ++it) {
        if (it->second.end > begin) hits.push_back(it->first);
      }
      return hits;
    };
    // Whether the output of this kernel may take the memory of `hits`: the precompiled family
    // only, an output it does not also read, whose memory the allocator handed out after every
    // kernel using them was enqueued. Their memory was allocated before their first kernel, so
    // it is another allocation, freed before this one: they are dead (nothing after this kernel
    // reads them) and, written by the region before any read (born), never need storing (they
    // stay in the tiles), so this output's writes clobber nothing still to be read. (A view of
    // the same allocation was allocated before their first kernel: it never passes.)
    const bool writes = r.kind != kMaxAll;  // ptr[0] is its output
    auto may_take = [&](uint8_t i, const c10::SmallVector<uintptr_t, 4>& hits) {
      if (!tiles || i != 0 || !writes || r.out_stamp.allocated_at == 0) return false;
      for (uint8_t j = 1; j < kArity[r.kind]; ++j) {
        if (r.ptr[j] == r.ptr[0]) return false;
      }
      return std::all_of(hits.begin(), hits.end(), [&](uintptr_t h) {
        const Buf& b = bufs.at(h);
        const Group& hg = groups[b.group];  // (an abs input is read again by a redo)
        return r.out_stamp.allocated_at >= b.last && hg.born[b.slot] &&
               std::find(hg.abs_in.begin(), hg.abs_in.end(), b.slot) == hg.abs_in.end();
      });
    };
    // Whether `here` meets another fresh buffer of this kernel (buffers seen before: seen_meeting).
    auto meets_fresh = [&](const Span& here) {
      return std::any_of(fresh.begin(), fresh.end(), [&](const Fresh& f) {
        return here.meets(span(reinterpret_cast<uintptr_t>(f.ptr), f.bytes));
      });
    };
    // Whether [begin, begin + bytes) meets another fresh buffer of this kernel or a 0-dim value
    // of the region (a factor or a result).
    auto overlaps = [&](uintptr_t begin, size_t bytes) {
      const Span here = span(begin, bytes);
      const auto meets = [&](const Value& v) { return here.meets(span(v.at, sizeof(float))); };
      return std::any_of(values.begin(), values.end(), meets) || meets_fresh(here);
    };
    for (uint8_t i = 0; i < kArity[r.kind] && !conflict; ++i) {
      const auto begin = reinterpret_cast<uintptr_t>(r.ptr[i]);
      const size_t bytes = static_cast<size_t>(r.numel) * c10::elementSize(r.dtype[i]);
      auto it = bufs.find(begin);
      if (it != bufs.end() && it->second.group == g && it->second.end == begin + bytes &&
          groups[g].dtypes[it->second.slot] == r.dtype[i]) {
        slots[i] = it->second.slot;
        used.push_back(begin);
        continue;
      }
      const auto same = std::find_if(fresh.begin(), fresh.end(), [&](const Fresh& f) { return f.ptr == r.ptr[i]; });
      if (same != fresh.end()) {
        conflict = same->bytes != bytes || same->dtype != r.dtype[i];
        slots[i] = static_cast<uint32_t>(nbufs + (same - fresh.begin()));
        continue;
      }
      // A buffer partially overlapping one seen before (or seen with another element count or
      // dtype) ends the region, unless its memory is dead buffers' (may_take).
      const auto hits = seen_meeting(begin, bytes);
      if (!hits.empty()) {
        conflict = !may_take(i, hits);
        kill.append(hits.begin(), hits.end());
      }
      conflict = conflict || overlaps(begin, bytes);
      slots[i] = static_cast<uint32_t>(nbufs + fresh.size());
      const bool born = i == 0 && writes && std::none_of(r.ptr.begin() + 1, r.ptr.begin() + kArity[r.kind],
                                               [&](void* p) { return p == r.ptr[0]; });
      fresh.push_back({r.ptr[i], bytes, r.dtype[i], born});
    }
    // A factor inside memory the region touches could change under it; a max's result is read
    // by nothing in the region (it is written after the group's pass). Groups run in the order
    // they were first seen, not in program order, so a result meeting any value seen before, or a
    // factor meeting a result, ends the region; a factor another kScale kernel reads is only read
    // twice (torchao with a static scale, one loss scale for many tensors).
    const void* scalar = r.value != nullptr ? static_cast<const void*>(r.value) : r.result;
    if (scalar != nullptr) {
      const auto v = reinterpret_cast<uintptr_t>(scalar);
      const Span here = span(v, sizeof(float));
      conflict = conflict || std::any_of(values.begin(), values.end(), [&](const Value& o) {
                   return here.meets(span(o.at, sizeof(float))) && (o.written || r.value == nullptr);
                 });
      conflict = conflict || meets_fresh(here) || !seen_meeting(v, sizeof(float)).empty();
    }
    // kAbs's and kMaxAll's rules (tile_fusion.h: a NaN or a zero max makes the group redo them
    // through ATen after its pass): they read memory nothing in the region writes before or
    // after them, or (a max) an abs's result, and only a max reads an abs's result, so that a
    // redo recomputes them from intact inputs and nothing else saw the bits it replaces.
    if (tiles && !conflict && !new_group) {
      const Group& gr = groups[g];
      auto in = [](const c10::SmallVector<uint8_t, 4>& set, uint32_t slot) {
        return std::find(set.begin(), set.end(), slot) != set.end();
      };
      const bool was_written = std::find(gr.written.begin(), gr.written.end(), slots[r.kind == kAbs ? 1 : 0]) != gr.written.end();
      if (r.kind == kAbs) conflict = was_written && slots[1] < nbufs;
      if (r.kind == kMaxAll) conflict = slots[0] < nbufs && was_written && !in(gr.abs_out, slots[0]);
      for (uint8_t i = writes ? 1 : 0; i < kArity[r.kind] && r.kind != kMaxAll; ++i) {
        conflict = conflict || (slots[i] < nbufs && in(gr.abs_out, slots[i]));
      }
      if (writes && slots[0] < nbufs) {
        conflict = conflict || in(gr.abs_in, slots[0]) || in(gr.abs_out, slots[0]) || in(gr.max_in, slots[0]);
      }
    }
    if (conflict || nbufs + fresh.size() > kMaxSlots) return false;
    if (scalar != nullptr) values.push_back({reinterpret_cast<uintptr_t>(scalar), r.value == nullptr});
    for (uintptr_t k : kill) {  // dead: never stored, and no longer found by address
      const Buf& b = bufs.at(k);
      groups[b.group].dead.push_back(static_cast<uint8_t>(b.slot));
      bufs.erase(k);
    }
    for (uintptr_t u : used) bufs.at(u).last = seq;
    if (new_group) {
      groups.emplace_back();
      groups.back().numel = r.numel;
    }
    Group& grp = groups[g];
    for (const Fresh& f : fresh) {
      const auto begin = reinterpret_cast<uintptr_t>(f.ptr);
      bufs.emplace(begin, Buf{begin + f.bytes, g, static_cast<uint32_t>(grp.buffers.size()), seq});
      grp.buffers.push_back(f.ptr);
      grp.dtypes.push_back(f.dtype);
      grp.born.push_back(f.born);
      grp.owner.push_back(0);
    }
    if (writes) grp.owner[slots[0]] = r.out_stamp.generation;
    if (writes && std::find(grp.written.begin(), grp.written.end(), slots[0]) == grp.written.end()) {
      grp.written.push_back(static_cast<uint8_t>(slots[0]));
    }
    grp.signature.push_back(static_cast<char>(r.kind));
    for (uint8_t i = 0; i < kArity[r.kind]; ++i) grp.signature.push_back(static_cast<char>(slots[i]));
    for (uint8_t i = 0; i < kScalars[r.kind]; ++i) grp.scalars.push_back(r.scalar[i]);
    if (tiles) {
      static constexpr tile_fusion::Op kOps[] = {tile_fusion::Op::Widen, tile_fusion::Op::Narrow,
                                                 tile_fusion::Op::Scale, tile_fusion::Op::Clamp,
                                                 tile_fusion::Op::Abs,   tile_fusion::Op::Max};
      const auto out = static_cast<uint8_t>(slots[0]), in = static_cast<uint8_t>(slots[writes ? 1 : 0]);
      tile_fusion::Step st{kOps[r.kind - kWiden], out, in};
      st.lo = r.scalar[0];
      st.hi = r.scalar[1];
      st.value = r.value;
      st.result = r.result;
      grp.steps.push_back(st);
      grp.step_records.push_back(&r);
      if (r.kind == kAbs) {
        grp.abs_in.push_back(in);
        grp.abs_out.push_back(out);
      }
      if (r.kind == kMaxAll) grp.max_in.push_back(in);
    }
    return true;
  };
  size_t n = 0, fused_records = 0;  // items, and the records they hold
  for (; n < records.size(); ++n) {
    const Record* r = static_cast<const Record*>(records[n]);
    if (!tiles && !detail::g_on && !r->list) break;
    if (r->count == 1) {
      if (!add(*r, seqs[n])) break;
      ++fused_records;
      continue;
    }
    // A list kernel joins whole or not at all: what its elements added to the groups is undone
    // if one cannot join (add() only appends, so the sizes before it suffice; the region ends
    // there, so `bufs` is not read again). Copying the groups and buffers for every list kernel
    // instead made the fuser quadratic in the region's size.
    struct Sizes {
      size_t buffers, signature, scalars, written;
    };
    c10::SmallVector<Sizes, 4> before;
    for (const Group& grp : groups) before.push_back({grp.buffers.size(), grp.signature.size(), grp.scalars.size(), grp.written.size()});
    uint32_t e = 0;
    while (e < r->count && add(r[e], seqs[n])) ++e;
    if (e < r->count) {
      groups.erase(groups.begin() + static_cast<std::ptrdiff_t>(before.size()), groups.end());
      for (size_t g = 0; g < before.size(); ++g) {
        groups[g].buffers.resize(before[g].buffers);
        groups[g].signature.resize(before[g].signature);
        groups[g].scalars.resize(before[g].scalars);
        groups[g].written.resize(before[g].written);
      }
      break;
    }
    fused_records += e;
  }
  if (fused_records < 2) return {0, 1, {}};
  // Intermediates that nothing references are not materialized. A buffer the region writes
  // whose memory the allocator holds as free, and freed before any kernel after the region was
  // enqueued, keeps its values in registers and is never stored: nothing can read them. Kernels
  // queued after the region hold raw aliases, not tensors, but only of tensors that were alive
  // when they were enqueued (a tensor argument outlives its op call), which this one was not;
  // anything else must write the memory before reading it. (The tensor was dropped while its
  // kernel was queued: `t = a + b; u = t * c; del t`.)
  {
    const uint64_t region_end = seqs[n - 1];
    for (Group& grp : groups) {
      for (uint8_t slot : grp.written) {
        const bool dead = std::find(grp.dead.begin(), grp.dead.end(), slot) != grp.dead.end();
        // Each record knows the allocation its output last held (Record::out_stamp): freed by
        // then, its memory may have been allocated again since. (Asking the allocator whether
        // the bytes are free walked a segment's blocks from its first: quadratic in the blocks
        // of an optimizer's many small tensors, 13 % of a 150-parameter step's time.)
        const bool freed = freed_by(grp.owner[slot], region_end);
        if (dead || freed) {
          grp.unstored.push_back(slot);
        }
      }
    }
  }
  if (tiles) return run_tiled(groups, records, n);

  c10::SmallVector<KernelFn, 4> kernels;
  for (Group& grp : groups) {
    grp.signature.insert(grp.signature.begin(), static_cast<char>(grp.buffers.size()));
    if (!grp.unstored.empty()) {
      grp.signature.push_back(kUnstored);
      for (uint8_t slot : grp.unstored) grp.signature.push_back(static_cast<char>(slot));
    }
  }
  if (!detail::g_on) {
    kernels.assign(groups.size(), nullptr);  // (interpret: the generated kernels are off)
  } else {
    std::lock_guard<std::mutex> lock(g_mu);
    for (Group& grp : groups) {
      Entry& e = (*g_cache)[grp.signature];
      kernels.push_back(e.fn);
      if (e.fn == nullptr && !e.failed && !e.requested && ++e.seen >= kCompileAfter) {
        e.requested = true;
        ++g_stats.requested;
        g_to_compile->push_back(grp.signature);
      }
    }
  }
  // A group whose kernel is not compiled runs interpreted if the generated kernels are off,
  // else the region runs unfused.
  size_t interpreted = 0;
  for (KernelFn k : kernels) {
    if (k == nullptr && !interpret) return {0, n, {}};
    interpreted += k == nullptr;
  }
  // From here the region counts as run: a failure part-way cannot be undone or retried.
  try {
    for (size_t g = 0; g < groups.size(); ++g) {
      if (static_cast<int>(g) == g_fail_after.load(std::memory_order_relaxed)) {
        g_fail_after.store(-1);
        throw std::runtime_error("injected fault after " + std::to_string(g) + " groups (fusion::fail_after)");
      }
      run_group(kernels[g], groups[g]);
    }
  } catch (const std::exception& ex) {
    return {n, 0, error_text(ex)};
  }
  if (interpreted > 0) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_stats.interpreted += interpreted;
  }
  track_records(records, n);
  return {n, 0, {}};
}

// After each run of the queue: the signatures that run asked for, compiled as one library (a
// compile is ~4 s of header parsing, whatever it holds).
void flush() {
  std::vector<std::string> sigs;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_to_compile->empty()) return;
    sigs.swap(*g_to_compile);
  }
  if (!Py_IsInitialized()) return;  // exiting: nothing more will run fused
  py::gil_scoped_acquire gil;
  py::list batch;
  for (const std::string& sig : sigs) batch.append(py::bytes(sig));
  compiler().attr("request")(batch);
}

const bool g_installed = [] {
  neuron::rt::engine::set_queue_limit(env_limit());
  install_fuser();
  return true;
}();

}  // namespace

void install(const std::string& signature, uintptr_t kernel) {
  std::lock_guard<std::mutex> lock(g_mu);
  Entry& e = (*g_cache)[signature];
  e.fn = reinterpret_cast<KernelFn>(kernel);
  e.failed = kernel == 0;
  ++(kernel == 0 ? g_stats.failed : g_stats.compiled);
}

void fail_after(int groups) noexcept { g_fail_after.store(groups); }

Stats stats() noexcept {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_stats;
}

}  // namespace torchneuron::fusion
