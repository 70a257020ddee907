"""The ranks `accel launch` started, seen from outside (for the job tests)."""
import time


def children(pid):
    """The launcher's child processes: its ranks."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def wait_for_ranks(job, count=2, avoid=(), seconds=60):
    """The `count` ranks of the running job `job` (a Popen of accel launch)
    that are not in `avoid`, once all run; [] if the job ends first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and job.poll() is None:
        ranks = [p for p in children(job.pid) if p not in avoid]
        if len(ranks) == count:
            return ranks
        time.sleep(0.02)
    return []
