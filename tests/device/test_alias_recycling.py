"""CPU aliases are recycled between ops (csrc/backend/zero_copy.cpp): nothing of one op's
arguments (dtype, shape, strides, offset, conjugate/negative bits, storage) may reach the next.

Each test runs a sequence of ops whose aliases are reused by the following op and compares
every result with the same sequence on CPU.
"""

import pytest
import torch

DEV = "neuron"


def test_conjugate_bit_does_not_reach_the_next_op():
    z = torch.randn(8, dtype=torch.complex64)
    w = torch.randn(8, dtype=torch.complex64)
    zn, wn = z.to(DEV), w.to(DEV)
    first = torch.add(zn.conj(), wn)  # aliases with the conjugate bit set
    second = torch.add(zn, wn)  # the same pooled aliases, for tensors without it
    torch.testing.assert_close(first.cpu(), z.conj() + w)
    torch.testing.assert_close(second.cpu(), z + w)


def test_negative_bit_does_not_reach_the_next_op():
    z = torch.randn(8, dtype=torch.complex64)
    zn = z.to(DEV)
    neg = torch._neg_view(zn.conj())  # conjugate and negative bits
    first = torch.mul(neg, zn)
    second = torch.mul(zn, zn)
    torch.testing.assert_close(first.cpu(), torch._neg_view(z.conj()) * z)
    torch.testing.assert_close(second.cpu(), z * z)


def test_dtype_shape_strides_and_offset_change_between_ops():
    a = torch.randn(16)
    m = torch.arange(60, dtype=torch.int64).reshape(6, 10)
    an, mn = a.to(DEV), m.to(DEV)
    r1 = an + an
    r2 = mn[1:, 2:7].t() * 3  # offset, transposed strides, another dtype
    r3 = mn[::2, ::3] + mn[::2, ::3]
    r4 = (an > 0) & (an < 1)  # bool
    torch.testing.assert_close(r1.cpu(), a + a)
    torch.testing.assert_close(r2.cpu(), m[1:, 2:7].t() * 3)
    torch.testing.assert_close(r3.cpu(), m[::2, ::3] * 2)
    torch.testing.assert_close(r4.cpu(), (a > 0) & (a < 1))


def test_out_resized_by_the_kernel_then_aliases_reused():
    a, b = torch.randn(32), torch.randn(32)
    an, bn = a.to(DEV), b.to(DEV)
    out = torch.empty(0, device=DEV)
    torch.add(an, bn, out=out)  # the kernel grows out's alias storage; adopted by the device
    after = an * bn  # reuses the aliases of that op
    torch.testing.assert_close(out.cpu(), a + b)
    torch.testing.assert_close(after.cpu(), a * b)
    assert out.device.type == DEV


def test_results_do_not_share_memory_with_a_later_op():
    a = torch.randn(64)
    an = a.to(DEV)
    results = [an + i for i in range(20)]  # every op's aliases recycled by the next
    for i, r in enumerate(results):
        torch.testing.assert_close(r.cpu(), a + i)
    ptrs = {r.data_ptr() for r in results}
    assert len(ptrs) == len(results)


def test_views_returned_by_kernels_keep_their_base_after_reuse():
    x = torch.randn(4, 6)
    xn = x.to(DEV)
    parts = torch.split(xn, 2, dim=1)  # views of one input, built from an alias
    y = xn * 2  # recycles that alias
    parts[0].mul_(10)
    x_ref = x.clone()
    x_ref[:, :2] *= 10
    torch.testing.assert_close(xn.cpu(), x_ref)
    torch.testing.assert_close(y.cpu(), x * 2)


@pytest.mark.parametrize("n", [1, 3, 17])
def test_many_arguments_per_op(n):
    xs = [torch.randn(5) for _ in range(n)]
    out = torch.stack([t.to(DEV) for t in xs]).sum(0)
    again = torch.stack([t.to(DEV) * 2 for t in xs]).sum(0)
    torch.testing.assert_close(out.cpu(), torch.stack(xs).sum(0))
    torch.testing.assert_close(again.cpu(), torch.stack(xs).sum(0) * 2)


def test_a_recycled_alias_has_the_size_of_its_new_storage():
    # A large op first, so the pooled aliases last described a large buffer; the out= kernel
    # must see the empty storage's true size and grow it, not write into the old extent.
    big = torch.randn(1 << 14, device=DEV)
    (big + big).sum()
    a, b = torch.randn(32), torch.randn(32)
    out = torch.empty(0, device=DEV)
    torch.add(a.to(DEV), b.to(DEV), out=out)
    assert out.untyped_storage().nbytes() == 32 * 4
    torch.testing.assert_close(out.cpu(), a + b)
