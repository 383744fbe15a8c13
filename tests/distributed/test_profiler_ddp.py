"""A 2-rank DDP step under torch.profiler: collectives are device activities on each rank's
communication queue, and each rank writes its own Parquet set."""

import os
import tempfile

import torch

DEV = "neuron"


def _dir(rank_pid):
    return os.path.join(tempfile.gettempdir(), f"torchneuron-profiler-ddp-{rank_pid}")


def case_profile_ddp(rank, size):
    import torch.distributed as dist
    from models import data, make_mlp
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchneuron.profiler.export_parquet import export_parquet, read_parquet_set

    model = DDP(make_mlp().to(DEV))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.PrivateUse1]
    with torch.profiler.profile(activities=acts, schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)) as prof:
        for s in range(3):
            x, y = data(s)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(DEV)), y.to(DEV)).backward()
            opt.step()
            prof.step()
    out = export_parquet(prof, _dir(os.getppid()))
    cc = read_parquet_set(out)["CcOp"].to_pylist()
    assert cc and all(c["group_size"] == size and c["rank"] == rank for c in cc)
    assert {c["collective"] for c in cc} >= {"allreduce"}
    assert all(c["est_ns"] > 0 and 0 <= c["exposed_ns"] <= c["est_ns"] + 1.0 for c in cc), cc
    dist.barrier()
    return len(cc)


def test_ddp_profile_records_collectives_per_rank(world2):
    counts = world2.run(case_profile_ddp, timeout_s=180)
    assert counts[0] == counts[1] > 0
    from torchneuron.profiler.report import write_report

    d = _dir(os.getpid())
    assert sorted(os.listdir(d)) >= ["rank_0", "rank_1"]
    rep = write_report(d)
    assert len(rep.headline) == 2
    md = open(rep.markdown_path).read()
    assert "allreduce" in md
