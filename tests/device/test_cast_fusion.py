"""Adaptive Eager's precompiled family (torch.neuron.engine.set_cast_fusion_enabled, on by
default): queued casts (bfloat16 -> float32 -> fp8), products with a 0-dim tensor and clamps run
as one pass over the elements, bit-identical to the kernels one by one.

Oracles: CPU PyTorch (every case), and the same program with the family off. Inputs carry the
values whose bits a path could change: NaN of either sign and other payloads, infinities,
subnormals, values past fp8's range, signed zeros.
"""

from __future__ import annotations

import pytest
import torch

import torchneuron
from support import run_python

engine = torch.neuron.engine
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture
def casting():
    was, was_casts = engine.is_enabled(), engine.is_cast_fusion_enabled()
    engine.set_enabled(True)
    engine.set_cast_fusion_enabled(True)
    yield
    torch.neuron.synchronize()
    engine.set_enabled(was)
    engine.set_cast_fusion_enabled(was_casts)


def hard_bf16(*shape, seed=0):
    """bfloat16 values of every class: random bit patterns (NaNs with payloads and signs,
    infinities, subnormals), then ordinary and fp8-overflowing magnitudes, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    bits = torch.randint(0, 1 << 16, (n,), generator=g, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).clone()
    x[: n // 2] = torch.randn(n // 2, generator=g).to(torch.bfloat16) * 300
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("-inf")], dtype=torch.bfloat16)
    return x.view(*shape)


def scaling_cast(x, scale, fp8):
    """torchao's float8 cast (hp_tensor_and_scale_to_float8): to float32, times the scale,
    clamped to the format's range, to fp8."""
    m = torch.finfo(fp8).max
    return (x.to(torch.float32) * scale).clamp(-m, m).to(fp8)


def as_bits(t):
    return t.cpu().view(torch.uint8) if t.element_size() == 1 else t.cpu().view(torch.int32)


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_scaling_cast_runs_as_one_region_with_cpu_bits(casting, fp8, layout):
    x = hard_bf16(384, 200, seed=1)
    if layout == "transposed":
        x = x.t()  # a weight's transpose: dense, not contiguous
    scale = torch.tensor(1.7)
    want = scaling_cast(x, scale, fp8)
    before = engine.stats()
    got = scaling_cast(x.to("neuron"), scale.to("neuron"), fp8)
    torch.neuron.synchronize()
    after = engine.stats()
    assert after["fused"] - before["fused"] == 4 and after["tiled"] - before["tiled"] == 1
    assert got.stride() == want.stride()
    assert torch.equal(as_bits(got), as_bits(want))


def test_fused_equals_unfused_bit_for_bit_on_every_float32_pattern(casting):
    # Random float32 bits through each step kept (stored) and chained: NaN payloads pass
    # through the scale and the clamp as on ATen's paths, and narrow as c10 narrows them.
    g = torch.Generator().manual_seed(2)
    f = torch.randint(-(2**31), 2**31 - 1, (70001,), generator=g, dtype=torch.int32).view(torch.float32)

    def program(t, s):
        a = t * s
        b = a.clamp(-300.0, 200.0)
        return a, b, b.to(torch.float8_e4m3fn), a.to(torch.float8_e5m2)

    want = program(f, torch.tensor(-0.75))
    before = engine.stats()["tiled"]
    got = program(f.to("neuron"), torch.tensor(-0.75, device="neuron"))
    torch.neuron.synchronize()
    assert engine.stats()["tiled"] - before == 1
    for g_, w in zip(got, want):
        assert torch.equal(as_bits(g_), as_bits(w))
    engine.set_cast_fusion_enabled(False)
    unfused = program(f.to("neuron"), torch.tensor(-0.75, device="neuron"))
    for g_, u in zip(got, unfused):
        assert torch.equal(as_bits(g_), as_bits(u))


