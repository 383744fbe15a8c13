"""Op x dtype pairs PyTorch's OpInfo database lists for CUDA and not for CPU run on neuron
(CUDA dtype parity), against a CPU oracle that computes in the widened dtype and rounds once."""

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_map


_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64}
_NOT_YET: dict = {}
# CPU has no kernel to compare with: these are checked against CPU SDPA below (dropout-free samples).
_OWN_ORACLE = {"torch.ops.aten._flash_attention_forward", "torch.ops.aten._efficient_attention_forward"}
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
            if _name(op) in _OWN_ORACLE:
                marks.append(pytest.mark.skip(reason="no CPU kernel to compare with: "
                                              "test_sdpa_backend_kernels_match_cpu_sdpa checks it against CPU SDPA"))
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


# ---- complex32 on the unboxed hot paths: computed in complex64, rounded once ---------------------

def _c32(*shape):
    torch.manual_seed(0)
    return torch.randn(*shape, dtype=torch.complex64).to(torch.complex32)


def test_complex32_sum_is_the_complex64_sum_rounded_once():
    x = _c32(64, 33)
    got = x.to("neuron").sum(1)
    assert got.dtype == torch.complex32
    assert torch.equal(got.cpu().view(torch.float16), x.to(torch.complex64).sum(1).to(torch.complex32).view(torch.float16))


def test_complex32_division_is_the_complex64_quotient_rounded_once():
    a, b = _c32(257), _c32(257) + 0.5
    got = a.to("neuron") / b.to("neuron")
    assert got.dtype == torch.complex32
    want = (a.to(torch.complex64) / b.to(torch.complex64)).to(torch.complex32)
    assert torch.equal(got.cpu().view(torch.float16), want.view(torch.float16))


def test_complex32_in_place_division_writes_the_rounded_quotient_into_self():
    a, b = _c32(17), _c32(17) + 0.5
    d = a.to("neuron")
    ptr = d.data_ptr()
    d /= b.to("neuron")
    assert d.data_ptr() == ptr and d.dtype == torch.complex32
    want = (a.to(torch.complex64) / b.to(torch.complex64)).to(torch.complex32)
    assert torch.equal(d.cpu().view(torch.float16), want.view(torch.float16))


def test_complex32_nanmean_ignores_nans_as_cuda_does():
    x = _c32(8, 6)
    x[0, 1] = complex(float("nan"), 0)
    got = torch.nanmean(x.to("neuron"), dim=1)
    xw = x.to(torch.complex64)
    keep = ~torch.isnan(xw)
    want = (torch.where(keep, xw, 0).sum(1) / keep.sum(1)).to(torch.complex32)
    torch.testing.assert_close(got.cpu(), want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.complex32, torch.complex64, torch.complex128], ids=str)
def test_complex_nansum_counts_an_element_with_a_nan_part_as_zero(dtype):
    # CPU refuses complex nansum (no oracle in the generic test): checked against the definition.
    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.complex128)
    x[1, 2] = complex(float("nan"), 1.0)
    x[4, 0] = complex(2.0, float("nan"))
    got = torch.nansum(x.to(dtype).to("neuron"), dim=0)
    assert got.dtype == dtype
    want = torch.where(torch.isnan(x), 0, x).sum(0).to(dtype)
    torch.testing.assert_close(got.cpu(), want, atol=1e-2, rtol=1e-2)


def test_fp16_hot_ops_keep_cpus_bits():
    # Only complex32 leaves the unboxed path: fp16 sum/div are CPU's kernels, bit for bit.
    torch.manual_seed(0)
    a, b = torch.randn(300).half(), torch.randn(300).half() + 3
    assert torch.equal((a.to("neuron") / b.to("neuron")).cpu(), a / b)
    assert torch.equal(a.to("neuron").sum().cpu(), a.sum())


# ---- bool abs / softsign / trace (CUDA kernels exist for bool) ------------------------------------

def test_bool_abs_is_the_identity_in_bool():
    x = torch.tensor([True, False, True, False])
    got = torch.abs(x.to("neuron"))
    assert got.dtype == torch.bool
    assert torch.equal(got.cpu(), x)


