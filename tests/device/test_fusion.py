"""Adaptive Eager (torch.neuron.engine.set_fusion_enabled): runs of queued float32 elementwise
kernels run as one generated kernel, bit-identical to running them one by one.

Oracle: the same program with fusion off (engine on, kernels one by one, which
tests/device/test_engine.py checks against CPU). Each fused case runs its program twice so the
fuser sees each region twice and compiles it, waits for the compilation, and compares the third
run. Sizes: 40003 elements split over two threads with scalar remainders of 2 and 1 (ATen's own
kernels run those), 37 (one vector pair and a remainder), 256 (vectors only).
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from support import run_python
from torchneuron.compile import eager_fusion

engine = torch.neuron.engine


@pytest.fixture
def fusing():
    was, was_fusing = engine.is_enabled(), engine.is_fusion_enabled()
    engine.set_enabled(True)
    engine.set_fusion_enabled(True)
    yield
    torch.neuron.synchronize()
    engine.set_enabled(was)
    engine.set_fusion_enabled(was_fusing)


def compiled_run(run):
    """`run()` twice, so that the fuser sees its regions twice and compiles them, then once more:
    (the last run's result, how many kernels it ran fused). Each run's result is kept until the
    queue ran, as in the last run (else its buffers are free then, and the fuser leaves them
    unstored: another kernel), then dropped, so that each run starts from the same allocator
    state."""
    for _ in range(2):
        warm = run()
        torch.neuron.synchronize()
        del warm
    eager_fusion.wait()
    assert not eager_fusion.errors
    before = engine.stats()["fused"]
    result = run()
    torch.neuron.synchronize()
    return result, engine.stats()["fused"] - before


def fused_and_unfused(program, make_inputs):
    """Final tensors of `program` fused (third run, after compiling) and unfused."""
    engine.set_fusion_enabled(False)
    unfused = make_inputs()
    program(unfused)
    expected = [t.cpu() for t in unfused]
    engine.set_fusion_enabled(True)

    def run():
        tensors = make_inputs()
        program(tensors)
        return tensors

    fused, ran_fused = compiled_run(run)
    return [t.cpu() for t in fused], expected, ran_fused


def random_program(seed: int, sizes: list[int], per_size: int = 4):
    """A random sequence of every fusible op kind (in place, out= and functional forms, Python
    numbers of both signs, lerp weights on both sides of 0.5) over `per_size` buffers of each
    size, the sizes interleaved (so one region holds one group per size)."""
    rng = random.Random(seed)
    steps = []
    for _ in range(60):
        kind = rng.choice(["add_", "sub_", "add_s", "mul_", "mul_s", "div_", "div_s", "addcmul_",
                           "addcdiv_", "lerp_", "add", "mul_out", "sub", "sqrt", "sqrt_list"])
        base = per_size * rng.randrange(len(sizes))
        a, b, c, d = (base + rng.randrange(per_size) for _ in range(4))
        v = rng.choice([-1.5, -0.3, 0.25, 0.7, 2.0, 3])
        steps.append((kind, a, b, c, d, v))

    def program(t):
        for kind, a, b, c, d, v in steps:
            if kind == "add_":
                t[a].add_(t[b], alpha=v)
            elif kind == "sub_":
                t[a].sub_(t[b], alpha=v)
            elif kind == "add_s":
                t[a].add_(v)
            elif kind == "mul_":
                t[a].mul_(t[b])
            elif kind == "mul_s":
                t[a].mul_(v)
            elif kind == "div_":
                t[a].div_(t[b])
            elif kind == "div_s":
                t[a].div_(v)
            elif kind == "addcmul_":
                t[a].addcmul_(t[b], t[c], value=v)
            elif kind == "addcdiv_":
                t[a].addcdiv_(t[b], t[c], value=v)
            elif kind == "lerp_":
                t[a].lerp_(t[b], v / 4)
            elif kind == "add":
                t[d] = torch.add(t[a], t[b], alpha=v)
            elif kind == "mul_out":
                torch.mul(t[a], t[b], out=t[d]) if d not in (a, b) else t[d].mul_(t[a])
            elif kind == "sub":
                t[d] = t[a] - t[b]
            elif kind == "sqrt":  # negative values give NaN, compared as such
                t[d] = torch.sqrt(t[a])
            elif kind == "sqrt_list" and a != b:
                t[c], t[d] = torch._foreach_sqrt([t[a], t[b]])
    return program


def test_random_sequences_fused_bit_identical_to_unfused(fusing):
    sizes = [40003, 37]
    program = random_program(seed=7, sizes=sizes)

    def make_inputs():
        g = torch.Generator().manual_seed(1)
        return [(torch.rand(n, generator=g) + 0.5).to("neuron") for n in sizes for _ in range(4)]

    fused, expected, ran_fused = fused_and_unfused(program, make_inputs)
    assert ran_fused >= 50
    for f, e in zip(fused, expected):
        assert torch.equal(f.nan_to_num(), e.nan_to_num()) and torch.equal(f.isnan(), e.isnan())


def test_adamw_foreach_step_fused_bit_identical_to_unfused(fusing):
    sizes = [40003, 256, 37, 1]

    def make_inputs():
        g = torch.Generator().manual_seed(0)
        return [torch.randn(n, generator=g).to("neuron") for n in sizes * 2]

    def program(t):
        params = [p.requires_grad_() for p in t[:4]]
        for p, g in zip(params, t[4:]):
            p.grad = g
        opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)
        for _ in range(3):
            opt.step()
        for p in params:
            p.requires_grad_(False)

    fused, expected, ran_fused = fused_and_unfused(program, make_inputs)
    assert ran_fused > 0
    for f, e in zip(fused, expected):
        assert torch.equal(f, e)


def test_adamw_foreach_step_runs_as_one_fused_region(fusing):
    # Its lists (weight decay, lerp, mul, addcmul, sqrt, div, add, addcdiv) over parameters of
    # three sizes, a one-element bias among them: one region, every list kernel in it.
    sizes = [40003, 256, 1]
    params = [torch.randn(n).to("neuron").requires_grad_() for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)
    for _ in range(3):
        opt.step()
        torch.neuron.synchronize()
    eager_fusion.wait()
    before = engine.stats()
    opt.step()
    torch.neuron.synchronize()
    after = engine.stats()
    assert after["regions"] - before["regions"] == 1
    assert after["fused"] - before["fused"] == after["enqueued"] - before["enqueued"] == 8


def test_every_foreach_list_form_fused_bit_identical_to_unfused(fusing):
    # Each in-place foreach overload the fuser takes (List with alpha, Scalar, ScalarList; sub,
    # mul, div, addcmul, addcdiv, lerp): a list kernel runs fused whole, one record per element.
    sizes = [40003, 37, 256]

    def make_inputs():
        g = torch.Generator().manual_seed(2)
        return [(torch.rand(n, generator=g) + 0.5).to("neuron") for _ in range(4) for n in sizes]

    def program(t):
        a, b, c, d = t[0:3], t[3:6], t[6:9], t[9:12]
        torch._foreach_add_(a, b, alpha=-0.3)
        torch._foreach_sub_(a, c, alpha=2)
        torch._foreach_add_(b, 0.7)
        torch._foreach_sub_(b, [0.1, -0.2, 3])
        torch._foreach_mul_(c, a)
        torch._foreach_mul_(c, 0.9)
        torch._foreach_mul_(d, [1.5, -0.5, 2])
        torch._foreach_div_(a, d)
        torch._foreach_div_(b, 3.0)
        torch._foreach_div_(c, [7.0, 0.3, -2.0])
        torch._foreach_addcmul_(d, a, b, value=0.25)
        torch._foreach_addcmul_(a, b, c, [0.1, 0.2, -0.3])
        torch._foreach_addcdiv_(b, c, d, value=-0.7)
        torch._foreach_addcdiv_(c, a, d, [1e-3, 2.0, -0.5])
        torch._foreach_lerp_(d, a, 0.6)
        torch._foreach_sqrt_(b)  # NaN for negative elements, compared as such
        torch._foreach_add_(c, torch._foreach_sqrt(d), alpha=0.5)

    fused, expected, ran_fused = fused_and_unfused(program, make_inputs)
    assert ran_fused >= 18          # list kernels, counted as queued items
    for f, e in zip(fused, expected):
        assert torch.equal(f.nan_to_num(), e.nan_to_num()) and torch.equal(f.isnan(), e.isnan())


@pytest.mark.parametrize("first", [600, 500], ids=["element0-joins-a-group", "element0-opens-a-group"])
def test_a_list_kernel_that_cannot_join_a_region_joins_none_of_it(fusing, first):
    # Element 1 of the list overlaps the queued mul's buffer partially, so the list must not join
    # the region of the two kernels before it, not even its element 0 (y would be added twice:
    # once fused, once when the list runs), whether element 0 went into the region's group of
    # 600 elements or opened a group of its own; and what it added is undone cleanly (the
    # region's signature compiles).
    def run(device):
        g = torch.Generator().manual_seed(3)
        base, x, y, w = (torch.rand(n, generator=g).to(device) for n in (1000, 600, first, first))
        x.mul_(2.0)
        base[:600].mul_(x)
        torch._foreach_add_([y, base[300:900]], [w, x])
        return base.cpu(), y.cpu()

    want = run("cpu")
    before, errors = engine.stats()["fused"], len(eager_fusion.errors)
    for _ in range(3):
        got = run("neuron")
        eager_fusion.wait()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert engine.stats()["fused"] > before   # the two kernels before the list ran fused
    assert len(eager_fusion.errors) == errors


def test_generated_kernel_follows_aten_vector_formula_per_op():
    # One kernel holding one op of each kind, each over its own buffers, against the ATen CPU
    # kernel over a vector-only size (no remainder): a wrong formula in KINDS (addcmul without
    # its FMA, say) shows here, op by op.
    ops = [  # (kind, scalars, ATen reference: out, inputs, scalars)
        (0, [0.3], lambda o, x, s: torch.add(x[0], x[1], alpha=s[0], out=o)),
        (1, [-1.7, 0.25], lambda o, x, s: torch.add(x[0], s[0], alpha=s[1], out=o)),
        (2, [], lambda o, x, s: torch.mul(x[0], x[1], out=o)),
        (3, [0.9], lambda o, x, s: torch.mul(x[0], s[0], out=o)),
        (4, [], lambda o, x, s: torch.div(x[0], x[1], out=o)),
        (5, [-0.6], lambda o, x, s: torch.div(x[0], s[0], out=o)),
        (6, [0.7], lambda o, x, s: torch.addcmul(x[0], x[1], x[2], value=s[0], out=o)),
        (7, [-0.45], lambda o, x, s: torch.addcdiv(x[0], x[1], x[2], value=s[0], out=o)),
        (8, [0.75], lambda o, x, s: torch.lerp(x[0], x[1], s[0], out=o)),
        (8, [0.2], lambda o, x, s: torch.lerp(x[0], x[1], s[0], out=o)),
    ]
    sig, slot, firsts, flat = [0], 0, [], []
    for kind, scalars, _ in ops:
        arity = eager_fusion.KINDS[kind][1]
        sig += [kind] + list(range(slot, slot + arity))
        firsts.append(slot)
        flat += scalars
        slot += arity
    sig[0] = slot
    kernel = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)(
        eager_fusion.compile_signature(bytes(sig)))
    n = 4096
    g = torch.Generator().manual_seed(2)
    bufs = [torch.randn(n, generator=g) for _ in range(slot)]
    expected = []
    for (kind, scalars, ref), first in zip(ops, firsts):
        out = torch.empty(n)
        ref(out, bufs[first + 1:first + eager_fusion.KINDS[kind][1]], scalars)
        expected.append(out)
    remainders = (ctypes.c_int64 * 64)()
    kernel((ctypes.c_void_p * slot)(*[b.data_ptr() for b in bufs]), (ctypes.c_float * len(flat))(*flat), n,
           remainders)
    for (kind, _, _), first, e in zip(ops, firsts, expected):
        assert torch.equal(bufs[first], e), eager_fusion.KINDS[kind][0]


def _run_kernel(signature: bytes, bufs: list, scalars: list, n: int) -> None:
    kernel = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)(
        eager_fusion.compile_signature(signature))
    remainders = (ctypes.c_int64 * 64)()
    kernel((ctypes.c_void_p * len(bufs))(*[b.data_ptr() for b in bufs]), (ctypes.c_float * max(1, len(scalars)))(*scalars),
           n, remainders)
    assert remainders[0] == remainders[1]  # vectors only: no scalar remainder left


def test_generated_kernel_with_sqrt_matches_aten_across_tiles():
    # sqrt is MKL's vmsSqrt over tiles: a chain over three tiles and a half (n = 1,792 with
    # 512-element tiles) with sqrt first, in the middle (in place on an unstored slot, which then
    # crosses the call in its scratch tile) and writing a stored slot, against ATen op by op;
    # the unstored slot's memory is never written.
    sqrt = next(i for i, k in enumerate(eager_fusion.KINDS) if k[0] == "sqrt")
    mul, add_scalar, div = 2, 1, 4
    # slots: 0 a, 1 b, 2 t (unstored), 3 out, 4 r
    sig = bytes([5, sqrt, 4, 0, mul, 2, 4, 1, sqrt, 2, 2, add_scalar, 2, 2, sqrt, 3, 2, div, 3, 3, 0,
                 eager_fusion.UNSTORED, 2])
    n = 1792
    g = torch.Generator().manual_seed(8)
    a, b = torch.rand(n, generator=g) * 1e3, torch.rand(n, generator=g)
    a[::7] *= 1e-42  # subnormals: ATen's mode keeps them (flushing them to zero would not)
    t, out, r = torch.full((n,), 7.0), torch.empty(n), torch.empty(n)
    _run_kernel(sig, [a, b, t, out, r], [0.5, 1.0], n)
    want_r = torch.sqrt(a)
    want_t = torch.add(torch.sqrt(want_r * b), 0.5)
    torch.testing.assert_close(r, want_r, rtol=0, atol=0)
    torch.testing.assert_close(out, torch.sqrt(want_t) / a, rtol=0, atol=0)
    assert torch.equal(t, torch.full((n,), 7.0))  # never stored
    assert "vmsSqrt" in eager_fusion.source([sig]) and "store(b2" not in eager_fusion.source([sig])


def test_deterministic_algorithms_turn_fusion_off(fusing):
    a, b = torch.rand(64, device="neuron"), torch.rand(64, device="neuron")
    before = engine.stats()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(3):
            a.mul_(b).add_(b, alpha=0.5)
            torch.neuron.synchronize()
    finally:
        torch.use_deterministic_algorithms(False)
    after = engine.stats()
    assert after["fused"] == before["fused"]
    assert after["kernels_requested"] == before["kernels_requested"]


CONFIGURED = "import torch; print(torch.neuron.engine.is_fusion_enabled())"


@pytest.mark.parametrize("value,on", [(None, False), ("1", True), ("0", False)])
def test_fusion_configured_by_environment(value, on):
    env = {"TORCH_NEURONX_ENABLE_CONCATENATION": value} if value is not None else {}
    if value is None:
        env["TORCH_NEURONX_ENABLE_CONCATENATION"] = ""  # unset: the default
    r = run_python(CONFIGURED, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(on)


EXIT_WITH_COMPILES_QUEUED = """
import sys, time
import torch
from torchneuron.compile import eager_fusion

def slow_compile(signature):
    print("compiled", flush=True)
    time.sleep(0.5)
    return 0

eager_fusion.compile_signature = slow_compile
eager_fusion.request([bytes([3, 2, 0, 1, 2]), bytes([3, 4, 0, 1, 2]), bytes([3, 2, 1, 0, 2]),
                      bytes([3, 4, 1, 0, 2]), bytes([3, 2, 2, 0, 1]), bytes([3, 4, 2, 0, 1])])
time.sleep(0.1)  # the first compile has started
print("exit", flush=True)
"""


def test_a_program_exits_without_waiting_for_queued_compiles():
    # A short script should not linger at exit compiling kernels it will never run; the compile
    # in progress finishes (a half-written library must not stay in the code cache).
    r = run_python(EXIT_WITH_COMPILES_QUEUED)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines.count("exit") == 1
    assert lines.count("compiled") == 1, r.stdout


def test_each_signature_is_its_own_library(monkeypatch):
    # The code cache is keyed by a library's source: with one library per request, a kernel
    # requested with others would be compiled again by a program requesting it alone.
    compiled = []
    monkeypatch.setattr(eager_fusion, "compile_signatures", lambda sigs: compiled.append(list(sigs)) or [0] * len(sigs))
    sigs = [bytes([9, 2, 8, 7, 6]), bytes([9, 4, 8, 7, 6])]  # slots out of first-use order: no
    eager_fusion.request(sigs)                              # region of a test has them
    eager_fusion.wait()
    assert compiled == [[s] for s in sigs]


def test_region_that_fails_to_compile_runs_unfused_and_is_not_retried(fusing, monkeypatch):
    def fail(signatures):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(eager_fusion, "compile_signatures", fail)
    a, b = torch.rand(48, device="neuron"), torch.rand(48, device="neuron")
    a0 = a.cpu()
    before = engine.stats()
    for _ in range(4):
        a.mul_(b).sub_(b, alpha=0.25).div_(3.0)
        torch.neuron.synchronize()
        eager_fusion.wait()
    after = engine.stats()
    assert after["kernels_requested"] - before["kernels_requested"] == 1  # once, never again
    assert after["kernels_failed"] - before["kernels_failed"] == 1
    assert after["fused"] == before["fused"]
    assert any("no compiler today" in e for e in eager_fusion.errors)
    eager_fusion.errors.clear()
    expected = a0.clone()
    bc = b.cpu()
    for _ in range(4):
        expected.mul_(bc).sub_(bc, alpha=0.25).div_(3.0)
    assert torch.equal(a.cpu(), expected)


def test_partially_overlapping_views_end_a_region(fusing, monkeypatch):
    # x[1:] and x[:-1] share all but one element: one group holding both would merge two
    # buffers' elements. The fuser must end the region between them.
    seen = []
    monkeypatch.setattr(eager_fusion, "request", lambda sigs: seen.extend(eager_fusion.parse(s) for s in sigs))
    x = torch.rand(65, device="neuron")
    y, z = torch.rand(64, device="neuron"), torch.rand(64, device="neuron")
    for _ in range(3):
        x[1:].mul_(y)    # kind 2 (mul)
        x[:-1].add_(y)   # kind 0 (add), partially overlapping the previous write
        z.mul_(2.0)      # kind 3 (mul by a number)
        torch.neuron.synchronize()
    kinds = [[kind for kind, _ in ops] for _, ops in seen]
    assert [0, 3] in kinds  # the region after the cut was fused
    assert not any(2 in k and 0 in k for k in kinds)


def test_fused_kernels_count_as_executed_ops(fusing):
    # torchneuron.get_executed_ops() answers "what ran on the device": a fused op still did.
    import torchneuron

    a, b = torch.rand(96, device="neuron"), torch.rand(96, device="neuron")

    def program():
        a.mul_(b).lerp_(b, 0.3)
        torch.neuron.synchronize()

    engine.set_fusion_enabled(False)
    torchneuron.clear_op_tracking()
    program()
    unfused = torchneuron.get_executed_ops()
    engine.set_fusion_enabled(True)
    program()
    program()
    eager_fusion.wait()
    torchneuron.clear_op_tracking()
    before = engine.stats()["fused"]
    program()
    assert engine.stats()["fused"] - before == 2
    assert torchneuron.get_executed_ops() == unfused
    assert unfused.get("aten::mul_.Tensor") == 1 and sum(unfused.values()) == 2


@pytest.mark.parametrize("numel, fuses", [(15, False), (64, True)])
def test_a_kernel_smaller_than_two_vectors_runs_unfused(fusing, numel, fuses):
    # Below two vectors (of AVX2 or AVX-512) ATen's loop is all scalar remainder, which a fused
    # kernel would hand back to ATen op by op: such kernels are not fused; larger ones are.
    def program(t):
        for _ in range(6):
            t[0].add_(t[1], alpha=0.5)
            t[1].mul_(t[0])

    def inputs():
        g = torch.Generator().manual_seed(0)
        return [torch.rand(numel, generator=g).to("neuron") for _ in range(2)]

    fused, expected, ran_fused = fused_and_unfused(program, inputs)
    assert (ran_fused > 0) == fuses
    for f, e in zip(fused, expected):
        torch.testing.assert_close(f, e, rtol=0, atol=0)


def test_a_foreach_list_with_elements_smaller_than_two_vectors_still_fuses_whole(fusing):
    # A list joins whole or not at all: its small elements (a one-element bias) keep a record.
    def program(t):
        for _ in range(3):
            torch._foreach_mul_(t[:2], 0.9)
            torch._foreach_add_(t[:2], t[2:], alpha=0.1)

    def inputs():
        g = torch.Generator().manual_seed(1)
        return [torch.rand(n, generator=g).to("neuron") for n in (1, 256, 1, 256)]

    fused, expected, ran_fused = fused_and_unfused(program, inputs)
    assert ran_fused == 6
    for f, e in zip(fused, expected):
        torch.testing.assert_close(f, e, rtol=0, atol=0)


N = 4096  # one thread's range, whole vector pairs: no scalar remainder


def _fused_third_run(program):
    """`program`'s result in its third run, whose regions ran fused."""
    result, ran_fused = compiled_run(program)
    assert ran_fused >= 2
    return result


def _poison_free_block(ptr):
    """Write 7.0 over the N floats at `ptr`, a freed block (device memory is host memory): a
    kernel that stores there when the queue runs overwrites it."""
    sentinel = torch.full((N,), 7.0)  # (alive until the copy is done)
    ctypes.memmove(ptr, sentinel.data_ptr(), 4 * N)


def _still_poisoned(ptr):
    return torch.equal(torch.frombuffer((ctypes.c_float * N).from_address(ptr), dtype=torch.float32),
                       torch.full((N,), 7.0))


def _requested(monkeypatch):
    """The group signatures the fuser asks to compile (compiled as usual)."""
    seen, request = [], eager_fusion.request
    monkeypatch.setattr(eager_fusion, "request", lambda sigs: (seen.extend(sigs), request(sigs))[1])
    return seen


def test_an_intermediate_nothing_references_is_not_stored(fusing, monkeypatch):
    seen = _requested(monkeypatch)
    g = torch.Generator().manual_seed(3)
    a, b = torch.rand(N, generator=g).to("neuron"), torch.rand(N, generator=g).to("neuron")
    ptrs = []

    def program():
        t = a + b
        out = t * b
        ptrs.append(t.data_ptr())
        del t  # dropped while its kernel is queued: its block is free, the kernel not yet run
        _poison_free_block(ptrs[-1])
        return out

    out = _fused_third_run(program)
    torch.testing.assert_close(out.cpu(), (a.cpu() + b.cpu()) * b.cpu(), rtol=0, atol=0)
    assert _still_poisoned(ptrs[-1])  # t's values were never stored
    assert any(eager_fusion.unstored(s) for s in seen)


def test_an_intermediate_dropped_before_later_kernels_were_queued_is_not_stored(fusing, monkeypatch):
    # As an optimizer step's denominators: dropped, then unrelated work is queued behind the
    # region (here exp into a buffer of its own) before the queue runs.
    seen = _requested(monkeypatch)
    g = torch.Generator().manual_seed(7)
    a, b = torch.rand(N, generator=g).to("neuron"), torch.rand(N, generator=g).to("neuron")
    e = torch.empty(N, device="neuron")
    ptrs = []

    def program():
        t = a.div(b)
        out = t.mul(a)
        ptrs.append(t.data_ptr())
        del t
        _poison_free_block(ptrs[-1])
        torch.exp(b, out=e)  # queued after the region, and after t was dropped
        return out

    out = _fused_third_run(program)
    torch.testing.assert_close(out.cpu(), a.cpu().div(b.cpu()).mul(a.cpu()), rtol=0, atol=0)
    torch.testing.assert_close(e.cpu(), torch.exp(b.cpu()), rtol=0, atol=0)
    assert _still_poisoned(ptrs[-1])  # t's values were never stored
    assert any(eager_fusion.unstored(s) for s in seen)


def test_an_intermediate_a_later_queued_kernel_reads_is_stored(fusing, monkeypatch):
    # exp (no record) is queued after the region and reads t through its alias; the tensor is
    # dropped only after that: t must be stored.
    seen = _requested(monkeypatch)
    g = torch.Generator().manual_seed(4)
    a, b = torch.rand(N, generator=g).to("neuron"), torch.rand(N, generator=g).to("neuron")

    def program():
        t = a - b
        out = t / b
        e = torch.empty(N, device="neuron")
        torch.exp(t, out=e)
        del t
        return out, e

    out, e = _fused_third_run(program)
    expected = a.cpu() - b.cpu()
    torch.testing.assert_close(out.cpu(), expected / b.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(e.cpu(), torch.exp(expected), rtol=0, atol=0)
    assert seen and not any(eager_fusion.unstored(s) for s in seen)


def test_an_intermediate_still_referenced_is_stored(fusing, monkeypatch):
    seen = _requested(monkeypatch)
    g = torch.Generator().manual_seed(5)
    a, b = torch.rand(N, generator=g).to("neuron"), torch.rand(N, generator=g).to("neuron")
    kept = []

    def program():
        t = a * b
        out = t + b
        kept.append(t)
        return out

    out = _fused_third_run(program)
    torch.testing.assert_close(kept[-1].cpu(), a.cpu() * b.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(out.cpu(), a.cpu() * b.cpu() + b.cpu(), rtol=0, atol=0)
    assert seen and not any(eager_fusion.unstored(s) for s in seen)


def test_unstored_slots_parse_from_a_signature():
    sig = bytes([3, 0, 2, 0, 1, 2, 2, 0, 1])
    assert eager_fusion.parse(sig) == eager_fusion.parse(sig + bytes([eager_fusion.UNSTORED, 2]))
    assert eager_fusion.unstored(sig) == set()
    assert eager_fusion.unstored(sig + bytes([eager_fusion.UNSTORED, 2])) == {2}
    src = eager_fusion.source([sig + bytes([eager_fusion.UNSTORED, 2])])
    assert "store(b2" not in src and "unstored [2]" in src


def test_a_fused_region_failing_part_way_reports_at_the_next_synchronization(fusing):
    # A generated kernel cannot fail by itself: the fault is injected after the region's first
    # group (of two: 4096 and 96 elements). What ran stays run; the error names the region and
    # where its first kernel was enqueued, once; the device stays usable.
    import sys

    import torchneuron

    g = torch.Generator().manual_seed(6)
    a, b = torch.rand(N, generator=g).to("neuron"), torch.rand(N, generator=g).to("neuron")
    c, d = torch.rand(96, generator=g).to("neuron"), torch.rand(96, generator=g).to("neuron")

    def program():
        a.add_(b, alpha=0.5)
        c.mul_(d)
        a.mul_(b)
        c.add_(d)

    for _ in range(2):
        program()
        torch.neuron.synchronize()
    eager_fusion.wait()
    a0, c0 = a.cpu(), c.cpu()
    torchneuron._C._fusion_fail_after(1)
    program(); line = sys._getframe().f_lineno  # noqa: E702
    with pytest.raises(RuntimeError) as err:
        torch.neuron.synchronize()
    msg = str(err.value)
    assert "fused region of 4 kernels" in msg and "aten::add_.Tensor" in msg and "injected fault" in msg
    assert f'{__file__}", line {line}' in msg
    torch.testing.assert_close(a.cpu(), a0.add(b.cpu(), alpha=0.5).mul(b.cpu()), rtol=0, atol=0)  # ran
    assert torch.equal(c.cpu(), c0)                                                                  # did not
    torch.neuron.synchronize()  # reported once
    program()
    torch.neuron.synchronize()
    torch.testing.assert_close(c.cpu(), c0.mul(d.cpu()).add(d.cpu()), rtol=0, atol=0)


def test_a_full_queue_leaves_a_growing_region_queued_so_regions_end_at_the_same_kernels(fusing, monkeypatch):
    # A loop that never synchronizes: each step is a product (not fusible) and a run of five
    # fusible kernels, 6 kernels against a queue of 64, so the queue fills at a different point
    # of the step each time. Regions must still be the step's whole run, never a piece cut where
    # the queue happened to fill: one signature, however many steps (each piece would be
    # another kernel to compile).
    seen = []
    monkeypatch.setattr(eager_fusion, "request", lambda sigs: seen.extend(sigs))  # nothing compiles
    w = torch.rand(64, 64, device="neuron")
    x = torch.rand(64, 64, device="neuron")
    for _ in range(50):
        y = x @ w
        y.mul_(0.5).add_(x, alpha=-3.0).div_(7.0).addcmul_(x, y, value=0.125).sub_(2.0)
    torch.neuron.synchronize()
    assert len(set(seen)) == 1, [list(s) for s in set(seen)]
