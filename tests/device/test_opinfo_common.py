"""PyTorch's device-generic ``TestCommon`` checks, run against neuron.

A harness of our own (PyTorch's test files are not in the wheel, and we do not copy them) over
the installed ``torch.testing._internal.common_methods_invocations.op_db``:

- ``compare_cpu``: every sample input of every op, on neuron and on the CPU, agree
  (TestCommon.test_compare_cpu; tolerance 1e-3 as there, or the op's own override);
- ``out``: ``out=`` works with correct buffers (same result, the same objects returned), refuses
  a CPU buffer (0-dim or not) and a dtype the result cannot be safely cast to
  (TestCommon.test_out's device and dtype cases);
- ``variant_consistency_eager``: method and in-place variants agree with the function;
- ``noncontiguous_samples``: non-contiguous inputs give the contiguous inputs' results and
  gradients.

One dtype per op (float32 where the op supports it, else its first dtype) keeps the run short.
Expected failures are PyTorch's own: a check is marked xfail (not strict) or skipped when op_db
marks it so *for CUDA* (``DecorateInfo.is_active(..., "cuda", ...)``), so the target is "no
failure that CUDA does not also have". Neuron's own exceptions are listed in ``NEURON_XFAIL``
with their reasons.
"""

from __future__ import annotations

import unittest

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing import make_tensor
from torch.testing._internal.opinfo.core import DecorateInfo
from torch.utils._pytree import tree_flatten, tree_map


DEVICE = "neuron"
MAX_SAMPLES = 6
# Ops whose results are undefined (uninitialised memory) or random, which the CPU cannot
# reproduce sample by sample, or whose inputs must stay on the CPU.
NOT_COMPARABLE = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
                  "bernoulli", "normal", "multinomial", "rand_like", "randn_like", "randint_like",
                  "randint", "uniform", "cauchy", "exponential", "geometric", "log_normal", "nn.functional.dropout",
                  "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
                  "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "randn", "rand",
                  "torch._subclasses.fake_impls", "tensor_split", "to", "item"}

# Failures of neuron's own, with the reason (none may be a silent wrong answer).
NEURON_XFAIL: dict[tuple[str, str], str] = {
    ("torch._scaled_mm_v2", "test_noncontiguous_samples"):
        "row-wise scales must have unit stride (the op's shape check, shared with CUDA's kernel); the "
        "non-contiguous sample breaks it, on CUDA too",
}


