#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// embedding's weight gradient (`embedding_dense_backward`) into the device's pooled result.
//
// CPU's kernel has no out= form: it allocates a zeroed [num_weights, D] gradient, then, split
// over ranges of weight rows, each thread walks every index and adds grad's row i to weight row
// indices[i] when that row is its own (skipping padding_idx; an index outside the table matches
// no range and is dropped). neuron used to run it and copy its result into the device's: a
// language model's table is large (GPT-2: 50257 x 768 fp32, 154 MB), and the fresh host
// allocation faults in every page each step before the copy: 48 ms there against CPU's 36.
// Here the same walk writes into the pooled result (zeroed in parallel): each weight row gets the
// same additions in the same (index) order, each rounded once as CPU's add kernel rounds it
// (fp32 / fp64: a + b; bf16 / fp16: in fp32, then to nearest even), so the bits are CPU's.
#include "embedding_backward.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>

#include "cpu_features.h"
#include "half_vec.h"

namespace torchneuron::embedding {
namespace {

// o[0..n) += g[0..n) for 16-bit floats, in fp32, rounded to nearest even (c10's conversions).
template <class T>
void add_row_scalar(T* o, const T* g, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] = static_cast<T>(static_cast<float>(o[j]) + static_cast<float>(g[j]));
}

template <class T>
void add_row_wide(T* o, const T* g, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] += g[j];
}

__attribute__((target("avx512f,avx512bw"))) void add_row_avx512(uint16_t* o, const uint16_t* g, int64_t n, bool bf16) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = half_vec::lanes(j, n);
    const __m512 s = _mm512_add_ps(half_vec::widen(half_vec::load(o + j, m), bf16),
                                   half_vec::widen(half_vec::load(g + j, m), bf16));
    half_vec::store(o + j, m, half_vec::narrow(s, bf16));
  }
}

template <class T, class Index>
void walk(T* out, const T* grad, const Index* idx, int64_t numel, int64_t rows, int64_t d, int64_t padding_idx) {
  const bool wide16 = (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) && cpu_features::avx512bw();
  // CPU's split: ranges of 1,000 weight rows, each thread walking every index for its own rows.
  at::parallel_for(0, rows, 1000, [&](int64_t start, int64_t end) {
    for (int64_t i = 0; i < numel; ++i) {
      const int64_t k = static_cast<int64_t>(idx[i]);
      if (k == padding_idx || k < start || k >= end) continue;
      T* o = out + k * d;
      const T* g = grad + i * d;
      if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
        if (wide16) {
          add_row_avx512(reinterpret_cast<uint16_t*>(o), reinterpret_cast<const uint16_t*>(g), d,
                         std::is_same_v<T, c10::BFloat16>);
        } else {
          add_row_scalar(o, g, d);
        }
      } else {
        add_row_wide(o, g, d);
      }
    }
  });
}

template <class T>
void run(const at::Tensor& out, const at::Tensor& grad, const at::Tensor& indices, int64_t padding_idx) {
  const int64_t d = out.size(1), rows = out.size(0), numel = indices.numel();
  T* o = static_cast<T*>(out.data_ptr());
  const T* g = static_cast<const T*>(grad.const_data_ptr());
  if (indices.scalar_type() == at::kLong) walk(o, g, indices.const_data_ptr<int64_t>(), numel, rows, d, padding_idx);
  else walk(o, g, indices.const_data_ptr<int32_t>(), numel, rows, d, padding_idx);
}

}  // namespace

bool direct(const at::Tensor& grad, const at::Tensor& indices, bool scale_grad_by_freq) {
  const auto dt = grad.scalar_type();
  return !scale_grad_by_freq && grad.dim() >= 1 && grad.is_contiguous() && indices.is_contiguous() &&
         (indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt) &&
         (dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf) &&
         grad.numel() == indices.numel() * grad.size(-1);
}

void dense_backward(const at::Tensor& out, const at::Tensor& grad, const at::Tensor& indices, int64_t padding_idx) {
  // Zero the result in parallel pieces of at least 1 MiB (a pooled block's pages are mapped).
  char* base = static_cast<char*>(out.data_ptr());
  const int64_t bytes = out.numel() * static_cast<int64_t>(out.element_size());
  at::parallel_for(0, bytes, int64_t{1} << 20, [&](int64_t b, int64_t e) { std::memset(base + b, 0, e - b); });
  if (out.size(1) == 0 || indices.numel() == 0) return;
  switch (grad.scalar_type()) {
    case at::kFloat: run<float>(out, grad, indices, padding_idx); break;
    case at::kDouble: run<double>(out, grad, indices, padding_idx); break;
    case at::kBFloat16: run<c10::BFloat16>(out, grad, indices, padding_idx); break;
    default: run<c10::Half>(out, grad, indices, padding_idx); break;
  }
}

}  // namespace torchneuron::embedding
