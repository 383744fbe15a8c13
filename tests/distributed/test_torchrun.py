"""The example under torchrun (4 processes, one per logical NeuronCore), and failure teardown."""

import os
import subprocess
import sys
import time

from world import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def torchrun(nproc, script_args, timeout):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = TORCHRUN + [f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
                      f"--master-port={free_port()}"] + script_args
    start = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - start


def test_example_train_fsdp_tp_under_torchrun_matches_cpu():
    p, _ = torchrun(4, ["examples/train_fsdp_tp.py", "--steps", "3", "--check"], timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "match CPU: ok" in p.stdout
    losses = [float(l.split()[-1]) for l in p.stdout.splitlines() if l.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_torchrun_tears_down_job_when_a_worker_fails():
    p, elapsed = torchrun(2, ["tests/distributed/torchrun_fail.py"], timeout=60)
    assert p.returncode != 0
    assert "exitcode  : 3" in p.stderr or "exitcode: 3" in p.stderr or "exit code 3" in p.stderr, p.stderr[-3000:]
    assert elapsed < 30
