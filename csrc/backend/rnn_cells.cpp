// The fused RNN cells ATen calls for every non-CPU input, with CUDA's semantics.
//
// aten/src/ATen/native/RNN.cpp computes LSTMCell / GRUCell (and so nn.LSTM and nn.GRU where
// oneDNN does not run them, packed sequences included; see torchneuron/kernels/rnn.py) for
// inputs that are is_cuda() || is_xpu() || is_privateuseone() as two GEMMs followed by one
// fused pointwise kernel, _thnn_fused_lstm_cell / _thnn_fused_gru_cell, whose backward
// (_thnn_fused_lstm_cell_backward_impl / _thnn_fused_gru_cell_backward) reads the workspace
// the forward saved. Only CUDA has those kernels (aten/src/ATen/native/cuda/RNN.cu); these are
// neuron's, with CUDA's workspace layouts so forward and backward pair up:
//   LSTM: [N, 4H], the activated gates sigmoid(i), sigmoid(f), tanh(g), sigmoid(o);
//   GRU:  [N, 5H], r, z, n (after tanh), hx, and hn + b_hn (the new gate's hidden part).
// Arithmetic is in the accumulation type (fp32 for fp16/bf16, as CUDA's acc_type); results and
// workspace are rounded once to the input dtype. Gate pre-activations are summed in CUDA's order
// ((input + hidden) + input_bias) + hidden_bias. sigmoid and tanh are ATen's vectorized CPU
// kernels, so a cell's values are those of the same formula written with torch ops.
//
// In C++ because a cell runs once per time step: written with torch ops it cost ~250 us a call
// (a 2x200 GRU step spent half its time there); these take a few us at that size, and queue on
// the execution engine like the GEMMs around them.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sigmoid_cpu_dispatch.h>
#include <ATen/ops/sum_cpu_dispatch.h>
#include <ATen/ops/tanh_cpu_dispatch.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "enqueue.h"

namespace torchneuron {
namespace rnn_cells {
namespace {

using OptTensor = std::optional<at::Tensor>;

at::Tensor value(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }

// One call's arguments and results: with the execution engine on, the kernel is queued over
// aliases made now and its results allocated now; otherwise it runs now, after the queue.
class CellCall {
 public:
  CellCall() {
    if (may_enqueue()) queued_.emplace();
    else now_ = std::make_unique<ZeroCopy>();
  }
  at::Tensor in(const at::Tensor& t) {
    if (!t.defined()) return t;
    return queued_ ? queued_->in(t) : now_->in(t);
  }
  // Allocates `result` (contiguous) on the device; returns the alias the kernel writes.
  at::Tensor out(at::Tensor& result, c10::IntArrayRef sizes, c10::ScalarType dtype) {
    if (queued_) return queued_->out(result, sizes, dtype);
    result = pooled(*now_, sizes, dtype);
    return now_->in_output(result);
  }
  template <class Work> void run(const char* name, Work&& work) {
    if (queued_) {
      queued_->enqueue(name, std::forward<Work>(work));
    } else {
      now_->launch(name);
      work();
    }
  }

