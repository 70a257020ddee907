"""Command-line sections shared by the compile-test scripts."""
import argparse
import sys


def parse(argv, markers):
    """Sections introduced by markers; values may start with '-' (compiler flags)."""
    sections, current = {m: [] for m in markers}, None
    for arg in argv:
        if arg in markers:
            current = arg
        elif current is None:
            sys.exit(f'unexpected argument {arg!r}')
        else:
            sections[current].append(arg)
    return argparse.Namespace(**{m.lstrip('-'): v for m, v in sections.items()})
