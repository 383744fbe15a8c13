"""The ``"torchneuron"`` provider of vLLM's IR ops ``rms_norm`` / ``fused_add_rms_norm``
(torchneuron/vllm/ops.py): which calls it takes, and that it computes what vLLM's native
implementation computes. In-process (imports vLLM's IR package, no engine)."""

from __future__ import annotations

import pytest
import torch

ir = pytest.importorskip("vllm.ir")

from torchneuron.vllm import ops  # noqa: E402

ops.register_ir_kernels()
PRIORITY = [ops.IR_PROVIDER, "native"]


def _x(rows=5, hidden=96, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=g).to(dtype)


def test_rms_norm_on_neuron_rows_dispatches_to_the_neuron_kernel():
    x, w = _x().to("neuron"), _x(1).flatten().to("neuron")
    with ir.ops.rms_norm.set_priority(PRIORITY):
        assert ir.ops.rms_norm.dispatch(x, w, 1e-5).provider == ops.IR_PROVIDER
        assert ir.ops.rms_norm.dispatch(x, None, 1e-5).provider == ops.IR_PROVIDER


@pytest.mark.parametrize("case", ["variance_size", "weight_dtype", "cpu_tensor", "strided_last_dim",
                                  "three_dims"])
def test_rms_norm_calls_the_kernel_cannot_take_fall_through_to_native(case):
    x, w = _x().to("neuron"), _x(1).flatten().to("neuron")
    args = {"variance_size": (x, w, 1e-5, 32),
            "weight_dtype": (x, w.double(), 1e-5),
            "cpu_tensor": (x.cpu(), w.cpu(), 1e-5),
            "strided_last_dim": (_x(96, 5).to("neuron").t(), None, 1e-5),
            "three_dims": (x.view(5, 2, 48), None, 1e-5)}[case]
    with ir.ops.rms_norm.set_priority(PRIORITY):
        assert ir.ops.rms_norm.dispatch(*args).provider == "native"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_provider_matches_vllms_native_implementation(dtype):
    x, w = _x(dtype=dtype), _x(1, dtype=dtype).flatten()
    with ir.ops.rms_norm.set_priority(PRIORITY):
        got = ir.ops.rms_norm(x.to("neuron"), w.to("neuron"), 1e-6)
    want = ir.ops.rms_norm.impls["native"].impl_fn(x, w, 1e-6)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=8e-3)
    torch.testing.assert_close(got.cpu(), want, **tol)


def test_fused_add_rms_norm_provider_updates_x_and_residual_like_native():
    x, res, w = _x(seed=1), _x(seed=2), _x(1, seed=3).flatten()
    want_x, want_res = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x, res, w, 1e-5)
    xn, rn = x.to("neuron"), res.to("neuron")
    with ir.ops.fused_add_rms_norm.set_priority(PRIORITY):
        assert ir.ops.fused_add_rms_norm.dispatch(xn, rn, w.to("neuron"), 1e-5).provider == \
            ops.IR_PROVIDER
        out_x, out_res = ir.ops.fused_add_rms_norm.maybe_inplace(xn, rn, w.to("neuron"), 1e-5)
    torch.testing.assert_close(out_x.cpu(), want_x, atol=1e-6, rtol=1e-6)
    assert torch.equal(out_res.cpu(), want_res)
