"""Faults end in an error within the timeout, never a hang (2 ranks, process group timeout 2 s).

Each scenario runs fresh subprocesses (fault_worker.py); the parent kills anything still alive
after a hard deadline, so a regression shows up as a failed test, not a stuck suite."""

import json
import os
import signal
import subprocess
import sys

from world import HERE, base_env, free_port

TIMEOUT_S = 2.0


def run_scenario(scenario, extra_env=None, deadline_s=40):
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, **base_env(rank, 2, port), FAULT_TIMEOUT_S=str(TIMEOUT_S),
                   **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "fault_worker.py"), scenario],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for rank, p in enumerate(procs):
        try:
            # rank 0 is the observer; once it is done the victim (rank 1) has served its purpose
            out, err = p.communicate(timeout=deadline_s if rank == 0 else 0.3)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            if rank == 0:
                raise AssertionError(f"{scenario}: rank 0 hung past {deadline_s} s")
            out, err = p.communicate()
        results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        outs.append({"rc": p.returncode, "results": results, "stderr": err})
    return outs


def test_killed_peer_raises_on_survivor_within_timeout():
    r0, r1 = run_scenario("peer_killed")
    assert r1["rc"] == -signal.SIGKILL
    (res,) = r0["results"]
    assert res["error"] and "RuntimeError" in res["error"], res
    assert res["elapsed"] < TIMEOUT_S + 1.0, res
    assert r0["rc"] == 0  # the survivor's exception was catchable: no watchdog abort


def test_stalled_peer_times_out_blocking_collective():
    r0, r1 = run_scenario("peer_stalls")
    (res,) = r0["results"]
    assert res["error"] and "Timed out" in res["error"], res
    assert TIMEOUT_S - 0.5 < res["elapsed"] < TIMEOUT_S + 1.5, res


def test_watchdog_aborts_process_on_stuck_unwaited_work_and_dumps_flight_recorder(tmp_path):
    prefix = str(tmp_path / "fr_rank")
    r0, r1 = run_scenario("unwaited_async_teardown", {"TORCH_NEURON_FR_DUMP_FILE": prefix})
    assert r0["rc"] == -signal.SIGABRT, r0["stderr"][-2000:]
    assert r0["results"] == []  # killed before it could look at the Work
    assert "watchdog" in r0["stderr"] and "allreduce" in r0["stderr"]
    dump = open(prefix + "0").read().splitlines()
    records = [json.loads(line) for line in dump if line.startswith("{")]
    assert [r["op"] for r in records][-2:] == ["allreduce", "allreduce"]
    assert records[-2]["state"] == "completed"
    assert records[-1]["state"] in ("timed_out", "failed") and records[-1]["shapes"] == "[[4]] -> [[4]]"


def test_watchdog_cleanup_only_mode_fails_work_and_keeps_process():
    r0, r1 = run_scenario("unwaited_async_cleanup_only", {"TORCH_NEURON_ASYNC_ERROR_HANDLING": "2"})
    assert r0["rc"] == 0, r0["stderr"][-2000:]
    (res,) = r0["results"]
    assert res["error"], res
