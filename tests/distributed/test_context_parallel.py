"""Context parallel attention on neuron (ring attention over the backend), against full
attention on CPU. Needs the device's SDPA choice (EFFICIENT) and the efficient-attention
forward/backward kernels registered by torchneuron._C_distributed."""

import torch
import torch.nn.functional as F
from torch.testing import assert_close

TOL = dict(atol=1e-5, rtol=1e-4)


def test_sdpa_on_neuron_uses_efficient_attention_and_matches_cpu():
    # Neuron takes CPU's kernel choice: its flash kernel (reported as efficient attention, the
    # op DTensor can shard) for plain inputs, the math path when the mask is trainable.
    torch.manual_seed(0)
    for causal, with_bias in ((False, False), (True, False), (False, True)):
        q, k, v = (torch.randn(2, 3, 8, 4, requires_grad=True) for _ in range(3))
        bias = torch.randn(8, 8, requires_grad=True) if with_bias else None
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal)
        ref.sum().backward()
        qn, kn, vn = (t.detach().to("neuron").requires_grad_() for t in (q, k, v))
        bn = bias.detach().to("neuron").requires_grad_() if with_bias else None
        out = F.scaled_dot_product_attention(qn, kn, vn, attn_mask=bn, is_causal=causal)
        efficient = type(out.grad_fn).__name__ == "ScaledDotProductEfficientAttentionBackward0"
        assert efficient == (not with_bias)
        out.sum().backward()
        assert_close(out.detach().cpu(), ref.detach(), **TOL)
        for a, b in ((qn, q), (kn, k), (vn, v)) + (((bn, bias),) if with_bias else ()):
            assert_close(a.grad.cpu(), b.grad, **TOL)


def _cp_case(rank, size, rotate, causal):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import (_cp_options,
                                                                  context_parallel_unshard,
                                                                  set_rotate_method)

    set_rotate_method(rotate)
    _cp_options.enable_load_balance = causal  # load balancing is only defined for causal
    mesh = init_device_mesh("neuron", (size,))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 8 * size, 4, generator=g) for _ in range(3))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
    ref.sum().backward()

    qn, kn, vn = (t.to("neuron") for t in (q, k, v))
    with context_parallel(mesh, buffers=[qn, kn, vn], buffer_seq_dims=[2, 2, 2]):
        ql, kl, vl = (t.detach().requires_grad_() for t in (qn, kn, vn))  # local shards
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
        out.sum().backward()
    full_out, dq, dk, dv = context_parallel_unshard(mesh, [out.detach(), ql.grad, kl.grad, vl.grad],
                                                    [2, 2, 2, 2])
    assert full_out.device.type == "neuron"
    assert_close(full_out.cpu(), ref.detach(), **TOL)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert_close(got.cpu(), want, **TOL)
    _cp_options.enable_load_balance = True


def case_cp_alltoall_causal(rank, size):
    _cp_case(rank, size, "alltoall", True)


def case_cp_allgather_noncausal(rank, size):
    _cp_case(rank, size, "allgather", False)


def test_context_parallel_ring_alltoall_causal_matches_full_attention(world2):
    world2.run(case_cp_alltoall_causal)


def test_context_parallel_allgather_matches_full_attention(world2):
    world2.run(case_cp_allgather_noncausal)
