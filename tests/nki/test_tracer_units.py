"""The kernel context of torchneuron/nki/tracer.py, rule by rule, without running a kernel:
what a context starts with, where its storage ids and random numbers come from, which context
is current, and which source line counts as the kernel's (the innermost frame outside the
package). Frames "inside the package" are made by compiling code under a file name there.
"""

import _thread
import os
import sys
import threading

import numpy as np
import pytest

from torchneuron.nki import tracer
from torchneuron.nki.errors import NKITracingError
from torchneuron.nki.launch import Launch
from torchneuron.platform import get_platform

PLAT = get_platform("trn2")
PKG_FILE = os.path.join(tracer._PKG_DIR, "made_up_module.py")  # a file name inside torchneuron/nki


def _compiled(source: str, filename: str, **env) -> dict:
    ns = dict(env)
    exec(compile(source, filename, "exec"), ns)
    return ns


def _line() -> int:
    return sys._getframe(1).f_lineno


# --- a new context -------------------------------------------------------------------------------
def test_a_context_keeps_its_platform_program_launch_mode_and_kernel_file():
    launch = Launch(2)
    ctx = tracer.KernelContext(PLAT, 1, launch, numerics=False, seed=3, kernel_file="/k.py")
    assert (ctx.platform, ctx.program_id, ctx.launch, ctx.numerics, ctx.kernel_file) == (
        PLAT, 1, launch, False, "/k.py")


def test_numerics_are_computed_unless_asked_otherwise():
    assert tracer.KernelContext(PLAT, 0, Launch(1)).numerics is True


def test_the_kernel_file_is_unknown_unless_given():
    assert tracer.KernelContext(PLAT, 0, Launch(1)).kernel_file is None


def test_a_context_starts_empty_synchronised_at_zero_and_active():
    ctx = tracer.KernelContext(PLAT, 0, Launch(1))
    assert ctx.instructions == [] and ctx.accumulators == {}
    assert (ctx.sync_seq, ctx.shared_index, ctx.active) == (0, 0, True)


def test_its_memory_ledger_is_for_its_platform_and_knows_the_context():
    ctx = tracer.KernelContext(PLAT, 0, Launch(1))
    assert ctx.memory.platform is PLAT and ctx.memory._ctx is ctx and ctx.memory.records == []


def test_each_program_draws_from_the_seed_plus_its_program_id():
    ctx = tracer.KernelContext(PLAT, 1, Launch(2), seed=5)
    np.testing.assert_array_equal(ctx.rng.random(4), np.random.default_rng(6).random(4))


def test_the_default_seed_is_zero():
    ctx = tracer.KernelContext(PLAT, 0, Launch(1))
    np.testing.assert_array_equal(ctx.rng.random(4), np.random.default_rng(0).random(4))


def test_programs_of_one_launch_share_one_sequence_of_storage_ids():
    launch = Launch(2)
    a, b = (tracer.KernelContext(PLAT, pid, launch) for pid in (0, 1))
    assert [a.new_sid(), b.new_sid(), a.new_sid()] == [1, 2, 3]


def test_a_context_without_a_launch_numbers_its_storages_from_one():
    ctx = tracer.KernelContext(PLAT, 0, None)
    assert [ctx.new_sid(), ctx.new_sid()] == [1, 2]


def test_the_number_of_programs_is_the_launchs():
    assert tracer.KernelContext(PLAT, 0, Launch(2)).num_programs == 2


def test_emitted_instructions_are_kept_in_order():
    ctx = tracer.KernelContext(PLAT, 0, Launch(1))
    first = tracer.Instr("a", "vector", 1.0, [], [])
    second = tracer.Instr("b", "dma", 0.0, [], [], nbytes=64)
    ctx.emit(first)
    ctx.emit(second)
    assert ctx.instructions == [first, second] and ctx.instructions[0] is first


# --- the current context -------------------------------------------------------------------------
def test_outside_a_kernel_there_is_no_current_context():
    with pytest.raises(NKITracingError) as info:
        tracer.current()
    err = info.value
    assert err.detail == ("nki.language / nki.isa calls must run inside a kernel launched with nki.jit, "
                          "nki.simulate or nki.benchmark")
    assert err.fix == "decorate the function with @nki.jit and call it, or run nki.simulate(kernel)(*args)"
    assert tracer.current_or_none() is None


