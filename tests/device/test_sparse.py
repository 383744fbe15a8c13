"""Sparse neuron tensors (COO, CSR, CSC, BSR, BSC) over CPU sparse kernels; CPU is the oracle."""

import itertools
import unittest

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import UnaryUfuncInfo
from torch.utils._pytree import tree_leaves, tree_map

import torchneuron
from support import ran_random_kernel


pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta",
                                        "ignore:Sparse invariant checks are implicitly disabled")

COMPRESSED = [torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc]
LAYOUTS = [torch.sparse_coo] + COMPRESSED
LAYOUT_IDS = [str(layout)[13:] for layout in LAYOUTS]


def dense_matrix(rows=4, cols=6):
    """A matrix with structural zeros, whole zero 2x2 blocks and repeated values."""
    x = torch.arange(1.0, rows * cols + 1).reshape(rows, cols)
    x[x.remainder(3) == 0] = 0
    x[:2, 2:4] = 0
    return x


def sparse(x, layout):
    blocksize = (2, 2) if layout in (torch.sparse_bsr, torch.sparse_bsc) else None
    return x.to_sparse(layout=layout, blocksize=blocksize)


def members(t):
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    return [t.ccol_indices(), t.row_indices(), t.values()]


def assert_on(t, device):
    assert t.device == torch.device(device)
    for m in members(t):
        assert m.device == torch.device(device)


def cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


# ---- construction and conversion --------------------------------------------------------

def test_coo_constructor_from_cpu_data_builds_a_neuron_tensor():
    i, v = torch.tensor([[0, 1, 1], [2, 0, 2]]), torch.tensor([3.0, 4.0, 5.0])
    got = torch.sparse_coo_tensor(i, v, (2, 3), device="neuron")
    assert_on(got, "neuron:0")
    torch.testing.assert_close(got.cpu(), torch.sparse_coo_tensor(i, v, (2, 3)))


def test_coo_constructor_keeps_neuron_members_without_copying():
    i = torch.tensor([[0, 1], [1, 0]], device="neuron")
    v = torch.tensor([1.0, 2.0], device="neuron")
    s = torch.sparse_coo_tensor(i, v, (2, 2))
    assert s._values().data_ptr() == v.data_ptr() and s._indices().data_ptr() == i.data_ptr()


@pytest.mark.parametrize("layout", COMPRESSED, ids=LAYOUT_IDS[1:])
def test_compressed_constructor_from_cpu_data_builds_a_neuron_tensor(layout):
    expected = sparse(dense_matrix(), layout)
    c, p, v = members(expected)
    got = torch.sparse_compressed_tensor(c, p, v, expected.shape, layout=layout, device="neuron")
    assert got.layout == layout
    assert_on(got, "neuron:0")
    torch.testing.assert_close(got.cpu(), expected)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_dense_to_sparse_matches_cpu(layout):
    got = sparse(dense_matrix().to("neuron"), layout)
    assert got.layout == layout
    assert_on(got, "neuron:0")
    torch.testing.assert_close(got.cpu(), sparse(dense_matrix(), layout))


@pytest.mark.parametrize("method", ["to_sparse_csr", "to_sparse_csc"])
def test_named_conversions_match_cpu(method):
    got = getattr(dense_matrix().to("neuron"), method)()
    torch.testing.assert_close(got.cpu(), getattr(dense_matrix(), method)())


@pytest.mark.parametrize("method", ["to_sparse_bsr", "to_sparse_bsc"])
def test_named_block_conversions_match_cpu(method):
    got = getattr(dense_matrix().to("neuron"), method)((2, 2))
    torch.testing.assert_close(got.cpu(), getattr(dense_matrix(), method)((2, 2)))


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_to_dense_matches_cpu(layout):
    got = sparse(dense_matrix(), layout).to("neuron").to_dense()
    assert got.device.type == "neuron" and got.layout == torch.strided
    torch.testing.assert_close(got.cpu(), dense_matrix())


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_to_neuron_and_back_round_trips(layout):
    s = sparse(dense_matrix(), layout)
    on_device = s.to("neuron")
    assert on_device.layout == layout
    assert_on(on_device, "neuron:0")
    back = on_device.cpu()
    assert_on(back, "cpu")
    torch.testing.assert_close(back, s)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_sparse_tensors_live_on_the_device_they_are_sent_to(layout):
    s = sparse(dense_matrix(), layout).to("neuron:1")
    assert_on(s, "neuron:1")
    result = s * 2  # computed on neuron:1 while neuron:0 is current
    assert_on(result, "neuron:1")
    torch.testing.assert_close(result.cpu(), sparse(dense_matrix(), layout) * 2)