 private:
  std::optional<QueuedCall> queued_;
  std::unique_ptr<ZeroCopy> now_;
};

// ---- argument checks (RNN.cu's checkSizes, with its messages' substance) ----------------------
void check_same_device_and_dtype(const char* fn, std::initializer_list<at::Tensor> tensors) {
  const at::Tensor* first = nullptr;
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    if (first == nullptr) {
      first = &t;
      continue;
    }
    TORCH_CHECK(t.device() == first->device(), fn, ": Expected all tensors to be on the same device, but found at least two devices, ",
                first->device(), " and ", t.device(), "!");
    TORCH_CHECK(t.scalar_type() == first->scalar_type(), fn, ": expected all tensors to have the same dtype, got ",
                first->scalar_type(), " and ", t.scalar_type());
  }
  TORCH_CHECK_NOT_IMPLEMENTED(first == nullptr || at::isFloatingType(first->scalar_type()), "\"", fn,
                              "\" not implemented for '", c10::toString(first->scalar_type()), "'");
  TORCH_CHECK(first == nullptr || first->is_privateuseone(), fn, ": expected neuron tensors, got ", first->device());
}

// Returns the hidden size.
int64_t check_cell_args(const char* fn, const at::Tensor& ig, const at::Tensor& hg, const at::Tensor& b1,
                        const at::Tensor& b2, int64_t factor, const at::Tensor& prev) {
  TORCH_CHECK(ig.dim() == 2, fn, ": Expected 2-dimensional tensor, but got ", ig.dim(),
              "-dimensional tensor for argument #1 'input_gates'");
  TORCH_CHECK(ig.sizes() == hg.sizes(), fn, ": Expected tensor for argument #1 'input_gates' to have the same size as ",
              "tensor for argument #2 'hidden_gates'; but ", ig.sizes(), " does not equal ", hg.sizes());
  const int64_t gates = ig.size(1);
  TORCH_CHECK(b1.defined() == b2.defined(), fn, ": input_bias and hidden_bias must both be given or both be None");
  if (b1.defined()) {
    TORCH_CHECK(b1.dim() == 1 && b1.numel() == gates, fn, ": Expected 'input_bias' to be 1-dimensional with ", gates,
                " elements, but got shape ", b1.sizes());
    TORCH_CHECK(b1.sizes() == b2.sizes(), fn, ": 'input_bias' and 'hidden_bias' differ in size: ", b1.sizes(), " vs ",
                b2.sizes());
  }
  TORCH_CHECK(gates % factor == 0 && prev.dim() == 2 && prev.size(0) == ig.size(0) && prev.size(1) == gates / factor,
              fn, ": Expected 'prev_hidden' of shape [", ig.size(0), ", ", gates / factor, "], but got ", prev.sizes());
  check_same_device_and_dtype(fn, {ig, hg, b1, b2, prev});
  return gates / factor;
}

// ---- kernels over CPU aliases ----------------------------------------------------------------
template <class T> const T* ptr(const at::Tensor& contiguous) { return contiguous.const_data_ptr<T>(); }
at::Tensor dense(const at::Tensor& t) { return t.defined() ? t.contiguous() : t; }
at::Tensor acc_buffer(c10::IntArrayRef sizes, c10::ScalarType acc) { return at::empty(sizes, at::TensorOptions().dtype(acc)); }

template <class T>
void lstm_forward(const at::Tensor& ig_, const at::Tensor& hg_, const at::Tensor& cx_, const at::Tensor& b1_,
                  const at::Tensor& b2_, const at::Tensor& hy_out, const at::Tensor& cy_out, const at::Tensor& ws_out) {
  using A = at::opmath_type<T>;
  const auto acc = c10::CppTypeToScalarType<A>::value;
  const at::Tensor ig = dense(ig_), hg = dense(hg_), cx = dense(cx_), b1 = dense(b1_), b2 = dense(b2_);
  const int64_t n = cx.size(0), h = cx.size(1), g4 = 4 * h;
  at::Tensor pre = acc_buffer({n, g4}, acc);
  A* p = pre.data_ptr<A>();
  const T *pi = ptr<T>(ig), *ph = ptr<T>(hg);
  for (int64_t k = 0; k < n * g4; ++k) p[k] = A(pi[k]) + A(ph[k]);
  if (b1.defined()) {
    const T *q1 = ptr<T>(b1), *q2 = ptr<T>(b2);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < g4; ++j) p[r * g4 + j] = (p[r * g4 + j] + A(q1[j])) + A(q2[j]);
  }
  at::Tensor act = at::cpu::sigmoid(pre);  // i, f, o; g's block is tanh:
  at::Tensor act_g = act.view({n, 4, h}).select(1, 2);
  at::cpu::tanh_out(act_g, pre.view({n, 4, h}).select(1, 2));
  const A* a = act.const_data_ptr<A>();
  at::Tensor cy_acc = acc_buffer({n, h}, acc);
  A* c = cy_acc.data_ptr<A>();
  const T* pc = ptr<T>(cx);
  for (int64_t r = 0; r < n; ++r) {
    const A* ar = a + r * g4;
    for (int64_t j = 0; j < h; ++j) c[r * h + j] = ar[h + j] * A(pc[r * h + j]) + ar[j] * ar[2 * h + j];
  }
  const at::Tensor tcy = at::cpu::tanh(cy_acc);
  const A* t = tcy.const_data_ptr<A>();
  T *hy = hy_out.data_ptr<T>(), *cy = cy_out.data_ptr<T>(), *ws = ws_out.data_ptr<T>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < h; ++j) {
      const int64_t k = r * h + j;
      hy[k] = T(a[r * g4 + 3 * h + j] * t[k]);
      cy[k] = T(c[k]);
    }
  for (int64_t k = 0; k < n * g4; ++k) ws[k] = T(a[k]);
}

