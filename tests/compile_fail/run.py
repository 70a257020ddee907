#!/usr/bin/env python3
"""Compile-fail tests: every snippet with an `// expect-error: REGEX` line must
fail to compile with a diagnostic matching REGEX; every `// expect-pass`
snippet (the twins) must compile, so a broken harness cannot pass. Each failing
snippet names its passing twin (`// twin: FILE`), and each twin calls
accel_test::exercise (exercise.hpp): the members a program uses, not only the type.

The LibTorch headers of torch_headers.hpp are precompiled once and included
first in every snippet (they hold no accel header, so what a snippet includes
of accel is still what it tests). `--only NAME...` checks those snippets and
their twins alone: a second build against another LibTorch (tools/run.sh test)
repeats a sample, since the refusals live in the torch-free policy core."""
import concurrent.futures, os, pathlib, re, subprocess, sys, tempfile

from sections import parse

args = parse(sys.argv[1:], ('--compiler', '--flags', '--snippets', '--only'))

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
    result = subprocess.run(args.compiler + args.flags + pch_flags + [str(snippet)], capture_output=True, text=True)
    if expect_pass:
        return snippet.name, result.returncode == 0, result.stderr[-2000:]
    ok = result.returncode != 0 and re.search(expect.group(1), result.stderr) is not None
    return snippet.name, ok, f'expected an error matching {expect.group(1)!r}, got exit {result.returncode}:\n{result.stderr[-2000:]}'

def selected(folder, only):
    """Every snippet, or the named ones and their twins."""
    snippets = sorted(folder.glob('*.cpp'))
    if not only:
        return snippets
    names = set(only)
    for name in only:
        path = folder / name
        if not path.is_file():
            sys.exit(f'--only names {name}, which is not a snippet in {folder}')
        twin = re.search(r'^// twin: (\S+)$', path.read_text(), re.M)
        if twin:
            names.add(twin.group(1))
    return [s for s in snippets if s.name in names]


def precompile(folder, scratch):
    """Flags that include the precompiled LibTorch headers (built here with the snippets' flags)."""
    header = pathlib.Path(scratch) / 'torch_headers.hpp'
    header.write_text((folder / 'torch_headers.hpp').read_text())
    flags = [f for f in args.flags if f != '-fsyntax-only']
    compiler = args.compiler[1:] if os.path.basename(args.compiler[0]) == 'ccache' else args.compiler  # 440 MB: not for the cache
    built = subprocess.run(compiler + flags + ['-x', 'c++-header', str(header), '-o', f'{header}.gch'],
                           capture_output=True, text=True)
    if built.returncode != 0:
        sys.exit(f'precompiling torch_headers.hpp failed:\n{built.stderr[-3000:]}')
    return ['-Winvalid-pch', '-include', str(header)]


folder = pathlib.Path(args.snippets[0])
snippets = selected(folder, args.only)
scratch = tempfile.TemporaryDirectory(prefix='accel-compile-fail-')
pch_flags = precompile(folder, scratch.name)
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