@pytest.mark.parametrize("layout", LAYOUTS[:3], ids=LAYOUT_IDS[:3])  # CPU has no empty BSR/BSC
def test_empty_sparse_factory_builds_a_neuron_tensor(layout):
    got = torch.empty((4, 6), layout=layout, device="neuron")
    expected = torch.empty((4, 6), layout=layout)
    assert got.layout == layout and got.shape == expected.shape and got._nnz() == expected._nnz()
    assert_on(got, "neuron:0")


def test_invalid_indices_are_rejected_as_on_cpu():
    i, v = torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0])
    with pytest.raises(RuntimeError, match="size is inconsistent with indices"):
        torch.sparse_coo_tensor(i, v, (3,), check_invariants=True)
    with pytest.raises(RuntimeError, match="size is inconsistent with indices"):
        torch.sparse_coo_tensor(i, v, (3,), device="neuron", check_invariants=True)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_save_and_load_keep_sparse_neuron_tensors(layout, tmp_path):
    s = sparse(dense_matrix(), layout)
    torch.save(s.to("neuron:1"), tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt")
    assert loaded.layout == layout
    assert_on(loaded, "neuron:1")
    torch.testing.assert_close(loaded.cpu(), s)


def test_tensor_neuron_method_moves_sparse_tensors():
    s = sparse(dense_matrix(), torch.sparse_coo)
    assert_on(s.neuron(), "neuron:0")
    torch.testing.assert_close(s.neuron().cpu(), s)


def test_hybrid_coo_with_dense_dimensions_matches_cpu():
    x = dense_matrix()
    expected = x.to_sparse(sparse_dim=1)  # rows are sparse, each stored row is dense
    got = x.to("neuron").to_sparse(sparse_dim=1)
    assert got.dense_dim() == 1 and got._values().shape == expected._values().shape
    torch.testing.assert_close(got.cpu(), expected)
    torch.testing.assert_close((got * 2).to_dense().cpu(), x * 2)


def test_coalesce_sums_duplicates_like_cpu():
    i = torch.tensor([[1, 0, 1, 1], [2, 0, 2, 0]])
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = torch.sparse_coo_tensor(i, v, (2, 3)).coalesce()
    s = torch.sparse_coo_tensor(i, v, (2, 3), device="neuron")
    assert not s.is_coalesced()
    got = s.coalesce()
    assert got.is_coalesced()
    assert_on(got, "neuron:0")
    torch.testing.assert_close(got._indices().cpu(), expected._indices())
    torch.testing.assert_close(got._values().cpu(), expected._values())


# ---- operations --------------------------------------------------------------------------

def _unary_cases():
    for op in op_db:
        if not isinstance(op, UnaryUfuncInfo) or torch.float32 not in op.supported_dtypes("cpu"):
            continue
        for layout, supported in [(torch.sparse_coo, op.supports_sparse),
                                  (torch.sparse_csr, op.supports_sparse_csr)]:
            if supported:
                name = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
                yield pytest.param(op, layout, id=f"{name}-{str(layout)[13:]}")


@pytest.mark.parametrize("op,layout", list(_unary_cases()))
def test_unary_elementwise_op_matches_cpu(op, layout):
    x = dense_matrix() / 7 - 1
    expected = op(sparse(x, layout))
    got = op(sparse(x.to("neuron"), layout))
    assert got.device.type == "neuron"
    torch.testing.assert_close(got.cpu(), expected, equal_nan=True)


def _sparse_samples(op, layout):
    try:
        return list(itertools.islice(op.sample_inputs_sparse(layout, "cpu", torch.float32), 4))
    except (NotImplementedError, unittest.SkipTest):  # OpInfo has no sparse samples for it
        return []


def _opinfo_sparse_cases():
    for op in op_db:
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        for layout, attr in zip(LAYOUTS, ["supports_sparse", "supports_sparse_csr", "supports_sparse_csc",
                                          "supports_sparse_bsr", "supports_sparse_bsc"]):
            if getattr(op, attr) and _sparse_samples(op, layout):
                name = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
                yield pytest.param(op, layout, id=f"{name}-{str(layout)[13:]}")


@pytest.mark.parametrize("op,layout", list(_opinfo_sparse_cases()))
def test_opinfo_sparse_samples_match_cpu(op, layout):
    """PyTorch's own sparse sample inputs (reductions, binary elementwise ops, ...)."""
    compared = 0
    for sample in _sparse_samples(op, layout):
        try:
            expected = op(sample.input, *sample.args, **sample.kwargs)
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            continue  # the sample is invalid on CPU too
        moved = tree_map(lambda x: x.to("neuron") if isinstance(x, torch.Tensor) else x,
                         (sample.input, sample.args, dict(sample.kwargs)))
        if "device" in moved[2]:  # factory-like ops: ask for the neuron device instead
            moved[2]["device"] = "neuron"
        torchneuron.clear_op_tracking()
        got = op(moved[0], *moved[1], **moved[2])
        for t in tree_leaves(got):
            if isinstance(t, torch.Tensor):
                assert t.device.type == "neuron"
        if ran_random_kernel():
            # neuron's Philox numbers differ from CPU's by design: same layout, shape, dtype.
            g, e = cpu(got), expected
            assert (g.layout, g.shape, g.dtype) == (e.layout, e.shape, e.dtype)
            compared += 1
            continue
        torch.testing.assert_close(tree_map(cpu, got), expected, equal_nan=True)
        compared += 1
    assert compared > 0, "every sample raises on CPU: nothing was compared"


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
@pytest.mark.parametrize("fn", [lambda a, b: a + b, lambda a, b: a * b, lambda a, b: torch.add(a, b, alpha=-2)],
                         ids=["add", "mul", "add-alpha"])
def test_sparse_sparse_elementwise_matches_cpu(layout, fn):
    a, b = dense_matrix(), dense_matrix().flip(0)
    expected = fn(sparse(a, layout), sparse(b, layout))
    got = fn(sparse(a, layout).to("neuron"), sparse(b, layout).to("neuron"))
    assert got.layout == layout
    torch.testing.assert_close(got.cpu().to_dense(), expected.to_dense())


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_inplace_ops_update_the_neuron_tensor_itself(layout):
    a, b = dense_matrix(), dense_matrix().flip(1)
    expected = sparse(a, layout)
    s = expected.to("neuron")
    expected.mul_(3)
    assert s.mul_(3) is s
    torch.testing.assert_close(s.cpu(), expected)
    if layout == torch.sparse_coo:  # sparse += sparse replaces the members (the sync path)
        expected.add_(sparse(b, layout))
        assert s.add_(sparse(b, layout).to("neuron")) is s
        assert_on(s, "neuron:0")
        torch.testing.assert_close(s.cpu().to_dense(), expected.to_dense())
    s.zero_()
    torch.testing.assert_close(s.cpu().to_dense(), torch.zeros_like(a))


def test_dense_plus_sparse_into_dense_matches_cpu():
    d, s = torch.ones(4, 6), sparse(dense_matrix(), torch.sparse_coo)
    dn = d.to("neuron")
    assert dn.add_(s.to("neuron"), alpha=-0.5) is dn
    torch.testing.assert_close(dn.cpu(), d.add_(s, alpha=-0.5))


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_copy_from_a_cpu_sparse_tensor_crosses_devices(layout):
    src = sparse(dense_matrix(), layout)
    dst = sparse(torch.zeros(4, 6), layout).to("neuron") if layout == torch.sparse_coo else \
        sparse(dense_matrix().flip(0), layout).to("neuron")
    dst.copy_(src)
    assert_on(dst, "neuron:0")
    torch.testing.assert_close(dst.cpu(), src)


MATMULS = {
    "sparse.mm": lambda s, d: torch.sparse.mm(s, d),
    "mm": lambda s, d: torch.mm(s, d),
    "matmul": lambda s, d: s @ d,
    "addmm": lambda s, d: torch.addmm(torch.full((4, 3), 0.5, device=d.device), s, d, beta=2.0, alpha=0.5),
}


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc],
                         ids=["coo", "csr", "csc"])
