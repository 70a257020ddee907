"""What bench/pytorch_ddp.py and bench/pytorch_zero.py share: the MLP, the
synthetic batches, spawning the ranks, the timed training loop and the
output lines that bench/ddp_side_by_side.sh and bench/zero_side_by_side.sh
parse.

Importing it sets one thread per process (OMP/OpenBLAS/MKL) unless the
environment says otherwise, before torch is imported.
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

WIDTHS = (512, 1024, 1024, 1024, 10)


def make_mlp(widths=WIDTHS):
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_batches(batch, rank, count=8):
    """`count` synthetic (input, label) batches of `batch` samples, seeded by rank."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch, WIDTHS[0], generator=gen),
             torch.randint(WIDTHS[-1], (batch,), generator=gen)) for _ in range(count)]


def init_rank(rank, world, port):
    """One thread, and the gloo group over loopback when there is more than one rank."""
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


class Timings:
    """A timed run: per-step phase times (s), this rank's elapsed time and the slowest rank's."""

    def __init__(self):
        self.forward, self.backward, self.optimizer, self.zero_grad = [], [], [], []
        self.elapsed = 0.0
        self.slowest = 0.0


def train_timed(model, optimizer, batches, warmup, steps, distributed):
    """`warmup` untimed steps, a barrier, then `steps` timed ones; returns Timings
    (slowest: the maximum elapsed time over the ranks)."""
    timings = Timings()

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
            timings.forward.append(t1 - t0)
            timings.backward.append(t2 - t1)
            timings.optimizer.append(t3 - t2)
            timings.zero_grad.append(t4 - t3)

    for i in range(warmup):
        step(i, False)
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(i, True)
    timings.elapsed = time.perf_counter() - start
    slowest = torch.tensor([timings.elapsed], dtype=torch.float64)
    if distributed:
        dist.barrier()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    timings.slowest = slowest.item()
    return timings


def med_ms(v):
    return 1e3 * statistics.median(v)


def phase_line(rank, timings, steps, optimizer_label):
    """The `[process R] per-step ms (median): ...` line, without its newline."""
    t = timings
    return (f"[process {rank}] per-step ms (median): forward {med_ms(t.forward):.1f} "
            f"backward+allreduce {med_ms(t.backward):.1f} {optimizer_label} {med_ms(t.optimizer):.1f} "
            f"zero_grad {med_ms(t.zero_grad):.1f} total {1e3 * t.elapsed / steps:.1f} (mean)")


def result_line(args, world, timings):
    """The start of rank 0's RESULT line: tag, world, global samples/s and steps/s."""
    samples = args.steps * args.batch * world
    return (f"RESULT tag={args.tag} world={world} global_samples_per_s={samples / timings.slowest:.1f} "
            f"steps_per_s={args.steps / timings.slowest:.2f}")


def exit_now():
    """Leave at once: tearing down the gloo group in 1.13 was seen to hang at
    exit now and then; the result is already printed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arg_parser(doc):
    """The options both benchmarks take; each adds its own, then --tag."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket_cap_mb", type=float, default=25.0)
    return p


def spawn_ranks(worker, args):
    """worker(rank, args, port) on args.nprocs ranks: in this process for one, spawned otherwise."""
    port = free_port()
    if args.nprocs == 1:
        worker(0, args, port)
    else:
        mp.spawn(worker, args=(args, port), nprocs=args.nprocs, join=True)
    return 0
