"""examples/llama_nkilib.py: trains through the NKI-lib kernels and models their time."""

import re

from support import REPO, run_python


def test_llama_example_trains_through_the_kernels_and_models_them():
    p = run_python(f"import runpy, sys; sys.argv = ['llama_nkilib.py', '--steps', '4']; "
                   f"runpy.run_path({REPO + '/examples/llama_nkilib.py'!r}, run_name='__main__')",
                   timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", p.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    for kernel in ("attention_cte fwd", "attention_bwd", "moe_cte fwd", "moe_cte bwd",
                   "rmsnorm fwd", "rmsnorm bwd", "rope fwd+bwd", "cross_entropy bwd"):
        assert kernel in p.stdout, kernel
    assert float(re.search(r"total ([\d.]+) us", p.stdout).group(1)) > 0
