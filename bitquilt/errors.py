"""Errors the user can fix: the command lines print them as one line, without a traceback (`run_command`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class UserError(Exception):
    pass


# What the CLI and the bench scripts report as one line instead of a traceback: UserError, plus the
# ValueError / FileNotFoundError that solvers, formats and loaders raise for input they reject.
USER_ERRORS = (UserError, ValueError, FileNotFoundError)


_command_line = False  # set by `run_command`: messages then name command-line flags, not the Python API's keywords
_at_end: list[Callable[[], None]] = []  # what `run_command` runs when its command ends, however it ends


def at_command_end(fn: Callable[[], None]) -> None:
    """Have `fn` run when a command (`run_command`) ends: e.g. drop the outputs it claimed but did not write."""
    if fn not in _at_end:
        _at_end.append(fn)


def option(flag: str, keyword: str) -> str:
    """How a message names an option: `flag` (e.g. "--overwrite") under a command line, else the Python API's
    `keyword` (e.g. "overwrite=True")."""
    return flag if _command_line else keyword


def _file_errors() -> tuple[type[Exception], ...]:
    """A failed read or write: OSError, and a damaged safetensors file where safetensors is installed (an install
    with the standalone runtime alone has none)."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return (OSError,)
    return (OSError, SafetensorError)


def run_command(prog: str, work: Callable[[], int], debug: bool = False) -> int:
    """A command line's exit status for `work()`: its user errors one line on stderr (2); a failed read or write (a
    full disk, a file too large, a damaged safetensors file) one line (1); Ctrl-C "interrupted" (130); a reader
    that went away (`... | head`) nothing, as cat does (141, the shell's status for SIGPIPE). `debug` re-raises
    errors with their traceback."""
    global _command_line
    _command_line = True
    try:
        return work()
    except (*USER_ERRORS, *_file_errors()) as e:
        if isinstance(e, BrokenPipeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
            return 141
        if debug:
            raise
        if isinstance(e, USER_ERRORS):
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        print(f"{prog}: error: reading or writing a file failed (a full disk? a size limit?): {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        _command_line = False
        for fn in _at_end:
            fn()
