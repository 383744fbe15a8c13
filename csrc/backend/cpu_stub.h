#pragma once
// Calling one of ATen's CPU DispatchStubs (at::native::<name>(c10::kCPU, ...)) from the
// extension. A stub's call signature lists one kernel pointer per CPU capability libtorch was
// compiled with; the x86-64 wheels compile AVX2 and AVX-512 kernels (nm: DispatchStubImpl::
// get_call_ptr takes DEFAULT, AVX512, AVX2), and DispatchStub.h declares that signature only
// under these macros. Include this before any ATen header that includes DispatchStub.h.
#if defined(__x86_64__)
#define HAVE_AVX512_CPU_DEFINITION
#define HAVE_AVX2_CPU_DEFINITION
#endif
