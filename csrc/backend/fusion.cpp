// Adaptive Eager: records of queued kernels, and the fuser the engine calls (fusion.h).
#include "fusion.h"
#include "allocator.h"
#include "enqueue.h"
#include "zero_copy.h"

#include <ATen/Config.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ScalarOps.h>
#include <ATen/ops/add_cpu_dispatch.h>
#include <ATen/ops/addcdiv_cpu_dispatch.h>
#include <ATen/ops/addcmul_cpu_dispatch.h>
#include <ATen/ops/div_cpu_dispatch.h>
#include <ATen/Version.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/lerp_cpu_dispatch.h>
#include <ATen/ops/mul_cpu_dispatch.h>
#include <ATen/ops/sqrt_cpu_dispatch.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace torchneuron::fusion {

namespace {

constexpr uint8_t kArity[] = {3, 2, 3, 2, 3, 2, 4, 4, 3, 2};    // buffers: out, then inputs
constexpr uint8_t kScalars[] = {1, 2, 0, 1, 0, 1, 1, 1, 1, 0};  // Python numbers, in order
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
  std::array<float, 2> scalar{};
  // The op, for torchneuron.get_executed_ops (a fused kernel still ran the op on the device).
  const char* hot = nullptr;
  const c10::OperatorName* boxed = nullptr;
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
};
// In a signature, after the kernels: the slots the kernel does not store (eager_fusion.py).
constexpr char kUnstored = static_cast<char>(0xFF);

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
  size_t at_op = 1, at_scalar = 0;  // signature[0] is the buffer count
  while (at_op < g.signature.size() && g.signature[at_op] != kUnstored) {
    const auto kind = static_cast<Kind>(g.signature[at_op]);
    std::array<at::Tensor, 4> t;
    for (uint8_t i = 0; i < kArity[kind]; ++i) t[i] = view(static_cast<uint8_t>(g.signature[at_op + 1 + i]));
    const float* s = g.scalars.data() + at_scalar;
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
    }
    at_op += 1 + kArity[kind];
    at_scalar += kScalars[kind];
  }
}

void run_group(KernelFn kernel, const Group& g) {
  c10::SmallVector<int64_t, 16> remainders(2 * static_cast<size_t>(at::get_num_threads()) + 2, 0);
  kernel(const_cast<void* const*>(g.buffers.data()), g.scalars.data(), g.numel, remainders.data());
  for (size_t t = 0; t + 1 < remainders.size(); t += 2) {
    if (remainders[t + 1] > remainders[t]) run_remainder(g, remainders[t], remainders[t + 1]);
  }
}

}  // namespace

namespace detail {
// Off by default until it wins on bench/engine.py (docs/benchmarks.md, Execution engine).
bool g_on = env_flag("TORCH_NEURONX_ENABLE_CONCATENATION", false);
}

namespace {
neuron::rt::engine::Decision fuse(const std::vector<const void*>& records, const std::vector<uint64_t>& seqs);
void flush();
}  // namespace

