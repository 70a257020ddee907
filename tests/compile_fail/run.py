#!/usr/bin/env python3
"""Compile-fail tests: every snippet with an `// expect-error: REGEX` line must
fail to compile with a diagnostic matching REGEX; every `// expect-pass`
snippet (the twins) must compile, so a broken harness cannot pass. Each failing
snippet names its passing twin (`// twin: FILE`), and each twin calls
accel_test::exercise (exercise.hpp): the members a program uses, not only the type."""
import concurrent.futures, os, pathlib, re, subprocess, sys

from sections import parse

args = parse(sys.argv[1:], ('--compiler', '--flags', '--snippets'))

def check(snippet):
    """(name, ok, detail) for one snippet."""
    text = snippet.read_text()
    expect = re.search(r'^// expect-error: (.+)$', text, re.M)
    expect_pass = re.search(r'^// expect-pass$', text, re.M)
    if not expect and not expect_pass:
        return snippet.name, False, 'has neither "// expect-error:" nor "// expect-pass"'
    if expect:
        twin = re.search(r'^// twin: (\S+)$', text, re.M)
        if not twin:
            return snippet.name, False, 'names no passing twin ("// twin: FILE")'
        twin_path = snippet.parent / twin.group(1)
        if not twin_path.is_file() or not re.search(r'^// expect-pass$', twin_path.read_text(), re.M):
            return snippet.name, False, f'its twin {twin.group(1)} is missing or not an "// expect-pass" snippet'
    if expect_pass and 'accel_test::exercise' not in text:
        return snippet.name, False, 'a twin must call accel_test::exercise or exercise_training (exercise.hpp)'
    result = subprocess.run(args.compiler + args.flags + [str(snippet)], capture_output=True, text=True)
    if expect_pass:
        return snippet.name, result.returncode == 0, result.stderr[-2000:]
    ok = result.returncode != 0 and re.search(expect.group(1), result.stderr) is not None
    return snippet.name, ok, f'expected an error matching {expect.group(1)!r}, got exit {result.returncode}:\n{result.stderr[-2000:]}'

snippets = sorted(pathlib.Path(args.snippets[0]).glob('*.cpp'))
failures = []
with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    for name, ok, detail in pool.map(check, snippets):
        print(f'{"ok  " if ok else "FAIL"} {name}')
        if not ok:
            failures.append(f'{name}: {detail}')
checked = len(snippets)

for f in failures:
    print(f, file=sys.stderr)
print(f'{checked - len(failures)} passed, {len(failures)} failed')
sys.exit(1 if failures or checked == 0 else 0)