def test_the_error_outside_a_kernel_names_the_calling_line():
    line = _line() + 2  # the line of the call below
    with pytest.raises(NKITracingError) as info:
        tracer.current()
    assert info.value.location == f"{__file__}:{line}"


def test_an_activated_context_is_current():
    ctx = tracer.KernelContext(PLAT, 0, Launch(1))
    with tracer.activate(ctx) as entered:
        assert entered is ctx
        assert tracer.current() is ctx and tracer.current_or_none() is ctx


def test_leaving_a_context_deactivates_it_and_restores_the_previous():
    outer, inner = (tracer.KernelContext(PLAT, pid, Launch(2)) for pid in (0, 1))
    with tracer.activate(outer):
        with tracer.activate(inner):
            pass
        assert inner.active is False and outer.active is True
        assert tracer.current() is outer
    assert tracer.current_or_none() is None


def test_an_inactive_context_is_not_current():
    ctx = tracer.KernelContext(PLAT, 0, Launch(1))
    with tracer.activate(ctx):
        ctx.active = False
        with pytest.raises(NKITracingError, match="must run inside a kernel"):
            tracer.current()


def test_an_error_inside_a_context_propagates():
    ctx = tracer.KernelContext(PLAT, 0, Launch(1))
    with pytest.raises(KeyError, match="boom"):
        with tracer.activate(ctx):
            raise KeyError("boom")
    assert ctx.active is False and tracer.current_or_none() is None


def _in_new_thread(fn):
    """``fn()``'s result or exception, run in a thread that never had a context."""
    out = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001  (handed back to the test)
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def test_a_thread_that_never_ran_a_kernel_has_no_current_context():
    assert isinstance(_in_new_thread(tracer.current), NKITracingError)
    assert _in_new_thread(tracer.current_or_none) is None


def test_a_context_can_be_activated_in_a_new_thread():
    ctx = tracer.KernelContext(PLAT, 0, Launch(1))

    def run():
        with tracer.activate(ctx):
            inside = tracer.current()
        return inside, tracer.current_or_none()

    assert _in_new_thread(run) == (ctx, None)


def test_each_thread_has_its_own_current_context():
    ctx = tracer.KernelContext(PLAT, 0, Launch(1))
    seen = []
    with tracer.activate(ctx):
        t = threading.Thread(target=lambda: seen.append(tracer.current_or_none()))
        t.start()
        t.join()
    assert seen == [None]


# --- the kernel's source line --------------------------------------------------------------------
def test_the_user_frame_is_the_direct_caller_outside_the_package():
    ns = _compiled("def kernel():\n    return user_frame()\n", "/user/kernel.py", user_frame=tracer.user_frame)
    assert ns["kernel"]() == ("/user/kernel.py", 2)


def test_frames_inside_the_package_are_skipped():
    ns = _compiled("def helper():\n    return user_frame()\n", PKG_FILE, user_frame=tracer.user_frame)
    line = _line() + 1
    assert ns["helper"]() == (__file__, line)


def test_a_sibling_package_with_the_same_prefix_is_user_code():
    sibling = tracer._PKG_DIR.rstrip(os.sep) + "lib" + os.sep + "kernel.py"  # torchneuron/nkilib/...
    ns = _compiled("def kernel():\n    return user_frame()\n", sibling, user_frame=tracer.user_frame)
    assert ns["kernel"]() == (sibling, 2)


def test_the_location_is_file_colon_line():
    ns = _compiled("def kernel():\n    return user_location()\n", "/user/kernel.py",
                   user_location=tracer.user_location)
    assert ns["kernel"]() == "/user/kernel.py:2"


def test_a_stack_entirely_inside_the_package_has_no_user_frame():
    # _thread starts the function with no frame below it (threading.Thread adds threading.py's)
    inside = _compiled("def f(frame, loc):\n    return frame(), loc()\n", PKG_FILE)["f"]
    ns = _compiled("def entry(out, done, frame, loc, inside):\n"
                   "    try:\n        out.append(inside(frame, loc))\n    finally:\n        done.set()\n", PKG_FILE)
    out, done = [], threading.Event()
    _thread.start_new_thread(ns["entry"], (out, done, tracer.user_frame, tracer.user_location, inside))
    assert done.wait(30)
    assert out == [(None, None)]
