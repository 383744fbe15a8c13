"""torchrun failure propagation: rank 1 exits with code 3 after the first collective while the
others block in the next one; torchrun must tear the job down (no hang)."""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torchneuron.distributed as tnd

tnd.register()
dist.init_process_group("neuron", timeout=timedelta(seconds=30))
assert torch.neuron.current_device() == int(os.environ["LOCAL_RANK"])
t = torch.ones(2, device="neuron")
dist.all_reduce(t)
if dist.get_rank() == 1:
    # os._exit, not sys.exit: an exit through interpreter finalization closes the transport
    # first, so rank 0's error could reach torchrun before exit code 3 does.
    os._exit(3)
dist.all_reduce(t)  # never completes normally: the peer is gone
