#!/usr/bin/python3
"""PyTorch ZeRO-1 reference for bench/zero_side_by_side.sh: DDP (gloo) with
torch.distributed.optim.ZeroRedundancyOptimizer wrapping Adam(lr=1e-3).

Spawns --nprocs ranks itself (torch.multiprocessing), trains the MLP
512-1024-1024-1024-10 on synthetic data, batch --batch per rank, one thread
per process, and prints on rank 0

    RESULT tag=pytorch_zero1 world=N global_samples_per_s=X steps_per_s=Y step_ms=Z
           param_bytes=P grad_bytes=G optim_bytes=O optim_bytes_max=M

after --warmup untimed steps and --steps timed ones (step_ms: the slowest
rank's mean wall time per step). Every rank prints its median phase times
and its model-state bytes, counted as accel's trainer.model_state_bytes()
counts them (the ZeRO paper's accounting):

  parameters       distinct storages of the model's parameters (all of them:
                   ZeRO-1 keeps the whole model on every rank)
  gradients        distinct storages of the parameters' .grad
  optimizer_state  the tensors of the state that ZeroRedundancyOptimizer's
                   local optimizer holds on this rank that are shaped like
                   their parameter (Adam: exp_avg, exp_avg_sq; the scalar
                   `step` tensors are not counted)

With DDP's default gradient_as_bucket_view=False the Reducer also keeps flat
bucket buffers as large as all gradients together; they are not in
`gradients` but printed as ddp_bucket_bytes (0 with --gradient_as_bucket_view 1).

ZeroRedundancyOptimizer partitions whole parameter tensors over the ranks
(greedy by size), so the optimizer state is split unevenly for a model of a
few large tensors: both ranks' bytes are printed.

Run it with Debian's interpreter (python3-torch): /usr/bin/python3 bench/pytorch_zero.py
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
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

WIDTHS = (512, 1024, 1024, 1024, 10)


def make_mlp(widths):
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.storage()
        key = s.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def model_state_bytes(model, optimizer):
    params = list(model.parameters())
    param_bytes = storage_bytes(params)
    grad_bytes = storage_bytes([p.grad for p in params])
    optim_bytes = 0
    local = optimizer.optim  # the wrapped optimizer: only this rank's partition
    for p, state in local.state.items():
        for v in state.values():
            if torch.is_tensor(v) and v.shape == p.shape:
                optim_bytes += v.numel() * v.element_size()
    return param_bytes, grad_bytes, optim_bytes


def worker(rank, args, port):
    torch.set_num_threads(1)
    world = args.nprocs
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = make_mlp(WIDTHS)
    model = DDP(model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=bool(args.gradient_as_bucket_view))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
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
        optimizer.step()  # the local Adam step on this rank's partition, then the parameter broadcasts
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
    dist.barrier()
    start = time.perf_counter()
    for i in range(args.steps):
        step(i, True)
    elapsed = time.perf_counter() - start
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    dist.barrier()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    slowest = slowest.item()

    # zero_grad() in 1.13 leaves the .grad tensors in place (set_to_none=False):
    # what the rank holds between steps, as accel measures it.
    param_bytes, grad_bytes, optim_bytes = model_state_bytes(model.module, optimizer)
    bucket_bytes = 0 if args.gradient_as_bucket_view else param_bytes
    mine = torch.tensor([param_bytes, grad_bytes, optim_bytes], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)

    def med(v):
        return 1e3 * statistics.median(v)

    # One write per line: both ranks share the pipe, and print() may split a line.
    sys.stdout.write(f"[process {rank}] per-step ms (median): forward {med(t_fwd):.1f} "
                     f"backward+allreduce {med(t_bwd):.1f} optimizer(step+broadcast) {med(t_opt):.1f} "
                     f"zero_grad {med(t_zero):.1f} total {1e3 * elapsed / args.steps:.1f} (mean)\n"
                     f"[process {rank}] model state bytes: parameters {param_bytes} gradients {grad_bytes} "
                     f"optimizer_state {optim_bytes} total {param_bytes + grad_bytes + optim_bytes} "
                     f"(ddp_bucket_bytes {bucket_bytes}; local optimizer holds {len(optimizer.optim.state)} of "
                     f"{len(list(model.parameters()))} parameter tensors)\n")
    sys.stdout.flush()
    dist.barrier()
    if rank == 0:
        samples = args.steps * args.batch * world
        optim_max = int(max(e[2].item() for e in every))
        print(f"RESULT tag={args.tag} world={world} global_samples_per_s={samples / slowest:.1f} "
              f"steps_per_s={args.steps / slowest:.2f} step_ms={1e3 * slowest / args.steps:.2f} "
              f"param_bytes={param_bytes} grad_bytes={grad_bytes} optim_bytes={optim_bytes} "
              f"optim_bytes_max={optim_max} ddp_bucket_bytes={bucket_bytes}", flush=True)
    # Leave at once: tearing down the gloo group in 1.13 was seen to hang at
    # exit now and then; the result is already printed.
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
    p.add_argument("--gradient_as_bucket_view", type=int, default=0)
    p.add_argument("--tag", default="pytorch_zero1")
    args = p.parse_args()
    if args.nprocs < 2:
        p.error("ZeroRedundancyOptimizer over DDP needs --nprocs >= 2")
    mp.spawn(worker, args=(args, free_port()), nprocs=args.nprocs, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
