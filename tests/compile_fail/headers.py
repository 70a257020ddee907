#!/usr/bin/env python3
"""Header self-containment: each header, included alone first in a TU, compiles."""
import os, subprocess, sys, tempfile

from sections import parse

args = parse(sys.argv[1:], ('--compiler', '--flags', '--headers'))

failed = 0
for header in args.headers:
    with tempfile.NamedTemporaryFile('w', suffix='.cpp', delete=False) as tu:
        tu.write(f'#include "{os.path.abspath(header)}"\n#include "{os.path.abspath(header)}"\n')
    result = subprocess.run(args.compiler + args.flags + [tu.name], capture_output=True, text=True)
    os.unlink(tu.name)
    ok = result.returncode == 0
    failed += not ok
    print(f'{"ok  " if ok else "FAIL"} {header}')
    if not ok:
        print(result.stderr[-3000:], file=sys.stderr)
print(f'{len(args.headers) - failed} passed, {failed} failed')
sys.exit(1 if failed else 0)
