"""The Python Accelerate's half of the side-by-side (bench/accelerate_side_by_side.sh).

    python accelerate_parity.py make --dir D [--widths 32,64,10 --samples 512 --batch_size 16 --lr 0.05]
        writes the initial weights and the data both sides train from (raw
        little-endian files, described by D/meta.json)
    torchrun --nproc_per_node 2 accelerate_parity.py train --dir D [--optimizer sgd|adam
        --accumulation K --clip MAX_NORM --precision fp32|bf16 --strategy ddp|fsdp --device cpu|cuda]
        trains with Accelerator and writes D/final_accelerate/param_<i>.f32; prints
        RESULT side=accelerate global_samples_per_s=X steps=N
    python accelerate_parity.py compare --dir D --tolerance T
        max |accel - accelerate| over all parameters; exit 1 above T
    python accelerate_parity.py sampler --samples N --world W --batch_size B [--shuffle --seed S --epoch E --drop_last]
        the indices Accelerate's prepared DataLoader gives each rank, as JSON
        (tests/torch/test_accelerate.cpp compares accel's loader with it); --reverse
        with a user sampler (the indices backwards), --batch_sampler: a user batch sampler, --passes K: K passes
        without set_epoch, as a list of passes; --iterable: the samples as an
        IterableDataset (Accelerate's IterableDatasetShard)
    torchrun --nproc_per_node N accelerate_parity.py surface --out F
        what Accelerate's calls give on N ranks (the scheduler's learning
        rates, gather_object, split_between_processes), as JSON in F
        (tests/torch/test_porting.cpp compares accel's with it)
"""
import argparse
import json
import os
import sys
import time

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pytorch_common import make_mlp  # noqa: E402  (the MLP of bench/bench_common.hpp)


def make(args):
    os.makedirs(args.dir, exist_ok=True)
    widths = [int(w) for w in args.widths.split(",")]
    torch.manual_seed(args.seed)
    model = make_mlp(widths)
    shapes = []
    for i, p in enumerate(model.parameters()):
        p.detach().numpy().astype("<f4").tofile(os.path.join(args.dir, f"init_{i}.f32"))
        shapes.append(list(p.shape))
    x = torch.randn(args.samples, widths[0])
    y = torch.randint(widths[-1], (args.samples,))
    x.numpy().astype("<f4").tofile(os.path.join(args.dir, "data_x.f32"))
    y.numpy().astype("<i8").tofile(os.path.join(args.dir, "data_y.i64"))
    meta = {"widths": widths, "param_shapes": shapes, "samples": args.samples,
            "batch_size": args.batch_size, "lr": args.lr}
    with open(os.path.join(args.dir, "meta.json"), "w") as f:
        json.dump(meta, f)
    return 0


def read_raw(path, shape, dtype):
    return torch.from_numpy(np.fromfile(path, dtype=dtype).reshape(shape).copy())


def train(args):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    with open(os.path.join(args.dir, "meta.json")) as f:
        meta = json.load(f)
    plugin = None
    if args.strategy == "fsdp":
        plugin = FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD", use_orig_params=True)
    accelerator = Accelerator(cpu=args.device == "cpu",
                              mixed_precision="no" if args.precision == "fp32" else args.precision,
                              gradient_accumulation_steps=args.accumulation, fsdp_plugin=plugin)
    model = make_mlp(meta["widths"])
    with torch.no_grad():
        for i, (p, shape) in enumerate(zip(model.parameters(), meta["param_shapes"])):
            p.copy_(read_raw(os.path.join(args.dir, f"init_{i}.f32"), shape, "<f4"))
    n = meta["samples"]
    x = read_raw(os.path.join(args.dir, "data_x.f32"), (n, meta["widths"][0]), "<f4")
    y = read_raw(os.path.join(args.dir, "data_y.i64"), (n,), "<i8")
    loader = DataLoader(TensorDataset(x, y), batch_size=meta["batch_size"])
    if args.strategy == "fsdp":  # FSDP wants the model prepared before the optimizer is made
        model = accelerator.prepare(model)
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=meta["lr"])
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=meta["lr"])
    if args.strategy == "fsdp":
        optimizer, loader = accelerator.prepare(optimizer, loader)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    steps, timed_samples, start = 0, 0, None
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for data, target in loader:
            if steps == 2:  # the first steps warm up allocators and connections
                accelerator.wait_for_everyone()
                start = time.perf_counter()
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    loss = F.cross_entropy(model(data), target)
                accelerator.backward(loss)
                if args.clip > 0 and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                optimizer.zero_grad()
            if steps >= 2:
                timed_samples += data.shape[0] * accelerator.num_processes
            steps += 1
    accelerator.wait_for_everyone()
    seconds = time.perf_counter() - start
    state = accelerator.get_state_dict(model)  # whole, also under FSDP
    if accelerator.is_main_process:
        out = os.path.join(args.dir, args.out)
        os.makedirs(out, exist_ok=True)
        for i, tensor in enumerate(state.values()):
            tensor.detach().float().cpu().numpy().astype("<f4").tofile(os.path.join(out, f"param_{i}.f32"))
        print(f"RESULT side=accelerate global_samples_per_s={timed_samples / seconds:.1f} steps={steps}", flush=True)
    accelerator.end_training()
    return 0


def compare(args):
    with open(os.path.join(args.dir, "meta.json")) as f:
        meta = json.load(f)
    worst = 0.0
    for i, _ in enumerate(meta["param_shapes"]):
        a = np.fromfile(os.path.join(args.dir, "final_accel", f"param_{i}.f32"), dtype="<f4")
        b = np.fromfile(os.path.join(args.dir, "final_accelerate", f"param_{i}.f32"), dtype="<f4")
        if a.shape != b.shape:
            print(f"parameter {i}: {a.size} values from accel, {b.size} from accelerate")
            return 1
        worst = max(worst, float(np.abs(a - b).max()))
    moved = max(float(np.abs(np.fromfile(os.path.join(args.dir, "final_accelerate", f"param_{i}.f32"), dtype="<f4")
                              - np.fromfile(os.path.join(args.dir, f"init_{i}.f32"), dtype="<f4")).max())
                for i, _ in enumerate(meta["param_shapes"]))
    verdict = "within" if worst <= args.tolerance else "ABOVE"
    print(f"PARITY max_abs_diff={worst:.3g} {verdict} tolerance={args.tolerance:g} (weights moved up to {moved:.3g})")
    return 0 if worst <= args.tolerance else 1


class ReverseSampler(torch.utils.data.Sampler):
    """A user's sampler: the samples backwards."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


class CyclingBatchSampler:
    """A user's batch sampler: the samples in order, in batches of 3, 1, 4, 1, 5, 3, 1, ... samples."""

    sizes = (3, 1, 4, 1, 5)

    def __init__(self, n, drop_last=False):
        self.n = n
        self.drop_last = drop_last  # BatchSamplerShard reads it: under it the last incomplete round is dropped

    def __iter__(self):
        start, k = 0, 0
        while start < self.n:
            size = self.sizes[k % len(self.sizes)]
            yield list(range(start, min(start + size, self.n)))
            start, k = start + size, k + 1

    def __len__(self):
        return sum(1 for _ in iter(self))


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset: the samples 0..n-1 as a stream."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter((torch.tensor(i),) for i in range(self.n))