def _name(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _dtype(op) -> torch.dtype | None:
    dtypes = op.supported_dtypes("cpu")
    if not dtypes:
        return None
    if torch.float32 in dtypes:
        return torch.float32
    order = [torch.int64, torch.bool, torch.complex64, torch.float64, torch.int32, torch.uint8]
    for d in order:
        if d in dtypes:
            return d
    return sorted(dtypes, key=str)[0]


def _cuda_decorators(op, test: str, dtype):
    """The decorators op_db applies to ``TestCommon.<test>`` for CUDA and ``dtype``."""
    for info in op.decorators:
        if not isinstance(info, DecorateInfo):
            yield info  # a bare decorator applies to every test
        elif info.is_active("TestCommon", test, "cuda", dtype, {}):
            yield from info.decorators


def _pytorch_mark(op, test: str, dtype):
    """What op_db says about ``TestCommon.<test>`` on CUDA: an xfail, a skip, or nothing."""
    for dec in _cuda_decorators(op, test, dtype):
        if dec is unittest.expectedFailure:
            return pytest.mark.xfail(reason=f"op_db: TestCommon.{test} fails on CUDA too", strict=False)
        if getattr(dec, "__qualname__", "").startswith(("skip", "skipIf")):
            return pytest.mark.skip(reason=f"op_db skips TestCommon.{test} on CUDA")
    return None


def _tolerance(op, test: str, dtype, default=(1e-3, 1e-3)):
    for dec in _cuda_decorators(op, test, dtype):
        d = getattr(dec, "d", None)  # toleranceOverride / precisionOverride
        if isinstance(d, dict) and dtype in d:
            tol = d[dtype]
            atol, rtol = (tol.atol, tol.rtol) if hasattr(tol, "atol") else (tol, default[1])
            return max(default[0], atol), max(default[1], rtol)
    return default


def _params(test: str, need=lambda op: True):
    out = []
    for op in op_db:
        name = _name(op)
        if op.name in NOT_COMPARABLE or name in NOT_COMPARABLE or not need(op):
            continue
        dtype = _dtype(op)
        if dtype is None:
            continue
        marks = []
        mark = _pytorch_mark(op, test, dtype)
        if mark is not None:
            marks.append(mark)
        if (name, test) in NEURON_XFAIL:
            marks.append(pytest.mark.xfail(reason=NEURON_XFAIL[(name, test)], strict=True))
        out.append(pytest.param(op, dtype, id=f"{name}-{str(dtype)[6:]}", marks=marks))
    return out


def _cpu(x):
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _samples(op, dtype, requires_grad=False, limit=MAX_SAMPLES):
    torch.manual_seed(0)
    out = []
    for sample in op.sample_inputs(DEVICE, dtype, requires_grad=requires_grad):
        out.append(sample)
        if len(out) >= limit:
            break
    return out


def _call(op, sample, fn=None):
    fn = fn or op
    return fn(sample.input, *sample.args, **sample.kwargs)


def _tensors(x):
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("op,dtype", _params("test_compare_cpu"))
def test_compare_cpu(op, dtype):
    atol, rtol = _tolerance(op, "test_compare_cpu", dtype)
    compared = 0
    for sample in _samples(op, dtype):
        cpu_sample = sample.transform(_cpu)
        try:
            expected = cpu_sample.output_process_fn_grad(_call(op, cpu_sample))
        except Exception:  # the sample is invalid on the CPU too
            continue
        actual = sample.output_process_fn_grad(_call(op, sample))
        if "device" not in sample.kwargs and _tensors(sample.input):
            for t in _tensors(actual):
                assert t.device.type == DEVICE, f"result on {t.device}"
        torch.testing.assert_close(tree_map(_cpu, actual), expected, atol=atol, rtol=rtol, equal_nan=True,
                                   check_device=False)
        compared += 1
    if compared == 0:
        pytest.skip("no sample input the CPU accepts")


def _first_out_sample(op, dtype):
    for sample in _samples(op, dtype, limit=3):
        try:
            expected = _call(op, sample)
        except Exception:
            continue
        if isinstance(expected, torch.Tensor) or (
                isinstance(expected, (tuple, list)) and expected and all(isinstance(t, torch.Tensor) for t in expected)):
            return sample, expected
    pytest.skip("no sample with tensor results")


def _call_out(op, sample, out):
    return op(sample.input, *sample.args, out=out, **sample.kwargs)


def _outs(expected, transform):
    if isinstance(expected, torch.Tensor):
        return transform(expected)
    return type(expected)(transform(t) for t in expected) if not hasattr(expected, "_fields") else \
        tuple(transform(t) for t in expected)


_FLOATING_COMPLEX = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
                     torch.complex32)


@pytest.mark.parametrize("op,dtype", _params("test_out", lambda op: op.supports_out))
def test_out(op, dtype):
    sample, expected = _first_out_sample(op, dtype)
    # Correct buffers: the same values, written into (and returned as) the given tensors.
    out = _outs(expected, lambda t: torch.empty_like(t))
    torch.manual_seed(0)
    result = _call_out(op, sample, out)
    if isinstance(out, torch.Tensor):
        assert result is out
    elif result is not None:  # the *_copy.out ops of TensorList results return nothing
        assert all(r is o for r, o in zip(result, out))
    if not op.is_factory_function:
        torch.testing.assert_close(tree_map(_cpu, _tensors(out)), tree_map(_cpu, _tensors(expected)), equal_nan=True)
    # Non-contiguous buffers of the right shape: written through their strides, not replaced.
    nc_out = _outs(expected, lambda t: make_tensor(t.shape, dtype=t.dtype, device=t.device, noncontiguous=True))
    strides = [t.stride() for t in _tensors(nc_out)]
    ptrs = [t.data_ptr() for t in _tensors(nc_out)]
    torch.manual_seed(0)
    _call_out(op, sample, nc_out)
    assert [t.stride() for t in _tensors(nc_out)] == strides
    assert [t.data_ptr() for t in _tensors(nc_out)] == ptrs
    if not op.is_factory_function:
        torch.testing.assert_close(tree_map(_cpu, _tensors(nc_out)), tree_map(_cpu, _tensors(expected)),
                                   equal_nan=True)
    # A buffer on the CPU, 0-dim or not, is an error for an op on the device.
    cpu_out = _outs(expected, lambda t: torch.empty_like(t, device="cpu"))
    with pytest.raises(RuntimeError):
        _call_out(op, sample, cpu_out)
    # A dtype the result cannot be cast to safely (integers for floating/complex results).
    tensors = _tensors(expected)
    if any(t.dtype in _FLOATING_COMPLEX for t in tensors):
        long_out = _outs(expected, lambda t: torch.empty_like(t, dtype=torch.long))
        # TypeError: TORCH_CHECK_TYPE (cat & co.), what CPU and CUDA raise for the same call.
        with pytest.raises((RuntimeError, TypeError)):
            _call_out(op, sample, long_out)


