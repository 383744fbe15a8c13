"""One rank of a fault scenario (run by test_faults.py as a subprocess).

Prints one line ``RESULT <json>`` describing what this rank observed; the parent asserts on it
and on the exit code. Process group timeout: FAULT_TIMEOUT_S seconds."""

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torchneuron.distributed as tnd


def report(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def main(scenario):
    rank = int(os.environ["RANK"])
    timeout = float(os.environ.get("FAULT_TIMEOUT_S", "2"))
    tnd.register()
    dist.init_process_group("neuron", timeout=timedelta(seconds=timeout))
    t = torch.ones(4, device="neuron")
    dist.all_reduce(t)  # the group works before the fault
    victim = rank == 1

    if scenario == "peer_killed":
        if victim:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.2)
    elif scenario == "peer_stalls":
        if victim:
            time.sleep(60)  # alive, but never joins the collective (the parent kills it)
    elif scenario in ("unwaited_async_teardown", "unwaited_async_cleanup_only"):
        if victim:
            time.sleep(60)  # the parent kills it once rank 0 is done
        start = time.monotonic()
        work = dist.all_reduce(t, async_op=True)  # never waited on: only the watchdog sees it
        time.sleep(timeout + 1.5)  # the watchdog acts at `timeout`
        # teardown mode never gets here (the watchdog aborts the process)
        try:
            work.wait()
            report(rank=rank, error=None)
        except Exception as e:  # noqa: BLE001
            report(rank=rank, error=str(e), elapsed=time.monotonic() - start)
        os._exit(0)

    start = time.monotonic()
    try:
        dist.all_reduce(t)
        report(rank=rank, error=None, elapsed=time.monotonic() - start)
    except Exception as e:  # noqa: BLE001
        report(rank=rank, error=f"{type(e).__name__}: {e}", elapsed=time.monotonic() - start)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
