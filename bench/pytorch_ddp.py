#!/usr/bin/python3
"""PyTorch DDP (gloo) reference for bench/ddp_side_by_side.sh.

Spawns --nprocs ranks itself (torch.multiprocessing), trains the MLP
512-1024-1024-1024-10 with SGD(lr=0.01) on synthetic data, batch --batch per
rank, one thread per process, and prints on rank 0

    RESULT tag=pytorch_ddp world=N global_samples_per_s=X steps_per_s=Y

after --warmup untimed steps and --steps timed ones. Every rank also prints
its median phase times (forward, backward including DDP's wait for the
gradient all-reduces that end backward, optimizer step, zero_grad).

Run it with Debian's interpreter (python3-torch): /usr/bin/python3 bench/pytorch_ddp.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytorch_common as common  # noqa: E402  (sets one thread per process before torch loads)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def worker(rank, args, port):
    world = args.nprocs
    distributed = world > 1
    common.init_rank(rank, world, port)
    torch.manual_seed(0)
    model = common.make_mlp()
    if distributed:
        model = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = common.make_batches(args.batch, rank)

    timings = common.train_timed(model, optimizer, batches, args.warmup, args.steps, distributed)

    print(common.phase_line(rank, timings, args.steps, "optimizer"), flush=True)
    if distributed:
        dist.barrier()
    if rank == 0:
        print(common.result_line(args, world, timings), flush=True)
    common.exit_now()


def main():
    p = common.arg_parser(__doc__)
    p.add_argument("--tag", default="pytorch_ddp")
    return common.spawn_ranks(worker, p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