def test_bool_abs_out_and_in_place():
    x = torch.tensor([[True, False], [False, True]])
    out = torch.empty(0, dtype=torch.bool, device="neuron")
    torch.abs(x.to("neuron"), out=out)
    assert torch.equal(out.cpu(), x)
    d = x.to("neuron")
    d.abs_()
    assert torch.equal(d.cpu(), x)


def test_bool_softsign_matches_cudas_promotion_to_float():
    x = torch.tensor([True, False, True])
    got = torch.nn.functional.softsign(x.to("neuron"))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), torch.tensor([0.5, 0.0, 0.5]))


def test_bool_trace_counts_the_true_diagonal_elements_as_int64():
    x = torch.tensor([[True, True, False], [False, False, True], [True, False, True], [True, True, True]])
    got = torch.trace(x.to("neuron"))
    assert got.dtype == torch.int64 and got.device.type == "neuron"
    assert got.item() == 2


def test_bool_trace_rejects_a_non_matrix():
    with pytest.raises(RuntimeError, match="expected a matrix"):
        torch.trace(torch.ones(3, dtype=torch.bool, device="neuron"))


# ---- fp16 FFTs (cuFFT's half precision) ---------------------------------------------------------

def _h(*shape):
    torch.manual_seed(0)
    return torch.randn(*shape).half()


def test_fp16_rfft_returns_complex32_of_the_fp32_transform_rounded_once():
    x = _h(3, 16)
    got = torch.fft.rfft(x.to("neuron"))
    assert got.dtype == torch.complex32 and got.device.type == "neuron"
    want = torch.fft.rfft(x.float()).to(torch.complex32)
    assert torch.equal(got.cpu().view(torch.float16), want.view(torch.float16))