@pytest.mark.parametrize("name", list(MATMULS))
def test_sparse_times_dense_matches_cpu(name, layout):
    s, d = sparse(dense_matrix(), layout), torch.arange(18.0).reshape(6, 3) / 5
    expected = MATMULS[name](s, d)
    got = MATMULS[name](s.to("neuron"), d.to("neuron"))
    assert got.device.type == "neuron"
    torch.testing.assert_close(cpu(got).to_dense(), expected.to_dense())


def test_sampled_addmm_matches_cpu():
    mask = sparse(dense_matrix(4, 4), torch.sparse_csr)
    a, b = torch.arange(12.0).reshape(4, 3) / 4, torch.arange(12.0).reshape(3, 4) / 3
    expected = torch.sparse.sampled_addmm(mask, a, b, beta=0.5, alpha=2.0)
    got = torch.sparse.sampled_addmm(mask.to("neuron"), a.to("neuron"), b.to("neuron"), beta=0.5, alpha=2.0)
    assert got.layout == torch.sparse_csr
    assert_on(got, "neuron:0")
    torch.testing.assert_close(got.cpu(), expected)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_autograd_through_sparse_mm_matches_cpu(layout):
    def grads(device):
        s = sparse(dense_matrix(), layout).to(device).requires_grad_()
        d = (torch.arange(18.0).reshape(6, 3) / 5).to(device).requires_grad_()
        (torch.sparse.mm(s, d) ** 2).sum().backward()
        return s.grad, d.grad

    (gs, gd), (es, ed) = grads("neuron"), grads("cpu")
    assert gs.layout == es.layout and gs.device.type == "neuron"
    torch.testing.assert_close(gs.cpu().to_dense(), es.to_dense())
    torch.testing.assert_close(gd.cpu(), ed)


