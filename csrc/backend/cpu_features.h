// What the host CPU can run, asked once per process. The extension is compiled for the x86-64
// baseline; kernels built with wider target attributes (AVX2, AVX-512) run only where these
// say so. Off x86-64 everything is false and the portable loops run.
#pragma once

namespace torchneuron::cpu_features {

#if defined(__x86_64__)
inline bool avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
inline bool avx2_fma() {
  static const bool yes = avx2() && __builtin_cpu_supports("fma");
  return yes;
}
inline bool avx512bw() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return yes;
}
inline bool avx512bf16() {
  static const bool yes = avx512bw() && __builtin_cpu_supports("avx512bf16");
  return yes;
}
inline bool avx512vbmi() {
  static const bool yes = avx512bw() && __builtin_cpu_supports("avx512vbmi");
  return yes;
}
inline bool avx512fp16() {
  static const bool yes = avx512bw() && __builtin_cpu_supports("avx512fp16");
  return yes;
}
#else
inline bool avx2() { return false; }
inline bool avx2_fma() { return false; }
inline bool avx512bw() { return false; }
inline bool avx512bf16() { return false; }
inline bool avx512vbmi() { return false; }
inline bool avx512fp16() { return false; }
#endif

}  // namespace torchneuron::cpu_features