def sampler(args):
    """Accelerate's own sharding of a prepared DataLoader, rank by rank."""
    from accelerate.data_loader import prepare_data_loader

    per_rank = []
    for rank in range(args.world):
        dataset = TensorDataset(torch.arange(args.samples))
        if args.iterable:
            loader = DataLoader(Stream(args.samples), batch_size=args.batch_size, drop_last=args.drop_last)
        elif args.batch_sampler:
            loader = DataLoader(dataset, batch_sampler=CyclingBatchSampler(args.samples, args.drop_last))
        elif args.reverse:
            loader = DataLoader(dataset, batch_size=args.batch_size, sampler=ReverseSampler(args.samples),
                                drop_last=args.drop_last)
        else:
            loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=args.shuffle, drop_last=args.drop_last)
        prepared = prepare_data_loader(loader, num_processes=args.world, process_index=rank, put_on_device=False,
                                       use_seedable_sampler=args.shuffle, data_seed=args.seed,
                                       split_batches=args.split_batches, even_batches=not args.uneven)
        if args.passes:  # Accelerate's own epoch count: no set_epoch
            per_rank.append([[int(i) for (batch,) in prepared for i in batch] for _ in range(args.passes)])
            continue
        prepared.set_epoch(args.epoch)
        if args.batch_sampler:  # the batches themselves: their sizes are the sampler's
            per_rank.append([[int(i) for i in batch] for (batch,) in prepared])
            continue
        per_rank.append([int(i) for (batch,) in prepared for i in batch])
    print(json.dumps(per_rank))
    return 0


def surface(args):
    """Accelerate's results on this job's ranks, written by rank 0."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    n, rank = accelerator.num_processes, accelerator.process_index
    out = {"num_processes": n}
    # The scheduler: StepLR(2, 0.5) from lr 0.1, 5 optimizer steps, with and without step_scheduler_with_optimizer.
    for with_optimizer in (True, False):
        acc = Accelerator(cpu=True, step_scheduler_with_optimizer=with_optimizer)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
        lrs = []
        for _ in range(5):
            acc.backward(model(torch.ones(1, 2)).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            lrs.append(optimizer.param_groups[0]["lr"])
        out["lr_with_optimizer" if with_optimizer else "lr_without_optimizer"] = lrs
    from accelerate.utils import gather_object
    out["gather_object_lists"] = gather_object([rank] * (rank + 1))
    splits = {}
    for length in (0, 1, 2, 5, 7):
        for padding in ((False,) if length == 0 else (False, True)):  # Accelerate cannot pad an empty list
            items = list(range(length))
            with accelerator.split_between_processes(items, apply_padding=padding) as mine:
                listed = list(mine)
            if length > 0:
                with accelerator.split_between_processes(torch.arange(length), apply_padding=padding) as mine:
                    tensor = [int(v) for v in mine]
            else:
                tensor = []
            with accelerator.split_between_processes({"a": items, "b": [10 * i for i in items]},
                                                     apply_padding=padding) as mine:
                mapping = {k: list(v) for k, v in mine.items()}
            splits[f"{length}{'_padded' if padding else ''}"] = gather_object(
                [{"rank": rank, "list": listed, "tensor": tensor, "map": mapping}])
    out["split_between_processes"] = splits
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    accelerator.wait_for_everyone()
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make")
    p.add_argument("--dir", required=True)
    p.add_argument("--widths", default="32,64,64,10")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("train")
    p.add_argument("--dir", required=True)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--out", default="final_accelerate")
    p = sub.add_parser("compare")
    p.add_argument("--dir", required=True)
    p.add_argument("--tolerance", type=float, required=True)
    p = sub.add_parser("sampler")
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--batch_size", type=int, required=True)
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--drop_last", action="store_true")
    p.add_argument("--uneven", action="store_true", help="even_batches=False")
    p.add_argument("--split_batches", action="store_true", help="--batch_size is the global batch")
    p.add_argument("--reverse", action="store_true", help="a user sampler: the samples backwards")
    p.add_argument("--passes", type=int, default=0, help="passes without set_epoch (a list of passes per rank)")
    p.add_argument("--iterable", action="store_true", help="the samples as an IterableDataset")
    p.add_argument("--batch_sampler", action="store_true",
                   help="a user batch sampler of batches of 3, 1, 4, 1, 5 samples (a list of batches per rank)")
    p = sub.add_parser("surface")
    p.add_argument("--out", required=True)
    args = parser.parse_args()
    return {"make": make, "train": train, "compare": compare, "sampler": sampler,
            "surface": surface}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