def test_tail_of_a_tile_and_of_a_vector_computed_like_the_rest(casting):
    # 1024-element tiles, 16-lane vectors: 40003 elements leave both a partial tile and a
    # scalar tail in each thread's range.
    x = hard_bf16(40003, seed=3)
    want = scaling_cast(x, torch.tensor(0.3), torch.float8_e4m3fn)
    got = scaling_cast(x.to("neuron"), torch.tensor(0.3, device="neuron"), torch.float8_e4m3fn)
    assert torch.equal(as_bits(got), as_bits(want))


def test_nan_bits_pass_scale_and_clamp_in_vectors_and_in_the_tail(casting):
    # 47 elements: two 16-lane vectors and a 15-element scalar tail, every one a NaN of some
    # sign and payload (or an infinity): both paths must keep their bits as ATen's do.
    g = torch.Generator().manual_seed(9)
    payload = torch.randint(1, 1 << 22, (47,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (47,), generator=g, dtype=torch.int32) << 31
    f = (payload | (0xFF << 23) | sign).view(torch.float32)
    f[5], f[40] = float("inf"), float("-inf")

    def program(t, s):
        c = (t * s).clamp(-448.0, 448.0)
        return c, c.to(torch.float8_e4m3fn)

    want = program(f, torch.tensor(2.0))
    got = program(f.to("neuron"), torch.tensor(2.0, device="neuron"))
    for g_, w in zip(got, want):
        assert torch.equal(as_bits(g_), as_bits(w))


def test_a_result_still_referenced_is_stored(casting):
    # The intermediates are kept here: the fused pass must write each of them.
    x = hard_bf16(5000, seed=4)
    s = torch.tensor(2.5)
    xn, sn = x.to("neuron"), s.to("neuron")
    w32 = x.to(torch.float32)
    wm = w32 * s
    wc = wm.clamp(-448.0, 448.0)
    g32 = xn.to(torch.float32)
    gm = g32 * sn
    gc = gm.clamp(-448.0, 448.0)
    g8 = gc.to(torch.float8_e4m3fn)
    for got, want in [(g32, w32), (gm, wm), (gc, wc), (g8, wc.to(torch.float8_e4m3fn))]:
        assert torch.equal(as_bits(got), as_bits(want))


def test_an_output_taking_a_dead_intermediates_memory_joins_the_region(casting):
    # torchao's cast frees each float32 temporary at once, so the fp8 result is allocated in
    # the memory of the product (dead by then): the fuser lets it join instead of ending the
    # region there, and never stores the dead product over it.
    x = hard_bf16(2048, 1024, seed=5)
    s = torch.tensor(3.0)
    xn, sn = x.to("neuron"), s.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()
    got = scaling_cast(xn, sn, torch.float8_e4m3fn)
    torch.neuron.synchronize()
    after = engine.stats()
    assert after["fused"] - before["fused"] == 4  # all four kernels in one region
    assert torch.equal(as_bits(got), as_bits(scaling_cast(x, s, torch.float8_e4m3fn)))


def test_overlapping_views_of_one_live_allocation_end_the_region(casting):
    # Two casts into overlapping views of one buffer: the second overwrites part of the first.
    # Fused in one pass, tile order would interleave them; the region must end between them.
    a, b = hard_bf16(4096, seed=6), hard_bf16(4096, seed=7)
    want = torch.empty(4096 + 512)
    want[:4096].copy_(a)
    want[512:].copy_(b)
    base = torch.empty(4096 + 512, device="neuron")
    an, bn = a.to("neuron"), b.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()["fused"]
    base[:4096].copy_(an)
    base[512:].copy_(bn)
    torch.neuron.synchronize()
    assert engine.stats()["fused"] == before  # two single-kernel regions: nothing fused
    assert torch.equal(as_bits(base), as_bits(want))


def test_a_factor_inside_a_buffer_of_the_region_ends_the_region(casting):
    # The 0-dim factor is an element of a tensor the region writes: read when the fused pass
    # starts, it would be the value before that write.
    x = hard_bf16(4096, seed=8)
    xn = x.to("neuron")
    y = xn.to(torch.float32)
    z = y * y[7]
    want = x.to(torch.float32) * x.to(torch.float32)[7]
    assert torch.equal(as_bits(z), as_bits(want))


@pytest.mark.parametrize("lo,hi", [(float("nan"), 1.0), (5.0, -5.0)])
def test_clamp_with_a_nan_bound_or_an_empty_range_matches_cpu(casting, lo, hi):
    # A NaN bound is left to ATen's kernel (no record); an empty range (lo > hi) fuses and
    # gives hi, as ATen's max-then-min does.
    f = torch.randn(4096) * 10
    s = torch.tensor(1.5)
    want = (f * s).clamp(lo, hi)
    got = (f.to("neuron") * s.to("neuron")).clamp(lo, hi)
    assert torch.equal(as_bits(got), as_bits(want))


def test_clamp_bounds_past_float32_raise_cpu_error_and_lose_nothing(casting):
    # CPU raises converting the bound; the fuser leaves such a clamp to ATen's kernel, whose
    # error surfaces, and the product before it is still computed.
    f = torch.randn(4096) * 10
    fn, sn = f.to("neuron"), torch.tensor(1.5, device="neuron")
    with pytest.raises(RuntimeError, match="overflow"):
        (f * 1.5).clamp(-1e300, 1e300)
    with pytest.raises(RuntimeError, match="overflow"):
        m = fn * sn
        m.clamp(-1e300, 1e300)
        torch.neuron.synchronize()
    assert torch.equal(as_bits(m), as_bits(f * torch.tensor(1.5)))


def test_deterministic_algorithms_turn_cast_fusion_off(casting):
    x = torch.randn(4096, dtype=torch.bfloat16, device="neuron")
    s = torch.tensor(2.0, device="neuron")
    torch.neuron.synchronize()
    before = engine.stats()["tiled"]
    torch.use_deterministic_algorithms(True)
    try:
        scaling_cast(x, s, torch.float8_e4m3fn)
        torch.neuron.synchronize()
    finally:
        torch.use_deterministic_algorithms(False)
    assert engine.stats()["tiled"] == before


def test_a_fused_cast_region_failing_reports_at_the_next_synchronization(casting):
    x = torch.randn(4096, dtype=torch.bfloat16, device="neuron")
    s = torch.tensor(2.0, device="neuron")
    torch.neuron.synchronize()
    torchneuron._C._fusion_fail_after(0)
    scaling_cast(x, s, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="fused region of 4 kernels.*injected fault"):
        torch.neuron.synchronize()
    got = scaling_cast(x, s, torch.float8_e4m3fn)  # the device stays usable
    assert torch.equal(as_bits(got), as_bits(scaling_cast(x.cpu(), s.cpu(), torch.float8_e4m3fn)))


CONFIGURED = "import torch; e = torch.neuron.engine; print(e.is_cast_fusion_enabled(), e.is_fusion_enabled())"


@pytest.mark.parametrize("value,casts,generated", [("", True, False), ("1", True, True), ("0", False, False)])
def test_cast_fusion_configured_by_environment(value, casts, generated):
    r = run_python(CONFIGURED, env={"TORCH_NEURONX_ENABLE_CONCATENATION": value})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(casts), str(generated)]


def test_torchao_float8_training_step_equals_unfused(casting):
    # torchao's float8 linear: 12 scaling casts a step, each a region; the gradients equal
    # the step with the family off, bit for bit.
    pytest.importorskip("torchao")
    from torchao.float8 import convert_to_float8_training

    def grads():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.GELU(),
                                    torch.nn.Linear(128, 64, bias=False)).to("neuron", torch.bfloat16)
        convert_to_float8_training(model)
        x = torch.randn(32, 64, device="neuron", dtype=torch.bfloat16, requires_grad=True)
        model(x).float().square().sum().backward()
        return [p.grad.cpu() for p in model.parameters()] + [x.grad.cpu()]

    before = engine.stats()["tiled"]
    fused = grads()
    assert engine.stats()["tiled"] - before >= 6
    engine.set_cast_fusion_enabled(False)
    for f, u in zip(fused, grads()):
        assert torch.equal(f.view(torch.int16), u.view(torch.int16))
