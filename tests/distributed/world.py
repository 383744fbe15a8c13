"""A pool of N rank processes that stays up across tests.

Starting a process that imports torch costs seconds on a 2-core machine, so each test does not
spawn its own job: a World starts N processes once (``spawn``), each runs
``init_process_group`` and then executes test cases sent to it (a function named by file and
qualified name, called as ``fn(rank, world_size)`` on every rank). Assertions run inside the
ranks; a failure comes back with the rank's traceback. Every wait has a timeout: a case that
does not finish in time kills the World (the next test starts a fresh one), so nothing hangs.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(rank: int, size: int, port: int) -> dict:
    return {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size),
        "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
    }


_modules: dict = {}


def load_case(path: str, name: str):
    mod = _modules.get(path)
    if mod is None:
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        spec = importlib.util.spec_from_file_location(f"case_{len(_modules)}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _modules[path] = mod
    return getattr(mod, name)


def _worker(rank, size, port, backend, timeout_s, extra_env, tasks, results):
    os.environ.update(base_env(rank, size, port))
    os.environ.update(extra_env)
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        import torchneuron.distributed as tnd

        tnd.register()
        torch.manual_seed(0)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        results.put((rank, "ready", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        path, name = task
        try:
            value = load_case(path, name)(rank, size)
            results.put((rank, "ok", value))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class World:
    def __init__(self, size: int, backend: str = "neuron", timeout_s: float = 30.0,
                 extra_env: dict | None = None):
        self.size, self.backend, self.timeout_s = size, backend, timeout_s
        self.extra_env = extra_env or {}
        self.procs: list = []

    def start(self, deadline_s: float = 90.0) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.size)]
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, self.size, port, self.backend, self.timeout_s,
                                        self.extra_env, self.tasks[r], self.results))
                      for r in range(self.size)]
        for p in self.procs:
            p.start()
        self._collect(deadline_s, "start")

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, fn, timeout_s: float = 60.0) -> list:
        """Run ``fn(rank, size)`` on every rank; returns the per-rank values (rank order)."""
        if not self.alive():
            self.stop()
            self.start()
        path = os.path.abspath(sys.modules[fn.__module__].__file__)
        for q in self.tasks:
            q.put((path, fn.__qualname__))
        return self._collect(timeout_s, fn.__name__)

    def _collect(self, timeout_s: float, what: str) -> list:
        deadline = time.monotonic() + timeout_s
        values: dict = {}
        errors: dict = {}
        while len(values) + len(errors) < self.size:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise TimeoutError(f"{what}: ranks {sorted(set(range(self.size)) - set(values) - set(errors))} "
                                   f"did not finish within {timeout_s} s (world killed)")
            try:
                rank, status, value = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if not all(p.is_alive() for p in self.procs):
                    # Give survivors a moment to report their error, then give up.
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                    if time.monotonic() > deadline - timeout_s + 5 or len(errors) + len(values) + len(dead) >= self.size:
                        self.stop()
                        raise RuntimeError(f"{what}: rank(s) {dead} died; errors: {errors}")
                continue
            (errors if status == "error" else values)[rank] = value
        if errors:
            self.stop()  # ranks may be out of step now
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{what} failed:\n{msg}")
        return [values[r] for r in range(self.size)]

    def stop(self) -> None:
        for q in getattr(self, "tasks", []):
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=3)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=3)
        self.procs = []
