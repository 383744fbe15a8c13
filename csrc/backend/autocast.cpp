// torch.autocast("neuron"): CUDA's op policies registered for AutocastPrivateUse1.
// PyTorch 2.13 registers no fallthrough for this key, so without the first block every op
// under autocast fails ("Autocastneuron backend").
#include <ATen/autocast_mode.h>
#include <torch/library.h>

// Inside at::autocast like CUDA's registrations: the op-list macros name ATen types unqualified.
namespace at::autocast {
namespace {

at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&,
                                       const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
              "autocast.\nMany models use a sigmoid layer right before the binary cross entropy "
              "layer. In this case, combine the two layers using "
              "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss. "
              "binary_cross_entropy_with_logits and BCEWithLogits are safe to autocast.");
}

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

#define KERNEL_NEURON_LOW(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define KERNEL_NEURON_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define KERNEL_NEURON_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define KERNEL_NEURON_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
#define KERNEL_NEURON_DIFFERENT(REDISPATCH_FUNC, REGISTER_NAME, REGISTER_SIGNATURE, \
                                REDISPATCH_SIGNATURE, POLICY)                      \
  KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE(                             \
      REDISPATCH_FUNC, REGISTER_NAME, REGISTER_SIGNATURE, REDISPATCH_SIGNATURE, POLICY)

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(KERNEL_NEURON_LOW)
  AT_FORALL_FP32(KERNEL_NEURON_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(KERNEL_NEURON_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_NEURON_DIFFERENT)
  AT_FORALL_PROMOTE(KERNEL_NEURON_PROMOTE)
  // As on CUDA: binary_cross_entropy is unsafe to autocast; point users at the logits form.
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"),
         TORCH_FN(binary_cross_entropy_banned));
}

}  // namespace
}  // namespace at::autocast
