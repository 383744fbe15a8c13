"""ATen ops only CUDA implements, reached by device-generic code: the scan keeps the list
complete (tools/scan_cuda_only_ops.py) and each neuron kernel is checked against a CPU oracle."""

import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scan_module():
    spec = importlib.util.spec_from_file_location("scan_cuda_only_ops",
                                                  os.path.join(ROOT, "tools", "scan_cuda_only_ops.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def scan():
    mod = _scan_module()
    return mod, mod.scan()


def test_every_cuda_only_op_has_a_neuron_kernel_or_a_documented_exclusion(scan):
    _, ops = scan
    missing = [op.name for op in ops if op.status == "MISSING"]
    assert missing == [], f"CUDA-only ops with neither a neuron kernel nor an exclusion: {missing}"


def test_reachable_cuda_only_ops_include_the_rnn_cells_and_sync_batch_norm(scan):
    _, ops = scan
    reachable = {op.name for op in ops if op.reachable}
    assert {"_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell_backward_impl",
            "_thnn_fused_gru_cell_backward", "batch_norm_stats", "batch_norm_backward_elemt"} <= reachable


def test_exclusions_name_only_cuda_only_ops_without_a_neuron_kernel(scan):
    # A stale exclusion (the op gained a CPU kernel, or neuron implemented it) is removed.
    mod, ops = scan
    by_name = {op.name: op for op in ops}
    stale = [n for n in mod.EXCLUDED if n not in by_name or by_name[n].neuron_kernel]
    assert stale == []


def test_docs_list_every_cuda_only_op_with_a_neuron_kernel(scan):
    _, ops = scan
    doc = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    assert "tools/scan_cuda_only_ops.py" in doc
    undocumented = [op.name for op in ops if op.neuron_kernel and f"`{op.name}`" not in doc]
    assert undocumented == []


# ---- SyncBatchNorm's pieces ------------------------------------------------------------------

def _ref_stats(x, eps):
    dims = [0] + list(range(2, x.dim()))
    return x.mean(dims), 1 / torch.sqrt(x.var(dims, unbiased=False) + eps)


def test_batch_norm_stats_matches_the_definition():
    x = torch.randn(4, 3, 5, dtype=torch.double)
    mean, invstd = torch.batch_norm_stats(x.to("neuron"), 1e-5)
    rm, ri = _ref_stats(x, 1e-5)
    torch.testing.assert_close(mean.cpu(), rm)
    torch.testing.assert_close(invstd.cpu(), ri)


def test_batch_norm_stats_of_half_input_are_fp32():
    mean, invstd = torch.batch_norm_stats(torch.randn(4, 3, device="neuron", dtype=torch.half), 1e-5)
    assert mean.dtype == invstd.dtype == torch.float32


def test_gather_stats_with_counts_merges_ranks_and_updates_running_stats():
    eps, momentum = 1e-5, 0.1
    parts = [torch.randn(n, 3, 2, dtype=torch.double) for n in (2, 5)]
    stats = [_ref_stats(p, eps) for p in parts]
    means = torch.stack([s[0] for s in stats]).to("neuron")
    invstds = torch.stack([s[1] for s in stats]).to("neuron")
    counts = torch.tensor([2.0 * 2, 5.0 * 2], dtype=torch.double, device="neuron")
    rm, rv = torch.zeros(3, dtype=torch.double, device="neuron"), torch.ones(3, dtype=torch.double, device="neuron")
    mean, invstd = torch.batch_norm_gather_stats_with_counts(parts[0].to("neuron"), means, invstds, rm, rv,
                                                             momentum, eps, counts)
    full = torch.cat(parts)
    em, ei = _ref_stats(full, eps)
    torch.testing.assert_close(mean.cpu(), em)
    torch.testing.assert_close(invstd.cpu(), ei)
    torch.testing.assert_close(rm.cpu(), momentum * em)
    unbiased = full.transpose(0, 1).reshape(3, -1).var(1, unbiased=True)
    torch.testing.assert_close(rv.cpu(), (1 - momentum) + momentum * unbiased)


# SyncBatchNorm itself (2 ranks, forward and backward against BatchNorm over the whole batch):
# tests/distributed/test_sync_batch_norm.py.


# ---- out_dtype GEMMs -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mm_out_dtype_fp32_is_the_exact_products_accumulated_in_fp32(dtype):
    a, b = torch.randn(8, 16).to(dtype), torch.randn(16, 4).to(dtype)
    got = torch.mm(a.to("neuron"), b.to("neuron"), out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), a.double().mm(b.double()).float(), atol=1e-5, rtol=1e-5)


def test_bmm_addmm_baddbmm_out_dtype_match_fp32_reference():
    a, b = torch.randn(2, 3, 4).half(), torch.randn(2, 4, 5).half()
    c = torch.randn(2, 3, 5)
    n = lambda t: t.to("neuron")  # noqa: E731
    ref = torch.bmm(a.float(), b.float())
    torch.testing.assert_close(torch.bmm(n(a), n(b), out_dtype=torch.float32).cpu(), ref)
    torch.testing.assert_close(torch.baddbmm(n(c), n(a), n(b), out_dtype=torch.float32, beta=0.5, alpha=2).cpu(),
                               0.5 * c + 2 * ref)
    torch.testing.assert_close(torch.addmm(n(c[0]), n(a[0]), n(b[0]), out_dtype=torch.float32).cpu(), c[0] + ref[0])


def test_mm_out_dtype_refuses_a_narrowing_out_dtype():
    a = torch.randn(2, 2, device="neuron")
    with pytest.raises(RuntimeError, match="out_dtype must be the same as input dtype or fp32"):
        torch.mm(a, a, out_dtype=torch.float16)


def test_mm_out_dtype_out_variant_writes_the_buffer():
    a = torch.randn(3, 3).bfloat16()
    out = torch.empty(3, 3, device="neuron")
    res = torch.mm(a.to("neuron"), a.to("neuron"), out_dtype=torch.float32, out=out)
    assert res is out
    torch.testing.assert_close(out.cpu(), a.float().mm(a.float()))


# ---- _fused_dropout / _masked_scale -----------------------------------------------------------

def test_fused_dropout_keeps_with_probability_p_and_scales_by_1_over_p():
    x = torch.ones(10000, device="neuron")
    out, mask = torch._fused_dropout(x, 0.75)
    assert mask.dtype == torch.uint8
    kept = mask.cpu().bool()
    assert 0.72 < kept.float().mean().item() < 0.78
    torch.testing.assert_close(out.cpu()[kept], torch.full((int(kept.sum()),), 1 / 0.75))
    assert (out.cpu()[~kept] == 0).all()


def test_masked_scale_is_the_backward_of_fused_dropout():
    x = torch.randn(100, device="neuron")
    mask = (torch.rand(100) > 0.5).to(torch.uint8)
    got = torch._masked_scale(x, mask.to("neuron"), 2.0)
    torch.testing.assert_close(got.cpu(), x.cpu() * mask * 2.0)
