"""Compiled-vs-eager numerics of small models on neuron (eager CPU is the oracle)."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from compile_models import DEV, MLP, GPTBlock, SmallCNN, assert_close, clone_to


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    ref = MLP().eval()
    return ref, torch.compile(clone_to(ref, DEV), backend="neuron")


def test_mlp_inference_matches_eager(mlp):
    ref, compiled = mlp
    x = torch.randn(8, 16)
    with torch.no_grad():
        assert_close(compiled(x.to(DEV)), ref(x))


def test_compiled_outputs_are_on_neuron(mlp):
    _, compiled = mlp
    with torch.no_grad():
        assert compiled(torch.randn(8, 16, device=DEV)).device == DEV


def test_small_cnn_inference_matches_eager():
    torch.manual_seed(0)
    ref = SmallCNN().eval()
    compiled = torch.compile(clone_to(ref, DEV), backend="neuron")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert_close(compiled(x.to(DEV)), ref(x))


def test_gpt_block_forward_and_backward_match_eager():
    torch.manual_seed(0)
    ref = GPTBlock()
    dev_model = clone_to(ref, DEV)
    compiled = torch.compile(dev_model, backend="neuron")
    x = torch.randn(2, 8, 32)
    out_ref = ref(x)
    out = compiled(x.to(DEV))
    assert_close(out, out_ref)
    out_ref.square().mean().backward()
    out.square().mean().backward()
    for (name, p_ref), p in zip(ref.named_parameters(), dev_model.parameters()):
        assert p.grad is not None and p.grad.device == DEV, name
        assert_close(p.grad, p_ref.grad, atol=1e-4, rtol=1e-3)


def test_model_created_on_device_compiles():
    torch.manual_seed(0)
    with torch.device(DEV):
        model = MLP()
    ref = clone_to(model, "cpu")
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert_close(torch.compile(model, backend="neuron")(x.to(DEV)), ref(x))


def test_autocast_bf16_inside_compiled_region():
    torch.manual_seed(0)
    w = torch.randn(32, 32)

    def f(x, w):
        with torch.autocast("neuron", dtype=torch.bfloat16):
            y = x @ w
        return y, y.float().relu().sum()

    x = torch.randn(16, 32)
    y, s = torch.compile(f, backend="neuron")(x.to(DEV), w.to(DEV))
    assert y.dtype == torch.bfloat16
    ref = x.bfloat16().float() @ w.bfloat16().float()
    assert_close(y.float(), ref, atol=0.1, rtol=0.02)
    assert_close(s, ref.relu().sum(), atol=1.0, rtol=0.02)


def test_compiler_disable_region_runs_eagerly(metrics):
    calls = []

    @torch.compiler.disable
    def eager_part(x):
        calls.append(torch.compiler.is_compiling())
        return x * 3

    def f(x):
        return eager_part(x.sin()) + 1

    x = torch.randn(8, device=DEV)
    out = torch.compile(f, backend="neuron")(x)
    torch.testing.assert_close(out.cpu(), x.cpu().sin() * 3 + 1)
    assert calls == [False]
    assert metrics()["compilations"] >= 1


@pytest.mark.skipif(torch.neuron.device_count() < 2, reason="needs two neuron devices")
def test_graph_on_second_device_allocates_and_runs_there():
    dev1 = torch.device("neuron:1")
    x = torch.randn(32, 32, device=dev1)
    out = torch.compile(lambda x: (x.sin() @ x).relu() + 1, backend="neuron")(x)
    assert out.device == dev1
    assert_close(out, (x.cpu().sin() @ x.cpu()).relu() + 1)


def test_channels_last_conv_forward_and_backward_match_eager():
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(3, 4, 3)
    dev_conv = clone_to(ref, DEV)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
    xd = x.detach().to(DEV).requires_grad_()
    out = torch.compile(dev_conv, backend="neuron")(xd)
    out_ref = ref(x)
    assert_close(out, out_ref)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    assert_close(xd.grad, x.grad)
    assert_close(dev_conv.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["causal", "bool_mask", "gqa", "gqa_bool_mask", "bool_mask_one_kv_head"])
def test_sdpa_forward_and_backward_match_eager(variant):
    # the last two take the math kernel (heads differ): Falcon's multi-query attention
    torch.manual_seed(0)
    kv_heads = {"gqa": 2, "gqa_bool_mask": 2, "bool_mask_one_kv_head": 1}.get(variant, 4)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k = torch.randn(2, kv_heads, 16, 8, requires_grad=True)
    v = torch.randn(2, kv_heads, 16, 8, requires_grad=True)
    mask = torch.rand(16, 16) > 0.3
    mask.fill_diagonal_(True)
    kwargs = {"causal": dict(is_causal=True), "gqa": dict(enable_gqa=True),
              "gqa_bool_mask": dict(enable_gqa=True)}.get(variant, {})

    def f(q, k, v, mask):
        m = mask if "bool_mask" in variant else None
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, **kwargs)

    qd, kd, vd = (t.detach().to(DEV).requires_grad_() for t in (q, k, v))
    out = torch.compile(f, backend="neuron")(qd, kd, vd, mask.to(DEV))
    ref = f(q, k, v, mask)
    assert_close(out, ref, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(ref)
    out.backward(g.to(DEV))
    ref.backward(g)
    for a, b in ((qd, q), (kd, k), (vd, v)):
        assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


def test_reduction_over_transposed_operands_matches_eager():
    # Inductor tiles such a loop in 2-d (CppTile2DKernel); neuron's kernel proxy required its
    # vector kernels to be neuron's own class and failed an assertion (HF Mamba's backward)
    def f(x, y):
        return (x * y).sum((0, 2), keepdim=True)

    x, y = torch.randn(2, 16, 128).transpose(1, 2), torch.randn(2, 128, 16)
    assert_close(torch.compile(f, backend="neuron")(x.to(DEV), y.to(DEV)), f(x, y))


def test_sdpa_with_a_learned_additive_mask_gets_its_gradient():
    # Swin adds its relative-position bias as attn_mask: the mask requires grad, which the CPU
    # flash kernel cannot differentiate (the math kernel can)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 4, 16, 16, requires_grad=True)

    def f(q, k, v, bias):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    dev = [t.detach().to(DEV).requires_grad_() for t in (q, k, v, bias)]
    out = torch.compile(f, backend="neuron")(*dev)
    ref = f(q, k, v, bias)
    assert_close(out, ref, atol=1e-5, rtol=1e-4)
    out.square().sum().backward()
    ref.square().sum().backward()
    for a, b in zip(dev, (q, k, v, bias)):
        assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


def test_explicit_attention_rewritten_into_sdpa_matches_eager():
    # Inductor's attention pattern matcher turns softmax(q k^T / sqrt(d)) v into SDPA and
    # traces it with FakeTensors: neuron's kernel choice must then name a kernel whose meta
    # function describes what neuron runs (HF MobileViT failed its stride checks)
    torch.manual_seed(0)
    q, k, v = (torch.randn(16, 4, 4, 8, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        scores = torch.matmul(q, k.transpose(-1, -2)) / 8 ** 0.5
        return torch.matmul(scores.softmax(dim=-1), v)

    dev = [t.detach().to(DEV).requires_grad_() for t in (q, k, v)]
    out, (code, *_) = run_and_get_code(torch.compile(f, backend="neuron"), *dev)
    assert "scaled_dot_product" in code  # the rewrite happened, so this test exercises it
    ref = f(q, k, v)
    assert_close(out, ref, atol=1e-5, rtol=1e-4)
    out.square().sum().backward()
    ref.square().sum().backward()
    for a, b in zip(dev, (q, k, v)):
        assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
