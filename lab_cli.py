"""What every script of the lab does with its command line: one-line refusals, numbers checked as they are read.

A mistake on the command line is one line naming the flag, exit status 2, no
usage dump and no traceback (argparse's own status for usage errors).
"""
from __future__ import annotations

import argparse
import sys


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser` refuse with "error: ... (see --help)" on one line, exit status 2."""
    def error(message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

    parser.error = error
    return parser


def at_least(low: int | float, kind=int):
    """An argparse type: a number of `kind` that is at least `low` ("at least 1, got 0")."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: '{text}'") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse
