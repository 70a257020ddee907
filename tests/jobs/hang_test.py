#!/usr/bin/env python3
"""`accel launch` and the flight recorder (NOTE [Flight recorder]): when a job
hangs past --timeout, or a rank dies, the launcher asks the ranks still
running for their records and prints which rank waits in which collective
and which never entered it.

1. The MLP example on 2 ranks; rank 1 is stopped (SIGSTOP: alive, silent)
   mid-training, so rank 0 waits in an all-reduce until --timeout ends the
   job: the summary must show rank 0 waiting in a collective (a training
   all-reduce, or an evaluation all-gather) and no record from rank 1 (a
   stopped process cannot answer).
2. Rank 1 is SIGKILLed instead: rank 0's collective fails, it writes its own
   record, and the summary shows rank 0 failed in it.
3. No screen where no collective failed: rank 0 ends with a handled error
   after training (its weights cannot be written) and exits 1 cleanly; the
   launcher reports that rank's last stderr lines and no flight-recorder
   summary, which would only show the finished job's stale records."""
import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from launched import wait_for_ranks

parser = argparse.ArgumentParser()
parser.add_argument("--accel", required=True)
parser.add_argument("--mlp", required=True)
args = parser.parse_args()


class Job:
    """`accel launch` of the MLP on 2 ranks, both outputs read as they come:
    `training` is set once rank 0 says it trains (its process group is up,
    the model prepared), which a fixed sleep after the ranks start cannot
    promise on a machine whose LibTorch loads slowly."""

    def __init__(self, timeout):
        command = [args.accel, "launch", "--num_processes", "2", "--timeout", str(timeout), args.mlp,
                   "--epochs", "1000", "--samples", "8192", "--hidden", "256"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.training = threading.Event()
        self.err = []
        self.readers = [threading.Thread(target=self.read_out), threading.Thread(target=self.read_err)]
        for reader in self.readers:
            reader.start()

    def read_out(self):
        for line in self.process.stdout:
            if "training on" in line:
                self.training.set()

    def read_err(self):
        self.err.extend(self.process.stderr)

    def finish(self, seconds):
        self.process.wait(timeout=seconds)
        for reader in self.readers:
            reader.join()
        return self.process.returncode, "".join(self.err)


failures = []
for name, sig, timeout, must in [
    # Training all-reduces or evaluation all-gathers: the moment decides which.
    ("stopped", signal.SIGSTOP, 20, ["flight recorder", "group world: newest collective #", "rank 0: waiting in ",
                                     "no record from rank 1"]),
    ("killed", signal.SIGKILL, 60, ["flight recorder", "rank 0: failed in ", "no record from rank 1"]),
]:
    job = Job(timeout)
    ranks = wait_for_ranks(job.process)
    if not ranks or not job.training.wait(60):
        job.process.kill()
        sys.exit(f"{name}: the ranks did not start training within a minute:\n{''.join(job.err)}")
    time.sleep(2)  # some steps into training

    os.kill(ranks[1], sig)
    returncode, err = job.finish(120)
    missing = [m for m in must if m not in err]
    print(f"{name}: exit {returncode}, {'all expected lines' if not missing else 'missing ' + str(missing)}")
    if missing or returncode == 0:
        failures.append(f"{name}: exit {returncode}, missing {missing}:\n{err}")
    else:
        print(err[err.find("accel launch: the ranks' last collectives"):])

clean = subprocess.run([args.accel, "launch", "--num_processes", "2", "--timeout", "120", args.mlp, "--epochs", "1",
                        "--samples", "512", "--save_weights", "/nonexistent/accel/weights.pt"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=180)
report = clean.stderr[clean.stderr.find("accel launch: rank "):]
must = ["exited with status 1", "its last lines on stderr", "[rank 0] mlp: "]  # the message, not its backtrace
missing = [m for m in must if m not in report]
unexpected = "flight recorder" in clean.stderr
print(f"handled error: exit {clean.returncode}, {'all expected lines' if not missing else 'missing ' + str(missing)}, "
      f"{'a flight-recorder screen' if unexpected else 'no flight-recorder screen'}")
if clean.returncode == 0 or missing or unexpected:
    failures.append(f"handled error: exit {clean.returncode}, missing {missing}, screen {unexpected}:\n{clean.stderr}")

if failures:
    print("\n".join(failures))
    sys.exit(1)
