"""Starting a profiler session while another Python thread runs must not deadlock.

kineto starts neuron's activity profiler holding its controller's mutex, after torch's Python
tracer was installed on every thread; the session's Python start callback, run there, could hand
the GIL to a traced thread that then waits for that mutex (csrc/backend/profiler.cpp, start()).
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, threading, torch, torchneuron
    sys.setswitchinterval(1e-6)  # hand the GIL over at every chance
    stop = False
    def busy():
        x = 0
        while not stop:
            x += len(str(x))  # calls: each is a traced Python event
    threading.Thread(target=busy, daemon=True).start()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.PrivateUse1]
    model = torch.nn.Linear(4, 4).to("neuron")
    for _ in range(20):
        with torch.profiler.profile(activities=acts, with_stack=True) as prof:
            model(torch.ones(2, 4, device="neuron")).sum().item()
    stop = True
    print("finished")
""")


def test_profiling_while_another_python_thread_runs_does_not_deadlock():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finished" in done.stdout
