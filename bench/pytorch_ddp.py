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
import argparse
import os
import socket
import statistics
import sys
import time

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

WIDTHS = (512, 1024, 1024, 1024, 10)


def make_mlp(widths):
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def worker(rank, args, port):
    torch.set_num_threads(1)
    world = args.nprocs
    distributed = world > 1
    if distributed:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = make_mlp(WIDTHS)
    if distributed:
        model = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(args.batch, WIDTHS[0], generator=gen),
                torch.randint(WIDTHS[-1], (args.batch,), generator=gen)) for _ in range(8)]

    t_fwd, t_bwd, t_opt, t_zero = [], [], [], []

    def step(i, record):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        optimizer.zero_grad()
        t4 = time.perf_counter()
        if record:
            t_fwd.append(t1 - t0)
            t_bwd.append(t2 - t1)
            t_opt.append(t3 - t2)
            t_zero.append(t4 - t3)

    for i in range(args.warmup):
        step(i, False)
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    for i in range(args.steps):
        step(i, True)
    elapsed = time.perf_counter() - start
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    if distributed:
        dist.barrier()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    slowest = slowest.item()

    def med(v):
        return 1e3 * statistics.median(v)

    print(f"[process {rank}] per-step ms (median): forward {med(t_fwd):.1f} backward+allreduce {med(t_bwd):.1f} "
          f"optimizer {med(t_opt):.1f} zero_grad {med(t_zero):.1f} total {1e3 * elapsed / args.steps:.1f} (mean)",
          flush=True)
    if distributed:
        dist.barrier()
    if rank == 0:
        samples = args.steps * args.batch * world
        print(f"RESULT tag={args.tag} world={world} global_samples_per_s={samples / slowest:.1f} "
              f"steps_per_s={args.steps / slowest:.2f}", flush=True)
    # Leave at once: tearing down the gloo group in 1.13 was seen to hang
    # at exit now and then; the result is already printed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket_cap_mb", type=float, default=25.0)
    p.add_argument("--tag", default="pytorch_ddp")
    args = p.parse_args()
    port = free_port()
    if args.nprocs == 1:
        worker(0, args, port)
    else:
        mp.spawn(worker, args=(args, port), nprocs=args.nprocs, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