// The engine asks the fuser only while fusion is on: off, no queued kernel pays for looking.
void set_enabled(bool on) noexcept {
  detail::g_on = on;
  if (on) neuron::rt::engine::set_fuser(&fuse, &flush);
  else neuron::rt::engine::set_fuser(nullptr, nullptr);
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
  return recs;
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

// The engine's fuser (engine.h): split the offered run into groups, and run them fused if every
// group's kernel is compiled.
neuron::rt::engine::Decision fuse(const std::vector<const void*>& records, const std::vector<uint64_t>& seqs) {
  if (at::globalContext().deterministicAlgorithms()) return {0, records.size(), {}};
  // Buffers seen so far, by first byte: [begin, end) and (group, slot).
  struct Buf {
    uintptr_t end;
    uint32_t group;
    uint32_t slot;
  };
  std::map<uintptr_t, Buf> bufs;
  c10::SmallVector<Group, 4> groups;
  // Adds one record to the region; false (and nothing changed) if it must end before it.
  auto add = [&](const Record& r) {
    uint32_t g = 0;
    while (g < groups.size() && groups[g].numel != r.numel) ++g;
    const bool new_group = g == groups.size();
    const size_t nbufs = new_group ? 0 : groups[g].buffers.size();
    // Slots of this kernel's buffers; a buffer partially overlapping one seen before (or seen
    // with another element count) ends the region here.
    std::array<uint32_t, 4> slots{};
    c10::SmallVector<void*, 4> fresh;
    bool conflict = false;
    const size_t bytes = static_cast<size_t>(r.numel) * sizeof(float);
    // Whether [begin, begin + bytes) meets a buffer seen before or another fresh one of this
    // kernel (all of them `bytes` long: same group).
    auto overlaps = [&](uintptr_t begin) {
      auto meets = [&](uintptr_t b, uintptr_t e) { return b < begin + bytes && begin < e; };
      auto next = bufs.lower_bound(begin);
      if (next != bufs.end() && meets(next->first, next->second.end)) return true;
      if (next != bufs.begin() && meets(std::prev(next)->first, std::prev(next)->second.end)) return true;
      return std::any_of(fresh.begin(), fresh.end(), [&](void* f) {
        const auto fb = reinterpret_cast<uintptr_t>(f);
        return meets(fb, fb + bytes);
      });
    };
    for (uint8_t i = 0; i < kArity[r.kind] && !conflict; ++i) {
      const auto begin = reinterpret_cast<uintptr_t>(r.ptr[i]);
      auto it = bufs.find(begin);
      if (it != bufs.end()) {
        conflict = it->second.group != g || it->second.end != begin + bytes;
        slots[i] = it->second.slot;
        continue;
      }
      const auto same = std::find(fresh.begin(), fresh.end(), r.ptr[i]);
      if (same != fresh.end()) {
        slots[i] = static_cast<uint32_t>(nbufs + (same - fresh.begin()));
        continue;
      }
      conflict = overlaps(begin);
      slots[i] = static_cast<uint32_t>(nbufs + fresh.size());
      fresh.push_back(r.ptr[i]);
    }
    if (conflict || nbufs + fresh.size() > kMaxSlots) return false;
    if (new_group) {
      groups.emplace_back();
      groups.back().numel = r.numel;
    }
    Group& grp = groups[g];
    for (void* f : fresh) {
      const auto begin = reinterpret_cast<uintptr_t>(f);
      bufs.emplace(begin, Buf{begin + bytes, g, static_cast<uint32_t>(grp.buffers.size())});
      grp.buffers.push_back(f);
    }
    if (std::find(grp.written.begin(), grp.written.end(), slots[0]) == grp.written.end()) {
      grp.written.push_back(static_cast<uint8_t>(slots[0]));
    }
    grp.signature.push_back(static_cast<char>(r.kind));
    for (uint8_t i = 0; i < kArity[r.kind]; ++i) grp.signature.push_back(static_cast<char>(slots[i]));
    for (uint8_t i = 0; i < kScalars[r.kind]; ++i) grp.scalars.push_back(r.scalar[i]);
    return true;
  };
  size_t n = 0, fused_records = 0;  // items, and the records they hold
  for (; n < records.size(); ++n) {
    const Record* r = static_cast<const Record*>(records[n]);
    if (r->count == 1) {
      if (!add(*r)) break;
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
    while (e < r->count && add(r[e])) ++e;
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
    const int device = static_cast<const Record*>(records[0])->device;
    const uint64_t region_end = seqs[n - 1];
    for (Group& grp : groups) {
      const size_t bytes = static_cast<size_t>(grp.numel) * sizeof(float);
      for (uint8_t slot : grp.written) {
        if (device_allocator()->is_free(device, grp.buffers[slot], bytes, region_end)) grp.unstored.push_back(slot);
      }
    }
  }

  c10::SmallVector<KernelFn, 4> kernels;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (Group& grp : groups) {
      grp.signature.insert(grp.signature.begin(), static_cast<char>(grp.buffers.size()));
      if (!grp.unstored.empty()) {
        grp.signature.push_back(kUnstored);
        for (uint8_t slot : grp.unstored) grp.signature.push_back(static_cast<char>(slot));
      }
      Entry& e = (*g_cache)[grp.signature];
      kernels.push_back(e.fn);
      if (e.fn == nullptr && !e.failed && !e.requested && ++e.seen >= kCompileAfter) {
        e.requested = true;
        ++g_stats.requested;
        g_to_compile->push_back(grp.signature);
      }
    }
  }
  for (KernelFn k : kernels) {
    if (k == nullptr) return {0, n, {}};
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
  for (size_t i = 0; i < n; ++i) {
    const Record& r = *static_cast<const Record*>(records[i]);
    if (r.hot != nullptr) track_hot(r.hot);
    else if (r.boxed != nullptr) track_fallback(*r.boxed);
  }
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
  set_enabled(detail::g_on);
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