template <class T>
void lstm_backward(const at::Tensor& ghy_, const at::Tensor& gcy_, const at::Tensor& cx_, const at::Tensor& cy_,
                   const at::Tensor& ws_, const at::Tensor& gg_out, const at::Tensor& gcx_out, const at::Tensor& gb_out) {
  using A = at::opmath_type<T>;
  const at::Tensor ghy = dense(ghy_), gcy = dense(gcy_), cx = dense(cx_), ws = dense(ws_);
  const int64_t n = cx.size(0), h = cx.size(1), g4 = 4 * h;
  const at::Tensor tcy = at::cpu::tanh(cy_.to(c10::CppTypeToScalarType<A>::value).contiguous());
  const A* t = tcy.const_data_ptr<A>();
  const T *pw = ptr<T>(ws), *pc = ptr<T>(cx);
  const T* pgh = ghy.defined() ? ptr<T>(ghy) : nullptr;
  const T* pgc = gcy.defined() ? ptr<T>(gcy) : nullptr;
  T *gg = gg_out.data_ptr<T>(), *gcx = gcx_out.data_ptr<T>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < h; ++j) {
      const int64_t k = r * h + j;
      const T* w = pw + r * g4 + j;
      const A i = A(w[0]), f = A(w[h]), g = A(w[2 * h]), o = A(w[3 * h]);
      const A go = pgh ? A(pgh[k]) : A(0), goc = pgc ? A(pgc[k]) : A(0);
      const A gog = go * t[k];
      const A d = ((go * o) * (A(1) - t[k] * t[k])) + goc;
      T* out = gg + r * g4 + j;
      out[0] = T(((d * g) * (A(1) - i)) * i);
      out[h] = T(((d * A(pc[k])) * (A(1) - f)) * f);
      out[2 * h] = T((d * i) * (A(1) - g * g));
      out[3 * h] = T((gog * (A(1) - o)) * o);
      gcx[k] = T(d * f);
    }
  if (gb_out.defined()) {
    at::Tensor gb = gb_out;
    at::cpu::sum_out(gb, gg_out, at::IntArrayRef{0});
  }
}

template <class T>
void gru_forward(const at::Tensor& ig_, const at::Tensor& hg_, const at::Tensor& hx_, const at::Tensor& b1_,
                 const at::Tensor& b2_, const at::Tensor& hy_out, const at::Tensor& ws_out) {
  using A = at::opmath_type<T>;
  const auto acc = c10::CppTypeToScalarType<A>::value;
  const at::Tensor ig = dense(ig_), hg = dense(hg_), hx = dense(hx_), b1 = dense(b1_), b2 = dense(b2_);
  const int64_t n = hx.size(0), h = hx.size(1), g3 = 3 * h;
  const T *pi = ptr<T>(ig), *ph = ptr<T>(hg), *px = ptr<T>(hx);
  const T* q1 = b1.defined() ? ptr<T>(b1) : nullptr;
  const T* q2 = b2.defined() ? ptr<T>(b2) : nullptr;
  at::Tensor rz = acc_buffer({n, 2 * h}, acc), hn = acc_buffer({n, h}, acc), ng = acc_buffer({n, h}, acc);
  A *prz = rz.data_ptr<A>(), *phn = hn.data_ptr<A>(), *png = ng.data_ptr<A>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < 2 * h; ++j) {
      A s = A(pi[r * g3 + j]) + A(ph[r * g3 + j]);
      if (q1) s = (s + A(q1[j])) + A(q2[j]);
      prz[r * 2 * h + j] = s;
    }
  at::cpu::sigmoid_(rz);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < h; ++j) {
      const int64_t k = r * h + j, m = r * g3 + 2 * h + j;
      const A hidden = q2 ? A(ph[m]) + A(q2[2 * h + j]) : A(ph[m]);
      const A input = q1 ? A(pi[m]) + A(q1[2 * h + j]) : A(pi[m]);
      phn[k] = hidden;
      png[k] = input + prz[r * 2 * h + j] * hidden;
    }
  at::cpu::tanh_(ng);
  T *hy = hy_out.data_ptr<T>(), *ws = ws_out.data_ptr<T>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < h; ++j) {
      const int64_t k = r * h + j;
      const A z = prz[r * 2 * h + h + j], nv = png[k];
      hy[k] = T(nv + z * (A(px[k]) - nv));
      T* w = ws + r * 5 * h + j;
      w[0] = T(prz[r * 2 * h + j]);
      w[h] = T(z);
      w[2 * h] = T(nv);
      w[3 * h] = px[k];
      w[4 * h] = T(phn[k]);
    }
}

