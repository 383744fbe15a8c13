// The torch headers nearly every unit of torchneuron._C parses: Tensor (about 4 s of CPU per
// unit) and the operator-registration API (about 7 s more). setup.py compiles this file once
// per build into a GCC precompiled header with the extension's exact flags and passes
// `-include` for it to every unit of _C; a unit that includes these headers again gets them
// from the include guards. If the .gch is missing or does not match the flags, GCC reads this
// text instead (same result, only slower; -Winvalid-pch says so in the build log).
// Only headers every unit may see: no Python.h (it must come first where it is used).
#include <ATen/core/Tensor.h>
#include <torch/library.h>
