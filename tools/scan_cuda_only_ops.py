"""Find every ATen op that has a CUDA kernel and no kernel CPU can run, and say what neuron does.

The CPU wheel registers no CUDA kernels, so the dispatcher cannot answer "which ops are
CUDA-only": torchgen's copy of ``native_functions.yaml`` (shipped in the torch wheel) can. An op
is *CUDA-only* when its ``dispatch:`` table names ``CUDA`` and none of ``CPU``,
``CompositeImplicitAutograd``, ``CompositeExplicitAutograd(NonFunctional)`` (a functional op with
a ``structured_delegate`` takes its out variant's table; an op without a table is
CompositeImplicitAutograd). Such an op fails on neuron unless neuron registers a kernel: the
boxed fallback redispatches to CPU, which has none.

Whether device-generic code reaches it is the second question. The scan answers it from
(a) the installed torch's Python sources (calls outside tests, decompositions and compiler
internals), (b) ``derivatives.yaml`` (backward ops of reachable ops are reachable), and
(c) :data:`CPP_CALL_SITES`, ATen's C++ calls taken for every non-CPU device (C++ sources are not
in the wheel; each entry names the file and the condition). Every CUDA-only op must either have
a neuron kernel or be listed in :data:`EXCLUDED` with the reason neuron never reaches it;
``tests/device/test_cuda_only_ops.py`` runs this scan and fails otherwise.

Usage: ``python tools/scan_cuda_only_ops.py [--markdown]``
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field

__all__ = ["CPP_CALL_SITES", "EXCLUDED", "CudaOnlyOp", "scan"]

_COMPOSITE_OR_CPU = {"CPU", "CompositeImplicitAutograd", "CompositeExplicitAutograd",
                     "CompositeExplicitAutogradNonFunctional"}

# ATen C++ call sites that take a CUDA-only op for every non-CPU device (PyTorch 2.13).
CPP_CALL_SITES: dict[str, str] = {
    "_thnn_fused_lstm_cell": "aten/src/ATen/native/RNN.cpp LSTMCell: input.is_cuda() || is_xpu() || "
                             "is_privateuseone() (nn.LSTM, nn.LSTMCell, packed sequences)",
    "_thnn_fused_gru_cell": "aten/src/ATen/native/RNN.cpp GRUCell: input.is_cuda() || is_xpu() || "
                            "is_privateuseone() (nn.GRU, nn.GRUCell)",
    "_thnn_fused_lstm_cell_backward_impl": "aten/src/ATen/native/RNN.cpp _thnn_fused_lstm_cell_backward "
                                           "(CompositeImplicit, the backward of _thnn_fused_lstm_cell)",
}

# CUDA-only ops neuron has no kernel for, and why it never needs one. Keys are overload names.
_CUDNN = "cuDNN library entry: ATen takes it only when cudnn is usable (input.is_cuda() and cudnn.is_acceptable)"
_MIOPEN = "MIOpen (ROCm) library entry: ATen takes it only for ROCm CUDA tensors"
_SDPA = ("SDPA backend kernel: reached only when the backend choice (_fused_sdp_choice_stub) picks it; neuron's "
         "choice (csrc/backend/sdpa.cpp) picks the math or neuron's efficient-attention kernels")
_SEMI = ("2:4 semi-structured sparsity (cuSPARSELt/CUTLASS): torch.sparse.SparseSemiStructuredTensor accepts "
         "CUDA tensors only")
EXCLUDED: dict[str, str] = {
    "_use_cudnn_ctc_loss": _CUDNN + " (LossCTC.cpp asks only for CUDA log_probs)",
    "_use_cudnn_ctc_loss.Tensor": _CUDNN + " (LossCTC.cpp asks only for CUDA log_probs)",
    "_cudnn_ctc_loss": _CUDNN,
    "_cudnn_ctc_loss.Tensor": _CUDNN,
    "_cudnn_rnn_flatten_weight": _CUDNN + " (nn.RNNBase.flatten_parameters checks fw.is_cuda)",
    "_cudnn_rnn": _CUDNN,
    "_cudnn_rnn_backward": _CUDNN,
    "_cudnn_init_dropout_state": _CUDNN,
    "cudnn_affine_grid_generator": _CUDNN,
    "cudnn_affine_grid_generator_backward": _CUDNN,
    "cudnn_batch_norm": _CUDNN,
    "cudnn_batch_norm.out": _CUDNN,
    "cudnn_batch_norm_backward": _CUDNN,
    "cudnn_convolution": _CUDNN,
    "cudnn_convolution.out": _CUDNN,
    "cudnn_convolution_transpose": _CUDNN,
    "cudnn_convolution_relu": _CUDNN,
    "cudnn_convolution_add_relu": _CUDNN,
    "cudnn_grid_sampler": _CUDNN,
    "cudnn_grid_sampler_backward": _CUDNN,
    "miopen_batch_norm": _MIOPEN,
    "miopen_batch_norm_backward": _MIOPEN,
    "miopen_convolution": _MIOPEN,
    "miopen_convolution_transpose": _MIOPEN,
    "miopen_depthwise_convolution": _MIOPEN,
    "miopen_convolution_relu": _MIOPEN,
    "miopen_convolution_add_relu": _MIOPEN,
    "miopen_rnn": _MIOPEN,
    "miopen_rnn_backward": _MIOPEN,
    "_use_miopen_ctc_loss": _MIOPEN,
    "_use_miopen_ctc_loss.Tensor": _MIOPEN,
    "miopen_ctc_loss": _MIOPEN,
    "miopen_ctc_loss.Tensor": _MIOPEN,
    "_conv_depthwise2d": "ConvUtils.h: the depthwise backend is chosen only for input.is_cuda()",
    "_conv_depthwise2d.out": "ConvUtils.h: the depthwise backend is chosen only for input.is_cuda()",
    "conv_depthwise3d": "ConvUtils.h: the depthwise backend is chosen only for input.is_cuda()",
    "_cslt_compress": _SEMI,
    "_cslt_sparse_mm": _SEMI,
    "_cslt_sparse_mm_search": _SEMI,
    "_sparse_semi_structured_tile": _SEMI,
    "_sparse_semi_structured_apply": _SEMI,
    "_sparse_semi_structured_apply_dense": _SEMI,
    "_sparse_semi_structured_linear": _SEMI,
    "_sparse_semi_structured_mm": _SEMI,
    "_sparse_semi_structured_addmm": _SEMI,
    "_to_sparse_semi_structured": _SEMI,
    "_mixed_dtypes_linear": "CUTLASS int4/int8 x fp16 GEMM with a CUDA tile layout; called by CUDA-only "
                            "quantization code (no device-generic caller)",
    "_convert_weight_to_int4pack": ("CUDA/MPS tile layout for int4 weights; CPU code uses "
                                    "_convert_weight_to_int4pack_for_cpu, which neuron runs"),
    "_weight_int4pack_mm": ("CUDA/MPS int4 GEMM on the CUDA tile layout; CPU code uses "
                            "_weight_int4pack_mm_for_cpu, which neuron runs"),
    "_philox_key_split": "torch.func._random (CUDA Philox keys): the device RNG work (branch rng)",
    "_philox_key_fold_in": "torch.func._random (CUDA Philox keys): the device RNG work (branch rng)",
    "_philox_normal_": "torch.func._random (CUDA Philox keys): the device RNG work (branch rng)",
    "_philox_uniform_": "torch.func._random (CUDA Philox keys): the device RNG work (branch rng)",
    "_scaled_grouped_mm_v2": ("MXFP8/NVFP4 grouped GEMM (swizzled block scales); neuron runs "
                              "_scaled_grouped_mm (docs/architecture.md, Precision)"),
    "_scaled_dot_product_flash_attention": _SDPA,
    "_scaled_dot_product_flash_attention.quantized": _SDPA,
    "_scaled_dot_product_flash_attention_backward": _SDPA,
    "_scaled_dot_product_cudnn_attention": _SDPA,
    "_scaled_dot_product_cudnn_attention_backward": _SDPA,
    "_flash_attention_forward_no_dropout_inplace": _SDPA,
    "_flash_attention_forward.quantized": _SDPA,
    "_cudnn_attention_forward": _SDPA,
    "_cudnn_attention_backward": _SDPA,
    "_triton_scaled_dot_attention": "Triton kernel, no caller in torch",
    "_triton_multi_head_attention": "Triton kernel, no caller in torch",
    "_fill_mem_eff_dropout_mask_": "called only by the CUDA memory-efficient attention with dropout",
}

# Python files of the installed torch that do not count as device-generic callers: tests, op
# registries that mention every op (overrides, decompositions, meta kernels, compiler lowerings).
_NOT_CALLERS = re.compile(
    r"^torch/(testing|_decomp|_refs|_prims|_meta_registrations\.py|_inductor|_dynamo|_functorch|_export|"
    r"export|fx|onnx|jit|_higher_order_ops|_subclasses|ao|overrides\.py|_tensor_docs\.py|_torch_docs\.py|"
    r"_lazy|cuda|backends/cudnn|utils/flop_counter\.py|_native|distributed/tensor/_ops|"
    r"distributed/tensor/_sharding_prop\.py|distributed/_tools|nested)")


@dataclass
class CudaOnlyOp:
    """One CUDA-only overload and what the scan found about it."""

    name: str  # "aten" overload name, e.g. "_thnn_fused_lstm_cell" or "mm.dtype"
    keys: list[str]
    python_callers: list[str] = field(default_factory=list)
    cpp_call_site: str | None = None
    backward_of: list[str] = field(default_factory=list)
    neuron_kernel: bool | None = None  # None when torch was not imported with torchneuron

    @property
    def reachable(self) -> bool:
        return bool(self.python_callers or self.cpp_call_site or self.backward_of)

    @property
    def status(self) -> str:
        if self.neuron_kernel:
            return "neuron kernel"
        if self.name in EXCLUDED:
            return "excluded: " + EXCLUDED[self.name]
        return "MISSING"


def _torchgen_dir() -> str:
    import torchgen

    return os.path.join(os.path.dirname(torchgen.__file__), "packaged")


def _load_yaml(path: str):
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path) as f:
        return yaml.load(f, Loader=loader)


def _cuda_only(functions) -> dict[str, list[str]]:
    by_name = {f["func"].split("(")[0]: f for f in functions}

    def keys(f) -> set[str]:
        if "dispatch" in f:
            return {k.strip() for key in f["dispatch"] for k in key.split(",")}
        if "structured_delegate" in f:
            return keys(by_name[f["structured_delegate"]])
        return {"CompositeImplicitAutograd"}

    out = {}
    for name, f in by_name.items():
        ks = keys(f)
        if "CUDA" in ks and not ks & _COMPOSITE_OR_CPU:
            out[name] = sorted(ks)
    return out


def _python_callers(names: list[str]) -> dict[str, list[str]]:
    import torch

    root = os.path.dirname(os.path.dirname(torch.__file__))
    base_names = {n.split(".")[0] for n in names}
    pattern = re.compile(r"(?<![\w.])(?:torch\.(?:ops\.aten\.|_C\._nn\.|_C\._VariableFunctions\.)?|_VF\.|"
                         r"aten\.|\.)(" + "|".join(sorted(map(re.escape, base_names), key=len, reverse=True)) +
                         r")\b")
    found: dict[str, set[str]] = {}
    for dirpath, _, files in os.walk(os.path.join(root, "torch")):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if _NOT_CALLERS.match(rel):
                continue
            try:
                text = open(path, encoding="utf-8", errors="replace").read()
            except OSError:
                continue
            for m in pattern.finditer(text):
                found.setdefault(m.group(1), set()).add(rel)
    return {n: sorted(found.get(n.split(".")[0], ())) for n in names}


def _backward_ops(derivatives, forward: str) -> list[str]:
    """Ops that derivatives.yaml calls in the backward formulas of ``forward``."""
    out = []
    for d in derivatives:
        if d["name"].split("(")[0] != forward:
            continue
        for k, v in d.items():
            if k in ("name", "dispatch", "output_differentiability", "result") or not isinstance(v, str):
                continue
            out += re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(", v)
    return out


def _has_neuron_kernel(name: str) -> bool | None:
    import torch

    if not hasattr(torch, "neuron"):
        return None
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::" + name, "PrivateUse1")


def scan() -> list[CudaOnlyOp]:
    """Every CUDA-only overload of the installed torch, with callers and neuron status."""
    pkg = _torchgen_dir()
    functions = _load_yaml(os.path.join(pkg, "ATen", "native", "native_functions.yaml"))
    derivatives = _load_yaml(os.path.join(pkg, "autograd", "derivatives.yaml"))
    cuda_only = _cuda_only(functions)
    callers = _python_callers(list(cuda_only))
    ops = {n: CudaOnlyOp(n, k, python_callers=callers[n], cpp_call_site=CPP_CALL_SITES.get(n),
                         neuron_kernel=_has_neuron_kernel(n)) for n, k in cuda_only.items()}
    # Backward closure: a CUDA-only op used by the derivative of a reachable op is reachable.
    changed = True
    while changed:
        changed = False
        for op in list(ops.values()):
            if not op.reachable:
                continue
            for b in _backward_ops(derivatives, op.name):
                if b in ops and op.name not in ops[b].backward_of:
                    ops[b].backward_of.append(op.name)
                    changed = True
    return sorted(ops.values(), key=lambda o: o.name)


def _markdown(ops: list[CudaOnlyOp]) -> str:
    lines = ["| op | reached from | neuron |", "|---|---|---|"]
    for op in ops:
        if op.cpp_call_site:
            where = op.cpp_call_site
        elif op.python_callers:
            where = ", ".join(op.python_callers[:3])
        elif op.backward_of:
            where = "backward of " + ", ".join(op.backward_of)
        else:
            where = "-"
        status = "kernel" if op.neuron_kernel else ("excluded: " + EXCLUDED[op.name] if op.name in EXCLUDED
                                                    else "**missing**")
        lines.append(f"| `{op.name}` | {where} | {status} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    import torch  # noqa: F401  (with autoload, registers neuron's kernels)

    ops = scan()
    if args.markdown:
        print(_markdown(ops))
    else:
        for op in ops:
            flag = "reachable" if op.reachable else "unreached"
            print(f"{op.name:48s} {flag:9s} {op.status}")
    missing = [op.name for op in ops if op.status == "MISSING"]
    print(f"\n{len(ops)} CUDA-only ops; {sum(o.reachable for o in ops)} reachable from device-generic code; "
          f"{sum(bool(o.neuron_kernel) for o in ops)} with a neuron kernel; {len(missing)} missing"
          + (": " + ", ".join(missing) if missing else ""), file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
