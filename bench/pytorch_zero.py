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
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytorch_common as common  # noqa: E402  (sets one thread per process before torch loads)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


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
    world = args.nprocs
    common.init_rank(rank, world, port)
    torch.manual_seed(0)
    model = common.make_mlp()
    model = DDP(model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=bool(args.gradient_as_bucket_view))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    batches = common.make_batches(args.batch, rank)

    # optimizer.step() is the local Adam step on this rank's partition, then the parameter broadcasts.
    timings = common.train_timed(model, optimizer, batches, args.warmup, args.steps, distributed=True)

    # zero_grad() in 1.13 leaves the .grad tensors in place (set_to_none=False):
    # what the rank holds between steps, as accel measures it.
    param_bytes, grad_bytes, optim_bytes = model_state_bytes(model.module, optimizer)
    bucket_bytes = 0 if args.gradient_as_bucket_view else param_bytes
    mine = torch.tensor([param_bytes, grad_bytes, optim_bytes], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)

    # One write per line: both ranks share the pipe, and print() may split a line.
    sys.stdout.write(common.phase_line(rank, timings, args.steps, "optimizer(step+broadcast)") + "\n" +
                     f"[process {rank}] model state bytes: parameters {param_bytes} gradients {grad_bytes} "
                     f"optimizer_state {optim_bytes} total {param_bytes + grad_bytes + optim_bytes} "
                     f"(ddp_bucket_bytes {bucket_bytes}; local optimizer holds {len(optimizer.optim.state)} of "
                     f"{len(list(model.parameters()))} parameter tensors)\n")
    sys.stdout.flush()
    dist.barrier()
    if rank == 0:
        optim_max = int(max(e[2].item() for e in every))
        print(common.result_line(args, world, timings) +
              f" step_ms={1e3 * timings.slowest / args.steps:.2f} "
              f"param_bytes={param_bytes} grad_bytes={grad_bytes} optim_bytes={optim_bytes} "
              f"optim_bytes_max={optim_max} ddp_bucket_bytes={bucket_bytes}", flush=True)
    common.exit_now()


def main():
    p = common.arg_parser(__doc__)
    p.add_argument("--gradient_as_bucket_view", type=int, default=0)
    p.add_argument("--tag", default="pytorch_zero1")
    args = p.parse_args()
    if args.nprocs < 2:
        p.error("ZeroRedundancyOptimizer over DDP needs --nprocs >= 2")
    return common.spawn_ranks(worker, args)


if __name__ == "__main__":
    sys.exit(main())
