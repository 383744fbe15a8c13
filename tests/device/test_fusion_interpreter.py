"""Adaptive Eager's interpreted kernel: with the generated kernels off (the default), the foreach
list kernels of an optimizer step run as one fused region by a precompiled loop, nothing
compiled, bit-identical to running them one by one.

Oracle: the same program with the engine on and the precompiled families off
(torch.neuron.engine.set_cast_fusion_enabled(False)), kernels one by one (which
tests/device/test_engine.py checks against CPU). Sizes: 40003 elements split over two threads
with scalar remainders (ATen's own kernels run those), 20000 (below the grain: one range,
where two threads would split it), 37 (one vector pair and a remainder), 513
(a tile and one vector pair more), 256 (vectors only), 1 (a remainder only).
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch
import torchneuron._C as _C

from support import run_python

engine = torch.neuron.engine

pytestmark = pytest.mark.skipif(not _C._fusion_interpreter_available(),
                                reason="the interpreted kernel needs AVX-512, ATen's AVX2/AVX-512 kernels and MKL")

SIZES = [40003, 20000, 37, 513, 256, 1]


@pytest.fixture
def interpreting():
    was = engine.is_enabled(), engine.is_fusion_enabled(), engine.is_cast_fusion_enabled()
    engine.set_enabled(True)
    engine.set_fusion_enabled(False)
    engine.set_cast_fusion_enabled(True)
    yield
    torch.neuron.synchronize()
    engine.set_enabled(was[0])
    engine.set_fusion_enabled(was[1])
    engine.set_cast_fusion_enabled(was[2])


def interpreted_and_unfused(program, make_inputs):
    """Final tensors of `program` interpreted and unfused, and how many groups ran interpreted."""
    engine.set_cast_fusion_enabled(False)
    unfused = make_inputs()
    program(unfused)
    expected = [t.cpu() for t in unfused]
    engine.set_cast_fusion_enabled(True)
    before = engine.stats()["interpreted"]
    tensors = make_inputs()
    program(tensors)
    got = [t.cpu() for t in tensors]
    return got, expected, engine.stats()["interpreted"] - before


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam-amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "sgd-nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2)),
    "radam": (torch.optim.RAdam, dict(lr=1e-2)),
    "adamax": (torch.optim.Adamax, dict(lr=1e-2)),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_steps_interpreted_bit_identical_to_unfused(interpreting, name):
    cls, kwargs = OPTIMIZERS[name]

    def make_inputs():
        g = torch.Generator().manual_seed(0)
        return [torch.randn(n, generator=g).to("neuron") for n in SIZES * 4]

    def program(t):
        params = [p.requires_grad_() for p in t[:len(SIZES)]]
        opt = cls(params, foreach=True, **kwargs)
        for step in range(3):
            for p, g in zip(params, t[len(SIZES) * (step + 1):len(SIZES) * (step + 2)]):
                p.grad = g
            opt.step()
        for p in params:
            p.requires_grad_(False)
        # The optimizer's state too (moments, squared averages, maxima).
        t.extend(v for s in opt.state.values() for v in s.values() if v.device.type == "neuron" and v.dim() > 0)

    got, expected, interpreted = interpreted_and_unfused(program, make_inputs)
    assert interpreted >= len(SIZES)  # one group per size at least (the steps queue as one run)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert same_bits(g, e)


LIST_FORMS = ["add_list", "sub_list", "add_scalar", "sub_scalarlist", "mul_list", "mul_scalar",
              "mul_scalarlist", "div_list", "div_scalar", "div_scalarlist", "addcmul_scalar",
              "addcmul_scalarlist", "addcdiv_scalar", "addcdiv_scalarlist", "lerp", "lerp_half", "sqrt_", "sqrt"]


def random_list_program(seed: int, nlists: int = 5):
    """Every in-place foreach form the fuser takes, then random ones, over `nlists` lists (one
    tensor of each size): Python numbers of both signs, lerp weights on both sides of 0.5, a list
    given twice (addcmul_(v, g, g)), sqrt of negative values (NaN) and a functional sqrt's
    result that is dropped after use (an intermediate nothing stores)."""
    rng = random.Random(seed)
    forms = LIST_FORMS + [rng.choice(LIST_FORMS) for _ in range(40)]
    steps = [(f, [rng.randrange(nlists) for _ in range(3)], rng.choice([-1.5, -0.3, 0.25, 0.7, 2.0, 3]),
              [rng.choice([-2.0, -0.1, 0.3, 1.7]) for _ in SIZES]) for f in forms]

    def program(t):
        lists = [t[i * len(SIZES):(i + 1) * len(SIZES)] for i in range(nlists)]
        for form, (a, b, c), v, vs in steps:
            A, B, C = lists[a], lists[b], lists[c]
            if form == "add_list":
                torch._foreach_add_(A, B, alpha=v)
            elif form == "sub_list":
                torch._foreach_sub_(A, B, alpha=v)
            elif form == "add_scalar":
                torch._foreach_add_(A, v)
            elif form == "sub_scalarlist":
                torch._foreach_sub_(A, vs)
            elif form == "mul_list":
                torch._foreach_mul_(A, B)
            elif form == "mul_scalar":
                torch._foreach_mul_(A, v)
            elif form == "mul_scalarlist":
                torch._foreach_mul_(A, vs)
            elif form == "div_list":
                torch._foreach_div_(A, B)
            elif form == "div_scalar":
                torch._foreach_div_(A, v)
            elif form == "div_scalarlist":
                torch._foreach_div_(A, vs)
            elif form == "addcmul_scalar":
                torch._foreach_addcmul_(A, B, C, value=v)
            elif form == "addcmul_scalarlist":
                torch._foreach_addcmul_(A, B, B, vs)
            elif form == "addcdiv_scalar":
                torch._foreach_addcdiv_(A, B, C, value=v)
            elif form == "addcdiv_scalarlist":
                torch._foreach_addcdiv_(A, B, C, vs)
            elif form == "lerp":
                torch._foreach_lerp_(A, B, v / 4)
            elif form == "lerp_half":  # |w| = 0.5 takes the end-based formula
                torch._foreach_lerp_(A, B, 0.5 if v > 0 else -0.5)
            elif form == "sqrt_":
                torch._foreach_sqrt_(A)
            elif form == "sqrt":
                d = torch._foreach_sqrt(B)
                torch._foreach_add_(A, d, alpha=v)
                del d
    return program, nlists


@pytest.mark.parametrize("seed", range(4))
def test_random_list_programs_interpreted_bit_identical_to_unfused(interpreting, seed):
    program, nlists = random_list_program(seed)

    def make_inputs():
        g = torch.Generator().manual_seed(seed)
        return [(torch.rand(n, generator=g) * 2 - 0.2).to("neuron") for _ in range(nlists) for n in SIZES]

    got, expected, interpreted = interpreted_and_unfused(program, make_inputs)
    assert interpreted >= 4
    for g, e in zip(got, expected):
        assert same_bits(g.nan_to_num(), e.nan_to_num()) and torch.equal(g.isnan(), e.isnan())


def adamw_step(sizes):
    params = [torch.randn(n).to("neuron").requires_grad_() for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)
    opt.step()  # (the first step creates the state: its lists differ)
    torch.neuron.synchronize()
    return opt


def test_an_adamw_step_runs_as_one_interpreted_region_with_nothing_compiled(interpreting):
    # Its lists (weight decay, lerp, mul, addcmul, sqrt, div, add, addcdiv) over parameters of
    # three sizes: one region, every list kernel in it, one group per size, no compile asked.
    opt = adamw_step([40003, 256, 1])
    before = engine.stats()
    opt.step()
    torch.neuron.synchronize()
    after = engine.stats()
    assert after["regions"] - before["regions"] == 1
    assert after["fused"] - before["fused"] == after["enqueued"] - before["enqueued"] == 8
    assert after["interpreted"] - before["interpreted"] == 3
    assert after["kernels_requested"] == before["kernels_requested"]


N = 4096  # one thread's range, whole vector pairs: no scalar remainder


def test_a_dropped_list_result_is_not_stored(interpreting):
    # An optimizer's denominators: a functional sqrt's list, read by the next list kernel and
    # dropped before the queue runs, stays in the scratch tiles; its memory is never written.
    g = torch.Generator().manual_seed(3)
    p, v = torch.rand(N, generator=g).to("neuron"), torch.rand(N, generator=g).to("neuron")
    want = p.cpu() + torch.sqrt(v.cpu()) / 2
    torch.neuron.synchronize()
    before = engine.stats()["interpreted"]
    d = torch._foreach_sqrt([v])
    torch._foreach_div_(d, 2.0)
    torch._foreach_add_([p], d)
    ptr = d[0].data_ptr()
    del d  # dropped while its kernels are queued: its block is free, the kernels not yet run
    sentinel = torch.full((N,), 7.0)
    ctypes.memmove(ptr, sentinel.data_ptr(), 4 * N)
    torch.neuron.synchronize()
    assert engine.stats()["interpreted"] - before == 1
    assert torch.equal(p.cpu(), want)
    poisoned = torch.frombuffer((ctypes.c_float * N).from_address(ptr), dtype=torch.float32)
    assert torch.equal(poisoned, sentinel)  # the sqrt's values were never stored


def test_single_kernels_are_not_interpreted(interpreting):
    # Elementwise kernels outside foreach lists carry no record unless the generated kernels
    # are on: they run one by one.
    a, b = torch.rand(N, device="neuron"), torch.rand(N, device="neuron")
    before = engine.stats()
    for _ in range(3):
        a.mul_(b).add_(b, alpha=0.5).addcdiv_(b, a)
    torch.neuron.synchronize()
    after = engine.stats()
    assert after["fused"] == before["fused"] and after["interpreted"] == before["interpreted"]


def test_generated_kernels_on_take_the_lists_instead(interpreting):
    opt = adamw_step([N, 37])
    engine.set_fusion_enabled(True)
    before = engine.stats()["interpreted"]
    for _ in range(3):
        opt.step()
        torch.neuron.synchronize()
    assert engine.stats()["interpreted"] == before


def test_precompiled_families_off_turn_it_off(interpreting):
    opt = adamw_step([N, 37])
    engine.set_cast_fusion_enabled(False)
    before = engine.stats()
    opt.step()
    torch.neuron.synchronize()
    after = engine.stats()
    assert after["interpreted"] == before["interpreted"] and after["fused"] == before["fused"]


def test_deterministic_algorithms_turn_it_off(interpreting):
    opt = adamw_step([N, 37])
    before = engine.stats()
    torch.use_deterministic_algorithms(True)
    try:
        opt.step()
        torch.neuron.synchronize()
    finally:
        torch.use_deterministic_algorithms(False)
    after = engine.stats()
    assert after["interpreted"] == before["interpreted"] and after["fused"] == before["fused"]


STEP = """
import torch
params = [torch.randn(n).to("neuron").requires_grad_() for n in (4096, 37)]
for p in params:
    p.grad = torch.randn_like(p)
opt = torch.optim.AdamW(params, foreach=True)
for _ in range(2):
    opt.step()
torch.neuron.synchronize()
print(torch.neuron.engine.stats()["interpreted"])
"""


@pytest.mark.parametrize("value,on", [("", True), ("0", False)], ids=["unset", "0"])
def test_interpreted_by_default_and_off_with_concatenation_0(value, on):
    # (The engine on whatever the suite runs with: the synchronous pass sets NEURON_LAUNCH_BLOCKING.)
    env = {"TORCH_NEURONX_ENABLE_CONCATENATION": value, "NEURON_LAUNCH_BLOCKING": "0",
           "TORCHNEURON_ASYNC_EXECUTION": "1"}
    r = run_python(STEP, env=env)
    assert r.returncode == 0, r.stderr
    assert (int(r.stdout.split()[-1]) > 0) == on
