#!/usr/bin/env python3
"""Two machines made of Linux network namespaces joined by a veth pair, one
`accel launch --num_machines 2 --machine_rank i --main_process_ip 10.231.0.1`
in each, with no GLOO_SOCKET_IFNAME (this host's name may resolve to
127.0.0.1, as in most containers: NOTE [Which address a rank advertises]).

1. DDP across the two machines ends on the same weights, byte for byte, as
   the same 2 ranks on one machine.
2. The link cut mid-training: both sides fail within the collective timeout
   and the roll call, each naming the rank it cannot reach.
3. GLOO_SOCKET_IFNAME=lo on machine 1: refused at once, naming the loopback
   address, instead of a "Connection refused" on the other machine.
Exits 77 (skipped) where namespaces cannot be made (not root, no `ip netns`)."""
import argparse
import os
import subprocess
import sys
import tempfile
import time

parser = argparse.ArgumentParser()
parser.add_argument("--accel", required=True)
parser.add_argument("--mlp", required=True)
args = parser.parse_args()
accel, mlp = os.path.abspath(args.accel), os.path.abspath(args.mlp)

tag = str(os.getpid() % 100000)
spaces = [f"accel{tag}m0", f"accel{tag}m1"]
links = [f"ac{tag}a", f"ac{tag}b"]
addresses = ["10.231.0.1", "10.231.0.2"]


def ip(*words):
    return subprocess.run(["ip", *words], capture_output=True, text=True)


def make_machines():
    if os.geteuid() != 0:
        return "not root"
    made = ip("netns", "add", spaces[0])
    if made.returncode != 0:
        return f"ip netns add: {made.stderr.strip() or made.returncode}"
    steps = [("netns", "add", spaces[1]), ("link", "add", links[0], "type", "veth", "peer", "name", links[1])]
    for i in (0, 1):
        steps += [("link", "set", links[i], "netns", spaces[i]),
                  ("-n", spaces[i], "addr", "add", addresses[i] + "/24", "dev", links[i]),
                  ("-n", spaces[i], "link", "set", links[i], "up"),
                  ("-n", spaces[i], "link", "set", "lo", "up")]
    for step in steps:
        done = ip(*step)
        if done.returncode != 0:
            return f"ip {' '.join(step)}: {done.stderr.strip()}"
    return None


def remove_machines():
    for space in spaces:
        ip("netns", "del", space)


def launch_on(machine, port, program_args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update(env_extra or {})
    command = ["ip", "netns", "exec", spaces[machine], accel, "launch", "--num_machines", "2", "--num_processes", "2",
               "--machine_rank", str(machine), "--main_process_ip", addresses[0], "--main_process_port", str(port),
               "--timeout", "180", mlp, *program_args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


why = make_machines()
if why:
    remove_machines()
    print(f"SKIP: cannot make two machines from network namespaces here ({why})")
    sys.exit(77)

failures = []
try:
    with tempfile.TemporaryDirectory() as tmp:
        # Same file names: PyTorch's archive names its root folder after the file.
        os.makedirs(f"{tmp}/one")
        os.makedirs(f"{tmp}/two")
        training = ["--epochs", "2", "--samples", "2048", "--hidden", "64"]
        # 1. The reference: the same 2 ranks on one machine.
        one = subprocess.run([accel, "launch", "-q", "--num_processes", "2", mlp, *training, "--save_weights",
                              f"{tmp}/one/final.pt"], capture_output=True, text=True)
        if one.returncode != 0:
            sys.exit(f"the one-machine run failed:\n{one.stderr}")
        jobs = [launch_on(m, 29611, [*training, "--save_weights", f"{tmp}/two/final.pt"]) for m in (0, 1)]
        outputs = [job.communicate(timeout=200) for job in jobs]
        codes = [job.returncode for job in jobs]
        print(f"two machines: exit {codes}")
        if codes != [0, 0]:
            failures.append(f"two machines: exit {codes}:\n{outputs[0][1]}\n{outputs[1][1]}")
        elif open(f"{tmp}/two/final.pt", "rb").read() != open(f"{tmp}/one/final.pt", "rb").read():
            failures.append("two machines: the weights differ from the one-machine run's")

        # 2. The link cut mid-training (10 s collective timeout).
        jobs = [launch_on(m, 29612, ["--epochs", "100000", "--hidden", "64", "--collective_timeout", "10"])
                for m in (0, 1)]
        time.sleep(4)
        cut = time.monotonic()
        ip("-n", spaces[0], "link", "set", links[0], "down")
        outputs = [job.communicate(timeout=120)[1] for job in jobs]
        seconds = time.monotonic() - cut
        print(f"link cut: exit {[j.returncode for j in jobs]} after {seconds:.1f} s")
        for machine, other in ((0, 1), (1, 0)):
            if jobs[machine].returncode == 0 or f"rank {other} is gone" not in outputs[machine]:
                failures.append(f"link cut: machine {machine} did not name rank {other}:\n{outputs[machine]}")
        if seconds > 45:
            failures.append(f"link cut: the ranks took {seconds:.1f} s to fail (timeout 10 s)")
        ip("-n", spaces[0], "link", "set", links[0], "up")

        # 3. A loopback address advertised to another machine.
        jobs = [launch_on(0, 29613, training), launch_on(1, 29613, training, {"GLOO_SOCKET_IFNAME": "lo"})]
        err1 = jobs[1].communicate(timeout=120)[1]
        jobs[0].kill()
        jobs[0].communicate()
        print(f"loopback: machine 1 exit {jobs[1].returncode}")
        if jobs[1].returncode == 0 or "rank 1 would advertise the loopback address 127.0.0.1" not in err1:
            failures.append(f"loopback: machine 1 was not refused by name:\n{err1}")
finally:
    remove_machines()

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("two machines: equal weights; a cut link named on both sides; loopback refused")
