#!/usr/bin/env python3
"""accel::bench's Google Benchmark integration, end to end: 2 ranks under
`accel launch`, Google Benchmark's own JSON output read back. Each strategy's
counted bytes per step equal its formula and the hand-worked figure; only
the main process reports; random interleaving, which would desynchronise
the ranks, is refused with a sentence.

    check_google_benchmark.py ACCEL_EXE STRATEGIES_GBENCH
"""
import json
import os
import subprocess
import sys
import tempfile

accel, program = sys.argv[1], sys.argv[2]
# MLP 16-32-10: 16*32 + 32 + 32*10 + 10 = 874 fp32 parameters, even, so no padding on 2 ranks.
P = 874 * 4
expected = {
    "accel/DDP": {"all_reduce": P},
    "accel/ZeRO-1": {"all_reduce": P, "all_gather": P},
    "accel/ZeRO-2": {"reduce_scatter": P, "all_gather": P},
    "accel/ZeRO-3": {"all_gather": 2 * P, "reduce_scatter": P},
}
kinds = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send", "recv"]
env = dict(os.environ, OMP_NUM_THREADS="1")
launch = [accel, "launch", "--num_processes", "2", "--timeout", "240", program,
          "--widths", "16,32,10", "--batch", "8", "--steps", "4"]

failures = []
with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "out.json")
    run = subprocess.run(launch + ["--benchmark_out=" + out, "--benchmark_out_format=json"],
                         capture_output=True, text=True, env=env, timeout=280)
    if run.returncode != 0:
        sys.exit(f"strategies_gbench failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
    report = json.load(open(out))
    # Google Benchmark appends the fixed settings: accel/DDP/iterations:4/real_time.
    runs = {b["name"].split("/iterations")[0]: b for b in report["benchmarks"]}
    for name, want in expected.items():
        if name not in runs:
            failures.append(f"{name}: missing from Google Benchmark's JSON (has {sorted(runs)})")
            continue
        b = runs[name]
        if b.get("error_occurred"):
            failures.append(f"{name}: {b.get('error_message')}")
            continue
        if b["iterations"] != 4:
            failures.append(f"{name}: {b['iterations']} iterations, not the 4 asked for")
        for kind in kinds:
            measured = b.get(kind + "_bytes", 0)
            formula = b.get("predicted_" + kind + "_bytes", 0)
            if measured != want.get(kind, 0) or formula != want.get(kind, 0):
                failures.append(f"{name}: {kind} measured {measured}, formula {formula}, expected {want.get(kind, 0)}")
        for counter in ["samples/s", "model_state_bytes", "peak_memory_bytes", "blocked_ms"]:
            if counter not in b:
                failures.append(f"{name}: no counter {counter}")
        print(f"{name}: " + ", ".join(f"{k} {b.get(k + '_bytes', 0):.0f}" for k in kinds if b.get(k + "_bytes")))
    # Rank 0 alone reports: rank 1's lines carry no benchmark rows.
    if any(line.startswith("[rank 1]") and "accel/" in line for line in run.stdout.splitlines()):
        failures.append("rank 1 printed benchmark rows:\n" + run.stdout)
    if sum("accel/DDP" in line for line in run.stdout.splitlines()) != 1:
        failures.append("the console table should list accel/DDP once:\n" + run.stdout)

refused = subprocess.run(launch + ["--benchmark_enable_random_interleaving=true"], capture_output=True, text=True,
                         env=env, timeout=280)
text = refused.stdout + refused.stderr
if refused.returncode == 0 or "random_interleaving" not in text or "repetitions" not in text:
    failures.append(f"random interleaving across ranks was not refused with a sentence ({refused.returncode}):\n{text}")

if failures:
    sys.exit("FAILED:\n" + "\n".join(failures))
print("google benchmark integration: ok")