template <class T>
void gru_backward(const at::Tensor& ghy_, const at::Tensor& ws_, const at::Tensor& gi_out, const at::Tensor& gh_out,
                  const at::Tensor& ghx_out, const at::Tensor& gbi_out, const at::Tensor& gbh_out) {
  using A = at::opmath_type<T>;
  const at::Tensor ghy = dense(ghy_), ws = dense(ws_);
  const int64_t n = ghy.size(0), h = ghy.size(1), g3 = 3 * h;
  const T *pg = ptr<T>(ghy), *pw = ptr<T>(ws);
  T *gi = gi_out.data_ptr<T>(), *gh = gh_out.data_ptr<T>(), *ghx = ghx_out.data_ptr<T>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < h; ++j) {
      const int64_t k = r * h + j;
      const T* w = pw + r * 5 * h + j;
      const A rg = A(w[0]), z = A(w[h]), nv = A(w[2 * h]), hx = A(w[3 * h]), hn = A(w[4 * h]);
      const A go = A(pg[k]);
      const A gz = ((go * (hx - nv)) * (A(1) - z)) * z;
      const A gn = (go * (A(1) - z)) * (A(1) - nv * nv);
      const A gr = ((gn * hn) * (A(1) - rg)) * rg;
      T* a = gi + r * g3 + j;
      T* b = gh + r * g3 + j;
      a[0] = b[0] = T(gr);
      a[h] = b[h] = T(gz);
      a[2 * h] = T(gn);
      b[2 * h] = T(gn * rg);
      ghx[k] = T(go * z);
    }
  if (gbi_out.defined()) {
    at::Tensor a = gbi_out, b = gbh_out;
    at::cpu::sum_out(a, gi_out, at::IntArrayRef{0});
    at::cpu::sum_out(b, gh_out, at::IntArrayRef{0});
  }
}

#define RNN_CELL_DISPATCH(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, __VA_ARGS__)

