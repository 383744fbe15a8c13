"""A consumer process for the IPC tests that stays up across tests.

Starting a process that imports torch costs seconds on a 2-core machine, so the tests share one
consumer per start method. It receives neuron tensors from the test process (the producer) over
a ``torch.multiprocessing`` queue or pipe, keeps them under a key, and runs small commands on
them; every reply carries CPU data or plain numbers, so the oracle comparisons happen in the
producer. Every wait has a timeout: nothing can hang the suite.
"""

from __future__ import annotations

import gc
import queue
import traceback

import torch
import torch.multiprocessing as mp
from torch.utils.data import Dataset


def _describe(obj):
    if isinstance(obj, torch.UntypedStorage):
        return str(obj.device), bytes(obj.cpu())
    return str(obj.device), obj.detach().cpu()


def _hold(held, conn, key, obj):
    held[key] = obj
    return _describe(obj)


def _hold_from_pipe(held, conn, key):
    held[key] = conn.recv()
    return _describe(held[key])


def _read(held, conn, key):
    return _describe(held[key])


def _add_(held, conn, key, value):
    held[key].add_(value)
    torch.neuron.synchronize()  # the producer reads it next (as on CUDA, with the engine on)


def _release(held, conn, key):
    del held[key]
    gc.collect()


def _same_memory(held, conn, a, b):
    return held[a].untyped_storage().data_ptr() == held[b].untyped_storage().data_ptr()


def _send_back(held, conn, key):
    return held[key]  # a received tensor: sharing it on must fail (CUDA's rule)


def _resize(held, conn, key, nbytes):
    held[key].untyped_storage().resize_(nbytes)


def _memory_allocated(held, conn):
    return torch.neuron.memory_allocated()


COMMANDS = {f.__name__[1:]: f for f in [_hold, _hold_from_pipe, _read, _add_, _release, _same_memory,
                                         _send_back, _resize, _memory_allocated]}


def serve(requests, replies, conn, argument) -> None:
    held: dict = {"argument": argument}  # a neuron tensor passed as a Process argument
    while True:
        try:
            msg = requests.get()
        except Exception:  # unpickling failed: report it, keep serving
            replies.put(("error", traceback.format_exc()))
            continue
        if msg is None:
            break
        cmd, *args = msg
        try:
            replies.put(("ok", COMMANDS[cmd](held, conn, *args)))
        except Exception:
            replies.put(("error", traceback.format_exc()))


class Consumer:
    def __init__(self, method: str, argument: torch.Tensor):
        ctx = mp.get_context(method)
        self.requests, self.replies = ctx.Queue(), ctx.Queue()
        self.pipe, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(self.requests, self.replies, child_end, argument),
                                daemon=True)
        self.proc.start()

    def call(self, cmd: str, *args, timeout: float = 120.0):
        """Run a command; returns its value, or raises AssertionError with the consumer's
        traceback. An exception raised while unpickling the reply is raised as is."""
        self.requests.put((cmd, *args))
        try:
            status, value = self.replies.get(timeout=timeout)
        except queue.Empty:
            alive = self.proc.is_alive()
            self.stop()
            raise TimeoutError(f"consumer did not answer {cmd!r} within {timeout} s (alive: {alive})")
        if status == "error":
            raise AssertionError(f"{cmd} failed in the consumer:\n{value}")
        return value

    def stop(self) -> None:
        try:
            self.requests.put(None)
        except Exception:
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


class NeuronRows(Dataset):
    """Items created on the device inside DataLoader workers."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3,), float(i), device="neuron")
