"""Which collectives this PyTorch's Gloo backend runs, on 2 CPU processes.

    python3 bench/gloo_capabilities.py            # Debian's python3-torch (1.13)
    ~/.cache/accel/torch-2.15.0/bin/python bench/gloo_capabilities.py   # the PyPI wheel (2.x)

Prints one Markdown table row per collective and dtype: "works" when the
result equals the reference, else the first line of the error. accel's
compat/ header turns these facts into which path the engines take; the
README's table is this script's output.
"""
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def probes(rank):
    """(name, dtype, function returning True when the result is right)."""
    n = WORLD

    def reduce_scatter_tensor(dtype, group):
        inp = torch.arange(2 * n, dtype=dtype) + rank
        out = torch.empty(2, dtype=dtype)
        dist.reduce_scatter_tensor(out, inp, group=group)
        full = sum(torch.arange(2 * n, dtype=torch.float64) + r for r in range(n))
        return torch.equal(out.double(), full[2 * rank:2 * rank + 2])

    def reduce_scatter_list(dtype, group):
        inp = [torch.full((2,), float(rank + j), dtype=dtype) for j in range(n)]
        out = torch.empty(2, dtype=dtype)
        dist.reduce_scatter(out, inp, group=group)
        return torch.equal(out.double(), torch.full((2,), float(sum(r + rank for r in range(n))), dtype=torch.float64))

    def all_gather_into_tensor(dtype, group):
        out = torch.empty(2 * n, dtype=dtype)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank), dtype=dtype), group=group)
        return torch.equal(out.double(), torch.arange(n, dtype=torch.float64).repeat_interleave(2))

    def all_reduce_sum(dtype, group):
        t = torch.full((3,), float(rank + 1), dtype=dtype)
        dist.all_reduce(t, group=group)
        return torch.equal(t.double(), torch.full((3,), float(n * (n + 1) // 2), dtype=torch.float64))

    def all_reduce_avg(dtype, group):
        t = torch.full((3,), float(2 * rank), dtype=dtype)
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
        return torch.equal(t.double(), torch.full((3,), float(n - 1), dtype=torch.float64))

    def all_to_all_single(dtype, group):
        out = torch.empty(n, dtype=dtype)
        dist.all_to_all_single(out, torch.full((n,), float(rank), dtype=dtype), group=group)
        return torch.equal(out.double(), torch.arange(n, dtype=torch.float64))

    rows = []
    for fn in (all_reduce_sum, all_reduce_avg, reduce_scatter_tensor, reduce_scatter_list,
               all_gather_into_tensor, all_to_all_single):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            rows.append((fn.__name__, dtype, lambda group, fn=fn, dtype=dtype: fn(dtype, group)))
    return rows


def worker(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = []
    for name, dtype, run in probes(rank):
        # A fresh group per probe: a failed collective may leave its group unusable.
        group = dist.new_group(backend="gloo")
        try:
            verdict = "works" if run(group) else "wrong result"
        except Exception as e:  # noqa: BLE001 - the error text is the finding
            verdict = str(e).strip().splitlines()[0][:90]
        results.append((name, str(dtype).replace("torch.", ""), verdict))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = queue.get()
    for p in procs:
        p.join(60)
    print(f"| collective (torch {torch.__version__}, gloo, {WORLD} ranks) | dtype | result |")
    print("| --- | --- | --- |")
    for name, dtype, verdict in results:
        print(f"| {name} | {dtype} | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