// ---- the ops ---------------------------------------------------------------------------------
constexpr char kLstm[] = "aten::_thnn_fused_lstm_cell";
constexpr char kLstmBwd[] = "aten::_thnn_fused_lstm_cell_backward_impl";
constexpr char kGru[] = "aten::_thnn_fused_gru_cell";
constexpr char kGruBwd[] = "aten::_thnn_fused_gru_cell_backward";

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                                                               const at::Tensor& cx, const OptTensor& input_bias,
                                                               const OptTensor& hidden_bias) {
  const at::Tensor b1 = value(input_bias), b2 = value(hidden_bias);
  const int64_t h = check_cell_args("_thnn_fused_lstm_cell", input_gates, hidden_gates, b1, b2, 4, cx);
  const int64_t n = cx.size(0);
  const auto dtype = input_gates.scalar_type();
  CellCall call;
  at::Tensor ig = call.in(input_gates), hg = call.in(hidden_gates), c = call.in(cx), q1 = call.in(b1), q2 = call.in(b2);
  at::Tensor hy, cy, ws;
  at::Tensor o_hy = call.out(hy, {n, h}, dtype), o_cy = call.out(cy, {n, h}, dtype), o_ws = call.out(ws, {n, 4 * h}, dtype);
  call.run(kLstm, [=]() {
    RNN_CELL_DISPATCH(dtype, "_thnn_fused_lstm_cell", [&] { lstm_forward<scalar_t>(ig, hg, c, q1, q2, o_hy, o_cy, o_ws); });
  });
  return {hy, cy, ws};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_backward_impl(const OptTensor& grad_hy,
                                                                             const OptTensor& grad_cy, const at::Tensor& cx,
                                                                             const at::Tensor& cy, const at::Tensor& workspace,
                                                                             bool has_bias) {
  const at::Tensor ghy = value(grad_hy), gcy = value(grad_cy);
  if (!ghy.defined() && !gcy.defined()) return {};  // CUDA's answer: no gradients
  const char* fn = "fused_lstm_cell_backward";
  const at::Tensor& defined = ghy.defined() ? ghy : gcy;
  TORCH_CHECK(defined.dim() == 2, fn, ": Expected 2-dimensional gradient, but got ", defined.dim(), "-dimensional");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_hy", &ghy}, {"grad_cy", &gcy},
                                {"cx", &cx}, {"cy", &cy}}) {
    TORCH_CHECK(!t->defined() || t->sizes() == defined.sizes(), fn, ": Expected tensor for '", name, "' to have size ",
                defined.sizes(), ", but got ", t->sizes());
  }
  const int64_t n = defined.size(0), h = defined.size(1);
  TORCH_CHECK(workspace.dim() == 2 && workspace.numel() == n * h * 4, fn, ": Expected 'workspace' with ", n * h * 4,
              " elements, but got shape ", workspace.sizes());
  check_same_device_and_dtype(fn, {workspace, ghy, gcy, cx, cy});
  const auto dtype = workspace.scalar_type();
  CellCall call;
  at::Tensor a_ghy = call.in(ghy), a_gcy = call.in(gcy), a_cx = call.in(cx), a_cy = call.in(cy), a_ws = call.in(workspace);
  at::Tensor grad_gates, grad_cx, grad_bias;
  at::Tensor o_gg = call.out(grad_gates, {n, 4 * h}, dtype), o_gcx = call.out(grad_cx, {n, h}, dtype);
  at::Tensor o_gb = has_bias ? call.out(grad_bias, {4 * h}, dtype) : at::Tensor();
  call.run(kLstmBwd, [=]() {
    RNN_CELL_DISPATCH(dtype, "_thnn_fused_lstm_cell_backward_impl",
                      [&] { lstm_backward<scalar_t>(a_ghy, a_gcy, a_cx, a_cy, a_ws, o_gg, o_gcx, o_gb); });
  });
  return {grad_gates, grad_cx, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> fused_gru_cell(const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                                                  const at::Tensor& hx, const OptTensor& input_bias,
                                                  const OptTensor& hidden_bias) {
  const at::Tensor b1 = value(input_bias), b2 = value(hidden_bias);
  const int64_t h = check_cell_args("_thnn_fused_gru_cell", input_gates, hidden_gates, b1, b2, 3, hx);
  const int64_t n = hx.size(0);
  const auto dtype = input_gates.scalar_type();
  CellCall call;
  at::Tensor ig = call.in(input_gates), hg = call.in(hidden_gates), x = call.in(hx), q1 = call.in(b1), q2 = call.in(b2);
  at::Tensor hy, ws;
  at::Tensor o_hy = call.out(hy, {n, h}, dtype), o_ws = call.out(ws, {n, 5 * h}, dtype);
  call.run(kGru, [=]() {
    RNN_CELL_DISPATCH(dtype, "_thnn_fused_gru_cell", [&] { gru_forward<scalar_t>(ig, hg, x, q1, q2, o_hy, o_ws); });
  });
  return {hy, ws};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  const char* fn = "fused_gru_cell_backward";
  TORCH_CHECK(grad_hy.dim() == 2, fn, ": Expected 2-dimensional tensor for argument #1 'grad_hy', but got ", grad_hy.dim(),
              "-dimensional");
  const int64_t n = grad_hy.size(0), h = grad_hy.size(1);
  TORCH_CHECK(workspace.dim() == 2 && workspace.size(0) == n && workspace.size(1) == 5 * h, fn,
              ": Expected tensor for argument #2 'workspace' to have size [", n, ", ", 5 * h, "], but got ",
              workspace.sizes());
  check_same_device_and_dtype(fn, {grad_hy, workspace});
  const auto dtype = workspace.scalar_type();
  CellCall call;
  at::Tensor g = call.in(grad_hy), w = call.in(workspace);
  at::Tensor gi, gh, ghx, gbi, gbh;
  at::Tensor o_gi = call.out(gi, {n, 3 * h}, dtype), o_gh = call.out(gh, {n, 3 * h}, dtype), o_ghx = call.out(ghx, {n, h}, dtype);
  at::Tensor o_gbi = has_bias ? call.out(gbi, {3 * h}, dtype) : at::Tensor();
  at::Tensor o_gbh = has_bias ? call.out(gbh, {3 * h}, dtype) : at::Tensor();
  call.run(kGruBwd, [=]() {
    RNN_CELL_DISPATCH(dtype, "_thnn_fused_gru_cell_backward",
                      [&] { gru_backward<scalar_t>(g, w, o_gi, o_gh, o_ghx, o_gbi, o_gbh); });
  });
  return {gi, gh, ghx, gbi, gbh};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_thnn_fused_lstm_cell", TORCH_FN(fused_lstm_cell));
  m.impl("_thnn_fused_lstm_cell_backward_impl", TORCH_FN(fused_lstm_cell_backward_impl));
  m.impl("_thnn_fused_gru_cell", TORCH_FN(fused_gru_cell));
  m.impl("_thnn_fused_gru_cell_backward", TORCH_FN(fused_gru_cell_backward));
}

}  // namespace rnn_cells
}  // namespace torchneuron
