"""The Python Accelerate side of resuming its save_state in C++ (tests/torch/test_checkpoint.cpp, suite
accelerate_resume). Run on 2 CPU processes under torch.distributed.run:

  accelerate_resume.py DIR   trains the test MLP (tiny_mlp's layers: Linear 8-16, Tanh, Linear 16-16, Tanh,
                             Linear 16-4) under Accelerate's DDP with Adam and StepLR for STEPS_BEFORE steps,
                             save_state(DIR/state), then STEPS_AFTER steps more: the final weights go to
                             DIR/python_final.safetensors, every step's global batch to DIR/data.safetensors
                             (each rank trains on its half, as the C++ run continued from DIR/state does).
"""
import sys

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

STEPS_BEFORE, STEPS_AFTER, GLOBAL_BATCH = 3, 3, 8


def main():
    out = sys.argv[1]
    accelerator = Accelerator(cpu=True)
    generator = torch.Generator().manual_seed(5)
    steps = STEPS_BEFORE + STEPS_AFTER
    x = torch.randn(steps, GLOBAL_BATCH, 8, generator=generator)
    y = torch.randint(0, 4, (steps, GLOBAL_BATCH), generator=generator)
    if accelerator.is_main_process:
        save_file({"x": x, "y": y}, f"{out}/data.safetensors")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    per_rank = GLOBAL_BATCH // accelerator.num_processes
    mine = slice(accelerator.process_index * per_rank, (accelerator.process_index + 1) * per_rank)
    for step in range(steps):
        if step == STEPS_BEFORE:
            accelerator.save_state(f"{out}/state")
        loss = torch.nn.functional.cross_entropy(model(x[step, mine]), y[step, mine])
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = accelerator.unwrap_model(model).state_dict()
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, f"{out}/python_final.safetensors")
    accelerator.end_training()


if __name__ == "__main__":
    main()
