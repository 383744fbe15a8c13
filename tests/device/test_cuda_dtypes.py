"""Op x dtype pairs PyTorch's OpInfo database lists for CUDA and not for CPU run on neuron
(CUDA dtype parity), against a CPU oracle that computes in the widened dtype and rounds once."""

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_map

_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64}
_FFT_HALF = ("ATen's FFT composites refuse fp16 real inputs for non-CUDA devices by device type "
             "(promote_type_fft: maybe_support_half = is_cuda()) before any kernel runs")
_NOT_YET = {
    "abs-bool": "bool abs (identity on CUDA): no neuron kernel yet",
    "nn.functional.softsign-bool": "needs bool abs",
    "trace-bool": "bool trace: no neuron kernel yet",
    "div.no_rounding_mode-complex32": "complex32 division takes the unboxed binary hot path, which does not widen yet",
    "true_divide-complex32": "complex32 division takes the unboxed binary hot path, which does not widen yet",
    "nanmean-complex32": "needs complex32 division",
    "sum-complex32": "sum is an unboxed hot op (ops.cpp), which does not take the fallback's widening retry yet",
    "torch.ops.aten._flash_attention_forward-float16": "SDPA backend kernel neuron's SDPA choice never picks "
                                                       "(tools/scan_cuda_only_ops.py EXCLUDED)",
    "torch.ops.aten._efficient_attention_forward-float16": "SDPA backend kernel (the public SDPA op has neuron's own)",
    "torch.ops.aten._efficient_attention_forward-float32": "SDPA backend kernel (the public SDPA op has neuron's own)",
    "nn.functional.batch_norm.without_cudnn-float16": "OpInfo variant defined for CUDA only (samples need cuda)",
}
RANDOM = {"nn.functional.rrelu"}


def _name(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _pairs():
    out = []
    for op in op_db:
        if op.name in RANDOM:
            continue
        for d in sorted(set(op.dtypesIf.get("cuda", op.dtypes)) - set(op.dtypes), key=str):
            pid = f"{_name(op)}-{str(d)[6:]}"
            marks = []
            if pid in _NOT_YET:
                marks.append(pytest.mark.xfail(reason=_NOT_YET[pid], strict=False))
            elif op.name.startswith("fft.") and d == torch.float16:
                marks.append(pytest.mark.xfail(reason=_FFT_HALF, strict=True))
            out.append(pytest.param(op, d, id=pid, marks=marks))
    return out


def _widen(x):
    return x.to(_WIDE[x.dtype]) if isinstance(x, torch.Tensor) and x.dtype in _WIDE else x


@pytest.mark.parametrize("op,dtype", _pairs())
def test_cuda_dtype_runs_on_neuron_and_matches_the_widened_cpu_result(op, dtype):
    torch.manual_seed(0)
    samples = list(op.sample_inputs("cpu", dtype))[:3]
    if not samples:
        pytest.skip("no sample input")
    for sample in samples:
        dev = sample.transform(lambda x: x.to("neuron") if isinstance(x, torch.Tensor) else x)
        got = op(dev.input, *dev.args, **dev.kwargs)
        wide = sample.transform(_widen)
        try:
            ref = op(wide.input, *wide.args, **wide.kwargs)
        except Exception as exc:  # CPU lacks even the wide dtype: nothing to compare
            pytest.skip(f"no CPU reference: {exc}")
        got_l = [t for t in tree_flatten(got)[0] if isinstance(t, torch.Tensor)]
        ref_l = [t for t in tree_flatten(ref)[0] if isinstance(t, torch.Tensor)]
        # complex32 convolutions run ATen's complex composite (three real convolutions, Gauss's
        # trick) in fp16, as on CUDA: cancellation costs a few percent on some outputs.
        tol = 1.5e-1 if "conv" in op.name and dtype == torch.complex32 else 1e-2
        for g, r in zip(got_l, ref_l):
            assert g.device.type == "neuron"
            r = r.to(g.dtype)
            torch.testing.assert_close(g.cpu(), r, equal_nan=True, atol=tol, rtol=tol)
