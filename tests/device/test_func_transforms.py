"""torch.func's transforms (grad, vmap, jacrev, jacfwd, hessian, jvp, vjp) over neuron tensors
give CPU's results."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

DEV = "neuron"


def rand(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape) + sum(shape)))


def same_on_both(fn, *inputs):
    """fn over CPU inputs and over the same inputs on neuron: equal results (to float rounding)."""
    want = fn(*inputs)
    got = fn(*(t.to(DEV) for t in inputs))
    want, got = (w if isinstance(w, (tuple, list)) else (w,) for w in (want, got))
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert g.device.type == DEV
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-5)


def attention(q, mask=None, causal=False):
    return F.scaled_dot_product_attention(q, q.flip(-1), q * 0.5, attn_mask=mask, is_causal=causal)


CASES = {
    "grad": (lambda x: grad(lambda t: (t.sin() ** 2).sum())(x), (rand(7),)),
    "jacrev": (lambda x: jacrev(lambda t: t.tanh() @ t)(x), (rand(5),)),
    "jacfwd": (lambda x: jacfwd(lambda t: torch.softmax(t, 0))(x), (rand(5),)),
    "hessian": (lambda x: hessian(lambda t: (t ** 3).sum())(x), (rand(4),)),
    "jvp": (lambda x, t: jvp(F.gelu, (x,), (t,)), (rand(6), rand(6) + 1)),
    "vjp": (lambda x, g: vjp(F.silu, x)[1](g), (rand(6), rand(6) + 2)),
    "vmap_mv": (lambda a, b: vmap(torch.mv)(a, b), (rand(4, 3, 5), rand(4, 5))),
    "vmap_conv2d": (lambda x, w: vmap(F.conv2d)(x, w), (rand(3, 1, 2, 6, 6), rand(3, 4, 2, 3, 3))),
    "vmap_layer_norm_grad": (lambda x: vmap(grad(lambda t: F.layer_norm(t, (4,)).pow(2).sum()))(x), (rand(3, 2, 4),)),
    # SDPA is composite: its kernel choice sees torch.func's wrappers (no storage to alias).
    "grad_sdpa_causal": (lambda q: grad(lambda t: attention(t, causal=True).sum())(q), (rand(1, 2, 4, 8),)),
    "vmap_sdpa": (lambda q: vmap(attention)(q), (rand(3, 1, 2, 4, 8),)),
    "jacrev_sdpa_mask": (lambda q, m: jacrev(lambda t: attention(t, mask=m).sum(-1))(q),
                         (rand(1, 2, 4, 8), rand(4, 4) > 0)),
    "vmap_grad_sdpa": (lambda q: vmap(grad(lambda t: attention(t, causal=True).sum()))(q), (rand(2, 1, 2, 4, 8),)),
}


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # (CPU's flash backward: no batching rule)
@pytest.mark.parametrize("name", list(CASES))
def test_transform_gives_cpus_result(name):
    fn, inputs = CASES[name]
    same_on_both(fn, *inputs)


def test_per_sample_gradients_with_functional_call():
    def per_sample(x, y):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)).to(x.device)
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, xi, yi):
            return F.mse_loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))
        return tuple(vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y).values())
    same_on_both(per_sample, rand(8, 4), rand(8, 2))
