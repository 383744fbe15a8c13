"""Bad input gets a clear Python exception, never a crash."""

import pytest
import torch

from support import run_python


@pytest.mark.parametrize("make", [
    lambda: torch.ones(1, device="neuron:9"),
    lambda: torch.ones(1).to("neuron:4"),
    lambda: torch.neuron.set_device(7),
    lambda: torch.neuron.memory_allocated(5),
    lambda: torch.neuron.get_device_properties(4),
    lambda: torch.neuron.Stream(device=6),
])
def test_invalid_device_index_names_the_valid_range(make):
    with pytest.raises(RuntimeError, match=r"neuron:\d.*valid indices 0..3"):
        make()


FORK_SCRIPT = """
import os, torch, multiprocessing as mp
torch.ones(1, device='neuron')   # initialises the device in the parent
def child(q):
    try:
        torch.ones(1, device='neuron')
        q.put('no error')
    except RuntimeError as e:
        q.put(str(e))
if __name__ == '__main__':
    ctx = mp.get_context('fork')
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start(); p.join(30)
    print(q.get(timeout=5))
    print('bad fork in parent:', torch.neuron._is_in_bad_fork())
"""


def test_use_in_forked_child_after_init_raises_cuda_style_error(tmp_path):
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    r = run_python(f"exec(open({str(script)!r}).read())")
    assert r.returncode == 0, r.stderr
    assert "Cannot re-initialize neuron in forked subprocess" in r.stdout
    assert "'spawn' start method" in r.stdout
    assert "bad fork in parent: False" in r.stdout


def test_fork_before_init_is_fine(tmp_path):
    script = tmp_path / "fork2.py"
    script.write_text(FORK_SCRIPT.replace("torch.ones(1, device='neuron')   # initialises", "pass  #"))
    r = run_python(f"exec(open({str(script)!r}).read())")
    assert r.returncode == 0, r.stderr
    assert "no error" in r.stdout


def test_out_of_memory_is_a_python_exception():
    r = run_python("import torch\ntry:\n    torch.empty(2 << 30, dtype=torch.uint8, device='neuron')\n"
                   "except torch.OutOfMemoryError as e:\n    print(type(e).__name__)",
                   env={"TORCHNEURON_DEVICE_MEMORY": "1GiB"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OutOfMemoryError"


def test_unsupported_requests_raise_clearly():
    with pytest.raises(NotImplementedError, match="interprocess"):
        torch.neuron.Event(interprocess=True)
    with pytest.raises(NotImplementedError, match="quantized neuron tensors are not implemented"):
        torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8).to("neuron")
    # Quantizing a neuron tensor once returned a plain neuron tensor of the integer codes.
    with pytest.raises(NotImplementedError, match="quantized neuron tensors are not implemented"):
        torch.quantize_per_tensor(torch.ones(2, device="neuron"), 0.1, 0, torch.qint8)
    with pytest.raises(NotImplementedError, match="quantized neuron tensors are not implemented"):
        torch.quantize_per_channel(torch.ones(2, 2, device="neuron"), torch.ones(2, device="neuron"),
                                   torch.zeros(2, device="neuron"), 0, torch.qint8)
    with pytest.raises(RuntimeError, match="pinned"):
        torch.empty(2, device="neuron", pin_memory=True)


def test_shape_errors_from_kernels_surface_as_python_errors():
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.ones(2, 3, device="neuron") @ torch.ones(2, 3, device="neuron")
    with pytest.raises(IndexError):
        torch.ones(3, device="neuron")[5]