@pytest.mark.parametrize("op,dtype", _params(
    "test_variant_consistency_eager", lambda op: op.method_variant is not None or op.inplace_variant is not None))
def test_variant_consistency_eager(op, dtype):
    checked = 0
    for sample in _samples(op, dtype, limit=3):
        try:
            expected = _call(op, sample)
        except Exception as exc:
            if not _cpu_raises(op, sample):
                raise AssertionError(f"neuron raises where the CPU does not: {exc}") from exc
            continue
        variants = [("method", op.method_variant)]
        for vname, fn in variants:
            if fn is None:
                continue
            got = _call(op, sample, fn)
            torch.testing.assert_close(tree_map(_cpu, got), tree_map(_cpu, expected), equal_nan=True, msg=vname)
            checked += 1
        inplace = op.inplace_variant
        if (inplace is not None and isinstance(expected, torch.Tensor) and isinstance(sample.input, torch.Tensor)
                and not sample.broadcasts_input and expected.dtype == sample.input.dtype
                and expected.shape == sample.input.shape):
            inp = sample.input.clone()
            got = inplace(inp, *sample.args, **sample.kwargs)
            assert got is inp
            torch.testing.assert_close(inp.cpu(), expected.cpu(), equal_nan=True, msg="inplace")
            checked += 1
    if checked == 0:
        pytest.skip("no variant applies to the samples")


def _cpu_raises(op, sample) -> bool:
    try:
        _call(op, sample.transform(_cpu))
    except Exception:
        return True
    return False


@pytest.mark.parametrize("op,dtype", _params("test_noncontiguous_samples"))
def test_noncontiguous_samples(op, dtype):
    grad = op.supports_autograd and dtype in (torch.float32, torch.complex64)
    checked = 0
    for sample in _samples(op, dtype, requires_grad=grad, limit=3):
        try:
            expected = sample.output_process_fn_grad(_call(op, sample))
        except Exception:
            continue
        nc = sample.noncontiguous()
        got = nc.output_process_fn_grad(_call(op, nc))
        torch.testing.assert_close(tree_map(_cpu, got), tree_map(_cpu, expected), equal_nan=True)
        checked += 1
        if not grad:
            continue
        outs = [t for t in _tensors(expected) if t.requires_grad]
        nc_outs = [t for t in _tensors(got) if t.requires_grad]
        ins = [t for t in _tensors((sample.input, sample.args, sample.kwargs)) if t.requires_grad]
        nc_ins = [t for t in _tensors((nc.input, nc.args, nc.kwargs)) if t.requires_grad]
        if not outs or not ins:
            continue
        gs = torch.autograd.grad([o.abs().sum() if o.is_complex() else o.sum() for o in outs], ins, allow_unused=True)
        ngs = torch.autograd.grad([o.abs().sum() if o.is_complex() else o.sum() for o in nc_outs], nc_ins,
                                  allow_unused=True)
        torch.testing.assert_close(tree_map(_cpu, list(ngs)), tree_map(_cpu, list(gs)), equal_nan=True)
    if checked == 0:
        pytest.skip("no sample input neuron accepts")
