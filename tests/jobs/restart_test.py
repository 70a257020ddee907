#!/usr/bin/env python3
"""`accel launch --max_restarts`: a job that loses ranks finishes anyway, on
the weights an uninterrupted run reaches, bitwise.

The MLP example trains on 2 ranks with a checkpoint every few steps. Each
interrupted run SIGKILLs a random rank at a random moment (twice: the second
kill lands in the restarted job), the launcher restarts the whole job, and the
example resumes from its newest complete checkpoint (Trainer::load_latest_state;
a kill in the middle of a save leaves an incomplete one, which is passed over).
The final weights must equal the uninterrupted run's byte for byte. Then:
with restarts exhausted, the launcher fails naming the rank."""
import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from launched import children, wait_for_ranks

parser = argparse.ArgumentParser()
parser.add_argument("--accel", required=True)
parser.add_argument("--mlp", required=True)
parser.add_argument("--runs", type=int, default=3)
parser.add_argument("--seed", type=int, default=None)
args = parser.parse_args()
seed = args.seed if args.seed is not None else random.randrange(1 << 30)
rng = random.Random(seed)
print(f"seed {seed} (--seed {seed} repeats these kill times)")
TRAINING = ["--epochs", "4", "--samples", "8192", "--hidden", "512", "--checkpoint_every", "5"]


def launch(project, restarts):
    command = [args.accel, "launch", "--num_processes", "2", "--max_restarts", str(restarts), "--timeout", "120",
               args.mlp, *TRAINING, "--project_dir", project, "--save_weights", os.path.join(project, "final.pt")]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def resumed_steps(out):
    """The step counts the restarted jobs resumed at ("resumed from ... after N steps")."""
    return [int(line.split(" after ")[1].split()[0]) for line in out.splitlines() if "resumed from" in line]


def check_run(name, job, kills, want, project):
    """Appends to `failures` what is wrong with a finished interrupted run; returns the steps it resumed at."""
    out, err = job.communicate()
    restarts = err.count("restarting the job")
    # A kill can land on a rank that has just finished (exited, not yet reaped): it changes nothing and the
    # launcher rightly sees a clean exit. Count the kills the launcher saw; at least one must have landed.
    landed = err.count("was killed by signal 9")
    resumed = resumed_steps(out)
    print(f"{name}: killed rank(s) {kills} ({landed} landed), {restarts} restart(s), resumed after {resumed} steps, "
          f"exit {job.returncode}")
    if job.returncode != 0:
        failures.append(f"{name}: exit {job.returncode}:\n{err}")
    elif restarts != landed or (kills and not landed) or landed > len(kills):
        failures.append(f"{name}: {len(kills)} kill(s), {landed} seen by the launcher, {restarts} restart(s):\n{err}")
    elif any(n <= 0 or n % 5 for n in resumed):
        failures.append(f"{name}: resumed at {resumed}, not at checkpoints (every 5 steps)")
    elif read(os.path.join(project, "final.pt")) != want:
        failures.append(f"{name}: the final weights differ from the uninterrupted run's")
    return resumed


failures = []
with tempfile.TemporaryDirectory() as tmp:
    reference = os.path.join(tmp, "reference")
    start = time.monotonic()
    job = launch(reference, 0)
    _, err = job.communicate()
    duration = time.monotonic() - start
    if job.returncode != 0:
        sys.exit(f"the uninterrupted run failed ({job.returncode}):\n{err}")
    want = read(os.path.join(reference, "final.pt"))
    print(f"uninterrupted run: {duration:.1f} s")

    resumed = []
    for run in range(args.runs):
        project = os.path.join(tmp, f"run{run}")
        job = launch(project, 3)
        killed, kills = set(), []
        for _ in range(2):
            ranks = wait_for_ranks(job, avoid=killed)
            if not ranks:
                break
            time.sleep(rng.uniform(0.5, 0.5 + 0.6 * duration))  # from start-up to late in training
            victim = rng.randrange(2)
            if job.poll() is not None or ranks[victim] not in children(job.pid):
                break  # finished (or restarting) before the kill
            try:
                os.kill(ranks[victim], signal.SIGKILL)
            except ProcessLookupError:
                break  # it exited between the look and the kill: the end of training (seen once)
            killed.update(ranks)
            kills.append(victim)
        resumed += check_run(f"run {run}", job, kills, want, project)
    if not resumed:  # the kills are random; the run below resumes from a checkpoint by construction
        print("no random run resumed from a checkpoint this time (the after_checkpoint run checks that)")

    # Killed once a checkpoint is complete, rank 0 (which hosts the store)
    # first: the restarted job must resume from it, not start again.
    project = os.path.join(tmp, "after_checkpoint")
    job = launch(project, 3)
    ranks = wait_for_ranks(job)
    first = os.path.join(project, "checkpoints", "checkpoint_0", "manifest.json")
    while job.poll() is None and not os.path.exists(first):
        time.sleep(0.01)
    os.kill(ranks[0], signal.SIGKILL)
    if not check_run("after a checkpoint", job, [0], want, project):
        failures.append("after a checkpoint: the restarted job did not resume from it")

    # No restarts left: the second kill ends the job, naming the rank.
    project = os.path.join(tmp, "exhausted")
    job = launch(project, 1)
    killed = set()
    for _ in range(2):
        ranks = wait_for_ranks(job, avoid=killed)
        if not ranks:
            failures.append("exhausted: the job ended before the kills")
            break
        time.sleep(0.3)
        os.kill(ranks[1], signal.SIGKILL)
        killed.update(ranks)
    _, err = job.communicate()
    if job.returncode == 0 or "no restarts left (--max_restarts 1)" not in err or "rank 1" not in err:
        failures.append(f"exhausted: exit {job.returncode}, expected a failure naming rank 1:\n{err}")

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("every interrupted run finished with the uninterrupted run's weights")