def test_fp16_irfft_and_fft_promote_real_half_to_complex32_as_cuda_does():
    x = _h(4, 8)
    got = torch.fft.fft(x.to("neuron"))
    assert got.dtype == torch.complex32
    torch.testing.assert_close(got.cpu(), torch.fft.fft(x.float()).to(torch.complex32), atol=1e-2, rtol=1e-2)
    r = torch.fft.irfft(x.to("neuron"), n=8)
    assert r.dtype == torch.float16
    torch.testing.assert_close(r.cpu(), torch.fft.irfft(x.float(), n=8).half(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("call", [lambda x: torch.fft.rfft(x), lambda x: torch.fft.fft(x),
                                  lambda x: torch.fft.irfft(x, n=6), lambda x: torch.fft.rfftn(x, s=(4, 6))],
                         ids=["rfft", "fft", "irfft", "rfftn"])
def test_fp16_fft_refuses_non_power_of_two_sizes_with_cudas_message(call):
    x = _h(4, 12).to("neuron")
    with pytest.raises(RuntimeError, match="powers of two when computing in half precision"):
        call(x)


def test_fp16_fft_does_not_restrict_the_untransformed_dims():
    x = _h(3, 5, 8)
    got = torch.fft.rfft(x.to("neuron"))
    torch.testing.assert_close(got.cpu(), torch.fft.rfft(x.float()).to(torch.complex32), atol=1e-2, rtol=1e-2)


def test_fp16_rfft_backward_gives_the_widened_gradient_in_half():
    x = _h(2, 8)
    xd = x.to("neuron").requires_grad_()
    torch.fft.rfft(xd).abs().sum().backward()
    xc = x.float().requires_grad_()
    torch.fft.rfft(xc).abs().sum().backward()
    assert xd.grad.dtype == torch.float16
    torch.testing.assert_close(xd.grad.cpu(), xc.grad.half(), atol=1e-2, rtol=1e-2)


def test_fp16_rfft_out_writes_complex32():
    x = _h(8)
    out = torch.empty(0, dtype=torch.complex32, device="neuron")
    torch.fft.rfft(x.to("neuron"), out=out)
    torch.testing.assert_close(out.cpu(), torch.fft.rfft(x.float()).to(torch.complex32), atol=1e-2, rtol=1e-2)


def test_fp32_fft_keeps_cpus_bits():
    torch.manual_seed(0)
    x = torch.randn(4, 12)
    assert torch.equal(torch.fft.rfft(x.to("neuron")).cpu(), torch.fft.rfft(x))
    assert torch.equal(torch.fft.fft2(x.to("neuron")).cpu(), torch.fft.fft2(x))


def test_bf16_fft_is_refused_as_on_cuda():
    with pytest.raises(RuntimeError, match="Unsupported dtype BFloat16"):
        torch.fft.rfft(torch.ones(8, dtype=torch.bfloat16, device="neuron"))


# ---- SDPA's CUDA backend kernels called directly ([B, S, H, D] layout) ----------------------------

def _attention_samples():
    out = []
    for op in op_db:
        if _name(op) not in _OWN_ORACLE:
            continue
        for d in sorted(set(op.dtypesIf.get("cuda", op.dtypes)) - set(op.dtypes), key=str):
            out.append(pytest.param(op, d, id=f"{_name(op)[14:]}-{str(d)[6:]}"))
    return out


def _sdpa_oracle(q, k, v, scale, bottom_right, causal, bias=None):
    from torch.nn.attention.bias import causal_lower_right
    qt, kt, vt = (t.float().transpose(1, 2) for t in (q, k, v))
    sq, sk = qt.shape[-2], kt.shape[-2]
    mask = torch.zeros(sq, sk)
    if causal:
        keep = causal_lower_right(sq, sk)._materialize() if bottom_right else torch.ones(sq, sk, dtype=torch.bool).tril()
        mask = mask.masked_fill(~keep, float("-inf"))
    if bias is not None:
        mask = mask + bias.float()
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).to(q.dtype)


@pytest.mark.parametrize("op,dtype", _attention_samples())
def test_sdpa_backend_kernels_match_cpu_sdpa(op, dtype):
    flash = "flash" in op.name
    checked = 0
    for sample in op.sample_inputs("cpu", dtype):
        kw = sample.kwargs
        if kw.get("dropout_p", 0.0) != 0.0:
            continue
        q, k, v = sample.input, *sample.args[:2]
        dev = sample.transform(lambda x: x.to("neuron") if isinstance(x, torch.Tensor) else x)
        got = op(dev.input, *dev.args, **dev.kwargs)
        if flash:
            causal, bottom_right = kw["is_causal"], True
        else:
            causal, bottom_right = kw["custom_mask_type"] != 0, kw["custom_mask_type"] == 2
        if kw.get("cu_seqlens_q") is not None:  # packed sequences: each segment on its own
            cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
            want = torch.cat([_sdpa_oracle(q[:, cq[i]:cq[i + 1]], k[:, ck[i]:ck[i + 1]], v[:, ck[i]:ck[i + 1]],
                                           kw.get("scale"), bottom_right, causal) for i in range(len(cq) - 1)], 1)
        else:
            want = _sdpa_oracle(q, k, v, kw.get("scale"), bottom_right, causal, kw.get("bias"))
        assert got[0].device.type == "neuron" and got[0].dtype == dtype and got[0].shape == want.shape
        torch.testing.assert_close(got[0].cpu(), want, atol=1e-2, rtol=1e-2, equal_nan=True)
        checked += 1
    assert checked > 0


def test_flash_attention_forward_logsumexp_is_fp32_per_query():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 8).half() for _ in range(3))
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q.to("neuron"), k.to("neuron"), v.to("neuron"), None, None,
                                                           5, 5, 0.0, False, False)
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, 5)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / 8 ** 0.5
    torch.testing.assert_close(lse.cpu(), torch.logsumexp(s, -1), atol=1e-3, rtol=1e-3)


def test_efficient_attention_forward_pads_logsumexp_to_32_queries():
    q = torch.randn(1, 40, 2, 8, device="neuron")
    _, lse, *_, mq, mk = torch.ops.aten._efficient_attention_forward(q, q, q, None, None, None, None, None, 0.0, 0,
                                                                     True)
    assert lse.shape == (1, 2, 64) and (mq, mk) == (40, 40)


def test_sdpa_backend_kernels_refuse_sliding_windows_naming_them():
    q = torch.randn(1, 4, 2, 8, device="neuron", dtype=torch.half)
    with pytest.raises(NotImplementedError, match="window_size_left=2"):
        torch.ops.aten._flash_attention_forward(q, q, q, None, None, 4, 4, 0.0, False, False, window_size_left=2)