@pytest.mark.parametrize("optimizer", ["SGD", "SparseAdam"])
def test_embedding_sparse_gradients_train_like_cpu(optimizer):
    def train(device):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True).to(device)
        opt = getattr(torch.optim, optimizer)(emb.parameters(), lr=0.1)
        idx = torch.tensor([1, 3, 3, 7], device=device)
        for _ in range(3):
            opt.zero_grad()
            (emb(idx) ** 2).sum().backward()
            assert emb.weight.grad.layout == torch.sparse_coo
            assert emb.weight.grad.device.type == torch.device(device).type
            opt.step()
        return emb.weight.detach()

    torch.testing.assert_close(train("neuron").cpu(), train("cpu"))


# ---- memory, dispatch, errors ------------------------------------------------------------

def test_memory_stats_count_sparse_members_exactly():
    x = dense_matrix(64, 64).to("neuron")
    base = torch.neuron.memory_allocated()
    s = x.to_sparse()  # members are fresh CPU results adopted into device memory
    member_bytes = sum(m.untyped_storage().nbytes() for m in members(s))
    assert torch.neuron.memory_allocated() - base == member_bytes
    del s
    assert torch.neuron.memory_allocated() == base


def test_generic_sparse_kernels_are_metadata_only():
    """The ops sparse.cpp runs by their CPU kernel on neuron tensors must have device-generic
    kernels: the same function is registered for the Meta sparse keys (COO's copy_ only checks
    layouts before calling copy_sparse_to_sparse_)."""
    for compressed, meta_key in [(False, "SparseMeta"), (True, "SparseCsrMeta")]:
        for name in torchneuron._C._sparse_generic_ops(compressed):
            if (name, compressed) == ("copy_", False):
                continue
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", meta_key), name


def test_every_sparse_cpu_kernel_has_a_neuron_route():
    """Registered per op, not only through the key's fallback, so that no op runs a
    CompositeExplicitAutograd(NonFunctional) kernel on neuron where CPU runs its sparse one."""
    missing = [(name, cpu_key) for name in torch._C._dispatch_get_all_op_names()
               if name.startswith("aten::")
               for cpu_key, neuron_key in [("SparseCPU", "SparsePrivateUse1"),
                                           ("SparseCsrCPU", "SparseCsrPrivateUse1")]
               if torch._C._dispatch_has_kernel_for_dispatch_key(name, cpu_key)
               and not torch._C._dispatch_has_kernel_for_dispatch_key(name, neuron_key)]
    assert missing == []


def test_sparse_with_a_cpu_dense_operand_is_rejected():
    s = sparse(dense_matrix(), torch.sparse_coo).to("neuron")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.sparse.mm(s, torch.ones(6, 2))
